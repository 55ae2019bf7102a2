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

    Saves what the backward reads (post-activation gates, states entering each step, LN
    statistics, pre-clip values); the kernels recompute the rest.
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


def fused_pass(cell: CellSpec, x, h0, c0, w: PassWeights, step_mask, reverse: bool, masks: PassMasks):
    """One layer in one direction on the fused kernels -> (y [T, B, Hr], h_n [B, Hr], c_n [B, H] or None).

    Same signature and results as the reference passes (ref/); see SPEC.md for the equations.
    Under ``torch.no_grad`` (or with nothing requiring grad) it keeps no per-step activations.
    """
    family = _FAMILY[cell.mode]
    differentiable, constant, scalars = _pack(cell, x, h0, c0, w, step_mask, reverse, masks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable):
        out = FusedPass.apply(family, scalars, len(constant), *constant, *differentiable)
        return (out[0], out[1], out[2]) if family == "lstm" else (out[0], out[1], None)
    out = getattr(build.extension(), f"{family}_forward")(differentiable + constant, scalars, False)
    return out[0], out[1], (out[2] if family == "lstm" else None)
