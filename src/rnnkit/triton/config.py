"""What one Triton pass knows: its static configuration and its tensors in the compute dtype.

State buffers hold T + 1 states, indexed so that step t reads ``io(cfg, t)[0]`` and writes
``io(cfg, t)[1]``: forward t -> t + 1, reverse t + 1 -> t. So the initial state sits at 0
(forward) or T (reverse), and the states entering the steps are one contiguous slice,
which is what the weight-gradient GEMM over all steps reads.
"""
from __future__ import annotations

import os
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import masks
from .gemm import half_mm, step_mm


LN_EPS = 1e-5

Pair = Optional[Tuple[torch.Tensor, torch.Tensor]]


class PassConfig(NamedTuple):
    """Static description of a pass; hashable, so it keys the CUDA-graph cache."""

    mode: str
    T: int
    B: int
    I: int
    H: int
    HR: int  # size of h: P with a projection, else H
    G: int  # gate blocks: 4 (LSTM), 3 (coupled LSTM, GRU), 1 (RNN)
    reverse: bool
    save: bool  # keep per-step activations for backward (else one step's worth of scratch)
    has_b_x: bool
    has_b_h: bool
    peephole: bool
    layer_norm: bool
    cell_clip: bool
    proj: bool
    proj_clip: bool
    rmask: bool  # variational mask on the h that enters R
    zone_h: int  # 0 off, 1 per-step 0/1 draws (training), 2 probability (evaluation)
    zone_c: int
    coupled: bool
    reset_after: bool
    relu: bool
    block: int  # lanes for H
    block_r: int  # lanes for HR
    step_gemm: str  # the per-step products' GEMM: "cublas" (torch.mm) or "triton" (gemm.step_mm)
    gemm_dtype: torch.dtype  # the GEMMs' operands: the compute dtype, or bfloat16 / float16 (`gemm_dtype`)


class PassTensors(NamedTuple):
    """One pass's tensors, contiguous, in the compute dtype (float32, or float64); x and the weights the
    GEMMs read (W, R, W_hr) in the pass's GEMM dtype (PassConfig.gemm_dtype)."""

    x: torch.Tensor  # [T, B, I] GEMM dtype
    h0: torch.Tensor  # [B, HR]
    c0: Optional[torch.Tensor]  # [B, H]
    W: torch.Tensor  # [G·H, I] GEMM dtype
    R: torch.Tensor  # [G·H, HR] GEMM dtype
    b_W: Optional[torch.Tensor]  # [G·H]
    b_R: Optional[torch.Tensor]  # [G·H]
    W_hr: Optional[torch.Tensor]  # [P, H] GEMM dtype
    peephole: Optional[torch.Tensor]  # [G - 1, H]
    ln_x: Pair  # ([G·H], [G·H])
    ln_h: Pair
    ln_c: Pair  # ([H], [H])
    keep: torch.Tensor  # [T, B] 1.0 where t < length
    recurrent: Optional[torch.Tensor]  # [B, HR]
    zone_h: Optional[torch.Tensor]  # [T, B, HR] 0/1 draws (training)
    zone_c: Optional[torch.Tensor]  # [T, B, H]
    scalars: torch.Tensor  # [5] p_h, p_c, cell_clip, proj_clip, eps (common.py)
    dummy: torch.Tensor  # [1] passed for absent pointers


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32 / bfloat16 / float16 compute and carry state in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_config(args: dict, save: bool, block_size) -> PassConfig:
    """The static description of a pass from the op's named arguments (rnnkit/passes.py)."""
    x, R, W, W_hr, c0 = args["x"], args["R"], args["W"], args["W_hr"], args["c0"]
    T, B, I = x.shape
    HR = R.shape[1]
    H = W_hr.shape[1] if W_hr is not None else (c0.shape[1] if c0 is not None else HR)
    zone = lambda mask, p: 1 if mask is not None else (2 if p else 0)  # noqa: E731
    return PassConfig(
        mode=args["mode"], T=T, B=B, I=I, H=H, HR=HR, G=W.shape[0] // H, reverse=args["reverse"], save=save,
        has_b_x=args["b_W"] is not None, has_b_h=args["b_R"] is not None, peephole=args["peephole"] is not None,
        layer_norm=args["ln_h_gain"] is not None, cell_clip=args["cell_clip"] is not None, proj=W_hr is not None,
        proj_clip=args["proj_clip"] is not None, rmask=args["recurrent_mask"] is not None,
        zone_h=zone(args["zoneout_h_mask"], args["zoneout_h"]), zone_c=zone(args["zoneout_c_mask"], args["zoneout_c"]),
        coupled=args["coupled_gates"], reset_after=args["reset_after"], relu=args["mode"] == "rnn_relu",
        block=block_size(H), block_r=block_size(HR), step_gemm=step_gemm_choice(), gemm_dtype=gemm_dtype(x.dtype),
    )


STEP_GEMMS = ("cublas", "triton")


def step_gemm_choice() -> str:
    """The per-step products' GEMM: ``$RNNKIT_TRITON_STEP_GEMM``, "cublas" (torch.mm, the default) or
    "triton" (`gemm.step_mm`). Read as each pass starts, into its PassConfig, so that a CUDA graph
    captures, and its cache keys on, the choice in force then; a pass's backward reads it again as it
    starts (either choice computes the same products, so a change in between is safe, and a bad value
    set in between raises there)."""
    return _choice("RNNKIT_TRITON_STEP_GEMM", STEP_GEMMS)


HALF_GEMMS = ("float32", "half")


def half_gemm_choice() -> str:
    """The GEMMs' operands of a bfloat16 / float16 pass: ``$RNNKIT_TRITON_HALF_GEMM``, "float32" (the
    default: x and the weights cast to float32 once per pass, every GEMM in float32) or "half" (in the
    module's dtype with float32 accumulation, on the tensor cores; the pointwise math and the carried
    state stay float32, h rounded to the half dtype as a GEMM's operand). float32 / float64 passes
    are not affected. Read as each pass starts, into its PassConfig (`gemm_dtype`), the backward's too
    (its saved tensors are in the compute dtype either way)."""
    return _choice("RNNKIT_TRITON_HALF_GEMM", HALF_GEMMS)


def _choice(name: str, choices: tuple) -> str:
    """``$name``, one of ``choices`` (unset: the first); anything else raises a ValueError naming it."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))} (unset: {choices[0]!r}), "
                         f"got {value!r}")
    return value


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the GEMMs' operands in a pass on ``dtype`` inputs: bfloat16 / float16 itself in "half"
    mode (`half_gemm_choice`), else the compute dtype."""
    if half_gemm_choice() == "half" and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return compute_dtype(dtype)


def step_product(cfg: PassConfig, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 accumulate: bool = False) -> None:
    """out = a @ b (out += a @ b with ``accumulate``) on the pass's per-step GEMM (`step_gemm_choice`).

    A float32 a (a state, a gradient) by a half-precision weight b ("half" mode) always runs on
    `step_mm`, which rounds a to b's dtype as it loads it: torch.mm cannot mix dtypes."""
    if cfg.step_gemm == "triton" or a.dtype != b.dtype:
        step_mm(a, b, out, accumulate)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def sequence_product(cfg: PassConfig, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for a GEMM over all steps (W x; dx and the weight gradients in backward), in the compute dtype:
    in "half" mode on a and b rounded to the half dtype, accumulated in float32 (`gemm.half_mm`: W x feeds
    the pointwise math unrounded; dx and the gradients are rounded once, to the module's dtype, by the
    caller); else on a and b in the compute dtype."""
    if cfg.gemm_dtype in (torch.bfloat16, torch.float16):
        return half_mm(a.to(cfg.gemm_dtype), b.to(cfg.gemm_dtype))
    return torch.mm(a, b)


def make_tensors(args: dict, gemm: Optional[torch.dtype] = None) -> PassTensors:
    """Cast and make contiguous once per pass (no-ops for contiguous float32 / float64 inputs); x and the
    weights the GEMMs read into ``gemm``, the pass's GEMM dtype (default: the compute dtype)."""
    x = args["x"]
    dtype = compute_dtype(x.dtype)
    gemm = gemm or dtype
    cast = lambda t, to=dtype: None if t is None else t.detach().to(to).contiguous()  # noqa: E731
    pair = lambda name: None if args[name + "_gain"] is None else (cast(args[name + "_gain"]),  # noqa: E731
                                                                   cast(args[name + "_shift"]))
    T, B = x.shape[:2]
    keep = masks.step_mask(args["lengths"], T, x.device, dtype)  # [T, B] 1.0 where t < length
    keep = torch.ones(T, B, dtype=dtype, device=x.device) if keep is None else keep
    scalars = scalars_tensor(
        (args["zoneout_h"], args["zoneout_c"], args["cell_clip"] or 0.0, args["proj_clip"] or 0.0, LN_EPS),
        dtype, x.device, plain=type(x) is torch.Tensor and _get_current_dispatch_mode() is None,
    )
    return PassTensors(
        x=cast(x, gemm), h0=cast(args["h0"]), c0=cast(args["c0"]), W=cast(args["W"], gemm), R=cast(args["R"], gemm),
        b_W=cast(args["b_W"]), b_R=cast(args["b_R"]), W_hr=cast(args["W_hr"], gemm), peephole=cast(args["peephole"]),
        ln_x=pair("ln_x"), ln_h=pair("ln_h"), ln_c=pair("ln_c"),
        keep=keep, recurrent=cast(args["recurrent_mask"]), zone_h=cast(args["zoneout_h_mask"]),
        zone_c=cast(args["zoneout_c_mask"]), scalars=scalars, dummy=torch.zeros(1, dtype=dtype, device=x.device),
    )


# Host-to-device copies. Inside a caller's CUDA-graph capture a blocking one (torch.tensor(..., device=cuda),
# a pageable .to(cuda)) is not allowed: the tensors are filled on the device there instead, which the
# caller's graph records. Elsewhere the scalars come from a pinned host copy kept per value, without
# blocking (a torch.tensor on the device would synchronize the stream, in every pass).

_PINNED_KEPT = 64
_pinned: Dict[tuple, torch.Tensor] = {}


def scalars_tensor(values: Tuple[float, ...], dtype: torch.dtype, device: torch.device, plain: bool) -> torch.Tensor:
    """[len(values)] on ``device``; ``plain``: eager, on real tensors (not fake ones), so a host copy may be kept."""
    if masks.stream_capturing(device):
        out = torch.empty(len(values), dtype=dtype, device=device)
        for k, value in enumerate(values):
            out[k].fill_(value)
        return out
    if device.type != "cuda" or not plain:
        return torch.tensor(values, dtype=dtype, device=device)
    key = (values, dtype)
    host = _pinned.get(key)
    if host is None:
        with torch.inference_mode(False):
            host = torch.tensor(values, dtype=dtype).pin_memory()
        if len(_pinned) >= _PINNED_KEPT:
            _pinned.clear()
        _pinned[key] = host
    return host.to(device, non_blocking=True)


def time_steps(cfg: PassConfig) -> range:
    return range(cfg.T - 1, -1, -1) if cfg.reverse else range(cfg.T)


def io(cfg: PassConfig, t: int) -> Tuple[int, int]:
    """(index of the state step t reads, index of the state it writes) in a [T + 1] buffer."""
    return (t + 1, t) if cfg.reverse else (t, t + 1)


def first_last(cfg: PassConfig) -> Tuple[int, int]:
    """Indices of the initial and the final state in a [T + 1] buffer."""
    return (cfg.T, 0) if cfg.reverse else (0, cfg.T)


def entering(cfg: PassConfig, states: torch.Tensor) -> torch.Tensor:
    """The T states entering the steps, in time order: [T, B, ·]."""
    return states[1:] if cfg.reverse else states[:-1]


def slot(cfg: PassConfig, t: int) -> int:
    """Index of step t in a per-step buffer ([T] when saving for backward, else [1] scratch)."""
    return t if cfg.save else 0


def recurrent_steps(cfg: PassConfig, buf: dict) -> Iterator[Tuple[int, int, int, int, torch.Tensor]]:
    """The forward time loop's shared head: per step, R h_in into the step's ``rh`` buffer.

    Yields (t, i, o, s, rh): the step, the state indices it reads and writes (`io`), its
    per-step slot (`slot`), and rh = R h_in [B, G·H] (saved per step under layer norm).
    """
    R_t = buf["R"].t()
    for t in time_steps(cfg):
        i, o = io(cfg, t)
        s = slot(cfg, t)
        rh = buf["rh"][s if cfg.layer_norm else 0]
        step_product(cfg, buf["hin"][i], R_t, rh)
        yield t, i, o, s, rh


def state_buffers(cfg: PassConfig, p: PassTensors, initial: torch.Tensor, mask: Optional[torch.Tensor]):
    """(states [T + 1, B, ·] holding the initial state, the masked h that enters R)."""
    states = initial.new_empty((cfg.T + 1,) + tuple(initial.shape))
    first = first_last(cfg)[0]
    states[first] = initial
    if mask is None:
        return states, states
    masked = torch.empty_like(states)
    masked[first] = initial * mask
    return states, masked


def or_dummy(p: PassTensors, t: Optional[torch.Tensor]) -> torch.Tensor:
    return p.dummy if t is None else t


def absent(p: PassTensors, n: int) -> torch.Tensor:
    """Stands in for an absent per-step buffer: indexing it at any step gives the dummy."""
    return p.dummy.expand(n, 1)


def per_step_or_absent(p: PassTensors, t: Optional[torch.Tensor], n: int) -> torch.Tensor:
    return absent(p, n) if t is None else t
