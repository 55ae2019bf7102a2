"""Haste (lmnt-com/haste): LSTM, GRU and LayerNormLSTM weights.

Haste layers are one unidirectional layer each; a stacked rnnkit module maps to a list
of them, one dict per layer. Per layer (Haste's docs and headers):

    LSTM           kernel (I, 4H), recurrent_kernel (H, 4H), bias (4H,)          gates i g f o
    GRU            kernel (I, 3H), recurrent_kernel (H, 3H), bias (3H,),
                   recurrent_bias (3H,)                                         gates z r h
                   n = tanh(W_h x + b_h + r ∘ (R_h h + rb_h))   (rnnkit reset_after=True)
    LayerNormLSTM  LSTM's, plus gamma (2, 4H): the input and recurrent LN gains (no
                   shifts), gamma_h, beta_h (H,): the LN of c in h = o ∘ tanh(LN(c))

Gate orders: SPEC.md, "Gate orders elsewhere" (Haste LSTM i g f o = "igfo", GRU z r h =
"zrn" in rnnkit letters). SPEC.md's layer norm is Haste's; rnnkit's extra LN shifts β_x,
β_h are constants added beside the bias, so they fold into Haste's bias exactly. Haste's
one LSTM bias is b_W + b_R.

Refused naming the option: bidirectional, proj_size, peephole, coupled_gates, cell_clip,
zoneout (Haste's zoneout is training-only, rnnkit's evaluation uses its expectation),
reset_after=False, layer_norm on GRU, RNN modes.

Example:
    >>> layers = rnnkit.interop.haste.to_haste(lstm)        # [{"kernel", ...}] per layer
    >>> lstm2 = rnnkit.interop.haste.from_haste(layers, "lstm")
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from ..spec import RNNSpec
from ._common import build_module, numpy_pieces, refuse, refuse_mode, regate, spec_of, suffix

HASTE_GATES = {"lstm": "igfo", "gru": "zrn"}
FMT = "Haste"


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that Haste cannot represent."""
    refuse_mode(FMT, spec, ("lstm", "gru"))
    allowed = {"reset_after=True", "per-layer sizes", "num_layers>1"}
    if spec.mode == "lstm":
        allowed.add("layer_norm")
    refuse(FMT, spec, allowed=allowed)


def to_haste(module) -> List[Dict[str, np.ndarray]]:
    """One dict of Haste weights per layer (LayerNormLSTM's when the module has layer_norm)."""
    spec = spec_of(module)
    check_spec(spec)
    pieces = numpy_pieces(module)
    ours, theirs = "ifgo" if spec.mode == "lstm" else "rzn", HASTE_GATES[spec.mode]
    layers = []
    for layer in range(spec.num_layers):
        cell, s = spec.cell(layer), suffix(layer, 0)
        gh = cell.gates * cell.hidden_size
        zeros = np.zeros(gh, dtype=pieces["weight_ih" + s].dtype)
        b_W, b_R = pieces.get("bias_ih" + s, zeros), pieces.get("bias_hh" + s, zeros)
        weights = {
            "kernel": regate(pieces["weight_ih" + s], ours, theirs).T.copy(),
            "recurrent_kernel": regate(pieces["weight_hh" + s], ours, theirs).T.copy(),
        }
        if spec.mode == "gru":
            weights.update(bias=regate(b_W, ours, theirs), recurrent_bias=regate(b_R, ours, theirs))
        else:
            bias = b_W + b_R
            if spec.layer_norm:
                bias = bias + pieces["layer_norm_ih_bias" + s] + pieces["layer_norm_hh_bias" + s]
                weights["gamma"] = np.stack([regate(pieces["layer_norm_ih_weight" + s], ours, theirs),
                                             regate(pieces["layer_norm_hh_weight" + s], ours, theirs)])
                weights["gamma_h"] = pieces["layer_norm_c_weight" + s]
                weights["beta_h"] = pieces["layer_norm_c_bias" + s]
            weights["bias"] = regate(bias, ours, theirs)
        layers.append(weights)
    return layers


def from_haste(layers: Sequence[Dict[str, np.ndarray]], mode: str, *, batch_first: bool = False, dtype=None):
    """Build an rnnkit module from Haste weights, one dict per stacked layer.

    ``mode`` is "lstm" (LSTM, or LayerNormLSTM when the dicts have ``gamma``) or "gru".
    Biases land as Haste has them: LSTM's single bias in bias_ih (bias_hh zero), GRU's
    bias and recurrent_bias in bias_ih and bias_hh.
    """
    if mode not in HASTE_GATES:
        raise ValueError(f"mode: Haste has 'lstm' and 'gru', got {mode!r}")
    G = 4 if mode == "lstm" else 3
    hidden = [int(np.shape(w["recurrent_kernel"])[0]) for w in layers]
    layer_norm = "gamma" in layers[0]
    spec = RNNSpec(mode, int(np.shape(layers[0]["kernel"])[0]), hidden if len(set(hidden)) > 1 else hidden[0],
                   len(layers), layer_norm=layer_norm, batch_first=batch_first)
    ours, theirs = "ifgo" if mode == "lstm" else "rzn", HASTE_GATES[mode]
    pieces = {}
    for layer, w in enumerate(layers):
        s = suffix(layer, 0)
        if np.shape(w["kernel"])[1] != G * hidden[layer]:
            raise ValueError(f"kernel: layer {layer} expected {G * hidden[layer]} columns, got shape {np.shape(w['kernel'])}")
        pieces["weight_ih" + s] = regate(np.asarray(w["kernel"]).T, theirs, ours)
        pieces["weight_hh" + s] = regate(np.asarray(w["recurrent_kernel"]).T, theirs, ours)
        bias = regate(np.asarray(w["bias"]), theirs, ours)
        pieces["bias_ih" + s] = bias
        pieces["bias_hh" + s] = regate(np.asarray(w["recurrent_bias"]), theirs, ours) if mode == "gru" else np.zeros_like(bias)
        if layer_norm:
            gamma = np.asarray(w["gamma"])
            pieces["layer_norm_ih_weight" + s] = regate(gamma[0], theirs, ours)
            pieces["layer_norm_hh_weight" + s] = regate(gamma[1], theirs, ours)
            pieces["layer_norm_ih_bias" + s] = np.zeros_like(bias)
            pieces["layer_norm_hh_bias" + s] = np.zeros_like(bias)
            pieces["layer_norm_c_weight" + s] = np.asarray(w["gamma_h"])
            pieces["layer_norm_c_bias" + s] = np.asarray(w["beta_h"])
    return build_module(spec, pieces, dtype)
