"""The Triton backend: fused GPU passes for every variant torch's cuDNN ops don't compute (issue 6).

Plain configurations go to the "native" backend (cuDNN through torch). This one runs the
rest on CUDA tensors: peepholes, layer norm, zoneout, variational recurrent dropout, cell and
projection clipping, projection, coupled gates, GRU reset_after=False, every bias mode,
lengths and reverse. Per pass: W·x as one GEMM over all steps; per step one GEMM for R·h_in
(all gates) and one fused Triton kernel for everything pointwise; backward mirrors it, with
the weight gradients as one GEMM per matrix over all steps. float32, float64, and bfloat16 /
float16 inputs (state and accumulation in float32). On CUDA the per-step loop is replayed
from a CUDA graph captured once per shape (graphs.py; untested on hardware so far).

    >>> lstm = rnnkit.LSTM(8, 16, peephole=True, layer_norm=True, backend="triton").cuda()
    >>> y, (h_n, c_n) = lstm(torch.randn(5, 3, 8, device="cuda"))

Without a GPU, ``RNNKIT_TRITON_INTERPRET=1`` makes the backend accept CPU tensors and run
the whole path (launcher, autograd, kernels) under Triton's interpreter: it sets
``TRITON_INTERPRET=1`` before the kernels are defined, and must be set before the first
triton pass of the process. This is how the test suite checks the kernels in CI.
Importing rnnkit never imports triton; the kernels load on the first triton pass.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

import torch

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_KERNELS = __name__ + ".launcher"


def interpreting() -> bool:
    """Whether CPU tensors are accepted, to run under Triton's interpreter (RNNKIT_TRITON_INTERPRET=1).

    ``TRITON_INTERPRET=1`` alone is not enough: "auto" would then route every CPU call
    with options torch's ops lack to the (slow) interpreter.
    """
    return os.environ.get("RNNKIT_TRITON_INTERPRET") == "1"


def _kernels_interpreted() -> Optional[bool]:
    """Whether the loaded kernels run under the interpreter; None before they are loaded."""
    if _KERNELS not in sys.modules:
        return None
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules[__name__ + ".common"].sigmoid, InterpretedFunction)


class TritonBackend:
    """Fused Triton passes on CUDA tensors (CPU tensors under RNNKIT_TRITON_INTERPRET=1); differentiable."""

    name = "triton"

    def unavailable_reason(self) -> Optional[str]:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if interpreting():
            return None
        if not torch.cuda.is_available():
            return ("no CUDA device (torch.cuda.is_available() is False); set RNNKIT_TRITON_INTERPRET=1 to run "
                    "on CPU tensors under Triton's interpreter")
        return None

    def unsupported_reason(self, spec, device, dtype) -> Optional[str]:
        device = torch.device(device)
        if device.type == "cpu" and interpreting():
            if _kernels_interpreted() is False:
                return ("RNNKIT_TRITON_INTERPRET=1 was set after the Triton kernels were compiled for the GPU; "
                        "set it before the first triton pass of the process")
        elif device.type != "cuda":
            return (f"runs on CUDA tensors, got device {device} (RNNKIT_TRITON_INTERPRET=1 accepts CPU tensors "
                    "under Triton's interpreter)")
        if dtype not in _DTYPES:
            return f"runs in float32, float64, bfloat16 and float16, got {dtype}"
        return None

    def run_pass(self, cell, x, h0, c0, weights, step_mask, reverse, masks):
        if _KERNELS not in sys.modules and interpreting():
            os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined (triton.jit)
        from .launcher import triton_pass

        return triton_pass(cell, x, h0, c0, weights, step_mask, reverse, masks)


__all__ = ["TritonBackend", "interpreting"]
