"""The cuDNN-style calls: forward_training + backward_data + backward_weights equal autograd
through the module; accumulate semantics; reserve lifecycle; forward_inference; the arguments
the calls (and rnnkit.rnn) refuse or take: PackedSequence, inference mode, spec, layout."""
from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import rnnkit
from helpers import assert_close, flatten, map_tree, packed

T, B, I, H = 5, 3, 4, 6
DT = torch.float64
REF = "reference"


def _states(module, batch=B, unbatched=False):
    spec = module.spec
    L, D = spec.num_layers, spec.num_directions
    shape = (lambda *s: s[:1] + s[2:]) if unbatched else (lambda *s: s)
    if spec.per_layer:
        hs = [torch.randn(*shape(D, batch, spec.output_size(k)), dtype=DT) for k in range(L)]
        cs = [torch.randn(*shape(D, batch, spec.hidden_sizes[k]), dtype=DT) for k in range(L)]
        return (hs, cs) if spec.mode == "lstm" else hs
    h = torch.randn(*shape(L * D, batch, spec.output_size(0)), dtype=DT)
    c = torch.randn(*shape(L * D, batch, spec.hidden_sizes[0]), dtype=DT)
    return (h, c) if spec.mode == "lstm" else h


CASES = {
    "lstm-proj-bi-L2-hx": (lambda: rnnkit.LSTM(I, H, 2, proj_size=3, bidirectional=True, backend=REF, dtype=DT),
                           dict(hx=True)),
    "lstm-peephole-ln-no-hx": (lambda: rnnkit.LSTM(I, H, peephole=True, layer_norm=True, backend=REF, dtype=DT),
                               dict(hx=False)),
    "lstm-per_layer-sum-lengths": (lambda: rnnkit.LSTM(I, [H, 5], 2, proj_size=[3, 2], bidirectional=True,
                                                       merge="sum", backend=REF, dtype=DT),
                                   dict(hx=True, lengths=[5, 2, 4])),
    "gru-batch_first-lengths": (lambda: rnnkit.GRU(I, H, 2, batch_first=True, backend=REF, dtype=DT),
                                dict(hx=True, lengths=[3, 5, 1])),
    "gru-reset_before-per_layer": (lambda: rnnkit.GRU(I, [H, 4], 2, reset_after=False, backend=REF, dtype=DT),
                                   dict(hx=True)),
    "rnn-relu-unbatched": (lambda: rnnkit.RNN(I, H, nonlinearity="relu", backend=REF, dtype=DT),
                           dict(hx=True, unbatched=True)),
    "rnn-tanh-no-hx": (lambda: rnnkit.RNN(I, H, 2, bidirectional=True, backend=REF, dtype=DT), dict(hx=False)),
    "lstm-stochastic": (lambda: rnnkit.LSTM(I, H, 2, zoneout=(0.2, 0.3), recurrent_dropout=0.3, input_dropout=0.2,
                                            dropconnect=0.3, dropout=0.4, backend=REF, dtype=DT),
                        dict(hx=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cudnn_calls_equal_autograd_through_the_module(case):
    make, opts = CASES[case]
    module = make().train()
    with torch.no_grad():
        module.flat_weights.normal_(0, 0.4)
    spec, lstm = module.spec, module.spec.mode == "lstm"
    unbatched = opts.get("unbatched", False)
    shape = (T, I) if unbatched else ((B, T, I) if spec.batch_first else (T, B, I))
    x = torch.randn(*shape, dtype=DT)
    hx = _states(module, unbatched=unbatched) if opts["hx"] else None
    lengths = opts.get("lengths")

    torch.manual_seed(11)
    y, hy, reserve = rnnkit.forward_training(spec, module.flat_weights, x, hx, lengths, backend=REF)
    assert not y.requires_grad and not any(t.requires_grad for t in flatten(hy))

    # the module, under the same seed (the same masks), with autograd
    x_leaf = x.clone().requires_grad_(True)
    hx_leaf = map_tree(hx, lambda t: t.clone().requires_grad_(True)) if hx is not None else None
    torch.manual_seed(11)
    y_ref, hy_ref = module(x_leaf, hx_leaf, lengths)
    assert_close(y, y_ref, "y")
    assert_close(hy, hy_ref, "hy")

    dy = torch.randn_like(y)
    h_n = hy[0] if lstm else hy
    dhy = map_tree(h_n, torch.randn_like)
    dcy = map_tree(hy[1], torch.randn_like) if lstm else None
    outputs = [y_ref] + flatten(hy_ref[0] if lstm else hy_ref) + (flatten(hy_ref[1]) if lstm else [])
    upstream = [dy] + flatten(dhy) + (flatten(dcy) if lstm else [])
    weights = list(module.named_weights().values())  # buffer order
    inputs = [x_leaf] + (flatten(hx_leaf) if hx is not None else []) + weights
    grads = torch.autograd.grad(outputs, inputs, upstream)
    n = len(grads) - len(weights)

    dx, dhx, dcx = rnnkit.backward_data(reserve, dy, dhy, dcy)
    dw = rnnkit.backward_weights(reserve)
    assert_close(dx, grads[0], "dx")
    assert_close(dw, packed(grads[n:]), "dw")
    if hx is not None:
        state_grads = flatten(dhx) + (flatten(dcx) if lstm else [])
        assert_close(state_grads, list(grads[1:n]), "dhx, dcx")
    else:  # zero initial states: still returned, shaped like them
        zero = _states(module)
        assert [t.shape for t in flatten(dhx)] == [t.shape for t in flatten(zero[0] if lstm else zero)]
    assert (dcx is None) == (not lstm)


def _gru_call():
    module = rnnkit.GRU(I, H, 2, backend=REF, dtype=DT)
    x = torch.randn(T, B, I, dtype=DT)
    y, hy, reserve = rnnkit.forward_training(module.spec, module.flat_weights, x, backend=REF)
    return module, x, y, hy, reserve


def test_missing_upstream_gradients_are_zeros():
    module, x, y, hy, reserve = _gru_call()
    dy = torch.randn_like(y)
    dx, dhx, _ = rnnkit.backward_data(reserve, dy)
    x_leaf = x.clone().requires_grad_(True)
    y_ref, _ = module.train()(x_leaf)
    assert_close(dx, torch.autograd.grad(y_ref, x_leaf, dy)[0], "dx")


def test_backward_weights_accumulate_adds_and_set_overwrites():
    _, _, y, hy, reserve = _gru_call()
    rnnkit.backward_data(reserve, torch.randn_like(y), torch.randn_like(hy))
    dw = rnnkit.backward_weights(reserve)
    start = torch.randn_like(dw)

    into = start.clone()
    out = rnnkit.backward_weights(reserve, into, accumulate=True)
    assert out is into
    assert_close(into, start + dw, "accumulate=True")

    into = start.clone()
    out = rnnkit.backward_weights(reserve, into, accumulate=False)
    assert out is into
    assert torch.equal(into, dw)

    out = rnnkit.backward_weights(reserve, into, accumulate=True)  # twice into the same buffer: 2 dw
    assert_close(out, 2 * dw, "accumulate twice")
    fresh = rnnkit.backward_weights(reserve)
    assert torch.equal(fresh, dw) and fresh is not dw  # a new tensor each time, not the reserve's own


def test_backward_weights_before_backward_data_raises():
    _, _, _, _, reserve = _gru_call()
    with pytest.raises(RuntimeError, match="backward_data"):
        rnnkit.backward_weights(reserve)


def test_a_consumed_reserve_raises():
    _, _, y, _, reserve = _gru_call()
    rnnkit.backward_data(reserve, torch.randn_like(y))
    with pytest.raises(RuntimeError, match="reserve"):
        rnnkit.backward_data(reserve, torch.randn_like(y))


def test_reserve_must_be_a_reserve():
    with pytest.raises(TypeError, match="reserve"):
        rnnkit.backward_data(object(), torch.randn(T, B, H))
    with pytest.raises(TypeError, match="reserve"):
        rnnkit.backward_weights(None)


def test_dweights_of_the_wrong_shape_raises():
    _, _, y, _, reserve = _gru_call()
    rnnkit.backward_data(reserve, torch.randn_like(y))
    with pytest.raises(ValueError, match="dweights"):
        rnnkit.backward_weights(reserve, torch.zeros(3, dtype=DT))


@pytest.mark.parametrize(
    "make",
    [
        lambda: rnnkit.LSTM(I, H, 2, proj_size=3, bidirectional=True, zoneout=(0.3, 0.1), dropout=0.5,
                            recurrent_dropout=0.3, backend=REF, dtype=DT),
        lambda: rnnkit.GRU(I, [H, 4], 2, input_dropout=0.3, dropconnect=0.5, zoneout=0.2, backend=REF, dtype=DT),
        lambda: rnnkit.RNN(I, H, layer_norm=True, bidirectional=True, merge="sum", backend=REF, dtype=DT),
    ],
    ids=["lstm", "gru-per_layer", "rnn"],
)
def test_forward_inference_equals_eval_and_keeps_no_graph(make):
    module = make()
    assert all(p.requires_grad for p in module.parameters())
    x = torch.randn(T, B, I, dtype=DT)
    hx = _states(module)
    lengths = [5, 1, 3]
    y, hy = rnnkit.forward_inference(module.spec, module.flat_weights, x, hx, lengths, backend=REF)
    assert not y.requires_grad and y.grad_fn is None
    assert not any(t.requires_grad for t in flatten(hy))
    with torch.no_grad():
        y_ref, hy_ref = module.eval()(x, hx, lengths)
    assert torch.equal(y, y_ref)
    assert_close(hy, hy_ref, "hy")
    y2, _ = rnnkit.forward_inference(module.spec, module.flat_weights, x, hx, lengths, backend=REF)
    assert torch.equal(y, y2)  # no masks: deterministic


# ---- arguments the calls refuse or take ---------------------------------------------

def test_rnn_and_forward_inference_take_a_packed_sequence_as_the_modules_do():
    module = rnnkit.LSTM(I, H, 2, bidirectional=True, backend=REF, dtype=DT).eval()
    x = torch.randn(T, B, I, dtype=DT)
    input = pack_padded_sequence(x, [3, 5, 1], enforce_sorted=False)
    with torch.no_grad():
        y_ref, hy_ref = module(input)
    for call in (rnnkit.rnn, rnnkit.forward_inference):
        y, hy = call(module.spec, module.flat_weights, input, backend=REF)
        assert isinstance(y, PackedSequence)
        assert torch.equal(y.batch_sizes, y_ref.batch_sizes) and torch.equal(y.sorted_indices, y_ref.sorted_indices)
        assert_close(y.data, y_ref.data, call.__name__)
        assert_close(hy, hy_ref, call.__name__)
    with pytest.raises(ValueError, match="^lengths"):
        rnnkit.rnn(module.spec, module.flat_weights, input, lengths=[3, 5, 1])


def test_forward_training_refuses_a_packed_sequence_asking_for_a_padded_tensor():
    module = rnnkit.GRU(I, H, backend=REF, dtype=DT)
    input = pack_padded_sequence(torch.randn(T, B, I, dtype=DT), [5, 3, 2])
    expected = r"^input: expected a padded tensor \(T, B, input_size\) with its lengths="
    with pytest.raises(TypeError, match=expected) as info:
        rnnkit.forward_training(module.spec, module.flat_weights, input)
    assert "or a PackedSequence" not in str(info.value)
    with pytest.raises(TypeError, match=r"^input: expected a tensor \(T, B, input_size\), got list$"):
        rnnkit.forward_training(module.spec, module.flat_weights, [1.0])


def test_forward_training_refuses_inference_mode():
    module = rnnkit.GRU(I, H, backend=REF, dtype=DT)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode.*forward_inference"):
        rnnkit.forward_training(module.spec, module.flat_weights, torch.randn(T, B, I, dtype=DT))


def test_forward_training_takes_inference_tensors_outside_inference_mode():
    module = rnnkit.LSTM(I, H, backend=REF, dtype=DT)
    x, hx = torch.randn(T, B, I, dtype=DT), _states(module)
    with torch.inference_mode():
        copies = [t.clone() for t in [module.flat_weights.detach(), x, *hx]]
    assert all(t.is_inference() for t in copies)
    results = []
    for w, x_, h, c in ([module.flat_weights.detach(), x, *hx], copies):
        y, hy, reserve = rnnkit.forward_training(module.spec, w, x_, (h, c), backend=REF)
        dy = torch.ones_like(y)
        results.append([y, *hy, *rnnkit.backward_data(reserve, dy), rnnkit.backward_weights(reserve)])
    for name, plain, inference in zip(["y", "h_n", "c_n", "dx", "dhx", "dcx", "dw"], *results):
        assert torch.equal(plain, inference), name


SPEC_CALLS = {
    "forward_training": lambda spec, w, x: rnnkit.forward_training(spec, w, x),
    "forward_inference": lambda spec, w, x: rnnkit.forward_inference(spec, w, x),
    "rnn": lambda spec, w, x: rnnkit.rnn(spec, w, x),
    "rnn-with-layout": lambda spec, w, x: rnnkit.rnn(spec, w, x, layout=rnnkit.Layout(rnnkit.RNNSpec("gru", I, H))),
}


@pytest.mark.parametrize("call", list(SPEC_CALLS))
def test_a_spec_that_is_not_an_rnnspec_is_a_type_error(call):
    weights = rnnkit.Layout(rnnkit.RNNSpec("gru", I, H)).new_buffer()
    with pytest.raises(TypeError, match=r"^spec: expected an rnnkit\.RNNSpec, got str$"):
        SPEC_CALLS[call]("gru", weights, torch.randn(T, B, I))


def test_backward_weights_accumulate_needs_dweights():
    _, _, y, _, reserve = _gru_call()
    rnnkit.backward_data(reserve, torch.randn_like(y))
    with pytest.raises(ValueError, match="^accumulate: .*dweights"):
        rnnkit.backward_weights(reserve, accumulate=True)


def test_rnn_refuses_the_layout_of_another_spec():
    spec = rnnkit.RNNSpec("lstm", I, H, peephole=True)
    weights = rnnkit.Layout(spec).new_buffer(dtype=DT)
    x = torch.randn(T, B, I, dtype=DT)
    with pytest.raises(ValueError, match="^layout: .*peephole=False; spec has peephole=True"):
        rnnkit.rnn(spec, weights, x, layout=rnnkit.Layout(rnnkit.RNNSpec("lstm", I, H)))
    with pytest.raises(TypeError, match="^layout"):
        rnnkit.rnn(spec, weights, x, layout="lstm")
    y, _ = rnnkit.rnn(spec, weights, x, layout=rnnkit.Layout(spec), backend=REF)
    assert torch.equal(y, rnnkit.rnn(spec, weights, x, backend=REF)[0])


@pytest.mark.parametrize("make", [lambda: rnnkit.LSTM(4, [6, 5], num_layers=2, proj_size=[3, 0]),
                                  lambda: rnnkit.GRU(4, 6, num_layers=2), lambda: rnnkit.RNN(4, 6),
                                  lambda: rnnkit.LSTM(4, 6, num_layers=2, batch_first=True)],
                         ids=["lstm-per-layer", "gru", "rnn", "lstm"])
def test_detach_state_carries_every_form_of_state(make):
    """The README's TBPTT loop (tuple(s.detach() for s in state)) failed for per-layer states
    and split a GRU's tensor into a tuple; detach_state keeps each form."""
    module = make()
    x = torch.randn(3, 8, 4) if module.batch_first else torch.randn(8, 3, 4)
    full, _ = module(x)
    state, outputs = None, []
    for chunk in x.split(3, dim=1 if module.batch_first else 0):
        y, state = module(chunk, state)
        y.sum().backward()  # each chunk's graph stands alone
        outputs.append(y.detach())
        state = rnnkit.detach_state(state)
        assert all(t.grad_fn is None and not t.requires_grad for t in rnnkit.functional._leaves(state))
    assert_close(torch.cat(outputs, 1 if module.batch_first else 0), full)
    assert rnnkit.detach_state(None) is None
    with pytest.raises(TypeError, match="state: expected a module's final state"):
        rnnkit.detach_state([torch.zeros(1), "h"])


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_y_is_the_callers_to_change_and_what_the_reserve_reads_is_not(backend):
    """forward_training's y is the caller's own (masking padding in place before backward_data
    changed the fused ops' saved output: refused by autograd's check, naming its internals); the
    input, hx and weights the reserve reads are the caller's too, and a change to one in place
    before backward_data is refused saying so. An integer hx is the DTypeMismatchError rnn raises."""
    spec = rnnkit.RNNSpec("lstm", 4, 5)
    w = rnnkit.Layout(spec).new_buffer(dtype=torch.float64)
    torch.manual_seed(0)
    w.normal_()
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    dy = torch.randn(6, 3, 5, dtype=torch.float64)
    y, _, reserve = rnnkit.forward_training(spec, w, x, backend=backend)
    expected = rnnkit.backward_data(reserve, dy)
    y, _, reserve = rnnkit.forward_training(spec, w, x, backend=backend)
    y[:, 0] = 0  # padding masked in place
    assert all(torch.equal(a, b) for a, b in zip(rnnkit.backward_data(reserve, dy), expected))
    x2 = x.clone()
    _, _, reserve = rnnkit.forward_training(spec, w, x2, backend=backend)
    x2.mul_(2)
    with pytest.raises(RuntimeError, match="backward_data: the input, hx or weights given to forward_training were "
                                           "changed in place"):
        rnnkit.backward_data(reserve, dy)
    gru = rnnkit.RNNSpec("gru", 4, 5)
    with pytest.raises(rnnkit.DTypeMismatchError, match="hx: expected dtype torch.float32"):
        rnnkit.forward_training(gru, rnnkit.Layout(gru).new_buffer(), torch.randn(3, 2, 4),
                                torch.zeros(1, 2, 5, dtype=torch.long))


def test_forward_training_follows_the_autocast_policy_as_rnn_does():
    """Under torch.autocast forward_training takes what rnn takes (float32 x or hx with weights in the
    autocast dtype, an input in it with float32 weights) and computes the same; backward_data takes a
    float32 gradient of a bfloat16 y (rounded to it, as autograd rounds one)."""
    spec = rnnkit.RNNSpec("lstm", 8, 16)
    w32 = rnnkit.Layout(spec).new_buffer()
    x = torch.randn(5, 3, 8)
    hx = (torch.randn(1, 3, 16).bfloat16(), torch.randn(1, 3, 16).bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for weights, inputs in ((w32.bfloat16(), (x,)), (w32, (x.bfloat16(),)), (w32, (x, hx))):
            y, hy, reserve = rnnkit.forward_training(spec, weights, *inputs)
            expected = rnnkit.rnn(spec, weights, *inputs)
            assert y.dtype == torch.bfloat16 and torch.equal(y, expected[0])
            dy = torch.randn(y.shape)  # float32
            dx, dhx, dcx = rnnkit.backward_data(reserve, dy)
            leaf = inputs[0].detach().requires_grad_()
            torch.autograd.backward(rnnkit.rnn(spec, weights, leaf, *inputs[1:])[0], dy.bfloat16())
            assert dx.dtype == inputs[0].dtype and torch.equal(dx, leaf.grad)
    y, _, reserve = rnnkit.forward_training(spec, w32, x)  # outside autocast: y's dtype, as before
    with pytest.raises(rnnkit.DTypeMismatchError, match=r"dy: expected dtype torch.float32, the dtype of the output"):
        rnnkit.backward_data(reserve, torch.randn(y.shape, dtype=torch.float64))


def test_native_refuses_half_precision_training_where_onednn_uses_amx(monkeypatch):
    """oneDNN's bfloat16 RNN backward on AMX gives wrong gradients (README); a call that records a gradient
    is refused by name, and auto, where the fused kernels are out, takes the reference instead. Inference
    and float32 training stay on native."""
    from rnnkit import backend as backends
    from rnnkit import native

    monkeypatch.setattr(native, "_amx", lambda: True)
    spec = rnnkit.RNNSpec("lstm", 8, 16)
    cpu = torch.device("cpu")
    with pytest.raises(rnnkit.BackendUnavailableError, match="bfloat16 training on a CPU with AMX"):
        backends.select("native", spec, cpu, torch.bfloat16, steps=5, grad=True, batch=3)
    if native._LOW[torch.bfloat16]():  # oneDNN has bfloat16 RNN kernels on this CPU
        assert backends.select("native", spec, cpu, torch.bfloat16, steps=5, grad=False, batch=3).name == "native"
    assert backends.select("native", spec, cpu, torch.float32, steps=5, grad=True, batch=3).name == "native"
    monkeypatch.setattr(backends.get("fused"), "unavailable_reason", lambda: "switched off for this test")
    assert backends.select("auto", spec, cpu, torch.bfloat16, steps=5, grad=True, batch=8).name == "reference"
    m = rnnkit.LSTM(8, 16, backend="native").bfloat16()
    with pytest.raises(rnnkit.BackendUnavailableError, match="AMX"):
        m(torch.randn(5, 3, 8, dtype=torch.bfloat16, requires_grad=True))
    monkeypatch.setattr(native, "_amx", lambda: False)
    if native._LOW[torch.bfloat16]():
        assert backends.select("native", spec, cpu, torch.bfloat16, steps=5, grad=True, batch=3).name == "native"
