"""Stochastic options on the reference backend: evaluation is the deterministic expectation
of docs/spec.md, training masks are reproducible under a seed and have the promised structure
(variational masks constant over time, zoneout keeps exactly the masked units, DropConnect
on R only, dropout between layers only)."""
from __future__ import annotations

import pytest
import torch

import rnnkit
import rnnkit.functional as functional
from helpers import assert_close

T, B, I, H = 6, 4, 5, 7
DT = torch.float64
REF = "reference"


def _randomize(module):
    with torch.no_grad():
        module.flat_weights.normal_(0, 0.5)
    return module


# ---- hand-written cells, independent of the reference ---------------------------------

def rnn_cell(x, h, W, R, b_W, b_R):
    return torch.tanh(x @ W.T + b_W + h @ R.T + b_R)


def lstm_cell(x, h, c, W, R, b_W, b_R):
    """-> (h̃, c̃): docs/spec.md's LSTM before zoneout."""
    i, f, g, o = (x @ W.T + b_W + h @ R.T + b_R).chunk(4, -1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def _weights(module):
    return module.weight_ih_l0, module.weight_hh_l0, module.bias_ih_l0, module.bias_hh_l0


class _RecordDraws:
    """Wraps functional.draw_pass to keep the masks each pass was given."""

    def __init__(self, monkeypatch):
        self.draws = []
        original = functional.draw_pass

        def record(*args, **kwargs):
            draw = original(*args, **kwargs)
            self.draws.append(draw)
            return draw

        monkeypatch.setattr(functional, "draw_pass", record)


# ---- evaluation: the expectation, deterministic ----------------------------------------

@pytest.mark.parametrize("p", [0.0, 0.3, 0.75])
def test_rnn_zoneout_eval_is_the_expectation(p):
    module = _randomize(rnnkit.RNN(I, H, zoneout=p, backend=REF, dtype=DT)).eval()
    x, h0 = torch.randn(T, B, I, dtype=DT), torch.randn(1, B, H, dtype=DT)
    with torch.no_grad():
        y, h_n = module(x, h0)
        h, expected = h0[0], []
        for t in range(T):
            h = p * h + (1 - p) * rnn_cell(x[t], h, *_weights(module))
            expected.append(h)
    assert_close(y, torch.stack(expected), "y")
    assert_close(h_n[0], h, "h_n")


@pytest.mark.parametrize("p_h,p_c", [(0.3, 0.0), (0.25, 0.6), (0.0, 0.5)])
def test_lstm_zoneout_eval_is_the_expectation(p_h, p_c):
    zoneout = (p_h, p_c) if p_c else p_h
    module = _randomize(rnnkit.LSTM(I, H, zoneout=zoneout, backend=REF, dtype=DT)).eval()
    x, h0, c0 = torch.randn(T, B, I, dtype=DT), torch.randn(1, B, H, dtype=DT), torch.randn(1, B, H, dtype=DT)
    with torch.no_grad():
        y, (h_n, c_n) = module(x, (h0, c0))
        h, c, expected = h0[0], c0[0], []
        for t in range(T):
            h_new, c_new = lstm_cell(x[t], h, c, *_weights(module))
            h, c = p_h * h + (1 - p_h) * h_new, p_c * c + (1 - p_c) * c_new
            expected.append(h)
    assert_close(y, torch.stack(expected), "y")
    assert_close((h_n[0], c_n[0]), (h, c), "h_n, c_n")


@pytest.mark.parametrize("cls", [rnnkit.LSTM, rnnkit.GRU, rnnkit.RNN])
def test_eval_is_deterministic_and_ignores_dropouts(cls):
    options = dict(dropout=0.5, input_dropout=0.3, recurrent_dropout=0.4, dropconnect=0.5)
    noisy = cls(I, H, 2, bidirectional=True, backend=REF, dtype=DT, **options).eval()
    plain = cls(I, H, 2, bidirectional=True, backend=REF, dtype=DT)
    plain.load_state_dict(noisy.state_dict())
    x = torch.randn(T, B, I, dtype=DT)
    with torch.no_grad():
        first, second, expected = noisy(x), noisy(x), plain(x)
    assert torch.equal(first[0], second[0])
    assert_close(first[0], expected[0], "y")
    assert_close(first[1], expected[1], "final states")


# ---- training: reproducible, and different between calls ----------------------------------

@pytest.mark.parametrize(
    "cls,options",
    [
        (rnnkit.LSTM, dict(zoneout=(0.2, 0.3), recurrent_dropout=0.3, input_dropout=0.2, dropconnect=0.3, dropout=0.3)),
        (rnnkit.GRU, dict(zoneout=0.3, recurrent_dropout=0.3, input_dropout=0.2, dropconnect=0.3, dropout=0.3)),
        (rnnkit.RNN, dict(zoneout=0.3, recurrent_dropout=0.3, input_dropout=0.2, dropconnect=0.3, dropout=0.3)),
    ],
    ids=["lstm", "gru", "rnn"],
)
def test_training_masks_are_reproducible_under_a_seed(cls, options):
    module = cls(I, H, 2, bidirectional=True, backend=REF, dtype=DT, **options).train()
    x = torch.randn(T, B, I, dtype=DT)
    torch.manual_seed(7)
    first = module(x)[0]
    torch.manual_seed(7)
    second = module(x)[0]
    third = module(x)[0]  # the generator moved on: new masks
    assert torch.equal(first, second)
    assert not torch.allclose(first, third)


# ---- variational masks: one per sequence, constant over time --------------------------------

@pytest.mark.parametrize("cls", [rnnkit.RNN, rnnkit.GRU, rnnkit.LSTM])
def test_recurrent_dropout_excludes_the_same_units_at_every_step(cls):
    p = 0.5
    module = _randomize(cls(I, H, recurrent_dropout=p, backend=REF, dtype=DT)).train()
    x = torch.randn(T, B, I, dtype=DT)
    states = (torch.randn(1, B, H, dtype=DT),) * (2 if cls is rnnkit.LSTM else 1)
    hx = states if cls is rnnkit.LSTM else states[0]
    y, _ = module(x, hx)
    dropped_any = kept_any = False
    for b in range(B):
        # y[t, b] reaches R's column j only through the masked h_{t-1, j} of sequence b
        first = torch.autograd.grad(y[0, b].sum(), module.weight_hh_l0, retain_graph=True)[0]
        last = torch.autograd.grad(y[T - 1, b].sum(), module.weight_hh_l0, retain_graph=True)[0]
        dropped_at_0 = first.abs().sum(0) == 0  # [H]
        reaches_last = last.abs().sum(0) != 0
        # dropped at step 0 -> still no path at step T-1, i.e. dropped at EVERY step; kept -> a path
        assert torch.equal(reaches_last, ~dropped_at_0), b
        dropped_any |= bool(dropped_at_0.any())
        kept_any |= bool((~dropped_at_0).any())
    assert dropped_any and kept_any


def test_recurrent_dropout_is_scaled_and_per_sequence():
    """Recover sequence b's mask from the gradient, then recompute by hand: kept units are scaled by 1/(1-p)."""
    p = 0.4
    module = _randomize(rnnkit.RNN(I, H, recurrent_dropout=p, backend=REF, dtype=DT)).train()
    x, h0 = torch.randn(T, B, I, dtype=DT), torch.randn(1, B, H, dtype=DT)
    y, h_n = module(x, h0)
    masks = []
    for b in range(B):
        grad = torch.autograd.grad(y[0, b].sum(), module.weight_hh_l0, retain_graph=True)[0]
        masks.append((grad.abs().sum(0) != 0).to(DT) / (1 - p))
    mask = torch.stack(masks)  # [B, H]
    assert len({tuple(m.tolist()) for m in mask}) > 1, "one mask per sequence, not one per batch"
    with torch.no_grad():
        h, expected = h0[0], []
        for t in range(T):
            h = rnn_cell(x[t], h * mask, *_weights(module))
            expected.append(h)
    assert_close(y, torch.stack(expected), "y")


def test_input_dropout_drops_a_feature_at_every_step():
    p = 0.5
    module = _randomize(rnnkit.RNN(I, H, input_dropout=p, backend=REF, dtype=DT)).train()
    x = torch.randn(T, B, I, dtype=DT, requires_grad=True)
    y, _ = module(x)
    # y[t] sees x[t] only through the masked input; dx[t, b, k] == 0 <=> feature k of b dropped at t
    reaches = torch.stack([
        torch.autograd.grad(y[t].sum(), x, retain_graph=True)[0][t] != 0 for t in range(T)
    ])  # [T, B, I]
    assert torch.equal(reaches, reaches[:1].expand_as(reaches)), "the mask must be the same at every step"
    assert reaches.any() and not reaches.all()
    mask = reaches[0].to(DT) / (1 - p)  # [B, I]
    with torch.no_grad():
        h, expected = torch.zeros(B, H, dtype=DT), []
        for t in range(T):
            h = rnn_cell(x[t] * mask, h, *_weights(module))
            expected.append(h)
    assert_close(y, torch.stack(expected), "y")


# ---- zoneout in training --------------------------------------------------------------------

def test_rnn_zoneout_training_keeps_exactly_the_masked_units(monkeypatch):
    p = 0.4
    module = _randomize(rnnkit.RNN(I, H, zoneout=p, backend=REF, dtype=DT)).train()
    record = _RecordDraws(monkeypatch)
    x, h0 = torch.randn(T, B, I, dtype=DT), torch.randn(1, B, H, dtype=DT)
    with torch.no_grad():
        y, h_n = module(x, h0)
    (draw,) = record.draws
    keep_old = draw.masks.zoneout_h  # [T, B, H] in {0, 1}
    previous = torch.cat([h0, y[:-1]])
    unchanged = y == previous  # a fresh tanh value equals the old one with probability 0
    assert torch.equal(unchanged, keep_old.bool())
    assert 0.2 < keep_old.mean().item() < 0.6
    with torch.no_grad():
        h, expected = h0[0], []
        for t in range(T):
            h = keep_old[t] * h + (1 - keep_old[t]) * rnn_cell(x[t], h, *_weights(module))
            expected.append(h)
    assert_close(y, torch.stack(expected), "y")


def test_lstm_zoneout_pair_training(monkeypatch):
    p_h, p_c = 0.3, 0.5
    module = _randomize(rnnkit.LSTM(I, H, zoneout=(p_h, p_c), backend=REF, dtype=DT)).train()
    record = _RecordDraws(monkeypatch)
    x, h0, c0 = (torch.randn(s, dtype=DT) for s in ((T, B, I), (1, B, H), (1, B, H)))
    with torch.no_grad():
        y, (h_n, c_n) = module(x, (h0, c0))
    (draw,) = record.draws
    d_h, d_c = draw.masks.zoneout_h, draw.masks.zoneout_c
    assert torch.equal(y == torch.cat([h0, y[:-1]]), d_h.bool())
    with torch.no_grad():
        h, c, expected = h0[0], c0[0], []
        for t in range(T):
            h_new, c_new = lstm_cell(x[t], h, c, *_weights(module))
            h, c = d_h[t] * h + (1 - d_h[t]) * h_new, d_c[t] * c + (1 - d_c[t]) * c_new
            expected.append(h)
    assert_close(y, torch.stack(expected), "y")
    assert_close((h_n[0], c_n[0]), (h, c), "h_n, c_n")


# ---- DropConnect ------------------------------------------------------------------------------

def test_dropconnect_changes_outputs_in_training_only(monkeypatch):
    p = 0.5
    module = _randomize(rnnkit.RNN(I, H, dropconnect=p, backend=REF, dtype=DT))
    plain = rnnkit.RNN(I, H, backend=REF, dtype=DT)
    plain.load_state_dict(module.state_dict())
    x = torch.randn(T, B, I, dtype=DT)
    with torch.no_grad():
        expected, _ = plain(x)
        assert torch.equal(module.eval()(x)[0], module.eval()(x)[0])
        assert_close(module.eval()(x)[0], expected, "eval y")
        record = _RecordDraws(monkeypatch)
        y, _ = module.train()(x)
    assert not torch.allclose(y, expected)
    assert_close(y[0], expected[0], "step 0 (h_0 = 0: R is not used)")
    (draw,) = record.draws
    mask = draw.dropconnect  # [H, H], one for the whole call
    assert set(mask.unique().tolist()) == {0.0, 1 / (1 - p)}
    W, R, b_W, b_R = _weights(module)
    with torch.no_grad():
        h, hand = torch.zeros(B, H, dtype=DT), []
        for t in range(T):
            h = rnn_cell(x[t], h, W, R * mask, b_W, b_R)
            hand.append(h)
    assert_close(y, torch.stack(hand), "y")


# ---- dropout between layers ---------------------------------------------------------------------

@pytest.mark.parametrize("layers", [2, 3])
def test_dropout_between_layers_only_in_training_and_not_on_the_last(monkeypatch, layers):
    p = 0.5
    module = _randomize(rnnkit.RNN(I, H, layers, dropout=p, backend=REF, dtype=DT))
    calls = []
    original = functional.layer_dropout

    def record(y, prob):
        out = original(y, prob)
        calls.append((y, out))
        return out

    monkeypatch.setattr(functional, "layer_dropout", record)
    x = torch.randn(T, B, I, dtype=DT)
    with torch.no_grad():
        module.eval()(x)
        assert calls == []
        y, _ = module.train()(x)
    assert len(calls) == layers - 1  # every layer's output but the last
    assert not (y == 0).any()  # the last layer's output is never dropped
    # rebuild the stack layer by layer from the recorded dropped outputs
    for k, (before, after) in enumerate(calls):
        ratio = after / before
        assert torch.all((ratio == 0) | ((ratio - 1 / (1 - p)).abs() < 1e-12))
        assert (ratio == 0).any()
    layer_input = x
    for k in range(layers):
        single = rnnkit.RNN(layer_input.shape[-1], H, backend=REF, dtype=DT)
        single.load_state_dict({n.replace(f"_l{k}", "_l0"): v for n, v in module.state_dict().items()
                                if n.endswith(f"_l{k}")})
        with torch.no_grad():
            out, _ = single(layer_input)
        if k < layers - 1:
            assert_close(out, calls[k][0], f"layer {k} output")
            layer_input = calls[k][1]
    assert_close(y, out, "y")


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_a_dropout_of_one_drops_everything_as_torch_nn_does(backend):
    """torch.nn takes dropout=1 (the next layer sees zeros); so does rnnkit, for each dropout:
    a mask of zeros, not 0/0 = NaN. input_dropout=1 is a zero input, recurrent_dropout=1 and
    dropconnect=1 a zero R."""
    torch.manual_seed(0)
    x = torch.randn(T, B, I, dtype=DT)
    reference = torch.nn.LSTM(I, H, 2, dropout=1.0).double()
    module = rnnkit.LSTM(I, H, 2, dropout=1.0, backend=backend).double()
    module.load_state_dict(reference.state_dict())
    assert_close(module.train()(x)[0], reference.train()(x)[0])

    plain = _randomize(rnnkit.GRU(I, H, backend=backend).double())
    for option, same_as in [("input_dropout", lambda m: m(torch.zeros_like(x))[0]),
                            ("recurrent_dropout", None), ("dropconnect", None)]:
        module = rnnkit.GRU(I, H, backend=backend, **{option: 1.0}).double()
        module.load_state_dict(plain.state_dict())
        if same_as is None:
            zero_r = rnnkit.GRU(I, H, backend=backend).double()
            zero_r.load_state_dict(plain.state_dict())
            with torch.no_grad():
                zero_r.weight_hh_l0.zero_()
            expected = zero_r(x)[0]
        else:
            expected = same_as(plain)
        got = module.train()(x)[0]
        assert torch.isfinite(got).all(), option
        assert_close(got, expected)


@pytest.mark.parametrize("lengths", [None, [6, 2, 4, 5]], ids=["padded", "lengths"])
@pytest.mark.parametrize("mode", ["gru", "lstm"])
def test_every_backend_draws_the_same_dropout_masks_under_a_seed(mode, lengths):
    """native handed the dropout to torch's op, which drew its own masks (on the packed data
    with lengths): 0.31 away from the reference's under the same seed."""
    x = torch.randn(T, B, I)
    outputs = {}
    for backend in ("native", "fused", "reference"):
        torch.manual_seed(0)
        module = (rnnkit.GRU if mode == "gru" else rnnkit.LSTM)(I, H, num_layers=3, dropout=0.5, backend=backend)
        torch.manual_seed(1)
        outputs[backend] = module.train()(x, lengths=lengths)[0]
        assert module.last_backend == backend
        outputs[backend + " next draw"] = torch.rand(3)  # the same number of draws, too
    for backend in ("native", "fused"):
        assert_close(outputs[backend], outputs["reference"])
        assert torch.equal(outputs[backend + " next draw"], outputs["reference next draw"])


def test_random_options_name_what_training_draws():
    """A one-layer stack's dropout draws nothing (it acts between layers), so its training calls
    keep the deterministic fast paths; every other random option is named."""
    assert rnnkit.LSTM(3, 4, dropout=0.5).spec.random_options == ()
    assert rnnkit.LSTM(3, 4, 2, dropout=0.5).spec.random_options == ("dropout",)
    spec = rnnkit.LSTM(3, 4, input_dropout=0.1, recurrent_dropout=0.2, dropconnect=0.3, zoneout=0.1).spec
    assert spec.random_options == ("input_dropout", "recurrent_dropout", "dropconnect", "zoneout")
    assert spec.uses_dropout_masks and not rnnkit.GRU(3, 4).spec.uses_dropout_masks
