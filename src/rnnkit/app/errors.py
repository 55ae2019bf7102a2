"""The command line's error type, shared by the applications it runs."""


class UserError(Exception):
    """A problem with what the user asked for or gave us; the message is one line, shown as is.

    ``rnnkit`` prints it as ``rnnkit: error: <message>`` and exits with status 1, leaving the
    files already saved untouched.
    """
