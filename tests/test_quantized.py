"""int8 dynamic quantization (rnnkit.quantize) for every option.

Two rungs, as for the float kernels:

- the int8 kernels against the int8 reference (`rnnkit.testing.int8_reference`: the reference
  backend on the dequantized weights, each GEMM's input rounded to the int8 grid per row): the
  integer GEMM is exact, so they agree to float32 rounding (fp32's tolerance), every option;
- int8 against float32, per layer, on realistic sizes, within `INT8_TOLERANCE`.

Kernel buffers are NaN-poisoned as in test_fused.py.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import rnnkit
from rnnkit.fused import build
from rnnkit.testing import INT8_TOLERANCE, assert_close, int8_reference, rel_rms
from helpers import flatten, make_module, map_tree, random_states, require_fused_kernels
from test_fused import AWKWARD, CASES

EXACT = INT8_TOLERANCE["int8_reference"]  # against int8_reference (rnnkit/testing.py says why not 1e-5)
INT8 = INT8_TOLERANCE["float"]  # against float32, per layer


@pytest.fixture(autouse=True, scope="module")
def poisoned_kernel_buffers():
    require_fused_kernels()
    build.set_poison(True)
    yield
    build.set_poison(False)


def quantized_pair(mode, I=5, H=7, **options):
    module = make_module(mode, I, H, torch.float32, **options).eval()
    return module, rnnkit.quantize(module)


def assert_matches_int8_reference(mode, T=6, B=3, I=5, H=7, lengths=None, batch_first=False, **options):
    module, q = quantized_pair(mode, I, H, batch_first=batch_first, **options)
    x = torch.randn(*((B, T) if batch_first else (T, B)), I)
    hx = map_tree(random_states(module, B), lambda t: t.float())
    lens = None if lengths is None else torch.tensor(lengths)
    with torch.no_grad():
        y, hy = q(x, hx, lens)
    y_ref, hy_ref = int8_reference(q, x, hx, lens)
    assert_close(y, y_ref, "y", tol=EXACT)
    assert_close(hy, hy_ref, "final states", tol=EXACT)


@pytest.mark.parametrize("mode, options", CASES)
def test_matches_int8_reference(mode, options):
    assert_matches_int8_reference(mode, **options)


@pytest.mark.parametrize("mode, options", CASES)
def test_matches_int8_reference_with_lengths(mode, options):
    assert_matches_int8_reference(mode, T=9, B=4, lengths=[9, 3, 1, 6], **options)


@pytest.mark.parametrize("shape", list(AWKWARD))
@pytest.mark.parametrize("mode, options", [
    pytest.param("lstm", dict(peephole=True, layer_norm=True, proj_size=4, bidirectional=True), id="lstm"),
    pytest.param("gru", dict(reset_after=False, bidirectional=True), id="gru_reset_before"),
    pytest.param("rnn_relu", dict(layer_norm=True), id="rnn"),
])
def test_awkward_shapes(mode, options, shape):
    assert_matches_int8_reference(mode, **{**options, **AWKWARD[shape]})


# one step of up to 8 rows: M unpacked, row by row; 9 rows or T > 1: packed; 64: blocks of rows
@pytest.mark.parametrize("T, B", [(1, 1), (1, 5), (1, 9), (4, 1), (4, 5), (4, 64)])
@pytest.mark.parametrize("H", [37, 300])  # tails; large enough to split across threads
def test_kernel_paths(T, B, H):
    assert_matches_int8_reference("lstm", T=T, B=B, I=33, H=H, proj_size=11, layer_norm=True)


def test_segmented_variable_lengths():
    """Lengths spread out, H >= 256: the batch runs sorted, in time spans (functional.Segments)."""
    module, q = quantized_pair("lstm", I=16, H=256)
    x = torch.randn(40, 8, 16)
    lengths = torch.tensor([40, 5, 33, 12, 20, 40, 7, 26])
    with torch.no_grad():
        y, hy = q(x, lengths=lengths)
    y_ref, hy_ref = int8_reference(q, x, lengths=lengths)
    assert_close(y, y_ref, "y", tol=EXACT)
    assert_close(hy, hy_ref, "final states", tol=EXACT)


def test_packed_sequence():
    module, q = quantized_pair("gru", I=6, H=9, bidirectional=True)
    seqs = [torch.randn(n, 6) for n in (5, 2, 7)]
    packed = nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
    with torch.no_grad():
        out, h = q(packed)
    ref_out, ref_h = int8_reference(q, packed)
    assert isinstance(out, nn.utils.rnn.PackedSequence)
    assert_close(out.data, ref_out.data, "packed output", tol=EXACT)
    assert_close(h, ref_h, "h_n", tol=EXACT)


@pytest.mark.parametrize("mode, options", [
    pytest.param("lstm", dict(peephole=True, proj_size=5, layer_norm=True, zoneout=0.2), id="lstm"),
    pytest.param("gru", dict(reset_after=False), id="gru_reset_before"),
    pytest.param("rnn_tanh", {}, id="rnn"),
])
@pytest.mark.parametrize("batch", [0, 3], ids=["unbatched", "batched"])
def test_cells(mode, options, batch):
    """A quantized cell is the one-step, one-layer quantized stack, with or without a state."""
    cls = {"lstm": rnnkit.LSTMCell, "gru": rnnkit.GRUCell, "rnn_tanh": rnnkit.RNNCell}[mode]
    stack_cls = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU, "rnn_tanh": rnnkit.RNN}[mode]
    cell = cls(8, 12, **options).eval()
    stack = stack_cls(8, 12, **options).eval()
    stack.load_state_dict({k + "_l0": v for k, v in cell.state_dict().items()})
    q_cell, q_stack = rnnkit.quantize(cell), rnnkit.quantize(stack)
    x = torch.randn(8) if batch == 0 else torch.randn(batch, 8)
    lead = () if batch == 0 else (batch,)
    Hr = 5 if options.get("proj_size") else 12
    h = torch.randn(*lead, Hr)
    hx = (h, torch.randn(*lead, 12)) if mode == "lstm" else h
    for state in (None, hx):
        with torch.no_grad():
            out = q_cell(x, state)
            stack_state = None if state is None else map_tree(state, lambda t: t.unsqueeze(0))
            _, expected = q_stack(x.unsqueeze(0), stack_state)
        expected = map_tree(expected, lambda t: t[0])
        assert_close(out, expected, "cell step", tol=EXACT)
        ref = map_tree(int8_reference(q_stack, x.unsqueeze(0), stack_state)[1], lambda t: t[0])
        assert_close(out, ref, "cell step vs int8 reference", tol=EXACT)


@pytest.mark.parametrize("mode, options", [
    pytest.param("lstm", {}, id="lstm"),
    pytest.param("lstm", dict(peephole=True, layer_norm=True), id="lstm-peephole_ln"),
    pytest.param("lstm", dict(proj_size=32, bidirectional=True), id="lstm-proj_bidirectional"),
    pytest.param("lstm", dict(proj_size=32, layer_norm=True), id="lstm-proj_ln"),
    pytest.param("gru", {}, id="gru"),
    pytest.param("gru", dict(reset_after=False), id="gru-reset_before"),
    pytest.param("gru", dict(layer_norm=True), id="gru-ln"),
    pytest.param("rnn_tanh", {}, id="rnn"),
])
def test_close_to_float32_per_layer(mode, options):
    """Each layer's output, run on the float layer's input, against float32 (INT8_TOLERANCE).

    Over 5 steps: the quantization's error, not what the dynamics make of it. An untrained
    layer-normalized LSTM amplifies any perturbation of its weights over time (its error grows
    from 0.5% at step 0 to 5% at step 30 with the weights alone rounded to int8); the trained
    char LM's bits/char (README) measure what that costs on a real model."""
    module = make_module(mode, 64, 128, torch.float32, num_layers=2, **options).eval()
    q = rnnkit.quantize(module)
    x = torch.randn(5, 8, 64)
    with torch.no_grad():
        errors = []
        for layer in range(2):
            single = make_module(mode, module.spec.layer_input_size(layer), 128, torch.float32,
                                 **options).eval()
            single.load_state_dict({k.replace(f"_l{layer}", "_l0"): v for k, v in module.state_dict().items()
                                    if f"_l{layer}" in k})
            q_single = rnnkit.quantize(single)
            y, hy = single(x)
            yq, hyq = q_single(x)
            errors.append(max(rel_rms(a, e) for a, e in zip([yq, *flatten(hyq)], [y, *flatten(hy)])))
            x = y  # the next layer runs on the float layer's output
        print(f"per-layer relative RMS errors {errors}")
        assert max(errors) <= INT8, f"per-layer relative RMS errors {errors}"
    # the whole stack too (errors compound, but stay small)
    x = torch.randn(5, 8, 64)
    with torch.no_grad():
        assert rel_rms(q(x)[0], module(x)[0]) <= 2 * INT8


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode, options", [
    pytest.param("lstm", dict(num_layers=3, peephole=True, layer_norm=True, proj_size=5), id="lstm"),
    pytest.param("gru", dict(num_layers=2, reset_after=False, batch_first=True), id="gru_reset_before"),
])
def test_one_step_calls_of_a_stack_equal_one_call(mode, options, batch):
    """A generation loop over an int8 stack (T calls of one step, the state carried) runs the int8
    one-step plans, layer by layer, and equals one call over the T steps (whose products read M
    packed; a one-step call's read it as it is: for one row, 512-bit loops on AVX512-VNNI)."""
    module, q = quantized_pair(mode, I=8, H=12, **options)
    batch_first = options.get("batch_first", False)
    x = torch.randn(batch, 6, 8) if batch_first else torch.randn(6, batch, 8)
    with torch.no_grad():
        y, hy = q(x)
        general_run = q._run
        q._run = lambda *args: pytest.fail("a one-step call left the plans for the general path")
        state, outputs = None, []
        for t in range(6):
            out, state = q(x[:, t:t + 1] if batch_first else x[t:t + 1], state)
            outputs.append(out)
        q._run = general_run
    assert len(q.__dict__["_plan"][0]) == options["num_layers"]
    assert_close(torch.cat(outputs, 1 if batch_first else 0), y, "outputs", tol=EXACT)
    assert_close(state, hy, "final state", tol=EXACT)


@pytest.mark.parametrize("mode, options", [
    pytest.param("lstm", dict(num_layers=3, peephole=True, layer_norm=True, proj_size=5, zoneout=0.2), id="lstm"),
    pytest.param("gru", dict(num_layers=2, reset_after=False, batch_first=True), id="gru_reset_before"),
    pytest.param("rnn_relu", dict(num_layers=2), id="rnn_relu"),
])
def test_sequence_calls_run_on_the_plans_and_equal_the_general_path(mode, options, monkeypatch):
    """A call over many steps runs each layer's pass through its plan (nn.planned_call), with the
    general path's outputs and final states bit for bit (batches of 1, 3 and 7 rows, from no state
    and from a given one)."""
    _, q = quantized_pair(mode, I=8, H=12, **options)
    batch_first = options.get("batch_first", False)
    general = q._run
    for batch in (1, 3, 7):
        x = torch.randn(batch, 6, 8) if batch_first else torch.randn(6, batch, 8)
        with torch.no_grad():
            hx = q(x)[1]
            q._run = lambda *args: pytest.fail("a sequence call left the plans for the general path")
            got = [q(x), q(x, hx)]
            q._run = general
            with monkeypatch.context() as patch:
                patch.setattr(rnnkit.quantized, "planned_call", lambda *args: None)
                want = [q(x), q(x, hx)]
        for a, b in zip(got, want):
            for u, v in zip(flatten(a), flatten(b)):
                assert torch.equal(u, v) and u.stride() == v.stride()


def test_qgemm_is_exact():
    """The int8 GEMM against an int64 computation of the same quantization, odd shapes, zero rows."""
    extension = build.extension()
    # one row: blocks of 8 panels (64 columns) and a partial one (200 = 3 · 64 + 8)
    # and the 512-bit loops (AVX512-VNNI): one row, K in 1 to 8 chunks of 64 held in registers, cut or
    # whole, or more (read from memory), N in blocks of 16 rows and a partial one; 2 to 8 rows, in
    # blocks of 1 to 4 rows against 3 to 8 rows of M
    for rows, N, K in [(1, 5, 37), (1, 200, 70), (1, 150, 150), (1, 1024, 256), (1, 17, 300), (1, 19, 350),
                       (1, 21, 420), (1, 23, 500), (1, 17, 64), (1, 16, 513), (1, 33, 600), (1, 48, 1100), (3, 37, 33), (5, 148, 100), (4, 31, 200), (8, 17, 513), (7, 10, 64),
                       (64, 1024, 256), (2, 3, 1), (37, 40, 130), (100, 24, 1100), (17, 9, 64)]:
        X = torch.randn(rows, K) * 3
        if rows > 1:
            X[0, :] = 0  # a zero row: scale 0, zeros out
        M = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        M[0, :] = 127
        scale = torch.rand(N) + 0.1
        C = extension.qgemm(X, M, scale)
        for name in extension.int8_kernels():  # every kernel this CPU runs, emulated VNNI among them
            with int8_kernel(name):
                assert torch.equal(extension.qgemm(X, M, scale), C), name
                assert torch.equal(extension.qgemm_packed(X, extension.q_pack(M, scale), scale), C), name
                assert torch.equal(extension.qgemv(X[-1].contiguous(), M, scale), C[-1]), name
                assert torch.equal(extension.qgemm_unpacked(X, M, scale), C), name
        amax = X.abs().amax(1, keepdim=True)
        q = torch.round(X * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))).long()
        acc = q @ M.long().T
        expected = (amax / 127.0) * scale * acc.float()
        torch.testing.assert_close(C, expected, rtol=1e-6, atol=0)
        for r in range(min(rows, 2)):  # the one-row kernel on M unpacked: the same bits as the packed one
            assert torch.equal(extension.qgemv(X[r].contiguous(), M, scale), C[r])
        assert torch.equal(extension.qgemm_unpacked(X, M, scale), C)  # several rows, M unpacked
        assert torch.equal(extension.qgemv(torch.zeros(K), M, scale), torch.zeros(N))  # one zero row
    # the largest products everywhere: sums that would overflow int16 pairs must not saturate
    X = torch.full((4, 512), -2.0)
    M = torch.full((8, 512), -127, dtype=torch.int8)
    for name in extension.int8_kernels():
        with int8_kernel(name):
            C = extension.qgemm(X, M, torch.ones(8))
            torch.testing.assert_close(C, torch.full((4, 8), 2.0 / 127 * 127 * 127 * 512))


@contextlib.contextmanager
def int8_kernel(name):
    """Run the int8 products on `name`'s kernels inside the block."""
    previous = build.extension().set_int8_kernel(name)
    try:
        yield
    finally:
        build.extension().set_int8_kernel(previous)


def test_every_int8_kernel_gives_the_same_bits():
    """The kernels differ in instructions only (VNNI: unsigned x + 128 less 128·Σw; AVX2: |x| and
    sign(w, x)); whole models give identical outputs on each, batched (packed M), one row
    (unpacked M) and one-step cells. VNNI's own instructions run only on a CPU that has them; the
    emulated kernel runs their arithmetic everywhere."""
    extension = build.extension()
    names = extension.int8_kernels()
    assert "emulated-vnni" in names or names == ["scalar"]
    module, q = quantized_pair("lstm", I=37, H=45, num_layers=2, bidirectional=True, peephole=True,
                               layer_norm=True, proj_size=13)
    cell = rnnkit.quantize(rnnkit.GRUCell(37, 29).eval())
    x, lengths, step = torch.randn(7, 5, 37), torch.tensor([7, 2, 5, 7, 1]), torch.randn(1, 37)
    with torch.no_grad():
        expected = q(x, lengths=lengths)[0], q(x[:1, :1])[0], cell(step)
        for name in names:
            with int8_kernel(name):
                got = q(x, lengths=lengths)[0], q(x[:1, :1])[0], cell(step)
            for a, b in zip(got, expected):
                assert torch.equal(a, b), name


def test_int8_kernel_choice(monkeypatch):
    """The CPU's fastest kernels run (what the doctor foretells from /proc/cpuinfo); a name this
    CPU cannot run, or an unknown one, is a ValueError, from the setter and from $RNNKIT_INT8_KERNEL."""
    from rnnkit.app import machine

    extension = build.extension()
    assert rnnkit.quantized.int8_kernel() in rnnkit.quantized.INT8_KERNELS
    if machine.cpu_flags() is not None:
        assert rnnkit.quantized.int8_kernel() == machine.expected_int8_kernel(
            machine.cpu_flags(), torch.backends.cpu.get_cpu_capability())
    for name in set(rnnkit.quantized.INT8_KERNELS) - set(extension.int8_kernels()) - {"scalar"}:
        with pytest.raises(ValueError, match=f"'{name}' needs instructions this CPU does not have"):
            extension.set_int8_kernel(name)
    runnable = ", ".join(extension.int8_kernels())
    with pytest.raises(ValueError, match=f"set_int8_kernel: expected 'auto' or one of {runnable} .*got 'sse'"):
        extension.set_int8_kernel("sse")
    assert extension.int8_kernel() == rnnkit.quantized.int8_kernel()  # a refused name changes nothing
    # $RNNKIT_INT8_KERNEL: a name this CPU runs is used; a bad one fails every int8 product with
    # its message until the setter chooses
    script = (
        "import sys, torch, rnnkit; from rnnkit.fused import build\n"
        "q = rnnkit.quantize(rnnkit.LSTM(4, 6).eval())\n"
        "try:\n    q(torch.randn(3, 2, 4)); print(rnnkit.quantized.int8_kernel())\n"
        "except ValueError as error:\n    print('refused:', error)\n"
        "    print('previous', build.extension().set_int8_kernel('auto')); q(torch.randn(3, 2, 4))\n"
        "    print('then', rnnkit.quantized.int8_kernel())\n"
    )
    chosen = extension.int8_kernels()[-1]
    auto = rnnkit.quantized.int8_kernel()
    for value, expected in ((chosen, [chosen]), ("sse", ["refused: RNNKIT_INT8_KERNEL: expected 'auto' or one of",
                                                        "previous auto", f"then {auto}"])):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "RNNKIT_INT8_KERNEL": value})
        assert result.returncode == 0 and all(e in result.stdout for e in expected), result.stdout + result.stderr[-2000:]


# ---- the module's contract ----------------------------------------------------------------------

def test_does_not_modify_the_module_and_copies_containers():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.rnn = rnnkit.LSTM(8, 16, num_layers=2, peephole=True)
            self.head = nn.Linear(16, 10)

        def forward(self, ids):
            y, _ = self.rnn(self.embed(ids))
            return self.head(y)

    model = Model().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = rnnkit.quantize(model)
    assert type(model.rnn) is rnnkit.LSTM and type(q.rnn) is rnnkit.quantized.LSTM
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert q.embed is not model.embed and torch.equal(q.embed.weight, model.embed.weight)
    ids = torch.randint(0, 10, (12, 3))
    with torch.no_grad():
        assert rel_rms(q(ids), model(ids)) < INT8
    assert q.rnn.weight_hh_l1.dtype == torch.int8 and q.rnn.weight_hh_l1_scale.shape == (64,)
    assert "weights=int8" in repr(q.rnn)


def test_save_and_load_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    module = rnnkit.LSTM(6, 10, proj_size=4, layer_norm=True, bidirectional=True).eval()
    q = rnnkit.quantize(module)
    path = tmp_path / "q.safetensors"
    safetensors_torch.save_model(q, str(path))
    fresh = rnnkit.quantize(rnnkit.LSTM(6, 10, proj_size=4, layer_norm=True, bidirectional=True))
    safetensors_torch.load_model(fresh, str(path))
    x = torch.randn(5, 2, 6)
    with torch.no_grad():
        assert_close(fresh(x), q(x), "reloaded outputs", tol=0)
    # torch.save of the state_dict loads with weights_only=True
    buffer = io.BytesIO()
    torch.save(q.state_dict(), buffer)
    buffer.seek(0)
    again = rnnkit.quantize(rnnkit.LSTM(6, 10, proj_size=4, layer_norm=True, bidirectional=True))
    again.load_state_dict(torch.load(buffer, weights_only=True))
    with torch.no_grad():
        assert_close(again(x), q(x), "reloaded outputs", tol=0)
    # -128 is outside symmetric int8 (and has no negation): refused by name, nothing loaded
    state = {k: v.clone() for k, v in q.state_dict().items()}
    state["weight_hh_l0_reverse"][1, 2] = -128
    before = again.weight_hh_l0_reverse.clone()
    with pytest.raises(ValueError, match=r"weight_hh_l0_reverse: expected int8 values in \[-127, 127\].*got -128 in 1"):
        again.load_state_dict(state)
    assert torch.equal(again.weight_hh_l0_reverse, before)


def test_cell_plan_follows_loaded_weights():
    cell = rnnkit.GRUCell(4, 6)
    q = rnnkit.quantize(cell)
    x = torch.randn(2, 4)
    with torch.no_grad():
        first = q(x)
        other = rnnkit.quantize(rnnkit.GRUCell(4, 6))
        q.load_state_dict(other.state_dict(), assign=True)
        assert_close(q(x), other(x), "after load_state_dict(assign=True)", tol=0)
        assert not torch.equal(first, q(x))


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_cells_deepcopy_and_pickle_after_a_call(quantized):
    """A cell that has run (and so holds its compiled one-step plan) copies and pickles."""
    cell = rnnkit.LSTMCell(3, 4, peephole=True)
    cell = rnnkit.quantize(cell) if quantized else cell.eval()
    x = torch.randn(2, 3)
    with torch.no_grad():
        expected = cell(x)
        copied = copy.deepcopy(cell)
        buffer = io.BytesIO()
        torch.save(cell, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)  # our own object, just written
        for other in (copied, loaded):
            assert_close(other(x), expected, "after deepcopy / pickle", tol=0)
        assert_close(cell(x), expected, "the original, after", tol=0)


def test_quantize_dynamic_mapping():
    quantization = pytest.importorskip("torch.ao.quantization")
    model = nn.Sequential(nn.Linear(4, 8), rnnkit.GRU(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated upstream
        q = quantization.quantize_dynamic(model, {nn.Linear, rnnkit.GRU},
                                          mapping=rnnkit.quantized.dynamic_quant_mapping())
    assert type(q[1]) is rnnkit.quantized.GRU and type(q[0]) is not nn.Linear
    with torch.no_grad():
        y, _ = q(torch.randn(3, 2, 4))
    assert y.shape == (3, 2, 8)



def test_quantize_dynamic_refuses_qconfigs_that_are_not_int8():
    """A float16 or quint8 qconfig names rnnkit layers: they are refused by name, not given int8
    weights while an nn.Linear in the same call becomes float16."""
    quantization = pytest.importorskip("torch.ao.quantization")
    mapping = rnnkit.quantized.dynamic_quant_mapping()
    for spec, dtype in [({rnnkit.LSTM}, torch.float16), ({rnnkit.LSTM}, torch.quint8),
                        ({rnnkit.LSTM: quantization.float16_dynamic_qconfig}, torch.qint8)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated upstream
            with pytest.raises(ValueError, match=r"LSTM: .*expected a qconfig with weight dtype torch.qint8, got "):
                quantization.quantize_dynamic(nn.Sequential(rnnkit.LSTM(4, 8)), spec, dtype=dtype, mapping=mapping)


def test_quantize_keeps_hooks_and_parametrized_weights():
    """A layer's forward pre-hooks and hooks fire on its quantized twin (as torch.ao's swap_module
    carries them), and a parametrized layer quantizes its weights as they compute now (its type is
    torch's generated subclass, not a user's subclass with its own forward)."""
    torch.manual_seed(0)
    module, seen = rnnkit.LSTM(6, 8).eval(), []
    module.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    module.register_forward_hook(lambda m, args, kwargs, out: seen.append("post"), with_kwargs=True)
    inner = nn.Sequential(rnnkit.GRU(6, 8).eval())
    inner[0].register_forward_hook(lambda m, args, out: seen.append("inner"))
    x = torch.randn(4, 2, 6)
    with torch.no_grad():
        rnnkit.quantize(module)(x)
        rnnkit.quantize(inner)(x)
    assert seen == ["pre", "post", "inner"]
    parametrized = nn.utils.parametrizations.weight_norm(rnnkit.LSTM(6, 8).eval(), "weight_hh_l0")
    q = rnnkit.quantize(parametrized)
    assert type(q) is rnnkit.quantized.LSTM
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the parametrized float module's note that it runs unpacked
        want = parametrized(x)[0]
        assert rel_rms(q(x)[0], want) < INT8
        plain = rnnkit.LSTM(6, 8).eval()
        plain.load_state_dict(parametrized.named_weights())
        assert torch.equal(q(x)[0], rnnkit.quantize(plain)(x)[0])  # the parametrized weights, quantized


def test_quantize_takes_a_pruned_layers_weights_and_leaves_prunes_hook_behind():
    """A layer pruned with torch.nn.utils.prune (twice, so a PruningContainer) quantizes its
    weights as prune's hook computes them now (orig * mask: the attribute it last set may be older
    and hold a graph), without the hook, mask or orig, which the int8 module has no use for (the
    carried hook failed every call reading ``<name>_orig``); the pruned module is left as it was.
    torch.ao's swap, which carries the hook itself, is refused with the way out."""
    prune = pytest.importorskip("torch.nn.utils.prune")
    torch.manual_seed(0)
    module = rnnkit.LSTM(6, 8).eval()
    prune.l1_unstructured(module, "weight_hh_l0", 0.5)
    prune.random_unstructured(module, "weight_hh_l0", 0.3)
    prune.l1_unstructured(module, "weight_ih_l0", 0.25)
    with torch.no_grad():
        module.weight_hh_l0_orig.mul_(2)  # after the hook's last run: its attribute is stale
    stale = module.weight_hh_l0
    q = rnnkit.quantize(module)  # before any forward (the attributes hold prune's graph)
    assert module.weight_hh_l0 is stale  # the user's module as it was
    plain = rnnkit.LSTM(6, 8).eval()
    with torch.no_grad():
        plain.load_state_dict({name: module.weight_hh_l0_orig * module.weight_hh_l0_mask if name == "weight_hh_l0"
                               else module.weight_ih_l0_orig * module.weight_ih_l0_mask if name == "weight_ih_l0"
                               else getattr(module, name) for name in plain.state_dict()})
    expected = rnnkit.quantize(plain)
    assert q.state_dict().keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        assert torch.equal(q.state_dict()[name], value), name
    assert int((q.weight_hh_l0 == 0).sum()) >= 8 * 4 * 8 // 2 and not q._forward_pre_hooks
    x = torch.randn(4, 2, 6)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pruned float module's note that it runs unpacked
        assert torch.equal(q(x)[0], expected(x)[0])
        module(x)  # the float module runs as before (its hook recomputes the weights)
    quantization = pytest.importorskip("torch.ao.quantization")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated upstream
        with pytest.raises(ValueError, match=r"^LSTM: weight_hh_l0, weight_ih_l0 pruned .*prune.remove"):
            quantization.quantize_dynamic(nn.Sequential(module), {rnnkit.LSTM},
                                          mapping=rnnkit.quantized.dynamic_quant_mapping())


def test_quantize_carries_what_was_attached_to_a_layer(tmp_path):
    """Buffers (persistent or not), submodules and public attributes a user attached to an rnnkit
    layer come with its quantized twin, deep-copied (what is shared stays shared), so that a hook
    reading them still runs and the state dict keeps their keys; a buffer named as one of the int8
    module's own is refused. A model whose forward calls ``flatten_parameters()`` (torch.nn's idiom)
    runs quantized."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = rnnkit.LSTM(6, 8)
            self.head = nn.Linear(8, 3)
            self.rnn.adapter = self.head  # shared with the model
            self.rnn.register_buffer("temperature", torch.tensor(2.0))
            self.rnn.register_buffer("scratch", torch.zeros(3), persistent=False)
            self.rnn.note = {"trained on": "tiny"}
            self.rnn.register_forward_hook(lambda m, args, out: (out[0] / m.temperature, out[1]))

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn.adapter(self.rnn(x)[0])

    model = Model().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = rnnkit.quantize(model)
    assert type(q.rnn) is rnnkit.quantized.LSTM
    assert q.rnn.temperature.item() == 2.0 and torch.equal(q.rnn.scratch, torch.zeros(3))
    assert q.rnn.note == {"trained on": "tiny"} and q.rnn.note is not model.rnn.note
    assert q.rnn.adapter is q.head and q.head is not model.head  # shared, and a copy
    keys = set(q.state_dict())
    assert {"rnn.temperature", "head.weight", "rnn.adapter.weight"} <= keys and "rnn.scratch" not in keys
    x = torch.randn(4, 2, 6)
    with torch.no_grad():
        got, want = q(x), model(x)
    assert rel_rms(got, want) < INT8  # the hook divided both by the temperature
    model.rnn.temperature.fill_(1.0)
    with torch.no_grad():
        assert rel_rms(q(x), model(x)) > 0.2  # q kept its own copy
    model.rnn.temperature.fill_(2.0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # the model is as it was
    safetensors_torch.save_model(q, str(tmp_path / "q.safetensors"))
    again = rnnkit.quantize(Model().eval())
    safetensors_torch.load_model(again, str(tmp_path / "q.safetensors"))
    with torch.no_grad():
        assert torch.equal(again(x), q(x))
    clash = rnnkit.LSTM(6, 8)
    clash.register_buffer("weight_ih_l0_scale", torch.ones(32))
    with pytest.raises(ValueError, match="weight_ih_l0_scale"):
        rnnkit.quantize(clash)


def test_state_dicts_do_not_cross_between_int8_and_float():
    """A float state dict into a quantized module, or an int8 one into a float module, is refused by
    the key's name even with strict=False (which only forgives the _scale keys): copy_ would turn
    float weights into int8 zeros, or int8 codes into float weights of up to ±127."""
    float_module, q = quantized_pair("lstm", 5, 7)
    with pytest.raises(ValueError, match=r"weight_ih_l0: expected int8 codes .* got torch.float32"):
        q.load_state_dict(float_module.state_dict(), strict=False)
    with pytest.raises(ValueError, match=r"weight_ih_l0: expected floating-point weights, got torch.int8"):
        float_module.load_state_dict(q.state_dict(), strict=False)
    q.load_state_dict(rnnkit.quantize(make_module("lstm", 5, 7, torch.float32)).state_dict())  # same kind: fine
    other_scheme = q.state_dict()  # unsigned codes with a zero point (ONNX's): not rnnkit's, and not a float module's
    other_scheme["weight_ih_l0"] = (other_scheme["weight_ih_l0"].int() + 128).to(torch.uint8)
    with pytest.raises(ValueError, match=r"weight_ih_l0: expected int8 codes .* got torch.uint8: .*zero point"):
        q.load_state_dict(other_scheme)



def test_dtype_conversions_leave_an_int8_module_working():
    """.double() / .half() / .to(dtype) on an int8 module (or on a model holding one) keep its
    int8 matrices and float32 scales and vectors: the same outputs after, where before every input
    was refused (float32 as "expected float64", float64 by the kernels)."""
    torch.manual_seed(0)
    _, q = quantized_pair("lstm", 6, 8, peephole=True, layer_norm=True)
    x = torch.randn(5, 2, 6)
    with torch.no_grad():
        want, want_step = q(x)[0], q(x[:1])[0]
        for convert in (nn.Module.double, nn.Module.half, nn.Module.bfloat16, lambda m: m.to(torch.float64)):
            model = convert(nn.Sequential(q))
            assert {b.dtype for b in q.buffers()} == {torch.int8, torch.float32}
            assert torch.equal(model(x)[0], want) and torch.equal(q(x[:1])[0], want_step)
        # not "(the dtype of the weights)": they are int8
        with pytest.raises(TypeError, match=r"^input: expected dtype torch.float32 \(the dtype the layer computes "
                                            r"in\), got torch.float64$"):
            q(x.double())


def test_compile_and_export():
    q = rnnkit.quantize(rnnkit.LSTM(5, 8, peephole=True).eval())
    x = torch.randn(4, 2, 5)
    with torch.no_grad():
        expected = q(x)
        compiled = torch.compile(q, fullgraph=True, backend="eager")
        assert_close(compiled(x), expected, "compiled", tol=0)
    program = torch.export.export(q, (x,))
    assert any("fused_int8_pass" in str(node.target) for node in program.graph.nodes)
    assert_close(program.module()(x), expected, "exported", tol=0)


@pytest.mark.parametrize("layer, shape", [
    pytest.param(lambda: rnnkit.LSTM(6, 8, num_layers=2, proj_size=5, peephole=True), (4, 3, 6), id="lstm"),
    pytest.param(lambda: rnnkit.LSTM(6, 8), (1, 3, 6), id="lstm_one_step"),
    pytest.param(lambda: rnnkit.GRU(6, 8, bidirectional=True, batch_first=True), (3, 4, 6), id="gru_bidir"),
    pytest.param(lambda: rnnkit.LSTMCell(6, 8, proj_size=5), (3, 6), id="lstm_cell"),
    pytest.param(lambda: rnnkit.GRUCell(6, 8), (6,), id="gru_cell_unbatched"),
])
def test_meta_device_and_fake_tensors_give_the_shapes(layer, shape):
    """An int8 module on the meta device (moved there, or quantized from a module there) and
    under FakeTensorMode gives the CPU call's shapes and dtypes through the op's fake implementation,
    where the kernels were called on memory a meta tensor has not ("its data is not allocated yet").
    A module quantized on the meta device takes real weights by load_state_dict(assign=True)."""
    torch.manual_seed(0)
    float_module = layer().eval()
    q = rnnkit.quantize(float_module)
    x = torch.randn(*shape)
    with torch.no_grad():
        want = flatten(q(x))
        on_meta = flatten(copy.deepcopy(q).to("meta")(x.to("meta")))
        built_on_meta = rnnkit.quantize(layer().to("meta").eval())
        from_meta = flatten(built_on_meta(x.to("meta")))
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = flatten(q(torch.randn(*shape)))
    for name, got in (("moved to meta", on_meta), ("quantized on meta", from_meta), ("fake", fake)):
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want], name
    assert all(t.is_meta for t in on_meta + from_meta)
    built_on_meta.load_state_dict(q.state_dict(), assign=True)
    with torch.no_grad():
        assert_close(built_on_meta(x), q(x), "quantized on meta, then loaded", tol=0)


@pytest.mark.parametrize("layer, shape", [(lambda: rnnkit.LSTM(4, 8, peephole=True), (1, 2, 4)),
                                          (lambda: rnnkit.LSTM(4, 8, peephole=True), (3, 2, 4)),
                                          (lambda: rnnkit.GRUCell(4, 8), (2, 4))], ids=["lstm-T1", "lstm-T3", "gru_cell"])
def test_buffers_loaded_with_assign_are_taken_or_refused_by_name(layer, shape):
    """load_state_dict(assign=True) keeps the tensors it is given: a non-contiguous int8 matrix
    computes as the contiguous one (the one-step plans, which need contiguous memory, step aside;
    they raised "a step plan needs contiguous weights"), and a scale or vector in another float
    dtype is refused by its name (the errors blamed the input, or named a shape or no buffer)."""
    torch.manual_seed(0)
    q = rnnkit.quantize(layer().eval())
    x = torch.randn(*shape)
    with torch.no_grad():
        want = flatten(q(x))
    strided = copy.deepcopy(q)
    state = strided.state_dict()
    name = [k for k in state if k.startswith("weight_hh")][0]
    state[name] = state[name].t().contiguous().t()
    strided.load_state_dict(state, assign=True)
    assert not getattr(strided, name).is_contiguous()
    with torch.no_grad():
        assert_close(flatten(strided(x)), want, "non-contiguous int8 matrix", tol=0)
    for key in [k for k in q.state_dict() if k.endswith("_scale") or k.startswith(("bias", "weight_peephole"))]:
        wrong = copy.deepcopy(q)
        state = wrong.state_dict()
        state[key] = state[key].double()
        wrong.load_state_dict(state, assign=True)
        with torch.no_grad(), pytest.raises(TypeError, match=rf"^{key}: expected float32 \(an int8 module's scales "
                                                             r"and vectors are float32\), got torch.float64$"):
            wrong(x)


INT8_ONNX_CASES = {  # name -> (layer, with lengths)
    "lstm_lengths": (lambda: rnnkit.LSTM(6, 12), True),
    "lstm_peephole_coupled": (lambda: rnnkit.LSTM(6, 12, peephole=True, coupled_gates=True), False),
    "lstm_bidir2_peephole": (lambda: rnnkit.LSTM(6, 12, num_layers=2, bidirectional=True, peephole=True), True),
}


def int8_onnx(model, args):
    """torch.onnx.export of `model` (dynamic T and B) -> an onnxruntime session."""
    import onnxruntime

    from test_pytorch2 import onnx_export

    proto = onnx_export(model, args).model_proto
    return proto, onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def run_onnx(session, *inputs):
    feeds = dict(zip([i.name for i in session.get_inputs()], [t.numpy() for t in inputs]))
    return [torch.from_numpy(a) for a in session.run(None, feeds)]


@pytest.mark.parametrize("case", list(INT8_ONNX_CASES))
def test_onnx_export_is_onnxruntimes_quantized_lstm(case):
    """torch.onnx.export of a model with an int8 LSTM: one com.microsoft.DynamicQuantizeLSTM per
    layer-direction on the same int8 weights and scales (stored uint8, zero point 128); onnxruntime
    quantizes the activations its own way, so on new shapes it matches rnnkit's int8 to int8's
    tolerance, as rnnkit's int8 matches float32."""
    from test_pytorch2 import VOCAB, Model, outputs_of

    factory, with_lengths = INT8_ONNX_CASES[case]
    torch.manual_seed(0)
    model = Model(factory()).eval()
    q = rnnkit.quantize(model)
    tokens, lengths = torch.randint(0, VOCAB, (5, 3)), torch.tensor([5, 2, 4])
    proto, session = int8_onnx(q, (tokens, lengths) if with_lengths else (tokens,))
    spec = q.rnn.spec
    nodes = [node for node in proto.graph.node if node.op_type == "DynamicQuantizeLSTM"]
    assert len(nodes) == spec.num_layers * spec.num_directions and {n.domain for n in nodes} == {"com.microsoft"}
    assert {node.domain for node in proto.graph.node} <= {"", "ai.onnx", "com.microsoft"}
    weights = {t.name: t for t in proto.graph.initializer}
    for node in nodes:  # W, R and their zero points are stored uint8 (onnx.TensorProto.UINT8 = 2)
        assert all(weights[node.input[i]].data_type == 2 for i in (1, 2, 9, 11)), node
    tokens, lengths = torch.randint(0, VOCAB, (7, 4)), torch.tensor([7, 1, 3, 6])
    actual = run_onnx(session, tokens, lengths) if with_lengths else run_onnx(session, tokens)
    with torch.no_grad():
        expected = outputs_of(q(tokens, lengths if with_lengths else None))
        float32 = outputs_of(model(tokens, lengths if with_lengths else None))
    for a, e, f in zip(actual, expected, float32):
        assert rel_rms(a, e) <= INT8 and rel_rms(a, f) <= INT8


def test_onnx_export_of_extreme_int8_weights_does_not_saturate():
    """Rows at ±127 against positive inputs: onnxruntime's u8 × s8 kernels on CPUs without VNNI
    add pairs of products in 16 bits and saturate there (an int8 export measured 20% off); the
    export's u8 × u8 weights (q + 128) do not."""
    torch.manual_seed(0)
    lstm = rnnkit.LSTM(64, 48).eval()
    with torch.no_grad():
        for weight in (lstm.weight_ih_l0, lstm.weight_hh_l0):
            weight.copy_(torch.where(torch.rand_like(weight) < 0.5, -0.05, 0.05))
    q = rnnkit.quantize(lstm)
    x = torch.rand(6, 3, 64) * 4  # unsigned inputs near the top of onnxruntime's uint8 range
    _, session = int8_onnx(q, (x,))
    actual = run_onnx(session, x)
    with torch.no_grad():
        expected = flatten(q(x))
    for a, e in zip(actual, expected):
        assert rel_rms(a, e) <= INT8


def test_torchscript_onnx_export_says_to_use_dynamo():
    q = rnnkit.quantize(rnnkit.LSTM(6, 8).eval())
    with pytest.raises(ValueError, match=r"int8 modules export to ONNX with torch.onnx.export\(..., dynamo=True\)"):
        torch.onnx.export(q, (torch.randn(3, 2, 6),), io.BytesIO(), dynamo=False)


@pytest.mark.parametrize("layer, words", [
    (lambda: rnnkit.GRU(6, 12), "torch.onnx.export: an int8 GRU has no ONNX operator"),
    (lambda: rnnkit.RNN(6, 12), "torch.onnx.export: an int8 RNN has no ONNX operator"),
    (lambda: rnnkit.LSTM(6, 12, layer_norm=True), "torch.onnx.export: layer_norm"),
    (lambda: rnnkit.LSTM(6, 12, proj_size=4), "torch.onnx.export: proj_size"),
])
def test_onnx_export_refuses_what_onnxruntime_cannot_run_in_int8(layer, words):
    """The error is found in the exporter's exception chain (it wraps every exception)."""
    q = rnnkit.quantize(layer().eval())
    with pytest.raises(torch.onnx.OnnxExporterError) as info:
        int8_onnx(q, (torch.randn(5, 3, 6),))
    chain, error = [], info.value
    while error is not None and len(chain) < 20:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, ValueError) and str(e).startswith(words) for e in chain), [str(e)[:200] for e in chain]



@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_non_finite_values_give_nan_not_a_finite_answer(mode):
    """int8 has no NaN or infinity: a row of activations (x, h0) or of weights that holds one gets
    scale NaN, so every output it reaches is NaN, on every kernel and path (packed batches, one
    row, one-step plans). The float module gives NaN for a NaN (or may saturate an infinity): the
    int8 one must not read the NaN as 0, as its row maxima once did (maxps drops a NaN), nor give
    any finite answer. Rows the value does not reach are untouched."""
    torch.manual_seed(0)
    extension = build.extension()
    for I, B, T in [(16, 3, 5), (40, 1, 1), (64, 9, 4), (33, 2, 1)]:  # K tails, one row, plans
        module, q = quantized_pair(mode, I, 32)
        x = torch.randn(T, B, I)
        with torch.no_grad():
            clean = q(x)[0]
            assert clean.isfinite().all()
            for bad in (float("nan"), float("inf"), -float("inf")):
                poisoned = x.clone()
                poisoned[T - 1, B - 1, I - 2] = bad
                h0 = torch.randn(1, B, 32)
                h0[0, 0, 3] = bad
                state = h0 if mode == "gru" else (h0, torch.zeros(1, B, 32))
                for name in extension.int8_kernels():
                    with int8_kernel(name):
                        y = q(poisoned)[0]
                        assert y[T - 1, B - 1].isnan().all(), (name, I, B, T, bad)
                        assert torch.equal(y[:T - 1], clean[:T - 1]) and torch.equal(y[:, :B - 1], clean[:, :B - 1])
                        assert q(x, state)[0][:, 0].isnan().all(), (name, "h0", bad)
    module = make_module(mode, 8, 6, torch.float32).eval()
    with torch.no_grad():
        module.weight_hh_l0[2, 1] = float("nan")
    assert rnnkit.quantize(module)(torch.randn(3, 2, 8))[0][-1].isnan().all()
    q_rows, scale = rnnkit.quantized.quantize_rows(torch.tensor([[1.0, float("inf")], [2.0, -1.0]]))
    assert scale[0].isnan() and torch.equal(q_rows[0], torch.zeros(2, dtype=torch.int8))
    assert torch.equal(q_rows[1], torch.tensor([127, -64], dtype=torch.int8))
    # rows of tiny weights (127 / max|w| overflows below ~3.7e-37): the codes of any other scale
    q_rows, scale = rnnkit.quantized.quantize_rows(torch.tensor([[1e-40, 0.0, -5e-41], [1e-38, 3e-39, 0.0]]))
    assert torch.equal(q_rows, torch.tensor([[127, 0, -64], [127, 38, 0]], dtype=torch.int8))
    assert torch.equal(scale, torch.tensor([1e-40, 1e-38]) / 127)


@pytest.mark.parametrize("call, error, words", [
    (lambda: rnnkit.quantize(nn.Linear(3, 3)), ValueError, "no rnnkit LSTM"),
    (lambda: rnnkit.quantize(rnnkit.LSTM(3, 3), dtype=torch.float16), ValueError, "dtype"),
    (lambda: rnnkit.quantize(rnnkit.quantize(rnnkit.LSTM(3, 3))), ValueError, "already quantized"),
    (lambda: rnnkit.quantize("lstm"), TypeError, "nn.Module"),
    (lambda: rnnkit.quantize(type("MyLSTM", (rnnkit.LSTM,), {})(3, 3)), ValueError, "subclasses"),
])
def test_refusals(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_refuses_gradients_and_wrong_inputs():
    q = rnnkit.quantize(rnnkit.LSTM(3, 4))
    x = torch.randn(2, 1, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference"):
        q(x)
    with torch.no_grad():
        q(x)  # fine without a gradient to record
        with pytest.raises(TypeError, match="input"):
            q(torch.randn(2, 1, 3, dtype=torch.float64))
        with pytest.raises(ValueError, match="input_size=3"):
            q(torch.randn(2, 1, 5))
    cell = rnnkit.quantize(rnnkit.LSTMCell(3, 4))
    with torch.no_grad(), pytest.raises(TypeError, match="pair"):
        cell(torch.randn(2, 3), torch.randn(2, 4))


BAD_CELL_STATES = {  # name -> (cell, input shape, hx): one mistake each
    "lstm_batched_wrong_batch": (lambda: rnnkit.LSTMCell(6, 8), (3, 6), lambda: (torch.zeros(2, 8), torch.zeros(3, 8))),
    "lstm_batched_wrong_c_size": (lambda: rnnkit.LSTMCell(6, 8), (3, 6), lambda: (torch.zeros(3, 8), torch.zeros(3, 7))),
    "lstm_batched_unbatched_h": (lambda: rnnkit.LSTMCell(6, 8), (3, 6), lambda: (torch.zeros(8), torch.zeros(3, 8))),
    "lstm_unbatched_batched_h": (lambda: rnnkit.LSTMCell(6, 8), (6,), lambda: (torch.zeros(1, 8), torch.zeros(8))),
    "lstm_unbatched_wrong_h_size": (lambda: rnnkit.LSTMCell(6, 8), (6,), lambda: (torch.zeros(7), torch.zeros(8))),
    "lstm_proj_h_of_hidden_size": (lambda: rnnkit.LSTMCell(6, 8, proj_size=5), (3, 6),
                                   lambda: (torch.zeros(3, 8), torch.zeros(3, 8))),
    "lstm_not_a_pair": (lambda: rnnkit.LSTMCell(6, 8), (3, 6), lambda: torch.zeros(3, 8)),
    "gru_batched_wrong_batch": (lambda: rnnkit.GRUCell(6, 8), (3, 6), lambda: torch.zeros(2, 8)),
    "gru_unbatched_wrong_size": (lambda: rnnkit.GRUCell(6, 8), (6,), lambda: torch.zeros(9)),
    "rnn_batched_wrong_size": (lambda: rnnkit.RNNCell(6, 8), (3, 6), lambda: torch.zeros(3, 9)),
    "rnn_float64_state": (lambda: rnnkit.RNNCell(6, 8), (3, 6), lambda: torch.zeros(3, 8, dtype=torch.float64)),
}


@pytest.mark.parametrize("case", list(BAD_CELL_STATES))
def test_cell_state_errors_are_the_float_cells(case):
    """A badly shaped hx gets the float cell's error from an int8 cell: the state named, the shape
    expected and the shape given (it showed the one-layer stack's shapes, an axis added to each:
    "hx[0] (h_0): expected shape (1, 3, 16), got (1, 2, 16)")."""
    layer, shape, hx = BAD_CELL_STATES[case]
    float_cell = layer().eval()
    q = rnnkit.quantize(float_cell)
    x = torch.randn(*shape)
    with torch.no_grad(), pytest.raises((TypeError, ValueError)) as expected:
        float_cell(x, hx())
    assert str(expected.value).startswith("hx"), expected.value  # the float cell's error is the one meant
    with torch.no_grad(), pytest.raises(type(expected.value)) as got:
        q(x, hx())
    assert str(got.value) == str(expected.value)


def test_int8_modules_have_the_float_modules_attributes_and_setting_them_takes_effect():
    """An int8 module had none of torch.nn's attributes (reading raised AttributeError) and
    setting one (q.batch_first = True, q.zoneout = 0) made a plain attribute nothing read."""
    torch.manual_seed(0)
    float_module = rnnkit.LSTM(16, 32, 2, zoneout=0.3, cell_clip=0.5).eval()
    q = rnnkit.quantize(float_module)
    for name in ("mode", "input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional",
                 "proj_size", "zoneout", "cell_clip", "peephole", "layer_norm"):
        assert getattr(q, name) == getattr(float_module, name), name
    x = torch.randn(5, 3, 16)
    with torch.no_grad():
        for steps in (x, x[:1]):  # the general path and the one-step plans
            q(steps)  # builds and caches what the old options need
        q.zoneout, q.cell_clip, q.batch_first = 0.0, None, True
        twin = rnnkit.LSTM(16, 32, 2, batch_first=True)
        twin.load_state_dict(float_module.state_dict())
        expected = rnnkit.quantize(twin.eval())
        for steps in (x, x[:1]):
            assert torch.equal(q(steps.transpose(0, 1))[0], expected(steps.transpose(0, 1))[0])
    with pytest.raises(AttributeError, match="hidden_size is fixed"):
        q.hidden_size = 8
    cell = rnnkit.quantize(rnnkit.RNNCell(4, 5))
    assert (cell.nonlinearity, cell.input_size, cell.hidden_size) == ("tanh", 4, 5)
    with pytest.raises(AttributeError, match="per-sequence"):
        cell.recurrent_dropout = 0.1



def test_int8_stacks_have_the_rnnbase_helpers():
    float_module = rnnkit.LSTM(4, 8, 2, bidirectional=True)
    q = rnnkit.quantize(float_module)
    x = torch.randn(5, 3, 4)
    _, hidden = float_module(x)
    assert q._flat_weights_names == float_module._flat_weights_names == torch.nn.LSTM(4, 8, 2, bidirectional=True)._flat_weights_names
    assert q.get_expected_hidden_size(x) == q.get_expected_cell_size(x) == (4, 3, 8)
    q.check_forward_args(x, hidden, None)
    with pytest.raises(RuntimeError, match=r"Expected hidden\[1\] size"):
        q.check_forward_args(x, (hidden[0], hidden[1][:, :2]), None)
    assert torch.equal(q.permute_hidden(hidden, torch.tensor([2, 0, 1]))[0], hidden[0][:, [2, 0, 1]])


@pytest.mark.filterwarnings("ignore:.*batching rule")
def test_int8_module_under_vmap_of_inputs_and_of_buffers():
    """vmap over inputs, and over buffers through functional_call (an ensemble of int8 models): as the
    per-member calls. The general path's cache of checked passes keys on the buffers' data pointers,
    which batched buffers do not have: it is kept to plain eager calls."""
    quantized = rnnkit.quantize(rnnkit.LSTM(4, 5).eval())
    xs = torch.randn(3, 6, 2, 4)
    buffers = dict(quantized.named_buffers())
    with torch.no_grad():
        batched = torch.func.vmap(lambda x: quantized(x)[0])(xs)
        assert torch.equal(batched, torch.stack([quantized(x)[0] for x in xs]))
        stacked = {name: torch.stack([value, value]) for name, value in buffers.items()}
        members = torch.func.vmap(lambda b: torch.func.functional_call(quantized, b, (xs[0],))[0])(stacked)
        assert torch.equal(members, torch.stack([quantized(xs[0])[0]] * 2))


def test_an_int8_model_under_autocast_takes_what_the_layer_before_hands_over():
    """Under torch.autocast a Linear before an int8 LSTM hands it bfloat16: widened to float32 (exact),
    the int8 kernels' dtype, and float32 out, as the int8 modules return under autocast."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), rnnkit.LSTM(8, 16)).eval()
    quantized = rnnkit.quantize(model)
    lstm, cell = quantized[1], rnnkit.quantize(rnnkit.GRUCell(8, 16).eval())
    x = torch.randn(5, 3, 8)
    with torch.no_grad():
        low = x.bfloat16()
        expected = lstm(low.float())[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lstm(low)[0]
            assert y.dtype == torch.float32 and torch.equal(y, expected)
            assert quantized(x)[0].dtype == torch.float32
            assert torch.equal(cell(low[0], torch.zeros(3, 16, dtype=torch.bfloat16)),
                               cell(low[0].float(), torch.zeros(3, 16)))
        with pytest.raises(rnnkit.DTypeMismatchError):  # outside autocast: refused as before
            lstm(low)
