"""The suite's one tolerance helper lives in the package (rnnkit.testing), shared with the benchmark."""
from rnnkit.testing import TOLERANCE, assert_close, rel_rms

__all__ = ["TOLERANCE", "assert_close", "rel_rms"]
