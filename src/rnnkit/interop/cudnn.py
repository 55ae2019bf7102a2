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
layer_norm, zoneout, proj_clip, reset_after=False, merge="sum", per-layer sizes. cuDNN's
cell clip (``cudnnRNNSetClip_v8``) is a descriptor setting, carried in ``config``.

Example:
    >>> params = rnnkit.interop.cudnn.to_cudnn(lstm)
    >>> params["matrices"][(0, 4)].shape          # R_i of layer 0, forward: (H, Hr)
    >>> lstm2 = rnnkit.interop.cudnn.from_cudnn(params)
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..spec import RNNSpec
from ._common import build_module, refuse, spec_of, suffix, torch_pieces

PROJECTION_ID = 8
CUDNN_MODES = {"lstm": "CUDNN_LSTM", "gru": "CUDNN_GRU", "rnn_tanh": "CUDNN_RNN_TANH", "rnn_relu": "CUDNN_RNN_RELU"}
CUDNN_BIAS = {
    "double": "CUDNN_RNN_DOUBLE_BIAS",
    "single_input": "CUDNN_RNN_SINGLE_INP_BIAS",
    "single_recurrent": "CUDNN_RNN_SINGLE_REC_BIAS",
    "none": "CUDNN_RNN_NO_BIAS",
}
FMT = "cuDNN"


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
        params: ``{"config", "matrices", "biases"}`` as described in `to_cudnn`.
        batch_first: the module's input layout (not a cuDNN weight property).
        dtype: the module's dtype (default float32).
    """
    config = params["config"]
    mode = {v: k for k, v in CUDNN_MODES.items()}.get(config["cellMode"])
    if mode is None:
        raise ValueError(f"config['cellMode']: expected one of {tuple(CUDNN_MODES.values())}, got {config['cellMode']!r}")
    bias_mode = {v: k for k, v in CUDNN_BIAS.items()}.get(config["biasMode"])
    if bias_mode is None:
        raise ValueError(f"config['biasMode']: expected one of {tuple(CUDNN_BIAS.values())}, got {config['biasMode']!r}")
    hidden, proj = config["hiddenSize"], config.get("projSize", config["hiddenSize"])
    spec = RNNSpec(
        mode, config["inputSize"], hidden, config["numLayers"],
        bidirectional=config["dirMode"] == "CUDNN_BIDIRECTIONAL",
        proj_size=0 if proj == hidden else proj,
        cell_clip=config.get("cellClip"),
        bias_mode=bias_mode,
        batch_first=batch_first,
    )
    matrices, biases = params["matrices"], params["biases"]
    G, D = spec.gates, spec.num_directions

    def get(table, key, what):
        if key not in table:
            raise ValueError(f"{what}: no entry for (pseudoLayer, linLayerID)={key}")
        return torch.as_tensor(table[key])

    pieces = {}
    for layer in range(spec.num_layers):
        for direction in range(D):
            pseudo, s = layer * D + direction, suffix(layer, direction)
            for offset, (weight, bias) in enumerate((("weight_ih", "bias_ih"), ("weight_hh", "bias_hh"))):
                ids = range(offset * G, (offset + 1) * G)
                pieces[weight + s] = torch.cat([get(matrices, (pseudo, i), "matrices") for i in ids])
                if (bias == "bias_ih" and spec.cell(0).has_bias_ih) or (bias == "bias_hh" and spec.cell(0).has_bias_hh):
                    pieces[bias + s] = torch.cat([get(biases, (pseudo, i), "biases") for i in ids])
            if spec.proj_sizes[layer]:
                pieces["weight_hr" + s] = get(matrices, (pseudo, PROJECTION_ID), "matrices")
    return build_module(spec, pieces, dtype)
