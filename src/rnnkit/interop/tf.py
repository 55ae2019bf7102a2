"""TensorFlow 1.x: ``tf.nn.rnn_cell.LSTMCell`` variables, and CudnnLSTM / CudnnGRU canonical weights.

LSTMCell (TF 1.x ``rnn_cell_impl.py``), per layer and direction:

    kernel             (I + Hr, 4H)  rows: input then recurrent; gates i j f o (j = candidate)
    bias               (4H,)
    w_i_diag, w_f_diag, w_o_diag (H,)              use_peepholes
    projection/kernel  (H, P)                      num_proj

    a = [x, m_prev] @ kernel + bias;  i, j, f, o = split(a, 4)
    c = σ(f + forget_bias [+ w_f_diag c_prev]) c_prev + σ(i [+ w_i_diag c_prev]) tanh(j)
    c = clip(c, ±cell_clip);  m = σ(o [+ w_o_diag c]) tanh(c);  m = clip(m @ proj, ±proj_clip)

This is SPEC.md's LSTM with peepholes (Greff), cell_clip and proj_clip; the gate order
(SPEC.md, "Gate orders elsewhere": TF i j f o is rnnkit's "igfo") is reordered here.
``forget_bias`` is added at run time by TF, so import folds it into the forget bias and
export subtracts it. TF's one bias is b_W + b_R (exact for every rnnkit bias mode).

Refused naming the option: coupled_gates (TF's CoupledInputForgetGateLSTMCell is another
cell), layer_norm, zoneout, reset_after, merge="sum", GRU and RNN modes for LSTMCell.

CudnnLSTM / CudnnGRU (``tf.contrib.cudnn_rnn``) keep cuDNN's canonical weights: see
:func:`to_tf_cudnn`, built on :mod:`rnnkit.interop.cudnn`.

Example:
    >>> tf_vars = rnnkit.interop.tf.to_tf(lstm, forget_bias=1.0)   # cells[layer][direction]
    >>> lstm2 = rnnkit.interop.tf.from_tf(tf_vars)
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from ..spec import RNNSpec
from . import cudnn
from ._common import build_module, numpy_pieces, refuse, refuse_mode, regate, spec_of, suffix

TF_GATES = "igfo"
FMT = "TF 1.x LSTMCell"


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that TF's LSTMCell cannot represent."""
    refuse_mode(FMT, spec, ("lstm",))
    refuse(FMT, spec, allowed={"proj_size", "proj_clip", "cell_clip", "peephole", "per-layer sizes",
                               "bidirectional", "num_layers>1"})


def to_tf(module, *, forget_bias: float = 1.0) -> dict:
    """The module's weights as TF 1.x LSTMCell variables.

    Returns:
        ``{"config": {num_units, num_proj, use_peepholes, cell_clip, proj_clip, forget_bias},
        "cells": [[{variable name: array} per direction] per layer]}``; variable names are
        ``kernel``, ``bias``, ``w_i_diag``, ``w_f_diag``, ``w_o_diag``, ``projection/kernel``.
        ``num_units`` and ``num_proj`` are per-layer lists.
    """
    spec = spec_of(module)
    check_spec(spec)
    pieces = numpy_pieces(module)
    cells = []
    for layer in range(spec.num_layers):
        cell, directions = spec.cell(layer), []
        for direction in range(spec.num_directions):
            s = suffix(layer, direction)
            kernel = np.concatenate([pieces["weight_ih" + s], pieces["weight_hh" + s]], axis=1)  # [4H, I + Hr]
            bias = np.zeros(4 * cell.hidden_size, dtype=kernel.dtype)
            for name in ("bias_ih", "bias_hh"):
                if name + s in pieces:
                    bias = bias + pieces[name + s]
            bias = regate(bias, "ifgo", TF_GATES)
            H = cell.hidden_size
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
        num_units=list(spec.hidden_sizes), num_proj=[p or None for p in spec.proj_sizes],
        use_peepholes=spec.peephole, cell_clip=spec.cell_clip, proj_clip=spec.proj_clip, forget_bias=forget_bias,
    )
    return {"config": config, "cells": cells}


def from_tf(tf_vars: dict, *, batch_first: bool = False, dtype=None):
    """Build an rnnkit LSTM from :func:`to_tf`'s structure (TF 1.x LSTMCell variables).

    ``tf_vars["config"]`` may give ``forget_bias`` (default 1.0, TF's), ``cell_clip`` and
    ``proj_clip``; sizes and peepholes are read from the variables. The module has
    bias_mode "double" with the whole TF bias (forget_bias folded in) in bias_ih.
    """
    config, cells = tf_vars.get("config", {}), tf_vars["cells"]
    forget_bias = config.get("forget_bias", 1.0)
    hidden = [int(np.shape(directions[0]["bias"])[0]) // 4 for directions in cells]
    proj = [int(np.shape(d[0]["projection/kernel"])[1]) if "projection/kernel" in d[0] else 0 for d in cells]
    out = [p or h for p, h in zip(proj, hidden)]
    input_size = int(np.shape(cells[0][0]["kernel"])[0]) - out[0]
    peephole = "w_i_diag" in cells[0][0]
    listed = len(set(hidden)) > 1 or len(set(proj)) > 1
    spec = RNNSpec(
        "lstm", input_size, hidden if listed else hidden[0], len(cells),
        bidirectional=len(cells[0]) == 2, proj_size=proj if listed else proj[0],
        peephole=peephole, cell_clip=config.get("cell_clip"), proj_clip=config.get("proj_clip"),
        batch_first=batch_first,
    )
    pieces = {}
    for layer, directions in enumerate(cells):
        cell = spec.cell(layer)
        for direction, v in enumerate(directions):
            s, H = suffix(layer, direction), cell.hidden_size
            kernel = regate(np.asarray(v["kernel"]).T, TF_GATES, "ifgo")  # [4H, I + Hr]
            if kernel.shape != (4 * H, cell.input_size + cell.output_size):
                raise ValueError(f"kernel: layer {layer} expected shape {(cell.input_size + cell.output_size, 4 * H)}, "
                                 f"got {np.shape(v['kernel'])}")
            pieces["weight_ih" + s], pieces["weight_hh" + s] = kernel[:, : cell.input_size], kernel[:, cell.input_size :]
            bias = np.array(v["bias"], copy=True)
            bias[2 * H : 3 * H] += forget_bias
            pieces["bias_ih" + s] = regate(bias, TF_GATES, "ifgo")
            pieces["bias_hh" + s] = np.zeros_like(bias)
            if peephole:
                pieces["weight_peephole" + s] = np.stack([v["w_i_diag"], v["w_f_diag"], v["w_o_diag"]])
            if cell.proj_size:
                pieces["weight_hr" + s] = np.asarray(v["projection/kernel"]).T
    return build_module(spec, pieces, dtype)


def to_tf_cudnn(module) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """CudnnLSTM / CudnnGRU / CudnnRNNTanh / CudnnRNNRelu canonical (weights, biases).

    The lists run over layers, directions, then cuDNN's linLayerIDs (SPEC.md: TF's cuDNN
    layers keep cuDNN's gate order), as ``CudnnRNNParamsToCanonical`` returns them;
    each matrix is (H, in) as cuDNN stores it, the projection (linLayerID 8) last.
    """
    params = cudnn.to_cudnn(module)
    return sorted_values(params["matrices"]), sorted_values(params["biases"])


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
    return cudnn.from_cudnn(params, batch_first=batch_first, dtype=dtype)
