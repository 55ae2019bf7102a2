"""Flax linen: LSTMCell / OptimizedLSTMCell, GRUCell and SimpleCell parameter trees.

Flax cells hold one ``Dense`` per gate (kernel (in, H), applied as ``x @ kernel + bias``),
read from ``flax/linen/recurrent.py`` (flax 0.12):

    LSTMCell, OptimizedLSTMCell   ii, if, ig, io  (no bias)   hi, hf, hg, ho  (bias)
        i, f, o = σ(ii(x) + hi(h)), g = tanh(ig(x) + hg(h)), c' = f c + i g, h' = o tanh(c')
        (OptimizedLSTMCell creates the same names and shapes.) Carry (c, h).
    GRUCell                       ir, iz, in  (bias)          hr, hz (no bias), hn (bias)
        n = tanh(in(x) + r ∘ hn(h)): rnnkit's reset_after=True; b_Rr, b_Rz fold into ir, iz
    SimpleCell                    i (bias)                    h (no bias); h' = act(i(x) + h(h))

Gate names are the gates themselves, so docs/spec.md's order (i f g o, r z n; "Gate orders
elsewhere": Flax shares cuDNN's) only fixes which block of rnnkit's W each Dense takes.

A stacked module maps to one ``nn.RNN(cell)`` per layer, ``{"cell": cell_params}``, or with
two directions to ``nn.Bidirectional(nn.RNN(cell), nn.RNN(cell))``,
``{"forward_rnn": {"cell": ...}, "backward_rnn": {"cell": ...}}`` (merge "concat" is
Flax's default merge_fn; "sum" is ``merge_fn=lambda a, b: a + b``).

Refused naming the option: proj_size, peephole, coupled_gates, cell_clip, layer_norm,
zoneout, reset_after=False (GRUCell is reset-after only). Every bias mode exports
exactly (a missing bias is zeros in Flax's).

Example:
    >>> params = rnnkit.interop.flax.to_flax(lstm)       # one tree per layer
    >>> y = flax.linen.RNN(flax.linen.LSTMCell(16)).apply({"params": params[0]}, x)
    >>> lstm2 = rnnkit.interop.flax.from_flax(params, "lstm")
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from ..spec import RNNSpec
from ._common import build_module, numpy_pieces, refuse, spec_of, suffix

FMT = "Flax"


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that Flax's cells cannot represent."""
    refuse("flax", FMT, spec)


def _dense(kernel: np.ndarray, bias: Optional[np.ndarray] = None) -> dict:
    tree = {"kernel": np.ascontiguousarray(kernel)}
    if bias is not None:
        tree["bias"] = bias
    return tree


def _cell_params(spec: RNNSpec, pieces: Dict[str, np.ndarray], layer: int, direction: int) -> dict:
    cell, s = spec.cell(layer), suffix(layer, direction)
    gh = cell.gates * cell.hidden_size
    W, R = pieces["weight_ih" + s], pieces["weight_hh" + s]
    zeros = np.zeros(gh, dtype=W.dtype)
    b_W = pieces["bias_ih" + s] if cell.has_bias_ih else zeros
    b_R = pieces["bias_hh" + s] if cell.has_bias_hh else zeros
    blocks = lambda a: np.split(a, cell.gates, axis=0)  # noqa: E731  (rnnkit's gate order)
    if spec.mode == "lstm":
        tree = {}
        for gate, w, r, b in zip("ifgo", blocks(W), blocks(R), blocks(b_W + b_R)):
            tree["i" + gate] = _dense(w.T)
            tree["h" + gate] = _dense(r.T, b)
        return tree
    if spec.mode == "gru":
        (w_r, w_z, w_n), (r_r, r_z, r_n) = blocks(W), blocks(R)
        (bw_r, bw_z, bw_n), (br_r, br_z, br_n) = blocks(b_W), blocks(b_R)
        return {
            "ir": _dense(w_r.T, bw_r + br_r), "iz": _dense(w_z.T, bw_z + br_z), "in": _dense(w_n.T, bw_n),
            "hr": _dense(r_r.T), "hz": _dense(r_z.T), "hn": _dense(r_n.T, br_n),
        }
    return {"i": _dense(W.T, b_W + b_R), "h": _dense(R.T)}


def to_flax(module) -> List[dict]:
    """One parameter tree per layer: ``{"cell": ...}``, or for two directions
    ``{"forward_rnn": {"cell": ...}, "backward_rnn": {"cell": ...}}`` (numpy arrays)."""
    spec = spec_of(module)
    check_spec(spec)
    pieces = numpy_pieces(module)
    layers = []
    for layer in range(spec.num_layers):
        if spec.bidirectional:
            layers.append({
                "forward_rnn": {"cell": _cell_params(spec, pieces, layer, 0)},
                "backward_rnn": {"cell": _cell_params(spec, pieces, layer, 1)},
            })
        else:
            layers.append({"cell": _cell_params(spec, pieces, layer, 0)})
    return layers


def _array(tree, *keys):
    for key in keys:
        if key not in tree:
            raise ValueError(f"params: missing {'/'.join(keys)}")
        tree = tree[key]
    return np.asarray(tree)


def _pieces_from_cell(spec: RNNSpec, tree, layer: int, direction: int, pieces: dict) -> None:
    s = suffix(layer, direction)
    if spec.mode == "lstm":
        W = [_array(tree, "i" + g, "kernel").T for g in "ifgo"]
        R = [_array(tree, "h" + g, "kernel").T for g in "ifgo"]
        b_R = np.concatenate([_array(tree, "h" + g, "bias") for g in "ifgo"])
        b_W = np.zeros_like(b_R)
    elif spec.mode == "gru":
        W = [_array(tree, "i" + g, "kernel").T for g in "rzn"]
        R = [_array(tree, "h" + g, "kernel").T for g in "rzn"]
        b_W = np.concatenate([_array(tree, "i" + g, "bias") for g in "rzn"])
        b_n = _array(tree, "hn", "bias")
        b_R = np.concatenate([np.zeros_like(b_n), np.zeros_like(b_n), b_n])
    else:
        W, R = [_array(tree, "i", "kernel").T], [_array(tree, "h", "kernel").T]
        b_W = _array(tree, "i", "bias")
        b_R = np.zeros_like(b_W)
    pieces["weight_ih" + s] = np.concatenate(W)
    pieces["weight_hh" + s] = np.concatenate(R)
    pieces["bias_ih" + s], pieces["bias_hh" + s] = b_W, b_R


def from_flax(params: Sequence[dict], mode: str, *, merge: str = "concat", batch_first: bool = True, dtype=None):
    """Build an rnnkit module from per-layer Flax parameter trees (as `to_flax` makes).

    Args:
        params: one tree per layer, ``{"cell": ...}`` or ``{"forward_rnn": ..., "backward_rnn": ...}``;
            a tree may also be wrapped in ``{"params": ...}``.
        mode: "lstm" (LSTMCell / OptimizedLSTMCell), "gru" (GRUCell), "rnn_tanh" or
            "rnn_relu" (SimpleCell with that activation_fn; residual=False).
        merge: "concat" (Flax's default merge_fn) or "sum".
        batch_first: the module's layout; Flax's nn.RNN default is batch-major (True).

    The module has bias_mode "double", with Flax's biases where the cell adds them.
    """
    if mode not in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        raise ValueError(f"mode: expected 'lstm', 'gru', 'rnn_tanh' or 'rnn_relu', got {mode!r}")
    params = [p["params"] if "params" in p else p for p in params]
    bidirectional = "forward_rnn" in params[0]
    cells = [[p["forward_rnn"]["cell"], p["backward_rnn"]["cell"]] if bidirectional else [p["cell"]] for p in params]
    first_w = {"lstm": ("ii", "kernel"), "gru": ("ir", "kernel")}.get(mode, ("i", "kernel"))
    first_r = {"lstm": ("hi", "kernel"), "gru": ("hr", "kernel")}.get(mode, ("h", "kernel"))
    hidden = [int(_array(c[0], *first_r).shape[0]) for c in cells]
    input_size = int(_array(cells[0][0], *first_w).shape[0])
    spec = RNNSpec(mode, input_size, hidden if len(set(hidden)) > 1 else hidden[0], len(cells),
                   bidirectional=bidirectional, merge=merge, batch_first=batch_first)
    pieces: dict = {}
    for layer, directions in enumerate(cells):
        for direction, tree in enumerate(directions):
            _pieces_from_cell(spec, tree, layer, direction, pieces)
    return build_module(spec, pieces, dtype)
