"""Haste LSTM, GRU, LayerNormLSTM and LayerNormGRU, against haste-pytorch 0.5.0rc0 itself.

The fixtures were computed by haste_pytorch's own layers on CPU (its pure-PyTorch path;
tests/fixtures/interop/make_real.py), in evaluation mode, so zoneout is its expectation:
import reads Haste's state_dict()s, export is what Haste computed after
``load_state_dict`` of :func:`to_haste`'s dicts.
"""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rnnkit
from rnnkit.interop import haste

from helpers import assert_close

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "interop"))
from interop_fixture import Fixture  # noqa: E402  (the reader of the real libraries' fixtures)

FIXTURES = ["haste_lstm_zoneout_per_layer", "haste_gru_zoneout", "haste_layernorm_lstm", "haste_layernorm_gru"]


def _layers(variables):
    layers = {}
    for key, value in variables.items():
        k, name = key.split("/", 1)
        layers.setdefault(int(k), {})[name] = value
    return [layers[k] for k in sorted(layers)]


def _expected(run, mode):
    """Haste's outputs as rnnkit's (y, h_n[, c_n]): per-layer states stacked, or listed when sizes differ."""
    layers = len({key.split("/")[1] for key in run.out if key != "y"})
    states = []
    for which in "hc" if mode == "lstm" else "h":
        per_layer = [torch.from_numpy(run.out[f"{which}/{k}"])[None] for k in range(layers)]
        sizes = {s.shape[-1] for s in per_layer}
        states.append(per_layer if len(sizes) > 1 else torch.cat(per_layer))
    return torch.from_numpy(run.out["y"]), states


def _states(hy, mode):
    return list(hy) if mode == "lstm" else [hy]


@pytest.mark.parametrize("tag", ["f32", "f64"])
@pytest.mark.parametrize("name", FIXTURES)
def test_import(name, tag):
    fixture = Fixture(name)
    run, mode = fixture.run(tag, "import"), fixture.case["mode"]
    module = haste.from_haste(_layers(run.vars), mode, zoneout=fixture.case["zoneout"], dtype=run.dtype).eval()
    assert module.spec.layer_norm == fixture.case["layer_norm"]
    y, hy = run.run_module(module)
    y_haste, states_haste = _expected(run, mode)
    assert_close(y, y_haste, f"{fixture} y")
    assert_close(_states(hy, mode), states_haste, f"{fixture} states")


@pytest.mark.parametrize("tag", ["f32", "f64"])
@pytest.mark.parametrize("name", FIXTURES)
def test_export(name, tag):
    fixture = Fixture(name)
    run, mode = fixture.run(tag, "export"), fixture.case["mode"]
    module = run.module()
    exported = haste.to_haste(module)
    assert [sorted(w) for w in exported] == [sorted(w) for w in _layers(run.vars)]
    for k, weights in enumerate(_layers(run.vars)):  # what Haste was given is what to_haste gives now
        for key, value in weights.items():
            assert_close(torch.from_numpy(exported[k][key]), torch.from_numpy(value), f"{fixture} layer {k} {key}")
    y, hy = run.run_module(module)
    y_haste, states_haste = _expected(run, mode)
    assert_close(y, y_haste, f"{fixture} y")
    assert_close(_states(hy, mode), states_haste, f"{fixture} states")


def test_layer_norm_shifts_fold_into_both_gru_biases():
    """Finding 2: β_x joins Haste's bias, β_h its recurrent_bias (inside r ∘ (·), with b_R)."""
    module = rnnkit.GRU(3, 4, layer_norm=True, dtype=torch.float64).eval()
    with torch.no_grad():
        module.flat_weights.uniform_(-1, 1)
    layers = haste.to_haste(module)
    assert sorted(layers[0]) == ["bias", "gamma", "kernel", "recurrent_bias", "recurrent_kernel"]
    b_R = module.state_dict()["bias_hh_l0"] + module.state_dict()["layer_norm_hh_bias_l0"]
    r, z, n = b_R.chunk(3)
    assert torch.equal(torch.from_numpy(layers[0]["recurrent_bias"]), torch.cat([z, r, n]))


def test_import_does_not_modify_its_argument():
    weights = [{"kernel": np.ones((3, 12)), "recurrent_kernel": np.ones((3, 12)), "bias": np.arange(12.0)}]
    haste.from_haste(weights, "lstm")
    assert np.array_equal(weights[0]["bias"], np.arange(12.0)) and list(weights[0]) == ["kernel", "recurrent_kernel", "bias"]


@pytest.mark.parametrize("module, message", [
    (lambda: rnnkit.LSTM(3, 4, bidirectional=True), "bidirectional: Haste cannot represent"),
    (lambda: rnnkit.LSTM(3, 4, zoneout=(0.1, 0.2)), r"zoneout: Haste zones out h only; zoneout=\(0.1, 0.2\)"),
    (lambda: rnnkit.LSTM(3, 4, proj_size=2), "proj_size: Haste cannot represent"),
    (lambda: rnnkit.LSTM(3, 4, peephole=True), "peephole: Haste cannot represent"),
    (lambda: rnnkit.LSTM(3, 4, cell_clip=1.0), "cell_clip: Haste cannot represent"),
    (lambda: rnnkit.GRU(3, 4, reset_after=False), "reset_after=False: Haste cannot represent"),
    (lambda: rnnkit.RNN(3, 4), "mode: Haste has no 'rnn_tanh' layer"),
], ids=["bidir", "zoneout_c", "proj", "peephole", "cell_clip", "reset_before", "rnn"])
def test_refuses_what_haste_cannot_represent(module, message):
    with pytest.raises(ValueError, match=message):
        haste.to_haste(module())


def test_zoneout_on_h_alone_is_carried():
    """Finding 3: (p_h, 0) is Haste's zoneout=p_h; only a zoneout on c is refused."""
    module = rnnkit.LSTM(3, 4, zoneout=(0.25, 0.0))
    assert haste.from_haste(haste.to_haste(module), "lstm", zoneout=0.25).spec.zoneout == (0.25, 0.0)


def test_bad_haste_dicts_are_named():
    with pytest.raises(ValueError, match=r"layers\[0\] \(a Haste LayerNormGRU layer\): expected the keys .*; missing \['recurrent_bias'\]"):
        haste.from_haste([{"kernel": np.ones((3, 12)), "recurrent_kernel": np.ones((4, 12)), "bias": np.ones(12),
                           "gamma": np.ones((2, 12))}], "gru")
    with pytest.raises(TypeError, match="layers: expected a non-empty list"):
        haste.from_haste({"kernel": np.ones((3, 12))}, "lstm")


@pytest.mark.parametrize("mode, layer_norm", [("lstm", False), ("gru", True)], ids=["lstm", "layernorm-gru"])
def test_bfloat16_exports_float32_and_imports_exactly(mode, layer_norm):
    """Review finding 16: numpy has no bfloat16, so to_haste gives float32 arrays (exact); a
    bfloat16 Haste layer's state_dict() (torch bfloat16 tensors) imports through float32."""
    make = rnnkit.LSTM if mode == "lstm" else rnnkit.GRU
    module = make(3, 4, num_layers=2, layer_norm=layer_norm).to(torch.bfloat16)
    layers = haste.to_haste(module)
    assert all(v.dtype == np.float32 for w in layers for v in w.values())
    state_dicts = [{k: torch.from_numpy(v).to(torch.bfloat16) for k, v in w.items()} for w in layers]
    back = haste.from_haste(state_dicts, mode, dtype=torch.bfloat16)
    assert torch.equal(back.flat_weights, haste.from_haste(layers, mode, dtype=torch.bfloat16).flat_weights)
    assert back.flat_weights.dtype == torch.bfloat16


@pytest.mark.parametrize("key, shape", [("bias", (20,)), ("recurrent_kernel", (6, 20)), ("gamma_h", (5,))])
def test_a_wrong_array_is_named_by_hastes_key(key, shape):
    layers = haste.to_haste(rnnkit.LSTM(4, 6, layer_norm=True))
    layers[0][key] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=rf"layers\[0\]\['{key}'\]: expected shape .* got {re.escape(str(shape))}"):
        haste.from_haste(layers, "lstm")
