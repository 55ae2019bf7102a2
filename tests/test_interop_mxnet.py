"""MXNet fused-RNN flat vector and Gluon names.

MXNet cannot be installed here, so the checks run on fixtures made by
tests/fixtures/interop/make_fixtures.py: a flat vector in the fused op's documented
order (all weights by layer, direction, i2h, h2h, h2r; then all biases) and outputs of
the cuDNN equations in numpy. Not proven: that MXNet's own kernels match that reading.
"""
from pathlib import Path

import numpy as np
import pytest
import torch

import rnnkit
from rnnkit.interop import mxnet as rmx

from helpers import assert_close

FIXTURES = Path(__file__).parent / "fixtures" / "interop"


@pytest.mark.parametrize("name, mode", [("mxnet_lstm_proj_bidir", "lstm"), ("mxnet_gru_bidir", "gru")])
def test_flat_fixture_both_directions(name, mode):
    data = np.load(FIXTURES / f"{name}.npz")
    module = rmx.from_mxnet_flat(data["flat"], mode, input_size=data["x"].shape[-1], hidden_size=int(data["hidden"]),
                                 num_layers=int(data["num_layers"]), bidirectional=int(data["num_directions"]) == 2,
                                 proj_size=int(data["proj"])).eval()
    with torch.no_grad():
        y, hy = module(torch.from_numpy(data["x"]))
    assert_close(y, torch.from_numpy(data["y"]), "y")
    h_n = hy[0] if mode == "lstm" else hy
    assert_close(h_n, torch.from_numpy(data["h_n"]), "h_n")
    if mode == "lstm":
        assert_close(hy[1], torch.from_numpy(data["c_n"]), "c_n")
    assert_close(torch.from_numpy(rmx.to_mxnet_flat(module)), torch.from_numpy(data["flat"]), "flat")


def test_gluon_names_round_trip():
    module = rnnkit.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2, cell_clip=0.5)
    named = rmx.to_gluon(module)
    assert list(named)[:5] == ["l0_i2h_weight", "l0_h2h_weight", "l0_h2r_weight", "l0_i2h_bias", "l0_h2h_bias"]
    assert named["r1_i2h_weight"].shape == (20, 4)
    back = rmx.from_gluon(named, "lstm", cell_clip=0.5)
    assert back.spec == module.spec
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "flat")


@pytest.mark.parametrize("module, option", [
    (lambda: rnnkit.LSTM(3, 4, peephole=True), "peephole"),
    (lambda: rnnkit.GRU(3, 4, reset_after=False), "reset_after=False"),
    (lambda: rnnkit.LSTM(3, 4, proj_size=2, proj_clip=0.5), "proj_clip"),
], ids=["peephole", "reset_before", "proj_clip"])
def test_refuses_what_mxnet_cannot_represent(module, option):
    with pytest.raises(ValueError, match=option):
        rmx.to_mxnet_flat(module())
