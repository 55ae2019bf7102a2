"""MXNet 1.x: the fused ``RNN`` operator's flat parameter vector and Gluon's parameter names.

Gluon's ``rnn.LSTM / GRU / RNN`` layers register, per layer ``k`` and direction ``l``
(forward) / ``r`` (reverse), in this order:

```text
{l,r}{k}_i2h_weight  (G·H, I_k)     {l,r}{k}_h2h_weight  (G·H, Hr)
{l,r}{k}_i2h_bias    (G·H,)         {l,r}{k}_h2h_bias    (G·H,)
{l,r}{k}_h2r_weight  (P, H)         LSTM with projection_size
```

``collect_params()`` puts the block's prefix before them (``lstm0_l0_i2h_weight``), and
``save_parameters()`` files name them by structure: ``_unfused.{k}.i2h_weight``
(unidirectional) or ``_unfused.{k}.{l,r}_cell.i2h_weight`` (bidirectional). The layers
hand the fused operator one flat vector: ALL weights first (for each layer, for each
direction: i2h, h2h, h2r), then ALL biases (for each layer, for each direction: i2h,
h2h). Gate order (docs/spec.md, "Gate orders elsewhere") is cuDNN's: LSTM i f g o, GRU r z n
(reset after the recurrent product), so no reordering.

MXNet clips the cell with a layer setting, not a parameter: Gluon ``rnn.LSTM``'s
``state_clip_min/max``, the fused operator's ``lstm_state_clip_min/max``; rnnkit's
``cell_clip`` is the symmetric pair (−cell_clip, cell_clip). The exporters return that
setting beside the parameters with ``with_settings=True`` (and refuse a clipped module
without it, naming cell_clip, since the parameters alone would make an unclipped layer);
the importers take it back under MXNet's names or as ``cell_clip``: after
``named, settings = to_gluon(lstm, with_settings=True)``, ``from_gluon(named, "lstm",
**settings)`` is the same module.
MXNet 1.9.1 applies the clip only in its GPU (cuDNN) kernel: its CPU kernel ignores it,
so the clip is unverified here.

Refused naming the option: peephole, coupled_gates, layer_norm, zoneout, proj_clip,
reset_after=False, merge="sum", per-layer sizes. MXNet always has both biases, so rnnkit
bias modes other than "double" export zeros for the missing one. A bfloat16 module exports
float32 arrays (numpy has no bfloat16; the values are exact); bfloat16 arrays import
through float32, into the module's ``dtype``.

Example:
    >>> flat = rnnkit.interop.mxnet.to_mxnet_flat(lstm)     # numpy vector for the fused op
    >>> named = rnnkit.interop.mxnet.to_gluon(lstm)         # {"l0_i2h_weight": array, ...}
    >>> mx.nd.save("lstm.params", {k: mx.nd.array(v) for k, v in named.items()})
    >>> gluon_lstm.load_parameters("lstm.params")          # Gluon adds its prefix
    >>> lstm2 = rnnkit.interop.mxnet.from_gluon(gluon_lstm.collect_params(), "lstm")
    >>> named, settings = rnnkit.interop.mxnet.to_gluon(clipped_lstm, with_settings=True)
    >>> gluon_lstm = mx.gluon.rnn.LSTM(16, **settings)     # state_clip_min/max
    >>> lstm3 = rnnkit.interop.mxnet.from_gluon(named, "lstm", **settings)
"""
from __future__ import annotations

import re
from typing import Dict, Mapping

import numpy as np

from ..spec import RNNSpec
from ._common import build_module, check_keys, exported_pieces, finite_number, imported_array, refuse, spec_of, suffix

FMT = "MXNet"
TORCH_TO_GLUON = {"weight_ih": "i2h_weight", "weight_hh": "h2h_weight", "weight_hr": "h2r_weight",
                  "bias_ih": "i2h_bias", "bias_hh": "h2h_bias"}
GLUON_CLIP = ("state_clip_min", "state_clip_max")  # gluon.rnn.LSTM's arguments
OPERATOR_CLIP = ("lstm_state_clip_min", "lstm_state_clip_max")  # the fused RNN operator's


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that MXNet cannot represent."""
    refuse("mxnet", FMT, spec)


def _gluon_name(layer: int, direction: int, piece: str) -> str:
    return f"{'r' if direction else 'l'}{layer}_{TORCH_TO_GLUON[piece]}"


def _clip_settings(spec: RNNSpec, names) -> Dict[str, float]:
    """MXNet's clip setting for ``spec`` under ``names`` (min, max): {} without a cell_clip."""
    return {} if spec.cell_clip is None else {names[0]: -spec.cell_clip, names[1]: spec.cell_clip}


def _returned(values, settings: Dict[str, float], with_settings: bool, names):
    if with_settings:
        return values, settings
    if settings:
        raise ValueError(f"cell_clip: MXNet holds the state clip in the layer's settings ({names[0]}, {names[1]}), "
                         "not among its parameters, so the parameters alone make an unclipped layer; pass "
                         "with_settings=True to get the settings too")
    return values


def to_gluon(module, *, with_settings: bool = False):
    """{Gluon parameter name: numpy array}, in Gluon's registration order, without a block prefix.

    ``mx.nd.save`` of these loads with ``gluon_layer.load_parameters`` (Gluon adds its
    prefix to names without dots); or ``param.set_data`` them through ``collect_params()``.

    With ``with_settings=True`` returns ``(named, settings)``: ``settings`` are the Gluon
    layer's arguments that are not parameters, ``{"state_clip_min": -c, "state_clip_max": c}``
    for an LSTM with cell_clip c, else ``{}``; ``rnn.LSTM(H, **settings)`` builds the layer,
    ``from_gluon(named, "lstm", **settings)`` the module. A module with cell_clip is refused
    without it.
    """
    spec = spec_of(module)
    check_spec(spec)
    pieces = exported_pieces(module)
    named = {}
    for layer in range(spec.num_layers):
        cell = spec.cell(layer)
        for direction in range(spec.num_directions):
            s = suffix(layer, direction)
            gh = cell.gates * cell.hidden_size
            for piece in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"):
                if piece + s in pieces:
                    named[_gluon_name(layer, direction, piece)] = pieces[piece + s]
                elif piece.startswith("bias"):
                    named[_gluon_name(layer, direction, piece)] = np.zeros(gh, dtype=pieces["weight_ih" + s].dtype)
    return _returned(named, _clip_settings(spec, GLUON_CLIP), with_settings, GLUON_CLIP)


def flat_order(spec: RNNSpec):
    """Gluon names in the fused operator's order: all weights, then all biases."""
    D, proj = spec.num_directions, any(spec.proj_sizes)
    weights = ("weight_ih", "weight_hh") + (("weight_hr",) if proj else ())
    order = [_gluon_name(k, d, p) for k in range(spec.num_layers) for d in range(D) for p in weights]
    order += [_gluon_name(k, d, p) for k in range(spec.num_layers) for d in range(D) for p in ("bias_ih", "bias_hh")]
    return order


def to_mxnet_flat(module, *, with_settings: bool = False):
    """The fused ``RNN`` operator's parameter vector (1-D numpy).

    With ``with_settings=True`` returns ``(flat, settings)``: ``settings`` are the operator's
    ``{"lstm_state_clip_min": -c, "lstm_state_clip_max": c}`` for an LSTM with cell_clip c,
    else ``{}`` (``mx.nd.RNN(..., **settings)``; ``from_mxnet_flat(flat, ..., **settings)``).
    A module with cell_clip is refused without it.
    """
    named, _ = to_gluon(module, with_settings=True)
    flat = np.concatenate([named[name].reshape(-1) for name in flat_order(module.spec)])
    return _returned(flat, _clip_settings(module.spec, OPERATOR_CLIP), with_settings, OPERATOR_CLIP)


GLUON_NAME = re.compile(r"(?P<prefix>.*?)(?P<dir>[lr])(?P<layer>\d+)_(?P<piece>i2h|h2h|h2r)_(?P<kind>weight|bias)")
SAVED_NAME = re.compile(r"(?P<prefix>.*?)_unfused\.(?P<layer>\d+)\.(?:(?P<dir>[lr])_cell\.)?"
                        r"(?P<piece>i2h|h2h|h2r)_(?P<kind>weight|bias)")


def gluon_names(named: Mapping[str, object]) -> Dict[str, object]:
    """Gluon parameters under any of Gluon 1.x's names -> under the bare names (``l0_i2h_weight``).

    Accepts the bare names, ``collect_params()``'s block-prefixed names
    (``lstm0_l0_i2h_weight``) and ``save_parameters()``'s structural names
    (``_unfused.0.i2h_weight``, ``_unfused.0.l_cell.i2h_weight``). All names must share one
    prefix. Values are passed through untouched.
    """
    if not hasattr(named, "items"):
        raise TypeError(f"named: expected a mapping of Gluon parameter names to arrays, got {type(named).__name__}")
    bare, prefixes = {}, set()
    for name, value in named.items():
        match = SAVED_NAME.fullmatch(name) or GLUON_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"named: {name!r} is not a Gluon LSTM / GRU / RNN parameter name (expected e.g. "
                             "'l0_i2h_weight', 'lstm0_l0_i2h_weight' or '_unfused.0.l_cell.i2h_weight')")
        prefixes.add(match["prefix"])
        key = f"{match['dir'] or 'l'}{match['layer']}_{match['piece']}_{match['kind']}"
        if key in bare:
            raise ValueError(f"named: two parameters for {key} ({name!r} and another)")
        bare[key] = value
    if len(prefixes) > 1:
        raise ValueError(f"named: the names mix prefixes {sorted(prefixes)}; pass one Gluon layer's parameters")
    return bare


def _cell_clip(cell_clip, low, high, names):
    """rnnkit's cell_clip from ``cell_clip`` or from MXNet's (min, max) clip settings ``names``."""
    if low is None and high is None:
        return cell_clip
    low = None if low is None else finite_number(names[0], low)
    high = None if high is None else finite_number(names[1], high)
    if low is None or high is None or low != -high:
        raise ValueError(f"{names[0]}, {names[1]}: rnnkit's cell_clip clips c to [-cell_clip, cell_clip], so "
                         f"expected both, with {names[0]} == -{names[1]}; got {low} and {high}")
    if cell_clip is not None and float(cell_clip) != float(high):
        raise ValueError(f"cell_clip, {names[1]}: two different clips, cell_clip={cell_clip} and "
                         f"{names[1]}={high}; give one")
    return float(high)


def from_gluon(named: Mapping[str, object], mode: str, *, cell_clip=None, state_clip_min=None, state_clip_max=None,
               batch_first: bool = False, dtype=None):
    """Build an rnnkit module from one Gluon layer's parameters.

    Args:
        named: {name: array} under any of the names `gluon_names` accepts; values
            may be numpy arrays, MXNet NDArrays or Gluon Parameters (``collect_params()``).
        mode: "lstm", "gru", "rnn_tanh" or "rnn_relu"; sizes, layers, directions and the
            projection are read from the arrays.
        cell_clip: the Gluon LSTM's symmetric state clip c (GPU-only in MXNet).
        state_clip_min: the same clip as the Gluon LSTM's own settings (`to_gluon`'s
            ``settings``): -c, with
        state_clip_max: c.
        batch_first: the module's layout (Gluon's ``layout="NTC"``).
        dtype: the module's dtype (default float32).
    """
    if mode not in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        raise ValueError(f"mode: expected 'lstm', 'gru', 'rnn_tanh' or 'rnn_relu', got {mode!r}")
    cell_clip = _cell_clip(cell_clip, state_clip_min, state_clip_max, GLUON_CLIP)
    named = {name: imported_array(value.data() if hasattr(value, "list_data") else value, name)  # Gluon Parameter
             for name, value in gluon_names(named).items()}
    if "l0_i2h_weight" not in named:
        raise ValueError(f"named: no l0_i2h_weight among {sorted(named)}")
    num_layers = 1 + max(int(GLUON_NAME.fullmatch(name)["layer"]) for name in named)
    bidirectional = "r0_i2h_weight" in named
    G = {"lstm": 4, "gru": 3}.get(mode, 1)
    hidden = named["l0_i2h_weight"].shape[0] // G
    proj = named["l0_h2r_weight"].shape[0] if "l0_h2r_weight" in named else 0
    spec = RNNSpec(mode, int(named["l0_i2h_weight"].shape[1]), int(hidden), num_layers,
                   bidirectional=bidirectional, proj_size=int(proj), cell_clip=cell_clip, batch_first=batch_first)
    expected = sorted({_gluon_name(*entry) for entry in build_layout_names(spec)})
    check_keys(named, expected, f"named (a {spec.num_layers}-layer {'bidirectional ' if bidirectional else ''}{mode})",
               kind="parameters")
    pieces = {piece + suffix(layer, direction): named[_gluon_name(layer, direction, piece)]
              for layer, direction, piece in build_layout_names(spec)}
    sources = {piece + suffix(layer, direction): f"named[{_gluon_name(layer, direction, piece)!r}]"
               for layer, direction, piece in build_layout_names(spec)}
    return build_module(spec, pieces, dtype, sources, f"a Gluon {mode} layer's, as mode={mode!r} says")


def from_mxnet_flat(flat: np.ndarray, mode: str, input_size: int, hidden_size: int, num_layers: int = 1, *,
                    bidirectional: bool = False, proj_size: int = 0, cell_clip=None, lstm_state_clip_min=None,
                    lstm_state_clip_max=None, batch_first: bool = False, dtype=None):
    """Build an rnnkit module from the fused operator's flat parameter vector.

    The sizes and ``bidirectional`` are the operator's ``state_size``, ``num_layers``,
    ``bidirectional``, ``proj_size`` its ``projection_size``; the state clip is ``cell_clip``
    or the operator's ``lstm_state_clip_min/max`` (as `to_mxnet_flat` returns them), which
    must be (-c, c).
    """
    cell_clip = _cell_clip(cell_clip, lstm_state_clip_min, lstm_state_clip_max, OPERATOR_CLIP)
    spec = RNNSpec(mode, input_size, hidden_size, num_layers, bidirectional=bidirectional, proj_size=proj_size)
    shapes = {}
    for layer, direction, piece in build_layout_names(spec):
        cell = spec.cell(layer)
        gh = cell.gates * cell.hidden_size
        shapes[_gluon_name(layer, direction, piece)] = {
            "weight_ih": (gh, cell.input_size), "weight_hh": (gh, cell.output_size),
            "weight_hr": (cell.proj_size, cell.hidden_size), "bias_ih": (gh,), "bias_hh": (gh,),
        }[piece]
    flat = imported_array(flat, "flat").reshape(-1)
    expected = sum(int(np.prod(shape)) for shape in shapes.values())
    if flat.size != expected:
        raise ValueError(f"flat: expected {expected} values for this configuration, got {flat.size}")
    named, offset = {}, 0
    for name in flat_order(spec):
        size = int(np.prod(shapes[name]))
        named[name] = flat[offset : offset + size].reshape(shapes[name])
        offset += size
    return from_gluon(named, mode, cell_clip=cell_clip, batch_first=batch_first, dtype=dtype)


def build_layout_names(spec: RNNSpec):
    """(layer, direction, piece) of every MXNet parameter of a double-bias module."""
    return [(k, d, p) for k in range(spec.num_layers) for d in range(spec.num_directions)
            for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh") + (("weight_hr",) if spec.proj_sizes[k] else ())]
