"""cuDNN canonical weights: one matrix and one bias per (pseudo-layer, linLayerID).

This is what ``cudnnGetRNNWeightParams(handle, desc, pseudoLayer, ..., linLayerID, ...)``
exposes, and what TF's ``CudnnRNNParamsToCanonical`` returns. cuDNN's own weight space
is opaque (its layout may change between GPUs and versions), so code that moves weights
in or out of cuDNN goes through these per-matrix views; rnnkit's packed buffer keeps the
same per-layer order as torch.nn's ``_flat_weights`` (w_ih, w_hh, b_ih, b_hh, w_hr),
which PyTorch copies into cuDNN's weight space one linLayerID at a time.

    pseudoLayer = layer * D + direction      (D = 2 when bidirectional, reverse second)

    linLayerID   LSTM (docs/spec.md: i f g o)     GRU (r z n)         RNN
    0 .. G-1     W_gate  (H, I_layer)        W_r, W_z, W_n       W
    G .. 2G-1    R_gate  (H, Hr)             R_r, R_z, R_n       R
    8            W_hr    (P, H), no bias     (LSTM with projection only)

Biases share the linLayerID of their matrix and are (H,); with bias mode
``single_input`` only IDs 0..G-1 have one, with ``single_recurrent`` only G..2G-1,
with ``none`` none do (cuDNN's CUDNN_RNN_DOUBLE_BIAS, SINGLE_INP_BIAS, SINGLE_REC_BIAS,
NO_BIAS). The gate order is rnnkit's own (docs/spec.md, "Gate orders elsewhere": cuDNN and
PyTorch share it), so no reordering happens here.

What cuDNN cannot represent, and is refused naming the option: peephole, coupled_gates,
layer_norm, zoneout (its evaluation-mode expectation changes the function), proj_clip,
reset_after=False, merge="sum", per-layer sizes. cuDNN's cell clip (``cudnnRNNSetClip_v8``,
symmetric here) is a descriptor setting, carried in ``config``.

Import reads ``config`` strictly: each mode is cudnn.h's name or its enum value, the fields
it does not read (``dataType``, ``mathPrec``, ``algo``, ...) are refused rather than ignored,
and the tables must hold exactly the entries the config uses. A bfloat16 or float16 module
exports tensors of its own dtype.

Example:
    >>> params = rnnkit.interop.cudnn.to_cudnn(lstm)
    >>> params["matrices"][(0, 4)].shape          # R_i of layer 0, forward: (H, Hr)
    >>> lstm2 = rnnkit.interop.cudnn.from_cudnn(params)
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Mapping, Tuple

import torch

from ..spec import RNNSpec
from ._common import build_module, check_keys, check_real, refuse, spec_of, suffix, torch_pieces

PROJECTION_ID = 8
CUDNN_MODES = {"lstm": "CUDNN_LSTM", "gru": "CUDNN_GRU", "rnn_tanh": "CUDNN_RNN_TANH", "rnn_relu": "CUDNN_RNN_RELU"}
CUDNN_BIAS = {
    "double": "CUDNN_RNN_DOUBLE_BIAS",
    "single_input": "CUDNN_RNN_SINGLE_INP_BIAS",
    "single_recurrent": "CUDNN_RNN_SINGLE_REC_BIAS",
    "none": "CUDNN_RNN_NO_BIAS",
}
FMT = "cuDNN"
# cudnn.h's enums, in the order of their values: a config filled from cuDNN may hold the integers.
CUDNN_ENUMS = {
    "cellMode": ("CUDNN_RNN_RELU", "CUDNN_RNN_TANH", "CUDNN_LSTM", "CUDNN_GRU"),
    "biasMode": ("CUDNN_RNN_NO_BIAS", "CUDNN_RNN_SINGLE_INP_BIAS", "CUDNN_RNN_DOUBLE_BIAS",
                 "CUDNN_RNN_SINGLE_REC_BIAS"),
    "dirMode": ("CUDNN_UNIDIRECTIONAL", "CUDNN_BIDIRECTIONAL"),
    "inputMode": ("CUDNN_LINEAR_INPUT", "CUDNN_SKIP_INPUT"),
}
PARTS = ("config", "matrices", "biases")
CONFIG_REQUIRED = ("cellMode", "biasMode", "dirMode", "inputSize", "hiddenSize", "numLayers")
CONFIG_OPTIONAL = ("projSize", "cellClip", "inputMode")


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that cuDNN cannot represent."""
    refuse("cudnn", FMT, spec)


def to_cudnn(module) -> dict:
    """The module's weights as cuDNN canonical matrices and biases.

    Returns:
        ``{"config": {...}, "matrices": {(pseudoLayer, linLayerID): tensor}, "biases": {...}}``.
        ``config`` holds the descriptor values (``cellMode``, ``biasMode``, ``dirMode``,
        ``inputSize``, ``hiddenSize``, ``projSize``, ``numLayers``, ``cellClip``). Tensors
        are copies (detached, on the module's device).
    """
    spec = spec_of(module)
    check_spec(spec)
    views = torch_pieces(module)
    G, D = spec.gates, spec.num_directions
    matrices: Dict[Tuple[int, int], torch.Tensor] = {}
    biases: Dict[Tuple[int, int], torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for direction in range(D):
            pseudo, s = layer * D + direction, suffix(layer, direction)
            for offset, (weight, bias) in enumerate((("weight_ih", "bias_ih"), ("weight_hh", "bias_hh"))):
                for gate, block in enumerate(views[weight + s].chunk(G, 0)):
                    matrices[(pseudo, offset * G + gate)] = block.clone()
                if bias + s in views:
                    for gate, block in enumerate(views[bias + s].chunk(G, 0)):
                        biases[(pseudo, offset * G + gate)] = block.clone()
            if "weight_hr" + s in views:
                matrices[(pseudo, PROJECTION_ID)] = views["weight_hr" + s]
    config = dict(
        cellMode=CUDNN_MODES[spec.mode],
        biasMode=CUDNN_BIAS[spec.bias_mode],
        dirMode="CUDNN_BIDIRECTIONAL" if spec.bidirectional else "CUDNN_UNIDIRECTIONAL",
        inputSize=spec.input_size,
        hiddenSize=spec.hidden_sizes[0],
        projSize=spec.proj_sizes[0] or spec.hidden_sizes[0],
        numLayers=spec.num_layers,
        cellClip=spec.cell_clip,
    )
    return {"config": config, "matrices": matrices, "biases": biases}


def from_cudnn(params: dict, *, batch_first: bool = False, dtype=None):
    """Build an rnnkit module from `to_cudnn`'s structure (or one filled from cuDNN).

    Args:
        params: ``{"config", "matrices", "biases"}`` as described in `to_cudnn`. ``config``
            needs ``cellMode``, ``biasMode``, ``dirMode``, ``inputSize``, ``hiddenSize`` and
            ``numLayers``; it may have ``projSize`` (default: ``hiddenSize``, no projection),
            ``cellClip`` (default None) and ``inputMode`` (only ``CUDNN_LINEAR_INPUT``: rnnkit
            has no skip-input layer). The modes are cudnn.h's names or their enum values
            (``dirMode=1`` is ``CUDNN_BIDIRECTIONAL``). The tables must hold exactly the
            entries the config uses: every matrix and bias of every pseudo-layer, and no other.
        batch_first: the module's input layout (not a cuDNN weight property).
        dtype: the module's dtype (default float32).

    Raises:
        TypeError: ``params`` or one of its parts is not a mapping.
        ValueError: naming the config field or table entry for a missing key, a key
            `from_cudnn` does not read (``dataType``, ``mathPrec``, ``algo``: the precision is
            ``dtype``), a value outside what rnnkit computes, an entry the config does not use,
            or a matrix or bias of the wrong shape.
    """
    config, matrices, biases = _parts(params)
    mode = {v: k for k, v in CUDNN_MODES.items()}[_enum(config, "cellMode", tuple(CUDNN_MODES.values()))]
    bias_mode = {v: k for k, v in CUDNN_BIAS.items()}[_enum(config, "biasMode", tuple(CUDNN_BIAS.values()))]
    bidirectional = _enum(config, "dirMode", CUDNN_ENUMS["dirMode"]) == "CUDNN_BIDIRECTIONAL"
    if "inputMode" in config:
        _enum(config, "inputMode", ("CUDNN_LINEAR_INPUT",))
    input_size, hidden, num_layers = (_size(config, field) for field in ("inputSize", "hiddenSize", "numLayers"))
    proj = _size(config, "projSize") if "projSize" in config else hidden
    if proj > hidden or (proj != hidden and mode != "lstm"):
        limit = (f"at most hiddenSize ({hidden})" if mode == "lstm"
                 else f"hiddenSize ({hidden}): only CUDNN_LSTM projects")
        raise ValueError(f"config['projSize']: expected {limit}, got {proj}")
    clip = config.get("cellClip")
    if clip is not None and (mode != "lstm" or not isinstance(clip, numbers.Real) or isinstance(clip, bool)
                             or not 0 < clip < math.inf):
        expected = "a positive float or None" if mode == "lstm" else "None: cuDNN clips only CUDNN_LSTM cells"
        raise ValueError(f"config['cellClip']: expected {expected}, got {clip!r}")
    spec = RNNSpec(
        mode, input_size, hidden, num_layers,
        bidirectional=bidirectional,
        proj_size=0 if proj == hidden else proj,
        cell_clip=None if clip is None else float(clip),
        bias_mode=bias_mode,
        batch_first=batch_first,
    )
    G, D, cell = spec.gates, spec.num_directions, spec.cell(0)
    bias_ids = [i for i in range(2 * G) if (cell.has_bias_ih if i < G else cell.has_bias_hh)]
    _check_table("matrices", matrices, _entry_shapes(spec))
    _check_table("biases", biases, {(p, i): (hidden,) for p in range(num_layers * D) for i in bias_ids})

    pieces = {}
    for layer in range(spec.num_layers):
        for direction in range(D):
            pseudo, s = layer * D + direction, suffix(layer, direction)
            for offset, (weight, bias) in enumerate((("weight_ih", "bias_ih"), ("weight_hh", "bias_hh"))):
                ids = range(offset * G, (offset + 1) * G)
                pieces[weight + s] = torch.cat([matrices[(pseudo, i)] for i in ids])
                if ids[0] in bias_ids:
                    pieces[bias + s] = torch.cat([biases[(pseudo, i)] for i in ids])
            if spec.proj_sizes[layer]:
                pieces["weight_hr" + s] = matrices[(pseudo, PROJECTION_ID)]
    return build_module(spec, pieces, dtype)


def _parts(params) -> Tuple[dict, dict, dict]:
    """``params``'s config and its two tables (the tables' values as tensors), checking the keys."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a mapping with {PARTS}, got {type(params).__name__}")
    check_keys(params, PARTS, "params")
    for part in PARTS:
        if not isinstance(params[part], Mapping):
            raise TypeError(f"params['{part}']: expected a mapping, got {type(params[part]).__name__}")
    config = params["config"]
    check_keys(config, CONFIG_REQUIRED, "config", CONFIG_OPTIONAL)
    tables = []
    for part in ("matrices", "biases"):
        table = {}
        for key, value in params[part].items():
            try:
                table[key] = torch.as_tensor(value)
            except (TypeError, RuntimeError, ValueError) as error:
                raise TypeError(f"{part}[{key!r}]: expected an array, got {type(value).__name__}") from error
            check_real(f"{part}[{key!r}]:", table[key].dtype)
            if table[key].device.type == "meta":
                raise ValueError(f"{part}[{key!r}]: expected values, got a tensor on the meta device (it has none)")
        tables.append(table)
    return config, tables[0], tables[1]


def _enum(config: Mapping, field: str, accepted: Tuple[str, ...]) -> str:
    """``config[field]`` as its cudnn.h name, which must be one of ``accepted``."""
    value, names = config[field], CUDNN_ENUMS[field]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < len(names):
        value = names[value]
    if not isinstance(value, str) or value not in accepted:
        expected = ", ".join(f"{name!r} ({names.index(name)})" for name in accepted)
        raise ValueError(f"config['{field}']: expected {'one of ' if len(accepted) > 1 else ''}{expected}, "
                         f"got {config[field]!r}")
    return value


def _size(config: Mapping, field: str) -> int:
    value = config[field]
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config['{field}']: expected a positive integer, got {value!r}")
    return int(value)


def _entry_shapes(spec: RNNSpec) -> Dict[Tuple[int, int], Tuple[int, ...]]:
    """{(pseudoLayer, linLayerID): shape} of every matrix ``spec`` has (see the module docstring)."""
    G, D, shapes = spec.gates, spec.num_directions, {}
    for layer in range(spec.num_layers):
        cell = spec.cell(layer)
        for direction in range(D):
            pseudo = layer * D + direction
            for i in range(2 * G):
                shapes[(pseudo, i)] = (cell.hidden_size, cell.input_size if i < G else cell.output_size)
            if cell.proj_size:
                shapes[(pseudo, PROJECTION_ID)] = (cell.proj_size, cell.hidden_size)
    return shapes


def _check_table(what: str, table: Dict, shapes: Dict[Tuple[int, int], Tuple[int, ...]]) -> None:
    """``table`` has exactly the keys of ``shapes``, each value of its shape."""
    check_keys(table, sorted(shapes), f"{what} (for the config)", kind="(pseudoLayer, linLayerID) entries")
    for key, shape in shapes.items():
        if tuple(table[key].shape) != shape:
            raise ValueError(f"{what}[{key}]: expected shape {shape}, got {tuple(table[key].shape)}")
