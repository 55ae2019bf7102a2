"""MXNet fused RNN vector and Gluon names, against mxnet 1.9.1 itself (CPU).

The fixtures were computed by MXNet's own ``mx.nd.RNN`` operator and Gluon ``rnn.LSTM`` /
``rnn.GRU`` layers (tests/fixtures/interop/make_real.py): import reads MXNet's flat vector,
Gluon's ``collect_params()`` names and its ``save_parameters()`` file names; export is
what MXNet computed from :func:`to_mxnet_flat`'s vector, or after Gluon's own
``load_parameters`` of :func:`to_gluon`'s names saved with ``mx.nd.save``.

MXNet 1.9.1's CPU kernel computes the float64 ReLU RNN with each ReLU output rounded to
float32 (see test_mxnet_rounds_float64_relu_to_float32), so that case is held to the
float32 tolerance in float64 too.

Not verified against MXNet: the state clip (rnnkit's cell_clip, MXNet's state_clip_min/max
settings), which MXNet 1.9.1 applies only in its GPU kernel; its round trip is checked here.
"""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rnnkit
from rnnkit.interop import mxnet as rmx

from helpers import TOLERANCE, assert_close

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "interop"))
from interop_fixture import Fixture  # noqa: E402  (the reader of the real libraries' fixtures)

FUSED = ["mxnet_fused_lstm_proj_bidir", "mxnet_fused_gru_bidir", "mxnet_fused_rnn_relu_bidir", "mxnet_fused_rnn_tanh"]
GLUON = ["mxnet_gluon_lstm_proj_bidir", "mxnet_gluon_gru_stacked"]


def _check_outputs(fixture, run, module):
    y, hy = run.run_module(module)
    states = list(hy) if isinstance(hy, tuple) else [hy]
    expected = [run.out["h_n"]] + ([run.out["c_n"]] if "c_n" in run.out else [])
    tol = TOLERANCE[torch.float32] if fixture.case["mode"] == "rnn_relu" else None  # MXNet's own precision
    assert_close(y, torch.from_numpy(run.out["y"]), f"{fixture} y", tol=tol)
    assert_close(states, [torch.from_numpy(s) for s in expected], f"{fixture} states", tol=tol)


@pytest.mark.parametrize("direction", ["import", "export"])
def test_mxnet_rounds_float64_relu_to_float32(direction):
    """Every float64 output of MXNet's ReLU RNN is a float32 value: MXNet rounds there, not rnnkit."""
    run = Fixture("mxnet_fused_rnn_relu_bidir").run("f64", direction)
    y = run.out["y"]
    assert y.dtype == np.float64 and np.array_equal(y, y.astype(np.float32).astype(np.float64))
    tanh = Fixture("mxnet_fused_rnn_tanh").run("f64", direction).out["y"]
    assert not np.array_equal(tanh, tanh.astype(np.float32).astype(np.float64))


def _from_flat(case, flat, dtype):
    return rmx.from_mxnet_flat(flat, case["mode"], input_size=4, hidden_size=case["hidden"],
                               num_layers=case["num_layers"], bidirectional=case["bidirectional"],
                               proj_size=case.get("proj", 0), dtype=dtype).eval()


@pytest.mark.parametrize("tag", ["f32", "f64"])
@pytest.mark.parametrize("name", FUSED)
def test_fused_import(name, tag):
    fixture = Fixture(name)
    run = fixture.run(tag, "import")
    _check_outputs(fixture, run, _from_flat(fixture.case, run.vars["parameters"], run.dtype))


@pytest.mark.parametrize("tag", ["f32", "f64"])
@pytest.mark.parametrize("name", FUSED)
def test_fused_export(name, tag):
    fixture = Fixture(name)
    run = fixture.run(tag, "export")
    module = run.module()
    assert_close(torch.from_numpy(rmx.to_mxnet_flat(module)), torch.from_numpy(run.vars["parameters"]), "flat")
    _check_outputs(fixture, run, module)


@pytest.mark.parametrize("naming", ["vars", "saved"], ids=["collect_params", "save_parameters"])
@pytest.mark.parametrize("tag", ["f32", "f64"])
@pytest.mark.parametrize("name", GLUON)
def test_gluon_import(name, tag, naming):
    """Finding 6: Gluon 1.9.1's own names, block-prefixed or structural, import as they are."""
    fixture = Fixture(name)
    run = fixture.run(tag, "import")
    named = run.groups[naming]
    prefix = {"vars": fixture.case["mode"] + r"\d+_[lr]\d", "saved": r"_unfused\.\d"}[naming]
    assert all(re.match(prefix, key) for key in named), list(named)
    module = rmx.from_gluon(named, fixture.case["mode"], dtype=run.dtype).eval()
    _check_outputs(fixture, run, module)


@pytest.mark.parametrize("tag", ["f32", "f64"])
@pytest.mark.parametrize("name", GLUON)
def test_gluon_export(name, tag):
    fixture = Fixture(name)
    run = fixture.run(tag, "export")
    module = run.module()
    exported = rmx.to_gluon(module)
    assert list(exported) == list(run.vars)
    for key, value in run.vars.items():
        assert_close(torch.from_numpy(exported[key]), torch.from_numpy(value), key)
    _check_outputs(fixture, run, module)


def test_gluon_names_round_trip_in_registration_order():
    module = rnnkit.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2)
    named = rmx.to_gluon(module)
    assert list(named)[:5] == ["l0_i2h_weight", "l0_h2h_weight", "l0_i2h_bias", "l0_h2h_bias", "l0_h2r_weight"]
    assert named["r1_i2h_weight"].shape == (20, 4)
    back = rmx.from_gluon(named, "lstm")
    assert back.spec == module.spec
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "flat")


def _run(module, x):
    with torch.no_grad():
        return module.eval()(x)[0]


def test_cell_clip_round_trips_as_mxnet_settings():
    """Review finding 4: the state clip is a layer setting, returned beside the parameters under
    MXNet's names and taken back by the importers, so the round trip computes the clipped LSTM."""
    module = rnnkit.LSTM(5, 6, num_layers=2, bidirectional=True, proj_size=3, cell_clip=0.1)
    x = torch.randn(7, 3, 5)
    named, settings = rmx.to_gluon(module, with_settings=True)
    assert settings == {"state_clip_min": -0.1, "state_clip_max": 0.1}  # gluon.rnn.LSTM's arguments
    flat, op_settings = rmx.to_mxnet_flat(module, with_settings=True)
    assert op_settings == {"lstm_state_clip_min": -0.1, "lstm_state_clip_max": 0.1}  # mx.nd.RNN's
    for back in (rmx.from_gluon(named, "lstm", **settings),
                 rmx.from_mxnet_flat(flat, "lstm", 5, 6, 2, bidirectional=True, proj_size=3, **op_settings)):
        assert back.spec == module.spec
        assert torch.equal(_run(back, x), _run(module, x))
    unclipped = rmx.from_gluon(named, "lstm")
    assert (_run(unclipped, x) - _run(module, x)).abs().max() > 1e-2  # what the settings carry
    assert rmx.to_gluon(rnnkit.GRU(5, 6), with_settings=True)[1] == {}


@pytest.mark.parametrize("export", [rmx.to_gluon, rmx.to_mxnet_flat], ids=["to_gluon", "to_mxnet_flat"])
def test_cell_clip_without_its_settings_is_refused(export):
    """The parameters alone would make an unclipped MXNet layer: refused, naming cell_clip."""
    with pytest.raises(ValueError, match="cell_clip: MXNet holds the state clip in the layer's settings .* "
                                         "with_settings=True"):
        export(rnnkit.LSTM(5, 6, cell_clip=0.1))


def test_clip_settings_must_be_one_symmetric_clip():
    named = rmx.to_gluon(rnnkit.LSTM(3, 4))
    with pytest.raises(ValueError, match=r"state_clip_min, state_clip_max: .* expected both, with "
                                         r"state_clip_min == -state_clip_max; got -0.5 and 0.25"):
        rmx.from_gluon(named, "lstm", state_clip_min=-0.5, state_clip_max=0.25)
    with pytest.raises(ValueError, match="got None and 0.5"):
        rmx.from_gluon(named, "lstm", state_clip_max=0.5)
    with pytest.raises(ValueError, match=r"cell_clip, lstm_state_clip_max: two different clips"):
        rmx.from_mxnet_flat(rmx.to_mxnet_flat(rnnkit.LSTM(3, 4)), "lstm", 3, 4, cell_clip=0.2,
                            lstm_state_clip_min=-0.5, lstm_state_clip_max=0.5)
    assert rmx.from_gluon(named, "lstm", cell_clip=0.5, state_clip_min=-0.5, state_clip_max=0.5).spec.cell_clip == 0.5


def test_bfloat16_exports_float32_and_imports_exactly():
    """Review finding 16: numpy has no bfloat16, so the arrays are float32 (exact); bfloat16
    arrays (ml_dtypes', as jax and others hand them) import through float32."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    module = rnnkit.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2).to(torch.bfloat16)
    named, flat = rmx.to_gluon(module), rmx.to_mxnet_flat(module)
    assert named["l0_i2h_weight"].dtype == np.float32 and flat.dtype == np.float32
    as_bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in named.items()}
    back = rmx.from_gluon(as_bf16, "lstm", dtype=torch.bfloat16)
    assert torch.equal(back.flat_weights, module.flat_weights)
    back = rmx.from_mxnet_flat(flat.astype(ml_dtypes.bfloat16), "lstm", 3, 4, 2, bidirectional=True, proj_size=2,
                               dtype=torch.bfloat16)
    assert torch.equal(back.flat_weights, module.flat_weights)


def test_gluon_names_refused():
    named = rmx.to_gluon(rnnkit.GRU(3, 4))
    with pytest.raises(ValueError, match="mix prefixes"):
        rmx.from_gluon({"a_" + k if k.endswith("bias") else "b_" + k: v for k, v in named.items()}, "gru")
    with pytest.raises(ValueError, match="'dense0_weight' is not a Gluon LSTM / GRU / RNN parameter name"):
        rmx.from_gluon({**named, "dense0_weight": np.zeros(1)}, "gru")
    with pytest.raises(ValueError, match=r"missing \['l0_h2h_bias'\]"):
        rmx.from_gluon({k: v for k, v in named.items() if k != "l0_h2h_bias"}, "gru")


@pytest.mark.parametrize("module, option", [
    (lambda: rnnkit.LSTM(3, 4, peephole=True), "peephole"),
    (lambda: rnnkit.GRU(3, 4, reset_after=False), "reset_after=False"),
    (lambda: rnnkit.LSTM(3, 4, proj_size=2, proj_clip=0.5), "proj_clip"),
    (lambda: rnnkit.LSTM(3, 4, layer_norm=True), "layer_norm"),
    (lambda: rnnkit.GRU(3, 4, bidirectional=True, merge="sum"), "merge='sum'"),
    (lambda: rnnkit.RNN(3, [4, 5], 2), "per-layer sizes"),
], ids=["peephole", "reset_before", "proj_clip", "layer_norm", "sum", "per-layer"])
def test_refuses_what_mxnet_cannot_represent(module, option):
    with pytest.raises(ValueError, match=f"{option}: MXNet cannot represent"):
        rmx.to_mxnet_flat(module())


def test_arrays_of_another_mode_are_named_by_gluons_key():
    with pytest.raises(ValueError, match=r"named\['l0_h2h_weight'\] expected shape \(24, 6\) \(a Gluon lstm layer's, "
                                         r"as mode='lstm' says\), got \(24, 8\)"):
        rmx.from_gluon(rmx.to_gluon(rnnkit.GRU(4, 8)), "lstm")
