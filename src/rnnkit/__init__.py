"""rnnkit: every LSTM / GRU / RNN variant behind one API, with one packed weight buffer.

    >>> import torch, rnnkit
    >>> lstm = rnnkit.LSTM(8, 16, num_layers=2, peephole=True, layer_norm=True)
    >>> y, (h_n, c_n) = lstm(torch.randn(5, 3, 8))

See docs/spec.md for the equations and README.md for the tour.
"""
from .backend import BackendUnavailableError, backends
from .errors import DTypeMismatchError, MismatchError
from .functional import backward_data, backward_weights, detach_state, forward_inference, forward_training, rnn
from .nn import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNCell
from .params import Layout, PassWeights
from . import quantized
from .quantized import quantize
from .spec import CellSpec, RNNSpec

from .interop.onnx_ops import install as _install_onnx_translations

_install_onnx_translations()  # torch.onnx.export of models with rnnkit layers (imports nothing now)

__version__ = "0.1.0"

__all__ = [
    "LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell",
    "RNNSpec", "CellSpec", "Layout", "PassWeights",
    "rnn", "forward_training", "forward_inference", "backward_data", "backward_weights", "detach_state",
    "backends", "BackendUnavailableError", "MismatchError", "DTypeMismatchError", "quantize", "quantized",
]
