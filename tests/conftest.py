"""Suite-wide fixtures. Uninitialised memory is poisoned with NaN (fla's habit), so a kernel
that leaves padding or tails unwritten fails loudly instead of passing by luck."""
import os

# CI has no GPU: Triton kernels run under Triton's interpreter. It must be chosen before
# anything imports triton (keras imports torch._dynamo, which imports triton). Not when
# tests/test_triton.py is to run the compiled kernels on a GPU (RNNKIT_TEST_TRITON_DEVICE=cuda).
if os.environ.get("RNNKIT_TEST_TRITON_DEVICE") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rnnkit.testing import nan_poisoned_allocations as _nan_poisoned  # noqa: E402


@pytest.fixture(autouse=True)
def nan_poisoned_allocations():
    """Every torch.empty / empty_like / new_empty made from Python during a test is NaN-filled."""
    with _nan_poisoned():
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def poisoned_kernel_buffers():
    """Every buffer the fused kernels allocate (at::empty on the C++ side) is NaN-filled, for a
    test module's tests (``pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")``)."""
    from rnnkit.fused import build

    try:
        build.extension()
    except RuntimeError as error:
        pytest.fail(f"the fused CPU backend did not build: {error}")
    build.set_poison(True)
    yield
    build.set_poison(False)
