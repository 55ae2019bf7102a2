"""The command line's error type, shared by the applications it runs."""
import torch


class UserError(Exception):
    """A problem with what the user asked for or gave us; the message is one line, shown as is.

    ``rnnkit`` prints it as ``rnnkit: error: <message>`` and exits with status 1, leaving the
    files already saved untouched.
    """


def no_cuda() -> UserError:
    """--device cuda on a machine where torch sees no CUDA device (train, sample, eval and bench say the same)."""
    return UserError(f"--device cuda: torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
