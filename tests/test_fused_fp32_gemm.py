"""The float32 GEMMs of the fused passes (fgemm.cpp): the kernels' own, on weights packed once per
pass into panels of 16 columns (AVX-512: 4 panels x 6 rows a block; AVX2: 1 x 6), or MKL's packed
sgemm. Each own kernel against float64 on awkward shapes (row, column and depth tails, the depth
split at 512, strided rows), and whole passes, forward and backward, on every kernel this CPU runs
against the reference. Kernel buffers are NaN-poisoned, as in test_fused.py, so a panel's padding
or a block's tail left unwritten fails.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from rnnkit import fused
from rnnkit.fused import build
from helpers import MODULES, assert_close, make_module, random_states
from test_fused import CASES
from test_fused_accuracy import assert_fused_error_within_twice_the_references, errors_against_float64

pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")  # conftest.py

# every float32 GEMM this CPU runs ("mkl" everywhere), and the kernels' own among them
FP32_GEMMS = fused.fp32_gemms() if build.unavailable_reason() is None else ["mkl"]
OWN = [name for name in FP32_GEMMS if name != "mkl"]


@pytest.mark.skipif(not OWN, reason="no own float32 GEMM kernels on this CPU (AVX2 + FMA or AVX-512 needed)")
@pytest.mark.parametrize("kernel", OWN or ["none"])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 37])  # row blocks: 1 of 1..6; 6 + 1; 6, 6, 5, 5, 5, 5; ...
@pytest.mark.parametrize("transposed", [False, True], ids=["M", "M_t"])
def test_own_gemm_matches_float64(kernel, rows, transposed):
    """X · Mᵀ (M packed by rows) and X · M (M packed by columns, a backward's products)."""
    torch.manual_seed(rows)
    # N: one column, panel tails (15, 17, 100), whole blocks (64 = 4 panels); K: 1, odd, the 512 split
    for N, K in [(1, 1), (15, 7), (17, 33), (64, 256), (100, 513), (70, 1100)]:
        X, M = torch.randn(rows, K), torch.randn(N, K)
        with fused.use_fp32_gemm(kernel):
            packed = build.extension().f32_pack(M.t().contiguous() if transposed else M, transposed)
            got = build.extension().f32_gemm_packed(X, packed, N)
        assert_close(got, (X.double() @ M.double().t()).float(), f"{N}x{K}, {rows} rows")


@pytest.mark.skipif(not OWN, reason="no own float32 GEMM kernels on this CPU (AVX2 + FMA or AVX-512 needed)")
@pytest.mark.parametrize("kernel", OWN or ["none"])
def test_own_gemm_of_many_rows_and_a_deep_sum_runs_by_chunks_of_rows(kernel):
    """Past one pass over K (512) and C over a tile of panels beyond 256 KB (a backward's dx = dA · W),
    the product takes its rows in chunks, each through every pass over K (fgemm.cpp, chunk_blocks):
    every row of every chunk, the last one short, is written (the result buffer is NaN-poisoned), as
    the product of its own rows would give it, bit for bit."""
    torch.manual_seed(0)
    extension = build.extension()
    # rows: 2 chunks of 85 + 82 row blocks (8 panels a tile); 2 of 170 + 47 (4 panels); 2 of 341 + 159 (2 panels)
    for rows, N, K in [(1000, 300, 1100), (1300, 64, 1025), (3000, 17, 600)]:
        X, M = torch.randn(rows, K), torch.randn(N, K)
        with fused.use_fp32_gemm(kernel):
            packed = extension.f32_pack(M, False)
            whole = extension.f32_gemm_packed(X, packed, N).clone()  # the result is a cached buffer: cloned
            pieces = torch.cat([extension.f32_gemm_packed(X[r:r + 37], packed, N).clone() for r in range(0, rows, 37)])
        assert torch.equal(whole, pieces), f"{rows}x{K}x{N}: a row's value depends on the chunk it ran in"
        assert_close(whole, (X.double() @ M.double().t()).float(), f"{rows}x{K}x{N}")


@pytest.mark.skipif(not OWN, reason="no own float32 GEMM kernels on this CPU (AVX2 + FMA or AVX-512 needed)")
@pytest.mark.parametrize("kernel", OWN or ["none"])
def test_own_gemm_reads_strided_rows_and_leaves_the_rest(kernel):
    """X rows with a leading dimension past K (a slice of a wider buffer)."""
    wide = torch.randn(9, 40)
    X, M = wide[:, 3:30], torch.randn(50, 27)
    with fused.use_fp32_gemm(kernel):
        got = build.extension().f32_gemm_packed(X, build.extension().f32_pack(M, False), 50)
    assert_close(got, (X.double() @ M.double().t()).float(), "strided X")


@pytest.mark.skipif(not OWN, reason="no own float32 GEMM kernels on this CPU (AVX2 + FMA or AVX-512 needed)")
@pytest.mark.parametrize("kernel", OWN or ["none"])
@pytest.mark.parametrize("rows", [0, 1, 7, 512, 1100])  # the sum's depth: empty, short, the 512 split and past it
@pytest.mark.parametrize("binding", ["f32_gemm_at_b", "f32_gemm_at_b_packed"])
def test_own_weight_gradient_matches_float64(kernel, rows, binding):
    """Aᵀ · B (the weight gradients), both ways a pass takes it. In place (f32_gemm_at_b): A's columns
    are the GEMM's rows (1, a block and a tail, several blocks), B's columns whole panels read in place
    and a tail copied into a padded panel. As (Bᵀ · A)ᵀ (f32_gemm_at_b_packed, the larger ones): A
    packed into panels (N a tail of a panel or several), Bᵀ read from B in place as the product's
    rows, the [K, N] product transposed into the result in 16 x 16 blocks. N, K of 1-4, 15, 16, 17,
    27, 37, 40, 64, 100 (blocks of every height, 1 to 6 rows); A and B slices of wider buffers, as a
    GRU's gate columns; NaN-poisoned scratch."""
    torch.manual_seed(rows)
    extension = build.extension()
    product = getattr(extension, binding)
    for N, K in [(1, 1), (2, 2), (3, 3), (4, 4), (5, 15), (13, 16), (37, 17), (6, 64), (64, 100), (100, 37),
                 (27, 40)]:
        A = torch.randn(rows, N + 9)[:, 4:4 + N]
        B = torch.randn(rows, K + 3)[:, 1:1 + K]
        before = (A.clone(), B.clone())
        with fused.use_fp32_gemm(kernel):
            start = extension.f32_gemm_count()
            got = product(A, B)
            assert extension.f32_gemm_count() == start + (rows > 0)  # an empty sum writes zeros
        assert got.shape == (N, K)
        assert_close(got, (A.double().t() @ B.double()).float(), f"{N}x{K}, {rows} rows")
        assert torch.equal(A, before[0]) and torch.equal(B, before[1])
    with fused.use_fp32_gemm("mkl"), pytest.raises(RuntimeError, match="MKL's"):
        product(torch.randn(3, 2), torch.randn(3, 4))


@pytest.mark.skipif(not OWN, reason="no own float32 GEMM kernels on this CPU (AVX2 + FMA or AVX-512 needed)")
@pytest.mark.parametrize("kernel", OWN or ["none"])
@pytest.mark.parametrize("mode, H, T, options", [
    ("lstm", 256, 33, {}),                     # dR and dW share dG: packed once for both
    ("lstm", 256, 33, {"layer_norm": True}),   # LN_x rewrites dA between them: each packs its own
    ("lstm", 256, 33, {"proj_size": 200}),     # dR's B is the projection's 200 columns (a panel tail)
    ("gru", 256, 44, {}),                      # A a slice of the gates' columns (the reset's and the candidate's)
    ("rnn_tanh", 512, 65, {}),
], ids=["lstm", "lstm-ln", "lstm-proj", "gru", "rnn"])
def test_weight_gradients_past_the_in_place_size_run_on_the_own_packed_kernel(kernel, mode, H, T, options):
    """A weight gradient Aᵀ · B whose A (the gates' gradient, T·B × G·H) is past 2²¹ floats, where
    reading A in place lost to MKL, runs as (Bᵀ · A)ᵀ on the own packed kernel (A packed once, Bᵀ
    read from B in place, the product transposed into place: f32_weight_gradient_packed) under
    "avx512", on MKL's under "avx2" (its strided blocks measured slower than MKL): every gradient
    against float64, relative ≤ 1e-4 (float32
    sums over 2,000-4,000 rows read 1e-7 to 1e-5, the layer-norm LSTM's bias gradient the most; a
    misplaced panel or a NaN-poisoned tail is off by far more), with NaN-poisoned buffers, and its
    products counted on the own kernels (MKL's are not)."""
    B, I = 64, 40
    torch.manual_seed(0)
    # torch.nn's init (no nudge, as make_module gives): a tanh RNN of H 512 nudged by 0.1 is chaotic
    # over 65 steps, where float32 and float64 part by 6% on any backend
    module32 = MODULES[mode](I, H, dtype=torch.float32, **options).train()
    module32.backend = "fused"
    module64 = copy.deepcopy(module32).double()
    gates = {"lstm": 4, "gru": 3, "rnn_tanh": 1}[mode] * H
    assert T * B * gates > 2 ** 21  # past the in-place size
    x = torch.randn(T, B, I)
    dy = torch.randn(T, B, module32.spec.output_size(0))
    count = build.extension().f32_gemm_count
    grads = {}
    for module, dtype in ((module32, torch.float32), (module64, torch.float64)):
        module.zero_grad()
        xi = x.to(dtype, copy=True).requires_grad_()
        with fused.use_fp32_gemm(kernel):
            y, _ = module(xi)
            start = count()
            y.backward(dy.to(dtype))
            products = count() - start
        grads[dtype] = {"x": xi.grad, **{name: p.grad for name, p in module.named_parameters()}}
        if dtype == torch.float32:
            # T steps' products with R (and W_hr), dx, and under AVX-512 the two weight gradients at least
            assert products >= T + (3 if kernel == "avx512" else 1), products
    for name, truth in grads[torch.float64].items():
        got = grads[torch.float32][name].double()
        error = ((got - truth).norm() / truth.norm()).item()
        assert error <= 1e-4, f"{name}: relative error {error:.2e}"


DRAWS = 16  # draws pooled per case (test_training_pass_on_every_fp32_gemm_matches_reference)


@pytest.mark.parametrize("kernel", FP32_GEMMS)
@pytest.mark.parametrize("mode, options", CASES)
def test_training_pass_on_every_fp32_gemm_matches_reference(mode, options, kernel):
    """Forward and every gradient of a float32 training pass on each GEMM kernel, on batches that split
    into several row blocks (13 rows: 6, 7 -> 5, 4, 4) and gates that end in a partial panel (4·37 =
    148 = 9 panels + 4), against float64 truth over DRAWS draws pooled: the fused errors' 99th
    percentile finite and at most 2× the float32 reference's (test_fused_accuracy's rule). A kernel
    that misplaces a panel or leaves a NaN-poisoned tail is off by far more than 2×.

    Why 16 draws: on the ill-conditioned cases (everything, coupled_everything: layer norm, clips,
    peepholes and a 3- or 4-wide projection) the ratio of two float32 roundings' errors swings from
    draw to draw (per draw from 0.07 up to 5.6 on `everything` and 6.0 on `coupled_everything`, 40
    draws each on Zen 4). Over 200-300 random subsets of those 40 draws, a pool of 4 exceeded 2× in
    2.5-15% of subsets per kernel (avx512 / mkl), so a change of a kernel's rounding alone could fail
    it; a pool of 16 exceeded it in none (at most 1.54-1.86×). Every other case stayed within 1.6× even with 4
    draws. Clip-boundary flips are not the cause: the worst draws' pre-clip values lie 2e-4 to 7e-4
    (relative) from the clips, far beyond float32's error."""
    T, B, I, H = 7, 13, 21, 37
    lengths = [7, 3, 1, 6, 7, 2, 5, 7, 4, 1, 6, 7, 3]
    samples = []
    with fused.use_fp32_gemm(kernel):
        for seed in range(DRAWS):
            torch.manual_seed(seed)
            module32 = make_module(mode, I, H, torch.float32, **options)
            module64 = copy.deepcopy(module32).double()
            x, states = torch.randn(T, B, I), random_states(module32, B, torch.float32)
            samples.append(errors_against_float64(module32, module64, x, states, lengths, training=True))
    assert_fused_error_within_twice_the_references(samples)


@pytest.mark.skipif(not OWN, reason="no own float32 GEMM kernels on this CPU (AVX2 + FMA or AVX-512 needed)")
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_the_choice_reaches_forward_and_backward(mode):
    """The own kernels take the products of a training pass's forward (R·h each step, W·x in
    chunks) and of its backward (· R each step, dx = dA · W); on "mkl" they take none."""
    module = make_module(mode, 48, 64, torch.float32).train()
    count = build.extension().f32_gemm_count
    for kernel in ("mkl", OWN[0]):
        x = torch.randn(6, 16, 48, requires_grad=True)
        with fused.use_fp32_gemm(kernel):
            module.backend = "fused"
            start = count()
            y, _ = module(x)
            forward = count() - start
            y.backward(torch.randn_like(y))
            backward = count() - start - forward
        if kernel == "mkl":
            assert forward == backward == 0
        else:
            assert forward >= 7 and backward >= 7, (forward, backward)  # 6 steps + the projection, each way


@pytest.mark.skipif(not OWN, reason="no own float32 GEMM kernels on this CPU (AVX2 + FMA or AVX-512 needed)")
def test_a_matrix_packed_before_the_choice_changed_to_mkl_still_multiplies():
    """Another thread's use_fp32_gemm("mkl") during a pass: the panels it packed still multiply."""
    X, M = torch.randn(7, 33), torch.randn(40, 33)
    with fused.use_fp32_gemm(OWN[0]):
        packed = build.extension().f32_pack(M, False)
    with fused.use_fp32_gemm("mkl"):
        got = build.extension().f32_gemm_packed(X, packed, 40)
    assert_close(got, (X.double() @ M.double().t()).float(), "after the switch")


def test_choosing_a_kernel_that_cannot_run_says_which_can():
    with pytest.raises(ValueError, match=r"expected 'auto' or one of .*mkl.*got 'fastest'"):
        with fused.use_fp32_gemm("fastest"):
            pass
    with pytest.raises(TypeError, match="name: expected a str"):
        with fused.use_fp32_gemm(None):
            pass
    assert fused.fp32_gemm() in fused.FP32_GEMMS  # the bad names left the choice as it was
    if "avx512" not in FP32_GEMMS:
        with pytest.raises(ValueError, match="needs instructions this CPU does not have"):
            with fused.use_fp32_gemm("avx512"):
                pass


def test_auto_takes_the_own_kernels_on_the_widest_vectors_and_mkl_elsewhere():
    """The CPU's choice, as measured (docs/reference/backends.md): the own kernels on AVX-512 (the
    weight gradients MKL's on Intel's CPUs, the own elsewhere), else on AVX2 + FMA, else MKL."""
    from rnnkit.app import machine

    intel = machine.cpu_vendor() == "GenuineIntel"
    expected = (("avx512-mkl" if intel else "avx512") if "avx512" in FP32_GEMMS else "avx2" if "avx2" in FP32_GEMMS
                else "mkl")
    with fused.use_fp32_gemm("auto"):
        assert fused.fp32_gemm() == expected


@pytest.mark.skipif("avx2" not in FP32_GEMMS, reason="no AVX2 + FMA on this CPU")
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_avx2_leaves_the_weight_gradients_to_mkl(mode):
    """Under "avx2" a training pass's products with a weight matrix run on the own kernel and its
    weight gradients on MKL's (f32_own_weight_gradients): a backward takes exactly the products
    with R each step and dx there (so does "avx512-mkl"), and under "avx512" (where this CPU has it)
    the weight gradients besides; the gradients agree within float32 sums' rounding either way."""
    T = 9
    options = {"reset_after": True} if mode == "gru" else {}  # reset_after=False: two products a step
    module = make_module(mode, 48, 64, torch.float32, **options).train()
    module.backend = "fused"
    count = build.extension().f32_gemm_count
    steps_products = 1  # per backward step: dG · R (a GRU's three gates in one)
    results = {}
    for kernel in [k for k in ("avx2", "avx512-mkl", "avx512") if k in FP32_GEMMS]:
        x = torch.randn(T, 16, 48, generator=torch.Generator().manual_seed(1)).requires_grad_()
        module.zero_grad()
        with fused.use_fp32_gemm(kernel):
            y, _ = module(x)
            start = count()
            y.backward(torch.ones_like(y))
            results[kernel] = (count() - start, [x.grad] + [p.grad.clone() for p in module.parameters()])
    products, grads = results["avx2"]
    assert products == T * steps_products + 1, products  # each step's · R and dx; no weight gradient
    if "avx512-mkl" in results:
        assert results["avx512-mkl"][0] == products, results["avx512-mkl"][0]
        for got, want in zip(grads, results["avx512-mkl"][1]):
            assert_close(got, want, "avx2 against avx512-mkl")
    if "avx512" in results:
        own, own_grads = results["avx512"]
        assert own >= products + 2, (own, products)  # dW and dR as well
        for got, want in zip(grads, own_grads):
            assert_close(got, want, "avx2 against avx512")


def test_a_bad_environment_value_fails_each_float32_call_until_a_choice_is_set():
    """A bad $RNNKIT_FP32_GEMM fails the passes that multiply in float32, with the runnable names; float64
    and int8 passes, which have no float32 GEMM, run."""
    script = (
        "import torch, rnnkit\n"
        "from rnnkit import fused\n"
        "rnnkit.LSTM(4, 8, backend='fused', dtype=torch.float64)(torch.randn(3, 2, 4, dtype=torch.float64))\n"
        "rnnkit.quantize(rnnkit.LSTM(4, 8).eval())(torch.randn(3, 2, 4))\n"
        "print('float64 and int8 ran')\n"
        "lstm = rnnkit.LSTM(4, 8, backend='fused')\n"
        "try:\n"
        "    lstm(torch.randn(3, 2, 4))\n"
        "except ValueError as error:\n"
        "    print('refused:', error)\n"
        "with fused.use_fp32_gemm('mkl'):\n"
        "    lstm(torch.randn(3, 2, 4))\n"
        "print('ran on', fused.fp32_gemm())\n"
    )
    env = dict(os.environ, RNNKIT_FP32_GEMM="fastest")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "float64 and int8 ran" in out.stdout
    assert "refused: RNNKIT_FP32_GEMM: expected 'auto' or one of" in out.stdout and "got 'fastest'" in out.stdout
    assert "ran on" in out.stdout
