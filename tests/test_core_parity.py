"""Rung one of truth: the reference stack against torch.nn.LSTM / GRU / RNN.

Outputs, final states, and the gradients of the input, the initial states and every
weight (by torch.nn name), with random upstream gradients on the output AND the final
states. The full cross product of the axes is thinned to a deterministic pairwise cover
per cell variant (every pair of axis values appears together at least once), so every
value of every axis is exercised.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import rnnkit
from helpers import assert_close

T, B, I, H, P = 5, 3, 4, 6, 3
LENGTHS = [4, 5, 2]  # unsorted, max == T (a PackedSequence pads back to max(lengths))

VARIANTS = {  # id -> (torch.nn class, rnnkit class, constructor kwargs)
    "lstm": (torch.nn.LSTM, rnnkit.LSTM, {}),
    "lstm-proj": (torch.nn.LSTM, rnnkit.LSTM, {"proj_size": P}),
    "gru": (torch.nn.GRU, rnnkit.GRU, {}),
    "rnn-tanh": (torch.nn.RNN, rnnkit.RNN, {"nonlinearity": "tanh"}),
    "rnn-relu": (torch.nn.RNN, rnnkit.RNN, {"nonlinearity": "relu"}),
}
AXES = {
    "dtype": [torch.float32, torch.float64],
    "layers": [1, 2, 3],
    "bidir": [False, True],
    "batch_first": [False, True],
    "init": [False, True],
    "input": ["tensor", "packed", "lengths"],
}


def pairwise_cover(axes: dict) -> list:
    """A deterministic greedy covering array of strength 2 over the axes' values."""
    names = list(axes)
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(range(len(names)), 2)
        for va in range(len(axes[names[a]]))
        for vb in range(len(axes[names[b]]))
    }
    candidates = list(itertools.product(*(range(len(axes[n])) for n in names)))
    rows = []
    while uncovered:
        def gain(row):
            return sum((a, row[a], b, row[b]) in uncovered for a, b in itertools.combinations(range(len(names)), 2))

        best = max(candidates, key=gain)  # max keeps the first of equals: deterministic
        uncovered -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(range(len(names)), 2)}
        rows.append({n: axes[n][v] for n, v in zip(names, best)})
    return rows


def _case_id(variant: str, row: dict) -> str:
    return "-".join([
        variant,
        "f32" if row["dtype"] == torch.float32 else "f64",
        f"L{row['layers']}",
        "bi" if row["bidir"] else "uni",
        "bf" if row["batch_first"] else "tf",
        "h0" if row["init"] else "nohx",
        row["input"],
    ])


CASES = [(variant, row) for variant in VARIANTS for row in pairwise_cover(AXES)]


def test_cover_has_every_value_of_every_axis():
    for variant in VARIANTS:
        rows = [row for v, row in CASES if v == variant]
        for axis, values in AXES.items():
            assert {repr(r[axis]) for r in rows} == {repr(v) for v in values}, (variant, axis)


def _twins(variant: str, row: dict):
    torch_cls, kit_cls, kwargs = VARIANTS[variant]
    common = dict(num_layers=row["layers"], bidirectional=row["bidir"], batch_first=row["batch_first"], **kwargs)
    reference = torch_cls(I, H, **common).to(row["dtype"])
    module = kit_cls(I, H, **common).to(row["dtype"])
    module.load_state_dict(reference.state_dict(), strict=True)
    return reference, module


@pytest.mark.parametrize("variant,row", CASES, ids=[_case_id(v, r) for v, r in CASES])
def test_matches_torch_nn(variant, row):
    dtype, lstm = row["dtype"], variant.startswith("lstm")
    reference, module = _twins(variant, row)
    D, L = 2 if row["bidir"] else 1, row["layers"]
    Hr = P if variant == "lstm-proj" else H
    x = torch.randn((B, T, I) if row["batch_first"] else (T, B, I), dtype=dtype, requires_grad=True)
    states = []
    if row["init"]:
        states = [torch.randn(L * D, B, Hr, dtype=dtype, requires_grad=True)]
        if lstm:
            states.append(torch.randn(L * D, B, H, dtype=dtype, requires_grad=True))
    hx = None if not states else (tuple(states) if lstm else states[0])
    lengths = torch.tensor(LENGTHS)

    # torch.nn: a tensor, or the padded batch packed with enforce_sorted=False
    if row["input"] == "tensor":
        y_ref, hy_ref = reference(x, hx)
        y_kit, hy_kit = module(x, hx)
    else:
        packed = pack_padded_sequence(x, lengths, batch_first=row["batch_first"], enforce_sorted=False)
        y_ref, hy_ref = reference(packed, hx)
        if row["input"] == "packed":
            y_kit, hy_kit = module(packed, hx)
            assert isinstance(y_kit, PackedSequence)
            assert torch.equal(y_kit.batch_sizes, y_ref.batch_sizes)
            assert torch.equal(y_kit.sorted_indices, y_ref.sorted_indices)
            assert torch.equal(y_kit.unsorted_indices, y_ref.unsorted_indices)
            y_ref, y_kit = y_ref.data, y_kit.data
        else:
            y_ref, _ = pad_packed_sequence(y_ref, batch_first=row["batch_first"], total_length=T)
            y_kit, hy_kit = module(x, hx, lengths=lengths)

    finals_ref = list(hy_ref) if lstm else [hy_ref]
    finals_kit = list(hy_kit) if lstm else [hy_kit]
    assert_close(y_kit, y_ref, "y")
    assert_close(finals_kit, finals_ref, "h_n/c_n")

    # random upstream gradients on the output and on every final state
    upstream = [torch.randn_like(y_ref)] + [torch.randn_like(f) for f in finals_ref]
    names = [name for name, _ in reference.named_parameters()]
    grads_ref = torch.autograd.grad([y_ref] + finals_ref, [x] + states + list(reference.parameters()), upstream,
                                    retain_graph=True)  # a packed input's graph is shared
    grads_kit = torch.autograd.grad([y_kit] + finals_kit, [x] + states + [module.flat_weights], upstream)
    n_data = 1 + len(states)
    assert_close(grads_kit[:n_data], grads_ref[:n_data], "d(x, h0, c0)")
    kit_weight_grads = module.layout.named_views(grads_kit[-1])
    assert set(kit_weight_grads) == set(names)
    for name, grad_ref in zip(names, grads_ref[n_data:]):
        assert_close(kit_weight_grads[name], grad_ref, f"d{name}")
