"""Autograd glue of the Triton passes: kernels (lstm.py, gru.py, rnn.py) -> family loops ->
``TritonPass`` (autograd.Function) -> :func:`triton_pass` (the backend's ``run_pass``).

Per pass, around the family's recurrent loop: the input projection W·x as one GEMM over all
steps (and LN_x over all rows at once); in backward, dx and dW as one GEMM each over all
steps, and the bias gradients as sums over all steps.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..masks import PassMasks
from ..params import PassWeights
from ..spec import CellSpec
from . import gru, lstm, rnn
from .common import block_size, ln_rows_backward, ln_rows_forward
from .config import make_config, make_tensors

FAMILIES = {"lstm": lstm, "gru": gru, "rnn_tanh": rnn, "rnn_relu": rnn}
# the differentiable inputs of a pass after x, h0, c0, in PassWeights order with LN pairs flattened
WEIGHT_NAMES = ("W", "R", "b_W", "b_R", "W_hr", "peephole", "ln_x_w", "ln_x_b", "ln_h_w", "ln_h_b",
                "ln_c_w", "ln_c_b")


def _pair(ln) -> list:
    return [None, None] if ln is None else list(ln)


class TritonPass(torch.autograd.Function):
    """One layer-direction pass; saves post-activation gates, the states entering each step,
    the raw R·h and LN statistics (layer norm), and the projection's input and output."""

    @staticmethod
    def forward(ctx, static, x, h0, c0, *weights):
        cell, step_mask, reverse, masks = static
        W, R, b_W, b_R, W_hr, peephole = weights[:6]
        ln = [None if weights[k] is None else (weights[k], weights[k + 1]) for k in (6, 8, 10)]
        w = PassWeights(W, R, b_W, b_R, W_hr, peephole, *ln)
        save = any(ctx.needs_input_grad)
        cfg = make_config(cell, x, w, reverse, masks, save, block_size)
        p = make_tensors(cell, x, h0, c0, w, step_mask, masks)
        T, B, I = x.shape
        gx_raw = (p.x.reshape(T * B, I) @ p.W.t()).view(T, B, -1)  # [T, B, G·H] the hoisted W x
        gx, stats_x = gx_raw, None
        if p.ln_x is not None:
            gx, stats_x = ln_rows_forward(gx_raw, p.ln_x[0], p.ln_x[1], p.scalars)
        y, h_n, c_n, saved = FAMILIES[cell.mode].forward(cfg, p, gx)
        if save:
            ctx.pass_ = (cfg, p, saved, gx_raw, stats_x)
            ctx.dtypes = [None if t is None else t.dtype for t in (x, h0, c0) + weights]
        out = (y.to(x.dtype), h_n.to(x.dtype))
        return out + (c_n.to(x.dtype),) if c_n is not None else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dh_n, dc_n=None):
        cfg, p, saved, gx_raw, stats_x = ctx.pass_
        del ctx.pass_  # backward runs once; free the activations as soon as it has
        T, B, I = p.x.shape
        dtype = p.x.dtype
        grad = lambda g, like: torch.zeros_like(like) if g is None else g.to(dtype).contiguous()  # noqa: E731
        dy = grad(dy, gx_raw[..., : cfg.HR])
        dh_n = grad(dh_n, p.h0)
        dc_n = grad(dc_n, p.c0) if p.c0 is not None else None
        g = FAMILIES[cfg.mode].backward(cfg, p, saved, dy, dh_n, dc_n)
        dgx = g["dgx"]  # [T, B, G·H] of LN_x(W x)
        dgx_raw = dgx
        if p.ln_x is not None:
            dgx_raw, dln_w, dln_b = ln_rows_backward(dgx, gx_raw, stats_x, p.ln_x[0])
            g["ln_x"] = (dln_w, dln_b)
        flat = dgx_raw.reshape(T * B, -1)
        g["W"] = flat.t() @ p.x.reshape(T * B, I)  # [G·H, I]
        g["x"] = (flat @ p.W).view(T, B, I) if ctx.needs_input_grad[1] else None
        g["b_W"] = dgx.sum((0, 1)) if p.b_W is not None else None
        if p.b_R is None:
            g["b_R"] = None
        for which in ("ln_x", "ln_h", "ln_c"):
            g[f"{which}_w"], g[f"{which}_b"] = g.pop(which, (None, None))
        names = ("x", "h0", "c0") + WEIGHT_NAMES
        grads = [
            None if (dt is None or g.get(name) is None or not need) else g[name].to(dt)
            for name, dt, need in zip(names, ctx.dtypes, ctx.needs_input_grad[1:])
        ]
        return (None,) + tuple(grads)


def triton_pass(cell: CellSpec, x, h0, c0, w: PassWeights, step_mask: Optional[torch.Tensor], reverse: bool,
                masks: PassMasks):
    """One layer in one direction on Triton -> (y [T, B, HR], h_n [B, HR], c_n [B, H] or None).

    Same contract as the reference passes (``rnnkit.ref``): x [T, B, I], h0 [B, HR], c0
    [B, H] (LSTM) or None, ``step_mask`` [T, B] bool or None, ``masks`` as drawn by masks.py.
    """
    static = (cell, step_mask, reverse, masks)
    out = TritonPass.apply(static, x, h0, c0, w.W, w.R, w.b_W, w.b_R, w.W_hr, w.peephole,
                           *_pair(w.ln_x), *_pair(w.ln_h), *_pair(w.ln_c))
    return (out[0], out[1], out[2]) if cell.mode == "lstm" else (out[0], out[1], None)
