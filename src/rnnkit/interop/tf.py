"""TensorFlow 1.x: ``tf.compat.v1.nn.rnn_cell`` LSTMCell / BasicLSTMCell / GRUCell variables, and CudnnLSTM / CudnnGRU canonical weights.

LSTMCell and BasicLSTMCell (TF 1.x ``rnn_cell_impl.py``), per layer and direction:

    kernel             (I + Hr, 4H)  rows: input then recurrent; gates i j f o (j = candidate)
    bias               (4H,)
    w_i_diag, w_f_diag, w_o_diag (H,)              LSTMCell use_peepholes
    projection/kernel  (H, P)                      LSTMCell num_proj

    a = [x, m_prev] @ kernel + bias;  i, j, f, o = split(a, 4)
    c = σ(f + forget_bias [+ w_f_diag c_prev]) c_prev + σ(i [+ w_i_diag c_prev]) tanh(j)
    c = clip(c, ±cell_clip);  m = σ(o [+ w_o_diag c]) tanh(c);  m = clip(m @ proj, ±proj_clip)

This is docs/spec.md's LSTM with peepholes (Greff), cell_clip and proj_clip; the gate order
(docs/spec.md, "Gate orders elsewhere": TF i j f o is rnnkit's "igfo") is reordered here.
``forget_bias`` is added at run time by TF, so import folds it into the forget bias and
export subtracts it. TF's one bias is b_W + b_R (exact for every rnnkit bias mode).

GRUCell, per layer and direction:

    gates/kernel       (I + H, 2H)   gates r u;  gates/bias (2H,)
    candidate/kernel   (I + H, H);               candidate/bias (H,)

    r, u = σ([x, h] @ gates/kernel + gates/bias)
    c = tanh([x, r ∘ h] @ candidate/kernel + candidate/bias);  h' = u h + (1 − u) c

which is docs/spec.md's GRU with ``reset_after=False`` (u is rnnkit's z; b_Rn sits outside
the reset there, so one bias per gate is exact for every bias mode).

Stacks and directions: ``MultiRNNCell`` is a stack of layers, ``bidirectional_dynamic_rnn``
one bidirectional layer (concatenate its two outputs for the next layer, as rnnkit's
merge="concat"). `cells_from_names` groups TF's variable names into
``cells[layer][direction]``. TF zeroes outputs past ``sequence_length`` and its reverse
direction starts at each sequence's last valid step, as rnnkit does.

Refused naming the option: coupled_gates (TF's CoupledInputForgetGateLSTMCell is another
cell), layer_norm, zoneout, merge="sum", GRU reset_after=True, RNN modes.

CudnnLSTM / CudnnGRU / CudnnRNNTanh / CudnnRNNRelu (``tf.contrib.cudnn_rnn``) keep cuDNN's
canonical weights: see `to_tf_cudnn`, built on `rnnkit.interop.cudnn`. They refuse what
cuDNN refuses, and cell_clip too: TF's cuDNN layers take no clip. They always have both
biases; a module with fewer exports zeros for the missing ones (exact). TF 2.21's
``CudnnRNNParamsToCanonical`` / ``CudnnRNNCanonicalToParams`` have no CPU kernel, so that
path is checked only against cuDNN's documented (pseudoLayer, linLayerID) addressing.

A bfloat16 module exports float32 arrays from `to_tf` (numpy has no bfloat16; the values
are exact) and bfloat16 tensors from `to_tf_cudnn`.

Example:
    >>> tf_vars = rnnkit.interop.tf.to_tf(lstm, forget_bias=1.0)   # cells[layer][direction]
    >>> lstm2 = rnnkit.interop.tf.from_tf(tf_vars)
    >>> named = {v.name: sess.run(v) for v in tf.compat.v1.trainable_variables()}
    >>> gru = rnnkit.interop.tf.from_tf(named)                      # TF's own variable names
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from ..spec import RNNSpec
from . import cudnn
from ._common import (build_module, exported_pieces, finite_number, imported_array, refuse, refuse_mode, regate,
                      spec_of, suffix, to_numpy)

TF_GATES = "igfo"
CELL_NAMES = {"lstm": "LSTMCell", "gru": "GRUCell"}
LSTM_VARIABLES = ("kernel", "bias", "w_i_diag", "w_f_diag", "w_o_diag", "projection/kernel")
GRU_VARIABLES = ("gates/kernel", "gates/bias", "candidate/kernel", "candidate/bias")
FMT = "TF 1.x rnn_cell"
CUDNN_FMT = "TF CudnnRNN"
PEEPHOLE_VARIABLES = ("w_i_diag", "w_f_diag", "w_o_diag")
FROM_CONFIG = "config"  # from_tf's settings: take the value from variables["config"]


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that TF's LSTMCell / GRUCell cannot represent."""
    refuse_mode(FMT, spec, ("lstm", "gru"))
    refuse("tf", FMT, spec)


def _bias(pieces: Dict[str, np.ndarray], s: str, size: int, dtype) -> np.ndarray:
    """b_W + b_R of one layer-direction (zeros for a bias the module's bias mode lacks)."""
    bias = np.zeros(size, dtype=dtype)
    for name in ("bias_ih", "bias_hh"):
        if name + s in pieces:
            bias = bias + pieces[name + s]
    return bias


def to_tf(module, *, forget_bias: float = 1.0) -> dict:
    """The module's weights as TF 1.x LSTMCell (or, for a GRU, GRUCell) variables.

    Args:
        module: an rnnkit LSTM, or a GRU with ``reset_after=False``.
        forget_bias: the TF LSTMCell's ``forget_bias`` (TF's default 1.0), subtracted from
            the exported forget bias; unused for a GRU.

    Returns:
        ``{"config": {cell, num_units, num_proj, use_peepholes, cell_clip, proj_clip, forget_bias},
        "cells": [[{variable name: array} per direction] per layer]}``; variable names are
        those of the TF cell's scope (``kernel``, ``bias``, ``w_i_diag``, ``projection/kernel``;
        GRU ``gates/kernel``, ``gates/bias``, ``candidate/kernel``, ``candidate/bias``).
        ``num_units`` and ``num_proj`` are per-layer lists. Arrays have the module's dtype,
        but a bfloat16 module's are float32 (exact; numpy has no bfloat16).
    """
    spec = spec_of(module)
    check_spec(spec)
    forget_bias = finite_number("forget_bias", forget_bias)
    pieces = exported_pieces(module)
    cells = []
    for layer in range(spec.num_layers):
        cell, directions = spec.cell(layer), []
        for direction in range(spec.num_directions):
            s, H = suffix(layer, direction), cell.hidden_size
            W, R = pieces["weight_ih" + s], pieces["weight_hh" + s]
            kernel = np.concatenate([W, R], axis=1)  # [G·H, I + Hr]
            bias = _bias(pieces, s, cell.gates * H, W.dtype)
            if spec.mode == "gru":  # rnnkit r z n: gates r, u(= z), then the candidate n
                variables = {"gates/kernel": kernel[: 2 * H].T.copy(), "gates/bias": bias[: 2 * H].copy(),
                             "candidate/kernel": kernel[2 * H :].T.copy(), "candidate/bias": bias[2 * H :].copy()}
            else:
                bias = regate(bias, "ifgo", TF_GATES)
                bias[2 * H : 3 * H] -= forget_bias  # TF adds forget_bias at run time
                variables = {"kernel": regate(kernel, "ifgo", TF_GATES).T.copy(), "bias": bias}
                if cell.peephole:
                    p = pieces["weight_peephole" + s]  # rows i, f, o
                    variables.update(w_i_diag=p[0].copy(), w_f_diag=p[1].copy(), w_o_diag=p[2].copy())
                if cell.proj_size:
                    variables["projection/kernel"] = pieces["weight_hr" + s].T.copy()
            directions.append(variables)
        cells.append(directions)
    config = dict(
        cell=CELL_NAMES[spec.mode], num_units=list(spec.hidden_sizes), num_proj=[p or None for p in spec.proj_sizes],
        use_peepholes=spec.peephole, cell_clip=spec.cell_clip, proj_clip=spec.proj_clip,
        forget_bias=forget_bias if spec.mode == "lstm" else None,
    )
    return {"config": config, "cells": cells}


# the scopes TF 1.x gives a cell's variables: LSTMCell, BasicLSTMCell, GRUCell (tf.compat.v1.nn.rnn_cell)
CELL_SCOPES = frozenset({"lstm_cell", "basic_lstm_cell", "gru_cell"})
# from_tf's config keys: to_tf's (cell, num_units, num_proj, use_peepholes are read from the arrays too, and checked)
CONFIG_KEYS = frozenset({"cell", "num_units", "num_proj", "use_peepholes", "cell_clip", "proj_clip", "forget_bias"})


def _natural_key(text: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def cells_from_names(named: Mapping[str, object]) -> List[List[Dict[str, object]]]:
    """Group TF 1.x variables, keyed by their TF names, into ``cells[layer][direction]``.

    ``named`` maps names as ``tf.compat.v1.trainable_variables()`` or a checkpoint reader
    gives them (``rnn/multi_rnn_cell/cell_1/lstm_cell/kernel:0``,
    ``bidirectional_rnn/bw/gru_cell/gates/bias``) to values, which are passed through
    untouched. A cell is the scope before its variable's own name; the direction is
    the ``fw`` / ``bw`` scope of ``bidirectional_dynamic_rnn``; layers are the cells'
    scopes without the direction, in natural order (``cell_2`` before ``cell_10``).

    Raises:
        ValueError: for a name that is no LSTMCell / GRUCell variable, or for a
            ``bidirectional_dynamic_rnn`` over a ``MultiRNNCell`` (each direction a whole
            stack: not rnnkit's layer-by-layer bidirectional stack).
    """
    if not isinstance(named, Mapping):
        raise TypeError(f"named: expected a mapping of TF variable names to arrays, got {type(named).__name__}")
    layers: Dict[str, Dict[int, Dict[str, object]]] = {}
    for name, value in named.items():
        path = name.split(":")[0].split("/")
        two = "/".join(path[-2:])
        variable = two if two in LSTM_VARIABLES + GRU_VARIABLES else path[-1]
        if variable not in LSTM_VARIABLES + GRU_VARIABLES:
            raise ValueError(f"named: {name!r} is not a variable of a TF LSTMCell or GRUCell "
                             f"(expected a name ending in one of {LSTM_VARIABLES + GRU_VARIABLES})")
        scope = path[: len(path) - len(variable.split("/"))]
        if not scope or scope[-1] not in CELL_SCOPES:  # a Dense's kernel / bias would pass for an LSTMCell's
            raise ValueError(f"named: {name!r} is not under a TF LSTMCell / GRUCell scope (a name's part before "
                             f"{variable!r} is one of {sorted(CELL_SCOPES)}); pass the recurrent layers' variables "
                             "alone, or cells named otherwise as from_tf's {'cells': [[{variable: array}]]}")
        sides = [k for k, part in enumerate(scope) if part in ("fw", "bw")]
        direction = 0
        if sides:
            k = sides[-1]
            direction = int(scope[k] == "bw")
            if any(re.fullmatch(r"cell_\d+", part) for part in scope[k + 1 :]):
                raise ValueError(f"named: {name!r} belongs to a MultiRNNCell inside bidirectional_dynamic_rnn, which "
                                 "stacks each direction separately; rnnkit's bidirectional layers merge after every "
                                 "layer (use one bidirectional_dynamic_rnn per layer)")
            scope = scope[:k] + scope[k + 1 :]
        cell = layers.setdefault("/".join(scope), {}).setdefault(direction, {})
        if variable in cell:
            raise ValueError(f"named: two values for {variable!r} of the cell of {name!r}")
        cell[variable] = value
    cells = []
    for key in sorted(layers, key=_natural_key):
        directions = layers[key]
        if sorted(directions) not in ([0], [0, 1]):
            raise ValueError(f"named: the cell scope {key!r} has a bw direction without an fw one")
        cells.append([directions[d] for d in sorted(directions)])
    return cells


def from_tf(variables, *, forget_bias=FROM_CONFIG, cell_clip=FROM_CONFIG, proj_clip=FROM_CONFIG,
            batch_first: bool = False, dtype=None):
    """Build an rnnkit LSTM or GRU from TF 1.x LSTMCell / BasicLSTMCell / GRUCell variables.

    Args:
        variables: `to_tf`'s ``{"config", "cells"}``, or TF's own names mapped to
            arrays (grouped by `cells_from_names`). Sizes, peepholes, the projection,
            layers and directions are read from the arrays.
        forget_bias: the LSTMCells' forget_bias (a setting, not a variable), a number;
            ``"config"`` (the default): ``variables["config"]``'s, else TF's default 1.0.
        cell_clip: the LSTMCells' cell_clip, or None for no clip; ``"config"`` (the
            default): the config's, else None. An explicit None removes a clip the config has.
        proj_clip: the LSTMCells' proj_clip, or None; ``"config"`` (the default) as for
            cell_clip.
        batch_first: the module's layout (``time_major=False`` in TF).
        dtype: the module's dtype (default float32).

    An LSTM gets bias_mode "double" with the whole TF bias (forget_bias folded in) in
    bias_ih; a GRUCell stack becomes a GRU with ``reset_after=False``, likewise.
    """
    if isinstance(variables, Mapping) and "cells" in variables:
        config, cells = dict(variables.get("config") or {}), variables["cells"]
    else:
        config, cells = {}, cells_from_names(variables)
    for key, value in dict(forget_bias=forget_bias, cell_clip=cell_clip, proj_clip=proj_clip).items():
        if not isinstance(value, str):
            config[key] = value
        elif value != FROM_CONFIG:
            raise ValueError(f"{key}: expected a number, None or {FROM_CONFIG!r}, got {value!r}")
    if not cells:
        raise ValueError("variables: no cells")
    gru = ["gates/kernel" in directions[0] for directions in cells]
    if any(gru) != all(gru):
        raise ValueError("variables: mixes GRUCell and LSTMCell layers; an rnnkit stack has one cell kind")
    D = len(cells[0])
    if any(len(directions) != D for directions in cells):
        raise ValueError("variables: some layers are bidirectional and some not; rnnkit's layers share directions")
    expected = GRU_VARIABLES if gru[0] else LSTM_VARIABLES
    for layer, directions in enumerate(cells):
        for direction, v in enumerate(directions):
            unknown = sorted(set(v) - set(expected))
            if unknown:
                raise ValueError(f"variables: cells[{layer}][{direction}] has {unknown}, not variables of a "
                                 f"TF {'GRUCell' if gru[0] else 'LSTMCell'}")
    cells = [[{key: to_numpy(value, key) for key, value in v.items()} for v in directions] for directions in cells]
    unknown = sorted(set(config) - CONFIG_KEYS)
    if unknown:
        raise ValueError(f"variables: config has {unknown}, not keys of to_tf's config ({sorted(CONFIG_KEYS)})")
    if gru[0]:
        # a GRUCell has no forget bias or clips: a value for one is refused, not dropped (num_proj and
        # use_peepholes are the config's description of the cells, which _check_config compares)
        for key in ("forget_bias", "cell_clip", "proj_clip"):
            if config.get(key) is not None:
                raise ValueError(f"{key}: a TF GRUCell has none (the arrays are a GRUCell's), got {config[key]!r}")
        module = _gru_from_tf(cells, batch_first, dtype)
    else:
        module = _lstm_from_tf(cells, config, batch_first, dtype)
    _check_config(config, module.spec)
    return module


def _check_config(config: dict, spec: RNNSpec) -> None:
    """The config's description of the cells (cell kind, sizes, peepholes, projection) against what the
    arrays made: a contradiction is an error naming the key, not a module built from one of the two."""
    made = dict(cell=CELL_NAMES[spec.mode], num_units=list(spec.hidden_sizes),
                num_proj=[p or None for p in spec.proj_sizes], use_peepholes=spec.peephole)
    for key, value in made.items():
        if key not in config or config[key] is None:
            continue
        given = config[key]
        if key in ("num_units", "num_proj") and not isinstance(given, (list, tuple)):
            given = [given] * spec.num_layers
        if key == "num_proj":
            given = [p or None for p in given]
        if key == "cell" and given == "BasicLSTMCell":
            given = "LSTMCell"  # the same variables (no peepholes, no projection: checked as the arrays say)
        if (list(given) if isinstance(given, (list, tuple)) else given) != value:
            raise ValueError(f"variables: config {key}={config[key]!r}, but the arrays are {key}={value!r}")


def _require(v: dict, names, where: str) -> None:
    missing = [name for name in names if name not in v]
    if missing:
        raise ValueError(f"variables: {where} has no {missing[0]}")


def _check_shape(v: dict, name: str, expected: tuple, where: str) -> None:
    if tuple(v[name].shape) != tuple(expected):
        raise ValueError(f"variables: {where}['{name}'] expected shape {tuple(expected)}, got {tuple(v[name].shape)}")


def _columns(v: dict, name: str, where: str, blocks: int) -> int:
    """The size of one of ``blocks`` gate blocks along the columns of the matrix ``v[name]``."""
    shape = tuple(v[name].shape)
    if len(shape) != 2 or shape[1] % blocks or not shape[1]:
        blocks_of = f" of {blocks} gate blocks of columns" if blocks > 1 else ""
        raise ValueError(f"variables: {where}['{name}'] expected a matrix{blocks_of}, got shape {shape}")
    return shape[1] // blocks


def _split_kernel(v: dict, name: str, rows: int, where: str, expected: tuple) -> Tuple[np.ndarray, np.ndarray]:
    """A TF kernel (I + Hr, G·H) -> (W, R) as rnnkit's (G·H, I), (G·H, Hr)."""
    _check_shape(v, name, expected, where)
    return v[name][:rows].T, v[name][rows:].T


def _lstm_from_tf(cells, config: dict, batch_first: bool, dtype):
    forget_bias = finite_number("forget_bias", config.get("forget_bias", 1.0))
    for layer, directions in enumerate(cells):
        for direction, v in enumerate(directions):
            where = f"cells[{layer}][{direction}]"
            _require(v, ("kernel", "bias"), where)
            if any(name in v for name in PEEPHOLE_VARIABLES):
                _require(v, PEEPHOLE_VARIABLES, where)
    hidden = [_columns(directions[0], "kernel", f"cells[{layer}][0]", 4) for layer, directions in enumerate(cells)]
    proj = [_columns(d[0], "projection/kernel", f"cells[{layer}][0]", 1) if "projection/kernel" in d[0] else 0
            for layer, d in enumerate(cells)]
    out = [p or h for p, h in zip(proj, hidden)]
    input_size = int(cells[0][0]["kernel"].shape[0]) - out[0]
    peephole = ["w_i_diag" in v for directions in cells for v in directions]
    if any(peephole) != all(peephole):
        raise ValueError("variables: some LSTMCells have peepholes and some not; rnnkit's layers share them")
    listed = len(set(hidden)) > 1 or len(set(proj)) > 1
    spec = RNNSpec(
        "lstm", input_size, hidden if listed else hidden[0], len(cells),
        bidirectional=len(cells[0]) == 2, proj_size=proj if listed else proj[0],
        peephole=all(peephole), cell_clip=config.get("cell_clip"), proj_clip=config.get("proj_clip"),
        batch_first=batch_first,
    )
    pieces = {}
    for layer, directions in enumerate(cells):
        cell = spec.cell(layer)
        for direction, v in enumerate(directions):
            s, H, where = suffix(layer, direction), cell.hidden_size, f"cells[{layer}][{direction}]"
            _check_shape(v, "bias", (4 * H,), where)
            if spec.peephole:
                for name in PEEPHOLE_VARIABLES:
                    _check_shape(v, name, (H,), where)
            if cell.proj_size:
                _check_shape(v, "projection/kernel", (H, cell.proj_size), where)
            elif "projection/kernel" in v:
                raise ValueError(f"variables: {where} has a projection/kernel, but cells[{layer}][0] has none")
            W, R = _split_kernel(v, "kernel", cell.input_size, where, (cell.input_size + cell.output_size, 4 * H))
            pieces["weight_ih" + s] = regate(W, TF_GATES, "ifgo")
            pieces["weight_hh" + s] = regate(R, TF_GATES, "ifgo")
            bias = v["bias"].copy()
            bias[2 * H : 3 * H] += forget_bias
            pieces["bias_ih" + s] = regate(bias, TF_GATES, "ifgo")
            pieces["bias_hh" + s] = np.zeros_like(bias)
            if spec.peephole:
                pieces["weight_peephole" + s] = np.stack([v["w_i_diag"], v["w_f_diag"], v["w_o_diag"]])
            if cell.proj_size:
                pieces["weight_hr" + s] = v["projection/kernel"].T
    return build_module(spec, pieces, dtype)


def _gru_from_tf(cells, batch_first: bool, dtype):
    for layer, directions in enumerate(cells):
        for direction, v in enumerate(directions):
            _require(v, GRU_VARIABLES, f"cells[{layer}][{direction}]")
    hidden = [_columns(directions[0], "candidate/kernel", f"cells[{layer}][0]", 1)
              for layer, directions in enumerate(cells)]
    input_size = int(cells[0][0]["gates/kernel"].shape[0]) - hidden[0]
    spec = RNNSpec("gru", input_size, hidden if len(set(hidden)) > 1 else hidden[0], len(cells),
                   bidirectional=len(cells[0]) == 2, reset_after=False, batch_first=batch_first)
    pieces = {}
    for layer, directions in enumerate(cells):
        cell = spec.cell(layer)
        for direction, v in enumerate(directions):
            s, H, where = suffix(layer, direction), cell.hidden_size, f"cells[{layer}][{direction}]"
            rows = cell.input_size + H
            W_rz, R_rz = _split_kernel(v, "gates/kernel", cell.input_size, where, (rows, 2 * H))
            W_n, R_n = _split_kernel(v, "candidate/kernel", cell.input_size, where, (rows, H))
            _check_shape(v, "gates/bias", (2 * H,), where)
            _check_shape(v, "candidate/bias", (H,), where)
            pieces["weight_ih" + s] = np.concatenate([W_rz, W_n])
            pieces["weight_hh" + s] = np.concatenate([R_rz, R_n])
            bias = np.concatenate([v["gates/bias"], v["candidate/bias"]])
            pieces["bias_ih" + s], pieces["bias_hh" + s] = bias, np.zeros_like(bias)
    return build_module(spec, pieces, dtype)


def check_cudnn_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that TF's cuDNN layers cannot represent."""
    refuse("cudnn", CUDNN_FMT, spec)
    if spec.cell_clip is not None:  # cuDNN's descriptor has a clip, but no TF cuDNN layer takes one
        raise ValueError(f"cell_clip: {CUDNN_FMT} cannot represent this option of the {spec.mode} module")


def to_tf_cudnn(module) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """CudnnLSTM / CudnnGRU / CudnnRNNTanh / CudnnRNNRelu canonical (weights, biases).

    The lists run over layers, directions, then cuDNN's linLayerIDs (docs/spec.md: TF's cuDNN
    layers keep cuDNN's gate order), as ``CudnnRNNParamsToCanonical`` returns them;
    each matrix is (H, in) as cuDNN stores it, the projection (linLayerID 8) last. The
    biases are TF's double-bias list, 2G per layer-direction, (H,) each: zeros where the
    module's bias_mode has none, which computes the same. Tensors have the module's dtype.

    Raises:
        ValueError: naming an option TF's cuDNN layers lack: what `rnnkit.interop.cudnn`
            refuses, and cell_clip.
    """
    spec = spec_of(module)
    check_cudnn_spec(spec)
    params = cudnn.to_cudnn(module)
    biases, zeros = params["biases"], params["matrices"][(0, 0)].new_zeros(spec.hidden_sizes[0])
    double = {(pseudo, i): biases[(pseudo, i)] if (pseudo, i) in biases else zeros.clone()
              for pseudo in range(spec.num_layers * spec.num_directions) for i in range(2 * spec.gates)}
    return sorted_values(params["matrices"]), sorted_values(double)


def sorted_values(table: dict) -> list:
    return [table[key] for key in sorted(table)]


def from_tf_cudnn(weights, biases, mode: str, input_size: int, hidden_size: int, num_layers: int = 1, *,
                  bidirectional: bool = False, proj_size: int = 0, batch_first: bool = False, dtype=None):
    """Build an rnnkit module from TF cuDNN canonical weights and biases (double bias, as TF's)."""
    spec = RNNSpec(mode, input_size, hidden_size, num_layers, bidirectional=bidirectional, proj_size=proj_size)
    G, D = spec.gates, spec.num_directions
    ids = list(range(2 * G)) + ([cudnn.PROJECTION_ID] if proj_size else [])
    keys = [(layer * D + d, i) for layer in range(num_layers) for d in range(D) for i in ids]
    bias_keys = [(p, i) for p, i in keys if i != cudnn.PROJECTION_ID]
    for name, given in (("weights", weights), ("biases", biases)):
        if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Sequence):
            raise TypeError(f"{name}: expected a list of arrays (TF's canonical order), got {type(given).__name__}")
    weights = [imported_array(value, f"weights[{index}]") for index, value in enumerate(weights)]
    biases = [imported_array(value, f"biases[{index}]") for index, value in enumerate(biases)]
    if len(weights) != len(keys) or len(biases) != len(bias_keys):
        raise ValueError(f"weights, biases: expected {len(keys)} and {len(bias_keys)} tensors, "
                         f"got {len(weights)} and {len(biases)}")
    params = {
        "config": dict(cellMode=cudnn.CUDNN_MODES[mode], biasMode="CUDNN_RNN_DOUBLE_BIAS",
                       dirMode="CUDNN_BIDIRECTIONAL" if bidirectional else "CUDNN_UNIDIRECTIONAL",
                       inputSize=input_size, hiddenSize=hidden_size, projSize=proj_size or hidden_size,
                       numLayers=num_layers),
        "matrices": dict(zip(keys, weights)),
        "biases": dict(zip(bias_keys, biases)),
    }
    shapes = cudnn._entry_shapes(spec)
    for index, (key, value) in enumerate(zip(keys, weights)):  # by the lists' indices, as the caller gave them
        if tuple(value.shape) != shapes[key]:
            raise ValueError(f"weights[{index}]: expected shape {shapes[key]} ((pseudoLayer, linLayerID) {key}), "
                             f"got {tuple(value.shape)}")
    for index, value in enumerate(biases):
        if tuple(value.shape) != (hidden_size,):
            raise ValueError(f"biases[{index}]: expected shape ({hidden_size},), got {tuple(value.shape)}")
    return cudnn.from_cudnn(params, batch_first=batch_first, dtype=dtype)
