"""Launcher and autograd glue of the fused CPU passes: kernel (csrc/) -> argument pack ->
``FusedPass`` (autograd.Function) -> :func:`fused_pass` (the backend's ``run_pass``)."""
from __future__ import annotations

from typing import List, Optional

import torch

from ..masks import PassMasks
from ..params import PassWeights
from ..spec import CellSpec
from . import build

_FAMILY = {"lstm": "lstm", "gru": "gru", "rnn_tanh": "rnn", "rnn_relu": "rnn"}
_DIFFERENTIABLE = 15  # x, h0, c0, W, R, b_W, b_R, W_hr, peephole, 3 LN (gain, shift) pairs


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _pair(ln) -> list:
    return [None, None] if ln is None else list(ln)


def _pack(cell: CellSpec, x, h0, c0, w: PassWeights, step_mask, reverse: bool, masks: PassMasks):
    """The kernels' argument pack (csrc/common.h, PassArgs): 15 differentiable tensors, then
    step mask, recurrent mask, zoneout indicators for h and c; and 8 scalars."""
    differentiable = [x, h0, c0, w.W, w.R, w.b_W, w.b_R, w.W_hr, w.peephole, *_pair(w.ln_x), *_pair(w.ln_h), *_pair(w.ln_c)]
    zh, zc = masks.zoneout_h, masks.zoneout_c
    constant = [
        step_mask,
        masks.recurrent,
        zh if isinstance(zh, torch.Tensor) else None,
        zc if isinstance(zc, torch.Tensor) else None,
    ]
    scalars = [
        float(cell.cell_clip or 0.0),
        float(cell.proj_clip or 0.0),
        0.0 if isinstance(zh, torch.Tensor) else float(zh or 0.0),
        0.0 if isinstance(zc, torch.Tensor) else float(zc or 0.0),
        float(reverse),
        float(cell.coupled_gates),
        float(cell.reset_after),
        float(cell.mode == "rnn_relu"),
    ]
    differentiable = [_contiguous(t) for t in differentiable]
    constant = [None if t is None else t.detach().contiguous() for t in constant]
    return differentiable, constant, scalars


class FusedPass(torch.autograd.Function):
    """One layer-direction pass with the fused forward and backward time loops.

    Saves what the backward reads: the post-activation gates, the output y (from which the
    backward rebuilds h entering each step), LSTM's c entering each step, layer norm's pre-norm
    sums and statistics, the projection clip's mask; the kernels recompute the rest (c̃,
    tanh(c̃), m). That is (G + 1)·T·B·H values per layer and direction plus layer norm's.
    """

    @staticmethod
    def forward(ctx, family: str, scalars: List[float], n_constant: int, *tensors):
        ext = build.extension()
        constant, differentiable = list(tensors[:n_constant]), list(tensors[n_constant:])
        pack = differentiable + constant
        out = getattr(ext, f"{family}_forward")(pack, scalars, True)
        ctx.family, ctx.scalars, ctx.n_constant = family, scalars, n_constant
        ctx.save_for_backward(*pack, *out[3:])
        return (out[0], out[1], out[2]) if family == "lstm" else (out[0], out[1])

    @staticmethod
    def backward(ctx, *grads):
        ext = build.extension()
        stored = ctx.saved_tensors
        n_pack = _DIFFERENTIABLE + ctx.n_constant
        pack, saved = list(stored[:n_pack]), list(stored[n_pack:])
        need_dx = ctx.needs_input_grad[3 + ctx.n_constant]
        grads_in = getattr(ext, f"{ctx.family}_backward")(pack, ctx.scalars, saved, list(grads), need_dx)
        return (None, None, None) + (None,) * ctx.n_constant + tuple(grads_in)


def _weight_block(w: PassWeights):
    """When the pass's weights are contiguous views tiling one block of a 1-D buffer (the packed
    parameters, as run_stack passes them): (block view, [(offset, numel, shape) or None per
    weight slot]); else None. One differentiable block instead of up to 12 views means autograd
    builds one buffer-sized gradient per pass instead of one per piece."""
    slots = [w.W, w.R, w.b_W, w.b_R, w.W_hr, w.peephole, *_pair(w.ln_x), *_pair(w.ln_h), *_pair(w.ln_c)]
    base = w.W._base
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    starts, total = [], 0
    for t in slots:
        if t is None:
            continue
        if t._base is not base or not t.is_contiguous():
            return None
        starts.append((t.storage_offset(), t.numel()))
        total += t.numel()
    starts.sort()
    lo, hi = starts[0][0], starts[-1][0] + starts[-1][1]
    if hi - lo != total or any(a + n != b for (a, n), (b, _) in zip(starts, starts[1:])):
        return None
    first = lo - base.storage_offset()
    # The whole buffer (one layer-direction) is passed as itself: a slice of it would make autograd
    # build a zero-filled buffer-sized gradient and copy the block's gradient into it.
    block = base if first == 0 and total == base.numel() else base[first : first + total]
    places = [None if t is None else (t.storage_offset() - lo, t.numel(), tuple(t.shape)) for t in slots]
    return block, places


class FusedPassBlock(torch.autograd.Function):
    """FusedPass with the weights given as one block of the packed buffer (see _weight_block)."""

    @staticmethod
    def forward(ctx, family, scalars, n_constant, places, *tensors):
        ext = build.extension()
        constant = list(tensors[:n_constant])
        x, h0, c0, block = tensors[n_constant:]
        weights = [None if p is None else block[p[0] : p[0] + p[1]].view(p[2]) for p in places]
        pack = [x, h0, c0, *weights] + constant
        out = getattr(ext, f"{family}_forward")(pack, scalars, True)
        ctx.family, ctx.scalars, ctx.n_constant, ctx.places, ctx.numel = family, scalars, n_constant, places, block.numel()
        ctx.save_for_backward(*[t for t in pack if t is not None], *out[3:])
        ctx.present = [t is not None for t in pack]
        return (out[0], out[1], out[2]) if family == "lstm" else (out[0], out[1])

    @staticmethod
    def backward(ctx, *grads):
        ext = build.extension()
        stored = iter(ctx.saved_tensors)
        pack = [next(stored) if here else None for here in ctx.present]
        saved = list(stored)
        need_dx = ctx.needs_input_grad[4 + ctx.n_constant]
        g = getattr(ext, f"{ctx.family}_backward")(pack, ctx.scalars, saved, list(grads), need_dx)
        dblock = None
        if ctx.needs_input_grad[-1]:
            dblock = ext.cached_empty([ctx.numel], grads[0])  # from the kernels' buffer cache
            for p, gw in zip(ctx.places, g[3:]):
                if p is None:
                    continue
                piece = dblock[p[0] : p[0] + p[1]]
                if gw is None:
                    piece.zero_()
                else:
                    piece.copy_(gw.reshape(-1))
        return (None,) * (4 + ctx.n_constant) + (g[0], g[1], g[2], dblock)


def fused_pass(cell: CellSpec, x, h0, c0, w: PassWeights, step_mask, reverse: bool, masks: PassMasks):
    """One layer in one direction on the fused kernels -> (y [T, B, Hr], h_n [B, Hr], c_n [B, H] or None).

    Same signature and results as the reference passes (ref/); see SPEC.md for the equations.
    Under ``torch.no_grad`` (or with nothing requiring grad) it keeps no per-step activations.
    """
    family = _FAMILY[cell.mode]
    differentiable, constant, scalars = _pack(cell, x, h0, c0, w, step_mask, reverse, masks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable):
        found = _weight_block(w)
        if found is not None:
            block, places = found
            out = FusedPassBlock.apply(family, scalars, len(constant), places, *constant, *differentiable[:3], block)
            return (out[0], out[1], out[2]) if family == "lstm" else (out[0], out[1], None)
        out = FusedPass.apply(family, scalars, len(constant), *constant, *differentiable)
        return (out[0], out[1], out[2]) if family == "lstm" else (out[0], out[1], None)
    out = getattr(build.extension(), f"{family}_forward")(differentiable + constant, scalars, False)
    return out[0], out[1], (out[2] if family == "lstm" else None)
