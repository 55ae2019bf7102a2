"""Flax linen (jax on CPU): parameter trees moved both ways give the same outputs and final states.

float64 runs switch jax's x64 mode on (jax.enable_x64) and build the cells with
param_dtype float64, so Flax computes them in float64.

Flax's output past a sequence's length is not defined to be zero, so with lengths only
the valid steps are compared (and the final carries, which Flax takes at each length).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn

import rnnkit
from rnnkit.interop import flax as rflax

from helpers import assert_close

B, T, I = 3, 5, 4

CONFIGS = {
    "lstm-2layer-bidir": (lambda: rnnkit.LSTM(I, 6, num_layers=2, bidirectional=True, batch_first=True),
                          lambda h: nn.LSTMCell(h), "lstm"),
    "optimized-lstm-single_input": (lambda: rnnkit.LSTM(I, 5, bias_mode="single_input", batch_first=True),
                                    lambda h: nn.OptimizedLSTMCell(h), "lstm"),
    "gru-bidir-sum": (lambda: rnnkit.GRU(I, 6, bidirectional=True, merge="sum", batch_first=True),
                      lambda h: nn.GRUCell(h), "gru"),
    "simplecell-relu-2layer": (lambda: rnnkit.RNN(I, 5, num_layers=2, nonlinearity="relu", batch_first=True),
                               lambda h: nn.SimpleCell(h, activation_fn=nn.relu), "rnn_relu"),
}


def _flax_layer(make_cell, hidden, bidirectional, merge):
    float_type = jnp.result_type(float)  # float64 under jax.enable_x64, else float32
    cell = make_cell
    make_cell = lambda h: cell(h).clone(param_dtype=float_type)  # noqa: E731 (the carry's dtype too)
    if not bidirectional:
        return nn.RNN(make_cell(hidden), return_carry=True)
    merge_fn = (lambda a, b: a + b) if merge == "sum" else (lambda a, b: jnp.concatenate([a, b], -1))
    return nn.Bidirectional(nn.RNN(make_cell(hidden)), nn.RNN(make_cell(hidden), reverse=True, keep_order=True),
                            merge_fn=merge_fn, return_carry=True)


def _flax_stack(spec, make_cell):
    """The stack in Flax as one jitted function (params, x, lengths) -> (y, last carry)."""

    @jax.jit
    def run(params, x, lengths):
        out, carry = x, None
        for k, tree in enumerate(params):
            layer = _flax_layer(make_cell, spec.hidden_sizes[k], spec.bidirectional, spec.merge)
            carry, out = layer.apply({"params": tree}, out, seq_lengths=lengths)
        return out, carry

    return lambda params, x, lengths: (lambda y, carry: (torch.from_numpy(np.array(y)), carry))(
        *run(params, jnp.asarray(x), jnp.asarray(lengths)))


def _random_flax_params(spec, make_cell, dtype=np.float32):
    """Random values in Flax's own parameter tree (its structure from ``init``, traced only)."""
    params, features, rng = [], I, np.random.default_rng(0)
    for k in range(spec.num_layers):
        layer = _flax_layer(make_cell, spec.hidden_sizes[k], spec.bidirectional, spec.merge)
        shapes = jax.eval_shape(layer.init, jax.random.key(k), jnp.zeros((1, 1, features)))["params"]
        params.append(jax.tree_util.tree_map(lambda s: rng.uniform(-0.5, 0.5, s.shape).astype(dtype), shapes))
        features = spec.merged_size(k)
    return params


def _carry_to_torch(spec, carry):
    """Flax's last-layer carry -> rnnkit's last-layer h (and c), shaped (D, B, ·)."""
    directions = carry if spec.bidirectional else (carry,)
    if spec.mode == "lstm":  # carry (c, h)
        return [torch.from_numpy(np.stack([np.asarray(d[i]) for d in directions])) for i in (1, 0)]
    return [torch.from_numpy(np.stack([np.asarray(d) for d in directions]))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_both_directions(name, dtype):
    with jax.enable_x64(dtype == torch.float64):  # jax computes in float64 only with x64 on
        _both_directions(name, dtype)


def _both_directions(name, dtype):
    make_module, make_cell, mode = CONFIGS[name]
    module = make_module().to(dtype).eval()
    spec = module.spec
    x = torch.randn(B, T, I, dtype=dtype)
    lengths = torch.tensor([T, 2, 4])
    keep = (torch.arange(T)[None, :] < lengths[:, None])[:, :, None].to(dtype)
    D = spec.num_directions

    run_flax = _flax_stack(spec, make_cell)
    y_flax, carry = run_flax(rflax.to_flax(module), x.numpy(), lengths.numpy())
    with torch.no_grad():
        y, hy = module(x, lengths=lengths)
    states = list(hy) if isinstance(hy, tuple) else [hy]
    assert_close(y_flax * keep, y, f"{name} y")
    assert_close(_carry_to_torch(spec, carry), [s[-D:] for s in states], f"{name} carry")

    params = _random_flax_params(spec, make_cell, x.numpy().dtype)
    back = rflax.from_flax(params, mode, merge=spec.merge, dtype=dtype).eval()
    y_flax2, _ = run_flax(params, x.numpy(), lengths.numpy())
    with torch.no_grad():
        y2, _ = back(x, lengths=lengths)
    assert_close(y_flax2 * keep, y2, f"{name} y (imported)")


@pytest.mark.parametrize("module, option", [
    (lambda: rnnkit.GRU(I, 6, reset_after=False), "reset_after=False"),
    (lambda: rnnkit.LSTM(I, 6, peephole=True), "peephole"),
    (lambda: rnnkit.LSTM(I, 6, proj_size=2), "proj_size"),
], ids=["reset_before", "peephole", "proj_size"])
def test_refuses_what_flax_cannot_represent(module, option):
    with pytest.raises(ValueError, match=option):
        rflax.to_flax(module())


def _extra_bias(tree, dense):
    tree[0]["cell"][dense]["bias"] = np.ones(6, np.float32)


def _extra_dense(tree, _):
    tree[0]["Dense_0"] = {"kernel": np.ones((6, 6), np.float32), "bias": np.ones(6, np.float32)}


@pytest.mark.parametrize("module, mode, change, dense, message", [
    (lambda: rnnkit.GRU(I, 6), "gru", _extra_bias, "hr", r"params\[0\]/cell/hr: expected the keys \['kernel'\]; "
     r"unexpected \['bias'\]$"),
    (lambda: rnnkit.GRU(I, 6), "gru", _extra_bias, "hz", r"params\[0\]/cell/hz: .* unexpected \['bias'\]"),
    (lambda: rnnkit.LSTM(I, 6), "lstm", _extra_bias, "ii", r"params\[0\]/cell/ii: .* unexpected \['bias'\]"),
    (lambda: rnnkit.RNN(I, 6), "rnn_tanh", _extra_dense, None, r"params\[0\]: expected the keys \['cell'\]; "
     r"unexpected \['Dense_0'\]$"),
], ids=["gru-hr-bias", "gru-hz-bias", "lstm-ii-bias", "extra-dense"])
def test_parameters_the_cell_does_not_have_are_refused(module, mode, change, dense, message):
    """Review finding 7: these were dropped without a word; Flax would add them, so the module
    computed something else. Now refused, listing the unexpected keys (as Haste and MXNet do)."""
    tree = rflax.to_flax(module())
    change(tree, dense)
    with pytest.raises(ValueError, match=message):
        rflax.from_flax(tree, mode)


def test_params_that_are_not_a_list_of_like_layers_are_refused():
    """Review finding 13: 'string indices must be integers' and KeyError 'forward_rnn' before."""
    one = rflax.to_flax(rnnkit.LSTM(I, 6))
    with pytest.raises(TypeError, match=r"params: expected a list with one parameter tree per layer .* got dict; "
                                        r"wrap a single layer's tree in a list"):
        rflax.from_flax(one[0], "lstm")
    bidirectional = rflax.to_flax(rnnkit.LSTM(I, 6, bidirectional=True))
    with pytest.raises(ValueError, match=r"params\[1\]: layer 0 is bidirectional \(forward_rnn, backward_rnn\) but "
                                         r"layer 1 is unidirectional \(cell\)"):
        rflax.from_flax(bidirectional + rflax.to_flax(rnnkit.LSTM(12, 6)), "lstm")
    with pytest.raises(ValueError, match="params: expected one parameter tree per layer, got an empty list"):
        rflax.from_flax([], "lstm")
    with pytest.raises(ValueError, match=r"params\[0\]/cell: expected the keys .*; missing \['hn', 'hr', 'hz', "
                                         r"'in', 'ir', 'iz'\]"):
        rflax.from_flax(one, "gru")
    two = rflax.to_flax(rnnkit.LSTM(I, 6, num_layers=2))
    two[1]["cell"]["ii"]["kernel"] = np.ones((I, 6), np.float32)
    with pytest.raises(ValueError, match=r"params\[1\]/cell/ii/kernel: expected shape \(6, 6\) .* got \(4, 6\)"):
        rflax.from_flax(two, "lstm")
    assert rflax.from_flax([{"params": one[0]}], "lstm").spec.hidden_sizes == (6,)


def test_bfloat16_exports_float32_and_imports_exactly():
    """Review finding 16: numpy has no bfloat16, so to_flax gives float32 arrays (exact); jax
    bfloat16 parameters import through float32 (torch cannot read ml_dtypes' bfloat16)."""
    module = rnnkit.LSTM(I, 6, num_layers=2, bidirectional=True).to(torch.bfloat16)
    tree = rflax.to_flax(module)
    assert all(a.dtype == np.float32 for a in jax.tree_util.tree_leaves(tree))
    as_bf16 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), tree)
    back = rflax.from_flax(as_bf16, "lstm", dtype=torch.bfloat16)
    assert torch.equal(back.flat_weights, rflax.from_flax(tree, "lstm", dtype=torch.bfloat16).flat_weights)
    assert back.flat_weights.dtype == torch.bfloat16
