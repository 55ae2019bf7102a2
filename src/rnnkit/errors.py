"""rnnkit's error classes for arguments that do not fit a module: each is also the class
torch.nn raises for the same mistake, so code written for either catches it."""


class MismatchError(ValueError, RuntimeError):
    """An input, state or weight whose shape or device does not fit the module. A ValueError, as
    rnnkit reports bad arguments, and a RuntimeError, as torch.nn raises for the same mistake, so
    code written for torch.nn (``except RuntimeError``) catches it too."""


class DTypeMismatchError(TypeError, ValueError):
    """An input, state or weight whose dtype is not the weights'. A TypeError, as rnnkit reports
    a wrong dtype, and a ValueError, as torch.nn raises for the same mistake."""
