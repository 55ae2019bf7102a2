"""Variable length on the reference backend (docs/spec.md, "Stacking, directions, sequences"):
a batch with lengths gives, per sequence, exactly what running that sequence alone gives,
in both directions and every layer; padded outputs are exactly zero; final states are the
state after step length-1."""
from __future__ import annotations

import pytest
import torch

import rnnkit
from helpers import assert_close, random_states

T, I, H = 7, 4, 5
LENGTHS = [3, 1, 5, 2]  # unsorted, one of length 1, max 5 < T: a two-step zero-padding tail
B = len(LENGTHS)
DT = torch.float64

VARIANTS = {
    "lstm": (rnnkit.LSTM, {}),
    "lstm-proj": (rnnkit.LSTM, dict(proj_size=3)),
    "lstm-peephole-ln-coupled": (rnnkit.LSTM, dict(peephole=True, layer_norm=True, coupled_gates=True)),
    "lstm-clip-zoneout": (rnnkit.LSTM, dict(cell_clip=0.5, proj_size=2, proj_clip=0.3, zoneout=(0.2, 0.4))),
    "gru": (rnnkit.GRU, {}),
    "gru-reset_before-single_recurrent": (rnnkit.GRU, dict(reset_after=False, bias_mode="single_recurrent")),
    "gru-ln-zoneout": (rnnkit.GRU, dict(layer_norm=True, zoneout=0.3)),
    "rnn_tanh": (rnnkit.RNN, {}),
    "rnn_relu-single_input": (rnnkit.RNN, dict(nonlinearity="relu", bias_mode="single_input")),
    "lstm-per_layer": (rnnkit.LSTM, dict(hidden_size=[5, 4], proj_size=[3, 0])),
    "gru-per_layer-sum": (rnnkit.GRU, dict(hidden_size=[5, 4], merge="sum")),
}


def _build(variant, batch_first):
    cls, options = VARIANTS[variant]
    options = dict(options)
    hidden = options.pop("hidden_size", H)
    module = cls(I, hidden, 2, bidirectional=True, batch_first=batch_first, backend="reference", dtype=DT, **options)
    with torch.no_grad():
        module.flat_weights.add_(0.2 * torch.randn_like(module.flat_weights))
    return module.eval()


def _initial_states(module):
    """-> ([h0 per layer or one tensor], [c0 likewise, or nothing for GRU / RNN])."""
    states = random_states(module, B, DT)
    h, c = states if module.spec.mode == "lstm" else (states, None)
    wrap = (lambda t: t) if module.spec.per_layer else (lambda t: [t])
    return wrap(h), ([] if c is None else wrap(c))


def _hx(module, hs, cs):
    per_layer = module.spec.per_layer
    h = hs if per_layer else hs[0]
    if module.spec.mode == "lstm":
        return h, (cs if per_layer else cs[0])
    return h


def _finals(module, hy):
    """Final states as a flat list of (·, B, ·) tensors."""
    parts = list(hy) if module.spec.mode == "lstm" else [hy]
    return [t for part in parts for t in (part if isinstance(part, list) else [part])]


@pytest.mark.parametrize("batch_first", [False, True], ids=["tf", "bf"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batch_with_lengths_equals_each_sequence_alone(variant, batch_first):
    module = _build(variant, batch_first)
    x = torch.randn((B, T, I) if batch_first else (T, B, I), dtype=DT, requires_grad=True)
    hs, cs = _initial_states(module)
    states = [s.requires_grad_(True) for s in hs + cs]
    y, hy = module(x, _hx(module, hs, cs), lengths=torch.tensor(LENGTHS))
    finals = _finals(module, hy)
    y_tm = y.transpose(0, 1) if batch_first else y  # [T, B, F]
    upstream = [torch.randn_like(y)] + [torch.randn_like(f) for f in finals]
    grads = torch.autograd.grad([y] + finals, [x] + states, upstream)
    dx_tm = grads[0].transpose(0, 1) if batch_first else grads[0]
    dy_tm = upstream[0].transpose(0, 1) if batch_first else upstream[0]

    for b, length in enumerate(LENGTHS):
        assert torch.all(y_tm[length:, b] == 0), f"padding of sequence {b} is not exactly zero"
        assert torch.all(dx_tm[length:, b] == 0), f"gradient reaches the padding of sequence {b}"
        x_b = (x[b:b + 1, :length] if batch_first else x[:length, b:b + 1]).detach().requires_grad_(True)
        states_b = [s[:, b:b + 1].detach().requires_grad_(True) for s in states]
        hs_b, cs_b = states_b[: len(hs)], states_b[len(hs):]
        y_b, hy_b = module(x_b, _hx(module, hs_b, cs_b))
        y_b_tm = y_b.transpose(0, 1) if batch_first else y_b
        finals_b = _finals(module, hy_b)
        assert_close(y_tm[:length, b], y_b_tm[:, 0], f"y of sequence {b}")
        assert_close([f[:, b] for f in finals], [f[:, 0] for f in finals_b], f"final states of sequence {b}")
        upstream_b = [dy_tm[:length, b:b + 1]] + [u[:, b:b + 1] for u in upstream[1:]]
        if batch_first:
            upstream_b[0] = upstream_b[0].transpose(0, 1)
        grads_b = torch.autograd.grad([y_b] + finals_b, [x_b] + states_b, upstream_b)
        dx_b = grads_b[0].transpose(0, 1) if batch_first else grads_b[0]
        assert_close(dx_tm[:length, b], dx_b[:, 0], f"dx of sequence {b}")
        assert_close([g[:, b] for g in grads[1:]], [g[:, 0] for g in grads_b[1:]], f"d(h0, c0) of sequence {b}")


@pytest.mark.parametrize("variant", ["lstm", "gru", "rnn_tanh"])
def test_final_state_is_the_state_after_the_last_valid_step(variant):
    """Forward direction, one layer: h_n of sequence b equals y[length_b - 1, b]; the reverse
    direction's h_n equals its output at step 0."""
    cls, options = VARIANTS[variant]
    module = cls(I, H, bidirectional=True, backend="reference", dtype=DT, **options).eval()
    x = torch.randn(T, B, I, dtype=DT)
    with torch.no_grad():
        y, hy = module(x, lengths=LENGTHS)
    h_n = hy[0] if variant == "lstm" else hy
    for b, length in enumerate(LENGTHS):
        assert torch.equal(h_n[0, b], y[length - 1, b, :H])
        assert torch.equal(h_n[1, b], y[0, b, H:])


@pytest.mark.parametrize("variant", ["lstm-proj", "gru", "rnn_tanh"])
def test_full_lengths_equal_no_lengths(variant):
    module = _build(variant, False)
    x = torch.randn(T, B, I, dtype=DT)
    with torch.no_grad():
        y, hy = module(x)
        for lengths in ([T] * B, torch.full((B,), T, dtype=torch.int32)):
            y_l, hy_l = module(x, lengths=lengths)
            assert_close(y_l, y, "y")
            assert_close(_finals(module, hy_l), _finals(module, hy), "final states")


def test_lengths_in_any_integer_form_agree():
    module = _build("lstm", False)
    x = torch.randn(T, B, I, dtype=DT)
    with torch.no_grad():
        ys = [module(x, lengths=lengths)[0] for lengths in
              (LENGTHS, tuple(LENGTHS), torch.tensor(LENGTHS), torch.tensor(LENGTHS, dtype=torch.int32))]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])


def test_all_sequences_of_length_one_with_a_long_tail():
    module = _build("gru", False)
    x = torch.randn(T, B, I, dtype=DT)
    with torch.no_grad():
        y, h_n = module(x, lengths=[1] * B)
        y_1, h_1 = module(x[:1])
    assert torch.all(y[1:] == 0)
    assert_close(y[:1], y_1, "y")
    assert_close(h_n, h_1, "h_n")


def test_step_mask_inside_a_capture_is_the_mask_elsewhere(monkeypatch):
    """masks.step_mask, every backend's builder of the steps that run: filled on the device inside a capture,
    compared there elsewhere; the same [T, B] either way, in the dtype asked for, None without lengths."""
    from rnnkit import masks

    lengths = torch.tensor([5, 1, 3, 2])
    expected = torch.arange(5).unsqueeze(1) < lengths.unsqueeze(0)
    assert masks.step_mask(None, 5, torch.device("cpu")) is None
    for capturing in (False, True):
        monkeypatch.setattr(masks, "stream_capturing", lambda device: capturing)
        assert torch.equal(masks.step_mask(lengths, 5, torch.device("cpu")), expected)
        keep = masks.step_mask(lengths, 5, torch.device("cpu"), torch.float64)
        assert keep.dtype == torch.float64 and torch.equal(keep, expected.double())
