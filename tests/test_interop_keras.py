"""Keras 3 (torch backend): weights moved both ways give the same outputs and final states.

Keras is batch-first; masked steps (lengths) are compared on the valid steps only, since
a unidirectional Keras layer repeats its last output there where rnnkit writes zeros.
Keras 3.15.1 on the torch backend does not compute float64 layers in float64: its
``keras.ops.matmul`` returns float32 for float64 operands (test_keras_torch_matmul_is_float32),
and its generic RNN loop (SimpleRNN, GRU reset_after=False, every masked layer) uses it.
So float64 runs (full sequences) are held to the float32 tolerance: they check that
float64 weights move both ways, not Keras's float64 arithmetic.
"""
import os

import numpy as np

os.environ["KERAS_BACKEND"] = "torch"  # before keras is imported anywhere

import keras  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import rnnkit  # noqa: E402
from rnnkit.interop import keras as rkeras  # noqa: E402

from helpers import TOLERANCE, assert_close, rel_rms  # noqa: E402

# Keras's torch backend converts with np.array(x, copy=False) internally (numpy 2 deprecation)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

B, T, I = 3, 5, 4

CONFIGS = {
    "lstm": dict(mode="lstm", hidden=6),
    "lstm-2layer-bidir": dict(mode="lstm", hidden=6, num_layers=2, bidirectional=True),
    "lstm-no-bias": dict(mode="lstm", hidden=5, bias=False),
    "lstm-per-layer-sizes": dict(mode="lstm", hidden=[6, 3], num_layers=2),
    "gru-reset_after": dict(mode="gru", hidden=6, bidirectional=True, merge="sum"),
    "gru-reset_before-2layer": dict(mode="gru", hidden=5, num_layers=2, reset_after=False),
    "gru-single_recurrent": dict(mode="gru", hidden=5, bias_mode="single_recurrent"),
    "simplernn-relu-bidir": dict(mode="rnn_relu", hidden=6, bidirectional=True),
    "simplernn-tanh": dict(mode="rnn_tanh", hidden=6),
}


def _rnnkit_module(c, dtype=torch.float32):
    kwargs = dict(num_layers=c.get("num_layers", 1), bidirectional=c.get("bidirectional", False),
                  merge=c.get("merge", "concat"), batch_first=True, bias=c.get("bias", True), dtype=dtype)
    if "bias_mode" in c:
        kwargs["bias_mode"] = c["bias_mode"]
    if c["mode"] == "lstm":
        return rnnkit.LSTM(I, c["hidden"], **kwargs)
    if c["mode"] == "gru":
        return rnnkit.GRU(I, c["hidden"], reset_after=c.get("reset_after", True), **kwargs)
    return rnnkit.RNN(I, c["hidden"], nonlinearity=c["mode"][4:], **kwargs)


def _keras_layers(c, dtype="float32"):
    layers, hidden = [], c["hidden"] if isinstance(c["hidden"], list) else [c["hidden"]] * c.get("num_layers", 1)
    for units in hidden:
        common = dict(units=units, return_sequences=True, return_state=True, use_bias=c.get("bias", True), dtype=dtype)
        if c["mode"] == "lstm":
            layer = keras.layers.LSTM(**common)
        elif c["mode"] == "gru":
            layer = keras.layers.GRU(reset_after=c.get("reset_after", True), **common)
        else:
            layer = keras.layers.SimpleRNN(activation=c["mode"][4:], **common)
        if c.get("bidirectional"):
            layer = keras.layers.Bidirectional(layer, merge_mode=c.get("merge", "concat"), dtype=dtype)
        layers.append(layer)
    return layers


def _run_keras(layers, x, mask):
    """-> (y, final states of the last layer) as torch tensors."""
    out = x
    for layer in layers:
        result = layer(out, mask=mask)
        out, states = result[0], result[1:]
    to_torch = lambda t: torch.as_tensor(keras.ops.convert_to_numpy(t))  # noqa: E731
    return to_torch(out), [to_torch(s) for s in states]


def _last_layer_states(module, hy, c):
    """rnnkit's final states of the last layer, in Keras's return_state order."""
    spec = module.spec
    if spec.mode == "lstm":
        h, cs = hy
        h, cs = (h[-1], cs[-1]) if spec.per_layer else (h[-spec.num_directions:], cs[-spec.num_directions:])
        pairs = [(h[d], cs[d]) for d in range(spec.num_directions)]
        return [t for pair in pairs for t in pair]
    h = hy[-1] if spec.per_layer else hy[-spec.num_directions:]
    return [h[d] for d in range(spec.num_directions)]


@pytest.mark.parametrize("with_lengths, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.float64)],
                         ids=["full-f32", "lengths-f32", "full-f64"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_both_directions(name, with_lengths, dtype):
    c = CONFIGS[name]
    keras_dtype = str(dtype).split(".")[1]
    x = torch.randn(B, T, I, dtype=dtype)
    lengths = torch.tensor([T, 2, 4]) if with_lengths else None
    valid = (torch.arange(T)[None, :] < (lengths if with_lengths else torch.full((B,), T))[:, None])
    mask = valid.numpy() if with_lengths else None

    # rnnkit -> Keras
    module = _rnnkit_module(c, dtype).eval()
    layers = _keras_layers(c, keras_dtype)
    _run_keras(layers, x.numpy(), mask)  # builds the layers
    rkeras.set_keras_weights(module, layers)
    y_keras, states_keras = _run_keras(layers, x.numpy(), mask)
    with torch.no_grad():
        y, hy = module(x, lengths=lengths)
    keep = valid[:, :, None].to(dtype)
    tol = TOLERANCE[torch.float32]  # Keras's own precision in float64 too (module docstring)
    assert_close(y_keras * keep, y, f"{name} y", tol=tol)
    assert_close(states_keras, _last_layer_states(module, hy, c), f"{name} states", tol=tol)

    # Keras -> rnnkit
    layers2 = _keras_layers(c, keras_dtype)
    _run_keras(layers2, x.numpy(), mask)
    back = rkeras.from_keras_layers(layers2, dtype=dtype).eval()
    y_keras2, _ = _run_keras(layers2, x.numpy(), mask)
    with torch.no_grad():
        y2, _ = back(x, lengths=lengths)
    assert_close(y_keras2 * keep, y2, f"{name} y (imported)", tol=tol)


def test_weight_lists_round_trip_and_shapes():
    module = rnnkit.GRU(I, 6, num_layers=2, bidirectional=True)
    weights = rkeras.to_keras(module)
    assert [w.shape for w in weights[1]] == [(12, 18), (6, 18), (2, 18)] * 2
    back = rkeras.from_keras(weights, "gru", bidirectional=True)
    assert_close(back.flat_weights.detach(), module.flat_weights.detach(), "flat")


@pytest.mark.parametrize("module, option", [
    (lambda: rnnkit.LSTM(I, 6, proj_size=3), "proj_size"),
    (lambda: rnnkit.LSTM(I, 6, peephole=True), "peephole"),
    (lambda: rnnkit.LSTM(I, 6, coupled_gates=True), "coupled_gates"),
    (lambda: rnnkit.LSTM(I, 6, cell_clip=1.0), "cell_clip"),
    (lambda: rnnkit.GRU(I, 6, layer_norm=True), "layer_norm"),
], ids=["proj_size", "peephole", "coupled", "cell_clip", "layer_norm"])
def test_refuses_what_keras_cannot_represent(module, option):
    with pytest.raises(ValueError, match=option):
        rkeras.to_keras(module())


def test_layer_mismatch_is_named():
    module = rnnkit.GRU(I, 6, reset_after=False)
    layer = keras.layers.GRU(6, reset_after=True)
    layer.build((None, T, I))
    with pytest.raises(ValueError, match="reset_after"):
        rkeras.set_keras_weights(module, [layer])
    assert rkeras.to_keras(module)[0][2].shape == (18,)  # one bias: b_W + b_R


def _built(layer, dtype="float64"):
    layer(keras.ops.convert_to_tensor(torch.zeros(B, T, I, dtype=getattr(torch, dtype)).numpy()))
    return layer


def test_go_backwards_is_refused_with_its_reason():
    """Finding 4: go_backwards=True returns the outputs in reversed time order (Keras's own
    run shows it below), which no rnnkit module computes: refused, naming go_backwards."""
    layer = _built(keras.layers.LSTM(6, return_sequences=True, go_backwards=True, dtype="float64"))
    with pytest.raises(ValueError, match=r"go_backwards: layers\[0\] has go_backwards=True; .* reversed time order"):
        rkeras.from_keras_layers([layer])
    module = rkeras.from_keras([layer.get_weights()], "lstm", batch_first=True, dtype=torch.float64).eval()
    with pytest.raises(ValueError, match="go_backwards"):
        rkeras.set_keras_weights(module, [layer])
    x = torch.randn(B, T, I, dtype=torch.float64)
    y_keras = torch.as_tensor(keras.ops.convert_to_numpy(layer(x.numpy())))
    with torch.no_grad():
        y_flipped, _ = module(x.flip(1))  # the message's claim: the module on the time-reversed input
        y, _ = module(x)
    assert_close(y_flipped, y_keras, "y on the reversed input")
    assert (y - y_keras).abs().max() > 0.1


def test_go_backwards_forward_layer_of_bidirectional_is_refused():
    forward = keras.layers.GRU(5, return_sequences=True, go_backwards=True, dtype="float64")
    backward = keras.layers.GRU(5, return_sequences=True, dtype="float64")
    layer = _built(keras.layers.Bidirectional(forward, backward_layer=backward, dtype="float64"))
    with pytest.raises(ValueError, match=r"go_backwards: layers\[0\].forward_layer has go_backwards=True"):
        rkeras.from_keras_layers([layer])


def test_keras_torch_matmul_is_float32():
    """Why float64 runs use float32's tolerance: Keras's matmul rounds float64 operands to float32."""
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    product = keras.ops.convert_to_numpy(keras.ops.matmul(a, b))
    assert str(product.dtype) == "float32"
    assert TOLERANCE[torch.float64] < rel_rms(torch.as_tensor(product), a @ b) < TOLERANCE[torch.float32]


def test_bias_mode_contradicting_use_bias_is_refused():
    """Review finding 5: bias_mode='none' with use_bias=True dropped the Keras bias; and a
    bias_mode for layers without a bias has nothing to place."""
    with_bias = rkeras.to_keras(rnnkit.LSTM(I, 6))
    with pytest.raises(ValueError, match=r"bias_mode, use_bias: bias_mode='none' would drop the Keras layers' bias "
                                         r"\(use_bias=True\)"):
        rkeras.from_keras(with_bias, "lstm", bias_mode="none")
    without = rkeras.to_keras(rnnkit.LSTM(I, 6, bias=False))
    with pytest.raises(ValueError, match=r"bias_mode, use_bias: the Keras layers have no bias \(use_bias=False\), "
                                         r"so there is none for bias_mode='double'"):
        rkeras.from_keras(without, "lstm", use_bias=False, bias_mode="double")
    assert rkeras.from_keras(without, "lstm", use_bias=False, bias_mode="none").spec.bias_mode == "none"


@pytest.mark.parametrize("module, mode, options, message", [
    (lambda: rnnkit.GRU(I, 6, reset_after=False), "gru", {},
     r"weights\[0\]\[2\]: mode='gru', reset_after=True expects a bias of shape \(2, 18\), got \(18,\), "
     r"the bias of a Keras GRU with reset_after=False"),
    (lambda: rnnkit.GRU(I, 6), "gru", dict(reset_after=False),
     r"weights\[0\]\[2\]: mode='gru', reset_after=False expects a bias of shape \(18,\), got \(2, 18\), "
     r"the bias of a Keras GRU with reset_after=True"),
    (lambda: rnnkit.LSTM(I, 6), "gru", {},
     r"weights\[0\]\[1\]: mode='gru' expects a recurrent_kernel of shape \(H, 3·H\) = \(6, 18\), got \(6, 24\), "
     r"which holds 4 gate blocks of 6 units \(a Keras LSTM\)"),
    (lambda: rnnkit.GRU(I, 6, bidirectional=True), "lstm", dict(bidirectional=True),
     r"weights\[0\]\[1\]: mode='lstm' expects a recurrent_kernel of shape \(H, 4·H\) = \(6, 24\), got \(6, 18\), "
     r"which holds 3 gate blocks of 6 units \(a Keras GRU\)"),
    (lambda: rnnkit.RNN(I, 6), "gru", {}, r"got \(6, 6\), which holds 1 gate block of 6 units \(a Keras SimpleRNN\)"),
    (lambda: rnnkit.LSTM(I, 6, bidirectional=True), "lstm", {},
     r"weights\[0\]: expected 3 arrays .* got 6, which is a layer with bidirectional=True, use_bias=True"),
    (lambda: rnnkit.LSTM(I, 6, num_layers=2, bidirectional=True), "lstm", dict(bidirectional=True, merge="sum"),
     r"weights\[1\]\[0\]: expected a kernel of shape \(6, 24\), got \(12, 24\); layer 0's outputs have 6 features"),
], ids=["gru-reset_before-read-as-after", "gru-reset_after-read-as-before", "lstm-as-gru", "gru-as-lstm",
        "simplernn-as-gru", "bidirectional-as-one", "concat-read-as-sum"])
def test_weights_that_are_not_the_mode_say_what_they_are(module, mode, options, message):
    """Review finding 12: an IndexError or 'regate: ... is not 3 gate blocks' before; now the
    array is named, with what mode and options expect and what its shape implies."""
    with pytest.raises(ValueError, match=message):
        rkeras.from_keras(rkeras.to_keras(module()), mode, **options)


def test_weights_not_one_list_per_layer_are_refused():
    with pytest.raises(ValueError, match="weights: expected one list of arrays per layer, got an empty list"):
        rkeras.from_keras([], "lstm")
    one_layer = rkeras.to_keras(rnnkit.LSTM(I, 6))[0]
    with pytest.raises(TypeError, match=r"weights\[0\]: expected one layer's list of arrays .* got ndarray"):
        rkeras.from_keras(one_layer, "lstm")


def test_bfloat16_exports_float32_and_imports_exactly():
    """Review finding 16: numpy has no bfloat16, so to_keras gives float32 arrays (exact);
    bfloat16 arrays (ml_dtypes', as Keras's jax backend returns them) import through float32."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    module = rnnkit.GRU(I, 6, num_layers=2, bidirectional=True).to(torch.bfloat16)
    weights = rkeras.to_keras(module)
    assert all(a.dtype == "float32" for layer in weights for a in layer)
    as_bf16 = [[a.astype(ml_dtypes.bfloat16) for a in layer] for layer in weights]
    back = rkeras.from_keras(as_bf16, "gru", bidirectional=True, dtype=torch.bfloat16)
    assert torch.equal(back.flat_weights, module.flat_weights)


def test_what_keras_computes_otherwise_is_refused_before_anything_is_written():
    """Keras layers whose activations only share a name with Keras's own (a scaled tanh of the
    user's, a relu with max_value), a stateful layer (its state carried from call to call) or an
    unbuilt one (no weights) are refused by name; and set_keras_weights checks every layer before
    it writes any."""
    import functools

    def tanh(v):  # LeCun's scaled tanh, named as Keras's
        return 1.7159 * keras.ops.tanh(2 / 3 * v)

    x = np.zeros((1, 2, 4), np.float32)
    for activation, words in ((tanh, "not one of keras.activations' own functions"),
                              (functools.partial(keras.activations.relu, max_value=1.0), "partial")):
        layer = keras.layers.SimpleRNN(6, activation=activation)
        layer(x)
        with pytest.raises(ValueError, match=f"activation: layers\\[0\\] uses .*{words}"):
            rkeras.from_keras_layers([layer])
    stateful = keras.layers.LSTM(6, stateful=True)
    stateful(np.ones((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match="stateful: layers\\[0\\] has stateful=True"):
        rkeras.from_keras_layers([stateful])
    with pytest.raises(ValueError, match="layers\\[0\\]: the Keras layer is not built"):
        rkeras.from_keras_layers([keras.layers.GRU(6)])
    module = rnnkit.LSTM(4, 6, 2)
    first, second = keras.layers.LSTM(6, return_sequences=True), keras.layers.LSTM(6, activation="relu")
    second(first(x))
    before = [w.copy() for w in first.get_weights()]
    with pytest.raises(ValueError, match="activation: layers\\[1\\] uses relu"):
        rkeras.set_keras_weights(module, [first, second])
    assert all(np.array_equal(a, b) for a, b in zip(before, first.get_weights()))
