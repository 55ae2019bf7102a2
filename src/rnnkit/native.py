"""The native backend: torch's own RNN ops (oneDNN on CPU, cuDNN on GPU) for plain configurations.

What the vendor kernels compute is exactly the spec's plain cell, so for those configurations
rnnkit hands the module's parameters to ``torch._VF.lstm / gru / rnn_*`` as the weight list. The
parameters alias one contiguous buffer in cuDNN's order, so nothing is copied or re-packed per
call. Everything else (peepholes, layer norm, zoneout, variational dropout, ...) is not what these
kernels compute and goes to another backend: which options those are is read from the option
table (``rnnkit.spec.OPTIONS``, column ``native``).
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .masks import layer_dropout
from .passes import forward_ad_reason
from .spec import RNNSpec, options_in_use

_OPS = {"lstm": "lstm", "gru": "gru", "rnn_tanh": "rnn_tanh", "rnn_relu": "rnn_relu"}
_CELLS = {"lstm": "lstm_cell", "gru": "gru_cell", "rnn_tanh": "rnn_tanh_cell", "rnn_relu": "rnn_relu_cell"}


def _amx() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's bfloat16 / float16 RNN kernels then use."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


_LOW = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported, torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}

_TORCH_SLOTS = ("W", "R", "b_W", "b_R", "W_hr")  # torch.nn's _flat_weights order within a pass
_CUDNN_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}  # cudnnRNNMode_t
_CUDNN_PLACEMENTS: Dict[tuple, Optional[Tuple[Tuple[int, ...], int]]] = {}
_PLACED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()  # storage address -> buffer


def register_placed(flat: torch.Tensor) -> None:
    """Remember ``flat`` as a module's buffer in cuDNN's placement (not the spec's layout)."""
    address = _address(flat)
    if address:
        _PLACED[address] = flat


def _address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (inside torch.func's wrappers), or 0 where it has none
    (fake and meta tensors)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(tensor) or functorch.is_legacy_batchedtensor(tensor):
        tensor = functorch.get_unwrapped(tensor)
    if isinstance(tensor, torch._subclasses.FakeTensor) or tensor.device.type == "meta":
        return 0
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def is_placed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a module's buffer placed as cuDNN places its weight space, or lies in
    one: itself, ``flat_weights`` or its gradient (tagged, which torch.compile sees too), and, in
    eager calls, a view or ``.detach()`` of one (by its storage). A copy of one's own is not
    recognized, nor a view under torch.compile."""
    if getattr(tensor, "_rnnkit_placed", False):
        return True
    if torch.compiler.is_compiling() or not _PLACED:
        return False
    global _stored_is_placed
    if _stored_is_placed is None:  # made here, not at import: torch.compiler.disable imports Dynamo (and Triton)
        _stored_is_placed = torch.compiler.disable(_stored_is_placed_eagerly)  # should Dynamo get here: a break
    return _stored_is_placed(tensor)


_stored_is_placed = None


def _stored_is_placed_eagerly(tensor: torch.Tensor) -> bool:
    address = _address(tensor)
    owner = _PLACED.get(address) if address else None
    return owner is not None and _address(owner) == address


def cudnn_placement(spec: RNNSpec, layout, device, dtype) -> Optional[Tuple[Tuple[int, ...], int]]:
    """Where cuDNN wants each of ``layout``'s pieces in its weight space, for a plain stack on a
    CUDA device -> (one offset per entry, in the layout's order; the weight space's numel), or
    None where cuDNN will not read this stack's weights (not CUDA, cuDNN off or refusing the
    dtype, options torch's RNN ops do not compute).

    Asked of cuDNN itself, once per (spec, device, dtype): torch's flatten (the one torch.nn's
    ``flatten_parameters`` runs) packs placeholder weights into a new weight space and points
    them at their places in it. The placement is cuDNN's, not a rule: cuDNN 8 put each layer's
    biases after its matrices, cuDNN 9.19 puts every matrix first and the biases after them all,
    and its weight space can be larger than the pieces (bias=False). A buffer laid out so is the
    one torch's ``_cudnn_rnn`` takes as it is (``try_get_weight_buf``), with no copy per call."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.backends.cudnn.enabled or options_in_use(spec, native=False):
        return None
    if _fake_mode():  # no cuDNN to ask under a fake mode (and its answer must not be kept for real tensors)
        return None
    if spec.bias_mode not in ("double", "none") or len(set(spec.hidden_sizes)) != 1 or len(set(spec.proj_sizes)) != 1:
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (spec, device, dtype)
    if key not in _CUDNN_PLACEMENTS:
        _CUDNN_PLACEMENTS[key] = _ask_cudnn(spec, layout, device, dtype)
    return _CUDNN_PLACEMENTS[key]


def cudnn_report(device="cuda") -> str:
    """One line for ``rnnkit doctor``: cuDNN's version, and how it places a plain stack's weights
    (a two-layer float32 LSTM asked for) -- whether rnnkit's CUDA buffers follow a placement of
    cuDNN's own, the spec's layout, or cuDNN will not read them in place."""
    from .params import Layout

    version = torch.backends.cudnn.version()
    if version is None:
        return "not available (the native backend runs torch's CUDA kernels without cuDNN)"
    name = f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    if not torch.backends.cudnn.enabled:
        return f"{name}, disabled (torch.backends.cudnn.enabled is False)"
    spec = RNNSpec("lstm", 8, 8, 2)
    layout = Layout(spec)
    placed = cudnn_placement(spec, layout, device, torch.float32)
    if placed is None:
        how = "cuDNN declined to place a plain LSTM's weights: the native backend's calls copy them"
    elif placed == (tuple(e.offset for e in layout.entries), layout.numel):
        how = "it places a plain stack's weights as the spec's layout: cuDNN reads rnnkit's buffers in place"
    else:
        how = ("it places a plain stack's weights its own way, and rnnkit's CUDA buffers follow it "
               "(module.flat_offsets): cuDNN reads them in place")
    return f"{name}; {how}"


def _fake_mode() -> bool:
    try:
        return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    except (AttributeError, RuntimeError):
        return False


def _ask_cudnn(spec: RNNSpec, layout, device, dtype) -> Optional[Tuple[Tuple[int, ...], int]]:
    entries = layout.entries
    placeholders = [torch.zeros(e.shape, device=device, dtype=dtype) for e in entries]
    if not torch.cudnn_is_acceptable(placeholders[0]):  # the check torch's RNN ops make
        return None
    per_pass = sum(1 for e in entries if e.layer == 0 and e.direction == 0)
    try:
        with torch.no_grad():
            flat = torch._cudnn_rnn_flatten_weight(
                placeholders, per_pass, spec.input_size, _CUDNN_MODES[spec.mode], spec.hidden_sizes[0],
                spec.proj_sizes[0], spec.num_layers, False, spec.bidirectional)
    except RuntimeError:  # cuDNN refused the configuration: it will not read these weights either
        return None
    storage = flat.untyped_storage().data_ptr()
    if flat.dim() != 1 or flat.storage_offset() != 0 or any(
            t.untyped_storage().data_ptr() != storage or not t.is_contiguous() for t in placeholders):
        return None
    return tuple(t.storage_offset() for t in placeholders), flat.numel()


def _train_flag(x: torch.Tensor, dropout: float, tensors) -> bool:
    """The ``train`` argument of torch's RNN ops: on with dropout, and on CUDA whenever a gradient
    is to be computed of ``x`` or ``tensors`` (cuDNN keeps what its backward needs only then),
    whatever the module's train() flag says; off on the CPU otherwise, as rnnkit has always run oneDNN."""
    if dropout:
        return True
    return x.device.type == "cuda" and torch.is_grad_enabled() and (
        x.requires_grad or any(t.requires_grad for t in tensors))


class NativeBackend:
    """torch.nn's own kernels (oneDNN / cuDNN) for the configurations they compute."""

    name = "native"

    def unavailable_reason(self) -> Optional[str]:
        return None

    def status(self) -> str:
        return "available"

    def unsupported_reason(self, spec: RNNSpec, device, dtype) -> Optional[str]:
        extras = options_in_use(spec, native=False)
        if extras:
            return f"torch's RNN kernels compute only the plain cell, not {', '.join(extras)}"
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            return f"runs on cpu and cuda tensors, got device {device}"
        if not dtype.is_floating_point:
            return f"needs a floating-point dtype, got {dtype}"
        if torch.compiler.is_compiling():  # first: Dynamo cannot trace the oneDNN probe below
            if device.type == "cpu":
                return ("under torch.compile / torch.export on the CPU every cell family runs on the fused "
                        "backend's custom ops (torch's oneDNN LSTM op, mkldnn_rnn_layer, cannot be traced)")
        elif torch._C._functorch.peek_interpreter_stack() is not None:
            return ("torch.func transforms (vmap) have no rule for torch's RNN ops; the fused and triton backends' "
                    "custom ops have one")
        if device.type == "cpu" and dtype in _LOW and not _LOW[dtype]():
            return (f"{dtype} on this CPU: oneDNN has no {dtype} RNN kernel without the CPU's {dtype} instructions "
                    "(torch.nn's LSTM fails the same way); the fused backend computes it")
        if device.type == "cpu" and any(spec.proj_sizes):
            return "proj_size on the CPU: torch runs LSTMP without oneDNN (its slow path); the fused backend computes it"
        return forward_ad_reason()  # oneDNN's LSTM (mkldnn_rnn_layer) has no forward-mode AD formula

    def training_reason(self, spec: RNNSpec, device, dtype) -> Optional[str]:
        """Why a call that records a gradient cannot run here, or None (`backend.select` asks it then)."""
        if torch.device(device).type == "cpu" and dtype in _LOW and _amx():
            return (f"{dtype} training on a CPU with AMX: oneDNN's backward there gives wrong gradients (torch 2.13: "
                    "a 1024-wide LSTM's input gradient 119% off float64; README, 'On an Intel Xeon with AMX'); the "
                    "fused backend computes it")
        return None

    def step(self, spec, w, x, h0, c0):
        """One step of a one-layer, one-direction cell, as torch.nn's cells compute it -> (h, c or None)."""
        op = getattr(torch._VF, _CELLS[spec.mode])
        if spec.mode == "lstm":
            return op(x, (h0, c0), w.W, w.R, w.b_W, w.b_R)
        return op(x, h0, w.W, w.R, w.b_W, w.b_R), None

    def run_stack(self, spec, weights, x, h0s, c0s, lengths, training):
        """Whole stack through torch._VF -> (y [T, B, F], h_ns, c_ns) as functional.run_stack.

        With dropout between layers in training on the CPU, layer by layer: the dropout masks
        come from masks.py, as for every backend (torch's op would draw its own, on packed data
        with lengths), so a seed gives the same masks whichever backend runs. On CUDA, cuDNN
        draws them in its one call, as torch.nn's does: cuDNN reads a stack's weights in place only
        from its weight space's first byte, and its placement (`cudnn_placement`) need not keep a
        layer's pieces together, so a layer run alone would have its weights copied at each call."""
        if training and spec.dropout and spec.num_layers > 1 and x.device.type == "cuda":
            return self._run(spec, spec.num_layers, weights, x, h0s, c0s, lengths, dropout=spec.dropout)
        if training and spec.dropout and spec.num_layers > 1:
            D, y, h_ns, c_ns = spec.num_directions, x, [], []
            for layer in range(spec.num_layers):
                part = slice(layer * D, (layer + 1) * D)
                y, h_n, c_n = self._run(spec, 1, weights[part], y, h0s[part], None if c0s is None else c0s[part],
                                        lengths)
                h_ns += h_n
                c_ns = None if c_n is None else c_ns + c_n
                if layer < spec.num_layers - 1:
                    y = layer_dropout(y, spec.dropout)
            return y, h_ns, c_ns
        return self._run(spec, spec.num_layers, weights, x, h0s, c0s, lengths)

    def run_whole(self, spec, weights, x, hx, training: bool, batch_first: bool, batch_sizes=None):
        """A module's call in one op, as torch.nn's forward makes it -> (y, h_n) or (y, (h_n, c_n)).

        ``weights`` are the stack's weights in torch.nn's order (`Layout` order for a plain stack),
        ``x`` a padded 3-D tensor (or a PackedSequence's data, with its ``batch_sizes``), ``hx`` None
        or the states stacked over layer-directions (in the packed batch's order), all of one dtype
        and device and checked by the caller (`_Recurrent._whole_native_call`). What
        `run_stack` does in several ops (the states split per pass and stacked again, zeros per
        pass): on a GPU each of those is a kernel launch."""
        lstm, L = spec.mode == "lstm", spec.num_layers
        if hx is None:
            B = int(batch_sizes[0]) if batch_sizes is not None else x.shape[0 if batch_first else 1]
            zeros = x.new_zeros(L * spec.num_directions, B, spec.proj_sizes[0] or spec.hidden_sizes[0])
            hx = (zeros, x.new_zeros(L * spec.num_directions, B, spec.hidden_sizes[0])) if lstm else zeros
        else:  # as the general path stacks them (cuDNN refuses a strided state; oneDNN's result may differ)
            hx = tuple(t.contiguous() for t in hx) if lstm else hx.contiguous()
        dropout = spec.dropout if training and L > 1 and x.device.type == "cuda" else 0.0
        train = _train_flag(x, dropout, [*weights, *(hx if lstm else (hx,))])
        op = getattr(torch._VF, _OPS[spec.mode])
        if batch_sizes is not None:
            out = op(x, batch_sizes, hx, weights, spec.bias_mode == "double", L, float(dropout), train, spec.bidirectional)
        else:
            out = op(x, hx, weights, spec.bias_mode == "double", L, float(dropout), train, spec.bidirectional,
                     batch_first)
        return (out[0], (out[1], out[2])) if lstm else (out[0], out[1])

    def _run(self, spec, num_layers, weights, x, h0s, c0s, lengths, dropout: float = 0.0):
        """``num_layers`` layers (their ``weights``, ``h0s``, ``c0s``) through torch._VF; ``dropout``
        between them is the op's own (cuDNN's masks).

        On CUDA the op runs in cuDNN's training mode (which keeps what its backward needs) when a
        gradient is to be computed, whatever the module's train() flag says: torch.nn passes that
        flag, so its cuDNN RNN in eval() fails on backward; rnnkit's computes the gradient."""
        flat_weights = [getattr(w, slot) for w in weights for slot in _TORCH_SLOTS if getattr(w, slot) is not None]
        hx = torch.stack(h0s)
        state = (hx, torch.stack(c0s)) if spec.mode == "lstm" else hx
        op = getattr(torch._VF, _OPS[spec.mode])
        train = _train_flag(x, dropout, [*flat_weights, *h0s, *(c0s or ())])
        args = (flat_weights, spec.bias_mode == "double", num_layers, float(dropout), train, spec.bidirectional)
        if lengths is None or x.shape[1] == 0:  # an empty batch has nothing to pack
            out = op(x, state, *args, False)
        else:
            packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
            order, unorder = packed.sorted_indices, packed.unsorted_indices
            sorted_state = tuple(s.index_select(1, order) for s in state) if spec.mode == "lstm" else state.index_select(1, order)
            out = op(packed.data, packed.batch_sizes, sorted_state, *args)
            y, _ = pad_packed_sequence(PackedSequence(out[0], packed.batch_sizes, order, unorder), total_length=x.shape[0])
            out = (y,) + tuple(s.index_select(1, unorder) for s in out[1:])
        y, h_n = out[0], out[1]
        c_ns = list(out[2].unbind(0)) if spec.mode == "lstm" else None
        return y, list(h_n.unbind(0)), c_ns
