"""Converters between rnnkit modules and other libraries' weight formats, one module per format.

    cudnn   cuDNN canonical (pseudoLayer, linLayerID) matrices and biases
    onnx    ONNX LSTM / GRU / RNN: export a runnable model, import one
    keras   Keras 3 LSTM, GRU, SimpleRNN (and Bidirectional) weight lists
    flax    Flax linen LSTMCell / OptimizedLSTMCell / GRUCell / SimpleCell parameter trees
    tf      TensorFlow 1.x LSTMCell / BasicLSTMCell (peepholes, projection, clips, forget_bias),
            GRUCell, and CudnnLSTM/GRU canonical weights
    mxnet   MXNet fused RNN flat parameter vector and Gluon 1.x parameter names
    haste   Haste LSTM, GRU, LayerNormLSTM and LayerNormGRU weights (with zoneout)

Every converter refuses, with a ValueError naming the option, a module option its format
cannot represent. Gate orders are docs/spec.md's table "Gate orders elsewhere"; the third-party
library a format belongs to is imported only when a function needs it. The tests check
each format against the real library: live (onnxruntime, Keras, Flax) or through
tests/fixtures/interop/, whose README says which library and version made each file.
"""
from . import cudnn, flax, haste, keras, mxnet, onnx, tf  # noqa: F401

__all__ = ["cudnn", "flax", "haste", "keras", "mxnet", "onnx", "tf"]
