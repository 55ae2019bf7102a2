"""Reliability (issue 18): what a caller leaves in the padding never reaches a result, empty
batches return empty results, bad `lengths` are named, and the compiled kernels' build cache is
keyed by everything that changes the build."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import rnnkit
from helpers import MODULES, flatten, make_module, require_fused_kernels

T, B, I, H = 5, 3, 4, 6
LENGTHS = [5, 2, 3]
BACKENDS = ["reference", "fused", "native"]


def _grads(module, x, lengths, packed: bool):
    """Outputs and the gradients of every weight and of x, with random upstream gradients."""
    x = x.detach().requires_grad_(True)
    if packed:
        y, hy = module(pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False))
        y = y.data
    else:
        y, hy = module(x, lengths=lengths)
    outputs = [y] + flatten(hy)
    generator = torch.Generator().manual_seed(3)
    upstream = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in outputs]
    weights = list(module.named_weights().values())
    grads = torch.autograd.grad(outputs, [x] + weights, upstream)
    return [o.detach() for o in outputs], list(grads)


@pytest.mark.parametrize("packed", [False, True], ids=["lengths", "packed"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("mode", list(MODULES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_never_reaches_a_result(backend, mode, bidirectional, packed):
    """Whatever the padding holds, outputs and every gradient are those of zero padding: finite,
    and the padded steps' input gradient is exactly 0 (the spec: a batch with lengths equals each
    sequence run alone)."""
    module = make_module(mode, I, H, torch.float32, backend=backend, bidirectional=bidirectional, num_layers=2)
    x = torch.randn(T, B, I)
    clean = x.clone()
    for b, (n, poison) in enumerate(zip(LENGTHS, [0.0, float("nan"), float("inf")])):
        x[n:, b] = poison  # sequence 0 has no padding; 1 has NaN, 2 inf
        clean[n:, b] = 0
    out, grads = _grads(module, x, LENGTHS, packed)
    out_clean, grads_clean = _grads(module, clean, LENGTHS, packed)
    for name, a, e in zip(["y", "final states"] + ["dx"] + list(module.named_weights()), out + grads,
                          out_clean + grads_clean):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, e), name
    dx = grads[0]
    for b, n in enumerate(LENGTHS):
        assert torch.equal(dx[n:, b], torch.zeros_like(dx[n:, b]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODULES))
def test_an_empty_batch_returns_empty_results(backend, mode):
    """B = 0, as torch.nn: empty outputs and states of the right shapes, and a backward that runs."""
    module = make_module(mode, I, H, torch.float32, backend=backend, num_layers=2, bidirectional=True)
    x = torch.randn(T, 0, I, requires_grad=True)
    for lengths in (None, torch.zeros(0, dtype=torch.int64)):
        y, hy = module(x, lengths=lengths)
        assert y.shape == (T, 0, 2 * H)
        for state in flatten(hy):
            assert state.shape == (4, 0, H)
        (y.sum() + sum(s.sum() for s in flatten(hy))).backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("cls", [rnnkit.LSTMCell, rnnkit.GRUCell, rnnkit.RNNCell])
def test_a_cell_on_an_empty_batch(cls):
    reference = {rnnkit.LSTMCell: torch.nn.LSTMCell, rnnkit.GRUCell: torch.nn.GRUCell,
                 rnnkit.RNNCell: torch.nn.RNNCell}[cls](I, H)
    cell = cls(I, H)
    x = torch.randn(0, I, requires_grad=True)
    out, expected = cell(x), reference(x)
    for a, e in zip(flatten(out), flatten(expected)):
        assert a.shape == e.shape == (0, H)
    sum(o.sum() for o in flatten(out)).backward()
    with torch.no_grad():  # the inference path too
        assert [o.shape for o in flatten(cell(torch.randn(0, I)))] == [e.shape for e in flatten(expected)]


def test_lengths_on_the_meta_device_are_named():
    with pytest.raises(ValueError, match="lengths: .*meta device"):
        rnnkit.LSTM(I, H)(torch.randn(T, 2, I), lengths=torch.tensor([5, 3], device="meta"))


def test_the_build_cache_is_keyed_by_what_changes_the_build(monkeypatch):
    """Two environments with the same torch version (other install paths, other Python ABI, other
    compiler) never share a build folder; the same environment always finds its own."""
    from rnnkit.fused import build

    first = build.cache_dir()
    assert build.cache_dir() == first
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    moved = build.cache_dir()
    assert moved != first and moved.parent == first.parent
    monkeypatch.undo()
    monkeypatch.setattr(build.sys.implementation, "cache_tag", "cpython-312")
    assert build.cache_dir() != first
    monkeypatch.undo()
    monkeypatch.setattr(build, "_flags", lambda: ["-O2"])
    assert build.cache_dir() != first


LOAD = "from rnnkit.fused import build; build.extension(); print('loaded')"


def test_a_build_killed_midway_does_not_hang_the_next_process():
    """torch's cpp_extension waits on its `lock` file for as long as the file exists, and a build
    killed midway leaves it behind: the next process removes it (it holds build.flock, which the
    OS released when the killed process died) and loads."""
    from rnnkit.fused import build

    require_fused_kernels()
    stale = build.cache_dir() / "lock"
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_a_process_waits_for_another_ones_build_and_says_so(tmp_path):
    """While another process builds (holds build.flock), a second one says it waits, once, and
    loads when the first is done."""
    fcntl = pytest.importorskip("fcntl")
    from rnnkit.fused import build

    require_fused_kernels()
    log = tmp_path / "stderr.txt"
    with open(build.cache_dir() / "build.flock", "a+") as handle, open(log, "w") as err:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            child = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=err, text=True)
            deadline = time.monotonic() + 120
            while "waiting for another process's build" not in log.read_text() and time.monotonic() < deadline:
                assert child.poll() is None, log.read_text()  # it must not load while the lock is held
                time.sleep(0.2)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    out, _ = child.communicate(timeout=240)
    assert child.returncode == 0 and out.strip() == "loaded", log.read_text()
    assert log.read_text().count("waiting for another process's build") == 1


def test_a_build_killed_midway_is_started_again_from_the_sources(tmp_path, monkeypatch):
    """A folder without build.done holds a build that never finished: its objects, library and
    ninja logs (a truncated .ninja_deps made ninja recompile on every load) are removed before the
    build runs; once it has loaded, build.done keeps later loads from touching anything. A
    failed build writes no build.done."""
    from torch.utils import cpp_extension

    from rnnkit.fused import build

    folder = tmp_path / "key"
    (folder / "csrc").mkdir(parents=True)
    leftovers = [".ninja_deps", ".ninja_log", "ops.o", "lock", "rnnkit_fused_cpu.so"]
    for name in leftovers:
        (folder / name).write_text("partial")
    seen = []

    def load(**kwargs):
        seen.append(sorted(p.name for p in folder.iterdir()))
        (folder / "rnnkit_fused_cpu.so").write_text("built")
        return "module"

    monkeypatch.setattr(build, "cache_dir", lambda: folder)
    monkeypatch.setattr(cpp_extension, "load", load)
    assert build._compile() == "module"
    assert seen == [["build.flock", "csrc"]]  # the sources (copied in by then) and the lock alone
    assert (folder / "build.done").exists() and (folder / "csrc" / "ops.cpp").exists()
    (folder / "ops.o").write_text("finished")
    assert build._compile() == "module"
    assert (folder / "ops.o").read_text() == "finished"  # a finished build is left as it is

    (folder / "build.done").unlink()

    def fail(**kwargs):
        raise RuntimeError("error: the compiler failed")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.raises(RuntimeError, match="compiler failed"):
        build._compile()
    assert not (folder / "build.done").exists()
