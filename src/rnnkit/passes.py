"""The kernel boundary: one named description of a pass, registered as ``torch.library`` custom ops.

A pass is one layer in one direction (docs/spec.md). Every compiled backend (``fused`` on CPU,
``triton`` on CUDA) exposes the same two ops, with the same named schema::

    rnnkit::<backend>_pass_forward(<PASS_ARGUMENTS>, bool training) -> (y, h_n, c_n, saved)
    rnnkit::<backend>_pass_backward(<PASS_ARGUMENTS>, y, saved, dy, dh_n, dc_n, need_dx, need_dW,
                                    need_dR, need_dW_hr) -> (dx, dh0, dc0, dweights)

``PASS_ARGUMENTS`` (below) is written once: tensors by role (x, h0, c0, the weights by the slot
names of `rnnkit.params.WEIGHT_SLOTS`, lengths and the random masks), then the cell's
scalars, all derived from `CellSpec` by `pass_scalars`. ``c_n`` and
``dc0`` are empty tensors for GRU/RNN; ``saved`` is what the training forward keeps (empty tensors
where a configuration keeps nothing); ``dweights`` is ONE gradient block holding the present
weights' gradients in the packed buffer's order.

Each op has a fake implementation (shapes for ``torch.compile`` / ``torch.export``), and one
autograd path, `PassFunction` (a ``torch.autograd.Function`` with ``setup_context``, which
``torch.func`` and ``torch.compile`` both accept), calls the backward op under ``no_grad``. When a
backward must itself be differentiable (``create_graph=True``: gradient penalties, Hessian-vector
products, ``torch.func.grad``), it is computed by recomputing the pass with the reference backend
under autograd, so higher-order gradients are exact on every backend.

In eager mode, with plain tensors and no transform active, the ops' implementations are called
directly: the dispatcher's Python round trip costs more than a whole one-step pass (B = 1).
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, NamedTuple, Optional, Sequence

import torch
from torch._C._functorch import TransformType
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .masks import PassMasks, in_transform, step_mask
from .params import WEIGHT_SLOTS, PassWeights
from .spec import CellSpec

# ---- the one description of a pass ------------------------------------------------------------

SLOTS = tuple(slot for slot, _ in WEIGHT_SLOTS)
_W_HR = SLOTS.index("W_hr")

PASS_ARGUMENTS = (
    ("x", "Tensor"),  # [T, B, I]
    ("h0", "Tensor"),  # [B, Hr]
    ("c0", "Tensor?"),  # [B, H], LSTM
    *((slot, "Tensor" if slot in ("W", "R") else "Tensor?") for slot in SLOTS),
    ("lengths", "Tensor?"),  # [B] int64, each in [1, T]
    ("recurrent_mask", "Tensor?"),  # [B, Hr] variational mask on the h entering R, scaled
    ("zoneout_h_mask", "Tensor?"),  # [T, B, Hr] keep-old indicators (training)
    ("zoneout_c_mask", "Tensor?"),  # [T, B, H]
    ("mode", "str"),  # "lstm", "gru", "rnn_tanh", "rnn_relu"
    ("zoneout_h", "float"),  # keep-old probability in evaluation (the expectation); 0 when masks are given
    ("zoneout_c", "float"),
    ("cell_clip", "float?"),
    ("proj_clip", "float?"),
    ("coupled_gates", "bool"),
    ("reset_after", "bool"),
    ("reverse", "bool"),
)
FORWARD_ARGUMENTS = PASS_ARGUMENTS + (("training", "bool"),)
BACKWARD_ARGUMENTS = PASS_ARGUMENTS + (
    ("y", "Tensor"),
    ("saved", "Tensor[]"),
    ("dy", "Tensor"),
    ("dh_n", "Tensor"),
    ("dc_n", "Tensor?"),
    ("need_dx", "bool"),
    ("need_dW", "bool"),
    ("need_dR", "bool"),
    ("need_dW_hr", "bool"),
)
FORWARD_NAMES = tuple(name for name, _ in FORWARD_ARGUMENTS)
BACKWARD_NAMES = tuple(name for name, _ in BACKWARD_ARGUMENTS)
_MASKS = ("lengths", "recurrent_mask", "zoneout_h_mask", "zoneout_c_mask")


def _schema(arguments, returns: str) -> str:
    return "(" + ", ".join(f"{kind} {name}" for name, kind in arguments) + ") -> " + returns


FORWARD_SCHEMA = _schema(FORWARD_ARGUMENTS, "(Tensor y, Tensor h_n, Tensor c_n, Tensor[] saved)")
BACKWARD_SCHEMA = _schema(BACKWARD_ARGUMENTS, "(Tensor dx, Tensor dh0, Tensor dc0, Tensor dweights)")


class PassScalars(NamedTuple):
    """The non-tensor arguments of a pass (the schema's str / float / bool part)."""

    mode: str
    zoneout_h: float
    zoneout_c: float
    cell_clip: Optional[float]
    proj_clip: Optional[float]
    coupled_gates: bool
    reset_after: bool
    reverse: bool


def pass_scalars(cell: CellSpec, reverse: bool, masks: PassMasks) -> PassScalars:
    """A pass's scalars from its cell, direction and masks (zoneout's probability in evaluation)."""
    probability = lambda z: 0.0 if z is None or isinstance(z, torch.Tensor) else float(z)  # noqa: E731
    return PassScalars(
        mode=cell.mode, zoneout_h=probability(masks.zoneout_h), zoneout_c=probability(masks.zoneout_c),
        cell_clip=cell.cell_clip, proj_clip=cell.proj_clip, coupled_gates=cell.coupled_gates,
        reset_after=cell.reset_after, reverse=bool(reverse),
    )


def mask_tensors(lengths, masks: PassMasks) -> tuple:
    """(lengths, recurrent_mask, zoneout_h_mask, zoneout_c_mask), None where absent."""
    tensor = lambda z: z if isinstance(z, torch.Tensor) else None  # noqa: E731
    return (lengths, masks.recurrent, tensor(masks.zoneout_h), tensor(masks.zoneout_c))


def pass_values(scalars: PassScalars, x, h0, c0, weights: Sequence, mask_args: Sequence) -> tuple:
    """A pass op's arguments in schema order (without ``training``): the one place they are assembled."""
    return (x, h0, c0, *weights, *mask_args, *scalars)


# the schema's order is the order pass_values assembles: checked once, here
assert PASS_ARGUMENTS[:3] == (("x", "Tensor"), ("h0", "Tensor"), ("c0", "Tensor?")) and tuple(
    name for name, _ in PASS_ARGUMENTS[3:]) == SLOTS + _MASKS + PassScalars._fields


# ---- fake implementations (shapes only) ---------------------------------------------------------

def named(values: Sequence, names: Sequence[str]) -> Dict[str, object]:
    """An op's positional values by their schema names."""
    return dict(zip(names, values))


def output_shapes(args: Dict[str, object]):
    """(T, B, H, Hr) of a pass from its arguments."""
    x, R, W_hr, c0 = args["x"], args["R"], args["W_hr"], args["c0"]
    Hr = R.shape[1]
    H = W_hr.shape[1] if W_hr is not None else (c0.shape[1] if c0 is not None else Hr)
    return x.shape[0], x.shape[1], H, Hr


def _fake_forward(saved_shapes: Callable) -> Callable:
    def fake(*values):
        args = named(values, FORWARD_NAMES)
        x = args["x"]
        T, B, H, Hr = output_shapes(args)
        c_n = x.new_empty(B, H) if args["mode"] == "lstm" else x.new_empty(0)
        saved = [x.new_empty(shape, dtype=dtype) for shape, dtype in saved_shapes(args)] if args["training"] else []
        return x.new_empty(T, B, Hr), x.new_empty(B, Hr), c_n, saved

    return fake


def _fake_backward(*values):
    args = named(values, BACKWARD_NAMES)
    x, h0, c0 = args["x"], args["h0"], args["c0"]
    dx = torch.empty_like(x) if args["need_dx"] else x.new_empty(0)
    dc0 = torch.empty_like(c0) if c0 is not None else x.new_empty(0)
    numel = sum(args[slot].numel() for slot in SLOTS if args[slot] is not None)
    return dx, torch.empty_like(h0), dc0, x.new_empty(numel)  # each like its input; the block in x's dtype


def _vmap_by_loop(op) -> Callable:
    """torch.func.vmap of a pass op: the op once per element of the mapped dimension, results
    stacked (correct for any mapped arguments, weights included; as fast as a Python loop)."""

    def rule(info, in_dims, *values):
        def select(value, dim, k):
            if dim is None:
                return value
            if isinstance(value, (list, tuple)):
                return [select(v, d, k) for v, d in zip(value, dim)]
            return value.select(dim, k)

        results = [op(*(select(v, d, k) for v, d in zip(values, in_dims))) for k in range(info.batch_size)]
        stacked = []
        for parts in zip(*results):  # y, h_n, c_n, saved / dx, dh0, dc0, dweights
            if isinstance(parts[0], (list, tuple)):
                stacked.append([torch.stack(list(items)) for items in zip(*parts)])
            else:
                stacked.append(torch.stack(list(parts)))
        out_dims = tuple([0] * len(s) if isinstance(s, list) else 0 for s in stacked)
        return tuple(stacked), out_dims

    return rule


# ---- the ops of one backend --------------------------------------------------------------------

def _any_batched(values) -> bool:
    """Whether a value is a torch.func.vmap-batched tensor."""
    return any(torch._C._functorch.is_batchedtensor(v) for v in values if isinstance(v, torch.Tensor))


def _legacy_batched(values) -> bool:
    """Whether a value is batched by autograd's is_grads_batched (torch's legacy vmap, which has no
    rule for the ops: `pass_gradients` recomputes such a backward in plain torch ops)."""
    return any(torch._C._functorch.is_legacy_batchedtensor(v) for v in values if isinstance(v, torch.Tensor))


def forward_ad_reason() -> Optional[str]:
    """Why the passes' ops cannot run now, when forward-mode AD is on (torch.func.jvp / jacfwd,
    torch.autograd.forward_ad): they have a backward rule and a vmap rule, no jvp rule. None
    otherwise (and always while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return None
    if torch.autograd.forward_ad._current_level >= 0 or in_transform(TransformType.Jvp):
        return ("forward-mode AD (torch.func.jvp / jacfwd, torch.autograd.forward_ad) needs a jvp rule, which these "
                "kernels' ops do not have; backend='reference' (chosen by 'auto') computes it")
    return None


def _direct(x: torch.Tensor) -> bool:
    """Whether an op's implementation can be called without the dispatcher: eager, plain tensors,
    no torch.func transform, no dispatch mode (fake tensors, export), no tracing."""
    return (
        not torch.compiler.is_compiling()  # first: Dynamo folds it, and must not trace the calls below
        and not torch.jit.is_tracing()
        and type(x) is torch.Tensor
        and torch._C._functorch.peek_interpreter_stack() is None
        and _get_current_dispatch_mode() is None
    )


class PassOps:
    """The forward and backward ops of one backend, ``rnnkit::<backend>_pass_forward`` / ``_backward``.

    Args:
        backend: the backend's name (the ops' name prefix).
        forward_impl, backward_impl: the kernels, called with the schema's arguments in order
            and returning (y, h_n, c_n, saved) / (dx, dh0, dc0, dweights).
        saved_shapes: ``{name: argument} -> [(shape, dtype), ...]``, what the training forward
            saves (for the fake implementation).
        device_types: where the implementations run ("cpu", "cuda").
    """

    def __init__(self, backend: str, forward_impl: Callable, backward_impl: Callable, saved_shapes: Callable,
                 device_types: Sequence[str]):
        self.backend = backend
        self.forward_impl, self.backward_impl = forward_impl, backward_impl
        names = {}
        for which, schema, impl, fake in (
            ("forward", FORWARD_SCHEMA, forward_impl, _fake_forward(saved_shapes)),
            ("backward", BACKWARD_SCHEMA, backward_impl, _fake_backward),
        ):
            qualname = f"rnnkit::{backend}_pass_{which}"
            torch.library.define(qualname, schema)
            torch.library.impl(qualname, tuple(device_types))(impl)
            torch.library.register_fake(qualname)(fake)
            op = getattr(torch.ops.rnnkit, f"{backend}_pass_{which}").default
            torch.library.register_vmap(qualname)(_vmap_by_loop(op))
            names[which] = op
        self.forward_op, self.backward_op = names["forward"], names["backward"]
        torch.library.register_autograd(f"rnnkit::{backend}_pass_forward", _op_backward_for(self),
                                        setup_context=_op_setup_context)

    def forward(self, *values):
        """The forward op on its arguments in schema order (`pass_values`, then ``training``)."""
        if _direct(values[0]):
            return self.forward_impl(*values)
        return self.forward_op(*values)

    def backward(self, *values):
        """The backward op on its arguments in schema order. The upstream gradients can be batched
        where x is not (a vmap of a vjp_fn): the dispatcher then."""
        if _direct(values[0]) and not _any_batched(values):
            return self.backward_impl(*values)
        return self.backward_op(*values)


# ---- autograd -----------------------------------------------------------------------------------

class PassFunction(torch.autograd.Function):
    """One pass through a backend's ops, differentiable in x, h0, c0 and every weight.

    ``apply(ops, scalars, x, h0, c0, lengths, recurrent_mask, zoneout_h_mask, zoneout_c_mask,
    *weights)`` with the weights in slot order (None where absent) -> (y, h_n, c_n, *saved).
    Under torch.func.vmap the ops' own vmap rules run (`_vmap_by_loop`).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(ops, scalars, x, h0, c0, *rest):
        mask_args, weights = rest[:4], rest[4:]
        y, h_n, c_n, saved = ops.forward(*pass_values(scalars, x, h0, c0, weights, mask_args), True)
        return (y, h_n, c_n, *saved)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ops, scalars, x, h0, c0 = inputs[:5]
        mask_args, weights = inputs[5:9], inputs[9:]
        y, c_n, saved = output[0], output[2], output[3:]
        ctx.ops, ctx.scalars = ops, scalars
        ctx.n_saved = len(saved)
        ctx.mark_non_differentiable(*saved)
        # no zero-filled gradients for the saved outputs (autograd's default): at [T, B, G·H] each,
        # filling them took ~6% of a training step (layer-norm LSTM, fastrnns shape)
        ctx.set_materialize_grads(False)
        if c0 is None:
            ctx.mark_non_differentiable(c_n)
        ctx.save_for_backward(x, h0, c0, *mask_args, *weights, y, *saved)
        ctx.strides = _strides((y, *saved))

    @staticmethod
    def backward(ctx, dy, dh_n, dc_n, *_):
        stored = ctx.saved_tensors
        x, h0, c0 = stored[:3]
        mask_args, weights = stored[3:7], stored[7:7 + len(SLOTS)]
        y, *saved = _laid_out(stored[7 + len(SLOTS):], ctx.strides)
        needs = ctx.needs_input_grad
        grads = pass_gradients(ctx.ops, ctx.scalars, x, h0, c0, weights, mask_args, y, saved, dy, dh_n, dc_n,
                               needs[2:5] + needs[9:])
        return (None, None) + grads[:3] + (None,) * 4 + grads[3:]


# Function.apply binds its arguments to forward's signature at every call (a Function with
# setup_context), and inspect.signature rebuilds that signature each time unless the function
# carries it: ~23 µs of a 170 µs training call of a small LSTM (AMD EPYC, 1 thread).
PassFunction.forward.__signature__ = inspect.signature(PassFunction.forward)


# Function.apply's Python layer binds the arguments to forward's signature and unwraps the dead
# wrappers of finished torch.func transforms, at every call: 25 µs of a two-layer LSTM's 270 µs
# forward at one step (AMD EPYC Zen 4, 1 thread). With plain tensors and no transform neither has
# anything to do (every argument is given, none is a wrapper), and autograd's C++ apply is called
# as that layer would call it.
_c_apply = super(torch.autograd.Function, PassFunction).apply
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(x, differentiable, mask_args) -> bool:
    """Whether a pass's tensors are plain (`_direct`; no subclass, no torch.func wrapper)."""
    if not _direct(x):
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return all(t is None or (type(t) in _PLAIN and not wrapped(t)) for group in (differentiable, mask_args)
               for t in group)


def _outlived_transform(t) -> bool:
    """Whether ``t`` wraps a torch.func transform level that has exited (functorch marks it -2)."""
    functorch = torch._C._functorch
    return isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t) and functorch.maybe_get_level(t) == -2


def _unwrapped(t):
    """The plain tensor under a dead level's wrappers (None and plain tensors as they are)."""
    while _outlived_transform(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _strides(outputs) -> tuple:
    """The strides of the forward's outputs a backward reads (y and the saved activations)."""
    return tuple(None if t is None else t.stride() for t in outputs)


def _laid_out(tensors, strides) -> list:
    """The saved outputs as the forward laid them out: a saved_tensors_hooks unpack may hand back the
    same values with other strides (a pool's padded rows, column-major), which torch allows (value,
    size, dtype and device must match) and the kernels' backward, reading memory as the forward
    wrote it, does not. Copied into the forward's layout where they differ; as they are otherwise."""
    return [t if t is None or t.stride() == stride else
            torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
            for t, stride in zip(tensors, strides)]


def pass_gradients(ops: "PassOps", scalars: PassScalars, x, h0, c0, weights, mask_args, y, saved, dy, dh_n, dc_n,
                   needs) -> tuple:
    """(dx, dh0, dc0, *one gradient per weight slot) of one pass, None where not needed or absent.

    ``needs`` says which of x, h0, c0 and the weight slots want a gradient. The weights' gradients
    are views of the one block the backward op returns. Under ``create_graph`` (grad mode on in a
    backward) they are computed by :func:`_reference_backward` instead, so they are differentiable.
    """
    need_x, need_h0, need_c0 = needs[:3]
    need_weights = needs[3:]
    if not torch.compiler.is_compiling() and any(map(_outlived_transform, (x, h0, c0, *weights))):
        # torch.func.vjp / jacrev call their vjp_fn after the forward's transform has exited: the saved
        # tensors are then wrappers of a dead level (any of them: x is a plain tensor when only the
        # weights were transformed), on which recomputing the pass gave wrong first-order gradients and
        # no second-order ones. Unwrapped, they are the forward's values at the levels still alive: an
        # enclosing transform or autograd (jacrev(jacrev(f)), hessian of the weights) differentiates
        # the recomputation on them; with nothing there to differentiate, the exact backward runs.
        x, h0, c0, y, dy, dh_n, dc_n = map(_unwrapped, (x, h0, c0, y, dy, dh_n, dc_n))
        weights, mask_args, saved = ([_unwrapped(t) for t in group] for group in (weights, mask_args, saved))
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, h0, c0, *weights, dy, dh_n, dc_n)):
            return _reference_backward(scalars, x, h0, c0, weights, mask_args, dy, dh_n, dc_n, tuple(needs))
        with torch.no_grad():
            return pass_gradients(ops, scalars, x, h0, c0, weights, mask_args, y, saved, dy, dh_n, dc_n, needs)
    if torch.is_grad_enabled() or (not torch.compiler.is_compiling() and _legacy_batched((dy, dh_n, dc_n))):
        # create_graph: gradients that are themselves differentiable; and upstream gradients batched by
        # autograd's is_grads_batched (torch.autograd.functional.jacobian(vectorize=True)), whose legacy
        # batching has no rule for the ops: the recomputation is plain torch ops, which it batches
        return _reference_backward(scalars, x, h0, c0, weights, mask_args, dy, dh_n, dc_n, tuple(needs))
    dy = torch.zeros_like(y) if dy is None else dy
    dh_n = torch.zeros_like(h0) if dh_n is None else dh_n
    if c0 is not None and dc_n is None:
        dc_n = torch.zeros_like(c0)
    dx, dh0, dc0, dweights = ops.backward(
        *pass_values(scalars, x, h0, c0, weights, mask_args), y, saved, dy, dh_n,
        dc_n if c0 is not None else None, bool(need_x), bool(need_weights[0]), bool(need_weights[1]),
        bool(need_weights[_W_HR]),
    )
    grads, offset = [], 0
    for w, need in zip(weights, need_weights):
        if w is None:
            grads.append(None)
            continue
        n = w.numel()
        grads.append(dweights[offset:offset + n].view(w.shape) if need else None)
        offset += n
    return (dx if need_x else None, dh0 if need_h0 else None, dc0 if (need_c0 and c0 is not None) else None,
            *grads)


def _op_setup_context(ctx, inputs, output):
    """The forward op's own autograd (torch.library.register_autograd), for code that calls the op
    directly: it needs ``training=True`` (the saved activations)."""
    ctx.values = inputs[:-1]  # every argument but training
    ctx.training = inputs[-1]
    ctx.set_materialize_grads(False)  # None, not zeros, for the saved outputs (pass_gradients fills what it needs)
    ctx.save_for_backward(*(v for v in inputs[:-1] if isinstance(v, torch.Tensor)), output[0], *output[3])
    ctx.strides = _strides((output[0], *output[3]))


def _op_backward_for(ops: "PassOps"):
    def backward(ctx, dy, dh_n, dc_n, dsaved):
        if not ctx.training:
            raise RuntimeError(f"rnnkit::{ops.backend}_pass_forward: differentiating it needs training=True (the "
                               "activations the backward reads), and this call ran in inference mode: rnnkit "
                               "layers in a torch.export program are for inference, as are calls made without "
                               "gradients; train the module itself (eagerly or under torch.compile)")
        stored = iter(ctx.saved_tensors)
        values = [next(stored) if isinstance(v, torch.Tensor) else v for v in ctx.values]
        y, *saved = _laid_out(list(stored), ctx.strides)
        x, h0, c0 = values[:3]
        weights = values[3:3 + len(SLOTS)]
        mask_args = values[3 + len(SLOTS):7 + len(SLOTS)]
        scalars = PassScalars(*values[7 + len(SLOTS):])
        needs = ctx.needs_input_grad
        grads = pass_gradients(ops, scalars, x, h0, c0, weights, mask_args, y, saved, dy, dh_n, dc_n,
                               needs[:3] + needs[3:3 + len(SLOTS)])
        return grads + (None,) * (len(FORWARD_NAMES) - len(grads))

    return backward


def _reference_backward(scalars: PassScalars, x, h0, c0, weights, mask_args, dy, dh_n, dc_n, needs) -> tuple:
    """(dx, dh0, dc0, *weight gradients) of a pass as a differentiable computation: the pass
    recomputed by the reference backend, differentiated with ``create_graph=True`` (with
    ``torch.func.vjp`` where a wanted input is not tracked at the current level)."""
    from .ref import PASSES
    from .spec import CellSpec

    lengths, recurrent, zone_h, zone_c = mask_args
    T = x.shape[0]
    steps = step_mask(lengths, T, x.device)
    masks = PassMasks(recurrent, zone_h if zone_h is not None else (scalars.zoneout_h or None),
                      zone_c if zone_c is not None else (scalars.zoneout_c or None))
    w = PassWeights(*weights)
    W_hr = w.W_hr
    cell = CellSpec(
        mode=scalars.mode, input_size=x.shape[2], hidden_size=(W_hr.shape[1] if W_hr is not None else
                                                                (c0.shape[1] if c0 is not None else h0.shape[1])),
        proj_size=W_hr.shape[0] if W_hr is not None else 0, peephole=w.peephole is not None,
        coupled_gates=scalars.coupled_gates, reset_after=scalars.reset_after, layer_norm=w.ln_h_gain is not None,
        cell_clip=scalars.cell_clip, proj_clip=scalars.proj_clip,
    )
    inputs = (x, h0, c0, *weights)
    wanted = [t for t, need in zip(inputs, needs) if need and t is not None]
    upstream = (dy, dh_n, dc_n) if c0 is not None else (dy, dh_n)
    if all(g is None for g in upstream):  # no gradient reached the pass's outputs (they are not materialized): zeros
        return tuple(torch.zeros_like(t) if (need and t is not None) else None for t, need in zip(inputs, needs))

    # a bfloat16 / float16 x is computed in float32, as the fused kernels compute it (its results
    # rounded back to x's dtype); half-precision matrices beside a float32 x widened to it
    dtype = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    widen = lambda t: t if t is None or not t.is_floating_point() or t.dtype == dtype else t.to(dtype)  # noqa: E731
    masks = PassMasks(*(widen(m) if isinstance(m, torch.Tensor) else m for m in masks))

    def recompute(*values):
        given = iter(values)
        x, h0, c0, *weights = (widen(next(given) if need and t is not None else t)
                               for t, need in zip(inputs, needs))
        outputs = PASSES[scalars.mode](cell, x, h0, c0, PassWeights(*weights), steps, scalars.reverse, masks)
        return tuple(o.to(inputs[0].dtype) for o, g in zip(outputs, upstream) if g is not None)

    received = tuple(g for g in upstream if g is not None)
    with torch.enable_grad():
        if all(t.requires_grad for t in wanted):
            grads = torch.autograd.grad(recompute(*wanted), wanted, received, create_graph=True, allow_unused=True)
        else:  # a wanted input this level does not track (a dead transform's value, unwrapped): a transform's vjp
            grads = torch.func.vjp(recompute, *wanted)[1](received)
    grads = iter(grads)
    return tuple(next(grads) if (need and t is not None) else None for t, need in zip(inputs, needs))


def run_pass(ops: PassOps, cell: CellSpec, x, h0, c0, w: PassWeights, lengths, reverse: bool, masks: PassMasks):
    """One pass on a backend's ops -> (y [T, B, Hr], h_n [B, Hr], c_n [B, H] or None).

    Without a gradient to compute (or under torch.export, whose programs are for inference) it
    calls the forward op in inference mode (nothing per step is kept); otherwise it goes through
    `PassFunction`.
    """
    scalars = pass_scalars(cell, reverse, masks)
    mask_args = mask_tensors(lengths, masks)
    weights = tuple(w)
    differentiable = (x, h0, c0, *weights)
    if (torch.is_grad_enabled() and not torch.compiler.is_exporting()
            and any(t is not None and t.requires_grad for t in differentiable)):
        apply = _c_apply if _plain(x, differentiable, mask_args) else PassFunction.apply
        out = apply(ops, scalars, x, h0, c0, *mask_args, *weights)
    else:
        out = ops.forward(*pass_values(scalars, x, h0, c0, weights, mask_args), False)
    return out[0], out[1], (out[2] if cell.mode == "lstm" else None)
