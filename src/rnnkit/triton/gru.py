"""GRU on Triton, both reset conventions (docs/spec.md, "Cells"); gates r, z, n.

reset_after=True: per step one GEMM R·h_in (all 3 gates) and one fused kernel (LN_h, biases,
gates, zoneout, lengths). reset_after=False needs r before R_n can be applied, so per step:
GEMM R_rz·h_in -> kernel (r, z, r ∘ h_in) -> GEMM R_n·(r ∘ h_in) -> kernel (n, h).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    EPS, P_H, h_grad, ln_input_grad, ln_stats, load_row, row_sum, sigmoid, store_row, tanh, write_h, zone_pointer,
)
from .config import (
    PassConfig, PassTensors, absent, entering, io, or_dummy, per_step_or_absent, recurrent_steps,
    sequence_product, slot, state_buffers, step_product, time_steps,
)
from .graphs import run_loop


@triton.jit
def gru_forward_kernel(
    gx, rh, b_x, b_h, lnh_w, lnh_b, scalars,  # shared by all steps
    h_prev, keep, zone_h, rmask,  # this step's inputs
    h_out, hin_out, y, gates, hr_n, stats_h,  # this step's outputs
    H,
    HAS_BX: tl.constexpr, HAS_BH: tl.constexpr, LN: tl.constexpr, RMASK: tl.constexpr, ZH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """reset_after=True: n = tanh(x_n + r ∘ (LN_h(R h_in)_n + b_Rn))."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    row = b * 3 * H
    x_r, x_z, x_n, _ = load_row(gx, row, H, cols, valid, 3)  # [3H] LN_x(W x)
    h_r, h_z, h_n, _ = load_row(rh, row, H, cols, valid, 3)  # [3H] R h_in
    if LN:
        mean, rstd = ln_stats(h_r, h_z, h_n, h_n, valid, 3 * H, tl.load(scalars + EPS), 3)
        w_r, w_z, w_n, _ = load_row(lnh_w, 0, H, cols, valid, 3)
        s_r, s_z, s_n, _ = load_row(lnh_b, 0, H, cols, valid, 3)
        h_r = (h_r - mean) * rstd * w_r + s_r
        h_z = (h_z - mean) * rstd * w_z + s_z
        h_n = (h_n - mean) * rstd * w_n + s_n
        tl.store(stats_h + 2 * b, mean)
        tl.store(stats_h + 2 * b + 1, rstd)
    if HAS_BX:
        v_r, v_z, v_n, _ = load_row(b_x, 0, H, cols, valid, 3)
        x_r, x_z, x_n = x_r + v_r, x_z + v_z, x_n + v_n
    if HAS_BH:
        v_r, v_z, v_n, _ = load_row(b_h, 0, H, cols, valid, 3)
        h_r, h_z, h_n = h_r + v_r, h_z + v_z, h_n + v_n
    r = sigmoid(x_r + h_r)
    z = sigmoid(x_z + h_z)
    n = tanh(x_n + r * h_n)
    h = tl.load(h_prev + b * H + cols, mask=valid, other=0.0)
    h_new = (1.0 - z) * n + z * h
    store_row(gates, row, H, cols, valid, r, z, n, n, 3)
    tl.store(hr_n + b * H + cols, h_n, mask=valid)
    keep_b = tl.load(keep + b) > 0.5
    write_h(h_new, h, b, H, cols, valid, keep_b, zone_pointer(zone_h, scalars, b, H, P_H, ZH), rmask,
            h_out, hin_out, y, ZH, RMASK)


@triton.jit
def gru_backward_kernel(
    gates, hr_n, h_prev, rh, stats_h, lnh_w, scalars,  # saved / shared
    keep, zone_h, rmask, dy, dh_in,  # this step's inputs
    dh_carry,  # gradient of the state leaving this step, updated to the one entering it
    dax, dah, drh, lnh_part,  # this step's outputs
    H,
    LN: tl.constexpr, RMASK: tl.constexpr, ZH: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    row = b * 3 * H
    keep_b = tl.load(keep + b) > 0.5
    zh = zone_pointer(zone_h, scalars, b, H, P_H, ZH)
    dh_new, dh_prev = h_grad(b, H, cols, valid, keep_b, zh, rmask, dh_carry, dh_in, dy, ZH, RMASK)
    r, z, n, _ = load_row(gates, row, H, cols, valid, 3)
    h = tl.load(h_prev + b * H + cols, mask=valid, other=0.0)
    h_n = tl.load(hr_n + b * H + cols, mask=valid, other=0.0)
    dh_prev += dh_new * z
    tl.store(dh_carry + b * H + cols, dh_prev, mask=valid)
    da_n = dh_new * (1.0 - z) * (1.0 - n * n)
    da_z = dh_new * (h - n) * z * (1.0 - z)
    da_r = da_n * h_n * r * (1.0 - r)
    dh_n = da_n * r  # of the recurrent side's n pre-activation
    store_row(dax, row, H, cols, valid, da_r, da_z, da_n, da_n, 3)
    store_row(dah, row, H, cols, valid, da_r, da_z, dh_n, dh_n, 3)
    if LN:
        mean, rstd = tl.load(stats_h + 2 * b), tl.load(stats_h + 2 * b + 1)
        r0, r1, r2, _ = load_row(rh, row, H, cols, valid, 3)
        x0 = tl.where(valid, (r0 - mean) * rstd, 0.0)
        x1 = tl.where(valid, (r1 - mean) * rstd, 0.0)
        x2 = tl.where(valid, (r2 - mean) * rstd, 0.0)
        w0, w1, w2, _ = load_row(lnh_w, 0, H, cols, valid, 3)
        e0, e1, e2 = da_r * w0, da_z * w1, dh_n * w2
        mean_g = row_sum(e0, e1, e2, e2, valid, 3) / (3 * H)
        mean_gx = row_sum(e0 * x0, e1 * x1, e2 * x2, e2, valid, 3) / (3 * H)
        e3 = ln_input_grad(e2, x2, rstd, mean_g, mean_gx)
        store_row(drh, row, H, cols, valid, ln_input_grad(e0, x0, rstd, mean_g, mean_gx),
                  ln_input_grad(e1, x1, rstd, mean_g, mean_gx), e3, e3, 3)
        store_row(lnh_part, row, H, cols, valid, da_r * x0, da_z * x1, dh_n * x2, dh_n, 3)


@triton.jit
def gru_reset_forward_kernel(gx, rh_rz, b_x, b_h, hin_prev, gates, r_hin, H,
                             HAS_BX: tl.constexpr, HAS_BH: tl.constexpr, BLOCK: tl.constexpr):
    """reset_after=False, first half: r, z and the reset h (r ∘ h_in) that R_n multiplies."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    x_r, x_z, _, _ = load_row(gx, b * 3 * H, H, cols, valid, 2)
    h_r, h_z, _, _ = load_row(rh_rz, b * 2 * H, H, cols, valid, 2)  # [2H] R_rz h_in
    a_r, a_z = x_r + h_r, x_z + h_z
    if HAS_BX:
        v_r, v_z, _, _ = load_row(b_x, 0, H, cols, valid, 2)
        a_r, a_z = a_r + v_r, a_z + v_z
    if HAS_BH:
        v_r, v_z, _, _ = load_row(b_h, 0, H, cols, valid, 2)
        a_r, a_z = a_r + v_r, a_z + v_z
    r = sigmoid(a_r)
    store_row(gates, b * 3 * H, H, cols, valid, r, sigmoid(a_z), r, r, 2)
    tl.store(r_hin + b * H + cols, r * tl.load(hin_prev + b * H + cols, mask=valid, other=0.0), mask=valid)


@triton.jit
def gru_candidate_forward_kernel(
    gx, nh, b_x, b_h, scalars, gates, h_prev, keep, zone_h, rmask, h_out, hin_out, y, H,
    HAS_BX: tl.constexpr, HAS_BH: tl.constexpr, RMASK: tl.constexpr, ZH: tl.constexpr, BLOCK: tl.constexpr,
):
    """reset_after=False, second half: n = tanh(x_n + R_n (r ∘ h_in) + b_Rn), then h."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    row = b * 3 * H
    a_n = tl.load(gx + row + 2 * H + cols, mask=valid, other=0.0) + tl.load(nh + b * H + cols, mask=valid, other=0.0)
    if HAS_BX:
        a_n += tl.load(b_x + 2 * H + cols, mask=valid, other=0.0)
    if HAS_BH:
        a_n += tl.load(b_h + 2 * H + cols, mask=valid, other=0.0)
    n = tanh(a_n)
    z = tl.load(gates + row + H + cols, mask=valid, other=0.0)
    h = tl.load(h_prev + b * H + cols, mask=valid, other=0.0)
    tl.store(gates + row + 2 * H + cols, n, mask=valid)
    keep_b = tl.load(keep + b) > 0.5
    write_h((1.0 - z) * n + z * h, h, b, H, cols, valid, keep_b, zone_pointer(zone_h, scalars, b, H, P_H, ZH),
            rmask, h_out, hin_out, y, ZH, RMASK)


@triton.jit
def gru_candidate_backward_kernel(
    gates, h_prev, keep, zone_h, rmask, scalars, dy, dh_in, dh_carry, da, H,
    RMASK: tl.constexpr, ZH: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    row = b * 3 * H
    keep_b = tl.load(keep + b) > 0.5
    zh = zone_pointer(zone_h, scalars, b, H, P_H, ZH)
    dh_new, dh_prev = h_grad(b, H, cols, valid, keep_b, zh, rmask, dh_carry, dh_in, dy, ZH, RMASK)
    z = tl.load(gates + row + H + cols, mask=valid, other=0.0)
    n = tl.load(gates + row + 2 * H + cols, mask=valid, other=0.0)
    h = tl.load(h_prev + b * H + cols, mask=valid, other=0.0)
    tl.store(dh_carry + b * H + cols, dh_prev + dh_new * z, mask=valid)
    tl.store(da + row + H + cols, dh_new * (h - n) * z * (1.0 - z), mask=valid)
    tl.store(da + row + 2 * H + cols, dh_new * (1.0 - z) * (1.0 - n * n), mask=valid)


@triton.jit
def gru_reset_backward_kernel(gates, hin_prev, d_rhin, da, dh_in, H, BLOCK: tl.constexpr):
    """d r from d (r ∘ h_in); writes d h_in's pointwise part (R_rz's part is added by a GEMM)."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < H
    r = tl.load(gates + b * 3 * H + cols, mask=valid, other=0.0)
    g = tl.load(d_rhin + b * H + cols, mask=valid, other=0.0)
    h_in = tl.load(hin_prev + b * H + cols, mask=valid, other=0.0)
    tl.store(da + b * 3 * H + cols, g * h_in * r * (1.0 - r), mask=valid)
    tl.store(dh_in + b * H + cols, g * r, mask=valid)


# ---- launchers ---------------------------------------------------------------------------

def _forward_loop(cfg: PassConfig, buf: dict) -> None:
    grid = (cfg.B,)
    for t, i, o, s, rh in recurrent_steps(cfg, buf):
        gru_forward_kernel[grid](
            buf["gx"][t], rh, buf["b_x"], buf["b_h"], buf["lnh_w"], buf["lnh_b"], buf["scalars"],
            buf["hs"][i], buf["keep"][t], buf["zone_h"][t], buf["rmask"],
            buf["hs"][o], buf["hin"][o], buf["y"][t], buf["gates"][s], buf["hr_n"][s], buf["stats_h"][s],
            cfg.H, HAS_BX=cfg.has_b_x, HAS_BH=cfg.has_b_h, LN=cfg.layer_norm, RMASK=cfg.rmask, ZH=cfg.zone_h,
            BLOCK=cfg.block,
        )


def _forward_loop_reset_before(cfg: PassConfig, buf: dict) -> None:
    grid = (cfg.B,)
    R_rz_t, R_n_t = buf["R_rz"].t(), buf["R_n"].t()
    for t in time_steps(cfg):
        i, o = io(cfg, t)
        s = slot(cfg, t)
        step_product(cfg, buf["hin"][i], R_rz_t, buf["rh"][0])  # [B, 2H] R_rz h_in
        gru_reset_forward_kernel[grid](
            buf["gx"][t], buf["rh"][0], buf["b_x"], buf["b_h"], buf["hin"][i], buf["gates"][s], buf["r_hin"][s],
            cfg.H, HAS_BX=cfg.has_b_x, HAS_BH=cfg.has_b_h, BLOCK=cfg.block,
        )
        step_product(cfg, buf["r_hin"][s], R_n_t, buf["nh"])  # [B, H] R_n (r ∘ h_in)
        gru_candidate_forward_kernel[grid](
            buf["gx"][t], buf["nh"], buf["b_x"], buf["b_h"], buf["scalars"], buf["gates"][s], buf["hs"][i],
            buf["keep"][t], buf["zone_h"][t], buf["rmask"], buf["hs"][o], buf["hin"][o], buf["y"][t],
            cfg.H, HAS_BX=cfg.has_b_x, HAS_BH=cfg.has_b_h, RMASK=cfg.rmask, ZH=cfg.zone_h, BLOCK=cfg.block,
        )


def saved_buffers(cfg: PassConfig) -> tuple:
    """The buffers of the forward loop the backward reads."""
    if cfg.reset_after:
        return ("hs", "hin", "gates", "rh", "hr_n", "stats_h")
    return ("hs", "hin", "gates", "r_hin")


def forward_buffers(cfg: PassConfig, p: PassTensors, gx: torch.Tensor):
    """The forward loop's buffers from gx = LN_x(W x) [T, B, 3H] -> (buffers, loop, saved names, write-only names)."""
    T, B, H = cfg.T, cfg.B, cfg.H
    n = T if cfg.save else 1
    new = gx.new_empty
    hs, hin = state_buffers(cfg, p, p.h0, p.recurrent)
    d = lambda t: or_dummy(p, t)  # noqa: E731
    buf = dict(
        gx=gx, b_x=d(p.b_W), b_h=d(p.b_R), scalars=p.scalars, keep=p.keep,
        zone_h=per_step_or_absent(p, p.zone_h, T), rmask=d(p.recurrent),
        hs=hs, hin=hin, y=new(T, B, H), gates=new(n, B, 3 * H),
    )
    if cfg.reset_after:
        buf.update(
            R=p.R, lnh_w=d(p.ln_h and p.ln_h[0]), lnh_b=d(p.ln_h and p.ln_h[1]),
            rh=new(n if cfg.layer_norm else 1, B, 3 * H), hr_n=new(n, B, H),
            stats_h=new(n, B, 2) if cfg.layer_norm else absent(p, n),
        )
        loop = _forward_loop
    else:
        buf.update(R_rz=p.R[: 2 * H], R_n=p.R[2 * H:], rh=new(1, B, 2 * H), nh=new(B, H), r_hin=new(n, B, H))
        loop = _forward_loop_reset_before
    fresh = [k for k in ("y", "gates", "rh", "hr_n", "stats_h", "nh", "r_hin") if k in buf]
    return buf, loop, saved_buffers(cfg), fresh


def _backward_loop(cfg: PassConfig, buf: dict) -> None:
    grid = (cfg.B,)
    for t in reversed(time_steps(cfg)):
        i, _ = io(cfg, t)
        s = slot(cfg, t)
        gru_backward_kernel[grid](
            buf["gates"][s], buf["hr_n"][s], buf["hs"][i], buf["rh"][s if cfg.layer_norm else 0],
            buf["stats_h"][s], buf["lnh_w"], buf["scalars"],
            buf["keep"][t], buf["zone_h"][t], buf["rmask"], buf["dy"][t], buf["dh_in"],
            buf["dh_carry"],
            buf["dax"][t], buf["dah"][t], buf["drh"][t], buf["lnh_part"][t],
            cfg.H, LN=cfg.layer_norm, RMASK=cfg.rmask, ZH=cfg.zone_h, BLOCK=cfg.block,
        )
        step_product(cfg, buf["drh"][t], buf["R"], buf["dh_in"])  # [B, H] d h_in of this step


def _backward_loop_reset_before(cfg: PassConfig, buf: dict) -> None:
    grid = (cfg.B,)
    H = cfg.H
    for t in reversed(time_steps(cfg)):
        i, _ = io(cfg, t)
        s = slot(cfg, t)
        da = buf["dax"][t]  # [B, 3H]
        gru_candidate_backward_kernel[grid](
            buf["gates"][s], buf["hs"][i], buf["keep"][t], buf["zone_h"][t], buf["rmask"], buf["scalars"],
            buf["dy"][t], buf["dh_in"], buf["dh_carry"], da, H, RMASK=cfg.rmask, ZH=cfg.zone_h, BLOCK=cfg.block,
        )
        step_product(cfg, da[:, 2 * H:], buf["R_n"], buf["d_rhin"])  # [B, H] d (r ∘ h_in)
        gru_reset_backward_kernel[grid](buf["gates"][s], buf["hin"][i], buf["d_rhin"], da, buf["dh_in"], H,
                                        BLOCK=cfg.block)
        step_product(cfg, da[:, : 2 * H], buf["R_rz"], buf["dh_in"], accumulate=True)  # + R_rz's part: [B, H]


def backward(cfg: PassConfig, p: PassTensors, saved: dict, dy, dh_n, dc_n) -> dict:
    """Gradients of one pass: ``dgx`` [T, B, 3H] (of LN_x(W x)) and every recurrent-side tensor."""
    T, B, H = cfg.T, cfg.B, cfg.H
    new = dy.new_empty
    dax = new(T, B, 3 * H)
    buf = dict(
        saved, scalars=p.scalars, keep=p.keep, zone_h=per_step_or_absent(p, p.zone_h, T),
        rmask=or_dummy(p, p.recurrent), dy=dy, dh_carry=dh_n.clone(), dh_in=torch.zeros_like(dh_n), dax=dax,
    )
    if cfg.reset_after:
        dah = new(T, B, 3 * H)
        buf.update(
            R=p.R, lnh_w=or_dummy(p, p.ln_h and p.ln_h[0]), dah=dah,
            drh=new(T, B, 3 * H) if cfg.layer_norm else dah,
            lnh_part=new(T, B, 3 * H) if cfg.layer_norm else absent(p, T),
        )
        loop, outputs = _backward_loop, ("dh_carry", "dh_in", "dax", "dah", "drh", "lnh_part")
    else:
        buf.update(R_rz=p.R[: 2 * H], R_n=p.R[2 * H:], d_rhin=new(B, H))
        loop, outputs = _backward_loop_reset_before, ("dh_carry", "dh_in", "dax")
    fresh = [k for k in ("dax", "dah", "drh", "lnh_part", "d_rhin") if k in buf]
    buf = run_loop(loop, cfg, buf, outputs=outputs, write_only=fresh)
    flat = lambda t, n: t.reshape(T * B, n)  # noqa: E731
    dh_in = buf["dh_in"] * p.recurrent if cfg.rmask else buf["dh_in"]
    h_in = flat(entering(cfg, saved["hin"]), H)
    if cfg.reset_after:
        dR = sequence_product(cfg, flat(buf["drh"], 3 * H).t(), h_in)  # [3H, H]
        d_hside = buf["dah"]
    else:
        da = buf["dax"]
        dR_rz = sequence_product(cfg, flat(da[..., : 2 * H], 2 * H).t(), h_in)  # [2H, H]
        dR_n = sequence_product(cfg, flat(da[..., 2 * H:], H).t(), flat(saved["r_hin"], H))  # [H, H]: R_n (r ∘ h_in)
        dR = torch.cat([dR_rz, dR_n])
        d_hside = da
    grads = dict(dgx=buf["dax"], h0=buf["dh_carry"] + dh_in, R=dR, b_R=d_hside.sum((0, 1)))
    if cfg.layer_norm:
        grads["ln_h"] = (buf["lnh_part"].sum((0, 1)), d_hside.sum((0, 1)))
    return grads
