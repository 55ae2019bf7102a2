"""LSTM on Triton (docs/spec.md, "Cells" and "Options"): one fused pointwise kernel per step.

Per step: R·h_in (one GEMM over all gates) -> ``lstm_forward_kernel`` (LN_h, biases,
peepholes, gates, cell clip, LN_c, zoneout, lengths) and, with a projection, m·W_hrᵀ (GEMM)
-> ``projection_forward_kernel`` (proj_clip, zoneout, lengths). Backward runs the mirror
image per step, then the weight gradients as one GEMM per matrix over all steps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    CELL_CLIP, EPS, P_C, P_H, PROJ_CLIP, h_grad, keep_old, keep_old_grad, ln_input_grad, ln_stats, load_row,
    row_sum, sigmoid, store_row, tanh, write_h, zone_pointer,
)
from .config import (
    PassConfig, PassTensors, absent, entering, io, or_dummy, per_step_or_absent, recurrent_steps,
    sequence_product, slot, state_buffers, step_product, time_steps,
)
from .graphs import run_loop


@triton.jit
def lstm_forward_kernel(
    gx, rh, b_x, b_h, peep, lnh_w, lnh_b, lnc_w, lnc_b, scalars,  # shared by all steps
    c_prev, h_prev, keep, zone_h, zone_c, rmask,  # this step's inputs
    c_out, h_out, hin_out, y, gates, c_tilde, m, stats_h, stats_c,  # this step's outputs
    H, HR,
    G: tl.constexpr, COUPLED: tl.constexpr, HAS_BX: tl.constexpr, HAS_BH: tl.constexpr, PEEP: tl.constexpr,
    LN: tl.constexpr, CLIP: tl.constexpr, PROJ: tl.constexpr, RMASK: tl.constexpr, ZH: tl.constexpr,
    ZC: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    row = b * G * H
    x0, x1, x2, x3 = load_row(gx, row, H, cols, valid, G)  # [G·H] LN_x(W x)
    r0, r1, r2, r3 = load_row(rh, row, H, cols, valid, G)  # [G·H] R h_in
    if LN:
        mean, rstd = ln_stats(r0, r1, r2, r3, valid, G * H, tl.load(scalars + EPS), G)
        w0, w1, w2, w3 = load_row(lnh_w, 0, H, cols, valid, G)
        s0, s1, s2, s3 = load_row(lnh_b, 0, H, cols, valid, G)
        r0, r1 = (r0 - mean) * rstd * w0 + s0, (r1 - mean) * rstd * w1 + s1
        r2, r3 = (r2 - mean) * rstd * w2 + s2, (r3 - mean) * rstd * w3 + s3
        tl.store(stats_h + 2 * b, mean)
        tl.store(stats_h + 2 * b + 1, rstd)
    a0, a1, a2, a3 = x0 + r0, x1 + r1, x2 + r2, x3 + r3
    if HAS_BX:
        v0, v1, v2, v3 = load_row(b_x, 0, H, cols, valid, G)
        a0, a1, a2, a3 = a0 + v0, a1 + v1, a2 + v2, a3 + v3
    if HAS_BH:
        v0, v1, v2, v3 = load_row(b_h, 0, H, cols, valid, G)
        a0, a1, a2, a3 = a0 + v0, a1 + v1, a2 + v2, a3 + v3
    if COUPLED:
        a_i, a_f, a_g, a_o = a0, a0, a1, a2  # blocks i, g, o; a_f unused
    else:
        a_i, a_f, a_g, a_o = a0, a1, a2, a3
    c = tl.load(c_prev + b * H + cols, mask=valid, other=0.0)  # [H]
    if PEEP:
        p_o = tl.load(peep + (G - 2) * H + cols, mask=valid, other=0.0)
        a_i = a_i + tl.load(peep + cols, mask=valid, other=0.0) * c
        if not COUPLED:
            a_f = a_f + tl.load(peep + H + cols, mask=valid, other=0.0) * c
    i = sigmoid(a_i)
    if COUPLED:
        f = 1.0 - i
    else:
        f = sigmoid(a_f)
    g = tanh(a_g)
    c_new = f * c + i * g
    if CLIP:
        clip = tl.load(scalars + CELL_CLIP)
        c_new = tl.minimum(tl.maximum(c_new, -clip, propagate_nan=tl.PropagateNan.ALL), clip, propagate_nan=tl.PropagateNan.ALL)
    if PEEP:
        a_o = a_o + p_o * c_new  # the output gate peeks at the new cell
    o = sigmoid(a_o)
    c_act = c_new
    if LN:
        mean_c, rstd_c = ln_stats(c_new, c_new, c_new, c_new, valid, H, tl.load(scalars + EPS), 1)
        gain = tl.load(lnc_w + cols, mask=valid, other=0.0)
        c_act = (c_new - mean_c) * rstd_c * gain + tl.load(lnc_b + cols, mask=valid, other=0.0)
        tl.store(stats_c + 2 * b, mean_c)
        tl.store(stats_c + 2 * b + 1, rstd_c)
    h_new = o * tanh(c_act)
    if COUPLED:
        store_row(gates, row, H, cols, valid, i, g, o, o, G)
    else:
        store_row(gates, row, H, cols, valid, i, f, g, o, G)
    tl.store(c_tilde + b * H + cols, c_new, mask=valid)
    keep_b = tl.load(keep + b) > 0.5
    c_state = keep_old(zone_pointer(zone_c, scalars, b, H, P_C, ZC), c, c_new, keep_b, cols, valid, ZC)
    tl.store(c_out + b * H + cols, c_state, mask=valid)
    if PROJ:
        tl.store(m + b * H + cols, h_new, mask=valid)
    else:
        h = tl.load(h_prev + b * HR + cols, mask=valid, other=0.0)
        write_h(h_new, h, b, HR, cols, valid, keep_b, zone_pointer(zone_h, scalars, b, HR, P_H, ZH), rmask,
                h_out, hin_out, y, ZH, RMASK)


@triton.jit
def projection_forward_kernel(
    h_pre, h_prev, keep, zone_h, rmask, scalars, h_out, hin_out, y, HR,
    PCLIP: tl.constexpr, RMASK: tl.constexpr, ZH: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < HR
    h_new = tl.load(h_pre + b * HR + cols, mask=valid, other=0.0)  # [P] W_hr m
    if PCLIP:
        clip = tl.load(scalars + PROJ_CLIP)
        h_new = tl.minimum(tl.maximum(h_new, -clip, propagate_nan=tl.PropagateNan.ALL), clip, propagate_nan=tl.PropagateNan.ALL)
    h = tl.load(h_prev + b * HR + cols, mask=valid, other=0.0)
    keep_b = tl.load(keep + b) > 0.5
    write_h(h_new, h, b, HR, cols, valid, keep_b, zone_pointer(zone_h, scalars, b, HR, P_H, ZH), rmask,
            h_out, hin_out, y, ZH, RMASK)


@triton.jit
def lstm_backward_kernel(
    gates, c_tilde, c_prev, rh, stats_h, stats_c, peep, lnh_w, lnc_w, lnc_b, scalars,  # saved / shared
    keep, zone_h, zone_c, rmask, dy, dh_in, dm,  # this step's inputs
    dh_carry, dc_carry,  # gradients of the states leaving this step, updated to those entering it
    da, drh, lnh_part, lnc_part_w, lnc_part_b, peep_part,  # this step's outputs
    H, HR,
    G: tl.constexpr, COUPLED: tl.constexpr, PEEP: tl.constexpr, LN: tl.constexpr, CLIP: tl.constexpr,
    PROJ: tl.constexpr, RMASK: tl.constexpr, ZH: tl.constexpr, ZC: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    row = b * G * H
    keep_b = tl.load(keep + b) > 0.5
    g0, g1, g2, g3 = load_row(gates, row, H, cols, valid, G)
    if COUPLED:
        i, f, g, o = g0, 1.0 - g0, g1, g2
    else:
        i, f, g, o = g0, g1, g2, g3
    c = tl.load(c_prev + b * H + cols, mask=valid, other=0.0)
    c_new = tl.load(c_tilde + b * H + cols, mask=valid, other=0.0)
    if PROJ:
        dh_new = tl.load(dm + b * H + cols, mask=valid, other=0.0)  # zeros on masked steps
    else:
        zh = zone_pointer(zone_h, scalars, b, HR, P_H, ZH)
        dh_new, dh_prev = h_grad(b, HR, cols, valid, keep_b, zh, rmask, dh_carry, dh_in, dy, ZH, RMASK)
        tl.store(dh_carry + b * HR + cols, dh_prev, mask=valid)
    dc_state = tl.load(dc_carry + b * H + cols, mask=valid, other=0.0)
    dc_new, dc_prev = keep_old_grad(zone_pointer(zone_c, scalars, b, H, P_C, ZC), dc_state, keep_b, cols, valid, ZC)
    c_act = c_new
    if LN:
        mean_c, rstd_c = tl.load(stats_c + 2 * b), tl.load(stats_c + 2 * b + 1)
        c_hat = tl.where(valid, (c_new - mean_c) * rstd_c, 0.0)
        gain = tl.load(lnc_w + cols, mask=valid, other=0.0)
        c_act = c_hat * gain + tl.load(lnc_b + cols, mask=valid, other=0.0)
    t_c = tanh(c_act)
    d_o = dh_new * t_c
    d_act = dh_new * o * (1.0 - t_c * t_c)
    if LN:
        g_c = d_act * gain
        dc_new += ln_input_grad(g_c, c_hat, rstd_c, tl.sum(g_c, 0) / H, tl.sum(g_c * c_hat, 0) / H)
        tl.store(lnc_part_w + b * H + cols, d_act * c_hat, mask=valid)
        tl.store(lnc_part_b + b * H + cols, d_act, mask=valid)
    else:
        dc_new += d_act
    da_o = d_o * o * (1.0 - o)
    if PEEP:
        p_i = tl.load(peep + cols, mask=valid, other=0.0)
        p_o = tl.load(peep + (G - 2) * H + cols, mask=valid, other=0.0)
        dc_new += da_o * p_o
    if CLIP:
        dc_new = tl.where(tl.abs(c_new) < tl.load(scalars + CELL_CLIP), dc_new, 0.0)
    d_i = dc_new * g
    d_g = dc_new * i
    dc_prev += dc_new * f
    if COUPLED:
        d_i -= dc_new * c  # f = 1 - i
    else:
        da_f = dc_new * c * f * (1.0 - f)
    da_i = d_i * i * (1.0 - i)
    da_g = d_g * (1.0 - g * g)
    if PEEP:
        rows = (G - 1) * H
        dc_prev += da_i * p_i
        tl.store(peep_part + b * rows + cols, da_i * c, mask=valid)
        tl.store(peep_part + b * rows + (G - 2) * H + cols, da_o * c_new, mask=valid)
        if not COUPLED:
            dc_prev += da_f * tl.load(peep + H + cols, mask=valid, other=0.0)
            tl.store(peep_part + b * rows + H + cols, da_f * c, mask=valid)
    tl.store(dc_carry + b * H + cols, dc_prev, mask=valid)
    if COUPLED:
        d0, d1, d2, d3 = da_i, da_g, da_o, da_o
    else:
        d0, d1, d2, d3 = da_i, da_f, da_g, da_o
    store_row(da, row, H, cols, valid, d0, d1, d2, d3, G)
    if LN:
        mean, rstd = tl.load(stats_h + 2 * b), tl.load(stats_h + 2 * b + 1)
        r0, r1, r2, r3 = load_row(rh, row, H, cols, valid, G)
        x0 = tl.where(valid, (r0 - mean) * rstd, 0.0)
        x1 = tl.where(valid, (r1 - mean) * rstd, 0.0)
        x2 = tl.where(valid, (r2 - mean) * rstd, 0.0)
        x3 = tl.where(valid, (r3 - mean) * rstd, 0.0)
        w0, w1, w2, w3 = load_row(lnh_w, 0, H, cols, valid, G)
        e0, e1, e2, e3 = d0 * w0, d1 * w1, d2 * w2, d3 * w3
        mean_g = row_sum(e0, e1, e2, e3, valid, G) / (G * H)
        mean_gx = row_sum(e0 * x0, e1 * x1, e2 * x2, e3 * x3, valid, G) / (G * H)
        store_row(drh, row, H, cols, valid, ln_input_grad(e0, x0, rstd, mean_g, mean_gx),
                  ln_input_grad(e1, x1, rstd, mean_g, mean_gx), ln_input_grad(e2, x2, rstd, mean_g, mean_gx),
                  ln_input_grad(e3, x3, rstd, mean_g, mean_gx), G)
        store_row(lnh_part, row, H, cols, valid, d0 * x0, d1 * x1, d2 * x2, d3 * x3, G)


@triton.jit
def projection_backward_kernel(
    h_pre, keep, zone_h, rmask, scalars, dy, dh_in, dh_carry, d_pre, HR,
    PCLIP: tl.constexpr, RMASK: tl.constexpr, ZH: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < HR
    keep_b = tl.load(keep + b) > 0.5
    zh = zone_pointer(zone_h, scalars, b, HR, P_H, ZH)
    dh_new, dh_prev = h_grad(b, HR, cols, valid, keep_b, zh, rmask, dh_carry, dh_in, dy, ZH, RMASK)
    tl.store(dh_carry + b * HR + cols, dh_prev, mask=valid)
    if PCLIP:
        h_new = tl.load(h_pre + b * HR + cols, mask=valid, other=0.0)
        dh_new = tl.where(tl.abs(h_new) <= tl.load(scalars + PROJ_CLIP), dh_new, 0.0)
    tl.store(d_pre + b * HR + cols, dh_new, mask=valid)


# ---- launchers ---------------------------------------------------------------------------

def _forward_loop(cfg: PassConfig, buf: dict) -> None:
    grid = (cfg.B,)
    for t, i, o, s, rh in recurrent_steps(cfg, buf):
        lstm_forward_kernel[grid](
            buf["gx"][t], rh, buf["b_x"], buf["b_h"], buf["peep"], buf["lnh_w"], buf["lnh_b"], buf["lnc_w"],
            buf["lnc_b"], buf["scalars"],
            buf["cs"][i], buf["hs"][i], buf["keep"][t], buf["zone_h"][t],
            buf["zone_c"][t], buf["rmask"],
            buf["cs"][o], buf["hs"][o], buf["hin"][o], buf["y"][t], buf["gates"][s], buf["c_tilde"][s],
            buf["m"][s], buf["stats_h"][s], buf["stats_c"][s],
            cfg.H, cfg.HR, G=cfg.G, COUPLED=cfg.coupled, HAS_BX=cfg.has_b_x, HAS_BH=cfg.has_b_h,
            PEEP=cfg.peephole, LN=cfg.layer_norm, CLIP=cfg.cell_clip, PROJ=cfg.proj, RMASK=cfg.rmask,
            ZH=cfg.zone_h, ZC=cfg.zone_c, BLOCK=cfg.block,
        )
        if cfg.proj:
            step_product(cfg, buf["m"][s], buf["W_hr"].t(), buf["h_pre"][s])  # [B, P]
            projection_forward_kernel[grid](
                buf["h_pre"][s], buf["hs"][i], buf["keep"][t], buf["zone_h"][t],
                buf["rmask"], buf["scalars"], buf["hs"][o], buf["hin"][o], buf["y"][t], cfg.HR,
                PCLIP=cfg.proj_clip, RMASK=cfg.rmask, ZH=cfg.zone_h, BLOCK=cfg.block_r,
            )


def saved_buffers(cfg: PassConfig) -> tuple:
    """The buffers of the forward loop the backward reads."""
    return ("hs", "hin", "cs", "rh", "gates", "c_tilde", "m", "h_pre", "stats_h", "stats_c")


def forward_buffers(cfg: PassConfig, p: PassTensors, gx: torch.Tensor):
    """The forward loop's buffers from gx = LN_x(W x) [T, B, G·H] -> (buffers, loop, saved names, write-only names)."""
    T, B, H, HR, G = cfg.T, cfg.B, cfg.H, cfg.HR, cfg.G
    n = T if cfg.save else 1
    new = gx.new_empty
    hs, hin = state_buffers(cfg, p, p.h0, p.recurrent)
    cs, _ = state_buffers(cfg, p, p.c0, None)
    d = lambda t: or_dummy(p, t)  # noqa: E731
    per_step = lambda on, *shape: new(n, B, *shape) if on else absent(p, n)  # noqa: E731
    buf = dict(
        gx=gx, R=p.R, b_x=d(p.b_W), b_h=d(p.b_R), peep=d(p.peephole), scalars=p.scalars, keep=p.keep,
        lnh_w=d(p.ln_h and p.ln_h[0]), lnh_b=d(p.ln_h and p.ln_h[1]),
        lnc_w=d(p.ln_c and p.ln_c[0]), lnc_b=d(p.ln_c and p.ln_c[1]),
        zone_h=per_step_or_absent(p, p.zone_h, T), zone_c=per_step_or_absent(p, p.zone_c, T),
        rmask=d(p.recurrent), W_hr=d(p.W_hr),
        hs=hs, hin=hin, cs=cs, y=new(T, B, HR),
        rh=new(n if cfg.layer_norm else 1, B, G * H), gates=new(n, B, G * H), c_tilde=new(n, B, H),
        m=per_step(cfg.proj, H), h_pre=per_step(cfg.proj, HR),
        stats_h=per_step(cfg.layer_norm, 2), stats_c=per_step(cfg.layer_norm, 2),
    )
    fresh = ("y", "rh", "gates", "c_tilde", "m", "h_pre", "stats_h", "stats_c")
    return buf, _forward_loop, saved_buffers(cfg), fresh


def _backward_loop(cfg: PassConfig, buf: dict) -> None:
    grid = (cfg.B,)
    for t in reversed(time_steps(cfg)):
        i, _ = io(cfg, t)
        s = slot(cfg, t)
        zone_h = buf["zone_h"][t]
        if cfg.proj:
            projection_backward_kernel[grid](
                buf["h_pre"][s], buf["keep"][t], zone_h, buf["rmask"], buf["scalars"], buf["dy"][t],
                buf["dh_in"], buf["dh_carry"], buf["d_pre"][t], cfg.HR,
                PCLIP=cfg.proj_clip, RMASK=cfg.rmask, ZH=cfg.zone_h, BLOCK=cfg.block_r,
            )
            step_product(cfg, buf["d_pre"][t], buf["W_hr"], buf["dm"])  # [B, H]
        lstm_backward_kernel[grid](
            buf["gates"][s], buf["c_tilde"][s], buf["cs"][i], buf["rh"][s if cfg.layer_norm else 0],
            buf["stats_h"][s], buf["stats_c"][s], buf["peep"], buf["lnh_w"], buf["lnc_w"], buf["lnc_b"],
            buf["scalars"],
            buf["keep"][t], zone_h, buf["zone_c"][t], buf["rmask"], buf["dy"][t],
            buf["dh_in"], buf["dm"],
            buf["dh_carry"], buf["dc_carry"],
            buf["da"][t], buf["drh"][t], buf["lnh_part"][t], buf["lnc_part_w"][t], buf["lnc_part_b"][t],
            buf["peep_part"][t],
            cfg.H, cfg.HR, G=cfg.G, COUPLED=cfg.coupled, PEEP=cfg.peephole, LN=cfg.layer_norm,
            CLIP=cfg.cell_clip, PROJ=cfg.proj, RMASK=cfg.rmask, ZH=cfg.zone_h, ZC=cfg.zone_c, BLOCK=cfg.block,
        )
        step_product(cfg, buf["drh"][t], buf["R"], buf["dh_in"])  # [B, HR] d h_in of this step


def backward(cfg: PassConfig, p: PassTensors, saved: dict, dy, dh_n, dc_n) -> dict:
    """Gradients of one pass: ``dgx`` [T, B, G·H] (of LN_x(W x)) and every recurrent-side tensor."""
    T, B, H, HR, G = cfg.T, cfg.B, cfg.H, cfg.HR, cfg.G
    new = dy.new_empty
    per_step = lambda on, *shape: new(T, B, *shape) if on else absent(p, T)  # noqa: E731
    da = new(T, B, G * H)
    buf = dict(
        saved, R=p.R, W_hr=or_dummy(p, p.W_hr), peep=or_dummy(p, p.peephole), scalars=p.scalars, keep=p.keep,
        lnh_w=or_dummy(p, p.ln_h and p.ln_h[0]), lnc_w=or_dummy(p, p.ln_c and p.ln_c[0]),
        lnc_b=or_dummy(p, p.ln_c and p.ln_c[1]),
        zone_h=per_step_or_absent(p, p.zone_h, T), zone_c=per_step_or_absent(p, p.zone_c, T),
        rmask=or_dummy(p, p.recurrent), dy=dy,
        dh_carry=dh_n.clone(), dc_carry=dc_n.clone(), dh_in=torch.zeros_like(dh_n),
        dm=new(B, H) if cfg.proj else p.dummy, d_pre=per_step(cfg.proj, HR),
        da=da, drh=per_step(True, G * H) if cfg.layer_norm else da,
        lnh_part=per_step(cfg.layer_norm, G * H),
        lnc_part_w=per_step(cfg.layer_norm, H), lnc_part_b=per_step(cfg.layer_norm, H),
        peep_part=per_step(cfg.peephole, G - 1, H),
    )
    outputs = ("dh_carry", "dc_carry", "dh_in", "da", "drh", "d_pre", "lnh_part", "lnc_part_w", "lnc_part_b",
               "peep_part")
    buf = run_loop(_backward_loop, cfg, buf, outputs=outputs,
                   write_only=("dm", "da", "drh", "d_pre", "lnh_part", "lnc_part_w", "lnc_part_b", "peep_part"))
    flat = lambda t, n: t.reshape(T * B, n)  # noqa: E731
    dh_in = buf["dh_in"] * p.recurrent if cfg.rmask else buf["dh_in"]
    grads = dict(
        dgx=buf["da"], h0=buf["dh_carry"] + dh_in, c0=buf["dc_carry"],
        R=sequence_product(cfg, flat(buf["drh"], G * H).t(), flat(entering(cfg, saved["hin"]), HR)),  # [G·H, HR]
        b_R=buf["da"].sum((0, 1)),
    )
    if cfg.proj:
        grads["W_hr"] = sequence_product(cfg, flat(buf["d_pre"], HR).t(), flat(saved["m"], H))  # [P, H]
    if cfg.peephole:
        grads["peephole"] = buf["peep_part"].sum((0, 1))
    if cfg.layer_norm:
        grads["ln_h"] = (buf["lnh_part"].sum((0, 1)), buf["da"].sum((0, 1)))
        grads["ln_c"] = (buf["lnc_part_w"].sum((0, 1)), buf["lnc_part_b"].sum((0, 1)))
    return grads
