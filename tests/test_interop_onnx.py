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


def _with_glue_between_layers(op: str, module=None):
    """A 2-layer LSTM model with one foreign op between (or after) its layers, as a user graph would have."""
    module = module if module is not None else rnnkit.LSTM(6, 6, num_layers=2).eval()
    model = ronnx.export(module)
    graph = model.graph
    second = next(n for n in graph.node if n.op_type == "LSTM" and n.input[0] != "input")
    y0 = second.input[0]
    if op == "residual":  # layer 1 reads y0 + input
        node = helper.make_node("Add", [y0, "input"], ["residual"], name="residual_add")
        second.input[0] = "residual"
        graph.node.insert(list(graph.node).index(second), node)
    elif op == "linear":  # layer 1 reads y0 @ W
        graph.initializer.append(numpy_helper.from_array(np.eye(6, dtype=np.float32)[::-1].copy(), "linear_W"))
        node = helper.make_node("MatMul", [y0, "linear_W"], ["linear"], name="linear_between")
        second.input[0] = "linear"
        graph.node.insert(list(graph.node).index(second), node)
    elif op == "parallel":  # layer 1 reads the model's input, not layer 0's output
        second.input[0] = "input"
    elif op == "head":  # a Linear after the stack, feeding the graph's output
        last = next(n for n in graph.node if "output" in n.output)
        last.output[0] = "features"
        graph.initializer.append(numpy_helper.from_array(np.eye(6, dtype=np.float32)[::-1].copy(), "head_W"))
        graph.node.append(helper.make_node("MatMul", ["features", "head_W"], ["output"], name="head"))
    return model


@pytest.mark.parametrize("op, message", [
    ("residual", r"node 'residual_add' \(Add\): it is not part of a recurrent stack"),
    ("linear", r"node 'linear_between' \(MatMul\): it is not part of a recurrent stack"),
    ("parallel", r"node 'LSTM_\d+' \(LSTM\): its input X is not the output of node"),
    ("head", r"node 'head' \(MatMul\): it is not part of a recurrent stack"),
])
def test_import_refuses_a_graph_that_is_not_a_stack(op, message):
    """Finding 5: every node must be a layer or the exporter's glue, else the import names it."""
    model = _with_glue_between_layers(op)
    onnx.checker.check_model(model)
    with pytest.raises(ValueError, match=message):
        ronnx.import_model(model)


def test_the_refused_residual_model_computes_something_else():
    """What the check prevents: the residual graph's output (onnxruntime) is not the stack's."""
    module = rnnkit.LSTM(6, 6, num_layers=2).eval()
    model = _with_glue_between_layers("residual", module)
    x = torch.randn(T, B, 6)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        y_stack, _ = module(x)
    assert (torch.from_numpy(y) - y_stack).abs().max() > 1e-2


def test_import_reads_merge_and_batch_first_from_the_glue():
    module = rnnkit.GRU(4, 5, num_layers=2, bidirectional=True, merge="sum", batch_first=True).eval()
    model = ronnx.export(module)
    del model.metadata_props[:]  # as if another tool wrote the same graph
    back = ronnx.import_model(model)
    assert back.spec.merge == "sum" and back.spec.batch_first
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "weights")


def _edit_initializer(model, prefix: str, change):
    for init in model.graph.initializer:
        if init.name.startswith(prefix):
            init.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(init).copy()), init.name))


@pytest.mark.parametrize("bias_mode, half", [("single_input", "recurrent"), ("single_recurrent", "input"),
                                             ("none", "both")])
def test_import_takes_the_graphs_bias_over_the_metadata(bias_mode, half):
    """Review finding 6: after export, a tool edits the half of B the module's bias mode left
    zero and keeps metadata_props. The import took bias_mode from the metadata and dropped that
    half (0.50 off onnxruntime); the graph's tensors win now."""
    module = rnnkit.LSTM(4, 6, num_layers=2, bidirectional=True, bias_mode=bias_mode).eval()
    model = ronnx.export(module)
    assert ronnx.import_model(model).spec.bias_mode == bias_mode  # untouched: the metadata's mode
    gh = 4 * 6
    columns = {"recurrent": slice(gh, None), "input": slice(None, gh), "both": slice(None)}[half]

    def edit(b):
        b[:, columns] += 0.5
        return b

    if bias_mode == "none":  # no B to edit: add one to the first node, as a tool would
        node = next(n for n in model.graph.node if n.op_type == "LSTM")
        model.graph.initializer.append(numpy_helper.from_array(np.full((2, 2 * gh), 0.5, np.float32), "B_added"))
        assert list(node.input[3:]) == []  # the exporter writes no B without a bias
        node.input.append("B_added")
    else:
        _edit_initializer(model, "B_", edit)
    onnx.checker.check_model(model)
    x = torch.randn(T, B, 4)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    back = ronnx.import_model(model).eval()
    assert back.spec.bias_mode == "double"
    with torch.no_grad():
        assert_close(torch.from_numpy(y), back(x)[0], f"{bias_mode}: onnxruntime vs imported")


@pytest.mark.parametrize("name, change, message", [
    ("B_", lambda b: b[:, : b.shape[1] // 2].copy(),
     r"B: node 'LSTM_\d+' \(LSTM\) input 'B_l0_\d+' expected shape \[1, 2·4·6\] = \(1, 48\), got \(1, 24\)"),
    ("P_", lambda p: p[:, :12].copy(),
     r"P: node 'LSTM_\d+' \(LSTM\) input 'P_l0_\d+' expected shape \[1, 3·6\] = \(1, 18\), got \(1, 12\)"),
    ("W_", lambda w: w[:, :12].copy(),
     r"W: node 'LSTM_\d+' \(LSTM\) input 'W_l0_\d+' expected shape \[1, 4·6, 4\] = \(1, 24, 4\), got \(1, 12, 4\)"),
    ("R_", lambda r: r[0].copy(), r"R: node 'LSTM_\d+' \(LSTM\) input 'R_l0_\d+' expected a 3-D tensor"),
], ids=["B", "P", "W", "R"])
def test_import_names_the_node_and_input_of_a_misshapen_tensor(name, change, message):
    """Review finding 17: 'weights: bias_hh_l0 expected shape (4,), got (0,)' or a regate
    message before, naming neither the ONNX input nor the node."""
    model = ronnx.export(rnnkit.LSTM(4, 6, peephole=True))
    _edit_initializer(model, name, change)
    with pytest.raises(ValueError, match=message):
        ronnx.import_model(model)


def test_bfloat16_module_exports_a_float32_model_with_its_values():
    """Review finding 16: numpy (and onnxruntime's recurrent kernels) have no bfloat16; the model
    is float32 with the module's values exactly, and a bfloat16 model imports through float32."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    module = rnnkit.GRU(4, 6, num_layers=2, bidirectional=True).to(torch.bfloat16).eval()
    model = ronnx.export(module)
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert torch.equal(ronnx.import_model(model, dtype=torch.bfloat16).flat_weights, module.flat_weights)
    x = torch.randn(T, B, 4).to(torch.bfloat16)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input": x.float().numpy()})[0]
    with torch.no_grad():
        reference = ronnx.import_model(model)(x.float())[0]  # the same values in float32
    assert_close(torch.from_numpy(y), reference, "float32 model")
    _edit_initializer(model, "", lambda a: a.astype(ml_dtypes.bfloat16) if a.dtype == np.float32 else a)
    assert torch.equal(ronnx.import_model(model, dtype=torch.bfloat16).flat_weights, module.flat_weights)


def test_a_transposed_input_into_a_batch_major_node_is_time_major():
    """X (T, B, I) -> Transpose -> LSTM(layout=1): the node reads the transposed tensor as batch-major,
    so the two transposes cancel and the graph's input is time-major (it was imported as
    batch_first, the glue's and the node's layouts or-ed). Checked against onnxruntime on the same
    node in layout 0 without the Transpose (onnxruntime has no layout=1 kernel)."""
    rng = np.random.default_rng(0)
    W = numpy_helper.from_array(rng.standard_normal((1, 24, 4), dtype=np.float32), "W")
    R = numpy_helper.from_array(rng.standard_normal((1, 24, 6), dtype=np.float32), "R")

    def model(nodes, out_shape):
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [5, 3, 4])],
                                  [helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, out_shape)], [W, R])
        made = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        made.ir_version = 8
        return made

    transposed = model([helper.make_node("Transpose", ["X"], ["Xb"], perm=[1, 0, 2]),
                        helper.make_node("LSTM", ["Xb", "W", "R"], ["Y", "Y_h"], hidden_size=6, layout=1)], [3, 1, 6])
    plain = model([helper.make_node("LSTM", ["X", "W", "R"], ["Y", "Y_h"], hidden_size=6)], [1, 3, 6])
    module = ronnx.import_model(transposed).eval()
    assert module.spec.batch_first is False
    x = rng.standard_normal((5, 3, 4), dtype=np.float32)
    session = ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(["Y_h"], {"X": x})
    with torch.no_grad():
        _, (h, _) = module(torch.from_numpy(x))
    assert_close(h, torch.from_numpy(expected), "h_n")
