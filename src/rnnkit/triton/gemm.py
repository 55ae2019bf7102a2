"""The per-step recurrent product on Triton: out = a @ b (or out += a @ b) for a skinny a.

Per step a pass multiplies the batch's h [B, ·] by a weight matrix (R h_in, W_hr m, and their
backward). At small B cuBLAS picks a kernel with a few CTAs for these (on an H200, [16, 128] x
[128, 512] took 22.5 µs in 4 CTAs); `step_mm` tiles the batch rows once (BLOCK_M up to 64) and
spreads the columns over many programs, one output tile each, the whole K loop in the program (no
split-K, no atomics: the result is deterministic). It allocates nothing and never synchronizes,
so a CUDA graph can capture it. The pass chooses it with ``RNNKIT_TRITON_STEP_GEMM=triton``
(config.py, `step_gemm_choice`).

Precision, as torch.mm without TF32: float32 and float64 products and sums in the inputs' dtype
(``input_precision="ieee"``); bfloat16 / float16 on the tensor cores with float32 accumulation,
the result rounded once to the output dtype (with ``accumulate``, after adding out's old value in
float32, as cuBLAS does with beta = 1). Mixed, for a half-precision pass's per-step products
(RNNKIT_TRITON_HALF_GEMM=half, config.py): a float32 a (the state, a gradient) by a bfloat16 /
float16 b (a weight) into a float32 out, a rounded to b's dtype (to nearest even) as it is loaded,
then the same tensor-core product, stored in float32.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

from .graphs import error_summary

_ACCUMULATOR = {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.float32,
                torch.float16: tl.float32}


@triton.jit
def bfloat16_rounded(v):
    """float32 ``v`` rounded to bfloat16's precision, to nearest even, kept in float32 (for the interpreter,
    whose float32 -> bfloat16 cast truncates)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded)  # a NaN stays NaN (its payload could carry into the exponent)


@triton.jit
def step_mm_kernel(
    a, b, out, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
    ACC: tl.constexpr, ACCUMULATE: tl.constexpr, ROUND_A: tl.constexpr, INTERPRETED_BF16: tl.constexpr,
    INTERPRETED_BF16_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # ROUND_A: a float32, b half (rounded to b's dtype as loaded); INTERPRETED_BF16(_OUT): under Triton's
    # interpreter, b (out) in bfloat16
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    a_ptrs = a + rows[:, None] * stride_am + ks[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b + ks[:, None] * stride_bk + cols[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k in range(0, K, BLOCK_K):
        a_tile = tl.load(a_ptrs, mask=row_ok & (ks[None, :] < K - k), other=0.0)
        b_tile = tl.load(b_ptrs, mask=(ks[:, None] < K - k) & col_ok, other=0.0)
        if ROUND_A:
            if INTERPRETED_BF16:
                a_tile = bfloat16_rounded(a_tile)
            else:
                a_tile = a_tile.to(b.dtype.element_ty)  # to nearest even (Triton's default downcast rounding)
        if INTERPRETED_BF16:  # the interpreter would multiply bfloat16's raw bits; in float32, the same exact products
            a_tile, b_tile = a_tile.to(ACC), b_tile.to(ACC)
        acc = tl.dot(a_tile, b_tile, acc, input_precision="ieee", out_dtype=ACC)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    o_ptrs = out + rows[:, None] * stride_om + cols[None, :] * stride_on  # [BLOCK_M, BLOCK_N]
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=row_ok & col_ok, other=0.0).to(ACC)
    if INTERPRETED_BF16_OUT:  # its float32 -> bfloat16 cast truncates: rounded to nearest even here, as on the GPU
        acc = bfloat16_rounded(acc)
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=row_ok & col_ok)


# torch.mm(a, b, out_dtype=...) on CUDA (newer torch releases): None until first tried, then whether it ran
_mm_out_dtype: Optional[bool] = None if hasattr(torch.ops.aten.mm, "dtype") else False


def half_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bfloat16 / float16 a [M, K] and b [K, N], accumulated in float32 and returned in float32 (never
    rounded to the half dtype; cuBLAS's split-K reductions in half precision, which torch allows for a half
    result, stay out). On CUDA cuBLAS on the tensor cores (torch.mm's ``out_dtype``); elsewhere (CPU tensors under
    Triton's interpreter), and where this torch has no such kernel (said once, as a warning), a float32 torch.mm
    of the same values, whose products are exact in float32 (and in TF32): the same sums, without the tensor
    cores."""
    global _mm_out_dtype
    if a.is_cuda and _mm_out_dtype is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _mm_out_dtype = True
            return out
        except (NotImplementedError, TypeError) as error:  # the schema without a kernel for these dtypes
            warnings.warn(f"rnnkit's triton backend: torch.mm(..., out_dtype=torch.float32) is not available here "
                          f"({error_summary(error)}); RNNKIT_TRITON_HALF_GEMM="
                          "half computes its whole-sequence GEMMs as float32 products of the rounded operands, "
                          "without the tensor cores", RuntimeWarning, stacklevel=2)
        _mm_out_dtype = False
    return torch.mm(a.float(), b.float())


def step_blocks(M: int, N: int) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K): all batch rows in one tile up to 64 (tl.dot needs 16 or more); 16
    columns a program below 2048 columns (so that [16, 512] runs in 32 programs and the backward's
    [16, 128] in 8), 32 up to 8192, 64 from there (128 programs or more, each reusing its rows of a
    over more columns). Not yet timed on a GPU: the first choice to revisit there."""
    return min(64, max(16, triton.next_power_of_2(M))), 16 if N < 2048 else 32 if N < 8192 else 64, 32


_INTERPRETED = type(step_mm_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 when triton was imported


def step_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """out = a @ b, or out += a @ b with ``accumulate``; returns ``out``.

    a: [M, K], b: [K, N], out: [M, N], one dtype (float32, float64, bfloat16 or float16), or a and out
    float32 with b bfloat16 / float16 (a rounded to b's dtype, float32 accumulation, stored in float32),
    on one CUDA device (CPU under Triton's interpreter, RNNKIT_TRITON_INTERPRET=1). Any strides (a row
    slice of a per-step buffer, a transposed weight ``R.t()``); ``out`` must not overlap a or b.

        >>> step_mm(h, R.t(), out=rh)  # [B, HR] x [HR, G·H] -> [B, G·H]
    """
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.dim() != 2:
            raise ValueError(f"step_mm: {name} must be 2-D, got shape {tuple(t.shape)}")
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K:
        raise ValueError(f"step_mm: b must be [K={K}, N] to match a {tuple(a.shape)}, got {tuple(b.shape)}")
    if tuple(out.shape) != (M, N):
        raise ValueError(f"step_mm: out must be [{M}, {N}] (a {tuple(a.shape)} @ b {tuple(b.shape)}), "
                         f"got {tuple(out.shape)}")
    mixed = a.dtype == out.dtype == torch.float32 and b.dtype in (torch.bfloat16, torch.float16)
    if not (a.dtype == b.dtype == out.dtype and a.dtype in _ACCUMULATOR or mixed):
        raise ValueError(f"step_mm: a, b and out must share one dtype of float32, float64, bfloat16, float16, or be "
                         f"float32, bfloat16 / float16, float32; got {a.dtype}, {b.dtype}, {out.dtype}")
    if not a.device == b.device == out.device:
        raise ValueError(f"step_mm: a, b and out must be on one device, got {a.device}, {b.device}, {out.device}")
    if any(stride == 0 and size > 1 for stride, size in zip(out.stride(), out.shape)):
        raise ValueError(f"step_mm: out must not repeat an element (an expanded tensor: programs would race to "
                         f"write it), got strides {out.stride()} for shape {tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    BLOCK_M, BLOCK_N, BLOCK_K = step_blocks(M, N)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
    step_mm_kernel[grid](
        a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        ACC=_ACCUMULATOR[b.dtype], ACCUMULATE=accumulate, ROUND_A=mixed,
        INTERPRETED_BF16=_INTERPRETED and b.dtype == torch.bfloat16,
        INTERPRETED_BF16_OUT=_INTERPRETED and out.dtype == torch.bfloat16,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out
