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
exactly (a missing bias is zeros in Flax's). On import, a tree must hold exactly the
cell's parameters: any other key (a bias on a Dense that has none, an extra Dense) is
refused, listed, since it would be dropped. A bfloat16 module exports float32 arrays
(numpy has no bfloat16; the values are exact); bfloat16 jax arrays import through
float32, into the module's ``dtype``.

Example:
    >>> params = rnnkit.interop.flax.to_flax(lstm)       # one tree per layer
    >>> y = flax.linen.RNN(flax.linen.LSTMCell(16)).apply({"params": params[0]}, x)
    >>> lstm2 = rnnkit.interop.flax.from_flax(params, "lstm")
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..spec import RNNSpec
from ._common import build_module, check_keys, exported_pieces, imported_array, refuse, spec_of, suffix

FMT = "Flax"
# Each cell's Dense layers, and the parameters each holds (flax/linen/recurrent.py)
CELL_PARAMS = {
    "lstm": {**{"i" + g: ("kernel",) for g in "ifgo"}, **{"h" + g: ("kernel", "bias") for g in "ifgo"}},
    "gru": {"ir": ("kernel", "bias"), "iz": ("kernel", "bias"), "in": ("kernel", "bias"),
            "hr": ("kernel",), "hz": ("kernel",), "hn": ("kernel", "bias")},
    "rnn": {"i": ("kernel", "bias"), "h": ("kernel",)},
}
FIRST_KERNELS = {"lstm": ("ii/kernel", "hi/kernel"), "gru": ("ir/kernel", "hr/kernel")}  # read the sizes from these


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
    pieces = exported_pieces(module)
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


def _keys(tree, expected, where: str) -> None:
    """Refuse a tree whose keys are not exactly ``expected``, listing the missing and the unexpected."""
    if not isinstance(tree, Mapping):
        raise TypeError(f"{where}: expected a dict with keys {sorted(expected)}, got {type(tree).__name__}")
    check_keys(tree, sorted(expected), where)


def _cell_arrays(mode: str, tree, where: str) -> Dict[str, np.ndarray]:
    """{"ii/kernel": array, ...}: every parameter of one cell, after checking it holds exactly those."""
    dense_params = CELL_PARAMS["rnn" if mode.startswith("rnn") else mode]
    _keys(tree, dense_params, where)
    arrays = {}
    for dense, names in dense_params.items():
        _keys(tree[dense], names, f"{where}/{dense}")
        for name in names:
            arrays[f"{dense}/{name}"] = imported_array(tree[dense][name], f"{where}/{dense}/{name}")
    return arrays


def _check_cell_shapes(arrays: Dict[str, np.ndarray], inputs: int, hidden: int, where: str) -> None:
    for key, array in arrays.items():
        dense, name = key.split("/")
        expected = (hidden,) if name == "bias" else ((inputs if dense[0] == "i" else hidden), hidden)
        if array.shape != expected:
            raise ValueError(f"{where}/{key}: expected shape {expected} (inputs {inputs}, hidden size "
                             f"{hidden}), got {array.shape}")


def _pieces_from_cell(spec: RNNSpec, arrays: Dict[str, np.ndarray], layer: int, direction: int, pieces: dict) -> None:
    s = suffix(layer, direction)
    a = lambda dense, name="kernel": arrays[f"{dense}/{name}"]  # noqa: E731
    if spec.mode == "lstm":
        W = [a("i" + g).T for g in "ifgo"]
        R = [a("h" + g).T for g in "ifgo"]
        b_R = np.concatenate([a("h" + g, "bias") for g in "ifgo"])
        b_W = np.zeros_like(b_R)
    elif spec.mode == "gru":
        W = [a("i" + g).T for g in "rzn"]
        R = [a("h" + g).T for g in "rzn"]
        b_W = np.concatenate([a("i" + g, "bias") for g in "rzn"])
        b_n = a("hn", "bias")
        b_R = np.concatenate([np.zeros_like(b_n), np.zeros_like(b_n), b_n])
    else:
        W, R = [a("i").T], [a("h").T]
        b_W = a("i", "bias")
        b_R = np.zeros_like(b_W)
    pieces["weight_ih" + s] = np.concatenate(W)
    pieces["weight_hh" + s] = np.concatenate(R)
    pieces["bias_ih" + s], pieces["bias_hh" + s] = b_W, b_R


def _layer_cells(params) -> List[List[tuple]]:
    """Per layer, [(cell tree, where)] for each direction, after checking the layers' structure."""
    if isinstance(params, Mapping) or not isinstance(params, Sequence) or isinstance(params, str):
        raise TypeError(f"params: expected a list with one parameter tree per layer (as to_flax returns), got "
                        f"{type(params).__name__}; wrap a single layer's tree in a list")
    if not params:
        raise ValueError("params: expected one parameter tree per layer, got an empty list")
    layers, bidirectional = [], None
    for k, tree in enumerate(params):
        if not isinstance(tree, Mapping):
            raise TypeError(f"params[{k}]: expected a layer's parameter tree (a dict), got {type(tree).__name__}")
        where = f"params[{k}]"
        if set(tree) == {"params"}:
            tree, where = tree["params"], f"params[{k}]/params"
        two = isinstance(tree, Mapping) and ("forward_rnn" in tree or "backward_rnn" in tree)
        if bidirectional is None:
            bidirectional = two
        elif two != bidirectional:
            kinds = {True: "bidirectional (forward_rnn, backward_rnn)", False: "unidirectional (cell)"}
            raise ValueError(f"{where}: layer 0 is {kinds[bidirectional]} but layer {k} is {kinds[two]}; "
                             "rnnkit's stacked layers all have the same directions")
        if two:
            _keys(tree, ("forward_rnn", "backward_rnn"), where)
            for name in ("forward_rnn", "backward_rnn"):
                _keys(tree[name], ("cell",), f"{where}/{name}")
            layers.append([(tree[name]["cell"], f"{where}/{name}/cell") for name in ("forward_rnn", "backward_rnn")])
        else:
            _keys(tree, ("cell",), where)
            layers.append([(tree["cell"], f"{where}/cell")])
    return layers


def from_flax(params: Sequence[dict], mode: str, *, merge: str = "concat", batch_first: bool = True, dtype=None):
    """Build an rnnkit module from per-layer Flax parameter trees (as `to_flax` makes).

    Args:
        params: one tree per layer, ``{"cell": ...}`` or ``{"forward_rnn": ..., "backward_rnn": ...}``;
            a tree may also be wrapped in ``{"params": ...}``.
        mode: "lstm" (LSTMCell / OptimizedLSTMCell), "gru" (GRUCell), "rnn_tanh" or
            "rnn_relu" (SimpleCell with that activation_fn; residual=False).
        merge: "concat" (Flax's default merge_fn) or "sum".
        batch_first: the module's layout; Flax's nn.RNN default is batch-major (True).
        dtype: the module's dtype (default float32); bfloat16 arrays are read as float32.

    The module has bias_mode "double", with Flax's biases where the cell adds them.

    Raises:
        TypeError: ``params`` is not a list of trees (e.g. one layer's tree on its own).
        ValueError: naming the tree's path, for a missing or unexpected key (listed), an
            array of the wrong shape, or layers that differ in their directions.
    """
    if mode not in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        raise ValueError(f"mode: expected 'lstm', 'gru', 'rnn_tanh' or 'rnn_relu', got {mode!r}")
    cells = [[(_cell_arrays(mode, tree, where), where) for tree, where in layer] for layer in _layer_cells(params)]
    first_w, first_r = FIRST_KERNELS.get(mode, ("i/kernel", "h/kernel"))
    for arrays, where in (d for layer in cells for d in layer):
        for key in (first_w, first_r):
            if arrays[key].ndim != 2:
                raise ValueError(f"{where}/{key}: expected a 2-D kernel, got shape {arrays[key].shape}")
    hidden = [int(layer[0][0][first_r].shape[1]) for layer in cells]
    input_size = int(cells[0][0][0][first_w].shape[0])
    bidirectional = len(cells[0]) == 2
    spec = RNNSpec(mode, input_size, hidden if len(set(hidden)) > 1 else hidden[0], len(cells),
                   bidirectional=bidirectional, merge=merge, batch_first=batch_first)
    pieces: dict = {}
    for layer, directions in enumerate(cells):
        cell = spec.cell(layer)
        for direction, (arrays, where) in enumerate(directions):
            _check_cell_shapes(arrays, cell.input_size, cell.hidden_size, where)
            _pieces_from_cell(spec, arrays, layer, direction, pieces)
    return build_module(spec, pieces, dtype)
