"""ONNX export runs in onnxruntime with the module's results; import brings the module back."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import rnnkit
from rnnkit.interop import onnx as ronnx

from helpers import assert_close

T, B = 5, 3

CONFIGS = {
    "lstm": lambda: rnnkit.LSTM(4, 6),
    "lstm-2layer-bidir-lengths-state": lambda: rnnkit.LSTM(4, 6, num_layers=2, bidirectional=True),
    "lstm-peephole-batch_first": lambda: rnnkit.LSTM(4, 5, num_layers=2, peephole=True, batch_first=True),
    "lstm-coupled-peephole-bidir": lambda: rnnkit.LSTM(4, 6, coupled_gates=True, peephole=True, bidirectional=True),
    "lstm-per-layer-sizes": lambda: rnnkit.LSTM(4, [6, 3], num_layers=2, bidirectional=True),
    "lstm-no-bias": lambda: rnnkit.LSTM(4, 6, bias=False),
    "gru-2layer-bidir-sum": lambda: rnnkit.GRU(4, 6, num_layers=2, bidirectional=True, merge="sum"),
    "gru-reset_before-single-bias": lambda: rnnkit.GRU(4, 6, reset_after=False, bias_mode="single_input"),
    "gru-single_recurrent-batch_first": lambda: rnnkit.GRU(4, 7, bias_mode="single_recurrent", batch_first=True),
    "rnn-relu-3layer-bidir": lambda: rnnkit.RNN(4, 6, num_layers=3, nonlinearity="relu", bidirectional=True),
    "rnn-tanh": lambda: rnnkit.RNN(4, 6),
}


def _initial_state(module):
    spec, D = module.spec, module.spec.num_directions
    if spec.per_layer:
        h = [torch.randn(D, B, spec.output_size(k)) for k in range(spec.num_layers)]
        c = [torch.randn(D, B, spec.hidden_sizes[k]) for k in range(spec.num_layers)]
    else:
        h = torch.randn(spec.num_layers * D, B, spec.output_size(0))
        c = torch.randn(spec.num_layers * D, B, spec.hidden_sizes[0])
    return (h, c) if spec.mode == "lstm" else h


def _feed(name, value, feed):
    if isinstance(value, list):
        for k, v in enumerate(value):
            feed[f"{name}_l{k}"] = v.numpy()
    else:
        feed[name] = value.numpy()


def _flat_outputs(y, hy):
    states = list(hy) if isinstance(hy, tuple) else [hy]
    flat = [y]
    for s in states:
        flat += s if isinstance(s, list) else [s]
    return flat


@pytest.mark.parametrize("with_lengths", [False, True], ids=["full", "lengths"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_runs_in_onnxruntime_and_imports_back(name, with_lengths):
    module = CONFIGS[name]().eval()
    spec = module.spec
    x = torch.randn(B, T, spec.input_size) if spec.batch_first else torch.randn(T, B, spec.input_size)
    lengths = torch.tensor([T, 1, 3]) if with_lengths else None
    hx = _initial_state(module)
    model = ronnx.export(module, include_lengths=with_lengths, include_initial_state=True)
    feed = {"input": x.numpy()}
    if with_lengths:
        feed["lengths"] = lengths.numpy()
    if spec.mode == "lstm":
        _feed("h_0", hx[0], feed)
        _feed("c_0", hx[1], feed)
    else:
        _feed("h_0", hx, feed)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, feed)
    with torch.no_grad():
        expected = _flat_outputs(*module(x, hx, lengths=lengths))
    assert len(got) == len(expected)
    for k, (a, e) in enumerate(zip(got, expected)):
        assert_close(torch.from_numpy(a), e, f"{name} output {k}")

    back = ronnx.import_model(model).eval()
    assert back.spec == spec
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "imported weights")


def test_export_to_file_without_states_and_fixed_axes(tmp_path):
    module = rnnkit.GRU(3, 4, num_layers=2).eval()
    path = tmp_path / "gru.onnx"
    ronnx.export(module, path, dynamic_axes=False, sequence_length=T, batch_size=B, opset=14)
    onnx.checker.check_model(str(path))
    x = torch.randn(T, B, 3)
    y, h_n = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})
    with torch.no_grad():
        y_ref, h_ref = module(x)
    assert_close(torch.from_numpy(y), y_ref, "y")
    assert_close(torch.from_numpy(h_n), h_ref, "h_n")
    back = ronnx.import_model(path)
    assert back.spec == module.spec


def _foreign_gru_model(linear_before_reset: int, **attributes):
    """A GRU model written by hand, without rnnkit's metadata (as another exporter would)."""
    H, I = 4, 3
    rng = np.random.default_rng(1)
    W = rng.standard_normal((2, 3 * H, I)).astype(np.float32)
    R = rng.standard_normal((2, 3 * H, H)).astype(np.float32)
    Bias = rng.standard_normal((2, 6 * H)).astype(np.float32)
    node = helper.make_node("GRU", ["X", "W", "R", "B"], ["Y", "Y_h"], hidden_size=H, direction="bidirectional",
                            linear_before_reset=linear_before_reset, **attributes)
    graph = helper.make_graph(
        [node], "foreign", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "B", I])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None), helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, n) for a, n in ((W, "W"), (R, "R"), (Bias, "B"))],
    )
    opsets = [helper.make_opsetid("", 17)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = helper.find_min_ir_version_for(opsets)
    return model


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_import_foreign_model(linear_before_reset):
    model = _foreign_gru_model(linear_before_reset)
    module = ronnx.import_model(model).eval()
    assert module.spec.reset_after == bool(linear_before_reset) and module.spec.bidirectional
    x = torch.randn(T, B, 3)
    Y, Y_h = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x.numpy()})
    with torch.no_grad():
        y, h_n = module(x)
    assert_close(torch.from_numpy(Y).permute(0, 2, 1, 3).reshape(T, B, -1), y, "Y")
    assert_close(torch.from_numpy(Y_h), h_n, "Y_h")


@pytest.mark.parametrize("module, option", [
    (lambda: rnnkit.LSTM(4, 6, proj_size=3), "proj_size"),
    (lambda: rnnkit.LSTM(4, 6, cell_clip=1.0), "cell_clip"),
    (lambda: rnnkit.GRU(4, 6, layer_norm=True), "layer_norm"),
    (lambda: rnnkit.RNN(4, 6, zoneout=0.1), "zoneout"),
], ids=["proj_size", "cell_clip", "layer_norm", "zoneout"])
def test_export_refuses_what_onnx_cannot_represent(module, option):
    with pytest.raises(ValueError, match=option):
        ronnx.export(module())


def test_import_refuses_clip_and_bad_opset():
    with pytest.raises(ValueError, match="clip"):
        ronnx.import_model(_foreign_gru_model(1, clip=3.0))
    with pytest.raises(ValueError, match="opset"):
        ronnx.export(rnnkit.GRU(2, 3), opset=11)
