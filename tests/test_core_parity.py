"""Rung one of truth: the reference backend against torch.nn.LSTM / GRU / RNN.

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
    module = kit_cls(I, H, backend="reference", **common).to(row["dtype"])
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
    kit_names = [name for name, _ in module.named_parameters()]
    grads_kit = torch.autograd.grad([y_kit] + finals_kit, [x] + states + list(module.parameters()), upstream)
    n_data = 1 + len(states)
    assert_close(grads_kit[:n_data], grads_ref[:n_data], "d(x, h0, c0)")
    kit_weight_grads = dict(zip(kit_names, grads_kit[n_data:]))
    assert set(kit_weight_grads) == set(names)
    for name, grad_ref in zip(names, grads_ref[n_data:]):
        assert_close(kit_weight_grads[name], grad_ref, f"d{name}")


# ---- per-layer sizes: a stack is its layers run one by one --------------------------------

PER_LAYER = {
    "lstm-proj-concat": (rnnkit.LSTM, dict(hidden_size=[6, 5, 4], proj_size=[3, 0, 2], merge="concat")),
    "lstm-proj-sum": (rnnkit.LSTM, dict(hidden_size=[6, 5, 4], proj_size=[3, 0, 2], merge="sum")),
    "lstm-peephole-ln-sum": (rnnkit.LSTM, dict(hidden_size=[4, 6], proj_size=[2, 3], merge="sum", peephole=True,
                                               layer_norm=True)),
    "gru-concat": (rnnkit.GRU, dict(hidden_size=[6, 3], merge="concat")),
    "gru-sum": (rnnkit.GRU, dict(hidden_size=[6, 3], merge="sum", reset_after=False)),
    "rnn-concat": (rnnkit.RNN, dict(hidden_size=[3, 5, 2], merge="concat")),
    "rnn-sum": (rnnkit.RNN, dict(hidden_size=[3, 5, 2], merge="sum")),
}


@pytest.mark.parametrize("variant", list(PER_LAYER))
def test_per_layer_stack_equals_layers_one_by_one(variant):
    cls, options = PER_LAYER[variant]
    options = dict(options)
    hidden, proj = options.pop("hidden_size"), options.pop("proj_size", None)
    L, lstm = len(hidden), cls is rnnkit.LSTM
    extra = {"proj_size": proj} if proj else {}
    stack = cls(I, hidden, L, bidirectional=True, backend="reference", dtype=torch.float64, **extra, **options)
    with torch.no_grad():
        stack.flat_weights.normal_(0, 0.4)
    spec = stack.spec
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    hs = [torch.randn(2, B, spec.output_size(k), dtype=torch.float64) for k in range(L)]
    cs = [torch.randn(2, B, spec.hidden_sizes[k], dtype=torch.float64) for k in range(L)]
    y, hy = stack(x, (hs, cs) if lstm else hs)
    upstream = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, upstream)

    layer_input = x.detach().requires_grad_(True)
    first_input = layer_input
    state = stack.state_dict()
    for k in range(L):
        single_extra = {"proj_size": proj[k]} if proj else {}
        single = cls(spec.layer_input_size(k), hidden[k], 1, bidirectional=True, backend="reference",
                     dtype=torch.float64, **single_extra, **options)
        suffix = f"_l{k}"
        single.load_state_dict(
            {n.replace(suffix, "_l0"): v for n, v in state.items() if n.endswith(suffix) or n.endswith(suffix + "_reverse")},
            strict=True,
        )
        layer_input, hy_k = single(layer_input, (hs[k], cs[k]) if lstm else hs[k])
        if lstm:
            assert_close((hy[0][k], hy[1][k]), hy_k, f"layer {k} (h_n, c_n)")
        else:
            assert_close(hy[k], hy_k, f"layer {k} h_n")
    assert_close(y, layer_input, "y")
    (dx_single,) = torch.autograd.grad(layer_input, first_input, upstream)
    assert_close(dx, dx_single, "dx")


# ---- unbatched input, as torch.nn -----------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch_first", [False, True], ids=["tf", "bf"])
def test_unbatched_matches_torch_nn(variant, batch_first):
    row = dict(layers=2, bidir=True, batch_first=batch_first, dtype=torch.float64)
    reference, module = _twins(variant, row)
    Hr = P if variant == "lstm-proj" else H
    x = torch.randn(T, I, dtype=torch.float64)
    hx = torch.randn(4, Hr, dtype=torch.float64)
    if variant.startswith("lstm"):
        hx = (hx, torch.randn(4, H, dtype=torch.float64))
    with torch.no_grad():
        y_ref, hy_ref = reference(x, hx)
        y, hy = module(x, hx)
    assert_close(y, y_ref, "y")
    assert_close(hy, hy_ref, "final states")


# ---- where torch.nn has no twin: docs/spec.md's equations, written out independently -----------

def _ln(v, gain, shift):
    mean = v.mean(-1, keepdim=True)
    var = ((v - mean) ** 2).mean(-1, keepdim=True)  # biased variance, eps 1e-5 (docs/spec.md)
    return (v - mean) / torch.sqrt(var + 1e-5) * gain + shift


def _spec_step(mode, o, p, x, h, c):
    """One step of docs/spec.md's cell; ``o`` the options, ``p`` the module's named weights (suffix-free)."""
    get = lambda name: p.get(name)  # noqa: E731
    a_x, a_h = x @ p["weight_ih"].T, h @ p["weight_hh"].T
    if o.get("layer_norm"):
        a_x = _ln(a_x, p["layer_norm_ih_weight"], p["layer_norm_ih_bias"])
        a_h = _ln(a_h, p["layer_norm_hh_weight"], p["layer_norm_hh_bias"])
    b_W = get("bias_ih") if get("bias_ih") is not None else 0.0
    b_R = get("bias_hh") if get("bias_hh") is not None else 0.0
    if mode == "lstm":
        a = a_x + b_W + a_h + b_R
        peep = get("weight_peephole")
        if o.get("coupled_gates"):
            a_i, a_g, a_o = a.chunk(3, -1)
            p_i, p_o = (peep[0], peep[1]) if peep is not None else (0.0, 0.0)
            i = torch.sigmoid(a_i + p_i * c)
            f = 1 - i
        else:
            a_i, a_f, a_g, a_o = a.chunk(4, -1)
            p_i, p_f, p_o = (peep[0], peep[1], peep[2]) if peep is not None else (0.0, 0.0, 0.0)
            i, f = torch.sigmoid(a_i + p_i * c), torch.sigmoid(a_f + p_f * c)
        c = f * c + i * torch.tanh(a_g)
        if o.get("cell_clip"):
            c = torch.clamp(c, -o["cell_clip"], o["cell_clip"])
        c_out = _ln(c, p["layer_norm_c_weight"], p["layer_norm_c_bias"]) if o.get("layer_norm") else c
        h = torch.sigmoid(a_o + p_o * c) * torch.tanh(c_out)
        if get("weight_hr") is not None:
            h = h @ p["weight_hr"].T
            if o.get("proj_clip"):
                h = torch.clamp(h, -o["proj_clip"], o["proj_clip"])
        return h, c
    if mode == "gru":
        Hh = h.shape[-1]
        b_W = b_W if isinstance(b_W, torch.Tensor) else torch.zeros(3 * Hh, dtype=x.dtype)
        b_R = b_R if isinstance(b_R, torch.Tensor) else torch.zeros(3 * Hh, dtype=x.dtype)
        xr, xz, xn = (a_x + b_W).chunk(3, -1)
        if o.get("reset_after", True):
            hr, hz, hn = (a_h + b_R).chunk(3, -1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
        else:
            R = p["weight_hh"]
            hr, hz = (h @ R[: 2 * Hh].T + b_R[: 2 * Hh]).chunk(2, -1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + (r * h) @ R[2 * Hh:].T + b_R[2 * Hh:])
        return (1 - z) * n + z * h, None
    act = torch.tanh if mode == "rnn_tanh" else torch.relu
    return act(a_x + b_W + a_h + b_R), None


SPEC_CASES = {
    "lstm-peephole": ("lstm", dict(peephole=True)),
    "lstm-coupled": ("lstm", dict(coupled_gates=True)),
    "lstm-coupled-peephole": ("lstm", dict(coupled_gates=True, peephole=True)),
    "lstm-layer_norm": ("lstm", dict(layer_norm=True)),
    "lstm-layer_norm-proj-peephole": ("lstm", dict(layer_norm=True, proj_size=3, peephole=True)),
    "lstm-cell_clip": ("lstm", dict(cell_clip=0.3)),
    "lstm-proj_clip": ("lstm", dict(proj_size=3, proj_clip=0.05)),
    "lstm-single_input": ("lstm", dict(bias_mode="single_input")),
    "lstm-single_recurrent-coupled": ("lstm", dict(bias_mode="single_recurrent", coupled_gates=True)),
    "gru-reset_before": ("gru", dict(reset_after=False)),
    "gru-reset_before-single_input": ("gru", dict(reset_after=False, bias_mode="single_input")),
    "gru-reset_before-single_recurrent": ("gru", dict(reset_after=False, bias_mode="single_recurrent")),
    "gru-reset_before-none": ("gru", dict(reset_after=False, bias_mode="none")),
    "gru-single_recurrent": ("gru", dict(bias_mode="single_recurrent")),
    "gru-layer_norm": ("gru", dict(layer_norm=True)),
    "rnn_tanh-layer_norm": ("rnn_tanh", dict(layer_norm=True)),
    "rnn_relu-layer_norm-single_input": ("rnn_relu", dict(layer_norm=True, bias_mode="single_input")),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_options_follow_the_spec_equations(case):
    mode, options = SPEC_CASES[case]
    spec = rnnkit.RNNSpec(mode, I, H, bidirectional=True, **options)
    layout = rnnkit.Layout(spec, suffixes=True)
    w = layout.new_buffer(dtype=torch.float64) + 0.3 * torch.randn(layout.numel, dtype=torch.float64)
    x = torch.randn(T, B, I, dtype=torch.float64)
    Hr = spec.output_size(0)
    h0, c0 = torch.randn(2, B, Hr, dtype=torch.float64), torch.randn(2, B, H, dtype=torch.float64)
    lstm = mode == "lstm"
    y, hy = rnnkit.rnn(spec, w, x, (h0, c0) if lstm else h0, backend="reference")
    expected_y, finals = [], []
    for direction, suffix in ((0, "_l0"), (1, "_l0_reverse")):
        p = {e.piece: layout.view(w, e.name) for e in layout if e.name.endswith(suffix) and e.direction == direction}
        h, c, ys = h0[direction], c0[direction], [None] * T
        for t in (range(T) if direction == 0 else reversed(range(T))):
            h, c = _spec_step(mode, options, p, x[t], h, c)
            ys[t] = h
        expected_y.append(torch.stack(ys))
        finals.append((h, c))
    assert_close(y, torch.cat(expected_y, -1), "y")
    h_n = hy[0] if lstm else hy
    assert_close(h_n, torch.stack([f[0] for f in finals]), "h_n")
    if lstm:
        assert_close(hy[1], torch.stack([f[1] for f in finals]), "c_n")
    if "clip" in case:  # the clip must actually bite somewhere for the case to mean anything
        limit = options.get("cell_clip") or options.get("proj_clip")
        values = hy[1] if "cell_clip" in case else y
        assert (values.abs() == limit).any()


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_merge_sum_is_the_sum_of_directions(mode):
    concat = rnnkit.RNNSpec(mode, I, H, bidirectional=True)
    summed = rnnkit.RNNSpec(mode, I, H, bidirectional=True, merge="sum")
    w = rnnkit.Layout(concat).new_buffer(dtype=torch.float64)
    assert rnnkit.Layout(summed).numel == w.numel()
    x = torch.randn(T, B, I, dtype=torch.float64)
    y_cat, hy_cat = rnnkit.rnn(concat, w, x, backend="reference", lengths=[5, 2, 3])
    y_sum, hy_sum = rnnkit.rnn(summed, w, x, backend="reference", lengths=[5, 2, 3])
    assert_close(y_sum, y_cat[..., :H] + y_cat[..., H:], "y")
    assert_close(hy_sum, hy_cat, "final states")


@pytest.mark.parametrize("variant", ["lstm-proj", "gru", "rnn-tanh"])
def test_sorted_packed_sequence_matches_torch_nn(variant):
    row = dict(layers=2, bidir=True, batch_first=False, dtype=torch.float64)
    reference, module = _twins(variant, row)
    x = torch.randn(T, B, I, dtype=torch.float64)
    packed = pack_padded_sequence(x, [5, 4, 2], enforce_sorted=True)
    with torch.no_grad():
        y_ref, hy_ref = reference(packed)
        y, hy = module(packed)
    assert y.sorted_indices is None and torch.equal(y.batch_sizes, y_ref.batch_sizes)
    assert_close(y.data, y_ref.data, "y")
    assert_close(hy, hy_ref, "final states")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("steps,batch,hidden", [(1, 1, 37), (1, 4, 6), (9, 1, 5)], ids=["T1-B1-H37", "T1", "B1"])
def test_awkward_shapes_match_torch_nn(variant, steps, batch, hidden):
    torch_cls, kit_cls, kwargs = VARIANTS[variant]
    reference = torch_cls(I, hidden, 2, bidirectional=True, **kwargs).double()
    module = kit_cls(I, hidden, 2, bidirectional=True, backend="reference", **kwargs).double()
    module.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(steps, batch, I, dtype=torch.float64, requires_grad=True)
    y_ref, hy_ref = reference(x)
    y, hy = module(x)
    assert_close(y, y_ref, "y")
    assert_close(hy, hy_ref, "final states")
    upstream = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x] + list(module.parameters()), upstream)
    grads_ref = torch.autograd.grad(y_ref, [x] + list(reference.parameters()), upstream)
    assert_close(grads[0], grads_ref[0], "dx")
    views = dict(zip([name for name, _ in module.named_parameters()], grads[1:]))
    for (name, _), grad_ref in zip(reference.named_parameters(), grads_ref[1:]):
        assert_close(views[name], grad_ref, f"d{name}")


# ---- torch.nn.RNNBase's helpers (_flat_weights, check_forward_args, permute_hidden, ...) ------

HELPER_CONFIGS = {
    "lstm-proj-bi": (torch.nn.LSTM, rnnkit.LSTM, dict(num_layers=2, bidirectional=True, proj_size=P)),
    "gru-batch_first": (torch.nn.GRU, rnnkit.GRU, dict(num_layers=2, batch_first=True)),
    "rnn-no-bias": (torch.nn.RNN, rnnkit.RNN, dict(bias=False)),
}


def _helper_pair(config):
    torch_cls, kit_cls, kwargs = HELPER_CONFIGS[config]
    reference = torch_cls(I, H, **kwargs)
    module = kit_cls(I, H, backend="reference", **kwargs)
    module.load_state_dict(reference.state_dict())
    return reference, module


@pytest.mark.parametrize("config", sorted(HELPER_CONFIGS))
def test_rnnbase_helpers_match_torch_nn(config):
    """Code written against torch.nn.RNNBase (subclasses that override forward, introspection
    over _flat_weights) reads the same names, values and shapes, and gets the same errors."""
    reference, module = _helper_pair(config)
    assert module._flat_weights_names == reference._flat_weights_names
    assert module._all_weights == reference._all_weights
    assert [w.shape for w in module._flat_weights] == [w.shape for w in reference._flat_weights]
    assert all(torch.equal(a, b) for a, b in zip(module._flat_weights, reference._flat_weights))

    x = torch.randn(B, T, I) if reference.batch_first else torch.randn(T, B, I)
    _, hidden = reference(x)
    assert module.get_expected_hidden_size(x, None) == reference.get_expected_hidden_size(x, None)
    module.check_forward_args(x, hidden, None)  # the module's own final state fits
    packed = pack_padded_sequence(x, [T, 2, 1], batch_first=reference.batch_first)
    assert module.get_expected_hidden_size(packed.data, packed.batch_sizes) == \
        reference.get_expected_hidden_size(packed.data, packed.batch_sizes)
    module.check_forward_args(packed.data, hidden, packed.batch_sizes)

    permutation = torch.tensor([2, 0, 1])
    got = torch.utils._pytree.tree_leaves(module.permute_hidden(hidden, permutation))
    want = torch.utils._pytree.tree_leaves(reference.permute_hidden(hidden, permutation))
    assert len(got) == len(want) == (2 if isinstance(hidden, tuple) else 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert module.permute_hidden(hidden, None) is hidden

    lstm = isinstance(hidden, tuple)
    bad_states = [(hidden[0][:, :2], hidden[1]), (hidden[0], hidden[1][:, :2])] if lstm else [hidden[:, :2]]
    bad_inputs = [x[..., :2], x.double()]
    for bad in bad_states:
        with pytest.raises(RuntimeError):
            reference.check_forward_args(x, bad, None)
        with pytest.raises(RuntimeError, match="size"):
            module.check_forward_args(x, bad, None)
    for bad in bad_inputs:
        with pytest.raises(Exception) as expected:
            reference.check_forward_args(bad, hidden, None)
        with pytest.raises(type(expected.value)):
            module.check_forward_args(bad, hidden, None)


def test_rnnbase_helpers_take_the_unbatched_state_the_call_takes():
    module = rnnkit.LSTM(I, H, 2, backend="reference")
    x = torch.randn(T, I)
    _, hidden = module(x)
    assert module.get_expected_hidden_size(x) == tuple(hidden[0].shape) == (2, H)
    module.check_forward_args(x, hidden, None)


def test_rnnbase_helpers_with_per_layer_sizes():
    module = rnnkit.LSTM(I, [H, 5], 2, bidirectional=True, proj_size=[3, 2], backend="reference")
    x = torch.randn(T, B, I)
    _, hidden = module(x)
    assert module.get_expected_hidden_size(x) == [tuple(h.shape) for h in hidden[0]]
    assert module.get_expected_cell_size(x) == [tuple(c.shape) for c in hidden[1]]
    module.check_forward_args(x, hidden, None)
    with pytest.raises(RuntimeError, match=r"hidden\[1\]\[1\]"):
        module.check_forward_args(x, (hidden[0], [hidden[1][0], hidden[1][1][:, :2]]), None)
    permuted = module.permute_hidden(hidden, torch.tensor([1, 2, 0]))
    assert torch.equal(permuted[1][1], hidden[1][1][:, [1, 2, 0]])
