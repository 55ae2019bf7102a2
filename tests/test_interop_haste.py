"""Haste LSTM, GRU and LayerNormLSTM weights.

Haste needs CUDA to build, so the checks run on fixtures made by
tests/fixtures/interop/make_fixtures.py, which implements Haste's documented equations
(LSTM gates i g f o; GRU z r h with the reset applied after R h + recurrent_bias;
LayerNormLSTM with gamma (2, 4H) and gamma_h / beta_h on c) in numpy. Not proven: that
Haste's CUDA kernels match that reading (e.g. its LN epsilon).
"""
from pathlib import Path

import numpy as np
import pytest
import torch

import rnnkit
from rnnkit.interop import haste

from helpers import assert_close

FIXTURES = Path(__file__).parent / "fixtures" / "interop"


def _layers(data):
    layers = [{} for _ in range(int(data["num_layers"]))]
    for key in data.files:
        if key.startswith("layers/"):
            _, k, name = key.split("/", 2)
            layers[int(k)][name] = data[key]
    return layers


@pytest.mark.parametrize("name, mode", [("haste_lstm", "lstm"), ("haste_gru", "gru"), ("haste_layernorm_lstm", "lstm")])
def test_fixture_both_directions(name, mode):
    data = np.load(FIXTURES / f"{name}.npz")
    layers = _layers(data)
    module = haste.from_haste(layers, mode).eval()
    with torch.no_grad():
        y, hy = module(torch.from_numpy(data["x"]))
    assert_close(y, torch.from_numpy(data["y"]), "y")
    assert_close(hy[0] if mode == "lstm" else hy, torch.from_numpy(data["h_n"]), "h_n")
    if mode == "lstm":
        assert_close(hy[1], torch.from_numpy(data["c_n"]), "c_n")
    for exported, original in zip(haste.to_haste(module), layers):
        assert exported.keys() == original.keys()
        for key in original:
            assert_close(torch.from_numpy(exported[key]), torch.from_numpy(original[key]), key)


def test_layer_norm_shifts_fold_into_the_bias():
    module = rnnkit.LSTM(3, 4, layer_norm=True).eval()
    with torch.no_grad():
        module.layer_norm_ih_bias_l0.uniform_(-1, 1)
        module.layer_norm_hh_bias_l0.uniform_(-1, 1)
    back = haste.from_haste(haste.to_haste(module), "lstm").eval()
    x = torch.randn(5, 2, 3)
    with torch.no_grad():
        assert_close(back(x)[0], module(x)[0], "y")


@pytest.mark.parametrize("module, option", [
    (lambda: rnnkit.LSTM(3, 4, bidirectional=True), "bidirectional"),
    (lambda: rnnkit.GRU(3, 4, layer_norm=True), "layer_norm"),
    (lambda: rnnkit.LSTM(3, 4, zoneout=0.1), "zoneout"),
    (lambda: rnnkit.RNN(3, 4), "mode"),
], ids=["bidir", "gru-layer_norm", "zoneout", "rnn"])
def test_refuses_what_haste_cannot_represent(module, option):
    with pytest.raises(ValueError, match=option):
        haste.to_haste(module())
