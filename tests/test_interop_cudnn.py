"""cuDNN canonical matrices: round trip, and the (pseudoLayer, linLayerID) addressing.

No GPU here, so cuDNN itself is not called: the addressing is checked against torch.nn's
parameters, which PyTorch copies into cuDNN's weight space with the same IDs (gate
order i f g o / r z n, projection at linLayerID 8). That PyTorch's CUDA path agrees is
PyTorch's claim, not proven here.
"""
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
