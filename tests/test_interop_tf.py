"""TF 1.x LSTMCell variables and TF cuDNN canonical weights.

TF 1.x cannot be installed here, so the LSTMCell checks run on fixtures made by
tests/fixtures/interop/make_fixtures.py, which implements rnn_cell_impl.LSTMCell's
documented equations (gates i j f o, forget_bias at run time, peepholes, cell_clip,
num_proj, proj_clip) in numpy. Not proven: that TF's own kernels match that reading.
"""
from pathlib import Path

import numpy as np
import pytest
import torch

import rnnkit
from rnnkit.interop import tf as rtf

from helpers import assert_close

FIXTURES = Path(__file__).parent / "fixtures" / "interop"


def _load(name):
    data = np.load(FIXTURES / f"{name}.npz")
    cells = [[{} for _ in range(int(data["num_directions"]))] for _ in range(int(data["num_layers"]))]
    for key in data.files:
        if key.startswith("cells/"):
            _, k, d, variable = key.split("/", 3)
            cells[int(k)][int(d)][variable] = data[key]
    clip = lambda v: None if np.isnan(v) else float(v)  # noqa: E731
    config = dict(forget_bias=float(data["forget_bias"]), cell_clip=clip(data["cell_clip"]),
                  proj_clip=clip(data["proj_clip"]))
    return {"config": config, "cells": cells}, data


@pytest.mark.parametrize("name", ["tf_lstmcell_peephole_proj_clip", "tf_lstmcell_bidir"])
def test_lstmcell_fixture_both_directions(name):
    tf_vars, data = _load(name)
    module = rtf.from_tf(tf_vars).eval()
    x = torch.from_numpy(data["x"])
    with torch.no_grad():
        y, (h_n, c_n) = module(x)
    assert_close(y, torch.from_numpy(data["y"]), "y")
    assert_close(h_n, torch.from_numpy(data["h_n"]), "h_n")
    assert_close(c_n, torch.from_numpy(data["c_n"]), "c_n")
    exported = rtf.to_tf(module, forget_bias=tf_vars["config"]["forget_bias"])
    for layer, directions in enumerate(tf_vars["cells"]):
        for d, variables in enumerate(directions):
            for key, value in variables.items():
                assert_close(torch.from_numpy(exported["cells"][layer][d][key]), torch.from_numpy(value), key)
    assert exported["config"]["cell_clip"] == tf_vars["config"]["cell_clip"]


def test_forget_bias_is_folded_on_import_and_subtracted_on_export():
    module = rnnkit.LSTM(3, 4)
    a = rtf.to_tf(module, forget_bias=1.0)["cells"][0][0]["bias"]
    b = rtf.to_tf(module, forget_bias=0.0)["cells"][0][0]["bias"]
    assert np.allclose(b - a, np.r_[np.zeros(8), np.ones(4), np.zeros(4)])


def test_cudnn_canonical_round_trip():
    module = rnnkit.GRU(3, 5, num_layers=2, bidirectional=True).eval()
    weights, biases = rtf.to_tf_cudnn(module)
    assert len(weights) == 2 * 2 * 6 and weights[0].shape == (5, 3)
    back = rtf.from_tf_cudnn(weights, biases, "gru", 3, 5, 2, bidirectional=True)
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "flat")


@pytest.mark.parametrize("module, option", [
    (lambda: rnnkit.LSTM(3, 4, coupled_gates=True), "coupled_gates"),
    (lambda: rnnkit.LSTM(3, 4, layer_norm=True), "layer_norm"),
    (lambda: rnnkit.GRU(3, 4), "mode"),
], ids=["coupled", "layer_norm", "gru"])
def test_refuses_what_lstmcell_cannot_represent(module, option):
    with pytest.raises(ValueError, match=option):
        rtf.to_tf(module())
