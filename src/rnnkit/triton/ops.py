"""The Triton passes as the custom ops ``rnnkit::triton_pass_forward`` / ``triton_pass_backward``
(schema: rnnkit/passes.py): kernels (lstm.py, gru.py, rnn.py) -> family loops -> these ops.

Per pass, around the family's recurrent loop: the input projection W·x as one GEMM over all
steps (and LN_x over all rows at once); in backward, dx and dW as one GEMM each over all
steps, and the bias gradients as sums over all steps. The training forward's saved list is
[W x, LN_x's statistics] and then the family's saved buffers that the configuration keeps
(`saved_names`); the backward fills in the others (`complete_saved`).

The kernels are imported on the first Triton pass (never by ``import rnnkit``).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Dict, List, Optional

import torch

from ..passes import BACKWARD_NAMES, FORWARD_NAMES, SLOTS, PassOps, named

_families: Optional[dict] = None
_OPTIONAL = {"hin": "rmask", "m": "proj", "h_pre": "proj", "stats_h": "layer_norm", "stats_c": "layer_norm"}


def interpreting() -> bool:
    """Whether CPU tensors are accepted, to run under Triton's interpreter (RNNKIT_TRITON_INTERPRET=1)."""
    return os.environ.get("RNNKIT_TRITON_INTERPRET") == "1"


def kernels() -> dict:
    """{mode: family module} (lstm.py, gru.py, rnn.py), imported on first use. Not kept while
    torch.compile traces: dynamo guards on the module globals a traced call reads, and one that
    changed under it (None, then this dict) failed the first compile of a process
    ("Unexpected type <class 'dict'>"); the next eager call keeps it."""
    global _families
    if _families is None:
        from . import gru, lstm, rnn

        families = {"lstm": lstm, "gru": gru, "rnn_tanh": rnn, "rnn_relu": rnn}
        if torch.compiler.is_compiling():
            return families
        _families = families
    return _families


def loaded() -> bool:
    return _families is not None


_launch_checked = False
_launch_failure: Optional[str] = None


def launch_failure(check: bool = True) -> Optional[str]:
    """Why Triton cannot compile and launch a kernel in this process, or None.

    Checked once (``check``; else what an earlier check found) by compiling and launching one small
    kernel, the layer norm of one row, on the current CUDA device (on a CPU tensor under the
    interpreter when there is none): where Triton cannot run (no libcuda, a GPU it does not support,
    a broken toolchain) ``backend="auto"`` moves on to the next backend instead of failing at its first
    pass. The reason is printed once, as the fused backend does when it cannot be built.
    """
    global _launch_checked, _launch_failure
    if _launch_checked or not check:
        return _launch_failure
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from ..masks import stream_capturing
    from .graphs import error_summary

    if stream_capturing(device):  # not inside a caller's CUDA-graph capture: a later call checks
        return None
    try:
        kernels()
        from .common import ln_rows_forward

        with _on_device_as_written(device), torch.inference_mode(False):
            row = torch.arange(16, dtype=torch.float32, device=device).unsqueeze(0)
            scalars = torch.full((5,), 1e-5, dtype=torch.float32, device=device)
            out, _ = ln_rows_forward(row, torch.ones(16, device=device), torch.zeros(16, device=device), scalars)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # an asynchronous launch error surfaces here, not in a pass
            if not bool(torch.isfinite(out).all()):
                raise RuntimeError("the test kernel returned non-finite values")
    except Exception as error:  # noqa: BLE001 (Triton's compile errors are not RuntimeErrors)
        _launch_failure = f"Triton could not compile or launch a kernel on {device} ({error_summary(error)})"
        print(f"rnnkit: triton backend unavailable: {_launch_failure}", file=sys.stderr)
    _launch_checked = True
    return _launch_failure


def _prepare(args: dict, save: bool):
    from .common import block_size
    from .config import make_config, make_tensors

    cfg = make_config(args, save, block_size)
    return cfg, make_tensors(args, cfg.gemm_dtype)


def saved_names(cfg, names) -> List[str]:
    """The family's saved buffers this configuration keeps: h entering R only with a recurrent
    mask (else it is h itself), the projection's only with one, LN statistics only with LN."""
    return [n for n in names if n not in _OPTIONAL or getattr(cfg, _OPTIONAL[n])]


def complete_saved(cfg, p, names, kept: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The family's saved dict with the buffers the configuration does not keep filled in."""
    from .config import absent

    saved = dict(kept)
    for name in names:
        if name not in saved:
            saved[name] = saved["hs"] if name == "hin" else absent(p, cfg.T)
    return saved


def _input_projection(cfg, p):
    from .common import ln_rows_forward
    from .config import sequence_product

    T, B, I = p.x.shape
    gx_raw = sequence_product(cfg, p.x.reshape(T * B, I), p.W.t()).view(T, B, p.W.shape[0])  # [T, B, G·H] W x
    if p.ln_x is None:
        return gx_raw, gx_raw, None
    gx, stats_x = ln_rows_forward(gx_raw, p.ln_x[0], p.ln_x[1], p.scalars)
    return gx_raw, gx, stats_x


def _on_device_as_written(device: torch.device) -> contextlib.ExitStack:
    """Where and how a pass computes: its kernels, GEMMs and CUDA graphs on the tensors' device (Triton
    launches on the *current* device, and the ops are called without the dispatcher's device guard),
    and autocast off, which the autograd engine carries into the backward when ``.backward()`` runs
    inside ``torch.autocast``: it would run the backward's float32 GEMMs (dx, dW, dR) in half precision.
    """
    from ..functional import _autocast_on  # not at import: functional imports the backends

    stack = contextlib.ExitStack()
    if device.type == "cuda":
        stack.enter_context(torch.cuda.device(device))
    if _autocast_on(device):
        stack.enter_context(torch.autocast(device.type, enabled=False))
    return stack


def _forward(*values):
    args = named(values, FORWARD_NAMES)
    with _on_device_as_written(args["x"].device):
        return _forward_pass(args)


def _forward_pass(args):
    from .graphs import run_loop
    from .config import first_last

    family = kernels()[args["mode"]]
    cfg, p = _prepare(args, save=args["training"])
    gx_raw, gx, stats_x = _input_projection(cfg, p)
    buf, loop, names, fresh = family.forward_buffers(cfg, p, gx)
    buf = run_loop(loop, cfg, buf, outputs=("y",) + tuple(names), write_only=fresh)
    last = first_last(cfg)[1]
    x = args["x"]
    y, h_n = buf["y"].to(x.dtype), buf["hs"][last].to(x.dtype, copy=True)
    c_n = buf["cs"][last].to(x.dtype, copy=True) if "cs" in buf else x.new_empty(0)
    saved = []
    if args["training"]:
        empty = gx_raw.new_empty(0)
        saved = [gx_raw, empty if stats_x is None else stats_x] + [buf[n] for n in saved_names(cfg, names)]
    return y, h_n, c_n, saved


def _saved_shapes(args):
    """What the training forward saves, from the same buffer allocation (run on fake tensors)."""
    family = kernels()[args["mode"]]
    cfg, p = _prepare(args, save=True)
    T, B = cfg.T, cfg.B
    gx = p.h0.new_empty(T, B, p.W.shape[0])
    buf, _, names, _ = family.forward_buffers(cfg, p, gx)
    stats = (T * B, 2) if p.ln_x is not None else (0,)
    return [((T, B, p.W.shape[0]), gx.dtype), (stats, gx.dtype)] + [
        (tuple(buf[n].shape), buf[n].dtype) for n in saved_names(cfg, names)
    ]


def _backward(*values):
    args = named(values, BACKWARD_NAMES)
    with _on_device_as_written(args["x"].device):
        return _backward_pass(args)


def _backward_pass(args):
    from .common import ln_rows_backward
    from .config import sequence_product

    family = kernels()[args["mode"]]
    cfg, p = _prepare(args, save=True)
    T, B, I = p.x.shape
    dtype = p.h0.dtype  # the compute dtype
    gx_raw, stats_x, *kept = args["saved"]
    names = family.saved_buffers(cfg)
    saved = complete_saved(cfg, p, names, dict(zip(saved_names(cfg, names), kept)))
    grad = lambda g: g.to(dtype).contiguous()  # noqa: E731
    dc_n = grad(args["dc_n"]) if p.c0 is not None else None
    g = family.backward(cfg, p, saved, grad(args["dy"]), grad(args["dh_n"]), dc_n)
    dgx = g["dgx"]  # [T, B, G·H] of LN_x(W x)
    dgx_raw = dgx
    if p.ln_x is not None:
        dgx_raw, dln_w, dln_b = ln_rows_backward(dgx, gx_raw, stats_x, p.ln_x[0])
        g["ln_x"] = (dln_w, dln_b)
    flat = dgx_raw.reshape(T * B, p.W.shape[0]).to(cfg.gemm_dtype)  # [T·B, G·H] the operand of dW and dx
    g["W"] = sequence_product(cfg, flat.t(), p.x.reshape(T * B, I))  # [G·H, I]
    g["b_W"] = dgx.sum((0, 1))
    for which in ("ln_x", "ln_h", "ln_c"):
        g[f"{which}_gain"], g[f"{which}_shift"] = g.pop(which, (None, None))
    x = args["x"]
    present = [(slot, args[slot]) for slot in SLOTS if args[slot] is not None]
    dweights = args["W"].new_empty(sum(w.numel() for _, w in present))
    offset = 0
    for slot, w in present:
        dweights[offset:offset + w.numel()].copy_(g[slot].reshape(-1))
        offset += w.numel()
    dx = sequence_product(cfg, flat, p.W).view(T, B, I).to(x.dtype) if args["need_dx"] else x.new_empty(0)
    dc0 = g["c0"].to(x.dtype) if p.c0 is not None else x.new_empty(0)
    return dx, g["h0"].to(x.dtype), dc0, dweights


OPS = PassOps("triton", _forward, _backward, _saved_shapes, device_types=("cuda", "cpu"))
