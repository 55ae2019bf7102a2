"""The fused CPU backend: compiled time loops for every cell family and option (issue 3).

Per pass: one GEMM for W·x over all steps, one GEMM per step for R·h (two for GRU with
reset_after=False, plus the projection's), one fused pointwise pass per step, and a
compiled backward whose weight gradients are one GEMM per matrix over all steps.

    >>> lstm = rnnkit.LSTM(8, 16, peephole=True, layer_norm=True, backend="fused")
    >>> y, (h_n, c_n) = lstm(torch.randn(5, 3, 8))
"""
from __future__ import annotations

from typing import Optional

import torch

from . import build
from .launcher import fused_pass

_DTYPES = (torch.float32, torch.float64)


def cached_buffer_bytes() -> int:
    """Bytes of freed kernel buffers kept for reuse (0 until the fused kernels have run).

    Buffers of 256 KB and more come from blocks that earlier calls freed: fresh memory costs a
    page fault per 4 KB page on first touch. At most RNNKIT_CPU_CACHE_MB (default 512; 0 turns
    the cache off) is kept; when a freed block does not fit, the largest kept blocks go first.
    """
    extension = build.loaded()
    return extension.cached_buffer_bytes() if extension is not None else 0


def release_cached_buffers() -> None:
    """Give the kept buffers back to the system. Tensors still alive keep their memory, and
    their blocks return to the cache when they die."""
    extension = build.loaded()
    if extension is not None:
        extension.release_cached_buffers()


class FusedCPUBackend:
    """Compiled C++ passes on ATen for CPU tensors in float32 / float64; differentiable."""

    name = "fused"

    def unavailable_reason(self) -> Optional[str]:
        return build.failure()

    def unsupported_reason(self, spec, device, dtype) -> Optional[str]:
        if torch.device(device).type != "cpu":
            return f"runs on CPU tensors only, got device {device}"
        if dtype not in _DTYPES:
            return f"runs in float32 and float64 only, got {dtype}"
        return None

    def run_pass(self, cell, x, h0, c0, weights, step_mask, reverse, masks):
        return fused_pass(cell, x, h0, c0, weights, step_mask, reverse, masks)


__all__ = ["FusedCPUBackend", "fused_pass"]
