"""Haste (lmnt-com/haste, haste_pytorch 0.5): LSTM, GRU, LayerNormLSTM and LayerNormGRU weights.

Haste layers are one unidirectional layer each; a stacked rnnkit module maps to a list
of them, one dict per layer, keyed as the Haste layer's ``state_dict()`` (so
``haste_layer.load_state_dict({k: torch.from_numpy(v) ...})`` loads it):

    LSTM           kernel (I, 4H), recurrent_kernel (H, 4H), bias (4H,)          gates i g f o
    GRU            kernel (I, 3H), recurrent_kernel (H, 3H), bias (3H,),
                   recurrent_bias (3H,)                                         gates z r h
                   h~ = tanh(W_h x + b_h + r ∘ (R_h h + rb_h))   (rnnkit reset_after=True)
    LayerNormLSTM  LSTM's, plus gamma (2, 4H): the input and recurrent LN gains (no
                   shifts), gamma_h, beta_h (H,): the LN of c in h = o ∘ tanh(LN(c))
    LayerNormGRU   GRU's, plus gamma (2, 3H): LN over all 3H of W x and of R h, gains only

Gate orders: docs/spec.md, "Gate orders elsewhere" (Haste LSTM i g f o = "igfo", GRU z r h =
"zrn" in rnnkit letters). docs/spec.md's layer norm is Haste's; rnnkit's extra LN shifts β_x,
β_h are constants added beside the biases, so they fold into Haste's: LSTM's one bias
takes b_W + b_R + β_x + β_h; GRU's ``bias`` takes b_W + β_x and ``recurrent_bias``
takes b_R + β_h (β_h sits inside r ∘ (·) with b_R, as rnnkit's LN_h(R h) + b_R does).

Zoneout: a Haste layer's ``zoneout=p`` zones out h only; in evaluation Haste computes
h = p·h_prev + (1 − p)·h_new, rnnkit's evaluation zoneout with ``zoneout=p``. The
probability is a layer setting, not a weight, so `to_haste`'s dicts do not hold it: build
the Haste layers with ``zoneout=module.spec.zoneout[0]``, and give ``from_haste`` the
layers' ``zoneout``. ``from_haste(to_haste(module), mode)`` without it builds a module
with zoneout 0, which in evaluation computes something other than the zoneout module.

Refused naming the option: bidirectional, proj_size, peephole, coupled_gates, cell_clip,
zoneout=(p_h, p_c) with p_c ≠ 0 (Haste never zones out c), reset_after=False, RNN modes.
Haste's DropConnect (``dropout``) is training-only, like rnnkit's, and is not exported.
A bfloat16 module exports float32 arrays (numpy has no bfloat16; the values are exact);
bfloat16 tensors import through float32, into the module's ``dtype``.

Example:
    >>> layers = rnnkit.interop.haste.to_haste(lstm)        # [{"kernel", ...}] per layer
    >>> haste_lstm.load_state_dict({k: torch.from_numpy(v) for k, v in layers[0].items()})
    >>> lstm2 = rnnkit.interop.haste.from_haste(layers, "lstm", zoneout=lstm.spec.zoneout[0])
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from ..spec import RNNSpec
from ._common import build_module, check_keys, exported_pieces, imported_array, refuse, refuse_mode, regate, spec_of, suffix

HASTE_GATES = {"lstm": "igfo", "gru": "zrn"}
RNNKIT_GATES = {"lstm": "ifgo", "gru": "rzn"}
HASTE_KEYS = {
    ("lstm", False): ("kernel", "recurrent_kernel", "bias"),
    ("gru", False): ("kernel", "recurrent_kernel", "bias", "recurrent_bias"),
    ("lstm", True): ("kernel", "recurrent_kernel", "bias", "gamma", "gamma_h", "beta_h"),
    ("gru", True): ("kernel", "recurrent_kernel", "bias", "recurrent_bias", "gamma"),
}
FMT = "Haste"


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that Haste cannot represent."""
    refuse_mode(FMT, spec, ("lstm", "gru"))
    if spec.zoneout[1]:
        raise ValueError(f"zoneout: Haste zones out h only; zoneout={spec.zoneout} also zones out c "
                         "(use zoneout=p_h, or (p_h, 0.0))")
    refuse("haste", FMT, spec)


def to_haste(module) -> List[Dict[str, np.ndarray]]:
    """One dict of Haste weights per layer, keyed as that Haste layer's ``state_dict()``.

    The layers are Haste ``LSTM`` / ``GRU`` (or ``LayerNormLSTM`` / ``LayerNormGRU`` when the
    module has layer_norm) with ``zoneout=module.spec.zoneout[0]``: the dicts do not hold
    the zoneout, a layer setting; give it to the Haste layers and to `from_haste` yourself.
    """
    spec = spec_of(module)
    check_spec(spec)
    pieces = exported_pieces(module)
    ours, theirs = RNNKIT_GATES[spec.mode], HASTE_GATES[spec.mode]
    layers = []
    for layer in range(spec.num_layers):
        cell, s = spec.cell(layer), suffix(layer, 0)
        zeros = np.zeros(cell.gates * cell.hidden_size, dtype=pieces["weight_ih" + s].dtype)
        b_W, b_R = pieces.get("bias_ih" + s, zeros), pieces.get("bias_hh" + s, zeros)
        if spec.layer_norm:
            b_W = b_W + pieces["layer_norm_ih_bias" + s]
            b_R = b_R + pieces["layer_norm_hh_bias" + s]
        weights = {
            "kernel": regate(pieces["weight_ih" + s], ours, theirs).T.copy(),
            "recurrent_kernel": regate(pieces["weight_hh" + s], ours, theirs).T.copy(),
        }
        if spec.mode == "gru":
            weights.update(bias=regate(b_W, ours, theirs), recurrent_bias=regate(b_R, ours, theirs))
        else:
            weights["bias"] = regate(b_W + b_R, ours, theirs)
        if spec.layer_norm:
            weights["gamma"] = np.stack([regate(pieces["layer_norm_ih_weight" + s], ours, theirs),
                                         regate(pieces["layer_norm_hh_weight" + s], ours, theirs)])
            if spec.mode == "lstm":
                weights["gamma_h"] = pieces["layer_norm_c_weight" + s].copy()
                weights["beta_h"] = pieces["layer_norm_c_bias" + s].copy()
        layers.append(weights)
    return layers


def from_haste(layers: Sequence[Dict[str, object]], mode: str, *, zoneout: float = 0.0, batch_first: bool = False,
               dtype=None):
    """Build an rnnkit module from Haste weights, one dict per stacked layer.

    Args:
        layers: per layer, the Haste layer's ``state_dict()`` (or `to_haste`'s dict):
            LSTM / GRU keys, plus ``gamma`` (and for LSTM ``gamma_h``, ``beta_h``) for the
            LayerNorm variants.
        mode: "lstm" (LSTM, LayerNormLSTM) or "gru" (GRU, LayerNormGRU).
        zoneout: the Haste layers' ``zoneout`` (they must share it); not in the dicts, so
            the default 0 is right only for layers built without zoneout.
        batch_first: the module's layout (Haste's own ``batch_first``).
        dtype: the module's dtype (default float32).

    Biases land as Haste has them: LSTM's single bias in bias_ih (bias_hh zero), GRU's
    bias and recurrent_bias in bias_ih and bias_hh; LN shifts are zero.
    """
    if not isinstance(mode, str) or mode not in HASTE_GATES:
        raise ValueError(f"mode: Haste has 'lstm' and 'gru', got {mode!r}")
    if isinstance(zoneout, (tuple, list)) and len(zoneout) == 2 and zoneout[1] != 0:
        raise ValueError(f"zoneout: a Haste layer zones out h only (one probability), got {tuple(zoneout)}, which "
                         "also zones out c")
    if isinstance(layers, (dict, str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise TypeError(f"layers: expected a non-empty list of dicts (one per layer), got {type(layers).__name__}")
    layer_norm = "gamma" in layers[0]
    expected = HASTE_KEYS[(mode, layer_norm)]
    arrays = []
    for k, weights in enumerate(layers):
        kind = ("LayerNorm" if layer_norm else "") + mode.upper()
        check_keys(weights, expected, f"layers[{k}] (a Haste {kind} layer)")
        arrays.append({key: imported_array(weights[key], f"layers[{k}][{key!r}]") for key in expected})
    G = 4 if mode == "lstm" else 3
    hidden = [int(w["recurrent_kernel"].shape[0]) for w in arrays]
    spec = RNNSpec(mode, int(arrays[0]["kernel"].shape[0]), hidden if len(set(hidden)) > 1 else hidden[0],
                   len(arrays), layer_norm=layer_norm, zoneout=zoneout, batch_first=batch_first)
    ours, theirs = RNNKIT_GATES[mode], HASTE_GATES[mode]
    pieces = {}
    for layer, w in enumerate(arrays):
        s, gh = suffix(layer, 0), G * hidden[layer]
        input_size = spec.cell(layer).input_size
        H = hidden[layer]
        shapes = {"kernel": (input_size, gh), "recurrent_kernel": (H, gh), "bias": (gh,), "recurrent_bias": (gh,),
                  "gamma": (2, gh), "gamma_h": (H,), "beta_h": (H,)}
        for key in expected:  # by Haste's names, before any regating
            if tuple(w[key].shape) != shapes[key]:
                raise ValueError(f"layers[{layer}][{key!r}]: expected shape {shapes[key]} (a Haste {mode.upper()} "
                                 f"layer of {H} units on {input_size} inputs), got {tuple(w[key].shape)}")
        pieces["weight_ih" + s] = regate(w["kernel"].T, theirs, ours)
        pieces["weight_hh" + s] = regate(w["recurrent_kernel"].T, theirs, ours)
        bias = regate(w["bias"], theirs, ours)
        pieces["bias_ih" + s] = bias
        pieces["bias_hh" + s] = regate(w["recurrent_bias"], theirs, ours) if mode == "gru" else np.zeros_like(bias)
        if layer_norm:
            gamma = w["gamma"]
            pieces["layer_norm_ih_weight" + s] = regate(gamma[0], theirs, ours)
            pieces["layer_norm_hh_weight" + s] = regate(gamma[1], theirs, ours)
            pieces["layer_norm_ih_bias" + s] = np.zeros_like(bias)
            pieces["layer_norm_hh_bias" + s] = np.zeros_like(bias)
            if mode == "lstm":
                pieces["layer_norm_c_weight" + s] = w["gamma_h"]
                pieces["layer_norm_c_bias" + s] = w["beta_h"]
    return build_module(spec, pieces, dtype)
