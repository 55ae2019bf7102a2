"""cuDNN canonical matrices: round trip, and the (pseudoLayer, linLayerID) addressing.

No GPU here, so cuDNN itself is not called: the addressing is checked against torch.nn's
parameters, which PyTorch copies into cuDNN's weight space with the same IDs (gate
order i f g o / r z n, projection at linLayerID 8). That PyTorch's CUDA path agrees is
PyTorch's claim, not proven here.
"""
import re

import pytest
import torch

import rnnkit
from rnnkit.interop import cudnn

from helpers import assert_close

CONFIGS = {
    "lstm-2layer-bidir-proj": lambda: rnnkit.LSTM(3, 6, num_layers=2, bidirectional=True, proj_size=4),
    "lstm-cell_clip-single_input": lambda: rnnkit.LSTM(3, 5, cell_clip=0.5, bias_mode="single_input"),
    "gru-bidir-single_recurrent": lambda: rnnkit.GRU(3, 5, bidirectional=True, bias_mode="single_recurrent"),
    "rnn-relu-no-bias": lambda: rnnkit.RNN(3, 5, num_layers=2, nonlinearity="relu", bias=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip(name):
    module = CONFIGS[name]().eval()
    params = cudnn.to_cudnn(module)
    back = cudnn.from_cudnn(params).eval()
    assert back.spec == module.spec
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "flat")
    x = torch.randn(4, 2, 3)
    with torch.no_grad():
        assert_close(back(x)[0], module(x)[0], "y")


def test_lin_layer_ids_match_torch_nn():
    H, P = 6, 4
    reference = torch.nn.LSTM(3, H, num_layers=2, bidirectional=True, proj_size=P)
    module = rnnkit.LSTM(3, H, num_layers=2, bidirectional=True, proj_size=P)
    module.load_state_dict(reference.state_dict())
    params = cudnn.to_cudnn(module)
    assert params["config"]["cellMode"] == "CUDNN_LSTM" and params["config"]["projSize"] == P
    pseudo = 1 * 2 + 1  # layer 1, reverse
    w_hh = reference.weight_hh_l1_reverse.detach()
    for gate, lin_id in (("i", 4), ("f", 5), ("g", 6), ("o", 7)):
        k = "ifgo".index(gate)
        assert torch.equal(params["matrices"][(pseudo, lin_id)], w_hh[k * H : (k + 1) * H])
    assert torch.equal(params["biases"][(pseudo, 1)], reference.bias_ih_l1_reverse.detach()[H : 2 * H])
    assert torch.equal(params["matrices"][(pseudo, 8)], reference.weight_hr_l1_reverse.detach())
    assert (pseudo, 8) not in params["biases"]


@pytest.mark.parametrize("module, option", [
    (lambda: rnnkit.LSTM(3, 5, peephole=True), "peephole"),
    (lambda: rnnkit.LSTM(3, 5, coupled_gates=True), "coupled_gates"),
    (lambda: rnnkit.GRU(3, 5, reset_after=False), "reset_after=False"),
    (lambda: rnnkit.GRU(3, 5, bidirectional=True, merge="sum"), "merge='sum'"),
    (lambda: rnnkit.RNN(3, [5, 4], num_layers=2), "per-layer sizes"),
    (lambda: rnnkit.LSTM(3, 5, layer_norm=True), "layer_norm"),
], ids=["peephole", "coupled", "reset_before", "sum", "per-layer", "layer_norm"])
def test_refuses_what_cudnn_cannot_represent(module, option):
    with pytest.raises(ValueError, match=option.replace("(", r"\(")):
        cudnn.to_cudnn(module())


def _bidirectional_gru_params():
    return cudnn.to_cudnn(rnnkit.GRU(3, 5, bidirectional=True))


def test_cudnn_enum_values_read_as_their_names():
    """A config filled from cuDNN holds cudnn.h's integers: dirMode=1 is CUDNN_BIDIRECTIONAL."""
    module = rnnkit.LSTM(3, 5, num_layers=2, bidirectional=True, bias_mode="single_input").eval()
    params = cudnn.to_cudnn(module)
    params["config"].update(cellMode=2, biasMode=1, dirMode=1, inputMode=0)
    back = cudnn.from_cudnn(params)
    assert back.spec == module.spec
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "flat")


@pytest.mark.parametrize("field, value, message", [
    ("dirMode", "bidirectional", r"config\['dirMode'\]: expected one of 'CUDNN_UNIDIRECTIONAL' \(0\), "
                                 r"'CUDNN_BIDIRECTIONAL' \(1\), got 'bidirectional'"),
    ("dirMode", 2, r"config\['dirMode'\]: expected one of .* got 2"),
    ("dirMode", True, r"config\['dirMode'\]: expected one of .* got True"),
    ("inputMode", "CUDNN_SKIP_INPUT",
     r"config\['inputMode'\]: expected 'CUDNN_LINEAR_INPUT' \(0\), got 'CUDNN_SKIP_INPUT'"),
    ("projSize", 3, r"config\['projSize'\]: expected hiddenSize \(5\): only CUDNN_LSTM projects, got 3"),
    ("cellClip", 0.5, r"config\['cellClip'\]: expected None: cuDNN clips only CUDNN_LSTM cells, got 0.5"),
    ("numLayers", 1.0, r"config\['numLayers'\]: expected a positive integer, got 1.0"),
    ("dataType", "CUDNN_DATA_FLOAT", r"config: expected the keys .*; unexpected \['dataType'\]"),
], ids=["dirMode-word", "dirMode-2", "dirMode-bool", "skip-input", "gru-projSize", "gru-cellClip", "numLayers-float",
        "dataType"])
def test_config_fields_are_validated(field, value, message):
    params = _bidirectional_gru_params()
    params["config"][field] = value
    with pytest.raises(ValueError, match=message):
        cudnn.from_cudnn(params)


def test_lstm_config_values_are_validated():
    params = cudnn.to_cudnn(rnnkit.LSTM(3, 5, proj_size=2))
    with pytest.raises(ValueError, match=r"config\['projSize'\]: expected at most hiddenSize \(5\), got 6"):
        cudnn.from_cudnn({**params, "config": {**params["config"], "projSize": 6}})
    with pytest.raises(ValueError, match=r"config\['cellClip'\]: expected a positive float or None, got -1.0"):
        cudnn.from_cudnn({**params, "config": {**params["config"], "cellClip": -1.0}})


@pytest.mark.parametrize("module, table, key, value", [
    (lambda: rnnkit.LSTM(3, 5, bias_mode="single_input"), "biases", (0, 4), torch.ones(5)),
    (lambda: rnnkit.GRU(3, 5, bias_mode="none"), "biases", (0, 0), torch.zeros(5)),
    (lambda: rnnkit.LSTM(3, 5, num_layers=2), "matrices", (2, 0), torch.ones(5, 5)),
    (lambda: rnnkit.LSTM(3, 5), "matrices", (0, 8), torch.ones(3, 5)),
], ids=["recurrent-bias-under-single_input", "bias-under-none", "extra-pseudo-layer", "projection-without-projSize"])
def test_entries_the_config_does_not_use_are_refused(module, table, key, value):
    params = cudnn.to_cudnn(module())
    params[table][key] = value
    message = rf"{table} \(for the config\): expected the \(pseudoLayer, linLayerID\) entries .*; unexpected \[{re.escape(str(key))}\]"
    with pytest.raises(ValueError, match=message):
        cudnn.from_cudnn(params)


def _without(mapping, key):
    return {k: v for k, v in mapping.items() if k != key}


@pytest.mark.parametrize("edit, error, message", [
    (lambda p: _without(p, "config"), ValueError, r"params: expected the keys .*; missing \['config'\]"),
    (lambda p: {**p, "config": _without(_without(p["config"], "inputSize"), "hiddenSize")}, ValueError,
     r"config: expected the keys .*; missing \['inputSize', 'hiddenSize'\]"),
    (lambda p: {**p, "matrices": _without(p["matrices"], (1, 8))}, ValueError,
     r"matrices \(for the config\): expected .*; missing \[\(1, 8\)\]"),
    (lambda p: {**p, "matrices": {**p["matrices"], (1, 4): torch.ones(5, 5)}}, ValueError,
     r"matrices\[\(1, 4\)\]: expected shape \(5, 2\), got \(5, 5\)"),
    (lambda p: [p], TypeError, r"params: expected a mapping"),
], ids=["no-config", "no-sizes", "no-projection", "wrong-shape", "not-a-mapping"])
def test_missing_or_malformed_parts_are_named(edit, error, message):
    params = cudnn.to_cudnn(rnnkit.LSTM(3, 5, num_layers=2, proj_size=2))
    with pytest.raises(error, match=message):
        cudnn.from_cudnn(edit(params))


def test_bfloat16_modules_export_bfloat16_tensors():
    module = rnnkit.LSTM(3, 5, proj_size=2).to(torch.bfloat16)
    params = cudnn.to_cudnn(module)
    assert all(t.dtype == torch.bfloat16 for t in [*params["matrices"].values(), *params["biases"].values()])
    back = cudnn.from_cudnn(params, dtype=torch.bfloat16)
    assert torch.equal(back.flat_weights, module.flat_weights)
