"""TF 1.x LSTMCell / BasicLSTMCell / GRUCell, against tensorflow-cpu 2.21.0 itself.

The fixtures were computed by TF's own ``tf.compat.v1`` cells (``dynamic_rnn`` over a
``MultiRNNCell``, or one ``bidirectional_dynamic_rnn`` per layer, with
``sequence_length`` where the case has lengths; tests/fixtures/interop/make_real.py):
import reads TF's variables under TF's own names, export is what TF computed after
loading :func:`to_tf`'s variables into them.

CudnnLSTM / CudnnGRU canonical weights are checked only for their addressing: TF 2.21's
canonical-weight ops have no CPU kernel.
"""
import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rnnkit
from rnnkit.interop import tf as rtf

from helpers import assert_close

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "interop"))
from interop_fixture import Fixture  # noqa: E402  (the reader of the real libraries' fixtures)

FIXTURES = ["tf_lstmcell_peephole_proj_clip", "tf_lstmcell_bidir_per_layer_lengths", "tf_basiclstmcell",
            "tf_grucell_stacked", "tf_grucell_bidir_lengths"]


def _settings(case):
    if case["cell"] == "GRUCell":
        return {}
    return dict(forget_bias=case["forget_bias"], cell_clip=case.get("cell_clip"), proj_clip=case.get("proj_clip"))


def _expected(run, case):
    """TF's outputs as rnnkit's (y, [h_n, c_n]): states stacked by layer then direction."""
    layers, D = len(case["num_units"]), 2 if case["bidirectional"] else 1
    states = []
    for which in ("h", "c") if case["cell"] != "GRUCell" else ("h",):
        per_layer = [torch.from_numpy(np.stack([run.out[f"{which}/{k}/{d}"] for d in range(D)])) for k in range(layers)]
        states.append(per_layer if len({s.shape for s in per_layer}) > 1 else torch.cat(per_layer))
    return torch.from_numpy(run.out["y"]), states


def _states(hy):
    return list(hy) if isinstance(hy, tuple) else [hy]


@pytest.mark.parametrize("tag", ["f32", "f64"])
@pytest.mark.parametrize("name", FIXTURES)
def test_import(name, tag):
    fixture = Fixture(name)
    run = fixture.run(tag, "import")
    module = rtf.from_tf(run.vars, **_settings(fixture.case), dtype=run.dtype).eval()
    assert module.spec.mode == ("gru" if fixture.case["cell"] == "GRUCell" else "lstm")
    y, hy = run.run_module(module)
    y_tf, states_tf = _expected(run, fixture.case)
    assert_close(y, y_tf, f"{fixture} y")
    assert_close(_states(hy), states_tf, f"{fixture} states")


@pytest.mark.parametrize("tag", ["f32", "f64"])
@pytest.mark.parametrize("name", FIXTURES)
def test_export(name, tag):
    fixture = Fixture(name)
    run = fixture.run(tag, "export")
    module = run.module()
    exported = rtf.to_tf(module, forget_bias=fixture.case.get("forget_bias", 1.0))
    loaded = rtf.cells_from_names(run.vars)  # what TF was given, under TF's names
    assert [[sorted(v) for v in d] for d in exported["cells"]] == [[sorted(v) for v in d] for d in loaded]
    for k, directions in enumerate(loaded):
        for d, variables in enumerate(directions):
            for key, value in variables.items():
                assert_close(torch.from_numpy(exported["cells"][k][d][key]), torch.from_numpy(value),
                             f"{fixture} cells[{k}][{d}][{key}]")
    y, hy = run.run_module(module)
    y_tf, states_tf = _expected(run, fixture.case)
    assert_close(y, y_tf, f"{fixture} y")
    assert_close(_states(hy), states_tf, f"{fixture} states")


def test_clips_are_active_in_the_fixture():
    """The clip case would pass without clipping if nothing reached the clip."""
    run = Fixture("tf_lstmcell_peephole_proj_clip").run("f64", "import")
    assert np.abs(run.out["c/0/0"]).max() == pytest.approx(0.3) and np.abs(run.out["y"]).max() == pytest.approx(0.1)


def test_grucell_is_reset_before_with_one_bias_per_gate():
    """Finding 7: a GRUCell is rnnkit's GRU(reset_after=False); both biases fold into TF's one."""
    module = rnnkit.GRU(3, 4, reset_after=False)
    variables = rtf.to_tf(module)["cells"][0][0]
    assert {k: v.shape for k, v in variables.items()} == {
        "gates/kernel": (7, 8), "gates/bias": (8,), "candidate/kernel": (7, 4), "candidate/bias": (4,)}
    back = rtf.from_tf(rtf.to_tf(module))
    assert back.spec.reset_after is False
    x = torch.randn(5, 2, 3)
    with torch.no_grad():
        assert_close(back(x)[0], module(x)[0], "y")


def test_forget_bias_is_folded_on_import_and_subtracted_on_export():
    module = rnnkit.LSTM(3, 4)
    a = rtf.to_tf(module, forget_bias=1.0)["cells"][0][0]["bias"]
    b = rtf.to_tf(module, forget_bias=0.0)["cells"][0][0]["bias"]
    assert np.allclose(b - a, np.r_[np.zeros(8), np.ones(4), np.zeros(4)])


def test_names_group_into_layers_and_directions():
    named = {f"layer_{k}/{side}/lstm_cell/{v}:0": np.zeros(1) for k in (10, 2) for side in ("bw", "fw")
             for v in ("kernel", "bias")}
    cells = rtf.cells_from_names(named)
    assert len(cells) == 2 and all(len(directions) == 2 for directions in cells)
    assert cells[0][1] is not cells[1][1] and sorted(cells[0][0]) == ["bias", "kernel"]


def test_names_refused():
    with pytest.raises(ValueError, match="MultiRNNCell inside bidirectional_dynamic_rnn"):
        rtf.cells_from_names({"bidirectional_rnn/fw/multi_rnn_cell/cell_0/lstm_cell/kernel:0": np.zeros(1)})
    with pytest.raises(ValueError, match="'rnn/dense/weights:0' is not a variable of a TF LSTMCell or GRUCell"):
        rtf.cells_from_names({"rnn/dense/weights:0": np.zeros(1)})


def test_cudnn_canonical_round_trip():
    module = rnnkit.GRU(3, 5, num_layers=2, bidirectional=True).eval()
    weights, biases = rtf.to_tf_cudnn(module)
    assert len(weights) == 2 * 2 * 6 and weights[0].shape == (5, 3)
    back = rtf.from_tf_cudnn(weights, biases, "gru", 3, 5, 2, bidirectional=True)
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "flat")


@pytest.mark.parametrize("module, message", [
    (lambda: rnnkit.LSTM(3, 4, coupled_gates=True), "coupled_gates: TF 1.x rnn_cell cannot represent"),
    (lambda: rnnkit.LSTM(3, 4, layer_norm=True), "layer_norm: TF 1.x rnn_cell cannot represent"),
    (lambda: rnnkit.LSTM(3, 4, zoneout=0.1), "zoneout: TF 1.x rnn_cell cannot represent"),
    (lambda: rnnkit.LSTM(3, 4, bidirectional=True, merge="sum"), "merge='sum': TF 1.x rnn_cell cannot represent"),
    (lambda: rnnkit.GRU(3, 4), "reset_after=True: TF 1.x rnn_cell cannot represent"),
    (lambda: rnnkit.RNN(3, 4), "mode: TF 1.x rnn_cell has no 'rnn_tanh' layer"),
], ids=["coupled", "layer_norm", "zoneout", "sum", "gru-reset_after", "rnn"])
def test_refuses_what_the_cells_cannot_represent(module, message):
    with pytest.raises(ValueError, match=message):
        rtf.to_tf(module())


@pytest.mark.parametrize("module, message", [
    (lambda: rnnkit.LSTM(3, 4, cell_clip=0.1), "cell_clip: TF CudnnRNN cannot represent"),
    (lambda: rnnkit.LSTM(3, 4, peephole=True), "peephole: TF CudnnRNN cannot represent"),
    (lambda: rnnkit.LSTM(3, 4, proj_size=2, proj_clip=0.5), "proj_clip: TF CudnnRNN cannot represent"),
    (lambda: rnnkit.GRU(3, 4, zoneout=0.1), "zoneout: TF CudnnRNN cannot represent"),
], ids=["cell_clip", "peephole", "proj_clip", "zoneout"])
def test_cudnn_refuses_what_tf_cudnn_layers_cannot_represent(module, message):
    """TF's CudnnLSTM takes no clip, though cuDNN's descriptor has one."""
    with pytest.raises(ValueError, match=message):
        rtf.to_tf_cudnn(module())


@pytest.mark.parametrize("bias_mode", ["single_input", "single_recurrent", "none"])
def test_cudnn_single_bias_modes_export_tf_double_bias(bias_mode):
    """TF's cuDNN layers always have 2G biases; the ones the module lacks are zeros (exact)."""
    module = rnnkit.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2, bias_mode=bias_mode).eval()
    weights, biases = rtf.to_tf_cudnn(module)
    assert len(weights) == 2 * 2 * 9 and len(biases) == 2 * 2 * 8
    assert all(b.shape == (5,) for b in biases)
    present = {"single_input": range(4), "single_recurrent": range(4, 8), "none": ()}[bias_mode]
    assert all(not torch.any(b) for k, b in enumerate(biases) if k % 8 not in present)
    back = rtf.from_tf_cudnn(weights, biases, "lstm", 3, 5, 2, bidirectional=True, proj_size=2).eval()
    x = torch.randn(4, 2, 3)
    with torch.no_grad():
        assert_close(back(x)[0], module(x)[0], "y")


def _tf_lstm(**options):
    return rtf.to_tf(rnnkit.LSTM(3, 4, **options))


def _edit(variables, name, value):
    variables["cells"][0][0][name] = value
    return variables


def _drop(variables, name):
    del variables["cells"][0][0][name]
    return variables


@pytest.mark.parametrize("variables, message", [
    (lambda: _drop(_tf_lstm(peephole=True), "w_f_diag"), r"cells\[0\]\[0\] has no w_f_diag"),
    (lambda: _drop(_tf_lstm(peephole=True), "w_o_diag"), r"cells\[0\]\[0\] has no w_o_diag"),
    (lambda: _edit(_tf_lstm(), "bias", np.zeros(12, np.float32)),
     r"cells\[0\]\[0\]\['bias'\] expected shape \(16,\), got \(12,\)"),
    (lambda: _edit(_tf_lstm(peephole=True), "w_i_diag", np.zeros(3, np.float32)),
     r"cells\[0\]\[0\]\['w_i_diag'\] expected shape \(4,\), got \(3,\)"),
    (lambda: _edit(rtf.to_tf(rnnkit.GRU(3, 4, reset_after=False)), "gates/bias", np.zeros(7, np.float32)),
     r"cells\[0\]\[0\]\['gates/bias'\] expected shape \(8,\), got \(7,\)"),
], ids=["no-w_f_diag", "no-w_o_diag", "lstm-bias-length", "peephole-length", "gru-bias-length"])
def test_import_names_the_missing_or_misshapen_variable(variables, message):
    with pytest.raises(ValueError, match=message):
        rtf.from_tf(variables())


def test_explicit_none_removes_the_config_clips():
    """None means no clip; the default "config" takes the config's."""
    variables = rtf.to_tf(rnnkit.LSTM(3, 4, proj_size=2, cell_clip=0.5, proj_clip=0.25))
    assert (rtf.from_tf(variables).spec.cell_clip, rtf.from_tf(variables).spec.proj_clip) == (0.5, 0.25)
    unclipped = rtf.from_tf(variables, cell_clip=None, proj_clip=None).spec
    assert unclipped.cell_clip is None and unclipped.proj_clip is None
    with pytest.raises(ValueError, match="cell_clip: expected a number, None or 'config', got 'none'"):
        rtf.from_tf(variables, cell_clip="none")
    with pytest.raises(TypeError, match="forget_bias: expected a number, got None"):
        rtf.from_tf(variables, forget_bias=None)


def test_bfloat16_modules_export_exact_float32():
    module = rnnkit.LSTM(3, 4, proj_size=2, peephole=True).to(torch.bfloat16)
    exported = rtf.to_tf(module)["cells"][0][0]
    widened = rtf.to_tf(copy.deepcopy(module).float())["cells"][0][0]
    assert sorted(exported) == sorted(widened)
    for name, value in exported.items():
        assert value.dtype == np.float32 and np.array_equal(value, widened[name]), name
    weights, biases = rtf.to_tf_cudnn(rnnkit.GRU(3, 4).to(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in weights + biases)


def test_what_the_arrays_and_options_cannot_both_be_is_refused():
    """from_tf refuses rather than drops: LSTMCell options given for GRUCell arrays, a config that
    says other cells than the arrays are (or has keys to_tf never writes), and variables of
    anything but an LSTMCell / GRUCell among TF's names (a Dense's kernel and bias have the very
    names of an LSTMCell's, and would import as a layer)."""
    gru = rtf.to_tf(rnnkit.GRU(4, 6, reset_after=False))
    for option in ("cell_clip", "proj_clip", "forget_bias"):
        with pytest.raises(ValueError, match=f"{option}: a TF GRUCell has none"):
            rtf.from_tf(gru, **{option: 3.0})
    lstm = rtf.to_tf(rnnkit.LSTM(4, 6))
    for key, value in (("use_peepholes", True), ("num_proj", [3]), ("cell", "GRUCell"), ("num_units", [7])):
        config = {**lstm["config"], key: value}
        with pytest.raises(ValueError, match=f"variables: config {key}="):
            rtf.from_tf({**lstm, "config": config})
    with pytest.raises(ValueError, match=r"config has \['forgetbias'\]"):
        rtf.from_tf({**lstm, "config": {**lstm["config"], "forgetbias": 0.0}})
    assert rtf.from_tf({**lstm, "config": {**lstm["config"], "cell": "BasicLSTMCell"}}).spec.mode == "lstm"
    cell = lstm["cells"][0][0]
    named = {"rnn/lstm_cell/kernel:0": cell["kernel"], "rnn/lstm_cell/bias:0": cell["bias"],
             "dense/kernel:0": np.zeros((6, 16), np.float32), "dense/bias:0": np.zeros(16, np.float32)}
    with pytest.raises(ValueError, match="'dense/kernel:0' is not under a TF LSTMCell / GRUCell scope"):
        rtf.from_tf(named)
    del named["dense/kernel:0"], named["dense/bias:0"]
    assert rtf.from_tf(named).spec.hidden_sizes == (6,)


def test_a_wrong_cudnn_tensor_is_named_by_its_index():
    weights, biases = rtf.to_tf_cudnn(rnnkit.LSTM(4, 6, 2))
    weights = list(weights)
    weights[9] = weights[9][:, :2]
    with pytest.raises(ValueError, match=r"weights\[9\]: expected shape \(6, 6\) .*got \(6, 2\)"):
        rtf.from_tf_cudnn(weights, biases, "lstm", 4, 6, 2)
    weights, biases = rtf.to_tf_cudnn(rnnkit.LSTM(4, 6))
    biases = list(biases)
    biases[3] = biases[3][:5]
    with pytest.raises(ValueError, match=r"biases\[3\]: expected shape \(6,\), got \(5,\)"):
        rtf.from_tf_cudnn(weights, biases, "lstm", 4, 6)
