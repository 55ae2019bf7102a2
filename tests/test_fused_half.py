"""bfloat16 / float16 modules on the fused CPU backend: the kernels read the half-precision matrices
(W, R, W_hr) as they are and compute in float32. With the matrices widened (bf16 kernels "none") a
pass, forward and backward, equals float32's on the same values up to float32's summation order:
float32's tolerance. On the bfloat16 kernels (AVX512_BF16, or their emulation) the GEMM operands
are rounded to bfloat16: bfloat16's tolerance, and not float32's bits (they ran); a single-layer
bfloat16 module equals the reference on the same roundings (`rnnkit.testing.RoundedProducts`) up
to float32 ties. Kernel buffers are NaN-poisoned, as in test_fused.py.
"""
from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch

import rnnkit
from rnnkit import masks
from rnnkit.fused import FusedCPUBackend, build
from rnnkit.fused import ops as fused_ops
from rnnkit.masks import draw_pass
from helpers import TOLERANCE, assert_close, flatten, make_module
from rnnkit.testing import BF16_ROUNDED_TOLERANCE, RoundedProducts
from test_fused import CASES, TRAINING_CASES

HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
# the bfloat16 GEMM kernels this CPU runs ("none" everywhere: bfloat16 weights widened to float32)
BF16_KERNELS = build.extension().bf16_kernels() if build.unavailable_reason() is None else ["none"]


pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")  # conftest.py


# Which product path each shape takes (gemm.cpp, PackedRight's half constructor; pass.cpp, InputSteps):
SHAPES = {
    "T7-B1": (7, 1),    # one row a step: R packed for the bf16 products (float16: the widening loop), W per chunk of rows
    "T1-B1": (1, 1),    # one step of one row: W and R both through the widening loop
    "T1-B5": (1, 5),    # one step of a few rows: the four-row widening loops, 4 + 1
    "T1-B9": (1, 9),    # one step of more rows: widened once, sgemm unpacked
    "T6-B3": (6, 3),    # a few rows over several steps: widened once and packed
    "T40-B12": (40, 12),  # chunks of many rows: W widened once for the input projection's GEMM
}


@contextlib.contextmanager
def bf16_kernel(name):
    """The bfloat16 GEMM kernels `name` ("none": bfloat16 weights widened to float32) for the block."""
    previous = build.extension().set_bf16_kernel(name)
    try:
        yield
    finally:
        build.extension().set_bf16_kernel(previous)


def bf16_products(rows, pack, dtype):
    """Whether a pass multiplies X by bfloat16 M with the CPU's bfloat16 kernels (X then rounded to
    bfloat16): gemm.cpp, PackedRight's half constructor."""
    read_as_is = not pack and rows <= 8  # one row of a matrix that multiplies more than once is packed too
    return dtype == torch.bfloat16 and build.extension().bf16_kernel() != "none" and not read_as_is


@pytest.mark.parametrize("kernel", BF16_KERNELS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 13, 20])
@pytest.mark.parametrize("pack", [False, True], ids=["once", "packed"])
def test_half_gemm_matches_float32_on_the_widened_matrix(rows, pack, dtype, kernel):
    """X · Mᵀ through each path a pass takes for half-precision M equals float32 on M's values (on
    X rounded to bfloat16 where the bfloat16 kernels take the product)."""
    torch.manual_seed(rows)
    with bf16_kernel(kernel):
        for N, K in [(37, 11), (64, 37), (130, 256), (200, 33)]:  # tails of rows (4, 2, 16) and of K (16, 8, 2)
            X, M = torch.randn(rows, K), torch.randn(N, K).to(dtype)
            got = build.extension().half_gemm(X, M, pack)
            operand = X.to(dtype).float() if bf16_products(rows, pack, dtype) else X
            assert_close(got, (operand.double() @ M.double().t()).float(), f"{N}x{K}, {rows} rows")


@pytest.mark.parametrize("kernel", [k for k in BF16_KERNELS if k != "none"] or
                         [pytest.param("none", marks=pytest.mark.skip(reason="no bfloat16 GEMM kernels on this CPU"))])
def test_bf16_weight_gradient_matches_float64_on_rounded_operands(kernel):
    """Aᵀ · B as a bfloat16 module's weight gradient: A transposed as it is rounded (16 × 16 blocks
    and their tails), B packed in pairs of rows (an odd count's last pair half zero), A also a
    column slice of a wider matrix (a GRU's dA narrowed), both read in place. Each product of two
    bfloat16 values is exact in float32, so only the float32 sums' order separates it from float64."""
    torch.manual_seed(0)
    with bf16_kernel(kernel):
        for rows, N, K in [(1, 1, 1), (7, 5, 3), (33, 37, 11), (40, 64, 48), (201, 130, 17), (1600, 512, 128)]:
            wide, B = torch.randn(rows, N + 9), torch.randn(rows, K)
            before = (wide.clone(), B.clone())
            for A in (wide[:, :N].contiguous(), wide[:, 4:4 + N]):
                got = build.extension().bf16_gemm_at_b(A, B)
                expected = A.bfloat16().double().t() @ B.bfloat16().double()
                assert_close(got, expected.float(), f"{rows} rows, N {N}, K {K}, A strided {not A.is_contiguous()}")
            assert torch.equal(wide, before[0]) and torch.equal(B, before[1])  # read, not rounded in place


@pytest.mark.parametrize("kernel", [k for k in BF16_KERNELS if k != "none"] or
                         [pytest.param("none", marks=pytest.mark.skip(reason="no bfloat16 GEMM kernels on this CPU"))])
def test_bf16_gemm_packed_matches_float64_on_rounded_operands(kernel):
    """X · Mᵀ on M packed in the bfloat16 kernels' panels, alone and added to C (beta 1), with tails of
    X's rows (AMX: tiles of 16), of K (AMX: chunks of 32 k, blocks of 1024) and of N (panels of 16).
    Each product of two bfloat16 values is exact in float32: only the sums' order separates the
    result from float64's. A row's result is the same bits whatever rows come with it, from two rows
    on (the AMX kernel pads a last tile of rows, and the last chunk of k, with zeros; a single row
    runs on vdpbf16ps)."""
    torch.manual_seed(1)
    ext = build.extension()
    with bf16_kernel(kernel):
        for rows, N, K in [(1, 1, 1), (15, 17, 31), (16, 16, 32), (17, 40, 33), (33, 130, 1025), (47, 33, 2100),
                           (64, 64, 2048), (130, 48, 64)]:
            X, M = torch.randn(rows, K), torch.randn(N, K).bfloat16()
            before = (X.clone(), M.clone())
            packed = ext.bf16_pack(M)
            expected = X.bfloat16().double() @ M.double().t()
            got = ext.bf16_gemm_packed(X, packed, N)
            assert_close(got, expected.float(), f"{rows} x {K} x {N}")
            if K % 2 == 0:  # X given rounded (bf16_gemm_rounded's product): the same bits, rows at any stride
                assert torch.equal(ext.bf16_gemm_packed(X.bfloat16(), packed, N), got), f"{rows} x {K} x {N}"
                wide = torch.full((rows, K + 46), float("nan")).bfloat16()  # NaN between the rows: never read
                wide[:, 6:6 + K] = X.bfloat16()
                assert torch.equal(ext.bf16_gemm_packed(wide[:, 6:6 + K], packed, N), got), f"{rows} x {K} x {N}, ld"
            C0 = torch.randn(rows, N)
            summed = ext.bf16_gemm_packed(X, packed, N, C0.clone())
            assert_close(summed, (C0.double() + expected).float(), f"{rows} x {K} x {N}, added to C")
            threads = torch.get_num_threads()
            try:  # each output is one thread's whole sum: the same bits however the panels are split
                torch.set_num_threads(2)
                assert torch.equal(ext.bf16_gemm_packed(X, packed, N), got), f"{rows} x {K} x {N}, 2 threads"
            finally:
                torch.set_num_threads(threads)
            for first, count in [(0, 2), (rows // 2, min(rows - rows // 2, 17)), (rows - 2, 2)] if rows >= 4 else []:
                part = ext.bf16_gemm_packed(X[first:first + count].contiguous(), packed, N)
                assert torch.equal(part, got[first:first + count]), f"{rows} x {K} x {N}: rows {first}+{count}"
            assert torch.equal(X, before[0]) and torch.equal(M, before[1])


@pytest.mark.skipif(BF16_KERNELS == ["none"], reason="no bfloat16 GEMM kernels on this CPU")
def test_bf16_gemm_packed_refuses_rows_closer_than_k():
    """A bfloat16 X whose rows overlap (row stride 0, or under K) is refused, not read past its rows."""
    ext = build.extension()
    packed = ext.bf16_pack(torch.randn(16, 64).bfloat16())
    for X in (torch.randn(1, 64).bfloat16().expand(3, 64), torch.randn(4096).bfloat16().as_strided((3, 64), (8, 1))):
        with pytest.raises(RuntimeError, match="an even row stride of at least K"):
            ext.bf16_gemm_packed(X, packed, 16)


def rounded_module(mode, options, dtype, T, B):
    """A float32 module whose weights are ``dtype`` values, and lengths for a batch of T steps
    (None at T = 1)."""
    module = make_module(mode, 11, 37, torch.float32, **options)
    with torch.no_grad():
        module.flat_weights.copy_(module.flat_weights.to(dtype).float())
    return module, (torch.randint(1, T + 1, (B,)) if T > 1 else None)


def pass_results(module, dtype, T, B, lengths):
    """(y, h_n, c_n) of every layer-0 pass of ``module`` (float32, weights already half-rounded)
    through the fused kernels: with its float32 matrices, and with the same matrices in ``dtype``."""
    spec = module.spec
    cell = spec.cell(0)
    torch.manual_seed(3)
    x = torch.randn(T, B, spec.input_size)
    results = {"float32": [], "half": []}
    with torch.no_grad():
        passes = module._pass_weights()
        for direction in range(spec.num_directions):
            w = passes[direction]
            h0, c0 = torch.randn(B, cell.output_size), torch.randn(B, cell.hidden_size)
            masks = draw_pass(spec, cell, T, B, x, False).masks
            half = w._replace(**{k: getattr(w, k).to(dtype) for k in ("W", "R", "W_hr") if getattr(w, k) is not None})
            for name, weights in (("float32", w), ("half", half)):
                out = FusedCPUBackend().run_pass(cell, x, h0, c0 if spec.mode == "lstm" else None, weights, lengths,
                                                 direction == 1, masks)
                results[name].append([t for t in out if t is not None])
    return results


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode, options", CASES)
def test_pass_on_half_matrices_matches_float32(mode, options, dtype, shape):
    """With the matrices widened (bfloat16 kernels "none"): float32's pass on the same values."""
    T, B = SHAPES[shape]
    module, lengths = rounded_module(mode, options, dtype, T, B)
    with bf16_kernel("none"):
        results = pass_results(module, dtype, T, B, lengths)
    for direction, (half, full) in enumerate(zip(results["half"], results["float32"])):
        for k, (a, e) in enumerate(zip(half, full)):
            assert a.dtype == torch.float32
            assert_close(a, e, f"direction {direction}, output {k}")


# The bfloat16 kernels round h to bfloat16 as R's operand (the carried state stays float32), so a
# pass on them differs from float32's by a rounding per step: within bfloat16's tolerance, the
# bound (measured 1.4e-3 plain, 3-8e-3 with layer norm at T = 6). Over 40 steps the layer-normalized
# LSTMs with a 3-wide projection amplify any such rounding: float32 itself moves 2-4% when the input
# moves by bfloat16's rounding (measured), so those long cases are left out rather than loosened.
# The instruction and its emulation agree to float32's tolerance (measured bit for bit on Zen 4).
BF16_KERNEL_CASES = [pytest.param(mode, options, shape, id=f"{case.id}-{shape}") for case in CASES
                     for mode, options in [case.values] for shape in ("T6-B3", "T1-B9", "T40-B12")
                     if shape != "T40-B12" or not options.get("layer_norm")]


@pytest.mark.skipif(BF16_KERNELS == ["none"], reason="no bfloat16 GEMM kernels on this CPU (AVX-512 needed)")
@pytest.mark.parametrize("mode, options, shape", BF16_KERNEL_CASES)
def test_pass_on_the_bf16_kernels_is_a_bf16_computation(mode, options, shape):
    T, B = SHAPES[shape]
    module, lengths = rounded_module(mode, options, torch.bfloat16, T, B)
    runs = {}
    for kernel in BF16_KERNELS:
        with bf16_kernel(kernel):
            runs[kernel] = pass_results(module, torch.bfloat16, T, B, lengths)
    widened = runs.pop("none")
    for kernel, results in runs.items():
        for direction, (half, full) in enumerate(zip(results["half"], results["float32"])):
            assert_close(half, full, f"{kernel}, direction {direction}", tol=TOLERANCE[torch.bfloat16])
        # they ran: bfloat16 operands, not the widened matrices' float32 arithmetic
        assert not all(torch.equal(a, b) for a, b in zip(flatten(results["half"]), flatten(widened["half"])))
    if "avx512-bf16" in runs and "emulated-bf16" in runs:
        assert_close(runs["avx512-bf16"]["half"], runs["emulated-bf16"]["half"], "the instruction against its emulation")
    if "amx-bf16" in runs:
        # the same bfloat16 operands, their float32 sums in another order: apart only where a sum lands
        # within an ulp of a rounding of h (measured 1.3e-5 over 40 steps of the zoneout LSTM)
        assert_close(runs["amx-bf16"]["half"], runs["avx512-bf16"]["half"], "AMX against vdpbf16ps",
                     tol=BF16_ROUNDED_TOLERANCE["rounded_products"])


def pass_gradients(module, dtype, T, B, lengths):
    """d(x, h0, c0) and the matrices' gradients of layer 0's forward pass through the fused kernels,
    with random upstream gradients on y, h_n and c_n: float32 matrices, then the same in ``dtype``."""
    spec = module.spec
    cell = spec.cell(0)
    torch.manual_seed(4)
    exact = lambda t: t.to(dtype).float()  # noqa: E731  as a half-precision module's inputs and states are
    x = exact(torch.randn(T, B, spec.input_size))
    h0, c0 = exact(torch.randn(B, cell.output_size)), exact(torch.randn(B, cell.hidden_size))
    lstm = spec.mode == "lstm"
    masks = draw_pass(spec, cell, T, B, x, False).masks
    with torch.no_grad():
        w = module._pass_weights()[0]
    results = {}
    for name, cast in (("float32", lambda t: t), ("half", lambda t: t.to(dtype))):
        matrices = {k: cast(getattr(w, k)).detach().requires_grad_() for k in ("W", "R", "W_hr")
                    if getattr(w, k) is not None}
        weights = w._replace(**matrices)
        leaves = [t.clone().requires_grad_() for t in (x, h0, c0)]
        out = FusedCPUBackend().run_pass(cell, leaves[0], leaves[1], leaves[2] if lstm else None, weights, lengths,
                                         False, masks)
        out = [t for t in out if t is not None]
        generator = torch.Generator().manual_seed(5)
        upstream = [torch.randn(t.shape, generator=generator) for t in out]
        inputs = leaves[:3 if lstm else 2] + list(matrices.values())
        results[name] = torch.autograd.grad(out, inputs, upstream)
    return results


@pytest.mark.parametrize("shape", ["T7-B1", "T1-B5", "T6-B3", "T1-B9"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode, options", CASES)
def test_training_on_half_matrices_matches_float32(mode, options, dtype, shape):
    """Forward and backward with the matrices widened (bfloat16 kernels "none"): float32's gradients
    on the same values; the matrices' gradients come back in their dtype (rounded once)."""
    T, B = SHAPES[shape]
    module, lengths = rounded_module(mode, options, dtype, T, B)
    with bf16_kernel("none"):
        results = pass_gradients(module, dtype, T, B, lengths)
    states = 3 if mode == "lstm" else 2
    for k, (a, e) in enumerate(zip(results["half"], results["float32"])):
        if k < states:
            assert a.dtype == torch.float32
            assert_close(a, e, f"d input {k}")
        else:
            assert a.dtype == dtype
            assert_close(a.float(), e, f"d matrix {k - states}", tol=TOLERANCE[dtype])


# Over several steps the forward rounds h to bfloat16 as R's operand, which moves a pre-activation
# across a kink now and then: relu's, or a clip's, where the gradient jumps (one such flip moved dx by
# 6-8% in these small cases). Those configurations are checked over one step, whose forward has
# nothing to round (x and the states are bfloat16 already); the rest over six steps as well.
KINKS = ("cell_clip", "proj_clip")
BF16_TRAINING_CASES = [pytest.param(mode, options, shape, id=f"{case.id}-{shape}") for case in CASES
                       for mode, options in [case.values] for shape in ("T6-B3", "T1-B9")
                       if shape == "T1-B9" or not (mode == "rnn_relu" or any(k in options for k in KINKS))]


@pytest.mark.skipif(BF16_KERNELS == ["none"], reason="no bfloat16 GEMM kernels on this CPU (AVX-512 needed)")
@pytest.mark.parametrize("mode, options, shape", BF16_TRAINING_CASES)
def test_training_on_the_bf16_kernels_is_a_bf16_computation(mode, options, shape):
    """The backward's products with a weight matrix round the gradient entering them to bfloat16:
    within bfloat16's tolerance of float32's gradients, for the instruction and its emulation."""
    T, B = SHAPES[shape]
    module, lengths = rounded_module(mode, options, torch.bfloat16, T, B)
    with bf16_kernel("none"):
        widened = pass_gradients(module, torch.bfloat16, T, B, lengths)["half"]
    for kernel in BF16_KERNELS:
        if kernel == "none":
            continue
        with bf16_kernel(kernel):
            results = pass_gradients(module, torch.bfloat16, T, B, lengths)
        for k, (a, e) in enumerate(zip(results["half"], results["float32"])):
            assert_close(a.float(), e, f"{kernel}: gradient {k}", tol=TOLERANCE[torch.bfloat16])
            # the backward's products ran on bfloat16 operands: dx, dh0 and the matrices' gradients
            # differ from the widened matrices' float32 arithmetic
            if k == 0 or k >= (3 if mode == "lstm" else 2):
                assert not torch.equal(a, widened[k]), f"{kernel}: gradient {k} is the widened path's"


def _spy_on_kernels(monkeypatch):
    """The dtypes of W, R and W_hr each forward kernel call receives."""
    seen = []
    impl = fused_ops.OPS.forward_impl

    def spy(*values):
        seen.append(tuple(None if v is None else v.dtype for v in (values[3], values[4], values[7])))  # W, R, W_hr
        return impl(*values)

    monkeypatch.setattr(fused_ops.OPS, "forward_impl", spy)
    return seen


@pytest.mark.parametrize("dtype", HALF)
def test_a_half_module_hands_its_matrices_to_the_kernels_as_they_are(dtype, monkeypatch):
    """No widened copy per call: W, R and W_hr reach the kernels in the module's dtype, in inference
    and in training, and the two agree."""
    torch.manual_seed(0)
    lstm = rnnkit.LSTM(11, 37, num_layers=2, bidirectional=True, proj_size=5, backend="fused").to(dtype)
    x = torch.randn(6, 3, 11).to(dtype)
    seen = _spy_on_kernels(monkeypatch)
    with torch.no_grad():
        y, (h, c) = lstm(x)
    y2, (h2, c2) = lstm(x.requires_grad_())
    assert len(seen) == 8 and all(s == (dtype, dtype, dtype) for s in seen), seen
    assert y.dtype == h.dtype == c.dtype == dtype
    assert_close([y, h, c], [y2, h2, c2], "inference against training's forward", tol=TOLERANCE[dtype])


def test_autocast_inference_hands_bf16_matrices_to_the_kernels(monkeypatch):
    torch.manual_seed(0)
    gru = rnnkit.GRU(11, 37, backend="fused")
    seen = _spy_on_kernels(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        y, _ = gru(torch.randn(5, 2, 11))
    assert y.dtype == torch.bfloat16
    assert seen and seen[0][:2] == (torch.bfloat16, torch.bfloat16), seen


def test_auto_trains_half_lstms_on_fused_and_leaves_their_batched_inference_to_onednn():
    """backend="auto" with a bfloat16 LSTM: a call that records a graph (weights, input or state
    needing gradients) or runs a batch of up to 4 rows goes to `fused` (faster than oneDNN's
    bfloat16 there, backend.select), a no_grad call of a larger batch (with lengths or not) to
    `native` where torch has oneDNN bfloat16 kernels; GRUs always to `fused`."""
    native_ok = rnnkit.backend.get("native").unsupported_reason(
        rnnkit.LSTM(3, 4).spec, torch.device("cpu"), torch.bfloat16) is None
    torch.manual_seed(0)
    lstm = rnnkit.LSTM(3, 4).to(torch.bfloat16)
    x = torch.randn(5, 6, 3, dtype=torch.bfloat16)
    lstm(x)
    assert lstm.last_backend == "fused"
    with torch.no_grad():
        lstm(x)
    assert lstm.last_backend == ("native" if native_ok else "fused")
    lstm.requires_grad_(False)
    lstm(x)  # nothing needs a gradient: inference
    assert lstm.last_backend == ("native" if native_ok else "fused")
    lstm(x, (torch.zeros(1, 6, 4, dtype=torch.bfloat16, requires_grad=True), torch.zeros(1, 6, 4, dtype=torch.bfloat16)))
    assert lstm.last_backend == "fused"  # a state needing its gradient
    lstm(x, lengths=torch.tensor([5, 4, 3, 2, 1, 1]))
    assert lstm.last_backend == ("native" if native_ok else "fused")  # lengths: inference too
    lstm(x[:, :4])
    assert lstm.last_backend == "fused"  # a batch of up to 4 rows, in inference too
    gru = rnnkit.GRU(3, 4).to(torch.bfloat16)
    with torch.no_grad():
        gru(x)
    assert gru.last_backend == "fused"
    float_lstm = rnnkit.LSTM(3, 4)
    with torch.autocast("cpu", torch.bfloat16):
        float_lstm(x.float())
        assert float_lstm.last_backend == "fused"
        with torch.no_grad():
            float_lstm(x.float())
        assert float_lstm.last_backend == ("native" if native_ok else "fused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_auto_runs_fused_wherever_it_was_measured_faster(dtype):
    """backend="auto" on the CPU in float32 / float64: GRUs and RNNs, a batch of up to 4 rows and
    float64 run on `fused`, and so do a float32 LSTM's training and calls with lengths (or a
    PackedSequence) where the CPU has AVX-512 (the fused kernels' own GEMM); a float32 LSTM's
    inference of a padded batch of 5 rows or more runs on `native` (oneDNN)."""
    lstm, gru, rnn = rnnkit.LSTM(3, 4, dtype=dtype), rnnkit.GRU(3, 4, dtype=dtype), rnnkit.RNN(3, 4, dtype=dtype)
    x = torch.randn(5, 6, 3, dtype=dtype)
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    batched = "native" if dtype == torch.float32 else "fused"
    measured = "fused" if avx512 or dtype == torch.float64 else "native"  # training, lengths
    with torch.no_grad():
        lstm(x)
        assert lstm.last_backend == batched
        lstm(x[:, :5])
        assert lstm.last_backend == batched
        lstm(x[:, :4])
        assert lstm.last_backend == "fused"
        lstm(x, lengths=torch.tensor([5, 4, 3, 2, 1, 1]))
        assert lstm.last_backend == measured
        lstm(torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 4, 3, 2, 1, 1])))
        assert lstm.last_backend == measured
        for module in (gru, rnn):
            module(x)
            assert module.last_backend == "fused"
    lstm(x)
    assert lstm.last_backend == measured  # training
    lstm(x[:, :4])
    assert lstm.last_backend == "fused"  # training, 4 rows


CELLS = {"lstm": (rnnkit.LSTMCell, dict(peephole=True, layer_norm=True, proj_size=5)),
         "gru": (rnnkit.GRUCell, {}), "rnn": (rnnkit.RNNCell, dict(nonlinearity="relu"))}


@pytest.mark.parametrize("batch", [None, 1, 3, 9], ids=["unbatched", "B1", "B3", "B9"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", list(CELLS))
def test_half_cells_step_on_their_plans_and_equal_the_general_path(kind, dtype, batch):
    """A half-precision cell's no_grad steps run on its one-step plan (matrices read as they are, the
    input and state widened and the results rounded back) and give the general path's bits."""
    cls, options = CELLS[kind]
    torch.manual_seed(0)
    cell = cls(11, 37, backend="fused", **options).to(dtype).eval()
    lead = () if batch is None else (batch,)
    x = torch.randn(*lead, 11).to(dtype)
    state = None
    for step in range(3):
        with torch.no_grad():
            plans = cell._step_plans(x, state)
            assert plans is not None
            out = plans[0](x, state)
            assert out is not None, "the plan declined a call it takes"
            expected = cell._step(x, state)
        got = list(out) if isinstance(out, tuple) else [out]
        want = list(expected) if isinstance(expected, tuple) else [expected]
        for a, e in zip(got, want):
            assert a.dtype == dtype and a.shape == e.shape
            assert torch.equal(a, e), f"step {step}: the plan differs from the general path"
        state = out


@pytest.mark.parametrize("dtype", HALF)
def test_one_step_calls_of_a_half_stack_run_on_the_plans(dtype):
    torch.manual_seed(0)
    lstm = rnnkit.LSTM(11, 37, num_layers=2, peephole=True, backend="fused").to(dtype).eval()
    x = torch.randn(5, 2, 11).to(dtype)
    with torch.no_grad():
        expected = [lstm(x[t:t + 1], None) for t in range(2)]

        def general_path(*args):
            raise AssertionError("a one-step call left the plans for the general path")

        lstm._pass_weights = general_path
        got = [lstm(x[t:t + 1], None) for t in range(2)]
    for (y, (h, c)), (ye, (he, ce)) in zip(got, expected):
        assert y.dtype == dtype
        assert torch.equal(y, ye) and torch.equal(h, he) and torch.equal(c, ce)



@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["lstm_stack", "lstm_cell", "gru_cell"])
def test_half_plans_see_in_place_updates_of_the_vectors(kind, dtype):
    """A half-precision module's one-step plans widen its vectors (biases, peepholes, layer norm's
    gains and shifts) to float32 at each call: an in-place update after the plans were built (an
    optimizer's step, load_state_dict, init) reaches the next step, as on a fresh copy. (The plans
    once widened them when built and kept the copies: every later step used the old biases.)"""
    cls, options, cell = {"lstm_stack": (rnnkit.LSTM, dict(peephole=True, layer_norm=True), False),
                          "lstm_cell": (rnnkit.LSTMCell, dict(peephole=True, layer_norm=True), True),
                          "gru_cell": (rnnkit.GRUCell, dict(layer_norm=True), True)}[kind]
    torch.manual_seed(0)
    module = cls(8, 16, backend="fused", **options).to(dtype).eval()
    x = torch.randn(2, 8).to(dtype) if cell else torch.randn(1, 2, 8).to(dtype)
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731

    def check(what):
        with torch.no_grad():
            assert module._step_plans(x, None) is not None  # the call below runs on the plans
            got, want = first(module(x)), first(copy.deepcopy(module)(x))
        assert torch.equal(got, want), f"{what}: the one-step plans used stale vectors"

    check("first call")  # plans built
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p))  # every vector, in place
    check("after in-place updates")
    module.load_state_dict({k: torch.randn_like(v) for k, v in module.state_dict().items()})
    check("after load_state_dict")


TRAINING_STACKS = {"lstm": (rnnkit.LSTM, dict(num_layers=2, bidirectional=True, proj_size=5, peephole=True)),
                   "gru": (rnnkit.GRU, dict(num_layers=2, layer_norm=True)),
                   "rnn": (rnnkit.RNN, dict(nonlinearity="relu", zoneout=0.1))}


DTYPE_KERNELS = [pytest.param(torch.bfloat16, kernel, id=f"bf16-{kernel}") for kernel in BF16_KERNELS] + [
    pytest.param(torch.float16, "none", id="fp16")]  # the bfloat16 kernels take bfloat16 matrices only


@pytest.mark.parametrize("dtype, kernel", DTYPE_KERNELS)
@pytest.mark.parametrize("kind", list(TRAINING_STACKS))
def test_half_stacks_train(kind, dtype, kernel):
    """A half-precision stack's gradients reach its parameters in its dtype, within the dtype's
    tolerance of the float32 stack's on the same values (training mode: zoneout's masks drawn alike)."""
    cls, options = TRAINING_STACKS[kind]
    torch.manual_seed(0)
    half = cls(11, 37, backend="fused", **options).to(dtype)
    full = cls(11, 37, backend="fused", **options)
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    x = torch.randn(6, 3, 11).to(dtype)
    upstream = torch.randn(6, 3, half.spec.num_directions * half.spec.output_size(0))
    with bf16_kernel(kernel):
        torch.manual_seed(1)
        (half(x)[0].float() * upstream).sum().backward()
    torch.manual_seed(1)
    (full(x.float())[0] * upstream).sum().backward()
    for (name, p), q in zip(half.named_parameters(), full.parameters()):
        assert p.grad is not None and p.grad.dtype == dtype, name
        assert_close(p.grad.float(), q.grad, name, tol=TOLERANCE[dtype])


def test_the_kernels_refuse_half_matrices_where_they_cannot_take_them():
    """Half matrices take float32 inputs, states and vectors, or all of them in the matrices' dtype
    (a half-precision call), and all one dtype: float64 inputs, mismatched matrices, half vectors
    beside a float32 x or float32 ones beside a half x are refused with the reason, never computed
    wrongly."""
    from rnnkit.passes import PassScalars

    lstm = rnnkit.LSTM(4, 6, backend="fused")
    w = lstm._pass_weights()[0]
    with torch.no_grad():
        half = w._replace(W=w.W.bfloat16(), R=w.R.bfloat16())
    scalars = PassScalars("lstm", 0.0, 0.0, None, None, False, True, False)
    x, h0, c0 = torch.randn(3, 2, 4), torch.zeros(2, 6), torch.zeros(2, 6)

    def forward(x, weights, training):
        return fused_ops.OPS.forward_impl(x, h0.to(x.dtype), c0.to(x.dtype), *weights, None, None, None, None,
                                          *scalars, training)

    with pytest.raises(RuntimeError, match="x is float32 or BFloat16, got x Double"):
        forward(x.double(), half, False)
    with pytest.raises(RuntimeError, match="R: expected BFloat16"):
        forward(x, half._replace(R=w.R.detach().half()), False)
    with pytest.raises(RuntimeError, match="biases, gains, states and masks are float32"):
        forward(x, half._replace(b_W=w.b_W.detach().bfloat16()), False)
    with pytest.raises(RuntimeError, match="b_W: expected BFloat16 like x and W"):
        forward(x.bfloat16(), half, False)  # its float32 vectors beside a bfloat16 x


def _bf16_dropout_mask(shape, p, like, draw=masks._dropout_mask):
    """A bfloat16 module's dropout mask for a float32 run: drawn alike, its scale 1/(1-p) rounded to
    bfloat16 as a bfloat16 module's masks are (rnnkit/masks.py draws in the input's dtype, as
    torch.nn.functional.dropout scales in it)."""
    return draw(shape, p, like).bfloat16().to(like.dtype)


def _rounded_products_runs(mode, options, training, T=9, B=4, lengths=(9, 3, 1, 6)):
    """(outputs, gradients) of one module twice: float32 on the reference backend under
    `RoundedProducts` (every product's operands and, in backward, the gradient entering it rounded
    to bfloat16), then in bfloat16 on the fused kernels; the same bfloat16 weights, input, initial
    states, upstream gradients and masks. The reference's results are rounded to bfloat16 as the
    bfloat16 module returns them. -> (the module's parameter names, [reference results, fused results]),
    each results list y, the final states, dx, the initial states' gradients, then the parameters'."""
    torch.manual_seed(0)
    module = make_module(mode, 11, 37, torch.float32, **options)
    with torch.no_grad():
        module.flat_weights.copy_(module.flat_weights.bfloat16().float())
    spec = module.spec
    x = torch.randn(T, B, 11).bfloat16()
    states = [torch.randn(spec.num_layers * spec.num_directions, B, spec.output_size(0)).bfloat16()]
    if mode == "lstm":
        states.append(torch.randn(spec.num_layers * spec.num_directions, B, 37).bfloat16())
    lengths = None if lengths is None else torch.tensor(lengths)
    runs = []
    for dtype, backend in ((torch.float32, "reference"), (torch.bfloat16, "fused")):
        m = copy.deepcopy(module).to(dtype)
        m.backend = backend
        m.train(training)
        leaves = [t.to(dtype).requires_grad_() for t in [x] + states]
        hx = tuple(leaves[1:]) if mode == "lstm" else leaves[1]
        with contextlib.ExitStack() as scope:
            if dtype == torch.float32:
                scope.enter_context(RoundedProducts(torch.bfloat16))
                scope.enter_context(mock.patch.object(masks, "_dropout_mask", _bf16_dropout_mask))
            torch.manual_seed(1)  # the same masks
            y, hy = m(leaves[0], hx, lengths)
            outputs = [y] + flatten(hy)
            generator = torch.Generator().manual_seed(2)
            upstream = [torch.randn(o.shape, generator=generator).bfloat16().to(dtype) for o in outputs]
            grads = torch.autograd.grad(outputs, leaves + list(m.parameters()), upstream)
        runs.append([t.detach().bfloat16() for t in outputs + list(grads)])
    return [name for name, _ in module.named_parameters()], runs


# The fused bfloat16 kernels round what a bfloat16 GEMM with float32 accumulation must (x, h entering
# R, the projection's input, the gates' gradient entering the backward's products) and nothing else,
# so the reference on the same roundings returns the same bfloat16 values but for float32 ties, and
# for two results a bfloat16 module rounds twice: rnnkit.testing.BF16_ROUNDED_TOLERANCE, measured.
# Stacks (layers, directions) are left to the pass-level tests above: a bfloat16 module hands its
# passes' outputs on as bfloat16 tensors (as torch.nn's bfloat16 LSTM does), so a bidirectional
# sum, an inter-layer dropout and every gradient flowing back between passes round once more than in
# the reference (measured 1e-3 to 5e-3 without clips, 5e-2 with cell and projection clips, whose kinks
# a flipped ulp crosses).
def _one_pass(options) -> bool:
    return options.get("num_layers", 1) == 1 and not options.get("bidirectional")


ROUNDED_PRODUCTS_CASES = [pytest.param(mode, options, False, id=case.id) for case in CASES
                          for mode, options in [case.values] if _one_pass(options)] + \
                         [pytest.param(mode, options, True, id=f"training-{name}") for name, (mode, options)
                          in TRAINING_CASES.items() if _one_pass(options)]


@pytest.mark.skipif(BF16_KERNELS == ["none"], reason="no bfloat16 GEMM kernels on this CPU (AVX-512 needed)")
@pytest.mark.parametrize("mode, options, training", ROUNDED_PRODUCTS_CASES)
def test_bf16_module_is_the_reference_on_rounded_products(mode, options, training):
    """A bfloat16 module on the fused kernels (each bfloat16 kernel this CPU runs) against the
    float32 reference whose products round their operands as a bfloat16 GEMM does (``rnnkit.testing``'s
    RoundedProducts): outputs, final states, the gradients of the input, the initial states and
    every weight, in training with the bfloat16 module's masks."""
    states = ["h_0", "c_0"] if mode == "lstm" else ["h_0"]
    twice = {name for name, on in (("dx", training and options.get("input_dropout")),
                                   ("weight_hh_l0", training and options.get("dropconnect"))) if on}
    for kernel in BF16_KERNELS:
        if kernel == "none":
            continue
        with bf16_kernel(kernel):
            parameters, (reference, fused) = _rounded_products_runs(mode, options, training)
        names = ["y"] + [f"{s} final" for s in states] + ["dx"] + [f"d {s}" for s in states] + parameters
        assert len(fused) == len(reference) == len(names)
        for name, a, e in zip(names, fused, reference):
            tolerance = BF16_ROUNDED_TOLERANCE["twice_rounded" if name in twice else "rounded_products"]
            assert_close(a.float(), e.float(), f"{kernel}: {name}", tol=tolerance)


@pytest.mark.parametrize("kernel", BF16_KERNELS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_a_bfloat16_call_without_a_gradient_takes_the_quick_activations(mode, dtype, kernel):
    """csrc/pass.h, PassArgs::quick_activations: a bfloat16 pass without a gradient on the bfloat16
    kernels takes σ and tanh in their quick forms (simd.h: within 2.5 float32 ulp, not 1.5), as int8
    inference does; a pass that will be differentiated, a float16 one and one on widened matrices
    (kernels "none") keep float32's. One step from the same state, the pass's float32 results:
    the two calls differ by those few ulp (and do differ: the quick forms ran), or not at all."""
    module, _ = rounded_module(mode, {}, dtype, 1, 16)
    spec, cell = module.spec, module.spec.cell(0)
    torch.manual_seed(5)
    x = 2 * torch.randn(1, 16, spec.input_size)  # gates over σ's and tanh's whole curve
    h0, c0 = torch.randn(16, cell.output_size), (torch.randn(16, cell.hidden_size) if mode == "lstm" else None)
    masks = draw_pass(spec, cell, 1, 16, x, False).masks
    with torch.no_grad():
        w = module._pass_weights()[0]
    half = w._replace(**{k: getattr(w, k).to(dtype) for k in ("W", "R", "W_hr") if getattr(w, k) is not None})
    with bf16_kernel(kernel):
        with torch.no_grad():
            quick = FusedCPUBackend().run_pass(cell, x, h0, c0, half, None, False, masks)
        leaf = x.clone().requires_grad_()
        full = FusedCPUBackend().run_pass(cell, leaf, h0, c0, half, None, False, masks)
    quick, full = [t for t in quick if t is not None], [t.detach() for t in full if t is not None]
    if dtype == torch.bfloat16 and kernel != "none":
        for name, a, e in zip(["y", "h_n", "c_n"], quick, full):
            bound = 8 * torch.finfo(torch.float32).eps * max(1.0, e.abs().max().item())
            assert (a - e).abs().max().item() <= bound, f"{name}: beyond the quick forms' few ulp"
        assert not torch.equal(quick[0], full[0]), "the call without a gradient took float32's forms"
    else:
        for a, e in zip(quick, full):
            assert torch.equal(a, e)


def test_rounded_products_round_both_operands_and_the_gradient_entering_them():
    """`RoundedProducts`: a @ b on a and b rounded to bfloat16; in backward the gradient entering the
    product rounded too, then passed straight through the roundings; everything else untouched."""
    torch.manual_seed(0)
    a, b = torch.randn(5, 7, requires_grad=True), torch.randn(7, 3, requires_grad=True)
    g = torch.randn(5, 3)
    r = lambda t: t.bfloat16().float()  # noqa: E731
    with RoundedProducts(torch.bfloat16):
        out = a @ b
        other = a * 1.0001  # not a product: float32
        da, db = torch.autograd.grad(out, [a, b], g)
    assert torch.equal(out, r(a.detach()) @ r(b.detach()))
    assert torch.equal(da, r(g) @ r(b.detach()).T) and torch.equal(db, r(a.detach()).T @ r(g))
    assert torch.equal(other, a.detach() * 1.0001) and not torch.equal(out, a.detach() @ b.detach())
    bias = torch.randn(3)
    with RoundedProducts(torch.bfloat16):
        assert torch.equal(torch.nn.functional.linear(a, b.T, bias), r(a.detach()) @ r(b.detach()) + bias)
        assert torch.equal(torch.addmm(bias, a, b, beta=0.5), 0.5 * bias + r(a.detach()) @ r(b.detach()))
        assert torch.equal(torch.mm(a, b), out) and torch.equal(torch.bmm(a[None], b[None])[0], out)
        with pytest.raises(NotImplementedError, match="einsum"):
            torch.einsum("ik,kj->ij", a, b)  # a product it does not model: an error, not float32


def test_auto_leaves_float32_lstm_training_to_onednn_without_avx512(monkeypatch):
    """Without AVX-512 the fused kernels' float32 LSTM was measured no faster than oneDNN's in
    training or with lengths (on MKL's products on an AVX2 EPYC; level on the own AVX2 kernel,
    emulated): auto runs a float32 LSTM of 5 rows or more on `native` there,
    and still GRUs, bfloat16 training and batches of up to 4 rows on `fused`."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    lstm, gru = rnnkit.LSTM(3, 4), rnnkit.GRU(3, 4)
    x = torch.randn(5, 6, 3)
    lstm(x)
    assert lstm.last_backend == "native"
    with torch.no_grad():
        lstm(x, lengths=torch.tensor([5, 4, 3, 2, 1, 1]))
    assert lstm.last_backend == "native"
    lstm(x[:, :4])
    assert lstm.last_backend == "fused"
    gru(x)
    assert gru.last_backend == "fused"
    if rnnkit.backend.get("native").unsupported_reason(lstm.spec, torch.device("cpu"), torch.bfloat16) is None:
        lstm.to(torch.bfloat16)(x.bfloat16())
        assert lstm.last_backend == "fused"


@pytest.mark.skipif(BF16_KERNELS == ["none"], reason="no bfloat16 GEMM kernels on this CPU (AVX-512 needed)")
@pytest.mark.parametrize("layer_norm", [False, True], ids=["plain", "layer_norm"])
@pytest.mark.parametrize("mode", ["lstm", "rnn_tanh"])
def test_weight_gradients_sharing_one_rounding_equal_each_alone(mode, layer_norm):
    """Without layer norm R's and W's gradients both take the gates' gradient dG, rounded to bfloat16 once for
    the two (a step at a time: csrc/pass.h, RoundedSteps): each equals, bit for bit, the gradient computed with
    the other matrix frozen (the backward then rounds only what the one gradient reads), for every layer of a
    stack; with layer norm (two different gradients) nothing is shared. T·B odd: the rounded rows' padding
    (poisoned buffers) must be written."""
    torch.manual_seed(0)
    module = make_module(mode, 24, 40, torch.float32, num_layers=2, backend="fused",
                         layer_norm=layer_norm).to(torch.bfloat16)
    x = torch.randn(9, 5, 24, dtype=torch.bfloat16)
    upstream = torch.randn(9, 5, 40)

    def grads(names):
        for name, p in module.named_parameters():
            p.requires_grad_(name in names)
        y, _ = module(x)
        return torch.autograd.grad(y.float(), [dict(module.named_parameters())[n] for n in names], upstream)

    names = [f"{kind}_l{layer}" for layer in range(2) for kind in ("weight_ih", "weight_hh")]
    together = dict(zip(names, grads(names)))
    assert module.last_backend == "fused"
    for name in names:
        (alone,) = grads([name])
        assert torch.equal(alone, together[name]), name


ROUNDED_STEPS_CASES = [pytest.param("lstm", {}, id="lstm"),
                       pytest.param("lstm", dict(peephole=True, proj_size=5), id="lstm-peephole-projection"),
                       pytest.param("lstm", dict(layer_norm=True), id="lstm-layer_norm"),
                       pytest.param("rnn_tanh", {}, id="rnn_tanh"),
                       pytest.param("rnn_relu", dict(layer_norm=True), id="rnn_relu-layer_norm")]


@pytest.mark.skipif(BF16_KERNELS == ["none"], reason="no bfloat16 GEMM kernels on this CPU (AVX-512 needed)")
@pytest.mark.parametrize("mode, options", ROUNDED_STEPS_CASES)
def test_bf16_backward_rounds_each_step_into_its_place(mode, options):
    """csrc/pass.h, RoundedSteps: a bfloat16 LSTM's or RNN's backward rounds each step's dG to
    bfloat16 as it goes, into that step's rows and into its columns of the transpose that the weight
    gradients read: from the last step to the first, or from the first to the last in a reverse pass.
    A reverse pass over x equals the forward pass over x flipped in time, for each bfloat16 kernel:
    y, the final states, dx and the initial states' gradients bit for bit (the same arithmetic in the
    same order), the matrices' gradients to float32's summation order (their sums over the T·B rows
    run the other way). T·B odd: the transpose's padding, in poisoned buffers, must be written."""
    T, B = 7, 3
    module = make_module(mode, 11, 37, torch.float32, **options)
    spec, cell = module.spec, module.spec.cell(0)
    lstm = mode == "lstm"
    torch.manual_seed(6)
    x = torch.randn(T, B, 11).bfloat16().float()
    states = [torch.randn(B, cell.output_size).bfloat16().float()]
    if lstm:
        states.append(torch.randn(B, cell.hidden_size).bfloat16().float())
    upstream = [torch.randn(T, B, cell.output_size)] + [torch.randn(s.shape) for s in states]
    masks = draw_pass(spec, cell, T, B, x, False).masks
    with torch.no_grad():
        w = module._pass_weights()[0]
    names = [k for k in ("W", "R", "W_hr") if getattr(w, k) is not None]

    count = build.extension().bf16_round_part_count

    def run(reverse):
        matrices = {k: getattr(w, k).bfloat16().requires_grad_() for k in names}
        leaves = [(x if reverse else x.flip(0)).clone().requires_grad_()] + [s.clone().requires_grad_() for s in states]
        out = FusedCPUBackend().run_pass(cell, leaves[0], leaves[1], leaves[2] if lstm else None,
                                         w._replace(**matrices), None, reverse, masks)
        out = [t for t in out if t is not None]
        dy = upstream[0] if reverse else upstream[0].flip(0)
        start = count()
        grads = torch.autograd.grad(out, leaves + list(matrices.values()), [dy] + upstream[1:])
        assert count() - start == 2 * T, "each step's dG rounded into its rows and its columns"
        if not reverse:  # back to the reverse pass's time order
            out, grads = [out[0].flip(0)] + out[1:], (grads[0].flip(0),) + grads[1:]
        return out, list(grads)

    for kernel in BF16_KERNELS:
        if kernel == "none":
            continue
        with bf16_kernel(kernel):
            (outputs, grads), (flipped_outputs, flipped_grads) = run(True), run(False)
        grad_names = ["dx", "d h0", "d c0"][:1 + len(states)]
        n = len(grad_names)
        for name, a, e in zip(["y", "h_n", "c_n"][:len(outputs)] + grad_names, outputs + grads[:n],
                              flipped_outputs + flipped_grads[:n]):
            assert torch.equal(a, e), f"{kernel}: {name}"
        for name, a, e in zip(names, grads[n:], flipped_grads[n:]):
            assert torch.isfinite(a.float()).all(), f"{kernel}: d{name}"
            assert_close(a.float(), e.float(), f"{kernel}: d{name}", tol=TOLERANCE[torch.float32])
