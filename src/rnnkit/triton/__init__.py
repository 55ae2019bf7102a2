"""The Triton backend: fused GPU passes for every variant torch's cuDNN ops don't compute (issue 6).

Plain configurations go to the "native" backend (cuDNN through torch). This one runs the
rest on CUDA tensors: peepholes, layer norm, zoneout, variational recurrent dropout, cell and
projection clipping, projection, coupled gates, GRU reset_after=False, every bias mode,
lengths and reverse. Per pass: W·x as one GEMM over all steps; per step one GEMM for R·h_in
(all gates) and one fused Triton kernel for everything pointwise; backward mirrors it, with
the weight gradients as one GEMM per matrix over all steps. float32, float64, and bfloat16 /
float16 inputs (state and accumulation in float32). On CUDA the per-step loop is replayed
from a CUDA graph captured at a shape's second call (graphs.py; replayed on an H200, 2026-11-28;
``rnnkit.triton.release_graphs()`` drops the kept graphs).
``RNNKIT_TRITON_STEP_GEMM=triton`` runs the per-step GEMMs on a Triton kernel for a skinny batch
(gemm.py) instead of cuBLAS (``cublas``, torch.mm: the default); each pass reads it as it starts.
``RNNKIT_TRITON_HALF_GEMM=half`` runs a bfloat16 / float16 pass's GEMMs on operands in its dtype with
float32 accumulation (tensor cores) instead of in float32 (``float32``, the default until timed on a
GPU); the pointwise math and the carried state stay float32 either way (config.py, `half_gemm_choice`),
and its per-step products run on the Triton kernel whatever ``RNNKIT_TRITON_STEP_GEMM`` says (they mix
a float32 state with half weights, which torch.mm cannot).

    >>> lstm = rnnkit.LSTM(8, 16, peephole=True, layer_norm=True, backend="triton").cuda()
    >>> y, (h_n, c_n) = lstm(torch.randn(5, 3, 8, device="cuda"))

Without a GPU, Triton's interpreter runs the kernels on CPU tensors: set ``TRITON_INTERPRET=1``
before anything imports triton (Triton reads it when its own library is defined) and
``RNNKIT_TRITON_INTERPRET=1`` to let this backend accept CPU tensors. rnnkit sets neither (the
test suite does, in tests/conftest.py). Importing rnnkit never imports triton.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from ..passes import forward_ad_reason, run_pass
from .graphs import release_graphs
from .ops import OPS, interpreting, kernels, launch_failure, loaded

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _interpreter_problem() -> Optional[str]:
    """Why Triton's interpreter cannot run the kernels in this process, or None."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros_like, InterpretedFunction):
        return ("Triton's interpreter needs TRITON_INTERPRET=1 in the environment before triton is first imported "
                "(torch._dynamo and keras import it too); it was imported without it")
    if _kernels_interpreted() is False:
        return "rnnkit's Triton kernels were loaded for the GPU before RNNKIT_TRITON_INTERPRET=1 was set"
    return None


def _kernels_interpreted() -> Optional[bool]:
    """Whether the loaded kernels run under the interpreter; None before they are loaded."""
    if not loaded():
        return None
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels()["lstm"].lstm_forward_kernel, InterpretedFunction)


class TritonBackend:
    """Fused Triton passes on CUDA tensors (CPU tensors under RNNKIT_TRITON_INTERPRET=1); differentiable."""

    name = "triton"
    ops = OPS

    def unavailable_reason(self) -> Optional[str]:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if not interpreting() and not torch.cuda.is_available():
            return ("no CUDA device (torch.cuda.is_available() is False); to run on CPU tensors under Triton's "
                    "interpreter set TRITON_INTERPRET=1 (before triton is imported) and RNNKIT_TRITON_INTERPRET=1")
        return launch_failure(check=False)  # what the check before the first pass found (prepare)

    def prepare(self) -> None:
        """Compile and launch one small kernel, once; RuntimeError with the reason when Triton cannot."""
        reason = launch_failure()
        if reason:
            raise RuntimeError(reason)

    def status(self) -> str:
        reason = self.unavailable_reason()
        if reason:
            return reason
        return "kernels loaded" if loaded() else "kernels load on first use"

    def unsupported_reason(self, spec, device, dtype) -> Optional[str]:
        device = torch.device(device)
        if device.type == "cpu" and interpreting():
            problem = _interpreter_problem()
            if problem:
                return problem
        elif device.type != "cuda":
            return (f"runs on CUDA tensors, got device {device} (RNNKIT_TRITON_INTERPRET=1 accepts CPU tensors "
                    "under Triton's interpreter)")
        if dtype not in _DTYPES:
            return f"runs in float32, float64, bfloat16 and float16, got {dtype}"
        return forward_ad_reason()

    def run_pass(self, cell, x, h0, c0, weights, lengths, reverse, masks):
        return run_pass(OPS, cell, x, h0, c0, weights, lengths, reverse, masks)


__all__ = ["TritonBackend", "interpreting", "release_graphs"]
