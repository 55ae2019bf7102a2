"""Converters between rnnkit modules and other libraries' weight formats, one module per format.

    cudnn   cuDNN canonical (pseudoLayer, linLayerID) matrices and biases
    onnx    ONNX LSTM / GRU / RNN: export a runnable model, import one
    keras   Keras 3 LSTM, GRU, SimpleRNN (and Bidirectional) weight lists
    flax    Flax linen LSTMCell / OptimizedLSTMCell / GRUCell / SimpleCell parameter trees
    tf      TensorFlow 1.x LSTMCell (peepholes, projection, clips, forget_bias) and CudnnLSTM/GRU
    mxnet   MXNet fused RNN flat parameter vector and Gluon parameter names
    haste   Haste LSTM, GRU and LayerNormLSTM weights

Every converter refuses, with a ValueError naming the option, a module option its format
cannot represent. Gate orders are SPEC.md's table "Gate orders elsewhere"; the third-party
library a format belongs to is imported only when a function needs it.
"""
from . import cudnn, flax, haste, keras, mxnet, onnx, tf  # noqa: F401

__all__ = ["cudnn", "flax", "haste", "keras", "mxnet", "onnx", "tf"]
