"""The bad-input catalogue: every mistake raises ValueError or TypeError with a message that
names the argument and, where there is one, the expected and the actual value. Also:
nothing the user passes in is modified."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import rnnkit
import rnnkit.interop.cudnn  # noqa: F401 (loaded lazily)
import rnnkit.interop.haste  # noqa: F401
import rnnkit.interop.keras  # noqa: F401
import rnnkit.interop.mxnet  # noqa: F401
import rnnkit.interop.tf  # noqa: F401

T, B, I, H = 5, 3, 4, 6
REF = "reference"


def lstm(**kw):
    return rnnkit.LSTM(I, H, 2, backend=REF, **kw)


def gru(**kw):
    return rnnkit.GRU(I, H, 2, backend=REF, **kw)


def x(*shape, dtype=torch.float32):
    return torch.randn(*(shape or (T, B, I))).to(dtype)


def packed():
    return pack_padded_sequence(x(), [5, 3, 2])


def run_functional_with_wrong_weights():
    spec = rnnkit.RNNSpec("gru", I, H)
    rnnkit.rnn(spec, torch.randn(10), x())


def backward_data_dcy_on_gru():
    spec = rnnkit.RNNSpec("gru", I, H)
    w = rnnkit.Layout(spec).new_buffer()
    y, hy, reserve = rnnkit.forward_training(spec, w, x())
    rnnkit.backward_data(reserve, torch.randn_like(y), dcy=torch.randn_like(hy))


def backward_data_wrong_dy():
    spec = rnnkit.RNNSpec("gru", I, H)
    w = rnnkit.Layout(spec).new_buffer()
    y, hy, reserve = rnnkit.forward_training(spec, w, x())
    rnnkit.backward_data(reserve, torch.randn(T, B, H + 1))


def _gru_call():
    spec = rnnkit.RNNSpec("gru", I, H)
    return spec, rnnkit.Layout(spec).new_buffer(), x()


def _gru_layout():
    return rnnkit.Layout(rnnkit.RNNSpec("gru", I, H))


_GRU_NUMEL = rnnkit.Layout(rnnkit.RNNSpec("gru", I, H)).numel


def _reserve_after_backward_data():
    y, hy, reserve = rnnkit.forward_training(*_gru_call())
    rnnkit.backward_data(reserve, torch.randn_like(y))
    return reserve


def _cudnn_params(complex_=False, meta=False, **config):
    import rnnkit.interop.cudnn  # noqa: F401 (the converters load lazily)

    params = rnnkit.interop.cudnn.to_cudnn(rnnkit.LSTM(I, H))
    params["config"].update(config)
    if complex_ or meta:
        params["matrices"] = {k: v.to(torch.complex64) if complex_ else v.to("meta")
                              for k, v in params["matrices"].items()}
    return params


# (id, call, substrings the message must contain: the argument's name first, then expected / actual)
CASES = [
    # ---- the input
    ("input-rank-4", lambda: lstm()(x(T, B, I, 1)), ["input", "3-D", "(5, 3, 4, 1)"]),
    ("input-rank-1", lambda: lstm()(x(I)), ["input", "2-D", "(4,)"]),
    ("input-feature-size", lambda: lstm()(x(T, B, 7)), ["input", "input_size=4", "(5, 3, 7)"]),
    ("input-float64-into-float32", lambda: lstm()(x(dtype=torch.float64)), ["input", "torch.float32", "torch.float64"]),
    ("input-integer", lambda: gru()(torch.ones(T, B, I, dtype=torch.int64)), ["input", "torch.float32", "torch.int64"]),
    ("input-not-a-tensor", lambda: gru()(x().tolist()), ["input", "tensor", "list"]),
    ("input-T0", lambda: gru()(x(0, B, I)), ["input", "at least one time step", "(0, 3, 4)"]),
    ("input-packed-with-lengths-beyond-T",  # torch's pack_padded_sequence does not check them
     lambda: gru()(pack_padded_sequence(x(), [T + 1, 3, 2])), ["input", "batch_sizes", "sum 11", "10 data rows"]),
    ("input-T0-batch_first", lambda: gru(batch_first=True)(x(B, 0, I)), ["input", "at least one time step", "(3, 0, 4)"]),
    # ---- initial states
    ("h0-batch-mismatch", lambda: gru()(x(), torch.randn(2, B - 1, H)), ["hx", "(2, 3, 6)", "(2, 2, 6)"]),
    ("h0-wrong-layers", lambda: gru()(x(), torch.randn(1, B, H)), ["hx", "(2, 3, 6)", "(1, 3, 6)"]),
    ("h0-wrong-dtype", lambda: gru()(x(), torch.randn(2, B, H, dtype=torch.float64)),
     ["hx", "torch.float32", "torch.float64"]),
    ("h0-not-a-tensor", lambda: gru()(x(), [[0.0]]), ["hx", "tensor", "list"]),
    ("lstm-h0-shape", lambda: lstm()(x(), (torch.randn(2, B, H - 1), torch.randn(2, B, H))),
     ["h_0", "(2, 3, 6)", "(2, 3, 5)"]),
    ("lstm-c0-shape", lambda: lstm()(x(), (torch.randn(2, B, H), torch.randn(2, B + 1, H))),
     ["c_0", "(2, 3, 6)", "(2, 4, 6)"]),
    ("lstm-c0-proj", lambda: lstm(proj_size=3)(x(), (torch.randn(2, B, 3), torch.randn(2, B, 3))),
     ["c_0", "(2, 3, 6)", "(2, 3, 3)"]),
    ("lstm-hx-not-a-pair", lambda: lstm()(x(), torch.randn(2, B, H)), ["hx", "pair", "Tensor"]),
    ("lstm-hx-triple", lambda: lstm()(x(), (torch.randn(2, B, H),) * 3), ["hx", "pair", "tuple"]),
    ("per-layer-list-wrong-length", lambda: rnnkit.GRU(I, [H, 5], 2, backend=REF)(x(), [torch.randn(1, B, H)]),
     ["hx", "2 tensors", "length 1"]),
    ("per-layer-entry-wrong-shape",
     lambda: rnnkit.GRU(I, [H, 5], 2, backend=REF)(x(), [torch.randn(1, B, H), torch.randn(1, B, H)]),
     ["hx[1]", "(1, 3, 5)", "(1, 3, 6)"]),
    ("per-layer-given-one-tensor", lambda: rnnkit.GRU(I, [H, 5], 2, backend=REF)(x(), torch.randn(2, B, H)),
     ["hx", "list of 2", "Tensor"]),
    ("unbatched-h0-batched", lambda: gru()(x(T, I), torch.randn(2, 1, H)), ["hx", "(2, 6)", "(2, 1, 6)"]),
    # ---- lengths
    ("lengths-longer-than-T", lambda: gru()(x(), lengths=[6, 2, 3]), ["lengths", "T=5", "max 6"]),
    ("lengths-zero", lambda: gru()(x(), lengths=[0, 2, 3]), ["lengths", "[1, T=5]", "min 0"]),
    ("lengths-negative", lambda: gru()(x(), lengths=torch.tensor([-1, 2, 3])), ["lengths", "[1, T=5]", "min -1"]),
    ("lengths-float-tensor", lambda: gru()(x(), lengths=torch.tensor([1.0, 2.0, 3.0])),
     ["lengths", "integer", "torch.float32"]),
    ("lengths-float-list", lambda: gru()(x(), lengths=[1.0, 2, 3]), ["lengths", "integers", "1.0"]),
    ("lengths-bool", lambda: gru()(x(), lengths=torch.tensor([True, True, True])), ["lengths", "torch.bool"]),
    ("lengths-wrong-count", lambda: gru()(x(), lengths=[1, 2]), ["lengths", "(3,)", "(2,)"]),
    ("lengths-2d", lambda: gru()(x(), lengths=torch.ones(3, 1, dtype=torch.int64)), ["lengths", "(3,)", "(3, 1)"]),
    ("lengths-not-a-sequence", lambda: gru()(x(), lengths="123"), ["lengths", "str"]),
    ("lengths-with-packed-sequence", lambda: gru()(packed(), lengths=[5, 3, 2]), ["lengths", "PackedSequence"]),
    ("lengths-with-unbatched-input", lambda: gru()(x(T, I), lengths=[3]), ["lengths", "unbatched"]),
    # ---- constructor options
    ("option-misspelt", lambda: rnnkit.LSTM(I, H, peepholes=True), ["LSTM", "'peepholes'", "did you mean 'peephole'"]),
    ("option-misspelt-cell", lambda: rnnkit.GRUCell(I, H, layernorm=True), ["GRUCell", "'layernorm'", "'layer_norm'"]),
    ("option-unknown", lambda: rnnkit.GRU(I, H, frobnicate=1), ["GRU", "'frobnicate'", "layer_norm", "zoneout"]),
    ("option-nonlinearity-on-gru", lambda: rnnkit.GRU(I, H, nonlinearity="relu"), ["GRU", "'nonlinearity'", "RNNCell"]),
    ("proj_size-equal-hidden", lambda: rnnkit.LSTM(I, H, proj_size=H, backend=REF), ["proj_size", "6", "smaller"]),
    ("proj_size-larger-per-layer", lambda: rnnkit.LSTM(I, [6, 4], 2, proj_size=[3, 5], backend=REF),
     ["proj_size[1]", "4", "5"]),
    ("peephole-on-gru", lambda: rnnkit.GRU(I, H, peephole=True, backend=REF), ["peephole", "gru"]),
    ("proj-on-gru", lambda: rnnkit.GRU(I, H, proj_size=3, backend=REF), ["proj_size", "gru"]),
    ("cell_clip-on-rnn", lambda: rnnkit.RNN(I, H, cell_clip=1.0, backend=REF), ["cell_clip", "rnn_tanh"]),
    ("proj_clip-without-proj", lambda: rnnkit.LSTM(I, H, proj_clip=1.0, backend=REF), ["proj_clip", "proj_size=0"]),
    ("cell_clip-negative", lambda: rnnkit.LSTM(I, H, cell_clip=-1.0, backend=REF), ["cell_clip", "-1.0"]),
    ("dropout-above-one", lambda: rnnkit.LSTM(I, H, 2, dropout=1.5, backend=REF), ["dropout", "[0, 1]", "1.5"]),
    ("zoneout-one", lambda: rnnkit.GRU(I, H, zoneout=1.0, backend=REF), ["zoneout", "[0, 1)", "1.0"]),
    ("zoneout-negative", lambda: rnnkit.GRU(I, H, zoneout=-0.1, backend=REF), ["zoneout", "[0, 1)", "-0.1"]),
    ("merge-sum-one-direction", lambda: rnnkit.LSTM(I, H, merge="sum", backend=REF), ["merge", "bidirectional=True"]),
    ("cell_clip-nan", lambda: rnnkit.LSTM(I, H, cell_clip=float("nan"), backend=REF), ["cell_clip", "finite", "nan"]),
    ("proj_clip-inf", lambda: rnnkit.LSTM(I, H, proj_size=2, proj_clip=float("inf"), backend=REF),
     ["proj_clip", "finite", "inf"]),
    ("cellspec-mode", lambda: rnnkit.CellSpec("lsmt", I, H), ["mode", "'lstm'", "'lsmt'"]),
    ("cellspec-proj-size", lambda: rnnkit.CellSpec("lstm", I, H, proj_size=20), ["proj_size", "hidden_size (6)", "20"]),
    ("cellspec-input-size", lambda: rnnkit.CellSpec("gru", -3, H), ["input_size", "positive", "-3"]),
    ("cell-list-hidden-size", lambda: rnnkit.LSTMCell(I, [H], backend=REF), ["hidden_size", "an int for a cell", "[6]"]),
    ("recurrent_dropout-above-one", lambda: rnnkit.RNN(I, H, recurrent_dropout=1.5, backend=REF),
     ["recurrent_dropout", "[0, 1]", "1.5"]),
    ("zoneout-pair-c-one", lambda: rnnkit.LSTM(I, H, zoneout=(0.1, 1.0), backend=REF), ["zoneout[1]", "1.0"]),
    ("dropconnect-string", lambda: rnnkit.LSTM(I, H, dropconnect="0.1", backend=REF), ["dropconnect", "str"]),
    ("hidden-list-length", lambda: rnnkit.LSTM(I, [6, 5], 3, backend=REF), ["hidden_size", "3", "2 entries"]),
    ("hidden-zero", lambda: rnnkit.GRU(I, 0, backend=REF), ["hidden_size", "positive", "0"]),
    ("num_layers-zero", lambda: rnnkit.GRU(I, H, 0, backend=REF), ["num_layers", "positive", "0"]),
    ("input_size-float", lambda: rnnkit.GRU(4.0, H, backend=REF), ["input_size", "float"]),
    ("bias_mode-unknown", lambda: rnnkit.LSTM(I, H, bias_mode="triple", backend=REF), ["bias_mode", "double", "'triple'"]),
    ("merge-unknown", lambda: rnnkit.LSTM(I, H, bidirectional=True, merge="mean", backend=REF),
     ["merge", "concat", "'mean'"]),
    ("backend-unknown", lambda: rnnkit.LSTM(I, H, backend="nope"), ["backend", "reference", "'nope'"]),
    ("layer_norm-reset_before", lambda: rnnkit.GRU(I, H, layer_norm=True, reset_after=False, backend=REF),
     ["layer_norm", "reset_after"]),
    ("reset_after-on-lstm", lambda: rnnkit.LSTM(I, H, reset_after=False, backend=REF), ["reset_after", "lstm"]),
    ("zoneout-pair-on-gru", lambda: rnnkit.GRU(I, H, zoneout=(0.1, 0.2), backend=REF), ["zoneout", "lstm", "gru"]),
    ("bias-false-with-double", lambda: rnnkit.LSTM(I, H, bias=False, bias_mode="double", backend=REF),
     ["bias_mode", "'none'", "'double'"]),
    ("bidirectional-not-bool", lambda: rnnkit.LSTM(I, H, bidirectional=1, backend=REF), ["bidirectional", "bool", "int"]),
    ("nonlinearity-unknown", lambda: rnnkit.RNN(I, H, nonlinearity="sigmoid", backend=REF),
     ["nonlinearity", "tanh", "'sigmoid'"]),
    ("forget_bias-on-gru", lambda: rnnkit.GRU(I, H, forget_bias=1.0, backend=REF), ["forget_bias", "gru"]),
    # ---- cells
    ("lstmcell-recurrent_dropout", lambda: rnnkit.LSTMCell(I, H, recurrent_dropout=0.1, backend=REF),
     ["recurrent_dropout", "per-sequence"]),
    ("grucell-dropconnect", lambda: rnnkit.GRUCell(I, H, dropconnect=0.1, backend=REF), ["dropconnect"]),
    ("rnncell-input_dropout", lambda: rnnkit.RNNCell(I, H, input_dropout=0.1, backend=REF), ["input_dropout"]),
    ("cell-input-rank-3", lambda: rnnkit.GRUCell(I, H, backend=REF)(x()), ["input", "2-D", "(5, 3, 4)"]),
    ("cell-input-feature-size", lambda: rnnkit.GRUCell(I, H, backend=REF)(x(B, 7)), ["input", "input_size=4", "(3, 7)"]),
    ("cell-hx-shape", lambda: rnnkit.GRUCell(I, H, backend=REF)(x(B, I), torch.randn(B + 1, H)),
     ["hx", "(3, 6)", "(4, 6)"]),
    ("lstmcell-hx-not-a-pair", lambda: rnnkit.LSTMCell(I, H, backend=REF)(x(B, I), torch.randn(B, H)),
     ["hx", "pair", "Tensor"]),
    ("lstmcell-c-shape", lambda: rnnkit.LSTMCell(I, H, backend=REF)(x(B, I), (torch.randn(B, H), torch.randn(B, 2))),
     ["hx (c)", "(3, 6)", "(3, 2)"]),
    # ---- the functional API
    ("functional-weights-size", run_functional_with_wrong_weights, ["weights", "1-D", "(10,)"]),
    ("backward_data-dcy-on-gru", backward_data_dcy_on_gru, ["dcy", "LSTM", "gru"]),
    ("backward_data-dy-shape", backward_data_wrong_dy, ["dy", "(5, 3, 6)", "(5, 3, 7)"]),
    ("functional-training-not-a-bool", lambda: rnnkit.rnn(*_gru_call(), training="no"), ["training", "bool", "'no'"]),
    ("functional-batch_first-not-a-bool", lambda: rnnkit.rnn(*_gru_call(), batch_first="no"),
     ["batch_first", "bool", "'no'"]),
    ("functional-backend-none", lambda: rnnkit.forward_inference(*_gru_call(), backend=None), ["backend", "None"]),
    ("backward_weights-accumulate-not-a-bool", lambda: rnnkit.backward_weights(_reserve_after_backward_data(),
                                                                                torch.zeros(_GRU_NUMEL), accumulate="x"),
     ["accumulate", "bool", "'x'"]),
    ("backward_weights-expanded-dweights", lambda: rnnkit.backward_weights(
        _reserve_after_backward_data(), torch.zeros(1).expand(_GRU_NUMEL)), ["dweights", "expanded", "(0,)"]),
    # ---- the descriptor API
    ("cellspec-proj-on-gru", lambda: rnnkit.CellSpec("gru", I, H, proj_size=2), ["proj_size", "LSTM", "gru"]),
    ("cellspec-peephole-on-gru", lambda: rnnkit.CellSpec("gru", I, H, peephole=True), ["peephole", "LSTM"]),
    ("cellspec-cell-clip-on-rnn", lambda: rnnkit.CellSpec("rnn_tanh", I, H, cell_clip=1.0), ["cell_clip", "LSTM"]),
    ("cellspec-zoneout-c-on-gru", lambda: rnnkit.CellSpec("gru", I, H, zoneout_c=0.5), ["zoneout_c", "LSTM"]),
    ("cellspec-ln-gru-reset-before", lambda: rnnkit.CellSpec("gru", I, H, layer_norm=True, reset_after=False),
     ["layer_norm", "reset_after=True"]),
    ("cellspec-proj-clip-without-proj", lambda: rnnkit.CellSpec("lstm", I, H, proj_clip=1.0), ["proj_clip", "proj_size=0"]),
    ("cellspec-reset-after-on-lstm", lambda: rnnkit.CellSpec("lstm", I, H, reset_after=False), ["reset_after", "GRU"]),
    ("layout-named_views-longer", lambda: _gru_layout().named_views(torch.zeros(_GRU_NUMEL + 3)),
     ["flat", f"{_GRU_NUMEL} values", f"({_GRU_NUMEL + 3},)"]),
    ("layout-named_views-list", lambda: _gru_layout().named_views([0.0] * _GRU_NUMEL), ["flat", "list"]),
    ("layout-pass_weights-layer", lambda: _gru_layout().pass_weights(torch.zeros(_GRU_NUMEL), 5, 0),
     ["layer", "[0, 1)", "5"]),
    ("layout-group-missing", lambda: _gru_layout().group({}), ["tensors", "missing", "weight_ih_l0"]),
    # ---- the converters
    ("keras-complex-arrays", lambda: rnnkit.interop.keras.from_keras(
        [[a.astype("complex64") for a in layer] for layer in rnnkit.interop.keras.to_keras(rnnkit.LSTM(I, H))], "lstm"),
     ["weights[0][0]", "real numbers", "complex64"]),
    ("keras-none-array", lambda: rnnkit.interop.keras.from_keras(
        [[a if k != 1 else None for k, a in enumerate(layer)] for layer in rnnkit.interop.keras.to_keras(
            rnnkit.LSTM(I, H))], "lstm"), ["weights[0][1]", "array", "None"]),
    ("keras-mode-list", lambda: rnnkit.interop.keras.from_keras([], ["lstm"]), ["mode", "['lstm']"]),
    ("keras-merge", lambda: rnnkit.interop.keras.from_keras(
        rnnkit.interop.keras.to_keras(rnnkit.LSTM(I, H, bidirectional=True)), "lstm", bidirectional=True, merge="bad"),
     ["merge", "'concat' or 'sum'", "'bad'"]),
    ("cudnn-complex-matrices", lambda: rnnkit.interop.cudnn.from_cudnn(_cudnn_params(complex_=True)),
     ["matrices[(0, 0)]", "real numbers", "complex64"]),
    ("cudnn-meta-matrices", lambda: rnnkit.interop.cudnn.from_cudnn(_cudnn_params(meta=True)),
     ["matrices[(0, 0)]", "meta"]),
    ("cudnn-cell-clip-bool", lambda: rnnkit.interop.cudnn.from_cudnn(_cudnn_params(cellClip=True)),
     ["config['cellClip']", "positive float", "True"]),
    ("tf-forget-bias-bool", lambda: rnnkit.interop.tf.to_tf(rnnkit.LSTM(I, H), forget_bias=True),
     ["forget_bias", "number", "True"]),
    ("tf-forget-bias-nan", lambda: rnnkit.interop.tf.from_tf(rnnkit.interop.tf.to_tf(rnnkit.LSTM(I, H)),
                                                            forget_bias=float("nan")), ["forget_bias", "finite", "nan"]),
    ("tf-cudnn-weights-none", lambda: rnnkit.interop.tf.from_tf_cudnn(None, [], "lstm", I, H),
     ["weights", "list of arrays", "NoneType"]),
    ("haste-zoneout-pair", lambda: rnnkit.interop.haste.from_haste(
        rnnkit.interop.haste.to_haste(rnnkit.LSTM(I, H)), "lstm", zoneout=(0.1, 0.5)), ["zoneout", "h only", "(0.1, 0.5)"]),
    ("haste-layers-str", lambda: rnnkit.interop.haste.from_haste("abc", "lstm"), ["layers", "list of dicts", "str"]),
    ("mxnet-state-clip-str", lambda: rnnkit.interop.mxnet.from_gluon(
        rnnkit.interop.mxnet.to_gluon(rnnkit.LSTM(I, H)), "lstm", state_clip_min="-1", state_clip_max="1"),
     ["state_clip_min", "number", "'-1'"]),
]


def test_catalogue_is_large_and_ids_are_unique():
    ids = [case[0] for case in CASES]
    assert len(ids) >= 25 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("call,needles", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_raises_a_clear_error(call, needles):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    message = str(info.value)
    assert message.startswith(needles[0]) or needles[0] in message.split(":")[0], (
        f"the message must name the argument {needles[0]!r} first: {message}"
    )
    for needle in needles[1:]:
        assert needle in message, f"{needle!r} missing from: {message}"


# (id, the same mistake made with torch.nn and with rnnkit): torch.nn raises RuntimeError for a
# shape or device that does not fit and ValueError for a wrong dtype; code catching those must
# catch rnnkit's error too (rnnkit's are also ValueError / TypeError, as the catalogue checks).
_TORCH_LSTM, _KIT_LSTM = torch.nn.LSTM(I, H, 2), rnnkit.LSTM(I, H, 2, backend=REF)
_TORCH_CELL, _KIT_CELL = torch.nn.GRUCell(I, H), rnnkit.GRUCell(I, H, backend=REF)
SAME_CLASS_AS_TORCH = [
    ("feature-size", lambda m: m(x(T, B, 7))),
    ("h0-batch", lambda m: m(x(), (torch.zeros(2, B + 1, H), torch.zeros(2, B, H)))),
    ("c0-size", lambda m: m(x(), (torch.zeros(2, B, H), torch.zeros(2, B, H + 1)))),
    ("T0", lambda m: m(x(0, B, I))),
    ("rank-4", lambda m: m(x(T, B, I, 1))),
    ("float64-input", lambda m: m(x(dtype=torch.float64))),
    ("input-on-meta", lambda m: m(x().to("meta"))),
]
SAME_CLASS_AS_TORCH_CELL = [
    ("cell-feature-size", lambda m: m(x(B, 7))),
    ("cell-h-batch", lambda m: m(x(B, I), torch.zeros(B + 1, H))),
    ("cell-rank-3", lambda m: m(x(B, 1, I))),
]


@pytest.mark.parametrize("call", [c[1] for c in SAME_CLASS_AS_TORCH + SAME_CLASS_AS_TORCH_CELL],
                         ids=[c[0] for c in SAME_CLASS_AS_TORCH + SAME_CLASS_AS_TORCH_CELL])
def test_errors_are_of_the_class_torch_nn_raises(call):
    cell = call in [c[1] for c in SAME_CLASS_AS_TORCH_CELL]
    with pytest.raises(Exception) as torch_error:
        call(_TORCH_CELL if cell else _TORCH_LSTM)
    expected = type(torch_error.value)
    assert expected in (RuntimeError, ValueError)
    with pytest.raises(expected) as info:
        call(_KIT_CELL if cell else _KIT_LSTM)
    assert isinstance(info.value, (ValueError, TypeError))


def test_device_mismatch_names_both_devices():
    """A second device is not available on this machine; the 'meta' device stands in for one."""
    module = gru()
    with pytest.raises(ValueError) as info:
        module(x().to("meta"))
    message = str(info.value)
    assert message.startswith("input") and "cpu" in message and "meta" in message
    with pytest.raises(ValueError) as info:
        module(x(), torch.randn(2, B, H, device="meta"))
    message = str(info.value)
    assert message.startswith("hx") and "cpu" in message and "meta" in message


def test_unavailable_backend_by_name_is_refused_with_the_reason(monkeypatch):
    from rnnkit import backend as backends

    reference = backends.get("reference")
    monkeypatch.setattr(reference, "unavailable_reason", lambda: "switched off for this test")
    with pytest.raises(rnnkit.BackendUnavailableError, match="switched off for this test"):
        rnnkit.LSTM(I, H, backend="reference")


# ---- nothing the user passes in is modified --------------------------------------------------

def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if hasattr(value, "_fields"):  # PackedSequence and other named tuples
        return value._make(_snapshot(v) for v in value)
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _same(a, b):
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


def _sum_outputs(out):
    if isinstance(out, torch.Tensor):
        return (out * torch.randn_like(out)).sum()
    if hasattr(out, "data") and not isinstance(out, torch.Tensor):  # PackedSequence
        return _sum_outputs(out.data)
    return sum(_sum_outputs(o) for o in out)


@pytest.mark.parametrize(
    "make,make_args",
    [
        (lambda: rnnkit.LSTM(I, H, 2, proj_size=3, bidirectional=True, backend=REF),
         lambda: (x(), (torch.randn(4, B, 3), torch.randn(4, B, H)), torch.tensor([5, 1, 3]))),
        (lambda: rnnkit.LSTM(I, [H, 5], 2, zoneout=(0.1, 0.2), recurrent_dropout=0.2, dropout=0.3, backend=REF),
         lambda: (x(), ([torch.randn(1, B, H), torch.randn(1, B, 5)], [torch.randn(1, B, H), torch.randn(1, B, 5)]),
                  [2, 5, 4])),
        (lambda: rnnkit.GRU(I, H, bidirectional=True, batch_first=True, input_dropout=0.3, backend=REF),
         lambda: (x(B, T, I), torch.randn(2, B, H), None)),
        (lambda: rnnkit.RNN(I, H, layer_norm=True, backend=REF), lambda: (x(T, I), torch.randn(1, H), None)),
        (lambda: rnnkit.GRU(I, H, backend=REF), lambda: (packed(), torch.randn(1, B, H), None)),
        (lambda: rnnkit.LSTMCell(I, H, peephole=True, zoneout=0.2, backend=REF),
         lambda: (x(B, I), (torch.randn(B, H), torch.randn(B, H)))),
    ],
    ids=["lstm-proj-bi-lengths", "lstm-per_layer-dropouts-list-lengths", "gru-batch_first", "rnn-unbatched",
         "gru-packed", "lstmcell"],
)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_inputs_are_not_modified(make, make_args, training):
    module = make().train(training)
    args = make_args()
    for a in args[:2]:
        for t in (a if isinstance(a, (list, tuple)) and not hasattr(a, "_fields") else [a]):
            for leaf in (t if isinstance(t, list) else [t]):
                if isinstance(leaf, torch.Tensor):
                    leaf.requires_grad_(True)
    before = _snapshot(args)
    out = module(*args)
    _sum_outputs(out).backward()
    assert _same(args, before)


# ---- weights put in by hand: checked before any kernel reads them --------------------------

@pytest.mark.parametrize("backend", ["auto", "fused", "reference"])
@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("name,shape", [("weight_hh_l0", (4 * H, H + 1)), ("weight_hh_l0", (4 * H, H - 1)),
                                        ("weight_ih_l0", (4 * H, I - 1)), ("bias_hh_l0", (4 * H + 2,))])
def test_a_weight_of_the_wrong_shape_is_refused_by_name(backend, steps, grad, name, shape):
    """p.data = ... of the wrong shape went to the fused kernels, which took the sizes from it:
    outputs of the wrong width, non-finite values or a corrupted heap (the process aborted)."""
    module = rnnkit.LSTM(I, H, backend=backend)
    getattr(module, name).data = torch.randn(shape)
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one warning that the aliasing is broken
        module(x(steps, B, I))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(name) and str(tuple(shape)) in message, message


def test_a_parametrization_of_the_wrong_shape_and_a_weight_of_another_dtype_are_refused():
    from torch.nn.utils import parametrize

    class Widen(torch.nn.Module):
        def forward(self, w):
            return torch.cat([w, w[:, :1]], 1)

    module = rnnkit.GRU(I, H)
    parametrize.register_parametrization(module, "weight_hh_l0", Widen(), unsafe=True)
    with pytest.raises(ValueError, match=r"weight_hh_l0: expected shape \(18, 6\)"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module(x())
    module = rnnkit.GRUCell(I, H)
    module.weight_hh.data = module.weight_hh.data.double()
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match="weight_hh: expected dtype torch.float32"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module(x(B, I))


@pytest.mark.skipif(bool(rnnkit.backend.get("fused").unavailable_reason()), reason="the fused kernels are not built here")
def test_the_fused_kernels_check_every_shape_themselves():
    """The kernels' own check, behind the modules' (a caller of the backend API directly)."""
    from rnnkit.masks import PassMasks

    spec = rnnkit.RNNSpec("lstm", I, H)
    w = rnnkit.LSTM(I, H)._pass_weights()[0]
    fused = rnnkit.backend.get("fused")
    h0, c0 = torch.zeros(B, H), torch.zeros(B, H)
    for bad in [dict(R=torch.randn(4 * H, H - 1)), dict(W=torch.randn(4 * H, I + 1)), dict(b_R=torch.randn(4 * H - 1)),
                dict(W=torch.randn(3 * H, I), R=torch.randn(3 * H, H))]:
        with pytest.raises(RuntimeError, match="rnnkit fused"):
            fused.run_pass(spec.cell(0), x(), h0, c0, w._replace(**bad), None, False, PassMasks())
    with pytest.raises(RuntimeError, match="h0: expected shape"):
        fused.run_pass(spec.cell(0), x(), torch.zeros(B + 1, H), c0, w, None, False, PassMasks())
