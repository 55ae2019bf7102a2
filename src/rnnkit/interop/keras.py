"""Keras 3: LSTM, GRU and SimpleRNN weight lists (``layer.get_weights()`` order), and Bidirectional.

Per layer and direction Keras holds (https://keras.io/api/layers/recurrent_layers/):

    kernel            (I, G·H)    W transposed
    recurrent_kernel  (H, G·H)    R transposed
    bias              (G·H,)      one bias: b_W + b_R (LSTM, SimpleRNN, GRU reset_after=False)
                      (2, G·H)    GRU reset_after=True: rows [b_W, b_R]

Gate orders (docs/spec.md, "Gate orders elsewhere"): Keras LSTM i f c o is rnnkit's i f g o;
Keras GRU z r h is rnnkit's r z n with the first two blocks swapped. A single Keras bias
is exact for every rnnkit bias mode because both biases are added outside any product;
for the GRU with reset_after=False that holds too (b_Rn is outside r ∘ (·) there).
Keras GRU ``reset_after`` is rnnkit's ``reset_after``. A ``Bidirectional`` wrapper's weights
are the forward layer's followed by the backward layer's; its merge modes "concat" and
"sum" are rnnkit's ``merge``.

Not representable, refused naming the option: proj_size, peephole, coupled_gates,
cell_clip, layer_norm, zoneout. Per-layer sizes are fine (one Keras layer per rnnkit
layer). Keras's ``recurrent_activation``/``activation`` must be the defaults (sigmoid,
tanh; SimpleRNN tanh or relu). ``from_keras`` checks the arrays against its ``mode`` and
options and names the array whose shape says otherwise (another layer type, the other GRU
``reset_after``, a Bidirectional layer, a layer with or without bias).

A bfloat16 module exports float32 arrays (numpy has no bfloat16; the values are exact);
bfloat16 arrays import through float32, into the module's ``dtype``.

Keras's ``go_backwards=True`` outside a ``Bidirectional`` wrapper returns the outputs in
reversed time order: no rnnkit module computes that, so the functions that take Keras
layers refuse it, naming ``go_backwards``.

Functions that take Keras layers import keras; set ``KERAS_BACKEND`` before that import.

Example:
    >>> weights = rnnkit.interop.keras.to_keras(gru)       # one list of arrays per layer
    >>> keras_gru.set_weights(weights[0])                  # or set_keras_weights(gru, [keras_gru])
    >>> gru2 = rnnkit.interop.keras.from_keras(weights, "gru", reset_after=True)
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..spec import RNNSpec
from ._common import build_module, exported_pieces, imported_array, refuse, regate, rnnkit_gates, spec_of, suffix

KERAS_GATES = {"lstm": "ifgo", "gru": "zrn", "rnn_tanh": "h", "rnn_relu": "h"}
LAYER_CLASSES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "SimpleRNN", "rnn_relu": "SimpleRNN"}
LAYERS_WITH_GATES = {4: "a Keras LSTM", 3: "a Keras GRU", 1: "a Keras SimpleRNN"}
FMT = "Keras"


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that Keras cannot represent."""
    refuse("keras", FMT, spec)


def _uses_two_biases(spec: RNNSpec) -> bool:
    return spec.mode == "gru" and spec.reset_after


def to_keras(module) -> List[List[np.ndarray]]:
    """One list of numpy arrays per layer, as that Keras layer's ``set_weights`` takes them.

    A bidirectional layer's list is the forward direction's arrays followed by the
    backward direction's (Keras ``Bidirectional`` order). Without bias (bias_mode "none")
    the layer is a Keras layer with ``use_bias=False``. A bfloat16 module gives float32
    arrays (numpy has no bfloat16; the values are exact).
    """
    spec = spec_of(module)
    check_spec(spec)
    pieces = exported_pieces(module)
    ours, theirs = rnnkit_gates(spec), KERAS_GATES[spec.mode]
    layers = []
    for layer in range(spec.num_layers):
        cell = spec.cell(layer)
        arrays = []
        for direction in range(spec.num_directions):
            s = suffix(layer, direction)
            arrays += [regate(pieces["weight_ih" + s], ours, theirs).T.copy(),
                       regate(pieces["weight_hh" + s], ours, theirs).T.copy()]
            if cell.bias_mode == "none":
                continue
            zeros = np.zeros(cell.gates * cell.hidden_size, dtype=arrays[-1].dtype)
            b_W = regate(pieces["bias_ih" + s], ours, theirs) if cell.has_bias_ih else zeros
            b_R = regate(pieces["bias_hh" + s], ours, theirs) if cell.has_bias_hh else zeros
            arrays.append(np.stack([b_W, b_R]) if _uses_two_biases(spec) else b_W + b_R)
        layers.append(arrays)
    return layers


def _layer_arrays(weights, D: int, use_bias: bool) -> List[List[np.ndarray]]:
    """``weights`` as one list of numpy arrays per layer, their number checked (bfloat16 read as float32)."""
    if not isinstance(weights, (list, tuple)):
        raise TypeError(f"weights: expected a list with one list of arrays per layer, got {type(weights).__name__}")
    if not weights:
        raise ValueError("weights: expected one list of arrays per layer, got an empty list")
    per_direction = 2 + int(use_bias)
    layers = []
    for k, arrays in enumerate(weights):
        if not isinstance(arrays, (list, tuple)):
            raise TypeError(f"weights[{k}]: expected one layer's list of arrays (layer.get_weights()), got "
                            f"{type(arrays).__name__}; weights holds one such list per layer")
        if len(arrays) != D * per_direction:
            implied = [f"bidirectional={d == 2}, use_bias={bias}" for d in (1, 2) for bias in (True, False)
                       if d * (2 + bias) == len(arrays)]
            raise ValueError(
                f"weights[{k}]: expected {D * per_direction} arrays (kernel, recurrent_kernel"
                f"{', bias' if use_bias else ''} per direction; bidirectional={D == 2}, use_bias={use_bias}), got "
                f"{len(arrays)}" + (f", which is a layer with {implied[0]}" if implied else ""))
        layers.append([imported_array(a, f"weights[{k}][{i}]") for i, a in enumerate(arrays)])
    return layers


def _check_shapes(layers, mode: str, D: int, use_bias: bool, reset_after: bool, merge: str) -> List[int]:
    """The layers' hidden sizes, after checking every array's shape against ``mode`` and the options."""
    G = len(KERAS_GATES[mode])
    per_direction = 2 + int(use_bias)
    hidden, features = [], None
    for k, arrays in enumerate(layers):
        for direction in range(D):
            first = direction * per_direction
            where = lambda j: f"weights[{k}][{first + j}]"  # noqa: E731
            side = " (backward layer)" if direction else ""
            kernel, recurrent = arrays[first : first + 2]
            for j, (name, array) in enumerate((("kernel", kernel), ("recurrent_kernel", recurrent))):
                if array.ndim != 2:
                    raise ValueError(f"{where(j)}: expected a 2-D {name}{side}, got shape {array.shape}")
            H = recurrent.shape[0] if direction == 0 else hidden[-1]
            if recurrent.shape != (H, G * H):
                blocks = recurrent.shape[1] / recurrent.shape[0] if recurrent.shape[0] else 0
                implied = (f", which holds {int(blocks)} gate block{'s' if blocks != 1 else ''} of "
                           f"{recurrent.shape[0]} units ({LAYERS_WITH_GATES[int(blocks)]})"
                           if blocks in LAYERS_WITH_GATES else "")
                raise ValueError(f"{where(1)}: mode={mode!r} expects a recurrent_kernel{side} of shape (H, {G}·H) = "
                                 f"{(H, G * H)}, got {recurrent.shape}{implied}")
            if direction == 0:
                hidden.append(H)
            inputs = kernel.shape[0] if features is None else features
            if kernel.shape != (inputs, G * H):
                merged = f" (bidirectional, merge={merge!r})" if D == 2 else ""
                before = "" if features is None else f"; layer {k - 1}'s outputs have {features} features{merged}"
                raise ValueError(f"{where(0)}: expected a kernel{side} of shape {(inputs, G * H)}, got {kernel.shape}{before}")
            if use_bias:
                bias = arrays[first + 2]
                two = mode == "gru" and reset_after
                expected = (2, G * H) if two else (G * H,)
                if bias.shape != expected:
                    other = (G * H,) if two else (2, G * H)
                    why = (f", the bias of a Keras GRU with reset_after={not reset_after}"
                           if mode == "gru" and bias.shape == other else "")
                    raise ValueError(f"{where(2)}: mode={mode!r}"
                                     f"{f', reset_after={reset_after}' if mode == 'gru' else ''} expects a bias{side} "
                                     f"of shape {expected}, got {bias.shape}{why}")
        features = hidden[-1] * (D if merge == "concat" else 1)
    return hidden


def from_keras(
    weights: Sequence[Sequence[np.ndarray]],
    mode: str,
    *,
    reset_after: bool = True,
    bidirectional: bool = False,
    merge: str = "concat",
    use_bias: bool = True,
    bias_mode: Optional[str] = None,
    batch_first: bool = False,
    dtype=None,
):
    """Build an rnnkit module from Keras weight lists, one list per stacked layer.

    Args:
        weights: per layer, the arrays of ``layer.get_weights()`` (a Bidirectional
            layer's: forward then backward). bfloat16 arrays are read as float32 (exact).
        mode: "lstm", "gru", "rnn_tanh" or "rnn_relu" (SimpleRNN's activation).
        reset_after: the Keras GRU's ``reset_after``.
        bidirectional: the layers are Keras ``Bidirectional`` wrappers.
        merge: the wrappers' merge_mode ("concat" or "sum").
        use_bias: the Keras layers' ``use_bias``.
        bias_mode: where a single Keras bias goes: "double" (default; into bias_ih,
            bias_hh zero, as torch.nn expects) or "single_input" / "single_recurrent".
            Layers without a bias (``use_bias=False``) make bias_mode "none"; any other
            bias_mode with them, or "none" with ``use_bias=True``, is refused.
        batch_first: the module's layout (Keras itself is batch-first).
        dtype: the module's dtype (default float32).

    Raises:
        ValueError: naming the array, when the arrays' number or shapes are not those of
            ``mode`` with these options (saying what they are instead: another layer type,
            the other reset_after, a bidirectional layer, a layer with(out) bias).
    """
    if not isinstance(mode, str) or mode not in KERAS_GATES:
        raise ValueError(f"mode: expected one of {tuple(KERAS_GATES)}, got {mode!r}")
    if bidirectional and merge not in ("concat", "sum"):  # before the shapes, which a wrong merge also misreads
        raise ValueError(f"merge: expected the wrappers' merge_mode, 'concat' or 'sum', got {merge!r}")
    if use_bias and bias_mode == "none":
        raise ValueError("bias_mode, use_bias: bias_mode='none' would drop the Keras layers' bias (use_bias=True); "
                         "for layers without a bias pass use_bias=False")
    if not use_bias and bias_mode not in (None, "none"):
        raise ValueError(f"bias_mode, use_bias: the Keras layers have no bias (use_bias=False), so there is none for "
                         f"bias_mode={bias_mode!r}; leave bias_mode unset (or 'none')")
    bias_mode = bias_mode or ("double" if use_bias else "none")
    D = 2 if bidirectional else 1
    per_direction = 2 + int(use_bias)
    weights = _layer_arrays(weights, D, use_bias)
    hidden = _check_shapes(weights, mode, D, use_bias, reset_after, merge)
    spec = RNNSpec(mode, int(weights[0][0].shape[0]), hidden if len(set(hidden)) > 1 else hidden[0],
                   len(weights), bidirectional=bidirectional, merge=merge, reset_after=reset_after if mode == "gru" else True,
                   bias_mode=bias_mode, batch_first=batch_first)
    ours, theirs = rnnkit_gates(spec), KERAS_GATES[mode]
    pieces = {}
    for layer, arrays in enumerate(weights):
        cell = spec.cell(layer)
        for direction in range(D):
            s = suffix(layer, direction)
            kernel, recurrent, *bias = arrays[direction * per_direction : (direction + 1) * per_direction]
            pieces["weight_ih" + s] = regate(kernel.T, theirs, ours)
            pieces["weight_hh" + s] = regate(recurrent.T, theirs, ours)
            if not bias:
                continue
            bias = bias[0]
            if _uses_two_biases(spec):
                b_W, b_R = bias[0], bias[1]
                if not (cell.has_bias_ih and cell.has_bias_hh) and np.any(bias[int(cell.has_bias_ih)]):
                    raise ValueError(f"bias_mode: {bias_mode!r} drops a non-zero row of the GRU bias of layer {layer}")
            else:
                b_W, b_R = bias, np.zeros_like(bias)
                if bias_mode == "single_recurrent":
                    b_W, b_R = b_R, b_W
            if cell.has_bias_ih:
                pieces["bias_ih" + s] = regate(b_W, theirs, ours)
            if cell.has_bias_hh:
                pieces["bias_hh" + s] = regate(b_R, theirs, ours)
    return build_module(spec, pieces, dtype)


# ---- Keras layer objects ---------------------------------------------------------------

def _check_layer(spec: RNNSpec, layer, index: int):
    """The inner recurrent layer(s) of a Keras layer (unwrapping Bidirectional), checked against spec."""
    import keras

    bidirectional = isinstance(layer, keras.layers.Bidirectional)
    if bidirectional != spec.bidirectional:
        raise ValueError(f"layers[{index}]: bidirectional={spec.bidirectional} needs "
                         f"{'a' if spec.bidirectional else 'no'} keras.layers.Bidirectional wrapper")
    if bidirectional and layer.merge_mode != spec.merge:
        raise ValueError(f"merge: layers[{index}] has merge_mode={layer.merge_mode!r}, the module merge={spec.merge!r}")
    for inner, where in _inner_layers(layer, index):
        _check_inner(spec, inner, index, where)
    return layer.forward_layer if bidirectional else layer, bidirectional


def _inner_layers(layer, index: int):
    """[(recurrent layer, where)] of one Keras layer, refusing a direction rnnkit cannot run.

    A Keras layer with ``go_backwards=True`` returns its outputs in reversed time order;
    rnnkit's reverse direction (inside a bidirectional module) keeps the input's time order,
    which is what Keras's ``Bidirectional`` makes of its backward layer. So go_backwards is
    accepted exactly there.
    """
    import keras

    if isinstance(layer, keras.layers.Bidirectional):
        inners = [(layer.forward_layer, False, f"layers[{index}].forward_layer"),
                  (layer.backward_layer, True, f"layers[{index}].backward_layer")]
    else:
        inners = [(layer, False, f"layers[{index}]")]
    for inner, backwards, where in inners:
        if getattr(inner, "go_backwards", False) != backwards:
            raise ValueError(
                f"go_backwards: {where} has go_backwards={inner.go_backwards}; such a layer returns its outputs in "
                "reversed time order, which no rnnkit module computes (rnnkit's reverse direction keeps the input's "
                "time order, as Keras's Bidirectional does). The module from_keras builds from its weights gives "
                "Keras's output when run on the time-reversed input")
    return [(inner, where) for inner, _, where in inners]


def _activation_name(function) -> str:
    """Keras's name of one of its own activations (``keras.activations.tanh`` -> "tanh"), else a
    description: a function of the user's with the same ``__name__`` (a scaled tanh), or a
    ``functools.partial`` (relu with ``max_value``), computes something else."""
    import keras

    name = getattr(function, "__name__", None)
    if name is not None and getattr(keras.activations, name, None) is function:
        return name
    return f"{function!r} (not one of keras.activations' own functions)"


def _check_inner(spec: RNNSpec, inner, index: int, where: str) -> None:
    name = LAYER_CLASSES[spec.mode]
    if type(inner).__name__ != name:
        raise ValueError(f"{where}: expected a keras.layers.{name}, got {type(inner).__name__}")
    if getattr(inner, "stateful", False):
        raise ValueError(f"stateful: {where} has stateful=True: Keras carries its state from call to call, an rnnkit "
                         "module takes it as hx (and returns it); convert a stateless layer and pass the state "
                         "yourself")
    activation = "relu" if spec.mode == "rnn_relu" else "tanh"
    if _activation_name(inner.activation) != activation:
        raise ValueError(f"activation: {where} uses {_activation_name(inner.activation)}, rnnkit's is {activation}")
    if spec.mode in ("lstm", "gru") and _activation_name(inner.recurrent_activation) != "sigmoid":
        raise ValueError(f"recurrent_activation: {where} uses {_activation_name(inner.recurrent_activation)}, "
                         "rnnkit's gates use sigmoid")
    if spec.mode == "gru" and inner.reset_after != spec.reset_after:
        raise ValueError(f"reset_after: {where} has {inner.reset_after}, the module {spec.reset_after}")
    if inner.units != spec.hidden_sizes[index]:
        raise ValueError(f"units: {where} has {inner.units}, the module's hidden size is {spec.hidden_sizes[index]}")
    if inner.use_bias != (spec.bias_mode != "none"):
        raise ValueError(f"use_bias: {where} has {inner.use_bias}, the module bias_mode={spec.bias_mode!r}")


def set_keras_weights(module, layers) -> None:
    """Copy the module's weights into built Keras layers, one per stacked layer.

    ``layers`` are keras LSTM / GRU / SimpleRNN layers (in a Bidirectional wrapper when
    the module is bidirectional) with matching units, activations, reset_after, use_bias.
    """
    spec = spec_of(module)
    layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    if len(layers) != spec.num_layers:
        raise ValueError(f"layers: expected {spec.num_layers} Keras layers (one per layer), got {len(layers)}")
    weights = to_keras(module)
    for index, layer in enumerate(layers):  # every layer checked before any is written
        _check_layer(spec, layer, index)
    for layer, arrays in zip(layers, weights):
        layer.set_weights(arrays)


def from_keras_layers(layers, *, batch_first: bool = True, dtype=None):
    """Build an rnnkit module from built Keras recurrent layers (one per stacked layer).

    The options come from the layers' configuration; ``batch_first`` defaults to True,
    Keras's own layout.
    """
    import keras

    layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    if not layers:
        raise ValueError("layers: expected at least one Keras recurrent layer, got none")
    for index, layer in enumerate(layers):
        _inner_layers(layer, index)
    first = layers[0]
    bidirectional = isinstance(first, keras.layers.Bidirectional)
    inner = first.forward_layer if bidirectional else first
    kind = type(inner).__name__
    modes = {"LSTM": "lstm", "GRU": "gru"}
    if kind == "SimpleRNN":
        mode = "rnn_relu" if _activation_name(inner.activation) == "relu" else "rnn_tanh"
    elif kind in modes:
        mode = modes[kind]
    else:
        raise ValueError(f"layers[0]: expected a keras LSTM, GRU or SimpleRNN layer, got {kind}")
    for index, layer in enumerate(layers):
        if not layer.built:
            raise ValueError(f"layers[{index}]: the Keras layer is not built (it has no weights yet); call it on an "
                             "input, or build() it, first")
    module = from_keras(
        [layer.get_weights() for layer in layers], mode,
        reset_after=getattr(inner, "reset_after", True), bidirectional=bidirectional,
        merge=first.merge_mode if bidirectional else "concat", use_bias=inner.use_bias,
        batch_first=batch_first, dtype=dtype,
    )
    for index, layer in enumerate(layers):
        _check_layer(module.spec, layer, index)
    return module
