"""One-step cells: equal torch.nn's cells (shared state_dict), unbatched inputs, options equal
the one-layer module for one step, and T steps of a cell equal the module over T steps."""
from __future__ import annotations

import pytest
import torch

import rnnkit
from rnnkit.errors import MismatchError
from helpers import assert_close, require_fused_kernels

T, B, I, H = 5, 3, 4, 6
REF = "reference"

TWINS = {
    "lstm": (torch.nn.LSTMCell, rnnkit.LSTMCell, {}),
    "lstm-nobias": (torch.nn.LSTMCell, rnnkit.LSTMCell, {"bias": False}),
    "gru": (torch.nn.GRUCell, rnnkit.GRUCell, {}),
    "rnn-tanh": (torch.nn.RNNCell, rnnkit.RNNCell, {"nonlinearity": "tanh"}),
    "rnn-relu": (torch.nn.RNNCell, rnnkit.RNNCell, {"nonlinearity": "relu"}),
}


def _as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", list(TWINS))
def test_cell_matches_torch_nn(kind, dtype):
    torch_cls, kit_cls, kwargs = TWINS[kind]
    reference = torch_cls(I, H, **kwargs).to(dtype)
    cell = kit_cls(I, H, backend=REF, **kwargs).to(dtype)
    cell.load_state_dict(reference.state_dict(), strict=True)
    lstm = kind.startswith("lstm")
    x = torch.randn(B, I, dtype=dtype, requires_grad=True)
    states = [torch.randn(B, H, dtype=dtype, requires_grad=True) for _ in range(2 if lstm else 1)]
    hx = tuple(states) if lstm else states[0]
    out_ref, out = _as_list(reference(x, hx)), _as_list(cell(x, hx))
    assert_close(out, out_ref, "h', c'")
    upstream = [torch.randn_like(o) for o in out_ref]
    names = [n for n, _ in reference.named_parameters()]
    grads_ref = torch.autograd.grad(out_ref, [x] + states + list(reference.parameters()), upstream)
    grads = torch.autograd.grad(out, [x] + states + list(cell.parameters()), upstream)
    n = 1 + len(states)
    assert_close(grads[:n], grads_ref[:n], "d(x, h, c)")
    views = dict(zip([name for name, _ in cell.named_parameters()], grads[n:]))
    assert set(views) == set(names)
    for name, grad_ref in zip(names, grads_ref[n:]):
        assert_close(views[name], grad_ref, f"d{name}")
    # no state: zeros, as torch.nn
    assert_close(_as_list(cell(x)), _as_list(reference(x)), "hx=None")


@pytest.mark.parametrize("kind", list(TWINS))
def test_unbatched_cell(kind):
    torch_cls, kit_cls, kwargs = TWINS[kind]
    reference = torch_cls(I, H, **kwargs)
    cell = kit_cls(I, H, backend=REF, **kwargs)
    cell.load_state_dict(reference.state_dict())
    lstm = kind.startswith("lstm")
    x = torch.randn(I)
    hx = (torch.randn(H), torch.randn(H)) if lstm else torch.randn(H)
    with torch.no_grad():
        out, out_ref = _as_list(cell(x, hx)), _as_list(reference(x, hx))
        batched = _as_list(cell(x[None], tuple(t[None] for t in hx) if lstm else hx[None]))
        no_state = _as_list(cell(x))
    assert [o.shape for o in out] == [(H,)] * len(out)
    assert_close(out, out_ref, "unbatched")
    assert_close(out, [b[0] for b in batched], "unbatched vs batch of one")
    assert_close(no_state, _as_list(reference(x)), "unbatched, hx=None")


OPTIONS = {  # id -> (cell class, module class, options)
    "lstm-peephole": (rnnkit.LSTMCell, rnnkit.LSTM, dict(peephole=True)),
    "lstm-layer_norm": (rnnkit.LSTMCell, rnnkit.LSTM, dict(layer_norm=True)),
    "lstm-coupled-peephole-clip": (rnnkit.LSTMCell, rnnkit.LSTM, dict(coupled_gates=True, peephole=True,
                                                                      cell_clip=0.8)),
    "lstm-proj-clip": (rnnkit.LSTMCell, rnnkit.LSTM, dict(proj_size=3, proj_clip=0.4)),
    "lstm-zoneout-pair": (rnnkit.LSTMCell, rnnkit.LSTM, dict(zoneout=(0.3, 0.4))),
    "lstm-everything": (rnnkit.LSTMCell, rnnkit.LSTM, dict(peephole=True, layer_norm=True, zoneout=0.2,
                                                          bias_mode="single_input")),
    "gru-layer_norm-zoneout": (rnnkit.GRUCell, rnnkit.GRU, dict(layer_norm=True, zoneout=0.3)),
    "gru-reset_before": (rnnkit.GRUCell, rnnkit.GRU, dict(reset_after=False, bias_mode="single_recurrent")),
    "rnn-layer_norm-zoneout": (rnnkit.RNNCell, rnnkit.RNN, dict(layer_norm=True, zoneout=0.5)),
    "rnn-relu": (rnnkit.RNNCell, rnnkit.RNN, dict(nonlinearity="relu", bias_mode="none")),
}


def _pair(kind):
    cell_cls, module_cls, options = OPTIONS[kind]
    bias = options.get("bias_mode") != "none"
    cell = cell_cls(I, H, bias=bias, backend=REF, dtype=torch.float64, **options)
    module = module_cls(I, H, bias=bias, backend=REF, dtype=torch.float64, **options)
    with torch.no_grad():
        cell.flat_weights.normal_(0, 0.5)
    module.load_state_dict({f"{name}_l0": value for name, value in cell.state_dict().items()}, strict=True)
    return cell, module


def _states(cell, batch_shape):
    spec = cell.spec
    h = torch.randn(*batch_shape, spec.output_size(0), dtype=torch.float64)
    if spec.mode == "lstm":
        return h, torch.randn(*batch_shape, spec.hidden_sizes[0], dtype=torch.float64)
    return h


def _stack(hx):
    """A cell state (h or (h, c)) -> the module's, with a leading L·D = 1 axis."""
    return tuple(t[None] for t in hx) if isinstance(hx, tuple) else hx[None]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", list(OPTIONS))
def test_cell_with_options_equals_the_module_for_one_step(kind, training):
    cell, module = _pair(kind)
    cell.train(training)
    module.train(training)
    x, hx = torch.randn(B, I, dtype=torch.float64), _states(cell, (B,))
    torch.manual_seed(3)  # the same masks in training: one step draws the same zoneout masks
    out = cell(x, hx)
    torch.manual_seed(3)
    _, hy = module(x[None], _stack(hx))
    expected = tuple(t[0] for t in hy) if isinstance(hy, tuple) else hy[0]
    assert_close(out, expected, "one step")


@pytest.mark.parametrize("kind", list(OPTIONS))
def test_stepping_the_cell_equals_the_module(kind):
    cell, module = _pair(kind)
    cell.eval()
    module.eval()
    x, hx = torch.randn(T, B, I, dtype=torch.float64), _states(cell, (B,))
    with torch.no_grad():
        y, hy = module(x, _stack(hx))
        state, outputs = hx, []
        for t in range(T):
            state = cell(x[t], state)
            outputs.append(state[0] if isinstance(state, tuple) else state)
    assert_close(torch.stack(outputs), y, "outputs")
    expected = tuple(t[0] for t in hy) if isinstance(hy, tuple) else hy[0]
    assert_close(state, expected, "final state")


def test_stepping_an_unbatched_cell():
    cell, module = _pair("lstm-everything")
    cell.eval()
    module.eval()
    x, hx = torch.randn(T, I, dtype=torch.float64), _states(cell, ())
    with torch.no_grad():
        y, (h_n, c_n) = module(x, _stack(hx))  # unbatched module: x (T, I), states (L·D, ·)
        state, outputs = hx, []
        for t in range(T):
            state = cell(x[t], state)
            outputs.append(state[0])
    assert_close(torch.stack(outputs), y, "outputs")
    assert_close(state, (h_n[0], c_n[0]), "final state")


# ---- one-step calls of the sequence modules (generation loops): the plans, layer by layer ------

STACKS = {  # id -> (module class, options)
    "lstm-3-layers-everything": (rnnkit.LSTM, dict(num_layers=3, peephole=True, layer_norm=True, proj_size=4,
                                                   proj_clip=0.5, zoneout=0.2, dropout=0.3)),
    "gru-2-reset_before-batch_first": (rnnkit.GRU, dict(num_layers=2, reset_after=False, batch_first=True)),
    "rnn-relu-2-layer_norm": (rnnkit.RNN, dict(num_layers=2, nonlinearity="relu", layer_norm=True)),
}


def _fused_and_reference(cls, dtype, **options):
    require_fused_kernels()
    fused = cls(I, H, backend="fused", dtype=dtype, **options).eval()
    reference = cls(I, H, backend=REF, dtype=dtype, **options).eval()
    with torch.no_grad():
        fused.flat_weights.normal_(0, 0.5)
    reference.load_state_dict(fused.state_dict())
    return fused, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", list(STACKS))
def test_one_step_calls_of_a_stack_equal_one_call_over_the_sequence(kind, dtype):
    """T calls of one step each, the state carried (how generation loops call a stack), equal one
    call over T steps; they run on the one-step plans (one per layer), from a given state and
    from none."""
    cls, options = STACKS[kind]
    fused, reference = _fused_and_reference(cls, dtype, **options)
    batch_first = options.get("batch_first", False)
    x = torch.randn(B, T, I, dtype=dtype) if batch_first else torch.randn(T, B, I, dtype=dtype)
    step = (lambda t: x[:, t:t + 1]) if batch_first else (lambda t: x[t:t + 1])
    def general_path(*args):
        raise AssertionError("a one-step call left the plans for the general path")

    fused._pass_weights = general_path  # the general path's first step: the plans must do every call
    with torch.no_grad():
        _, hx = reference(x)  # an initial state in the module's format
        y, hy = reference(x, hx)
        state, outputs = hx, []
        for t in range(T):
            out, state = fused(step(t), state)
            outputs.append(out)
        assert fused.last_backend == "fused"
        assert_close(fused(step(0)), reference(step(0)), "from no state")
    assert_close(torch.cat(outputs, 1 if batch_first else 0), y, "outputs")
    assert_close(state, hy, "final state")


def _general_path_only(monkeypatch):
    """Calls of stacks take the general path: nn.planned_call declines every call."""
    monkeypatch.setattr(rnnkit.nn, "planned_call", lambda *args: None)
    monkeypatch.setattr(rnnkit.quantized, "planned_call", lambda *args: None)


def _leaves(out):
    y, state = out
    return [y, *(state if isinstance(state, tuple) else (state,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("kind", list(STACKS))
@pytest.mark.parametrize("backend", ["fused", "auto"])
def test_sequence_calls_without_a_gradient_run_on_the_plans_and_equal_the_general_path(kind, dtype, backend,
                                                                                         monkeypatch):
    """A call of many steps without a gradient runs each layer's pass through its plan, one C++
    call a layer (nn.planned_call), with the general path's outputs, final states, dtypes and
    strides bit for bit, from a given state and from none; batches of 1, 3 and 7 rows, and a call
    of one step (the layers' step plans)."""
    cls, options = STACKS[kind]
    fused, _ = _fused_and_reference(cls, dtype, **options)
    fused.backend = backend
    batch_first = options.get("batch_first", False)
    for batch, steps in ((1, T), (3, T), (7, T), (3, 1)):
        x = torch.randn(batch, steps, I, dtype=dtype) if batch_first else torch.randn(steps, batch, I, dtype=dtype)
        with torch.no_grad():
            hx = fused(x)[1]
            with monkeypatch.context() as patch:
                _general_path_only(patch)
                want = [fused(x), fused(x, hx)]
            chosen = fused.last_backend  # auto: oneDNN's for a plain LSTM's batch of 5 rows or more (next test)
            with monkeypatch.context() as patch:
                if chosen == "fused":  # the plans run every layer
                    patch.setattr(fused, "_pass_weights", lambda: pytest.fail("left the plans for the general path"))
                got = [fused(x), fused(x, hx)]
        assert fused.last_backend == chosen
        for a, b in zip(got, want):
            for u, v in zip(_leaves(a), _leaves(b)):
                assert torch.equal(u, v) and u.dtype == v.dtype and u.stride() == v.stride()


def test_inputs_the_plans_cannot_take_go_to_the_general_path(monkeypatch):
    """A sparse input or state is the general path's to refuse, with its message (the plans'
    reshape would have said something else)."""
    fused, _ = _fused_and_reference(rnnkit.LSTM, torch.float32)
    x, h = torch.randn(T, B, I), torch.randn(1, B, H)
    with torch.no_grad():
        for args in ((x.to_sparse(),), (x, (h.to_sparse(), h)), (x, (h, h.to_sparse()))):
            with pytest.raises(Exception) as planned:
                fused(*args)
            with monkeypatch.context() as patch:
                _general_path_only(patch)
                with pytest.raises(Exception) as general:
                    fused(*args)
            assert (type(planned.value), str(planned.value)) == (type(general.value), str(general.value))


def test_sequence_calls_leave_auto_s_choice_as_it_is(monkeypatch):
    """The plans run a sequence only where the general path would choose the fused kernels: with
    "auto", an LSTM's padded batch of backend.NATIVE_MIN_BATCH rows or more stays on oneDNN's
    (native), a smaller one on the plans; a call that records a graph takes the general path."""
    require_fused_kernels()
    lstm = rnnkit.LSTM(I, H, num_layers=2).eval()
    general = lstm._pass_weights
    calls = []
    monkeypatch.setattr(lstm, "_pass_weights", lambda: calls.append(1) or general())
    small, large = rnnkit.backend.NATIVE_MIN_BATCH - 1, rnnkit.backend.NATIVE_MIN_BATCH
    whole = lstm._whole_native_call
    native = []
    monkeypatch.setattr(lstm, "_whole_native_call", lambda *args: native.append(1) or whole(*args))
    with torch.no_grad():
        lstm(torch.randn(T, small, I))
        assert (calls, native, lstm.last_backend) == ([], [], "fused")
        lstm(torch.randn(T, large, I))
        assert (calls, native, lstm.last_backend) == ([], [1], "native")  # torch's one op (next tests)
    lstm(torch.randn(T, small, I, requires_grad=True))
    assert (len(calls), lstm.last_backend) == (1, "fused")


NATIVE_STACKS = {  # id -> (module class, options): plain stacks, which torch's RNN ops compute
    "lstm-2-bidirectional": (rnnkit.LSTM, dict(num_layers=2, bidirectional=True)),
    "lstm-batch_first-no-bias": (rnnkit.LSTM, dict(batch_first=True, bias=False)),
    "gru-2-batch_first": (rnnkit.GRU, dict(num_layers=2, batch_first=True)),
    "rnn-relu-bidirectional": (rnnkit.RNN, dict(nonlinearity="relu", bidirectional=True)),
    "lstm-3-dropout": (rnnkit.LSTM, dict(num_layers=3, dropout=0.4)),
}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", list(NATIVE_STACKS))
def test_native_calls_run_in_torch_s_one_op_and_equal_the_general_path(kind, training, monkeypatch):
    """A call that "native" runs goes to torch's RNN op in one call (nn._whole_native_call, as
    torch.nn's forward does), with the general path's outputs, final states and every gradient bit
    for bit, from a given state (one that needs a gradient too) and from none, with and without a
    gradient; dropout between layers in training stays on the general path (masks.py's masks)."""
    cls, options = NATIVE_STACKS[kind]
    torch.manual_seed(0)
    module = cls(I, H, backend="native", **options).train(training)
    batch_first = options.get("batch_first", False)
    whole = module._whole_native_call
    taken = []

    def spy(*args):
        out = whole(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(module, "_whole_native_call", spy)
    D, L = 2 if options.get("bidirectional") else 1, options.get("num_layers", 1)
    for grad in (False, True):
        x = torch.randn(B, T, I) if batch_first else torch.randn(T, B, I)
        h = torch.randn(L * D, B, H)
        hx = (h, torch.randn(L * D, B, H)) if cls is rnnkit.LSTM else h
        results = []
        for whole_op in (True, False):
            if not whole_op:
                monkeypatch.setattr(module, "_whole_native_call", lambda *args: None)
            for state in (None, hx):
                xi = x.clone().requires_grad_(grad)
                si = None if state is None else tuple(t.clone().requires_grad_(grad) for t in (
                    state if isinstance(state, tuple) else (state,)))
                si = si if si is None or cls is rnnkit.LSTM else si[0]
                module.zero_grad()
                torch.manual_seed(3)
                with torch.set_grad_enabled(grad):
                    out = module(xi, si)
                leaves = _leaves(out)
                got = [t.detach() for t in leaves]
                if grad:
                    torch.manual_seed(4)
                    torch.autograd.backward(leaves, [torch.randn_like(t) for t in leaves])
                    got += [xi.grad] + [t.grad for t in (si if isinstance(si, tuple) else (si,)) if t is not None]
                    got += [p.grad for p in module.parameters()]
                results.append((module.last_backend, got))
            monkeypatch.setattr(module, "_whole_native_call", spy)
        for (ran_a, a), (ran_b, b) in zip(results[:2], results[2:]):
            assert ran_a == ran_b == "native"
            for u, v in zip(a, b):
                assert torch.equal(u, v) and u.stride() == v.stride()
    on_masks = training and options.get("dropout")
    assert taken and all(t != on_masks for t in taken), taken


@pytest.mark.parametrize("kind", ["lstm-2-bidirectional", "gru-2-batch_first", "lstm-3-dropout"])
def test_native_calls_on_a_packed_sequence_run_in_torch_s_one_op_and_equal_the_general_path(kind, monkeypatch):
    """A PackedSequence (sorted or not) goes to torch's op as its data and batch sizes, with the
    states in the caller's batch order (as torch.nn's): the general path's output, final states and
    every gradient bit for bit, from a given state and from none."""
    from torch.nn.utils.rnn import pack_padded_sequence

    cls, options = NATIVE_STACKS[kind]
    torch.manual_seed(0)
    module = cls(I, H, backend="native", **options).eval()
    whole = module._whole_native_call
    D, L = 2 if options.get("bidirectional") else 1, options.get("num_layers", 1)
    batch_first = options.get("batch_first", False)
    for lengths, enforce_sorted in (([T, T - 2, 3, 1], True), ([2, T, 1, T - 1], False)):
        x = torch.randn(len(lengths), T, I) if batch_first else torch.randn(T, len(lengths), I)
        h = torch.randn(L * D, len(lengths), H)
        hx = (h, torch.randn_like(h)) if cls is rnnkit.LSTM else h
        results = []
        for path in ("whole", "general"):
            monkeypatch.setattr(module, "_whole_native_call", whole if path == "whole" else (lambda *args: None))
            for state in (None, hx):
                xi = x.clone().requires_grad_()
                si = None if state is None else (tuple(t.clone().requires_grad_() for t in state)
                                                  if isinstance(state, tuple) else state.clone().requires_grad_())
                module.zero_grad()
                packed = pack_padded_sequence(xi, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted)
                if path == "whole":
                    assert whole(packed, si, None) is not None
                y, hy = module(packed, si)
                leaves = [y.data, *(hy if isinstance(hy, tuple) else (hy,))]
                torch.manual_seed(4)
                torch.autograd.backward(leaves, [torch.randn_like(t) for t in leaves])
                got = [t.detach() for t in leaves] + [xi.grad] + [p.grad for p in module.parameters()]
                got += [] if si is None else [t.grad for t in (si if isinstance(si, tuple) else (si,))]
                assert torch.equal(y.batch_sizes, packed.batch_sizes)
                results.append(got)
        for a, b in zip(results[:2], results[2:]):
            for u, v in zip(a, b):
                assert torch.equal(u, v)


def test_native_whole_op_takes_only_what_it_can_check():
    """Inputs and states the one-op path cannot take as they are go to the general path, which
    runs them or refuses them with its own message: lengths, unbatched inputs, inputs and states of
    another shape or dtype, a tuple state on a GRU."""
    lstm = rnnkit.LSTM(I, H, num_layers=2, backend="native")
    gru = rnnkit.GRU(I, H, backend="native")
    x, h = torch.randn(T, B, I), torch.randn(2, B, H)
    assert lstm._whole_native_call(x, None, None) is not None
    assert lstm._whole_native_call(x, (h, h), None) is not None
    declined = [
        (lstm, x, None, torch.full((B,), T)), (lstm, x[:, 0], None, None),
        (lstm, torch.nn.utils.rnn.pack_padded_sequence(x.double(), [T] * B), None, None),
        (lstm, x, (h[:1], h), None), (lstm, x, (h, h.double()), None), (lstm, x, [h, h], None), (lstm, x, h, None),
        (lstm, x.double(), None, None), (lstm, x[:0], None, None), (gru, x, (h[:1],), None), (gru, x, h, None),
        (lstm, torch.randn(T, B, I + 1), None, None),  # the feature size: torch's op would read past the rows
    ]
    for module, *args in declined:
        assert module._whole_native_call(*args) is None, args
    with pytest.raises(Exception, match="hx"):
        gru(x, h)  # the general path's message: 1 layer, not 2
    with pytest.raises(MismatchError, match="input"):
        lstm(torch.randn(T, B, I + 1))


@pytest.mark.parametrize("mode", ["lstm", "gru"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_native_one_op_takes_strided_states_as_the_general_path_does(mode, batch_first, monkeypatch):
    """States that are views (an expanded learned h0, a batch-major state transposed) reach torch's
    op contiguous, as the general path stacks them (cuDNN refuses a strided state, and torch's CPU
    GRU on one gives other bits): outputs and every gradient bit for bit, over several seeds."""
    for seed in range(6):
        torch.manual_seed(seed)
        cls = rnnkit.LSTM if mode == "lstm" else rnnkit.GRU
        module = cls(I, H, num_layers=2, bidirectional=True, backend="native", batch_first=batch_first)
        whole = module._whole_native_call
        x = torch.randn(B, T, I) if batch_first else torch.randn(T, B, I)
        h0 = torch.randn(4, 1, H, requires_grad=True)
        c0 = torch.randn(B, 4, H).requires_grad_()
        results = []
        for path in (whole, lambda *args: None):
            monkeypatch.setattr(module, "_whole_native_call", path)
            module.zero_grad()
            h0.grad = c0.grad = None
            hx = (h0.expand(4, B, H), c0.transpose(0, 1)) if mode == "lstm" else c0.transpose(0, 1)
            y, hy = module(x, hx)
            outs = [y, *(hy if mode == "lstm" else (hy,))]
            torch.manual_seed(4)
            torch.autograd.backward(outs, [torch.randn_like(t) for t in outs])
            results.append(outs + [h0.grad, c0.grad] + [p.grad for p in module.parameters()])
        assert module.last_backend == "native"
        for u, v in zip(*results):
            assert (u is None and v is None) or torch.equal(u, v)


@pytest.mark.parametrize("options", [dict(bidirectional=True), dict(num_layers=2, hidden_size=[H, H + 2])],
                         ids=["bidirectional", "per_layer_sizes"])
def test_one_step_calls_the_plans_do_not_take_run_the_general_path(options):
    options = dict(options)
    hidden = options.pop("hidden_size", H)
    require_fused_kernels()
    fused = rnnkit.LSTM(I, hidden, backend="fused", **options).eval()
    reference = rnnkit.LSTM(I, hidden, backend=REF, **options).eval()
    reference.load_state_dict(fused.state_dict())
    x = torch.randn(1, B, I)
    with torch.no_grad():
        assert_close(fused(x), reference(x), "one step")
    assert "_plan" not in fused.__dict__


@pytest.mark.parametrize("stack", [False, True], ids=["cell", "stack"])
def test_frozen_parameters_still_pass_gradients_to_the_input_and_state(stack):
    """A one-step call with frozen parameters but an input or state that requires grad records
    the graph (the plans, which record none, step aside): d(x, h, c) equal the reference's."""
    if stack:
        fused, reference = _fused_and_reference(rnnkit.LSTM, torch.float32, num_layers=2, peephole=True)
        shape, lead = (1, B, I), (2,)
    else:
        require_fused_kernels()
        fused = rnnkit.LSTMCell(I, H, backend="fused", peephole=True)
        reference = rnnkit.LSTMCell(I, H, backend=REF, peephole=True)
        reference.load_state_dict(fused.state_dict())
        shape, lead = (B, I), ()
    grads = []
    torch.manual_seed(0)
    x, h, c = torch.randn(*shape), torch.randn(*lead, B, H), torch.randn(*lead, B, H)
    for module in (fused, reference):
        module.requires_grad_(False)
        inputs = [t.clone().requires_grad_() for t in (x, h, c)]
        out = module(inputs[0], (inputs[1], inputs[2]))
        results = [out[0], *out[1]] if stack else list(out)
        assert all(r.requires_grad for r in results)
        grads.append(torch.autograd.grad(results, inputs, [torch.ones_like(r) for r in results]))
    assert_close(grads[0], grads[1], "d(x, h, c)")


def test_one_step_plans_follow_the_parameters_memory():
    """The plans hold the parameters' memory: memory swapped under the same Parameter objects
    (``vector_to_parameters``, ``.data =``, dtype round trips, ``flatten_parameters``) or a
    non-contiguous parameter must not leave a no_grad one-step call on stale or wrong weights."""
    fused, reference = _fused_and_reference(rnnkit.GRU, torch.float32, num_layers=2)
    x = torch.randn(1, B, I)

    def check(what):
        reference.load_state_dict({k: v.contiguous() for k, v in fused.state_dict().items()})
        with torch.no_grad():
            assert_close(fused(x), reference(x), what)

    check("first call")  # plans built
    vector = torch.nn.utils.parameters_to_vector(fused.parameters())
    torch.nn.utils.vector_to_parameters(vector * 0.5, fused.parameters())
    check("after vector_to_parameters")
    fused.half().float()
    with torch.no_grad():
        fused.weight_hh_l1.mul_(2)
    check("after a dtype round trip")
    fused.weight_ih_l0.data = torch.randn_like(fused.weight_ih_l0)
    check("after .data =")
    fused.weight_hh_l0 = torch.nn.Parameter(torch.randn(H, 3 * H).t())  # (3H, H), strided
    assert not fused.weight_hh_l0.is_contiguous()
    check("with a non-contiguous parameter")
