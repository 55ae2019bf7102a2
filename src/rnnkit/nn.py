"""Drop-in modules ``LSTM``, ``GRU``, ``RNN`` and the one-step cells. Thin: the work is in functional.py."""
from __future__ import annotations

import copy
import copyreg
import difflib
import inspect
import math
import warnings
from collections import OrderedDict
from contextlib import nullcontext
from typing import Optional

import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod as _PRUNING
from torch.nn.utils.rnn import PackedSequence

from . import backend as backends_
from . import functional
from .errors import DTypeMismatchError, MismatchError
from .masks import draw_pass
from .native import cudnn_placement, register_placed
from .params import TORCH_PIECES, Layout, PassWeights, check_forget_bias, initialize
from .passes import _direct, forward_ad_reason
from .spec import RNNSpec, _flag


def _bias_mode(bias, bias_mode: Optional[str]) -> str:
    bias = _flag("bias", bias)
    if bias_mode is None:
        return "double" if bias else "none"
    if not bias and bias_mode != "none":
        raise ValueError(f"bias_mode: bias=False means bias_mode='none', got bias_mode={bias_mode!r}")
    return bias_mode


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` whose storage is exactly ``t``'s memory (through DLPack), for
    state_dict consumers that refuse a view of a larger storage (safetensors)."""
    if type(t) is not torch.Tensor or t.device.type not in ("cpu", "cuda"):
        return t
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return torch.from_dlpack(t)


def pruning_hooks(module: nn.Module) -> dict:
    """torch.nn.utils.prune's forward pre-hooks on ``module``, by the name of the weight each masks
    (a PruningContainer where one weight was pruned more than once)."""
    return {hook._tensor_name: hook for hook in module._forward_pre_hooks.values() if isinstance(hook, _PRUNING)}


def load_checked(module: nn.Module, load, check, args: tuple) -> None:
    """``module._load_from_state_dict(*args)`` (``load``: the parent class's) with ``check(state_dict,
    prefix)`` between the module's own load_state_dict pre-hooks and the copy: torch runs those hooks
    inside ``load``, so a check before it would judge the values before a hook converts them (a hook
    that dequantizes a checkpoint's weights). The hooks run here first, once."""
    hooks = module._load_state_dict_pre_hooks
    for hook in hooks.values():
        hook(*args)
    check(args[0], args[1])
    module.__dict__["_load_state_dict_pre_hooks"] = OrderedDict()  # they ran above
    try:
        load(*args)
    finally:
        module.__dict__["_load_state_dict_pre_hooks"] = hooks


def _plain_eager() -> bool:
    """Eager mode with no torch.func transform and no tracing: data pointers can be read."""
    return (
        not torch.compiler.is_compiling()  # first: Dynamo folds it, and must not trace the calls below
        and not torch.jit.is_tracing()
        and torch._C._functorch.peek_interpreter_stack() is None
    )


class _Pack(torch.autograd.Function):
    """The parameters as views of the packed buffer they alias, with ONE packed gradient.

    ``apply(flat, packing, *params)`` -> one view of ``flat`` per parameter. Backward writes the
    pieces' gradients into one buffer laid out like ``flat`` (no copy when a single pass already
    returned them so: a one-layer, one-direction module; zeros in the room cuDNN's placement keeps
    past the pieces) and hands each parameter a view of it,
    which autograd keeps as the parameter's ``.grad``: so ``module.flat_weights.grad`` is the
    packed gradient, and each ``weight_ih_l0.grad`` its slice.
    """

    @staticmethod
    def forward(ctx, flat, packing, *params):
        ctx.packing, ctx.total = packing, flat.numel()
        if torch.autograd.graph._allow_mutation_on_saved_tensors_enabled:
            # the context clones a saved tensor before its first change, found by (address, version);
            # the parameters, views of one buffer, share one version counter, so an optimizer's step
            # bumps them all at its first parameter and the rest went unsaved: wrong gradients. The
            # views the call saves are then of a copy no step changes.
            flat = flat.clone()
        # each piece as one strided view of flat (contiguous, row-major), where slicing and viewing
        # took two calls a piece: 22 -> 8 µs for a two-layer LSTM's 8 pieces (AMD EPYC Zen 4)
        base = flat.storage_offset()
        return tuple(flat.as_strided(shape, _row_major(shape), base + offset) for offset, _, shape in packing)

    @staticmethod
    def backward(ctx, *grads):
        packing = ctx.packing
        needs = ctx.needs_input_grad[2:]
        if not any(need for need, g in zip(needs, grads) if g is not None):
            return (None, None) + (None,) * len(grads)
        functorch = torch._C._functorch
        if any(g is not None and (functorch.is_legacy_batchedtensor(g) or functorch.is_functorch_wrapped_tensor(g))
               for g in grads):  # batched (is_grads_batched, vmap) or a transform's: no storage to pack them into
            return (None, None) + tuple(g if need else None for need, g in zip(needs, grads))
        total = ctx.total
        packed = _already_packed(grads, packing, total)
        if packed is None:
            like = next(g for g in grads if g is not None)
            packed = like.new_empty(total) if _dense(packing, total) else like.new_zeros(total)
            for g, (offset, numel, _) in zip(grads, packing):
                piece = packed[offset:offset + numel]
                piece.zero_() if g is None else piece.copy_(g.reshape(-1))
        return (None, None) + tuple(
            packed[offset:offset + numel].view(shape) if need else None
            for need, (offset, numel, shape) in zip(needs, packing)
        )


def _row_major(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    if len(shape) == 1:
        return (1,)
    if len(shape) == 2:
        return (shape[1], 1)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _dense(packing, total: int) -> bool:
    """Whether the pieces of ``packing`` cover a buffer of ``total`` values with no room between them."""
    return sum(numel for _, numel, _ in packing) == total


def _already_packed(grads, packing, total: int) -> Optional[torch.Tensor]:
    """The buffer the gradients already form, laid out as ``packing`` says, or None. A missing
    gradient (a frozen weight) is allowed where another one shows the buffer."""
    present = [(g, offset) for g, (offset, _, _) in zip(grads, packing) if g is not None]
    if not present or any(not g.is_contiguous() for g, _ in present):
        return None
    first, first_offset = present[0]
    storage = first.untyped_storage()
    start = first.storage_offset() - first_offset
    if start < 0 or storage.nbytes() < (start + total) * first.element_size():
        return None
    for g, offset in present:
        if g.untyped_storage().data_ptr() != storage.data_ptr() or g.storage_offset() != start + offset:
            return None
    return first.new_empty(0).set_(storage, start, (total,))


def _rnn_mode(nonlinearity) -> str:
    """RNN / RNNCell's ``nonlinearity`` -> the spec's mode, or a ValueError naming it."""
    if nonlinearity not in ("tanh", "relu"):
        raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
    return f"rnn_{nonlinearity}"


# RNN's and RNNCell's nonlinearity, read from the spec and set through it (_SpecAttributes._respec)
_NONLINEARITY = property(lambda self: self.spec.mode[len("rnn_"):], lambda self, value: self._respec(mode=_rnn_mode(value)))

TORCH_MODE = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN_TANH", "rnn_relu": "RNN_RELU"}  # torch.nn's .mode


class _SpecAttributes:
    """torch.nn's attribute names and rnnkit's options, read from ``self.spec`` (the float and
    the int8 modules alike).

    torch.nn reads its attributes at every call, so code sets them after construction (a
    dropout schedule, batch_first for a new pipeline). Those the weights do not depend on
    (dropout, batch_first, the regularizers, the clips; and nonlinearity, which torch.nn's
    RNNCell reads at every call) take effect from the next call; those that fix the weights'
    shapes or meaning (sizes, peephole, layer_norm, coupled_gates, reset_after, bias_mode, merge)
    raise when set, rather than being quietly ignored.
    """

    spec: RNNSpec
    layout: Layout

    def _respec(self, **changes) -> None:
        """Rebuild the spec with ``changes`` (validated as the constructor validates them)."""
        spec = RNNSpec(**{**self.spec.options(), **changes})
        self.spec, self.layout = spec, Layout(spec, suffixes=self.layout.suffixes)
        self.__dict__.pop("_plan", None)  # the one-step plans hold the old scalars

    def __getstate__(self):
        """deepcopy / pickle without the one-step plans (compiled objects; rebuilt on the next call)."""
        state = dict(self.__dict__)
        state.pop("_plan", None)
        return state

    def _fixed(self, name: str):
        raise AttributeError(f"{type(self).__name__}.{name} is fixed at construction (the parameters' shapes or "
                             f"meaning depend on it); build a new module instead")

    input_size = property(lambda self: self.spec.input_size, lambda self, value: self._fixed("input_size"))
    hidden_size = property(lambda self: list(self.spec.hidden_sizes) if self.spec.per_layer else self.spec.hidden_sizes[0],
                           lambda self, value: self._fixed("hidden_size"))
    bias = property(lambda self: self.spec.bias_mode != "none", lambda self, value: self._fixed("bias"))
    # rnnkit's options, likewise: the parameters do not depend on these (a zoneout schedule,
    # a clip changed for fine-tuning), on those below they do
    zoneout = property(lambda self: self.spec.options()["zoneout"], lambda self, value: self._respec(zoneout=value))
    cell_clip = property(lambda self: self.spec.cell_clip, lambda self, value: self._respec(cell_clip=value))
    proj_clip = property(lambda self: self.spec.proj_clip, lambda self, value: self._respec(proj_clip=value))
    reset_after = property(lambda self: self.spec.reset_after, lambda self, value: self._fixed("reset_after"))
    peephole = property(lambda self: self.spec.peephole, lambda self, value: self._fixed("peephole"))
    coupled_gates = property(lambda self: self.spec.coupled_gates, lambda self, value: self._fixed("coupled_gates"))
    layer_norm = property(lambda self: self.spec.layer_norm, lambda self, value: self._fixed("layer_norm"))
    bias_mode = property(lambda self: self.spec.bias_mode, lambda self, value: self._fixed("bias_mode"))


class _StackAttributes(_SpecAttributes):
    """A stack's attributes (see `_SpecAttributes`); mode as torch.nn spells it."""

    mode = property(lambda self: TORCH_MODE[self.spec.mode], lambda self, value: self._fixed("mode"))
    num_layers = property(lambda self: self.spec.num_layers, lambda self, value: self._fixed("num_layers"))
    bidirectional = property(lambda self: self.spec.bidirectional, lambda self, value: self._fixed("bidirectional"))
    proj_size = property(lambda self: list(self.spec.proj_sizes) if self.spec.per_layer else self.spec.proj_sizes[0],
                         lambda self, value: self._fixed("proj_size"))
    dropout = property(lambda self: self.spec.dropout, lambda self, value: self._respec(dropout=value))
    batch_first = property(lambda self: self.spec.batch_first, lambda self, value: self._respec(batch_first=value))
    input_dropout = property(lambda self: self.spec.input_dropout, lambda self, value: self._respec(input_dropout=value))
    recurrent_dropout = property(lambda self: self.spec.recurrent_dropout,
                                 lambda self, value: self._respec(recurrent_dropout=value))
    dropconnect = property(lambda self: self.spec.dropconnect, lambda self, value: self._respec(dropconnect=value))
    merge = property(lambda self: self.spec.merge, lambda self, value: self._fixed("merge"))

    @property
    def all_weights(self):
        """torch.nn's list of per-layer-direction weight lists (torch.nn's pieces, then the extras)."""
        return [[getattr(self, name) for name in names] for names in self._all_weights]

    # ---- torch.nn.RNNBase's helpers, for code written against them (subclasses, introspection) ----

    @property
    def _all_weights(self) -> list:
        """The parameter names of each layer-direction, as torch.nn.RNNBase lists them."""
        D = self.spec.num_directions
        return [[e.name for e in self.layout if e.layer * D + e.direction == i] for i in range(self.spec.num_layers * D)]

    @property
    def _flat_weights_names(self) -> list:
        return [name for names in self._all_weights for name in names]

    @property
    def _flat_weights(self) -> list:
        """The weights as the module computes with them now (a parametrized one's value), in
        ``_flat_weights_names``' order. Read-only: assign a parameter by name to change one."""
        return [getattr(self, name) for name in self._flat_weights_names]

    def _expected_state(self, input, batch_sizes, which: int):
        """h_0's (0) or c_0's (1) shape for this input: a list of one shape per layer with per-layer
        sizes; without the batch axis for an unbatched (T, input_size) input, as the call takes it."""
        if batch_sizes is not None:
            return functional._state_shapes(self.spec, int(batch_sizes[0]))[which]
        unbatched = input.dim() == 2
        shapes = functional._state_shapes(self.spec, 1 if unbatched else input.size(0 if self.spec.batch_first else 1))
        shape = shapes[which]
        strip = lambda s: functional._unbatch_shape(s, unbatched)  # noqa: E731
        return [strip(s) for s in shape] if isinstance(shape, list) else strip(shape)

    def get_expected_hidden_size(self, input, batch_sizes=None):
        """h_0's shape for this input (a list of one shape per layer with per-layer sizes)."""
        return self._expected_state(input, batch_sizes, 0)

    def check_input(self, input, batch_sizes=None) -> None:
        """The input's rank, feature size, dtype and device (with ``batch_sizes``: a PackedSequence's 2-D data)."""
        like = self._like()
        if batch_sizes is None:
            functional.check_input(self.spec, input, like, self.spec.batch_first)
        elif not isinstance(input, torch.Tensor) or input.dim() != 2:
            raise MismatchError(f"input: expected a PackedSequence's 2-D data (rows, input_size) with batch_sizes, "
                                f"got shape {tuple(getattr(input, 'shape', ()))}")
        else:
            functional.check_tensor("input", input, (input.shape[0], self.spec.input_size), like)

    def check_hidden_size(self, hx, expected_hidden_size, msg: str = "Expected hidden size {}, got {}") -> None:
        if tuple(hx.size()) != tuple(expected_hidden_size):
            raise MismatchError(msg.format(tuple(expected_hidden_size), list(hx.size())))

    def check_forward_args(self, input, hidden, batch_sizes=None) -> None:
        """What torch.nn checks before a call: the input, then each state tensor's shape."""
        self.check_input(input, batch_sizes)
        h_shape = self.get_expected_hidden_size(input, batch_sizes)
        if self.spec.mode == "lstm":
            c_shape = self.get_expected_cell_size(input, batch_sizes)
            parts = [("hidden[0]", hidden[0], h_shape), ("hidden[1]", hidden[1], c_shape)]
        else:
            parts = [("hidden", hidden, h_shape)]
        for name, value, shape in parts:
            pairs = zip(value, shape) if self.spec.per_layer else [(value, shape)]
            for k, (tensor, expected) in enumerate(pairs):
                label = f"{name}[{k}]" if self.spec.per_layer else name
                self.check_hidden_size(tensor, expected, f"Expected {label} size {{}}, got {{}}")

    def permute_hidden(self, hx, permutation):
        """hx with its batch axis reordered by ``permutation`` (None: hx itself), for every state tensor."""
        if permutation is None:
            return hx
        return functional._map(hx, lambda t: t.index_select(1, permutation))

    def get_expected_cell_size(self, input, batch_sizes=None):
        """An LSTM's c_0 shape for this input (a list of one shape per layer with per-layer sizes)."""
        if self.spec.mode != "lstm":
            raise AttributeError(f"{type(self).__name__} has no cell state (get_expected_cell_size is an LSTM's)")
        return self._expected_state(input, batch_sizes, 1)


# a stack's per-sequence options, each with its off value (a one-step cell has none of them)
_SEQUENCE_LEVEL = {"input_dropout": 0.0, "recurrent_dropout": 0.0, "dropconnect": 0.0, "dropout": 0.0,
                   "bidirectional": False, "merge": "concat", "num_layers": 1, "batch_first": False}


def _per_sequence(name: str) -> str:
    return (f"{name}: a per-sequence option, which a one-step cell does not take; use rnnkit.LSTM / GRU / RNN "
            "(or apply the mask to the cell's input yourself)")


# the keywords the modules' constructors take beside torch.nn's arguments: RNNSpec's options and the modules' own
_KEYWORDS = frozenset(name for name, p in inspect.signature(RNNSpec.__init__).parameters.items()
                      if p.kind is p.KEYWORD_ONLY) | {"forget_bias", "backend", "device", "dtype"}


def _check_keywords(module: nn.Module, options: dict) -> None:
    """A keyword a constructor does not take: a TypeError naming the module the user built (not the
    spec it builds), with the option meant where the name is close to one, else the options there are."""
    unknown = [name for name in options if name not in _KEYWORDS]
    if not unknown:
        return
    known, kind = sorted(_KEYWORDS), type(module).__name__
    for name in unknown:
        if name == "nonlinearity":
            hint = "nonlinearity is rnnkit.RNN's and RNNCell's ('tanh' or 'relu'); an LSTM's and a GRU's are fixed"
        else:
            close = difflib.get_close_matches(name, known, n=1)
            hint = (f"did you mean {close[0]!r}?" if close else
                    f"{kind} takes torch.nn's arguments and, as keywords, {', '.join(known)}")
        raise TypeError(f"{kind}: unexpected keyword argument {name!r}: {hint}")


def _is_off(value, off) -> bool:
    """``value`` is the option's off value (0 is dropout's 0.0; False is not num_layers' 1)."""
    return isinstance(value, (bool, int, float, str)) and isinstance(value, bool) == isinstance(off, bool) and value == off


class _CellAttributes(_SpecAttributes):
    """A cell's attributes (see `_SpecAttributes`). Like torch.nn's cells it has none of a stack's
    per-sequence options (``hasattr(cell, "dropout")`` is False); setting one to anything but its
    off value raises, rather than making an attribute that nothing reads."""

    proj_size = property(lambda self: self.spec.proj_sizes[0], lambda self, value: self._fixed("proj_size"))

    def __setattr__(self, name, value) -> None:
        if name in _SEQUENCE_LEVEL and not _is_off(value, _SEQUENCE_LEVEL[name]):
            raise AttributeError(f"{type(self).__name__}.{_per_sequence(name)}")
        super().__setattr__(name, value)


class _PackedModule(_SpecAttributes, nn.Module):
    """A module whose parameters alias one packed buffer ``flat_weights``.

    Every weight is an ordinary leaf ``nn.Parameter`` registered under torch.nn's name
    (``weight_ih_l0``, ``bias_hh_l1_reverse``, ``weight_hr_l0``; the extras after them:
    ``weight_peephole_l0``, ``layer_norm_ih_weight_l0``, ...), so optimizers, param groups,
    init-by-name loops, hooks, ``requires_grad_``, parametrizations, ``functional_call`` and
    state_dicts work as with torch.nn. The parameters are views of one contiguous buffer in the
    spec's order (on CUDA, a plain stack's in cuDNN's placement), which the kernels take with no
    copy; backward writes one packed gradient and each parameter's ``.grad`` is a view of it. Anything that breaks the aliasing (a
    parametrization, ``p.data = ...``, ``load_state_dict(assign=True)``, ``set_``) still computes
    correctly, the parameters then being passed to the kernels one by one, and warns once;
    `flatten_parameters` re-establishes it.
    """

    spec: RNNSpec
    layout: Layout

    def _init_packed(self, spec: RNNSpec, suffixes: bool, backend: str, forget_bias, device, dtype) -> None:
        self.spec = spec
        self.layout = Layout(spec, suffixes=suffixes)
        self.backend = backends_.check_name(backend)
        if backend != "auto":
            reason = backends_.get(backend).unavailable_reason()
            if reason:
                raise backends_.BackendUnavailableError(f"backend={backend!r} cannot run here: {reason}")
        self.last_backend: Optional[str] = None
        entries = self.layout.entries
        self._names = tuple(e.name for e in entries)  # the layout's order
        flat = self._new_flat(device, dtype)
        views = self.weight_views(flat)
        torch_first = [e for e in entries if e.piece in TORCH_PIECES] + [e for e in entries if e.piece not in TORCH_PIECES]
        for e in torch_first:  # torch.nn's parameter order, the extras after
            self.register_parameter(e.name, nn.Parameter(views[e.name]))
        self._set_flat(flat)
        self.forget_bias = check_forget_bias(spec, forget_bias)  # here too: reset_parameters skips the meta device
        self.reset_parameters()

    # ---- the packed buffer -------------------------------------------------------------------

    def _new_flat(self, device, dtype) -> torch.Tensor:
        """A buffer for the weights on ``device`` in ``dtype``, placed as that device's kernels read
        it (sets ``_packing``, one (offset, numel, shape) per entry in the layout's order, and
        ``_cudnn_placed``): the spec's layout, or, for a plain stack on CUDA, cuDNN's own placement
        (`native.cudnn_placement`), so that cuDNN takes the buffer as it is.

        cuDNN's weight space can be larger than the pieces: a stack without biases keeps room for
        them, which cuDNN reads as biases (torch runs it with both), so it must stay zero. That
        room, past the last piece, is zeroed here and left out of `flat_weights`, so no write to
        the buffer reaches it; a placement with room between pieces is not taken (the spec's
        layout then, and cuDNN copies the weights at each call)."""
        flat = torch.empty(0, device=device, dtype=dtype)
        self._packing, numel, self._cudnn_placed = self._placement(flat)
        if not self._cudnn_placed:
            return flat.new_empty(numel)
        flat = flat.new_zeros(numel)
        self._mark_placed(flat)
        return flat

    def _canonical_packing(self) -> tuple:
        """The spec's layout as a packing: (offset, numel, shape) per entry."""
        return tuple((e.offset, e.numel, e.shape) for e in self.layout.entries)

    def _placement(self, like: torch.Tensor):
        """(packing, the buffer's numel, whether cuDNN reads it in place) for a buffer like ``like``."""
        entries = self.layout.entries
        canonical = self._canonical_packing()
        placed = None
        if like.is_floating_point() and self.layout.suffixes:  # a stack: cells never run cuDNN's RNN op
            placed = cudnn_placement(self.spec, self.layout, like.device, like.dtype)
        if placed is None:
            return canonical, self.layout.numel, False
        offsets, numel = placed
        packing = tuple((offset, e.numel, e.shape) for offset, e in zip(offsets, entries))
        if max(o + n for o, n, _ in packing) != self.layout.numel:  # room between pieces
            return canonical, self.layout.numel, False
        return packing, numel, True

    def _mark_placed(self, flat: torch.Tensor) -> None:
        """Tell the functional calls, which read the spec's layout, to refuse ``flat`` (and its views) when
        it is placed otherwise: by a tag Dynamo sees, and by its storage (`native.register_placed`)."""
        if self._packing != self._canonical_packing():
            flat._rnnkit_placed = True
            register_placed(flat)

    @property
    def flat_offsets(self) -> dict:
        """{name: offset} of each weight in `flat_weights`, in the layout's order: the spec's layout
        (``rnnkit.Layout(spec)``'s offsets), except for a plain stack on CUDA, whose buffer is
        placed as cuDNN places its weight space (cuDNN's choice, which differs between cuDNN
        versions)."""
        return {name: offset for name, (offset, _, _) in zip(self._names, self._packing)}

    def weight_views(self, flat: Optional[torch.Tensor] = None) -> dict:
        """{name: view} of each weight in ``flat`` (default `flat_weights`), at `flat_offsets`."""
        flat = self.flat_weights if flat is None else flat
        return {name: flat[offset:offset + numel].view(shape)
                for name, (offset, numel, shape) in zip(self._names, self._packing)}

    def _set_flat(self, flat: Optional[torch.Tensor]) -> None:
        self.__dict__.pop("_plan", None)  # the one-step plans hold the old memory
        self._flat = flat
        # what flat_weights shows: the pieces, without the room cuDNN keeps past them (see `_new_flat`)
        self._shown = None if flat is None or flat.numel() == self.layout.numel else flat[:self.layout.numel]
        if self._shown is not None and getattr(flat, "_rnnkit_placed", False):
            self._shown._rnnkit_placed = True
        self._warned_unpacked = False
        self._rebound = False  # a weight was assigned (module.weight_ih_l0 = ..., load_state_dict(assign=True))
        self._packed = tuple(self._parameters.get(name) for name in self._names)  # the Parameters packed

    def _like(self) -> torch.Tensor:
        """A weight: inputs and states must have its dtype and device."""
        return self._current()[0]

    def _current(self) -> list:
        """The weights as the module computes with them now (parameters, or parametrized values; in a
        forward, what the forward pre-hooks left: prune's masked weight, and what a later hook made
        of it, as torch.nn computes with)."""
        return [getattr(self, name) for name in self._names]

    def _settled(self) -> list:
        """The weights as read between calls (converters, ``flat_weights``, ``named_weights``,
        `rnnkit.quantize`): `_current`, with a pruned weight (torch.nn.utils.prune) as prune's hook
        computes it, orig * mask: the attribute the hook sets is as old as the last forward (an
        optimizer step since is not in it)."""
        tensors = self._current()
        pruned = pruning_hooks(self) if self._forward_pre_hooks else None
        if pruned:
            tensors = [pruned[name].apply_mask(self) if name in pruned else t for name, t in zip(self._names, tensors)]
        return tensors

    def _aliased(self, tensors) -> bool:
        """Whether ``tensors`` (the weights in buffer order) are exactly the packed buffer's pieces.
        The buffer's address is read now, not kept: moving a storage to shared memory (what
        torch.multiprocessing does to a module it sends to a spawned process or a DataLoader
        worker) moves the buffer and its views together, which keeps them aliased."""
        flat = self._flat
        if flat is None or tensors[0].dtype != flat.dtype:
            return False
        base, size = flat.data_ptr(), flat.element_size()
        # the layout too: ``p.data = p.data.t()`` keeps a square weight's address, not its meaning
        return all(t.data_ptr() == base + offset * size and t.shape == shape and t.is_contiguous()
                   for t, (offset, _, shape) in zip(tensors, self._packing))

    def _note_unpacked(self, tensors) -> None:
        """Warn once that the parameters no longer alias the packed buffer: a weight is parametrized,
        was assigned, or one the module packed was moved (``p.data = ...``, ``set_``). Not for
        tensors swapped in for a call without assignment, as torch.func.functional_call and FSDP
        do (they are not the module's to re-pack)."""
        if self._warned_unpacked:
            return
        registered = [self._parameters.get(name) for name in self._names]
        moved = any(p is not None and p is q for p, q in zip(registered, self._packed))
        if any(p is None for p in registered) or self._rebound or moved:
            self._warned_unpacked = True
            warnings.warn(
                f"{type(self).__name__}: the weights are not views of one packed buffer any more (a parametrization, "
                "pruning, p.data = ..., load_state_dict(assign=True) or set_ broke the aliasing), so each call passes "
                "them to the kernels one by one and flat_weights / flat_weights.grad are copies. Call "
                "flatten_parameters() to pack them again (after removing a parametrization or pruning: "
                "parametrize.remove_parametrizations, prune.remove).",
                stacklevel=3,
            )

    def _step_plans(self, input, hx, steps: int = 1, batch: int = 1) -> Optional[list]:
        """The fused kernels' plans, one per pass (weights and scalars fixed once, one C++ call a
        step, or a pass over ``steps`` steps of ``batch`` rows), when this call can take them: eager
        with plain tensors (no torch.func transform, dispatch mode or tracing), no gradient to record
        (of the parameters, the input or the state, forward-mode AD's tangents included), no
        autocast, no random masks, and, for more than one step, the backend the general path would
        choose is ``fused`` (`_plans_take_sequences`); else None.
        The plans hold the parameters' memory: they are rebuilt when a parameter, or the memory
        behind one or its layout (``p.data = ...``, ``flatten_parameters``, ``.to``), changes. Generation loops
        live on this path (README, "Speed": step API)."""
        if (self.training and self.spec.uses_dropout_masks) or not _direct(input) or forward_ad_reason():
            return None
        params = self._parameters
        tensors = tuple(params.get(name) for name in self._names)
        if torch.is_grad_enabled() and (
                any(t is None or t.requires_grad for t in tensors) or input.requires_grad
                or any(isinstance(t, torch.Tensor) and t.requires_grad for t in functional._leaves(hx))):
            return None
        if any(t is None for t in tensors):  # a parametrized weight: computed each call
            return None
        memory = memory_of(tensors)
        cached = self.__dict__.get("_plan")
        if cached is None or cached[1] != self.backend or cached[3] != memory or \
                any(a is not b for a, b in zip(cached[2], tensors)):
            cached = StepPlans((self._make_plans(tensors), self.backend, tensors, memory, {}))
            self.__dict__["_plan"] = cached
            if not self._aliased(tensors):  # as the general path says (`_pass_weights`)
                self._note_unpacked(tensors)
        plans = cached[0]
        if plans is None or functional._autocast_on(tensors[0].device):
            return None
        if steps != 1 and not self._plans_take_sequences(cached[4], tensors[0], batch):
            return None
        return plans

    def _plans_take_sequences(self, known: dict, weight: torch.Tensor, batch: int) -> bool:
        """Whether the backend chosen for a call of several steps without a gradient (nor lengths) is
        ``fused``, whose kernels the plans run: with ``"auto"`` an LSTM's padded batch of
        `backend.NATIVE_MIN_BATCH` rows or more stays on oneDNN's (`backend.select`). The answer
        depends on the batch only through that threshold, and is kept in ``known``."""
        key = batch < backends_.NATIVE_MIN_BATCH
        if key not in known:
            chosen = backends_.select(self.backend, self.spec, weight.device, weight.dtype, steps=2, batch=batch)
            known[key] = chosen.name == "fused"
        return known[key]

    def _check_pieces(self, tensors) -> None:
        """Each weight has its entry's shape, and all have one dtype and device: a weight put in
        by hand (``p.data = ...``, ``load_state_dict(assign=True)``, a parametrization,
        functional_call) is checked here, before any kernel reads it (the fused kernels take
        the sizes from the tensors they are given)."""
        first = tensors[0]
        dtype, device = getattr(first, "dtype", None), getattr(first, "device", None)
        if all(isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype and t.device == device
               for t, (_, _, shape) in zip(tensors, self._packing)):
            return  # the common case in one pass; the loop below finds what to say
        for name, t, (_, _, shape) in zip(self._names, tensors, self._packing):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor of shape {shape}, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise MismatchError(f"{name}: expected shape {shape} (this module's layout), got {tuple(t.shape)}")
            if t.dtype != first.dtype:
                raise DTypeMismatchError(f"{name}: expected dtype {first.dtype} (that of {self._names[0]}), got {t.dtype}")
            if t.device != first.device:
                raise MismatchError(f"{name}: expected a tensor on {first.device} (that of {self._names[0]}), "
                                    f"got {t.device}")

    def _make_plans(self, tensors) -> Optional[list]:
        self._check_pieces(tensors)  # one dtype and device, each weight its shape
        W = tensors[0]
        if W.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16) or any(
                not t.is_contiguous() for t in tensors):
            return None  # the general path takes these
        try:
            chosen = backends_.select(self.backend, self.spec, W.device, W.dtype, steps=1)
        except backends_.BackendUnavailableError:
            return None  # the careful path says why
        if chosen.name != "fused":
            return None
        return step_plans(self.spec, self.layout.group(dict(zip(self._names, (t.detach() for t in tensors)))), W)

    def _pass_weights(self) -> list:
        """One PassWeights per layer-direction: views of the packed buffer through `_Pack`
        when the parameters alias it and a gradient is wanted, else the parameters themselves."""
        tensors = self._current()
        eager = _plain_eager()
        if eager and self._aliased(tensors):
            if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                views = _Pack.apply(self._flat, self._packing, *tensors)
                # a frozen weight goes as itself (the same memory), so the kernels skip its gradient
                tensors = [v if t.requires_grad else t for v, t in zip(views, tensors)]
        else:  # weights put in by hand, or swapped in by a transform or a trace: checked before any kernel
            if eager:
                self._note_unpacked(tensors)
            self._check_pieces(tensors)
        return self.layout.group(dict(zip(self._names, tensors)))

    @property
    def flat_weights(self) -> torch.Tensor:
        """The packed buffer the parameters alias (at `flat_offsets`: the spec's layout, or cuDNN's
        placement for a plain stack on CUDA; `weight_views` cuts it), for cuDNN-style code. Its
        ``.grad`` is the packed gradient: a view that the parameters' ``.grad`` are slices of, after
        a backward (a copy when they are not).

        It is not itself a parameter and does not require grad: optimize ``module.parameters()``.
        When the aliasing is broken (see the class docstring) this is a copy of the weights.
        """
        tensors = self._settled()
        if self._aliased(tensors):
            flat = self._flat if self._shown is None else self._shown
        else:
            self._note_unpacked(tensors)
            flat = self._placed_copy([t.detach() for t in tensors])
        grads = [None if p is None else p.grad for p in (self._parameters.get(n) for n in self._names)]
        if all(g is None for g in grads):
            flat.grad = None
        else:
            packed = _already_packed(grads, self._packing, flat.numel())
            if packed is None:
                packed = self._placed_copy([(g if g is not None else torch.zeros_like(t)).detach()
                                            for g, t in zip(grads, tensors)], flat.numel())
            else:
                self._mark_placed(packed)
            flat.grad = packed
        return flat

    def _placed_copy(self, tensors, total: Optional[int] = None) -> torch.Tensor:
        """``tensors`` (in the layout's order) copied into one new buffer placed as `flat_offsets` say."""
        total = total or self.layout.numel
        out = tensors[0].new_empty(total) if _dense(self._packing, total) else tensors[0].new_zeros(total)
        for t, (offset, numel, _) in zip(tensors, self._packing):
            out[offset:offset + numel].copy_(t.reshape(-1))
        self._mark_placed(out)
        return out

    def flatten_parameters(self) -> None:
        """Pack the parameters into one contiguous buffer and make each a view of it again (the
        kernels then take the buffer with no copy, and backward writes one packed gradient).

        Needed only after something broke the aliasing (``p.data = ...``,
        ``load_state_dict(assign=True)``, a removed parametrization); harmless otherwise.
        Parametrized weights cannot alias the buffer while they are parametrized.
        """
        tensors = self._current()
        if self._aliased(tensors):
            return
        params = [self._parameters.get(name) for name in self._names]
        plain = [p for p in params if p is not None]
        if not plain or any(type(p.data) is not torch.Tensor for p in plain):
            return  # e.g. FSDP's sharded DTensors: they are not ours to re-pack
        first = plain[0]
        for name, p in zip(self._names, params):
            if p is not None and (p.dtype != first.dtype or p.device != first.device):
                raise (DTypeMismatchError if p.dtype != first.dtype else MismatchError)(
                    f"flatten_parameters: every weight must have one dtype and device to share a buffer, "
                    f"got {name} as {p.dtype} on {p.device} and {self._names[params.index(first)]} as "
                    f"{first.dtype} on {first.device}"
                )
        flat = self._new_flat(first.device, first.dtype)
        if first.is_shared():
            flat.share_memory_()
        with torch.no_grad():
            for t, p, (offset, numel, shape) in zip(tensors, params, self._packing):
                view = flat[offset:offset + numel].view(shape)
                view.copy_(t)
                if p is not None:
                    p.data = view
        self._set_flat(flat)

    def _apply(self, fn, recurse=True):
        # .to(), .double(), .half(), .cuda(), to_empty(): torch converts each parameter on its
        # own; pack them into one buffer of the new dtype / device again (as torch.nn's RNNs do).
        out = super()._apply(fn, recurse)
        if self._flat is not None and not self._aliased(self._current()):
            self._flat = self._shown = None  # the old buffer: nothing aliases it any more after a conversion
            self.flatten_parameters()
        return out

    def __deepcopy__(self, memo):
        """copy.deepcopy with the packed buffer copied once and each parameter a view of the copy.
        torch's Parameter deepcopy clones each parameter on its own, and the copy then packed them
        again: three copies of the weights alive at once (a 2-layer LSTM(2048): +576 MB, torch.nn's
        deepcopy +257). Where the parameters do not all alias the buffer (parametrized, pruned,
        ``p.data = ...``, cuDNN's placement) the usual way: the state's deepcopy then ``__setstate__``
        (a parametrized module's ``__dict__`` as torch's parametrize copies it, no ``__setstate__``)."""
        if id(self) in memo:
            return memo[id(self)]
        flat = self.__dict__.get("_flat")
        params = [self._parameters.get(name) for name in self._names]
        if flat is not None and self._shown is None and not self._cudnn_placed and id(flat) not in memo \
                and all(type(p) is nn.Parameter and id(p) not in memo for p in params) and self._aliased(params):
            twin = flat.clone()
            memo[id(flat)] = twin
            for p, (offset, numel, shape) in zip(params, self._packing):
                memo[id(p)] = nn.Parameter(twin[offset:offset + numel].view(shape), requires_grad=p.requires_grad)
        replica = type(self).__new__(type(self))
        memo[id(self)] = replica
        if nn.utils.parametrize.is_parametrized(self):  # its __getstate__ refuses: torch's own deepcopy of these
            replica.__dict__ = copy.deepcopy(self.__dict__, memo)
            for slot in copyreg._slotnames(type(self)):
                if hasattr(self, slot):
                    setattr(replica, slot, copy.deepcopy(getattr(self, slot), memo))
            return replica
        replica.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return replica

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_shown" not in self.__dict__:  # pickled before buffers had a placement: the spec's layout
            self.__dict__["_cudnn_placed"] = False
            flat = self.__dict__.get("_flat")
            self.__dict__["_shown"] = None if flat is None or flat.numel() == self.layout.numel else \
                flat[:self.layout.numel]
        flat = self._flat
        if flat is None:
            return
        # deepcopy clones each parameter on its own: pack them again (a pickle keeps the aliasing). A
        # buffer placed on another device or by another cuDNN than this one's (a module saved on a GPU
        # and loaded on the CPU, or the reverse) is placed again as this device's kernels read it.
        packing, numel, cudnn = self._placement(flat)
        if packing != self._packing or numel != flat.numel():
            self._flat = self._shown = None
            self.flatten_parameters()
        elif not self._aliased(self._current()):
            self.flatten_parameters()
        else:
            self._cudnn_placed = cudnn
            self._mark_placed(flat)

    def reset_parameters(self, forget_bias: Optional[float] = None) -> None:
        """Re-draw the weights as torch.nn does (uniform ±1/sqrt(H)); LN gains 1, shifts 0. A pruned
        weight's ``_orig`` is drawn (its mask kept), a parametrized one through its ``right_inverse``
        (the weight is the draw; without one, each original uniformly, as torch.nn's reset does).

        Args:
            forget_bias: the LSTM forget gate's initial bias; None: the module's ``forget_bias``
                (the constructor's), so that ``to_empty`` + ``reset_parameters()`` initializes
                as the constructor would. Set ``module.forget_bias = None`` for torch.nn's
                uniform forget-gate bias.
        """
        if forget_bias is None:
            forget_bias = getattr(self, "forget_bias", None)  # None in a module pickled before it was kept
        params = [self._parameters.get(n) for n in self._names]
        like = self._current()[0]
        if like.device.type == "meta":
            return
        if all(p is not None for p in params) and not self._cudnn_placed and self._aliased(params):
            with torch.no_grad():  # drawn straight into the buffer the parameters are views of
                initialize(self.layout, self._flat, forget_bias=forget_bias)  # (a copy doubled the peak)
            return
        fresh = torch.empty(self.layout.numel, dtype=like.dtype, device=like.device)
        initialize(self.layout, fresh, forget_bias=forget_bias)
        pruned = pruning_hooks(self) if self._forward_pre_hooks else {}
        entries = {entry.name: entry for entry in self.layout}
        with torch.no_grad():
            for name, value in self.layout.named_views(fresh).items():
                p = self._parameters.get(name)
                if p is not None:
                    p.copy_(value)
                    continue
                # a weight pruned (its _orig re-drawn, the mask kept) or parametrized: torch.nn's
                # reset re-draws what parameters() lists, the _orig and the originals, too
                target = name + "_orig" if name in pruned else name
                if not nn.utils.parametrize.is_parametrized(self, target):
                    if self._parameters.get(target) is not None:
                        self._parameters[target].copy_(value)
                    continue
                try:
                    setattr(self, target, value)  # the originals through right_inverse: the weight is the draw
                except (RuntimeError, NotImplementedError):  # no right_inverse: each original drawn, as torch.nn does
                    bound = 1.0 / math.sqrt(self.spec.hidden_sizes[entries[name].layer])
                    for original in self.parametrizations[target].parameters():
                        original.uniform_(-bound, bound)

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)
        if name in self.__dict__.get("_names", ()):
            self.__dict__["_rebound"] = True

    def named_weights(self):
        """{torch.nn name: weight} for every piece, in buffer order, as the next call computes with
        them (parametrized values; a pruned weight as orig * mask)."""
        return dict(zip(self._names, self._settled()))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:  # each entry its own storage, so safetensors accepts it; still an alias
            for name in self._names:
                key = prefix + name
                if key in destination:
                    destination[key] = _standalone(destination[key])

    def state_dict(self, *args, **kwargs):
        """torch.nn's, with the tensors a parametrization keeps of a weight (its ``original``: the
        weight itself where the parametrization has no right_inverse; weight_norm's direction) each
        in a storage of its own, as this module's own entries are: they are views of the packed
        buffer, which safetensors' save_model refuses."""
        destination = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "") + "parametrizations."
        for key, value in destination.items():
            if key.startswith(prefix) and type(value) is torch.Tensor:  # not keep_vars' Parameters
                destination[key] = _standalone(value)
        return destination

    def _load_from_state_dict(self, *args):
        load_checked(self, super()._load_from_state_dict, self._check_loaded, args)

    def _check_loaded(self, state_dict: dict, prefix: str) -> None:
        """An int8 module's codes (rnnkit.quantize's state dict) are refused by name: copy_ would
        turn them into float weights of up to ±127, whatever ``strict`` says."""
        for name in self._names:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                hint = (" (an int8 module's codes, which need their _scale: load them into rnnkit.quantize's module "
                        "of this configuration instead)" if value.dtype == torch.int8 else "")
                raise ValueError(f"{prefix}{name}: expected floating-point weights, got {value.dtype}{hint}")

    def _backend_note(self) -> str:
        ran = f", last ran: {self.last_backend}" if self.last_backend and self.backend == "auto" else ""
        return f"backend={self.backend!r}{ran}" if (self.backend != "auto" or ran) else ""


def check_cell_input(spec: RNNSpec, input) -> None:
    """A one-step cell's input: a tensor (B, input_size) or (input_size,)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input: expected a tensor (B, input_size) or (input_size,), got {type(input).__name__}")
    if input.dim() not in (1, 2):
        raise ValueError(f"input: expected a 2-D tensor (B, input_size) or 1-D (input_size,), got shape {tuple(input.shape)}")
    if input.shape[-1] != spec.input_size:  # checked here so the message shows the caller's shape
        raise MismatchError(f"input: expected feature size input_size={spec.input_size} in the last axis, got shape "
                            f"{tuple(input.shape)}")


class StepPlans(tuple):
    """A module's cached one-step plans and what they were built from, kept in its ``__dict__``
    under ``_plan``. The plans are compiled objects that neither copy nor pickle: a deepcopy drops
    them (None, rebuilt on the next call) as ``__getstate__`` does, also where a parametrized
    module's deepcopy copies the ``__dict__`` as it is."""

    def __deepcopy__(self, memo):
        return None


def memory_of(tensors) -> tuple:
    """What a step plan reads of each tensor: its address, shape and layout (``p.data = p.data.t()``
    keeps a square weight's address, ``p.data = p.data[:n]`` its address and strides)."""
    return (*map(torch.Tensor.data_ptr, tensors), *map(torch.Tensor.size, tensors),
            *map(torch.Tensor.stride, tensors))  # map: a step's few µs count


def step_plans(spec: RNNSpec, passes, like: torch.Tensor, scales=None) -> list:
    """The fused kernels' one-step plans, one per pass (``passes``: PassWeights in layer-direction
    order), in evaluation form (zoneout's expectation); ``scales``: each pass's (W_scale, R_scale,
    W_hr_scale) for int8 weights, else None."""
    from .fused import build
    from .passes import pass_scalars, pass_values

    empty = like.new_empty(0)
    plans = []
    for index, w in enumerate(passes):
        cell = spec.cell(index // spec.num_directions)
        masks = draw_pass(spec, cell, 1, 1, like, False).masks
        int8 = {} if scales is None else dict(zip(("W_scale", "R_scale", "W_hr_scale"), scales[index]))
        plans.append(build.extension().step_plan(*pass_values(pass_scalars(cell, False, masks), empty, empty, None,
                                                              tuple(w), (None,) * 4), **int8))
    return plans


def planned_call(spec: RNNSpec, plans_of, input, hx, lengths):
    """A stack's call of inference layer by layer through its plans (``plans_of(steps, batch)``: one
    per layer, or None), or None where they cannot take it (the general path then runs, and says
    what is wrong). One direction, one size for every layer, a tensor input and tensor states; the
    results are the general path's, bit for bit. Each layer's pass over the sequence (one time step
    in a generation loop) is one C++ call, where the general path spent ~25 µs of Python a call
    (checks, states, masks, the backend's choice).
    """
    if lengths is not None or type(input) is not torch.Tensor or input.dim() != 3 or spec.num_directions != 1 \
            or spec.per_layer:
        return None
    steps, batch = (input.shape[1], input.shape[0]) if spec.batch_first else input.shape[:2]
    if steps == 0 or batch == 0:
        return None
    plans = plans_of(steps, batch)
    if plans is None:
        return None
    lstm, L = spec.mode == "lstm", spec.num_layers
    if hx is None:
        states = [None] * L
    else:
        parts = hx if lstm else (hx,)
        if (lstm and (not isinstance(hx, tuple) or len(hx) != 2)) or any(
                type(t) is not torch.Tensor or t.dim() != 3 or t.shape[0] != L for t in parts):
            return None
        states = [(parts[0][layer], parts[1][layer]) if lstm else parts[0][layer] for layer in range(L)]
    hs, cs = [], []
    x = input.transpose(0, 1) if spec.batch_first else input
    for plan, state in zip(plans, states):
        out = plan.sequence(x, state)
        if out is None:
            return None
        x = out[0]
        hs.append(out[1])
        cs.append(out[2] if lstm else None)
    y = x.transpose(0, 1) if spec.batch_first else x
    h_n = torch.stack(hs)
    return (y, (h_n, torch.stack(cs))) if lstm else (y, h_n)


class _Recurrent(_StackAttributes, _PackedModule):
    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        bias_mode: Optional[str] = None,
        forget_bias: Optional[float] = None,
        backend: str = "auto",
        device=None,
        dtype=None,
        **options,
    ):
        super().__init__()
        _check_keywords(self, options)
        spec = RNNSpec(
            mode,
            input_size,
            hidden_size,
            num_layers,
            bidirectional=bidirectional,
            bias_mode=_bias_mode(bias, bias_mode),
            dropout=dropout,
            batch_first=batch_first,
            **options,
        )
        self._init_packed(spec, True, backend, forget_bias, device, dtype)

    def forward(self, input, hx=None, lengths=None):
        """Run the stack over a sequence.

        Args:
            input: (T, B, input_size), (B, T, input_size) with batch_first, (T, input_size)
                unbatched, or a PackedSequence.
            hx: initial state (zeros when None); shapes as [`rnnkit.rnn`][rnnkit.rnn] says.
            lengths: (B,) valid lengths of a padded tensor input, in any order.

        Returns:
            (output, h_n), or (output, (h_n, c_n)) for LSTM; output is a PackedSequence
            when the input is one.
        """
        cuda = type(input) is torch.Tensor and input.is_cuda  # the plans run the fused CPU kernels only
        out = None if cuda else planned_call(self.spec, lambda steps, batch: self._step_plans(input, hx, steps, batch),
                                             input, hx, lengths)
        if out is not None:
            self.__dict__["last_backend"] = "fused"  # a plain attribute: skips Module.__setattr__
            return out
        out = self._whole_native_call(input, hx, lengths)
        if out is not None:
            self.__dict__["last_backend"] = "native"
            return out
        weights = self._pass_weights()
        return functional.sequence_call(lambda *args, **kwargs: self._run(weights, *args, **kwargs), input, hx, lengths,
                                        self.spec.batch_first)

    def _whole_native_call(self, input, hx, lengths):
        """The call in torch's one RNN op, as torch.nn's forward makes it, where the general path
        would choose ``native`` for it, or None (the general path then runs, and says what is
        wrong): eager, a padded 3-D input of the weights' dtype and device, no lengths, states None
        or stacked tensors of the right shapes, the parameters aliasing the packed buffer, no
        autocast, and no dropout masks of masks.py to draw (dropout between layers in training on
        the CPU). The results are the general path's, bit for bit; on CUDA it saves the general
        path's launches (zeros and stacks per pass) and ~40-100 µs of Python a call, which
        cuDNN-sized calls pay in full (issue 16: native read 0.7-0.9 of torch.nn's speed)."""
        spec = self.spec
        packed = type(input) is PackedSequence
        if lengths is not None or spec.per_layer or not (packed or (type(input) is torch.Tensor and input.dim() == 3)):
            return None
        data = input.data if packed else input
        tensors = self._current()
        W = tensors[0]
        if type(data) is not torch.Tensor or data.dtype != W.dtype or data.device != W.device or not _plain_eager() \
                or functional._autocast_on(W.device) or not self._aliased(tensors) \
                or data.dim() == 0 or data.shape[-1] != spec.input_size:  # the general path's checks and messages
            return None
        if self.training and spec.dropout and spec.num_layers > 1 and W.device.type != "cuda":
            return None
        if packed:
            functional._check_packed(input)  # the general path's check and message
            if data.shape[0] == 0:
                return None
            steps, batch = input.batch_sizes.shape[0], int(input.batch_sizes[0])
        else:
            steps, batch = (input.shape[1], input.shape[0]) if spec.batch_first else input.shape[:2]
        if steps == 0 or batch == 0:
            return None
        if hx is not None:
            lstm, LD = spec.mode == "lstm", spec.num_layers * spec.num_directions
            parts = hx if lstm else (hx,)
            if (lstm and (type(hx) is not tuple or len(hx) != 2)) or any(
                    type(t) is not torch.Tensor or t.dtype != W.dtype or t.device != W.device for t in parts):
                return None
            shapes = ((LD, batch, spec.proj_sizes[0] or spec.hidden_sizes[0]), (LD, batch, spec.hidden_sizes[0]))
            if any(tuple(t.shape) != shape for t, shape in zip(parts, shapes)):
                return None
        grad = torch.is_grad_enabled() and (data.requires_grad or any(t.requires_grad for t in tensors) or (
            hx is not None and any(t.requires_grad for t in (hx if type(hx) is tuple else (hx,)))))
        if W.device.type == "cpu" and (self.backend == "fused" or (self.backend == "auto" and backends_.fused_first(
                spec, W.dtype, steps=steps, grad=grad, batch=batch, lengths=packed))):
            # the general path's choice is the fused kernels (or, where they cannot run, what it says),
            # never this one: asking select costs ~25 µs of a call (a small LSTM's 5.8 ms forward)
            return None
        try:
            chosen = backends_.select(self.backend, spec, W.device, W.dtype, steps=steps, grad=grad, batch=batch,
                                      lengths=packed)
        except backends_.BackendUnavailableError:
            return None
        if chosen.name != "native":
            return None
        # One packed gradient, of which each .grad is a view, as `_pass_weights` gives: cuDNN's backward
        # writes its weight gradient as one buffer placed as the weights are (which `flat_weights.grad`
        # finds) when it reads the buffer in place and the stack has both biases: torch's
        # `_cudnn_rnn_backward_weight` returns views of that buffer only where its pieces per layer (4,
        # 5 with a projection, biases included) match the op's (2 or 3 without biases), and copies a
        # bias-less stack's out (test_native_gradients_are_views_of_one_packed_gradient failed so on an
        # H200); oneDNN's is one tensor per weight: through `_Pack`
        cudnn = W.is_cuda and self._cudnn_placed and spec.bias_mode == "double" and torch.backends.cudnn.enabled \
            and torch.cudnn_is_acceptable(W)
        if grad and not cudnn and any(t.requires_grad for t in tensors):
            views = _Pack.apply(self._flat, self._packing, *tensors)
            tensors = [v if t.requires_grad else t for v, t in zip(views, tensors)]
        if not packed:
            return chosen.run_whole(spec, tensors, input, hx, self.training, spec.batch_first)
        order, unorder = input.sorted_indices, input.unsorted_indices
        hx = functional._batch_permuted(hx, order, batch)  # the states come in the caller's batch order, as torch.nn's
        y, hy = chosen.run_whole(spec, tensors, data, hx, self.training, False, input.batch_sizes)
        return PackedSequence(y, input.batch_sizes, order, unorder), functional._batch_permuted(hy, unorder, batch)

    def _run(self, weights, input, hx, lengths, batch_first, padding_unread=False):
        y, hy, ran = functional.run(self.spec, weights, input, hx, lengths, training=self.training, backend=self.backend,
                                    batch_first=batch_first, like=weights[0].W, padding_unread=padding_unread)
        if not torch.compiler.is_compiling():
            self.__dict__["last_backend"] = ran  # a plain attribute: skips Module.__setattr__
        return y, hy

    def extra_repr(self) -> str:
        defaults = RNNSpec(self.spec.mode, 1, 1).options()
        shown = {"input_size", "hidden_size"}
        parts = [f"{self.spec.input_size}, {self.hidden_size}"]
        for key, value in self.spec.options().items():
            if key not in shown and key != "mode" and value != defaults[key]:
                parts.append(f"{key}={value!r}")
        note = self._backend_note()
        return ", ".join(parts + ([note] if note else []))


class LSTM(_Recurrent):
    """Multi-layer LSTM, a drop-in for `torch.nn.LSTM`, with every variant of the spec.

    For each layer and direction, gates in cuDNN / PyTorch order i, f, g, o:

    ```text
    i = σ(W_i x_t + b_Wi + R_i h_{t-1} + b_Ri [+ p_i ∘ c_{t-1}])
    f = σ(W_f x_t + b_Wf + R_f h_{t-1} + b_Rf [+ p_f ∘ c_{t-1}])      coupled_gates: f = 1 − i
    g = tanh(W_g x_t + b_Wg + R_g h_{t-1} + b_Rg)
    c_t = f ∘ c_{t-1} + i ∘ g                                         clamped to ±cell_clip if set
    o = σ(W_o x_t + b_Wo + R_o h_{t-1} + b_Ro [+ p_o ∘ c_t])
    h_t = o ∘ tanh(c_t)                                               proj_size: h_t = W_hr h_t (±proj_clip)
    ```

    With `layer_norm` the input and recurrent pre-activations are normalized separately and
    `h_t = o ∘ tanh(LN_c(c_t))`; zoneout, variational dropout and DropConnect act as
    docs/spec.md says.

    Args:
        input_size: I, the features of the input.
        hidden_size: H, an int, or a list with one entry per layer (states then become per-layer lists).
        num_layers: L, stacked layers.
        bias: False is `bias_mode="none"`.
        batch_first: input and output are (B, T, ·) instead of (T, B, ·).
        dropout: dropout on every layer's output but the last (training only).
        bidirectional: add a reverse direction (D = 2).
        proj_size: P, the LSTMP projection (0 = none), an int or a per-layer list, P < H.
        **options: the spec's other options, by keyword: `peephole`, `coupled_gates`, `cell_clip`,
            `proj_clip`, `layer_norm`, `zoneout` (p, or `(p_h, p_c)`), `input_dropout`,
            `recurrent_dropout`, `dropconnect`, `merge` ("concat" or "sum"), `bias_mode` ("double",
            "single_input", "single_recurrent", "none"), `forget_bias` (initial forget-gate bias),
            `backend` ("auto", "native", "fused", "triton", "reference"), `device`, `dtype`.
            [`RNNSpec`][rnnkit.RNNSpec] documents each.

    The call `lstm(input, hx=None, lengths=None)` takes:

    - input: (T, B, I), (B, T, I) with `batch_first`, (T, I) unbatched, or a `PackedSequence`.
    - hx: `(h_0, c_0)` with h_0 (L·D, B, Hr) and c_0 (L·D, B, H), Hr = P or H; zeros when None.
      With per-layer sizes each is a list of L tensors (D, B, Hr_k) / (D, B, H_k).
    - lengths: (B,) integers in [1, T] in any order, for a padded tensor input: steps past a
      sequence's length output zeros and leave its state alone.

    It returns `(output, (h_n, c_n))`: output (T, B, D·Hr) (Hr with `merge="sum"`), or a
    `PackedSequence` when the input is one; h_n and c_n shaped like h_0 and c_0.

    Attributes:
        weight_ih_l{k}{_reverse} (nn.Parameter): W of layer k, (4H, I) for k = 0, else (4H, D·Hr); 3H rows
            instead of 4H here and below with coupled gates.
        weight_hh_l{k}{_reverse} (nn.Parameter): R, (4H, Hr).
        bias_ih_l{k}{_reverse}, bias_hh_l{k}{_reverse} (nn.Parameter): b_W and b_R, (4H,), as `bias_mode` keeps them.
        weight_hr_l{k}{_reverse} (nn.Parameter): W_hr, (P, H), with a projection.
        weight_peephole_l{k}{_reverse} (nn.Parameter): the diagonal peepholes, rows i, f, o: (3, H); (2, H) rows i, o with coupled gates.
        layer_norm_{ih,hh}_{weight,bias}_l{k}{_reverse} (nn.Parameter): LN gains (init 1) and shifts (init 0), (4H,).
        layer_norm_c_{weight,bias}_l{k}{_reverse} (nn.Parameter): LN of the cell, (H,).
        flat_weights (torch.Tensor): the one packed buffer all of the above are views of, in the spec's order.
        last_backend (str): the backend that ran the last eager call.

    Example:
        >>> lstm = rnnkit.LSTM(10, 20, num_layers=2, peephole=True, zoneout=0.1)
        >>> y, (h_n, c_n) = lstm(torch.randn(5, 3, 10))    # y: (5, 3, 20), h_n: (2, 3, 20)
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, **options):
        super().__init__("lstm", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size=proj_size, **options)


class GRU(_Recurrent):
    """Multi-layer GRU, a drop-in for `torch.nn.GRU`, with every variant of the spec.

    For each layer and direction, gates in cuDNN / PyTorch order r, z, n:

    ```text
    r = σ(W_r x_t + b_Wr + R_r h_{t-1} + b_Rr)
    z = σ(W_z x_t + b_Wz + R_z h_{t-1} + b_Rz)
    n = tanh(W_n x_t + b_Wn + r ∘ (R_n h_{t-1} + b_Rn))        reset_after=True (cuDNN, PyTorch; default)
    n = tanh(W_n x_t + b_Wn + R_n (r ∘ h_{t-1}) + b_Rn)        reset_after=False (Keras, ONNX's default)
    h_t = (1 − z) ∘ n + z ∘ h_{t-1}
    ```

    Args:
        input_size: I, the features of the input.
        hidden_size: H, an int, or a list with one entry per layer (states then become per-layer lists).
        num_layers: L, stacked layers.
        bias: False is `bias_mode="none"`.
        batch_first: input and output are (B, T, ·) instead of (T, B, ·).
        dropout: dropout on every layer's output but the last (training only).
        bidirectional: add a reverse direction (D = 2).
        **options: `reset_after`, `layer_norm` (reset_after only), `zoneout`, `input_dropout`,
            `recurrent_dropout`, `dropconnect`, `merge`, `bias_mode`, `backend`, `device`,
            `dtype`; [`RNNSpec`][rnnkit.RNNSpec] documents each.

    The call `gru(input, hx=None, lengths=None)` takes input as [`LSTM`][rnnkit.LSTM] does and
    h_0 (L·D, B, H) (per-layer sizes: a list of L tensors (D, B, H_k)); it returns
    `(output, h_n)`, output (T, B, D·H).

    Attributes:
        weight_ih_l{k}{_reverse} (nn.Parameter): W, (3H, I) for layer 0, else (3H, D·H).
        weight_hh_l{k}{_reverse} (nn.Parameter): R, (3H, H).
        bias_ih_l{k}{_reverse}, bias_hh_l{k}{_reverse} (nn.Parameter): b_W and b_R, (3H,).
        layer_norm_{ih,hh}_{weight,bias}_l{k}{_reverse} (nn.Parameter): LN gains and shifts, (3H,).
        flat_weights (torch.Tensor): the packed buffer the parameters are views of.
        last_backend (str): the backend that ran the last eager call.

    Example:
        >>> gru = rnnkit.GRU(10, 20, bidirectional=True, reset_after=False)
        >>> y, h_n = gru(torch.randn(5, 3, 10))             # y: (5, 3, 40), h_n: (2, 3, 20)
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, **options):
        super().__init__("gru", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         **options)


class RNN(_Recurrent):
    """Multi-layer Elman RNN, a drop-in for `torch.nn.RNN`: `h_t = act(W x_t + b_W + R h_{t-1} + b_R)`.

    Args:
        input_size: I, the features of the input.
        hidden_size: H, an int, or a list with one entry per layer.
        num_layers: L, stacked layers.
        nonlinearity: "tanh" (default) or "relu".
        bias: False is `bias_mode="none"`.
        batch_first: input and output are (B, T, ·) instead of (T, B, ·).
        dropout: dropout on every layer's output but the last (training only).
        bidirectional: add a reverse direction (D = 2).
        **options: `layer_norm`, `zoneout`, `input_dropout`, `recurrent_dropout`, `dropconnect`,
            `merge`, `bias_mode`, `backend`, `device`, `dtype`; [`RNNSpec`][rnnkit.RNNSpec]
            documents each.

    The call `rnn(input, hx=None, lengths=None)` takes and returns what [`GRU`][rnnkit.GRU]'s does.

    Attributes:
        weight_ih_l{k}{_reverse} (nn.Parameter): W, (H, I) for layer 0, else (H, D·H).
        weight_hh_l{k}{_reverse} (nn.Parameter): R, (H, H).
        bias_ih_l{k}{_reverse}, bias_hh_l{k}{_reverse} (nn.Parameter): b_W and b_R, (H,).
        flat_weights (torch.Tensor): the packed buffer the parameters are views of.
        last_backend (str): the backend that ran the last eager call.

    Example:
        >>> rnn = rnnkit.RNN(10, 20, nonlinearity="relu", layer_norm=True)
        >>> y, h_n = rnn(torch.randn(5, 3, 10))
    """

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, **options):
        super().__init__(_rnn_mode(nonlinearity), input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, **options)

    nonlinearity = _NONLINEARITY


# ---- cells: one step, for generation --------------------------------------------------

class _Cell(_CellAttributes, _PackedModule):
    def __init__(self, mode, input_size, hidden_size, bias=True, *, bias_mode=None, forget_bias=None,
                 backend="auto", device=None, dtype=None, **options):
        super().__init__()
        _check_keywords(self, options)
        sequence_level = sorted(set(options) & set(_SEQUENCE_LEVEL))
        if sequence_level:
            raise TypeError(_per_sequence(sequence_level[0]))
        for name, value in (("hidden_size", hidden_size), ("proj_size", options.get("proj_size", 0))):
            if isinstance(value, (list, tuple)):
                raise TypeError(f"{name}: expected an int for a cell (a list gives a stack's per-layer sizes), got "
                                f"{type(value).__name__} {value!r}")
        spec = RNNSpec(mode, input_size, hidden_size, 1, bias_mode=_bias_mode(bias, bias_mode), **options)
        self._init_packed(spec, False, backend, forget_bias, device, dtype)

    def _forward(self, input, hx):
        plans = self._step_plans(input, hx) if isinstance(input, torch.Tensor) else None
        if plans is not None:
            out = plans[0](input, hx)
            if out is not None:
                self.__dict__["last_backend"] = "fused"  # a plain attribute: skips Module.__setattr__
                return out
        return self._step(input, hx)

    def _step(self, input, hx):
        """One step, straight to the backend's pass (no stack loop, no state lists)."""
        spec = self.spec
        check_cell_input(spec, input)
        if torch.compiler.is_exporting():
            from .interop import onnx_ops

            if onnx_ops.exporting():  # refused as the stacks refuse, where the user called, not in the op's translation
                onnx_ops.check_exportable(spec)
        w = self._pass_weights()[0]
        low = functional._autocast_dtype(w.W.device, w.W.dtype)
        if low is not None:  # the stacks' autocast policy (functional.run)
            input, hx = functional._to_dtype(input, low), functional._to_dtype(hx, low)
            w = PassWeights(*(None if t is None else t.to(low) for t in w))
        functional.check_tensor("input", input, None, w.W)
        unbatched = input.dim() == 1
        B = 1 if unbatched else input.shape[0]
        cell = spec.cell(0)
        lstm = spec.mode == "lstm"
        if hx is None:
            h0 = input.new_zeros(B, cell.output_size)
            c0 = input.new_zeros(B, cell.hidden_size) if lstm else None
        else:
            parts = functional.check_cell_states(spec, hx, input, w.W)
            h0 = parts[0].reshape(B, cell.output_size)  # sizes spelled out: B may be 0
            c0 = parts[1].reshape(B, cell.hidden_size) if lstm else None
        x = input.reshape(B, spec.input_size)
        chosen = backends_.select(self.backend, spec, x.device, x.dtype, steps=1)
        # under autocast, the policy above and nothing else (functional.run's shield)
        with torch.autocast(x.device.type, enabled=False) if functional._autocast_on(x.device) else nullcontext():
            if hasattr(chosen, "step"):
                h, c = chosen.step(spec, w, x, h0, c0)
            else:
                masks = draw_pass(spec, cell, 1, B, x, self.training).masks
                _, h, c = chosen.run_pass(cell, x.unsqueeze(0), h0, c0, w, None, False, masks)
        if not torch.compiler.is_compiling():
            self.__dict__["last_backend"] = chosen.name  # a plain attribute: skips Module.__setattr__
        if unbatched:
            h, c = h[0], (c[0] if lstm else None)
        return (h, c) if lstm else h

    def extra_repr(self) -> str:
        note = self._backend_note()
        return f"{self.input_size}, {self.hidden_size}" + (f", {note}" if note else "")


class LSTMCell(_Cell):
    """One LSTM step, a drop-in for `torch.nn.LSTMCell`, with the LSTM's cell options.

    The step of [`LSTM`][rnnkit.LSTM] (its equations) for one layer and direction, for
    generation loops and custom recurrences. In inference (no gradient to record) each call is
    one C++ call on the CPU: the step costs the kernel plus a few microseconds.

    Args:
        input_size: I.
        hidden_size: H.
        bias: False is `bias_mode="none"`.
        **options: `proj_size`, `peephole`, `coupled_gates`, `cell_clip`, `proj_clip`,
            `layer_norm`, `zoneout` (p or `(p_h, p_c)`), `bias_mode`, `forget_bias`, `backend`,
            `device`, `dtype`. Variational dropout and DropConnect are per-sequence options of
            [`LSTM`][rnnkit.LSTM].

    Attributes:
        weight_ih (nn.Parameter): W, (4H, I).
        weight_hh (nn.Parameter): R, (4H, Hr), Hr = P with a projection, else H.
        bias_ih, bias_hh (nn.Parameter): b_W and b_R, (4H,).
        weight_hr, weight_peephole, layer_norm_* (nn.Parameter): as in [`LSTM`][rnnkit.LSTM], without suffixes.
        flat_weights (torch.Tensor): the packed buffer the parameters are views of.

    Example:
        >>> cell = rnnkit.LSTMCell(10, 20, peephole=True)
        >>> h, c = cell(torch.randn(3, 10))
        >>> h, c = cell(torch.randn(3, 10), (h, c))    # generation: carry the state
    """

    def __init__(self, input_size, hidden_size, bias=True, **options):
        super().__init__("lstm", input_size, hidden_size, bias, **options)

    def forward(self, input, hx=None):
        """One step.

        Args:
            input: (B, I), or (I,) unbatched.
            hx: `(h, c)` with h (B, Hr) and c (B, H) (unbatched: (Hr,), (H,)); zeros when None.

        Returns:
            `(h', c')`, shaped like h and c.
        """
        return self._forward(input, hx)


class GRUCell(_Cell):
    """One GRU step, a drop-in for `torch.nn.GRUCell`, with the GRU's cell options.

    The step of [`GRU`][rnnkit.GRU] for one layer and direction.

    Args:
        input_size: I.
        hidden_size: H.
        bias: False is `bias_mode="none"`.
        **options: `reset_after`, `layer_norm`, `zoneout`, `bias_mode`, `backend`, `device`, `dtype`.

    Attributes:
        weight_ih (nn.Parameter): W, (3H, I).
        weight_hh (nn.Parameter): R, (3H, H).
        bias_ih, bias_hh (nn.Parameter): b_W and b_R, (3H,).

    Example:
        >>> cell = rnnkit.GRUCell(10, 20, reset_after=False)
        >>> h = cell(torch.randn(3, 10))
    """

    def __init__(self, input_size, hidden_size, bias=True, **options):
        super().__init__("gru", input_size, hidden_size, bias, **options)

    def forward(self, input, hx=None):
        """One step: input (B, I) or (I,), h (B, H) or (H,) or None (zeros) -> h', shaped like h."""
        return self._forward(input, hx)


class RNNCell(_Cell):
    """One Elman RNN step, a drop-in for `torch.nn.RNNCell`: `h' = act(W x + b_W + R h + b_R)`.

    Args:
        input_size: I.
        hidden_size: H.
        bias: False is `bias_mode="none"`.
        nonlinearity: "tanh" (default) or "relu".
        **options: `layer_norm`, `zoneout`, `bias_mode`, `backend`, `device`, `dtype`.

    Attributes:
        weight_ih (nn.Parameter): W, (H, I).
        weight_hh (nn.Parameter): R, (H, H).
        bias_ih, bias_hh (nn.Parameter): b_W and b_R, (H,).

    Example:
        >>> cell = rnnkit.RNNCell(10, 20, nonlinearity="relu")
        >>> h = cell(torch.randn(3, 10))
    """

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", **options):
        super().__init__(_rnn_mode(nonlinearity), input_size, hidden_size, bias, **options)

    nonlinearity = _NONLINEARITY

    def forward(self, input, hx=None):
        """One step: input (B, I) or (I,), h (B, H) or (H,) or None (zeros) -> h', shaped like h."""
        return self._forward(input, hx)
