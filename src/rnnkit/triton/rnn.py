"""Elman RNN on Triton (docs/spec.md, "Cells"): h̃ = act(LN_x(W x) + b_W + LN_h(R h_in) + b_R), per step
one GEMM and one fused pointwise kernel; backward mirrors it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import EPS, P_H, h_grad, ln_input_grad, ln_stats, tanh, write_h, zone_pointer
from .config import (
    PassConfig, PassTensors, absent, entering, or_dummy, per_step_or_absent, recurrent_steps,
    sequence_product, slot, state_buffers, step_product, time_steps,
)
from .graphs import run_loop


@triton.jit
def rnn_forward_kernel(
    gx, rh, b_x, b_h, lnh_w, lnh_b, scalars,  # shared by all steps
    h_prev, keep, zone_h, rmask,  # this step's inputs
    h_out, hin_out, y, act_out, stats_h,  # this step's outputs
    H,
    HAS_BX: tl.constexpr, HAS_BH: tl.constexpr, LN: tl.constexpr, RELU: tl.constexpr, RMASK: tl.constexpr,
    ZH: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    offs = b * H + cols
    r = tl.load(rh + offs, mask=valid, other=0.0)  # [H] R h_in
    if LN:
        mean, rstd = ln_stats(r, r, r, r, valid, H, tl.load(scalars + EPS), 1)
        r = (r - mean) * rstd * tl.load(lnh_w + cols, mask=valid, other=0.0) + tl.load(lnh_b + cols, mask=valid,
                                                                                        other=0.0)
        tl.store(stats_h + 2 * b, mean)
        tl.store(stats_h + 2 * b + 1, rstd)
    a = tl.load(gx + offs, mask=valid, other=0.0) + r
    if HAS_BX:
        a += tl.load(b_x + cols, mask=valid, other=0.0)
    if HAS_BH:
        a += tl.load(b_h + cols, mask=valid, other=0.0)
    if RELU:
        h_new = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        h_new = tanh(a)
    tl.store(act_out + offs, h_new, mask=valid)
    h = tl.load(h_prev + offs, mask=valid, other=0.0)
    keep_b = tl.load(keep + b) > 0.5
    write_h(h_new, h, b, H, cols, valid, keep_b, zone_pointer(zone_h, scalars, b, H, P_H, ZH), rmask,
            h_out, hin_out, y, ZH, RMASK)


@triton.jit
def rnn_backward_kernel(
    act, rh, stats_h, lnh_w, scalars,  # saved / shared
    keep, zone_h, rmask, dy, dh_in,  # this step's inputs
    dh_carry,  # gradient of the state leaving this step, updated to the one entering it
    da, drh, lnh_part,  # this step's outputs
    H,
    LN: tl.constexpr, RELU: tl.constexpr, RMASK: tl.constexpr, ZH: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    offs = b * H + cols
    keep_b = tl.load(keep + b) > 0.5
    zh = zone_pointer(zone_h, scalars, b, H, P_H, ZH)
    dh_new, dh_prev = h_grad(b, H, cols, valid, keep_b, zh, rmask, dh_carry, dh_in, dy, ZH, RMASK)
    tl.store(dh_carry + offs, dh_prev, mask=valid)
    h_new = tl.load(act + offs, mask=valid, other=0.0)
    if RELU:
        d_a = tl.where(h_new > 0, dh_new, 0.0)
    else:
        d_a = dh_new * (1.0 - h_new * h_new)
    tl.store(da + offs, d_a, mask=valid)
    if LN:
        mean, rstd = tl.load(stats_h + 2 * b), tl.load(stats_h + 2 * b + 1)
        x_hat = tl.where(valid, (tl.load(rh + offs, mask=valid, other=0.0) - mean) * rstd, 0.0)
        e = d_a * tl.load(lnh_w + cols, mask=valid, other=0.0)
        tl.store(drh + offs, ln_input_grad(e, x_hat, rstd, tl.sum(e, 0) / H, tl.sum(e * x_hat, 0) / H), mask=valid)
        tl.store(lnh_part + offs, d_a * x_hat, mask=valid)


# ---- launchers ---------------------------------------------------------------------------

def _forward_loop(cfg: PassConfig, buf: dict) -> None:
    grid = (cfg.B,)
    for t, i, o, s, rh in recurrent_steps(cfg, buf):
        rnn_forward_kernel[grid](
            buf["gx"][t], rh, buf["b_x"], buf["b_h"], buf["lnh_w"], buf["lnh_b"], buf["scalars"],
            buf["hs"][i], buf["keep"][t], buf["zone_h"][t], buf["rmask"],
            buf["hs"][o], buf["hin"][o], buf["y"][t], buf["act"][s], buf["stats_h"][s],
            cfg.H, HAS_BX=cfg.has_b_x, HAS_BH=cfg.has_b_h, LN=cfg.layer_norm, RELU=cfg.relu, RMASK=cfg.rmask,
            ZH=cfg.zone_h, BLOCK=cfg.block,
        )


def saved_buffers(cfg: PassConfig) -> tuple:
    """The buffers of the forward loop the backward reads."""
    return ("hs", "hin", "rh", "act", "stats_h")


def forward_buffers(cfg: PassConfig, p: PassTensors, gx: torch.Tensor):
    """The forward loop's buffers from gx = LN_x(W x) [T, B, H] -> (buffers, loop, saved names, write-only names)."""
    T, B, H = cfg.T, cfg.B, cfg.H
    n = T if cfg.save else 1
    new = gx.new_empty
    hs, hin = state_buffers(cfg, p, p.h0, p.recurrent)
    d = lambda t: or_dummy(p, t)  # noqa: E731
    buf = dict(
        gx=gx, R=p.R, b_x=d(p.b_W), b_h=d(p.b_R), scalars=p.scalars, keep=p.keep,
        lnh_w=d(p.ln_h and p.ln_h[0]), lnh_b=d(p.ln_h and p.ln_h[1]),
        zone_h=per_step_or_absent(p, p.zone_h, T), rmask=d(p.recurrent),
        hs=hs, hin=hin, y=new(T, B, H), rh=new(n if cfg.layer_norm else 1, B, H), act=new(n, B, H),
        stats_h=new(n, B, 2) if cfg.layer_norm else absent(p, n),
    )
    return buf, _forward_loop, saved_buffers(cfg), ("y", "rh", "act", "stats_h")


def _backward_loop(cfg: PassConfig, buf: dict) -> None:
    grid = (cfg.B,)
    for t in reversed(time_steps(cfg)):
        s = slot(cfg, t)
        rnn_backward_kernel[grid](
            buf["act"][s], buf["rh"][s if cfg.layer_norm else 0], buf["stats_h"][s], buf["lnh_w"], buf["scalars"],
            buf["keep"][t], buf["zone_h"][t], buf["rmask"], buf["dy"][t], buf["dh_in"],
            buf["dh_carry"],
            buf["da"][t], buf["drh"][t], buf["lnh_part"][t],
            cfg.H, LN=cfg.layer_norm, RELU=cfg.relu, RMASK=cfg.rmask, ZH=cfg.zone_h, BLOCK=cfg.block,
        )
        step_product(cfg, buf["drh"][t], buf["R"], buf["dh_in"])  # [B, H] d h_in of this step


def backward(cfg: PassConfig, p: PassTensors, saved: dict, dy, dh_n, dc_n) -> dict:
    """Gradients of one pass: ``dgx`` [T, B, H] (of LN_x(W x)) and every recurrent-side tensor."""
    T, B, H = cfg.T, cfg.B, cfg.H
    new = dy.new_empty
    da = new(T, B, H)
    buf = dict(
        saved, R=p.R, lnh_w=or_dummy(p, p.ln_h and p.ln_h[0]), scalars=p.scalars, keep=p.keep,
        zone_h=per_step_or_absent(p, p.zone_h, T), rmask=or_dummy(p, p.recurrent), dy=dy,
        dh_carry=dh_n.clone(), dh_in=torch.zeros_like(dh_n),
        da=da, drh=new(T, B, H) if cfg.layer_norm else da,
        lnh_part=new(T, B, H) if cfg.layer_norm else absent(p, T),
    )
    buf = run_loop(_backward_loop, cfg, buf, outputs=("dh_carry", "dh_in", "da", "drh", "lnh_part"),
                   write_only=("da", "drh", "lnh_part"))
    flat = lambda t: t.reshape(T * B, H)  # noqa: E731
    dh_in = buf["dh_in"] * p.recurrent if cfg.rmask else buf["dh_in"]
    grads = dict(
        dgx=buf["da"], h0=buf["dh_carry"] + dh_in,
        R=sequence_product(cfg, flat(buf["drh"]).t(), flat(entering(cfg, saved["hin"]))),  # [H, H]
        b_R=buf["da"].sum((0, 1)),
    )
    if cfg.layer_norm:
        grads["ln_h"] = (buf["lnh_part"].sum((0, 1)), buf["da"].sum((0, 1)))
    return grads
