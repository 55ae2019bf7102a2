"""The fused CPU backend: compiled time loops for every cell family and option.

Per pass: one GEMM for W·x over all steps (in cache-sized chunks), one GEMM per step for R·h
(two for GRU with reset_after=False, plus the projection's), one fused pointwise pass per step,
and a compiled backward whose weight gradients are one GEMM per matrix over all steps, written
straight into the pass's gradient block. The kernels are the custom ops
``rnnkit::fused_pass_forward`` / ``fused_pass_backward`` (ops.py; C++ in csrc/, built on first
use by build.py).

float32 and float64 compute natively. float32's products with a weight matrix run on the kernels'
own GEMM (the weights packed once per pass; `fp32_gemm`, `use_fp32_gemm`): AVX-512's where the CPU
has it, AVX2's elsewhere (MKL's on a CPU with neither). With AVX-512 the weight gradients run on it
too: while the gates' gradient is at most 2²¹ floats reading both operands in place, beyond as
(Bᵀ · A)ᵀ on the gates' gradient packed once (for dR and dW where they share it); with AVX2 they
are MKL's. bfloat16 and
float16 tensors are computed in float32 (the weights and inputs as given, accumulation, pointwise
math and the carried state in float32) and the outputs rounded back. The kernels read a half-precision module's matrices (W, R, W_hr) as
they are: one step of a few rows widens each value as it is loaded, reading half of float32's
bytes a step (so does a batch of one over many steps on a CPU without bfloat16 products). The
GEMMs of batches, a batch of one over many steps, and training's forward and backward run on the CPU's bfloat16 dot products where it has them (AVX512_BF16,
`bf16_kernel`: both operands in bfloat16, so h, and in the backward the gradients entering a
product with a weight matrix, are rounded to bfloat16 as operands, while sums, the carried state
and the weight gradients stay float32); otherwise each matrix is widened to float32 once per pass.

    >>> lstm = rnnkit.LSTM(8, 16, peephole=True, layer_norm=True, backend="fused")
    >>> y, (h_n, c_n) = lstm(torch.randn(5, 3, 8))
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from ..passes import forward_ad_reason, run_pass
from . import build
from .ops import OPS

_NATIVE = (torch.float32, torch.float64)
_IN_FLOAT32 = (torch.bfloat16, torch.float16)


def cached_buffer_bytes() -> int:
    """Bytes of freed kernel buffers kept for reuse (0 until the fused kernels have run).

    Buffers of 256 KB and more come from blocks that earlier calls freed: fresh memory costs a
    page fault per 4 KB page on first touch. The cache keeps no more than recent calls use: at
    most a quarter more than the most bytes of such buffers that were in use at once during the
    last few hundred requests (about ten calls; a call's blocks of several sizes can add up to
    more than its peak in use), so a loop over one shape keeps exactly its working set and a
    stream of new shapes about one call's worth, and never more than ``RNNKIT_CPU_CACHE_MB``
    megabytes (default: an eighth of the machine's memory, at least 256; ``0`` turns the cache off). When a freed block does not fit, the
    longest-kept blocks go first; what a burst of large calls left behind is given back to the
    system a window or two after it ends (a window counts the small buffer requests too, so calls
    that make only small ones, such as a generation loop after training, end windows; with no
    calls at all nothing is given back until ``release_cached_buffers()``).

        >>> rnnkit.fused.release_cached_buffers()
        >>> rnnkit.fused.cached_buffer_bytes()
        0
    """
    extension = build.loaded()
    return extension.cached_buffer_bytes() if extension is not None else 0


def release_cached_buffers() -> None:
    """Give the kept buffers back to the system now (they are mapped memory: the process's
    resident size drops by as much). Tensors still alive keep their memory, and their blocks
    return to the cache when they die; the next calls refill it."""
    extension = build.loaded()
    if extension is not None:
        extension.release_cached_buffers()


BF16_KERNELS = {
    "amx-bf16": "AMX-BF16 (Sapphire Rapids and later Xeons): tdpbf16ps on tiles of 16 rows x 32 k of the bfloat16 "
                "operands, float32 sums, for the products of 2 rows or more a vdpbf16ps kernel takes (the same packed "
                "weights and rounded inputs); the rest as avx512-bf16",
    "avx512-bf16": "AVX512_BF16: vdpbf16ps on bfloat16 weights and inputs (h rounded to bfloat16 as R's operand), "
                   "float32 sums, for every pass's GEMMs (a batch of one included); one step of up to 8 rows "
                   "reads the bfloat16 weights as they are; calls without a gradient take int8's quicker σ and tanh",
    "emulated-bf16": "vdpbf16ps's arithmetic in AVX-512F instructions (for tests on CPUs without AVX512_BF16)",
    "none": "bfloat16 weights read as they are for a batch of one and for one step of up to 8 rows in inference, "
            "widened to float32 once per pass for larger batches and for training's backward (float32's GEMMs)",
}


def bf16_kernel() -> str:
    """The GEMM kernels a bfloat16 module's batched passes run on (a key of `BF16_KERNELS`): the
    CPU's bfloat16 dot products where it has them (AVX512_BF16), else "none"; or the one
    $RNNKIT_BF16_KERNEL names (read at the first use; a ValueError if this CPU cannot run it).
    Loads the fused kernels, building them on first use."""
    return build.extension().bf16_kernel()


FP32_GEMMS = {
    "avx512-mkl": "avx512's own products (the per-step products, the input projection and dx), MKL's sgemm for the "
                  "weight gradients: the CPU's choice on Intel's AVX-512 CPUs, where MKL's weight "
                  "gradients were measured faster (120-143 GFLOP/s against 53-118 on an Emerald Rapids Xeon)",
    "avx512": "the kernels' own float32 GEMM on AVX-512 (weights packed once per pass into panels of 16 columns, "
              "4 panels x 6 rows of sums in zmm registers) for the per-step products, the input projection and dx; "
              "and the weight gradients (read in place up to 2²¹ floats of the gates' gradient, packed beyond)",
    "avx2": "the kernels' own float32 GEMM on AVX2 + FMA (1 panel x 6 rows of sums in ymm registers) for the "
            "per-step products, the input projection and dx, on CPUs without AVX-512; MKL for the weight gradients",
    "mkl": "MKL's packed sgemm (as torch links it) for the per-step products, MKL for the rest",
}


def fp32_gemm() -> str:
    """The float32 GEMM kernels of the fused passes (a key of `FP32_GEMMS`): the kernels' own on the
    CPU's widest vectors, AVX-512 or AVX2 (measured faster than MKL on the passes' shapes,
    benchmarks/README.md), MKL's on a CPU with neither; on Intel's AVX-512 CPUs with the weight
    gradients on MKL's ("avx512-mkl"); or the ones $RNNKIT_FP32_GEMM names (read
    at the first use; a ValueError if this CPU cannot run them). `use_fp32_gemm` changes it. Loads
    the fused kernels, building them on first use."""
    return build.extension().fp32_gemm()


def fp32_gemms() -> List[str]:
    """The float32 GEMM kernels this CPU and build can run ("mkl" always among them)."""
    return list(build.extension().fp32_gemms())


@contextlib.contextmanager
def use_fp32_gemm(name: str):
    """Run the fused passes' float32 GEMMs on ``name`` (a key of `FP32_GEMMS`, or "auto": the CPU's
    choice) inside the block, for every thread; the previous choice comes back after it.

        >>> with rnnkit.fused.use_fp32_gemm("mkl"):
        ...     y, _ = lstm(x)
    """
    if not isinstance(name, str):
        raise TypeError(f"use_fp32_gemm: name: expected a str (one of {', '.join(FP32_GEMMS)} or 'auto'), "
                        f"got {type(name).__name__}")
    previous = build.extension().set_fp32_gemm(name)
    try:
        yield
    finally:
        build.extension().set_fp32_gemm(previous)


class FusedCPUBackend:
    """Compiled C++ passes on ATen for CPU tensors; differentiable."""

    name = "fused"
    ops = OPS

    def unavailable_reason(self) -> Optional[str]:
        return build.unavailable_reason()

    def status(self) -> str:
        return build.status()

    def prepare(self) -> None:
        """Build (or load) the kernels; RuntimeError with the reason when that fails."""
        build.extension()

    def unsupported_reason(self, spec, device, dtype) -> Optional[str]:
        if torch.device(device).type != "cpu":
            return f"runs on CPU tensors only, got device {device}"
        if dtype not in _NATIVE + _IN_FLOAT32:
            return f"runs in float32, float64, bfloat16 and float16, got {dtype}"
        return forward_ad_reason()

    def run_pass(self, cell, x, h0, c0, weights, lengths, reverse, masks):
        # bfloat16 / float16: x, the states, the weights and the masks as they are; the op computes in
        # float32 and gives its results back in x's dtype (csrc/ops.cpp, HalfCall)
        return run_pass(OPS, cell, x, h0, c0, weights, lengths, reverse, masks)


__all__ = ["FusedCPUBackend", "BF16_KERNELS", "FP32_GEMMS", "bf16_kernel", "cached_buffer_bytes", "fp32_gemm",
           "fp32_gemms", "release_cached_buffers", "use_fp32_gemm"]
