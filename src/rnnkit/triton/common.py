"""Triton pieces every cell family shares: activations, row loads, layer norm, the state epilogue.

Kernels run one program per batch row (grid ``(B,)``): a row holds all G gate blocks of one
sample, which is what the per-row layer norm over G·H needs. Every block is a vector of
``BLOCK >= H`` lanes; lanes ``>= H`` are masked on load (zeros) and store, and excluded
from reductions. Kernels compute in the dtype of their buffers (the launcher keeps them in
float32, or float64 for float64 inputs). Scalars that must be exact in float64 (zoneout
probabilities in evaluation, clip values, the LN epsilon) come from the ``scalars`` tensor,
never from Python floats (which Triton passes as float32):

    scalars = [p_h, p_c, cell_clip, proj_clip, eps]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# indices into ``scalars`` (constexpr, so the kernels can read them)
P_H = tl.constexpr(0)
P_C = tl.constexpr(1)
CELL_CLIP = tl.constexpr(2)
PROJ_CLIP = tl.constexpr(3)
EPS = tl.constexpr(4)


def block_size(n: int) -> int:
    """Lanes of one gate block: a power of two >= n (Triton's arange needs one)."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def tanh(v):
    # (1 - t) / (1 + t) with t = exp(-2|v|) never overflows, but for small |v| the 1 - t cancels
    # (float32 lost 1e-2 relative at |v| = 1e-6, float64 1e-5): below 1/8 the odd Taylor series to
    # v^13 instead (its truncation is < 1e-16 relative there; the exp form is within ~4 ulps from
    # 1/8 up, more on the GPU's approximate float32 exp: ~1e-6 at worst).
    a = tl.abs(v)
    t = tl.exp(-2.0 * a)
    s = a * a
    series = a * (1.0 + s * (-0.3333333333333333 + s * (0.13333333333333333 + s * (-0.05396825396825397 + s * (
        0.021869488536155203 + s * (-0.008863235529902197 + s * 0.003592128036572481))))))
    magnitude = tl.where(a < 0.125, series, (1.0 - t) / (1.0 + t))
    return tl.where(v >= 0, magnitude, -magnitude)


@triton.jit
def load_row(ptr, row, H, cols, valid, G: tl.constexpr):
    """The G gate blocks of one row of a [*, G·H] buffer; unused blocks (G < 4) are zeros."""
    v0 = tl.load(ptr + row + cols, mask=valid, other=0.0)
    v1 = tl.zeros_like(v0)
    v2 = tl.zeros_like(v0)
    v3 = tl.zeros_like(v0)
    if G > 1:
        v1 = tl.load(ptr + row + H + cols, mask=valid, other=0.0)
    if G > 2:
        v2 = tl.load(ptr + row + 2 * H + cols, mask=valid, other=0.0)
    if G > 3:
        v3 = tl.load(ptr + row + 3 * H + cols, mask=valid, other=0.0)
    return v0, v1, v2, v3


@triton.jit
def store_row(ptr, row, H, cols, valid, v0, v1, v2, v3, G: tl.constexpr):
    tl.store(ptr + row + cols, v0, mask=valid)
    if G > 1:
        tl.store(ptr + row + H + cols, v1, mask=valid)
    if G > 2:
        tl.store(ptr + row + 2 * H + cols, v2, mask=valid)
    if G > 3:
        tl.store(ptr + row + 3 * H + cols, v3, mask=valid)


@triton.jit
def row_sum(v0, v1, v2, v3, valid, G: tl.constexpr):
    """Sum over the G blocks of a row (valid lanes only)."""
    s = tl.sum(tl.where(valid, v0, 0.0), 0)
    if G > 1:
        s += tl.sum(tl.where(valid, v1, 0.0), 0)
    if G > 2:
        s += tl.sum(tl.where(valid, v2, 0.0), 0)
    if G > 3:
        s += tl.sum(tl.where(valid, v3, 0.0), 0)
    return s


@triton.jit
def ln_stats(v0, v1, v2, v3, valid, N, eps, G: tl.constexpr):
    """Mean and 1/sqrt(var + eps) over a row of N = G·H values (biased variance, docs/spec.md)."""
    mean = row_sum(v0, v1, v2, v3, valid, G) / N
    d0, d1, d2, d3 = v0 - mean, v1 - mean, v2 - mean, v3 - mean
    var = row_sum(d0 * d0, d1 * d1, d2 * d2, d3 * d3, valid, G) / N
    return mean, 1.0 / tl.sqrt(var + eps)


@triton.jit
def ln_input_grad(g, xhat, rstd, mean_g, mean_gx):
    """d(input) of LN from g = d(normalized) ∘ gain: rstd (g − mean(g) − x̂ mean(g x̂))."""
    return rstd * (g - mean_g - xhat * mean_gx)


@triton.jit
def keep_old(zone, old, new, keep, cols, valid, ZONE: tl.constexpr):
    """docs/spec.md's zoneout d ∘ old + (1 − d) ∘ new, then the lengths mask (masked steps keep old).

    ZONE: 0 off, 1 a row of 0/1 draws at ``zone`` (training), 2 the probability p at ``zone``.
    """
    out = new
    if ZONE == 1:
        d = tl.load(zone + cols, mask=valid, other=0.0)
        out = d * old + (1.0 - d) * new
    if ZONE == 2:
        d = tl.load(zone)
        out = d * old + (1.0 - d) * new
    return tl.where(keep, out, old)


@triton.jit
def keep_old_grad(zone, d_out, keep, cols, valid, ZONE: tl.constexpr):
    """Backward of `keep_old`: (d new, d old) from d out."""
    d_new = d_out
    d_old = tl.zeros_like(d_out)
    if ZONE == 1:
        d = tl.load(zone + cols, mask=valid, other=0.0)
        d_new = (1.0 - d) * d_out
        d_old = d * d_out
    if ZONE == 2:
        d = tl.load(zone)
        d_new = (1.0 - d) * d_out
        d_old = d * d_out
    return tl.where(keep, d_new, 0.0), tl.where(keep, d_old, d_out)


@triton.jit
def write_h(h_new, h_prev, b, HR, cols, valid, keep, zone, rmask, h_out, hin_out, y, ZONE: tl.constexpr,
            RMASK: tl.constexpr):
    """The h epilogue: zoneout, lengths mask, output y (zeros on masked steps), masked h for R."""
    h = keep_old(zone, h_prev, h_new, keep, cols, valid, ZONE)
    tl.store(h_out + b * HR + cols, h, mask=valid)
    tl.store(y + b * HR + cols, tl.where(keep, h, 0.0), mask=valid)
    if RMASK:
        m = tl.load(rmask + b * HR + cols, mask=valid, other=0.0)
        tl.store(hin_out + b * HR + cols, h * m, mask=valid)


@triton.jit
def h_grad(b, HR, cols, valid, keep, zone, rmask, dh_carry, dh_in, dy, ZONE: tl.constexpr, RMASK: tl.constexpr):
    """Backward of `write_h` and of the recurrent mask -> (d h̃, d h_prev through the state).

    The gradient reaching the state out of this step is the carried one plus R's (d h_in ∘ mask).
    """
    offs = b * HR + cols
    d_state = tl.load(dh_carry + offs, mask=valid, other=0.0)
    d_rec = tl.load(dh_in + offs, mask=valid, other=0.0)
    if RMASK:
        d_rec = d_rec * tl.load(rmask + offs, mask=valid, other=0.0)
    d_state = d_state + d_rec
    d_out = d_state + tl.where(keep, tl.load(dy + offs, mask=valid, other=0.0), 0.0)
    return keep_old_grad(zone, d_out, keep, cols, valid, ZONE)


@triton.jit
def zone_pointer(zone, scalars, b, N, WHICH: tl.constexpr, ZONE: tl.constexpr):
    """Where `keep_old` reads d: this row of the draws, or the probability in ``scalars``."""
    if ZONE == 1:
        ptr = zone + b * N
    else:
        ptr = scalars + WHICH
    return ptr


# ---- layer norm over whole rows (LN_x of the hoisted input projection, all steps at once) ----

@triton.jit
def ln_rows_forward_kernel(x, gain, shift, out, stats, scalars, N, BLOCK: tl.constexpr):
    # int64: row * N indexes all T·B rows of [T, B, G·H] at once, past 2^31 elements at large T·B·H
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    v = tl.load(x + row * N + cols, mask=valid, other=0.0)
    mean, rstd = ln_stats(v, v, v, v, valid, N, tl.load(scalars + EPS), 1)
    g = tl.load(gain + cols, mask=valid, other=0.0)
    s = tl.load(shift + cols, mask=valid, other=0.0)
    tl.store(out + row * N + cols, (v - mean) * rstd * g + s, mask=valid)
    tl.store(stats + 2 * row, mean)
    tl.store(stats + 2 * row + 1, rstd)


@triton.jit
def ln_rows_backward_kernel(d_out, x, stats, gain, d_x, gain_part, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # as in ln_rows_forward_kernel
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    mean, rstd = tl.load(stats + 2 * row), tl.load(stats + 2 * row + 1)
    xhat = tl.where(valid, (tl.load(x + row * N + cols, mask=valid, other=0.0) - mean) * rstd, 0.0)
    dn = tl.load(d_out + row * N + cols, mask=valid, other=0.0)
    g = dn * tl.load(gain + cols, mask=valid, other=0.0)
    mean_g = tl.sum(g, 0) / N
    mean_gx = tl.sum(g * xhat, 0) / N
    tl.store(d_x + row * N + cols, ln_input_grad(g, xhat, rstd, mean_g, mean_gx), mask=valid)
    tl.store(gain_part + row * N + cols, dn * xhat, mask=valid)


def ln_rows_forward(x: torch.Tensor, gain, shift, scalars):
    """LN over the last axis of x [..., N] -> (normalized, stats [rows, 2] of mean and rstd)."""
    N = x.shape[-1]
    rows = x.numel() // N
    out = torch.empty_like(x)
    stats = x.new_empty(rows, 2)
    ln_rows_forward_kernel[(rows,)](x, gain, shift, out, stats, scalars, N, BLOCK=block_size(N))
    return out, stats


def ln_rows_backward(d_out: torch.Tensor, x: torch.Tensor, stats, gain):
    """-> (d x, d gain, d shift) of `ln_rows_forward`."""
    N = x.shape[-1]
    rows = x.numel() // N
    d_out = d_out.contiguous()
    d_x = torch.empty_like(x)
    gain_part = torch.empty_like(x)
    ln_rows_backward_kernel[(rows,)](d_out, x, stats, gain, d_x, gain_part, N, BLOCK=block_size(N))
    return d_x, gain_part.reshape(rows, N).sum(0), d_out.reshape(rows, N).sum(0)
