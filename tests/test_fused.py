"""The fused CPU backend against the reference: outputs and every gradient, every option.

Each case runs one module twice on the same weights, inputs and seed (so training masks are
the same draws): backend="reference", then backend="fused", with random upstream gradients
on y, h_n and c_n. Buffers the C++ kernels allocate are NaN-poisoned (as conftest.py does
for torch.empty), so an unwritten value fails the comparison.
"""
from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import rnnkit
from rnnkit import backend as backends
from rnnkit.fused import build
from helpers import assert_close, flatten, make_module, map_tree, run_backend



pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")  # conftest.py


def run_both(module, x, hx, lengths=None, training=False):
    """(outputs, gradients) per backend: y, final states; dx, d initial states, d flat weights.

    The reference runs in float64 on the same weights, inputs and masks (a float32 module's
    Bernoulli draws are the float64 ones, seed for seed): a float32 fused pass is held to its
    distance from the exact answer, not from another float32 computation, whose own rounding
    (about as large, in the ill-conditioned cases) would make the comparison a coin toss."""
    results = {"fused": run_backend(module, "fused", x, hx, lengths, training)}
    if x.dtype != torch.float64:
        exact = lambda t: t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
        module, x, hx = copy.deepcopy(module).double(), exact(x), map_tree(hx, exact)
    results["reference"] = run_backend(module, "reference", x, hx, lengths, training)
    return results


def assert_fused_matches(mode, dtype=torch.float64, T=6, B=3, I=5, H=7, lengths=None, training=False,
                         batch_first=False, **options):
    module = make_module(mode, I, H, dtype, batch_first=batch_first, **options)
    spec = module.spec
    D, L = spec.num_directions, spec.num_layers
    x = torch.randn(*((B, T) if batch_first else (T, B)), I, dtype=dtype, requires_grad=True)
    if spec.per_layer:  # states are per-layer lists (D, B, size_k)
        h0 = [torch.randn(D, B, spec.output_size(k), dtype=dtype, requires_grad=True) for k in range(L)]
        c0 = [torch.randn(D, B, spec.hidden_sizes[k], dtype=dtype, requires_grad=True) for k in range(L)]
    else:
        h0 = torch.randn(L * D, B, spec.output_size(0), dtype=dtype, requires_grad=True)
        c0 = torch.randn(L * D, B, H, dtype=dtype, requires_grad=True)
    hx = (h0, c0) if mode == "lstm" else h0
    results = run_both(module, x, hx, lengths, training)
    (out_f, grad_f), (out_r, grad_r) = results["fused"], results["reference"]
    for k, (a, e) in enumerate(zip(out_f, out_r)):
        assert_close(a.double(), e, "y" if k == 0 else f"final state {k - 1}", dtype)
    state_names = [f"d state_0[{k}]" for k in range(len(grad_r) - 2)]
    for name, a, e in zip(["dx"] + state_names + ["d flat_weights"], grad_f, grad_r):
        assert_close(a.double(), e, name, dtype)
    # every named piece of the packed gradient, so a failure says which parameter is off
    for entry in module.layout:
        assert_close(module.layout.view(grad_f[-1], entry.name).double(), module.layout.view(grad_r[-1], entry.name),
                     entry.name, dtype)


LSTM_CASES = {
    "plain": {},
    "peephole": dict(peephole=True),
    "layer_norm": dict(layer_norm=True),
    "projection": dict(proj_size=4),
    "proj_clip": dict(proj_size=4, proj_clip=0.1),
    "cell_clip": dict(cell_clip=0.2),
    "coupled": dict(coupled_gates=True),
    "coupled_peephole": dict(coupled_gates=True, peephole=True),
    "zoneout_eval": dict(zoneout=(0.3, 0.2)),
    "bias_none": dict(bias_mode="none"),
    "bias_single_input": dict(bias_mode="single_input"),
    "everything": dict(peephole=True, layer_norm=True, proj_size=4, proj_clip=0.3, cell_clip=0.5,
                       zoneout=(0.2, 0.1)),
    "coupled_everything": dict(coupled_gates=True, peephole=True, layer_norm=True, cell_clip=0.4, proj_size=3),
    "stack_bidirectional": dict(num_layers=2, bidirectional=True, peephole=True),
    "per_layer_sizes_sum": dict(num_layers=2, bidirectional=True, merge="sum", proj_size=[0, 3]),
}
GRU_CASES = {
    "plain": {},
    "reset_before": dict(reset_after=False),
    "layer_norm": dict(layer_norm=True),
    "zoneout_eval": dict(zoneout=0.25),
    "reset_before_zoneout": dict(reset_after=False, zoneout=0.25),
    "bias_single_recurrent": dict(bias_mode="single_recurrent"),
    "bias_single_recurrent_reset_before": dict(bias_mode="single_recurrent", reset_after=False),
    "bias_none": dict(bias_mode="none"),
    "stack_bidirectional": dict(num_layers=2, bidirectional=True, layer_norm=True),
}
RNN_CASES = {
    "plain": {},
    "layer_norm": dict(layer_norm=True),
    "zoneout_eval": dict(zoneout=0.25),
    "stack_bidirectional": dict(num_layers=2, bidirectional=True),
}
CASES = (
    [pytest.param("lstm", o, id=f"lstm-{k}") for k, o in LSTM_CASES.items()]
    + [pytest.param("gru", o, id=f"gru-{k}") for k, o in GRU_CASES.items()]
    + [pytest.param(m, o, id=f"{m}-{k}") for m in ("rnn_tanh", "rnn_relu") for k, o in RNN_CASES.items()]
)


@pytest.mark.parametrize("mode, options", CASES)
def test_matches_reference_fp64(mode, options):
    assert_fused_matches(mode, **options)


@pytest.mark.parametrize("mode, options", CASES)
def test_matches_reference_fp32_with_lengths(mode, options):
    assert_fused_matches(mode, dtype=torch.float32, T=9, B=4, lengths=[9, 3, 1, 6], **options)


TRAINING_CASES = {
    "lstm-zoneout": ("lstm", dict(zoneout=(0.3, 0.2))),
    "lstm-zoneout_h": ("lstm", dict(zoneout=0.3, proj_size=4)),
    "lstm-dropouts": ("lstm", dict(input_dropout=0.2, recurrent_dropout=0.3, dropconnect=0.3)),
    "lstm-all": ("lstm", dict(num_layers=2, bidirectional=True, dropout=0.3, input_dropout=0.2,
                              recurrent_dropout=0.3, dropconnect=0.2, zoneout=(0.2, 0.1), peephole=True,
                              layer_norm=True, proj_size=4)),
    "gru-all": ("gru", dict(num_layers=2, bidirectional=True, dropout=0.2, recurrent_dropout=0.3,
                            zoneout=0.2, layer_norm=True)),
    "gru-reset_before": ("gru", dict(reset_after=False, recurrent_dropout=0.3, dropconnect=0.2, zoneout=0.2)),
    "rnn_tanh-all": ("rnn_tanh", dict(recurrent_dropout=0.3, input_dropout=0.2, zoneout=0.2, layer_norm=True)),
    "rnn_relu-all": ("rnn_relu", dict(recurrent_dropout=0.3, dropconnect=0.2, zoneout=0.2)),
}


@pytest.mark.parametrize("case", list(TRAINING_CASES))
@pytest.mark.parametrize("lengths", [None, [6, 2, 4]], ids=["full", "lengths"])
def test_matches_reference_in_training(case, lengths):
    mode, options = TRAINING_CASES[case]
    assert_fused_matches(mode, training=True, lengths=lengths, **options)


AWKWARD = {
    "T1": dict(T=1),
    "H37": dict(H=37),
    "B1": dict(B=1),
    "long_padding_tail": dict(T=12, B=3, lengths=[12, 2, 1]),
    "one_sequence_length_1": dict(T=5, B=1, lengths=[1]),
    "batch_first": dict(batch_first=True, lengths=[6, 1, 4]),
}


@pytest.mark.parametrize("shape", list(AWKWARD))
@pytest.mark.parametrize("mode, options", [
    pytest.param("lstm", dict(peephole=True, layer_norm=True, proj_size=4, bidirectional=True), id="lstm"),
    pytest.param("gru", dict(bidirectional=True), id="gru"),
    pytest.param("gru", dict(reset_after=False, bidirectional=True), id="gru_reset_before"),
    pytest.param("rnn_tanh", dict(layer_norm=True, bidirectional=True), id="rnn"),
])
def test_awkward_shapes(mode, options, shape):
    assert_fused_matches(mode, **{**options, **AWKWARD[shape]})


BATCH_OF_ONE = [  # float32 B = 1 runs the kernels' own matrix-vector loops instead of BLAS
    pytest.param("lstm", dict(peephole=True, layer_norm=True, proj_size=5, bidirectional=True), id="lstm-proj"),
    pytest.param("lstm", dict(num_layers=2, recurrent_dropout=0.2, zoneout=0.1), id="lstm-stack"),
    pytest.param("gru", dict(bidirectional=True), id="gru"),
    pytest.param("gru", dict(reset_after=False, dropconnect=0.2), id="gru_reset_before"),
    pytest.param("rnn_relu", dict(layer_norm=True), id="rnn"),
]


@pytest.mark.parametrize("H", [37, 200])  # 37: row and column tails; 200: large enough to split across threads
@pytest.mark.parametrize("mode, options", BATCH_OF_ONE)
def test_batch_of_one_fp32(mode, options, H):
    assert_fused_matches(mode, dtype=torch.float32, T=7, B=1, I=11, H=H, training=True, lengths=[5], **options)


@pytest.mark.parametrize("B", [2, 5, 9])  # one step: up to 8 rows, gemv_small_batch (4 + 1 at 5); 9, sgemm on R as it is
@pytest.mark.parametrize("mode, options", BATCH_OF_ONE)
def test_one_step_of_a_batch_fp32(mode, options, B):
    assert_fused_matches(mode, dtype=torch.float32, T=1, B=B, I=11, H=37, training=True, **options)


GRADCHECK = {
    "lstm-peephole_ln_proj": ("lstm", dict(peephole=True, layer_norm=True, proj_size=2, cell_clip=5.0)),
    "lstm-coupled_zoneout": ("lstm", dict(coupled_gates=True, zoneout=(0.3, 0.2))),
    "gru-reset_after": ("gru", dict(layer_norm=True)),
    "gru-reset_before": ("gru", dict(reset_after=False)),
    "rnn_tanh": ("rnn_tanh", {}),
    "rnn_relu": ("rnn_relu", dict(zoneout=0.2)),
}


@pytest.mark.parametrize("case", list(GRADCHECK))
def test_gradcheck_fp64(case):
    mode, options = GRADCHECK[case]
    spec = rnnkit.RNNSpec(mode, 3, 3, bidirectional=True, **options)
    weights = rnnkit.Layout(spec).new_buffer(dtype=torch.float64)
    with torch.no_grad():
        weights.add_(0.1 * torch.randn_like(weights))
    weights.requires_grad_(True)
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 2, spec.output_size(0), dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    lstm = mode == "lstm"

    def run(x, h0, c0, weights):
        y, hy = rnnkit.rnn(spec, weights, x, (h0, c0) if lstm else h0, [4, 2], backend="fused")
        return (y, *hy) if lstm else (y, hy)

    assert torch.autograd.gradcheck(run, (x, h0, c0 if lstm else None, weights), eps=1e-6, atol=1e-7)


def test_inference_keeps_no_graph():
    module = make_module("lstm", 5, 7, torch.float32, peephole=True, backend="fused").eval()
    with torch.no_grad():
        y, (h, c) = module(torch.randn(6, 3, 5))
    assert y.grad_fn is None and h.grad_fn is None and c.grad_fn is None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_repeated_calls_do_not_leak():
    module = make_module("lstm", 32, 64, torch.float32, peephole=True, layer_norm=True, proj_size=32,
                  zoneout=0.1, backend="fused").train()
    x = torch.randn(40, 16, 32, requires_grad=True)

    def call():
        y, (h, c) = module(x)
        (y.sum() + h.sum() + c.sum()).backward()
        with torch.no_grad():
            module.eval()(x)
        module.train()

    for _ in range(10):
        call()
    gc.collect()
    before = _rss_bytes()
    for _ in range(60):  # a leaked call keeps ~1 MB of saved activations: 60 MB over 60 calls
        call()
    gc.collect()
    assert _rss_bytes() - before < 24 * 2**20


def _train_call(module, x):
    y, (h, c) = module(x)
    (y.sum() + h.sum() + c.sum()).backward()
    return y.detach()


def test_freed_buffers_are_reused_then_released():
    from rnnkit import fused
    module = make_module("lstm", 64, 128, torch.float32, layer_norm=True, backend="fused").train()
    x = torch.randn(50, 16, 64, requires_grad=True)  # gates [50, 16, 512]: 1.6 MB buffers, cached
    fused.release_cached_buffers()
    assert fused.cached_buffer_bytes() == 0
    _train_call(module, x), _train_call(module, x)
    kept = fused.cached_buffer_bytes()
    assert kept > 2**20
    for _ in range(3):
        _train_call(module, x)
        assert fused.cached_buffer_bytes() == kept  # each call took its buffers from the cache and gave them back
    y = _train_call(module, x)
    expected = y.clone()
    fused.release_cached_buffers()
    assert fused.cached_buffer_bytes() == 0
    assert torch.equal(y, expected)  # a live output keeps its memory through a release
    y.resize_(2, y.numel())  # and is an ordinary, resizable tensor
    assert torch.equal(y[0], expected.flatten())


def _run_python(code: str, **env) -> str:
    """Run ``code`` in a fresh interpreter (its own buffer cache and RSS); its last stdout line."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1]


def test_buffer_cache_keeps_true_sizes_and_evicts_the_longest_kept():
    code = """
from rnnkit.fused import build
import torch
ext = build.extension()
MB = 2**20
def buffer(n):
    return ext.cached_empty([n], torch.empty(0, dtype=torch.uint8))
a = buffer(int(1.2 * MB)); del a
first = ext.cached_buffer_bytes()  # 1.25 MB: sizes go up to whole 64 KB
assert first == 20 * 2**16, first
b = buffer(1 * MB)  # reuses that block (within 1.25x) ...
assert ext.cached_buffer_bytes() == 0
del b                               # ... and returns it at its true size
assert ext.cached_buffer_bytes() == first, (ext.cached_buffer_bytes(), first)
big, small = buffer(int(1.5 * MB)), buffer(MB)
ext.release_cached_buffers()
del big  # limit 2 MB: 1.5 MB kept
assert ext.cached_buffer_bytes() == int(1.5 * MB), ext.cached_buffer_bytes()
del small  # small holds the reused 1.25 MB block: 2.75 MB would not fit, so the longest-kept block goes
assert ext.cached_buffer_bytes() == first, ext.cached_buffer_bytes()
print("ok")
"""
    assert _run_python(code, RNNKIT_CPU_CACHE_MB="2") == "ok"


@pytest.mark.skipif(not hasattr(os, "sysconf") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 4 << 30,
                    reason="the default cap is an eighth of the machine's memory: 512 MB from 4 GB")
def test_buffer_cache_default_cap_keeps_a_working_set_above_256_mb():
    """By default the cache may keep an eighth of the machine's memory (at least 256 MB): a 320 MB
    working set (a layer-norm LSTM's training at T 100, B 64, H 512) is kept whole, so a second
    call maps nothing new. With the former fixed 256 MB the last blocks were unmapped and mapped
    again at every call (15,296 page faults a call, 8% of that call's time)."""
    code = """
import resource
from rnnkit.fused import build
import torch
ext = build.extension()
MB = 2**20
def buffers():
    held = [ext.cached_empty([32 * MB], torch.empty(0, dtype=torch.uint8)) for _ in range(10)]
    for b in held:
        b.fill_(1)  # every page touched, as a pass writes its buffers
    return held
held = buffers(); del held
assert ext.cached_buffer_bytes() == 320 * MB, ext.cached_buffer_bytes()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
held = buffers()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
assert faults < 1000, faults  # 64 MB mapped again would be ~16,000
del held
ext.release_cached_buffers()
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "RNNKIT_CPU_CACHE_MB"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "ok"


def test_buffer_cache_keeps_no_more_than_recent_calls_use():
    """The cache holds at most what was in use at once lately: blocks a past burst left behind go
    back to the system (RSS drops) within two windows of 256 requests once nothing uses them."""
    code = """
from rnnkit.fused import build
import torch
ext = build.extension()
MB = 2**20
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
def buffer(n):
    return ext.cached_empty([n], torch.empty(0, dtype=torch.uint8)).fill_(1)  # touched: resident
burst = [buffer(8 * MB) for _ in range(4)]
del burst
assert ext.cached_buffer_bytes() == 32 * MB, ext.cached_buffer_bytes()  # 32 MB were in use at once
before = rss()
for _ in range(600):  # then one 3 MB buffer at a time
    b = buffer(3 * MB)
    del b
assert ext.cached_buffer_bytes() == 3 * MB, ext.cached_buffer_bytes()
assert before - rss() >= 24 * MB, (before - rss()) / MB  # the 8 MB blocks were unmapped
ext.release_cached_buffers()
assert ext.cached_buffer_bytes() == 0
print("ok")
"""
    assert _run_python(code) == "ok"


def test_buffer_cache_gives_back_a_burst_when_only_small_requests_follow():
    """Small requests (malloc's) count toward the window too: a training call's blocks, followed by
    calls that ask for small buffers only (a generation loop of cells), went back to the system only
    when a large request came, or never (238 MB kept over 2,000 cell steps in the report)."""
    code = """
from rnnkit.fused import build
import torch
ext = build.extension()
MB = 2**20
burst = [ext.cached_empty([8 * MB], torch.empty(0, dtype=torch.uint8)).fill_(1) for _ in range(4)]
del burst
assert ext.cached_buffer_bytes() == 32 * MB, ext.cached_buffer_bytes()
for _ in range(600):  # two windows of 256 requests, every one small
    small = ext.cached_empty([1024], torch.empty(0))
    del small
assert ext.cached_buffer_bytes() == 0, ext.cached_buffer_bytes()
print("ok")
"""
    assert _run_python(code) == "ok"


def test_buffer_cache_footprint_with_varied_shapes():
    """A new random shape on every training call: the cache stays within about one call's working
    set (the old fixed 512 MB limit kept every new size: 146 MB after 150 calls here, 564 MB in the
    issue's run), the process does not grow with the calls, and releasing the cache brings its
    resident size back to where it started."""
    code = """
import gc, random, torch, rnnkit
from rnnkit import fused
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
torch.manual_seed(0)
module = rnnkit.LSTM(32, 64, 2, layer_norm=True, backend="fused").train()
def call(T, B):
    y, (h, c) = module(torch.randn(T, B, 32, requires_grad=True))
    (y.sum() + h.sum() + c.sum()).backward()
call(100, 32)  # the largest shape: its working set is the most the cache may keep
fused.release_cached_buffers()
gc.collect()
start, most = rss(), 0
rng = random.Random(0)
for _ in range(300):
    call(rng.randint(10, 100), rng.randint(2, 32))
    most = max(most, fused.cached_buffer_bytes() / 2**20)
grown = rss() - start
fused.release_cached_buffers()
gc.collect()
print(f"{most:.1f},{grown:.1f},{rss() - start:.1f}")
"""
    most, grown, after_release = map(float, _run_python(code).split(","))
    assert most <= 48, f"the cache kept up to {most:.0f} MB"
    assert grown <= 96, f"RSS grew by {grown:.0f} MB over 300 calls"
    assert after_release <= 24, f"RSS after release_cached_buffers(): {after_release:.0f} MB above the start"


def test_a_loop_over_one_shape_maps_no_new_buffers():
    """A 2-layer LSTM's training call keeps three [T, B, 4H] blocks in use at once, and blocks of
    other sizes come and go around them: their sum is more than the peak in use. The cache keeps a
    quarter more than that peak, so every call after the first finds its blocks (it used to unmap
    one 3.2 MB block a call and map it again in the next: ~800 page faults a call here)."""
    code = """
import resource, torch, rnnkit
torch.set_num_threads(1)
module = rnnkit.LSTM(128, 128, 2, backend="fused").train()
x = torch.randn(100, 16, 128, requires_grad=True)
upstream = [torch.randn(100, 16, 128), torch.randn(2, 16, 128), torch.randn(2, 16, 128)]
def call():  # as rnnkit bench times a training call
    y, (h, c) = module(x)
    return torch.autograd.grad([y, h, c], [x, *module.parameters()], upstream)
for _ in range(3):
    call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    call()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""
    faults = float(_run_python(code))
    assert faults < 200, f"{faults:.0f} page faults a call (a 3.2 MB block is 800)"


def test_buffer_cache_setting_must_be_a_number():
    code = ("import torch; from rnnkit.fused import build;"
            "build.extension().cached_empty([2**20], torch.empty(0)); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RNNKIT_CPU_CACHE_MB": "lots"})
    assert out.returncode == 0 and out.stdout.split()[-1] == "ok", out.stderr
    assert "RNNKIT_CPU_CACHE_MB must be a whole number of MB" in out.stderr and "'lots'" in out.stderr
    memory_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 8 / 2**20
    assert f"using the default, {max(256, int(memory_mb))} MB (an eighth of this machine's memory" in out.stderr


def test_buffer_cache_can_be_turned_off():
    code = ("import torch, rnnkit; from rnnkit import fused; m = rnnkit.LSTM(64, 128, backend='fused');"
            "y, _ = m(torch.randn(50, 16, 64)); y.sum().backward(); print(fused.cached_buffer_bytes())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RNNKIT_CPU_CACHE_MB": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0"


@pytest.mark.parametrize("where, expect", [
    (dict(device="meta"), "CPU"),
    (dict(dtype=torch.float8_e4m3fn), "float32, float64, bfloat16 and float16"),
])
def test_named_backend_raises_with_reason(where, expect):
    spec = rnnkit.RNNSpec("lstm", 3, 4, peephole=True)
    weights = torch.zeros(rnnkit.Layout(spec).numel, **where)
    x = torch.zeros(2, 1, 3, **where)
    with pytest.raises(rnnkit.BackendUnavailableError, match=expect):
        rnnkit.rnn(spec, weights, x, backend="fused")


def test_build_failure_is_reported_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(build, "_extension", None)
    monkeypatch.setattr(build, "_failure", "the C++ build failed (no compiler)")
    failed = "the C++ build failed (no compiler)"
    assert rnnkit.backends()["fused"] == {"available": False, "reason": failed, "status": failed}
    spec = rnnkit.RNNSpec("gru", 3, 4, layer_norm=True)
    assert backends.select("auto", spec, torch.device("cpu"), torch.float32).name == "reference"
    with pytest.raises(rnnkit.BackendUnavailableError, match="no compiler"):
        backends.select("fused", spec, torch.device("cpu"), torch.float32)


def test_auto_prefers_fused_for_variants():
    spec = rnnkit.RNNSpec("lstm", 3, 4, layer_norm=True)
    assert backends.select("auto", spec, torch.device("cpu"), torch.float32).name == "fused"


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got − exact| in units of the float32 spacing at exact (exact in float64)."""
    at = exact.float().abs()
    return (got.double() - exact).abs() / (torch.nextafter(at, torch.tensor(float("inf"))) - at).double()


@pytest.mark.parametrize("quick", [False, True], ids=["exact", "quick"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vectorized_activations_are_accurate(dtype, quick):
    """The passes' σ and tanh against float64 over the whole range, lengths off the vector width.
    float32 (simd.h's own forms): at most 1.5 ulp (σ) and 1 ulp (tanh), 0.35 on average (torch's:
    2.5 and 0.5 at most; the earlier fast forms were 3.9 and 5.2 ulp off at most, 0.6 and 0.8 on
    average); int8 inference's quick forms at most 2.5 ulp, 0.35 on average. float64 (Sleef, quick
    or not): within 1e-14."""
    ext = build.extension()
    v = torch.cat([torch.linspace(-30, 30, 200001), torch.logspace(-9, 1.3, 30001), -torch.logspace(-9, 1.3, 30001)])
    v = torch.cat([v, torch.tensor([0.0, 4e-4, -4e-4, 7.9, -7.9, 8.0, 1e4, -1e4])])[:-3]  # odd length
    s, t = ext.activations(v.to(dtype).contiguous(), quick)
    exact = v.double()
    for name, got, want in (("σ", s, torch.sigmoid(exact)), ("tanh", t, torch.tanh(exact))):
        assert torch.isfinite(got).all(), name
        if dtype == torch.float64:
            err = (got - want).abs() / want.abs().clamp_min(1e-30)
            assert err[want.abs() > 1e-30].max().item() < 1e-14, name
            continue
        ulps = _ulps(got, want)
        worst, mean = ulps.max().item(), ulps.mean().item()
        bound = 2.5 if quick else (1.5 if name == "σ" else 1.0)
        assert worst <= bound and mean <= 0.35, f"{name}: {worst:.2f} ulp at most, {mean:.2f} on average"
    # NaN stays NaN (a poisoned buffer must not come out finite); ±inf saturate exactly; ±0 keep their sign.
    s, t = ext.activations(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0] * 7, dtype=dtype), quick)
    assert s[0::5].isnan().all() and t[0::5].isnan().all()
    assert (s[1::5] == 1).all() and (s[2::5] == 0).all() and (s[3::5] == 0.5).all() and (s[4::5] == 0.5).all()
    assert (t[1::5] == 1).all() and (t[2::5] == -1).all()
    assert (t[3::5] == 0).all() and not t[3::5].signbit().any() and t[4::5].signbit().all()


SAVED_BUDGET = {
    "lstm": ("lstm", {}), "lstm-peephole": ("lstm", dict(peephole=True)),
    "lstm-coupled_peephole": ("lstm", dict(coupled_gates=True, peephole=True)),
    "lstm-cell_clip": ("lstm", dict(cell_clip=0.5)), "lstm-proj_clip": ("lstm", dict(proj_size=4, proj_clip=0.5)),
    "lstm-zoneout": ("lstm", dict(zoneout=(0.2, 0.1))), "lstm-lengths": ("lstm", dict(lengths=True)),
    "gru": ("gru", {}), "gru-reset_before": ("gru", dict(reset_after=False)), "rnn_tanh": ("rnn_tanh", {}),
}


@pytest.mark.parametrize("case", list(SAVED_BUDGET))
def test_training_saves_at_most_g_plus_1_values_per_step(case):
    """What a training forward keeps for the backward, beyond its inputs, weights and output y:
    at most (G + 1)·T·B·H values (G gates; LSTM: c entering each step; GRU/RNN: h entering)."""
    mode, options = SAVED_BUDGET[case]
    options = dict(options)
    lengths = [6, 2, 4] if options.pop("lengths", False) else None
    T, B, I, H = 6, 3, 5, 7
    # eval(): zoneout as its expectation, so no mask tensors (masks are allowed on top)
    module = make_module(mode, I, H, torch.float32, backend="fused", **options).eval()
    x = torch.randn(T, B, I, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = module(x, lengths=lengths)[0] if lengths else module(x)[0]
    known = {t.untyped_storage().data_ptr() for t in (x, y, module.flat_weights)}
    # the pass's input (with lengths, x with its padding zeroed) is an input, not an activation
    per_step = [t for t in saved if t.untyped_storage().data_ptr() not in known and t.is_floating_point()
                and t.dim() > 0 and t.shape[0] in (T, T * B) and t.shape != x.shape]
    G = {"lstm": 3 if options.get("coupled_gates") else 4, "gru": 3, "rnn_tanh": 1}[mode]
    kept = sum(t.numel() for t in per_step)
    assert G * T * B * H <= kept <= (G + 1) * T * B * H, [tuple(t.shape) for t in per_step]


@pytest.mark.parametrize("mode, options", [
    pytest.param("lstm", dict(peephole=True, layer_norm=True, proj_size=4, zoneout=0.2), id="lstm"),
    pytest.param("gru", dict(layer_norm=True), id="gru"),
    pytest.param("gru", dict(reset_after=False), id="gru_reset_before"),
    pytest.param("rnn_tanh", dict(layer_norm=True), id="rnn"),
])
def test_inference_in_chunks_matches_reference(mode, options):
    """Inference projects the input in chunks as the loop reaches them (memory flat in T):
    chunks of ~256 KB of gates make 18-step chunks here (B=64, G·H=28, float64), so T=70 spans
    four, the last partial, in both directions and with lengths (one of them the full 70)."""
    module = make_module(mode, 5, 7, torch.float64, bidirectional=True, **options).eval()
    x = torch.randn(70, 64, 5, dtype=torch.float64)
    lengths = torch.randint(1, 71, (64,)).tolist()
    lengths[0] = 70
    outputs = {}
    with torch.no_grad():
        for backend in ("reference", "fused"):
            module.backend = backend
            y, hy = module(x, lengths=lengths)
            outputs[backend] = [y] + flatten(hy)
    for k, (got, want) in enumerate(zip(outputs["fused"], outputs["reference"])):
        assert_close(got, want, f"output {k}")


@pytest.mark.parametrize("mode, B, options", [
    pytest.param("lstm", 64, dict(peephole=True, layer_norm=True, zoneout=0.2), id="lstm"),  # 18-step chunks
    pytest.param("gru", 64, dict(layer_norm=True), id="gru"),  # 24-step chunks
    pytest.param("rnn_tanh", 160, dict(layer_norm=True), id="rnn"),  # 29-step chunks
])
def test_training_projects_in_chunks(mode, B, options):
    """Training also projects the input a chunk at a time (~256 KB of gates, into the buffer the
    backward reads, with layer norm's raw sums and statistics sliced the same way): T=41 spans
    two or three chunks in both directions; outputs and every gradient match the reference."""
    lengths = torch.randint(1, 42, (B,)).tolist()
    lengths[0] = 41
    assert_fused_matches(mode, T=41, B=B, lengths=lengths, training=True, bidirectional=True, **options)


def _binding_names(function) -> tuple:
    """The argument names of a pybind11 function, from its signature line."""
    signature = function.__doc__.splitlines()[0]
    inside = signature[signature.index("(") + 1 : signature.rindex(") ->")]
    return tuple(part.split(":")[0].strip() for part in inside.split(", ") if ":" in part)


def test_the_bindings_take_the_op_schema_names_in_order():
    """csrc/ops.cpp lists the pass's arguments by name once more (pybind11's py::arg): they must be
    the schema's (rnnkit/passes.py), in its order, or a call would pass a value to the wrong one."""
    from rnnkit.passes import BACKWARD_NAMES, FORWARD_NAMES

    ext = build.extension()
    assert _binding_names(ext.pass_forward) == FORWARD_NAMES
    assert _binding_names(ext.pass_backward) == BACKWARD_NAMES
    from rnnkit.quantized import INT8_ARGUMENTS

    int8 = tuple(name for name, _ in INT8_ARGUMENTS)  # the pass's, then W_scale, R_scale, W_hr_scale
    assert _binding_names(ext.pass_forward_int8) == int8
    assert _binding_names(ext.step_plan) == int8  # the scales optional: int8 cells


# ---- variable lengths: the batch shrinks as sequences end -----------------------------------

SEGMENT_CASES = [
    ("lstm", dict(bidirectional=True, proj_size=4, peephole=True)),
    ("lstm", dict(layer_norm=True, zoneout=0.2)),
    ("lstm", dict(hidden_size=[9, 6], num_layers=2)),
    ("gru", dict(bidirectional=True, layer_norm=True)),
    ("gru", dict(reset_after=False, batch_first=True)),
    ("rnn_relu", dict(bidirectional=True)),
]
SEGMENT_LENGTHS = {"13-distinct": [5, 23, 1, 17, 23, 9, 2, 11, 23, 6, 14, 3, 20], "one-short": [23, 23, 4, 23],
                   "none-full": [3, 19, 7, 12]}


@pytest.mark.parametrize("mode,options", SEGMENT_CASES, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
@pytest.mark.parametrize("lengths", list(SEGMENT_LENGTHS.values()), ids=list(SEGMENT_LENGTHS))
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_lengths_run_the_rows_still_going(mode, options, lengths, training, monkeypatch):
    """With lengths, fused sorts the batch and runs at most SEGMENTS spans of time on the rows
    still going (rows ending inside a span take their length relative to it; steps no sequence
    reaches are zeros). Outputs, final states and, in training, every gradient (random upstream
    gradients) equal the reference's, in the caller's row order, with given initial states and
    NaN in the padding (which the spans' gathers leave out, or zero inside a span).
    Zoneout is sampled only in eval here: training with random masks runs one pass."""
    from rnnkit import functional

    options = dict(options)
    if training:
        options.pop("zoneout", None)
    batch_first = options.pop("batch_first", False)
    hidden = options.pop("hidden_size", 9)
    layers = options.pop("num_layers", 2)
    cls = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU, "rnn_relu": rnnkit.RNN}[mode]
    if mode == "rnn_relu":
        options["nonlinearity"] = "relu"
    kwargs = dict(num_layers=layers, batch_first=batch_first, dtype=torch.float64, **options)
    fused = cls(7, hidden, backend="fused", **kwargs).train(training)
    reference = cls(7, hidden, backend="reference", **kwargs).train(training)
    reference.load_state_dict(fused.state_dict())
    T, B = 23, len(lengths)
    x = torch.randn(B, T, 7, dtype=torch.float64) if batch_first else torch.randn(T, B, 7, dtype=torch.float64)
    with torch.no_grad():
        _, hx = reference(x, lengths=torch.tensor(lengths))  # some initial states in the module's format
    for b, length in enumerate(lengths):  # NaN in the padding: no output or gradient may read it
        (x[b, length:] if batch_first else x[length:, b]).fill_(float("nan"))
    monkeypatch.setattr(functional, "SEGMENT_MIN_HIDDEN", 1)  # small cells here, to keep the test fast
    spans = []
    real = functional.Segments.run_pass
    monkeypatch.setattr(functional.Segments, "run_pass", lambda self, *a, **k: spans.append(len(self.spans)) or real(self, *a, **k))

    def run(module):
        x_ = x.clone().requires_grad_(training)
        hx_ = map_tree(hx, lambda t: t.clone().requires_grad_(training))
        with torch.set_grad_enabled(training):
            out = module(x_, hx_, lengths=torch.tensor(lengths))
        results = flatten(out)
        if not training:
            return results
        torch.manual_seed(1)
        upstream = [torch.randn_like(r) for r in results]
        grads = torch.autograd.grad(results, [x_, *flatten(hx_), *module.parameters()], upstream)
        return [r.detach() for r in results] + list(grads)

    got, want = run(fused), run(reference)
    assert spans and max(spans) <= functional.SEGMENTS
    assert fused.last_backend == "fused"
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_close(a, b)


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
def test_a_packed_sequence_runs_in_its_packed_order_with_the_states_permuted(per_layer):
    """A PackedSequence (enforce_sorted=False) with initial states runs padded in its packed order,
    the states permuted into it and back as torch.nn's are: the same as the padded batch with its
    lengths in the caller's order, through the spans (H 256), the reference backend and torch.nn."""
    torch.manual_seed(0)
    hidden = [256, 256] if per_layer else 256
    fused = rnnkit.LSTM(5, hidden, num_layers=2, bidirectional=True, backend="fused", dtype=torch.float64)
    reference = rnnkit.LSTM(5, hidden, num_layers=2, bidirectional=True, backend="reference", dtype=torch.float64)
    reference.load_state_dict(fused.state_dict())
    lengths = torch.tensor([3, 30, 1, 9, 30, 2])
    x = torch.randn(30, 6, 5, dtype=torch.float64)
    _, hx = reference(x, lengths=lengths)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    want_y, want_hy = reference(x, hx, lengths=lengths)
    for module in (fused, reference):
        y, hy = module(packed, hx)
        assert torch.equal(y.sorted_indices, packed.sorted_indices) and torch.equal(y.batch_sizes, packed.batch_sizes)
        assert_close(pad_packed_sequence(y, total_length=30)[0], want_y, module.backend)
        assert_close(flatten(hy), flatten(want_hy), module.backend)
    if not per_layer:
        twin = torch.nn.LSTM(5, 256, num_layers=2, bidirectional=True, dtype=torch.float64)
        twin.load_state_dict(fused.state_dict())
        y, hy = twin(packed, hx)
        assert_close(pad_packed_sequence(y, total_length=30)[0], want_y, "torch.nn")
        assert_close(flatten(hy), flatten(want_hy), "torch.nn")


def test_a_packed_call_leaves_other_calls_padding_zero(monkeypatch):
    """A PackedSequence's padded output is not filled (only the steps that ran are read back), and
    only that call's: a padded call with lengths= made while it runs (from a hook, a mode, a
    backend of one's own) still gets zeros past each length."""
    from rnnkit import functional

    monkeypatch.setattr(functional, "SEGMENT_MIN_HIDDEN", 1)
    torch.manual_seed(0)
    outer, inner = rnnkit.LSTM(3, 5, backend="fused"), rnnkit.GRU(3, 5, backend="fused")
    lengths = torch.tensor([6, 1, 2, 1])
    x = torch.randn(6, 4, 3)
    seen, real = [], functional.Segments.run_pass

    def run_pass(self, *args, **kwargs):
        if not seen:  # once, in the outer call
            seen.append(None)
            seen[0] = inner(x, lengths=lengths)[0]
        return real(self, *args, **kwargs)

    monkeypatch.setattr(functional.Segments, "run_pass", run_pass)
    y, _ = outer(pack_padded_sequence(x, lengths, enforce_sorted=False))
    want = rnnkit.LSTM(3, 5, backend="reference")
    want.load_state_dict(outer.state_dict())
    assert_close(pad_packed_sequence(y, total_length=6)[0], want(x, lengths=lengths)[0])
    assert seen and all(bool((seen[0][int(n):, b] == 0).all()) for b, n in enumerate(lengths))


def test_vmapped_lengths_run_without_spans():
    """Per-sample lengths under torch.func.vmap (README) with cells wide enough to segment: the spans
    need the lengths' values, which vmap has not, so the batch runs in one pass (it failed on
    .item())."""
    torch.manual_seed(0)
    module = rnnkit.LSTM(8, 256, backend="fused")
    x = torch.randn(3, 10, 4, 8)
    lengths = torch.tensor([[10, 2, 3, 1], [4, 10, 1, 1], [10, 10, 10, 1]])
    got = torch.func.vmap(lambda x, n: module(x, lengths=n)[0])(x, lengths)
    want = torch.stack([module(x[k], lengths=lengths[k])[0] for k in range(3)])
    assert_close(got, want)


def test_span_ends_leave_the_fewest_padded_row_steps():
    """The spans' ends (at most SEGMENTS, among the distinct lengths, the longest last) minimize the
    row-steps the spans run, as a search over every choice finds; a long tail's last span no longer
    carries the rows that end early in it (evenly spaced ends ran 3x the row-steps here)."""
    import itertools
    import random

    from rnnkit.functional import span_ends

    def work(lengths, ends):
        start, total = 0, 0
        for end in ends:
            total, start = total + (end - start) * sum(1 for n in lengths if n > start), end
        return total

    generator = random.Random(0)
    for _ in range(200):
        T = generator.randint(1, 40)
        lengths = [generator.randint(1, T) for _ in range(generator.randint(1, 12))]
        distinct, count = sorted(set(lengths)), generator.randint(1, 5)
        ends = span_ends(lengths, count)
        assert ends == sorted(set(ends)) and set(ends) <= set(distinct) and ends[-1] == distinct[-1], (lengths, ends)
        assert len(ends) == min(count, len(distinct))
        best = min(work(lengths, [*cut, distinct[-1]]) for cut in itertools.combinations(distinct[:-1], len(ends) - 1))
        assert work(lengths, ends) == best, (lengths, count, ends)
    tail = [1000] + [1 + (7 * k * k) % 120 for k in range(63)]  # most short, one long
    distinct = sorted(set(tail))
    evenly = [distinct[round((k + 1) * len(distinct) / 4) - 1] for k in range(4)]
    assert 3 * work(tail, span_ends(tail, 4)) < work(tail, evenly)
    assert span_ends(list(torch.tensor([5, 5, 3, 1]).unbind()), 4) == [1, 3, 5]  # by value, not identity
    many = [1 + (k * 7919) % 20000 for k in range(8192)]  # ~8,000 distinct: chosen among SPAN_CANDIDATES of them
    ends = span_ends(many, 4)
    assert len(ends) == 4 and ends == sorted(set(ends)) and set(ends) <= set(many) and ends[-1] == max(many)


def test_lengths_segment_only_where_it_saves_work():
    """Little padding, one row, small cells, training with random masks, another backend: one
    pass over all rows."""
    from rnnkit import functional

    spec = rnnkit.LSTM(4, 256).spec
    backend = backends.select("fused", spec, torch.device("cpu"), torch.float32)
    spread = torch.tensor([10, 2, 7, 5])
    assert functional.Segments.worth_it(backend, spec, spread, 10, False)
    assert functional.Segments.worth_it(backend, spec, spread, 10, True)  # training without masks
    assert not functional.Segments.worth_it(backend, rnnkit.LSTM(4, 256, zoneout=0.1).spec, spread, 10, True)
    assert not functional.Segments.worth_it(backend, rnnkit.LSTM(4, 256, 2, dropout=0.2).spec, spread, 10, True)
    assert functional.Segments.worth_it(backend, rnnkit.LSTM(4, 256, zoneout=0.1).spec, spread, 10, False)  # eval: no masks
    assert not functional.Segments.worth_it(backend, spec, torch.tensor([10, 10, 10, 9]), 10, False)  # 2.5% padding
    assert not functional.Segments.worth_it(backend, spec, torch.tensor([3]), 10, False)  # one row
    assert not functional.Segments.worth_it(backend, rnnkit.LSTM(4, [256, 128], 2).spec, spread, 10, False)
    reference = backends.select("reference", spec, torch.device("cpu"), torch.float32)
    assert not functional.Segments.worth_it(reference, spec, spread, 10, False)


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
@pytest.mark.parametrize("cell", [False, True], ids=["layer", "cell"])
def test_rnn_without_zoneout_takes_an_infinite_state_as_the_reference(nonlinearity, cell):
    """An RNN's h without zoneout is act(·) itself: the fused pass blended 0 · h_prev + 1 · act, NaN
    where h_prev was ±inf (an h_0 of -inf, or a relu state that overflowed), where the reference,
    native and torch.nn give tanh's -1 or inf. Outputs and gradients against the reference."""
    torch.manual_seed(0)
    make = (lambda b: rnnkit.RNNCell(3, 4, nonlinearity=nonlinearity, backend=b)) if cell else \
        (lambda b: rnnkit.RNN(3, 4, nonlinearity=nonlinearity, backend=b))
    fused, reference = make("fused").double(), make("reference").double()
    reference.load_state_dict(fused.state_dict())
    with torch.no_grad():
        for m in (fused, reference):
            m.weight_hh_l0.mul_(1e300) if not cell and nonlinearity == "relu" else None
    x = torch.randn(1 if cell else 5, 2, 3, dtype=torch.float64)
    h0 = torch.randn(2, 4, dtype=torch.float64) if cell else torch.randn(1, 2, 4, dtype=torch.float64)
    h0.view(-1)[1] = -float("inf")
    results = []
    for m in (fused, reference):
        xs, hs = x.clone().requires_grad_(True), h0.clone().requires_grad_(True)
        out = m(xs[0], hs) if cell else m(xs, hs)[0]
        finite = torch.where(torch.isfinite(out), out, torch.zeros_like(out))
        grads = torch.autograd.grad(finite.sum(), [xs, hs] + list(m.parameters()), allow_unused=True)
        results.append((out.detach(), [g for g in grads if g is not None]))
    (out, grads), (want, want_grads) = results
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and not torch.isnan(want).all()
    assert_close(torch.nan_to_num(out), torch.nan_to_num(want), "output")
    for g, w in zip(grads, want_grads):
        assert torch.equal(torch.isnan(g), torch.isnan(w))
        assert_close(torch.nan_to_num(g), torch.nan_to_num(w), "gradient")
