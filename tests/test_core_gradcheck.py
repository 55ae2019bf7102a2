"""Rung two of truth for what torch.nn does not have: torch.autograd.gradcheck in float64
on the reference backend, with respect to the input, the initial states and the packed
weights, for every option of docs/spec.md (stochastic ones in evaluation mode).

Clipping: gradcheck across a clamp edge is meaningless (the function has a kink there),
so each clip case picks its clip value such that the clip is ACTIVE for some entries and
inactive for others, with every pre-clamp value at least ``CLIP_MARGIN`` away from the
edge (far beyond gradcheck's eps = 1e-6). The pre-clamp values are recorded with a
TorchFunctionMode around the forward, and the margin is asserted, not assumed.
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rnnkit
from rnnkit.functional import rnn

T, B, I, H = 3, 2, 3, 4
CLIP_MARGIN = 1e-3
DT = torch.float64
# fast mode checks J along random directions (v^T J u against finite differences): the
# same failure detection in practice at a fraction of the cost of the full Jacobian
FAST = True


def _state_tensors(spec: rnnkit.RNNSpec, batch: int):
    """Random initial states as a flat list, and a function rebuilding the user's hx from it."""
    D, L = spec.num_directions, spec.num_layers
    lstm = spec.mode == "lstm"
    if spec.per_layer:
        hs = [torch.randn(D, batch, spec.output_size(k), dtype=DT) for k in range(L)]
        cs = [torch.randn(D, batch, spec.hidden_sizes[k], dtype=DT) for k in range(L)] if lstm else []

        def assemble(tensors):
            return (list(tensors[:L]), list(tensors[L:])) if lstm else list(tensors)

        return hs + cs, assemble
    hs = [torch.randn(L * D, batch, spec.output_size(0), dtype=DT)]
    cs = [torch.randn(L * D, batch, spec.hidden_sizes[0], dtype=DT)] if lstm else []
    return hs + cs, (lambda tensors: tuple(tensors) if lstm else tensors[0])


def _flatten(out):
    flat, stack = [], [out]
    while stack:
        item = stack.pop(0)
        if isinstance(item, (tuple, list)):
            stack = list(item) + stack
        else:
            flat.append(item)
    return tuple(flat)


def _weights(spec: rnnkit.RNNSpec) -> torch.Tensor:
    """Initialized weights with noise, so LN gains are not all exactly 1 and shifts not 0."""
    layout = rnnkit.Layout(spec)
    return layout.new_buffer(dtype=DT) + 0.1 * torch.randn(layout.numel, dtype=DT)


def _check(spec, lengths=None, x_scale=1.0, weights=None):
    x = (x_scale * torch.randn(T, B, spec.input_size, dtype=DT)).requires_grad_(True)
    states, assemble = _state_tensors(spec, B)
    states = [s.requires_grad_(True) for s in states]
    w = (weights if weights is not None else _weights(spec)).requires_grad_(True)

    def f(x, w, *states):
        return _flatten(rnn(spec, w, x, assemble(states), lengths, training=False, backend="reference"))

    assert torch.autograd.gradcheck(f, (x, w, *states), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=FAST)


CASES = {
    "lstm-peephole": dict(mode="lstm", peephole=True),
    "lstm-peephole-bi-L2": dict(mode="lstm", peephole=True, num_layers=2, bidirectional=True),
    "lstm-layer_norm": dict(mode="lstm", layer_norm=True),
    "lstm-layer_norm-proj-peephole": dict(mode="lstm", layer_norm=True, proj_size=2, peephole=True),
    "gru-layer_norm": dict(mode="gru", layer_norm=True),
    "rnn_tanh-layer_norm": dict(mode="rnn_tanh", layer_norm=True),
    "rnn_relu-layer_norm": dict(mode="rnn_relu", layer_norm=True),
    "lstm-coupled": dict(mode="lstm", coupled_gates=True),
    "lstm-coupled-peephole": dict(mode="lstm", coupled_gates=True, peephole=True),
    "lstm-coupled-peephole-layer_norm": dict(mode="lstm", coupled_gates=True, peephole=True, layer_norm=True),
    "gru-reset_before": dict(mode="gru", reset_after=False),
    "gru-reset_before-bi-L2": dict(mode="gru", reset_after=False, num_layers=2, bidirectional=True),
    "lstm-per_layer-hidden-proj": dict(mode="lstm", num_layers=2, hidden_size=[4, 3], proj_size=[2, 0]),
    "lstm-per_layer-bi-sum": dict(mode="lstm", num_layers=2, hidden_size=[3, 4], proj_size=[2, 3],
                                  bidirectional=True, merge="sum"),
    "gru-per_layer-bi-concat": dict(mode="gru", num_layers=2, hidden_size=[4, 3], bidirectional=True),
    "rnn_tanh-per_layer": dict(mode="rnn_tanh", num_layers=3, hidden_size=[2, 5, 3]),
    "lstm-merge_sum-L2": dict(mode="lstm", num_layers=2, bidirectional=True, merge="sum"),
    "gru-merge_sum-L2": dict(mode="gru", num_layers=2, bidirectional=True, merge="sum"),
    "rnn_tanh-merge_sum": dict(mode="rnn_tanh", bidirectional=True, merge="sum"),
    "lstm-zoneout-pair-eval": dict(mode="lstm", zoneout=(0.3, 0.2)),
    "lstm-zoneout-proj-eval": dict(mode="lstm", zoneout=0.4, proj_size=2),
    "gru-zoneout-eval": dict(mode="gru", zoneout=0.3, bidirectional=True),
    "rnn_tanh-zoneout-eval": dict(mode="rnn_tanh", zoneout=0.5),
    "lstm-all-dropouts-eval": dict(mode="lstm", num_layers=2, dropout=0.3, input_dropout=0.2,
                                   recurrent_dropout=0.25, dropconnect=0.4),
    "gru-all-dropouts-eval": dict(mode="gru", num_layers=2, dropout=0.3, input_dropout=0.2,
                                  recurrent_dropout=0.25, dropconnect=0.4, bidirectional=True),
    "rnn_tanh-all-dropouts-eval": dict(mode="rnn_tanh", num_layers=2, dropout=0.3, input_dropout=0.2,
                                       recurrent_dropout=0.25, dropconnect=0.4),
}
for _mode, _extra in (("lstm", {}), ("gru", {}), ("gru", {"reset_after": False}), ("rnn_tanh", {})):
    for _bias_mode in ("double", "single_input", "single_recurrent", "none"):
        _name = _mode + ("-reset_before" if _extra else "") + f"-bias_{_bias_mode}"
        CASES[_name] = dict(mode=_mode, bias_mode=_bias_mode, bidirectional=True, **_extra)


@pytest.mark.parametrize("options", list(CASES.values()), ids=list(CASES))
def test_gradcheck(options):
    options = dict(options)
    spec = rnnkit.RNNSpec(options.pop("mode"), I, options.pop("hidden_size", H), options.pop("num_layers", 1),
                          **options)
    _check(spec)


@pytest.mark.parametrize(
    "options",
    [
        dict(mode="lstm", num_layers=2, bidirectional=True, peephole=True),
        dict(mode="gru", num_layers=2, bidirectional=True, reset_after=False),
        dict(mode="rnn_tanh", bidirectional=True, layer_norm=True, zoneout=0.3),
        dict(mode="lstm", hidden_size=[4, 3], proj_size=[3, 2], num_layers=2, bidirectional=True, merge="sum"),
    ],
    ids=["lstm-peephole-bi-L2", "gru-reset_before-bi-L2", "rnn_tanh-ln-zoneout-bi", "lstm-per_layer-bi-sum"],
)
def test_gradcheck_with_lengths(options):
    options = dict(options)
    spec = rnnkit.RNNSpec(options.pop("mode"), I, options.pop("hidden_size", H), options.pop("num_layers", 1),
                          **options)
    _check(spec, lengths=torch.tensor([1, 3]))
    _check(spec, lengths=torch.tensor([2, 1]))


# ---- clipping: active for some entries, every value away from the edge -----------------

class _RecordClamps(TorchFunctionMode):
    """Records the input of every clamp the forward performs."""

    def __init__(self):
        super().__init__()
        self.values = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("clamp", "clip"):
            self.values.append(args[0].detach().abs().flatten())
        return func(*args, **(kwargs or {}))


def _clamped_values(spec, weights, x, states, assemble):
    with torch.no_grad(), _RecordClamps() as record:
        rnn(spec, weights, x, assemble(states), training=False, backend="reference")
    return torch.cat(record.values)


def _pick_clip(make_spec, weights_for, x, states_for):
    """A clip value with 0 < (clamped fraction) < 1 and every |value| >= CLIP_MARGIN from it."""
    free = make_spec(None)
    w = weights_for(free)
    states, assemble = states_for(free)
    candidates = _clamped_values(make_spec(1e6), w, x, states, assemble).sort().values
    gaps = candidates[1:] - candidates[:-1]
    for k in gaps.argsort(descending=True).tolist():
        clip = float(candidates[k] + candidates[k + 1]) / 2
        spec = make_spec(clip)
        values = _clamped_values(spec, w, x, states, assemble)
        active = (values > clip).float().mean().item()
        if 0 < active < 1 and (values - clip).abs().min().item() >= CLIP_MARGIN:
            return spec, w, states, assemble, active
    raise AssertionError("no clip value keeps every pre-clamp value away from the edge")


@pytest.mark.parametrize(
    "which,options",
    [
        ("cell_clip", dict()),
        ("cell_clip", dict(peephole=True, layer_norm=True)),
        ("cell_clip", dict(coupled_gates=True, num_layers=2, bidirectional=True)),
        ("proj_clip", dict(proj_size=2)),
        ("proj_clip", dict(proj_size=3, num_layers=2, bidirectional=True, peephole=True)),
    ],
    ids=["cell_clip", "cell_clip-peephole-ln", "cell_clip-coupled-bi-L2", "proj_clip", "proj_clip-bi-L2-peephole"],
)
def test_gradcheck_clip_active_away_from_edge(which, options):
    options = dict(options)
    layers = options.pop("num_layers", 1)

    def make_spec(clip):
        extra = {which: clip} if clip is not None else {}
        return rnnkit.RNNSpec("lstm", I, H, layers, **options, **extra)

    x = (2.0 * torch.randn(T, B, I, dtype=DT))
    weights = {}

    def weights_for(spec):  # large weights so |c| and |h| spread widely
        return weights.setdefault("w", 2.0 * _weights(spec))

    saved = {}

    def states_for(spec):
        if "s" not in saved:
            saved["s"] = _state_tensors(spec, B)
        return saved["s"]

    spec, w, states, assemble, active = _pick_clip(make_spec, weights_for, x, states_for)
    assert 0 < active < 1
    x.requires_grad_(True)
    w = w.clone().requires_grad_(True)
    states = [s.clone().requires_grad_(True) for s in states]

    def f(x, w, *states):
        return _flatten(rnn(spec, w, x, assemble(states), training=False, backend="reference"))

    assert torch.autograd.gradcheck(f, (x, w, *states), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=FAST)
