"""The benchmark harness (rnnkit.app.bench): it writes its reports, refuses to time a wrong runner,
warns when its numbers are noisy, and plots only what ran.

No timing assertions here (BENCH.md); these are smoke tests of the harness on a tiny shape.
"""
import importlib.util
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rnnkit
from rnnkit.app import bench
from rnnkit.app import machine
from rnnkit.app.bench import report
from rnnkit.app.bench.measure import Case, flops
from rnnkit.app.bench.registry import SHAPES, VARIANTS
from rnnkit.app.bench.runners import INT8_TOLERANCE, Model, RnnkitBf16, RnnkitInt8, Runner, rnnkit_module
from rnnkit.testing import TOLERANCE

from helpers import require_fused_kernels

RECORD_FIELDS = {"runner", "runner_title", "shape", "variant", "timed_variant", "mode", "status"}
TIMED_FIELDS = {
    "median_ms", "times_ms", "repeat_spread", "speedup_vs_torch_nn", "gflop", "gflops_per_s", "fraction_of_sgemm",
    "peak_memory_bytes", "saved_activation_bytes", "max_rel_rms_error", "tolerance", "error_bound", "page_faults_per_call",
    "calls_per_repeat",
}
ENVIRONMENT_FIELDS = {"torch", "rnnkit", "threads", "cpu", "device", "dtype", "repeats", "sgemm_gflops", "rnnkit_backends",
                      "warnings", "load_average_samples"}


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """The load-average warning is tested on purpose below; elsewhere the shared machine's load is not the point."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def _run(tmp_path, *flags):
    out = tmp_path / "results"
    # --default-malloc: the bench's own setting (malloc keeps what it frees) would stay with this
    # process, the whole suite's, for good; a subprocess tests it below
    status = bench.main(["--quick", "--threads", "1", "--default-malloc", "--out", str(out), *flags])
    return status, json.loads((out / "bench.json").read_text()), out


def _run_with_runner(tmp_path, factory, *flags):
    """_run with the runner ``factory`` registered under its name for the run."""
    bench.register(factory.name, factory)
    try:
        return _run(tmp_path, *flags)
    finally:
        bench.unregister(factory.name)


def test_quick_run_writes_json_markdown_and_png(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.123456789, 0.0, 0.0))
    variants = ["lstm", "lstm_peephole", "lstm_per_layer"]
    status, report_, out = _run(tmp_path, "--variants", *variants, "--runners", "torch.nn", "reference")
    assert status == 0
    assert (out / "bench.md").read_text().splitlines()[0].endswith("; load average 0.12")
    assert ENVIRONMENT_FIELDS <= set(report_["environment"])
    records = report_["records"]
    assert len(records) == len(variants) * 2 * 2  # variants x modes x runners
    for record in records:
        assert RECORD_FIELDS <= set(record), record
        assert record["status"] == "ok", record
        assert TIMED_FIELDS <= set(record), record
        assert record["max_rel_rms_error"] <= record["tolerance"] == record["error_bound"]  # tiny: within the dtype's
        assert len(record["times_ms"]) == report_["environment"]["repeats"]
    training = [r for r in records if r["mode"] == "training"]
    assert all(r["saved_activation_bytes"] > 0 for r in training)
    # torch.nn lacks peepholes: it times its plain LSTM as the baseline, and says so
    stand_ins = [r for r in records if r["runner"] == "torch.nn" and r["variant"] == "lstm_peephole"]
    assert all(r["timed_variant"] == "lstm" and "stand_in" in r for r in stand_ins)
    # LSTM variants also carry their time against torch.nn's plain LSTM of the same shape and mode
    plain = {r["mode"]: r["median_ms"] for r in records if r["runner"] == "torch.nn" and r["variant"] == "lstm"}
    for r in records:
        if r["variant"] == "lstm":
            assert "time_vs_torch_nn_plain_lstm" not in r
        else:
            assert r["time_vs_torch_nn_plain_lstm"] == pytest.approx(r["median_ms"] / plain[r["mode"]])
    table, plain_table = (out / "bench.md").read_text().split("LSTM variants: time")
    assert "| shape | variant | mode | torch.nn | reference |" in table
    assert table.count("| tiny |") == len(variants) * 2
    assert plain_table.count("| tiny |") == (len(variants) - 1) * 2
    if importlib.util.find_spec("matplotlib") is None:
        return
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_api_rows_are_checked_and_timed_per_step(tmp_path):
    status, report_, out = _run(tmp_path, "--step", "--runners", "torch.nn", "reference")
    assert status == 0
    records = report_["records"]
    assert {(r["variant"], r["mode"], r["shape"]) for r in records} == {
        (v, "inference", "step-tiny") for v in ("lstm_cell", "gru_cell", "lstm_t1")}
    for record in records:
        assert record["status"] == "ok", record
        assert record["max_rel_rms_error"] <= record["tolerance"]  # checked against the reference before timing
        assert record["timed_variant"] == record["variant"]  # torch.nn has cells and T=1 calls: no stand-in
        assert record["per_step_us"] == pytest.approx(record["median_ms"] * 1e3 / SHAPES["step-tiny"].T)
        assert record["speedup_vs_torch_nn"] > 0
    assert "µs/step" in (out / "bench.md").read_text()


def test_step_shapes_of_the_grid_follow_bench_md():
    for name, B, H in (("step128", 1, 128), ("step512", 1, 512), ("step512-b4", 4, 512)):
        shape = SHAPES[name]
        assert (shape.B, shape.I, shape.H, shape.L) == (B, H, H, 1)
    assert [VARIANTS[v].modes for v in ("lstm_cell", "gru_cell", "lstm_t1")] == [("inference",)] * 3


@pytest.mark.parametrize("flags", [["--step", "--modes", "training"], ["--variants", "lstm_cell", "--shapes", "small"]],
                         ids=["step-training", "step-two-layers"])
def test_step_api_combinations_that_cannot_run_are_refused(tmp_path, capsys, flags):
    assert bench.main(["--quick", "--out", str(tmp_path), *flags]) == 2
    assert "step API" in capsys.readouterr().err


class WrongWeights(Runner):
    """The reference backend on perturbed weights: a runner the check must catch."""

    name = "wrong"
    title = "deliberately wrong"

    def build(self, case):
        module = rnnkit_module(case.variant, case.shape, "reference", case.device, case.dtype)
        module.load_state_dict(case.reference(case.variant.name).state_dict())
        with torch.no_grad():
            module.flat_weights.add_(1e-2)
        return Model(case.variant.name, [module])


def test_a_wrong_runner_is_reported_failed_and_not_timed(tmp_path):
    status, report_, out = _run_with_runner(tmp_path, WrongWeights, "--variants", "lstm", "--runners", "torch.nn", "wrong")
    assert status == 1
    wrong = [r for r in report_["records"] if r["runner"] == "wrong"]
    assert [r["mode"] for r in wrong] == ["inference", "training"]
    for record in wrong:
        assert record["status"] == "failed"
        assert "relative RMS error" in record["reason"]
        assert not TIMED_FIELDS & set(record)
    assert "FAILED" in (out / "bench.md").read_text()


class FreshMemory(Runner):
    """The reference backend, whose every call also writes to 256 pages of memory newly mapped
    from the OS (an allocator that hands its memory back between calls): faults the bench must count."""

    name = "fresh"
    title = "fresh memory each call"
    pages = 256

    def build(self, case):
        module = rnnkit_module(case.variant, case.shape, "reference", case.device, case.dtype)
        module.load_state_dict(case.reference(case.variant.name).state_dict())
        pages = self.pages

        class Faulting(Model):
            def forward(self, x, lengths=None):
                memory = mmap.mmap(-1, pages * mmap.PAGESIZE)
                for page in range(pages):
                    memory[page * mmap.PAGESIZE] = 1
                memory.close()
                return super().forward(x, lengths)

        return Faulting(case.variant.name, [module])


def test_a_repeat_is_one_call_on_the_cpu_and_20_ms_of_calls_on_cuda():
    """On the CPU each timed call is synchronized alone; on CUDA one repeat runs back-to-back calls
    for 20 ms (one synchronized call of a few ms read 10-60% apart between repeats on an H200)."""
    from rnnkit.app.bench.measure import CUDA_MAX_CALLS, calls_per_repeat

    assert calls_per_repeat("cpu", 1e-6) == 1 and calls_per_repeat(torch.device("cpu"), 0.0) == 1
    assert calls_per_repeat("cuda", 0.001) == 20 and calls_per_repeat("cuda:0", 0.0015) == 14
    assert calls_per_repeat("cuda", 0.05) == 1 and calls_per_repeat("cuda", 1e-7) == CUDA_MAX_CALLS
    assert calls_per_repeat("cuda", 0.0) == CUDA_MAX_CALLS


def test_time_call_divides_back_to_back_calls(monkeypatch):
    """Time and page faults per call over ``calls`` calls, on a clock and a fault counter that each
    call moves by 1 s and 10 faults."""
    from rnnkit.app.bench import measure

    clock, faults, ran = [0.0], [0], []
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(measure, "minor_faults", lambda: faults[0])

    class Counting:
        device = "cpu"

        def run(self, model, mode, upstream):
            ran.append(mode)
            clock[0] += 1.0
            faults[0] += 10

    assert measure.time_call(Counting(), None, "inference", None, calls=5) == (1.0, 10)
    assert len(ran) == 5
    assert measure.time_call(Counting(), None, "inference", None) == (1.0, 10) and len(ran) == 6


def test_a_cuda_case_times_its_repeats_as_calls_per_repeat_says(monkeypatch):
    """measure_case on a device that says CUDA: one sizing call per runner, then each repeat runs
    that many calls, recorded in calls_per_repeat; on the CPU no sizing call and one call a repeat."""
    from rnnkit.app.bench import measure

    for device, expected_calls in (("cuda", 3), ("cpu", 1)):
        runs = []
        monkeypatch.setattr(measure, "calls_per_repeat", lambda d, seconds: 3 if torch.device(d).type == "cuda" else 1)
        monkeypatch.setattr(measure, "synchronize", lambda d: None)
        monkeypatch.setattr(measure, "peak_bytes", lambda *args: 0)
        monkeypatch.setattr(measure, "flops", lambda *args: 1.0)
        monkeypatch.setattr(measure, "check", lambda *args: measure.Checked(0.0, 1e-5))
        case = measure.Case(SHAPES["tiny"], VARIANTS["lstm"],
                            "cpu", torch.float32)
        monkeypatch.setattr(case, "device", device, raising=False)
        monkeypatch.setattr(case, "run", lambda model, mode, upstream: runs.append(mode), raising=False)

        class Fake(Runner):
            name, title = "fake", "fake"

            def build(self, case):
                return Model("lstm", [torch.nn.Linear(1, 1)])

        monkeypatch.setattr(case, "expected", lambda variant, mode: {"upstream": None}, raising=False)
        [record] = measure.measure_case(case, "inference", [Fake()], repeats=2, warmup=1, sgemm=1.0)
        assert record["status"] == "ok" and record["calls_per_repeat"] == expected_calls, record
        sizing = 1 if device == "cuda" else 0
        assert len(runs) == 1 + sizing + 2 * expected_calls, (device, len(runs))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
# in the warm-up, the CUDA sizing call (or the first repeat), a repeat, the memory measurement after the repeats
@pytest.mark.parametrize("crash_at", [1, 2, 4, "memory"])
def test_a_runner_that_crashes_while_timed_is_reported_and_the_others_are_timed(monkeypatch, device, crash_at):
    from rnnkit.app.bench import measure

    calls = {"steady": 0, "crash": 0}
    monkeypatch.setattr(measure, "calls_per_repeat", lambda d, seconds: 1)
    monkeypatch.setattr(measure, "synchronize", lambda d: None)

    def peak(case, model, mode, upstream):
        if crash_at == "memory" and model.timed_variant == "crash":
            raise RuntimeError("CUDA out of memory")
        return 0

    monkeypatch.setattr(measure, "peak_bytes", peak)
    monkeypatch.setattr(measure, "flops", lambda *args: 1.0)
    monkeypatch.setattr(measure, "check", lambda *args: measure.Checked(0.0, 1e-5))
    case = measure.Case(SHAPES["tiny"], VARIANTS["lstm"], "cpu", torch.float32)
    case.device = device

    def run(model, mode, upstream):
        calls[model.timed_variant] += 1
        if model.timed_variant == "crash" and calls["crash"] == crash_at:
            raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(case, "run", run)
    monkeypatch.setattr(case, "expected", lambda variant, mode: {"upstream": None})

    def fake(name):
        class Fake(Runner):
            def build(self, case):
                return Model(name, [torch.nn.Linear(1, 1)])

        runner = Fake()
        runner.name = runner.title = name
        return runner

    steady, crash = measure.measure_case(case, "inference", [fake("steady"), fake("crash")], repeats=3, warmup=1,
                                         sgemm=1.0)
    assert crash["status"] == "failed" and crash["reason"] == "while timed: RuntimeError: CUDA out of memory", crash
    assert "median_ms" not in crash
    assert steady["status"] == "ok" and len(steady["times_ms"]) == 3, steady


@pytest.mark.skipif(importlib.util.find_spec("resource") is None, reason="the OS counts no page faults for Python (Windows)")
def test_page_faults_inside_timed_calls_are_counted_and_named(tmp_path):
    status, report_, out = _run_with_runner(tmp_path, FreshMemory, "--variants", "lstm", "--runners", "reference", "fresh",
                                            "--modes", "inference")
    assert status == 0
    by_runner = {r["runner"]: r for r in report_["records"]}
    assert by_runner["fresh"]["page_faults_per_call"] >= FreshMemory.pages
    assert by_runner["reference"]["page_faults_per_call"] < report.FAULT_LIMIT  # its memory stays with the process
    notes = (out / "bench.md").read_text().split("Page faults inside the timed calls")[1]
    assert "- fresh / tiny / lstm / inference: " in notes and "reference /" not in notes


LARGE_BLOCK_SCRIPT = """
import sys, torch
from rnnkit.app import bench
from rnnkit.app.bench.runners import Model, Runner, rnnkit_module

class LargeBlocks(Runner):
    # the reference backend, whose every call also allocates and writes 40 MB through torch: a
    # block above glibc's largest adaptive mmap threshold (32 MB), which its defaults map and
    # unmap at every call
    name, title = "large", "a 40 MB tensor each call"

    def build(self, case):
        module = rnnkit_module(case.variant, case.shape, "reference", case.device, case.dtype)
        module.load_state_dict(case.reference(case.variant.name).state_dict())

        class Allocating(Model):
            def forward(self, x, lengths=None):
                torch.empty(10_000_000).fill_(1.0)
                return super().forward(x, lengths)

        return Allocating(case.variant.name, [module])

bench.register("large", LargeBlocks)
sys.exit(bench.main(["--quick", "--threads", "1", "--variants", "lstm", "--modes", "inference", "--runners",
                     "large", *sys.argv[2:], "--out", sys.argv[1]]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("flags, kept", [((), True), (("--default-malloc",), False)], ids=["default", "default-malloc"])
def test_the_bench_keeps_freed_memory_in_the_process_unless_told_not_to(tmp_path, flags, kept):
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    script = tmp_path / "large_blocks.py"
    script.write_text(LARGE_BLOCK_SCRIPT)
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, str(script), str(out), *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report_ = json.loads((out / "bench.json").read_text())
    (large,) = [r for r in report_["records"] if r["runner"] == "large"]
    if kept:
        assert report_["environment"]["malloc"].startswith("kept: ")
        assert "; malloc kept" in (out / "bench.md").read_text().splitlines()[0]
        assert large["page_faults_per_call"] < report.FAULT_LIMIT  # the 40 MB came back from the heap
    else:
        assert report_["environment"]["malloc"] == "default: --default-malloc"
        # mapped afresh and written at every call: ~9,800 faults of 4 KB pages, or ~20 where
        # transparent huge pages back it with 2 MB ones
        assert large["page_faults_per_call"] >= 10


def test_page_fault_notes_name_runners_over_the_limit():
    records = [
        {"runner": "torch.nn", "shape": "medium", "variant": "lstm", "mode": "training", "status": "ok",
         "page_faults_per_call": 14824},
        {"runner": "fused", "shape": "medium", "variant": "lstm", "mode": "training", "status": "ok", "page_faults_per_call": 1},
        {"runner": "gone", "shape": "medium", "variant": "lstm", "mode": "training", "status": "ok", "page_faults_per_call": None},
        {"runner": "wrong", "shape": "medium", "variant": "lstm", "mode": "training", "status": "failed"},
    ]
    (note,) = report.page_fault_notes(records)
    megabytes = 14824 * mmap.PAGESIZE / 1e6
    assert note == (f"torch.nn / medium / lstm / training: 14,824 page faults a call ({megabytes:.1f} MB of memory "
                    "fresh from the OS at every call)")


def test_unavailable_runner_is_reported_with_its_reason(tmp_path):
    class Missing(Runner):
        name, title = "missing", "not installed"

        def unavailable_reason(self):
            return "ImportError: no module named missing"

    status, report_, _ = _run_with_runner(tmp_path, Missing, "--variants", "gru", "--runners", "missing", "reference", "--modes", "inference")
    assert status == 0
    (missing,) = [r for r in report_["records"] if r["runner"] == "missing"]
    assert missing["status"] == "unavailable" and "ImportError" in missing["reason"]
    # the plot shows only the runners that ran: no legend entry for the unavailable one
    assert report.plotted_runners(report_["records"], ["torch.nn", "missing", "reference"], "inference") == ["reference"]
    if importlib.util.find_spec("matplotlib") is None:
        return
    drawn, note = report.plot(str(tmp_path / "plot.png"), report_["records"], ["torch.nn", "missing", "reference"])
    assert note is None and drawn["inference"]["runners"] == ["reference"]


def _records(speedups, mode="inference", runner="fused"):
    return [{"runner": runner, "shape": "s", "variant": f"v{k}", "mode": mode, "status": "ok", "speedup_vs_torch_nn": x}
            for k, x in enumerate(speedups)]


@pytest.mark.parametrize("speedups", [[0.8, 1.36], [0.15, 1.3], [0.03, 8.0], [1.0]], ids=["narrow", "wide", "decades", "one"])
def test_plot_ticks_are_plain_ratios(tmp_path, speedups):
    pytest.importorskip("matplotlib")
    drawn, note = report.plot(str(tmp_path / "plot.png"), _records(speedups), ["torch.nn", "fused"])
    labels = drawn["inference"]["yticklabels"]
    assert len(labels) >= 2 and "1" in labels
    for label in labels:
        float(label)  # "0.5", "1", "2": no "3×10⁰", no mathtext
        assert "$" not in label and "10^" not in label and "×" not in label
    assert drawn["inference"]["minor_yticklabels"] == []
    values = sorted(float(label) for label in labels)
    assert values[0] <= min(speedups) * 2 and values[-1] >= max(speedups) / 2  # a tick within 2x of every bar


def test_nothing_to_plot_when_only_torch_nn_ran(tmp_path):
    pytest.importorskip("matplotlib")
    drawn, note = report.plot(str(tmp_path / "plot.png"), _records([1.0], runner="torch.nn"), ["torch.nn"])
    assert drawn is None and "nothing to plot" in note


# ---- warnings: noisy repeats, a busy machine ---------------------------------------------

def test_spread_warnings_name_the_noisy_runner():
    records = [
        {"runner": "fused", "shape": "small", "variant": "lstm", "mode": "training", "status": "ok", "repeat_spread": 0.35},
        {"runner": "torch.nn", "shape": "small", "variant": "lstm", "mode": "training", "status": "ok", "repeat_spread": 0.04},
        {"runner": "wrong", "shape": "small", "variant": "lstm", "mode": "training", "status": "failed"},
    ]
    (warning,) = report.spread_warnings(records)
    assert "fused / small / lstm / training" in warning and "35%" in warning


def test_repeat_spread():
    from rnnkit.app.bench.measure import repeat_spread

    assert repeat_spread([1.0, 1.0, 1.0]) == 0.0
    assert repeat_spread([0.9, 1.0, 1.2]) == pytest.approx(0.3)


@pytest.mark.parametrize("samples, cores, warns", [
    ([(0.3, 0), (1.2, 1)], 2, False),  # our own thread is most of the load
    ([(0.05, 0), (1.1, 1)], 1, False),  # pinned to one core (taskset): the load average's noise only
    ([(1.9, 0)], 2, True),  # others keep ~2 cores busy before we start
    ([(0.2, 0), (3.5, 1)], 2, True),  # others joined while we ran
    ([], 2, False),
], ids=["idle", "idle-pinned", "busy-at-start", "busy-meanwhile", "no-load-average"])
def test_load_warning(samples, cores, warns):
    warning = report.load_warning(samples, cores=cores, threads=1)
    assert (warning is not None) == warns
    if warns:
        assert "load average" in warning and f"{cores} cores" in warning


def test_a_loaded_machine_is_warned_about(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    status, report_, out = _run(tmp_path, "--variants", "gru", "--runners", "torch.nn", "--modes", "inference")
    assert status == 0
    assert any("load average 64.00" in w for w in report_["environment"]["warnings"])
    assert "**Warnings**" in (out / "bench.md").read_text() and "\n- load average 64.00" in (out / "bench.md").read_text()
    assert "rnnkit bench: warning: load average" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--shapes", "nope"], ["--variants", "nope"], ["--runners", "nope"], ["--modes", "nope"]],
                         ids=["shape", "variant", "runner", "mode"])
def test_unknown_names_are_refused(tmp_path, flags, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path), *flags]) == 2
    assert f"rnnkit bench: error: {flags[0]}: unknown name 'nope'; expected one of " in capsys.readouterr().err


def test_flops_follow_bench_md():
    shape = SHAPES["fastrnns"]
    case = Case(shape, VARIANTS["lstm"], "cpu", torch.float32)
    forward = 2 * 4 * shape.H * (shape.I + shape.H) * shape.B * shape.T
    assert flops(case, "lstm", "inference") == forward
    assert flops(case, "lstm", "training") == 3 * forward


# ---- variable lengths (BENCH.md: lengths from T/8 to T; torch.nn on a PackedSequence) --------

class IgnoresLengths(Runner):
    """rnnkit's reference on the padded batch as if every sequence ran all T steps."""

    name, title = "ignores-lengths", "ignores lengths"

    def build(self, case):
        module = rnnkit_module(case.variant, case.shape, "reference", case.device, case.dtype)
        module.load_state_dict(case.reference(case.variant.name).state_dict())
        model = Model(case.variant.name, [module])
        model.forward = lambda x, lengths=None: Model.forward(model, x)
        return model


def test_variable_length_rows_are_checked_and_timed(tmp_path):
    runners = ["torch.nn", "reference", "onnxruntime"] if importlib.util.find_spec("onnxruntime") else ["torch.nn", "reference"]
    status, report_, out = _run(tmp_path, "--variants", "lstm_lengths", "lstm_packed", "--runners", *runners)
    assert status == 0
    records = report_["records"]
    timed = [r for r in records if r["status"] == "ok"]
    # onnxruntime runs inference only; everything else runs both modes
    assert len(timed) == 2 * 2 * 2 + (2 if "onnxruntime" in runners else 0)
    for record in timed:
        assert TIMED_FIELDS <= set(record), record
        assert record["max_rel_rms_error"] <= record["tolerance"] or record["runner"] == "onnxruntime"
    # the work counted is the steps run: the lengths' sum, not T·B
    shape = SHAPES["tiny"]
    case = Case(shape, VARIANTS["lstm_lengths"], "cpu", torch.float32)
    assert case.lengths.min() == max(1, shape.T // 8) and case.lengths.max() == shape.T
    full = Case(shape, VARIANTS["lstm"], "cpu", torch.float32)
    assert flops(case, "lstm_lengths", "inference") == flops(full, "lstm", "inference") * int(case.lengths.sum()) // (shape.T * shape.B)


def test_a_runner_that_ignores_lengths_fails_the_check(tmp_path):
    status, report_, _ = _run_with_runner(tmp_path, IgnoresLengths, "--variants", "lstm_lengths", "--runners", "torch.nn", "ignores-lengths")
    assert status == 1
    wrong = [r for r in report_["records"] if r["runner"] == "ignores-lengths"]
    assert wrong and all(r["status"] == "failed" for r in wrong)


def test_the_sgemm_limit_is_the_best_library_on_the_kernels_shapes():
    from rnnkit.app.bench.measure import gemm_shapes, sgemm_gflops

    shapes = gemm_shapes([SHAPES["small"], SHAPES["stream"]], 64)
    assert (64, 64, 64) in shapes
    assert (100 * 16, 128, 4 * 128) in shapes and (16, 128, 4 * 128) in shapes  # small: projection, per step
    assert not any(M == 1 for M, _, _ in shapes)  # stream's B=1 steps are matrix-vector products
    limit, by_library = sgemm_gflops("cpu", 64, [SHAPES["tiny"]], repeats=1)
    assert "MKL" in by_library and limit == max(by_library.values()) > 0
    if torch.backends.mkldnn.is_available():
        assert "oneDNN" in by_library


def test_the_table_header_names_the_cpu_features(tmp_path):
    status, report_, out = _run(tmp_path, "--variants", "gru", "--runners", "torch.nn", "--modes", "inference")
    env = report_["environment"]
    assert set(env["cpu_flags"]) <= set(machine.SIMD_FLAGS)
    header = (out / "bench.md").read_text().splitlines()[0]
    assert env["cpu"] in header and f"sgemm {env['sgemm_gflops']:.0f} GFLOP/s" in header
    if len(env["sgemm_by_library"]) > 1:
        assert "best of MKL" in header


def test_where_float32_is_luck_the_check_takes_medians_over_inputs_one_ulp_apart(monkeypatch):
    """Above the dtype's tolerance, one float32 run's distance from the truth is luck: the check
    then compares medians over the input and 7 neighbours one ulp away, each with its own truth."""
    from rnnkit.app.bench import measure

    case = Case(SHAPES["tiny"], VARIANTS["lstm_layer_norm"], "cpu", torch.float32)
    assert case.expected("lstm_layer_norm", "training")["samples"] == []  # within tolerance: one run
    monkeypatch.setitem(measure.TOLERANCE, torch.float32, 0.0)  # every error is "above tolerance" now
    case = Case(SHAPES["tiny"], VARIANTS["lstm_layer_norm"], "cpu", torch.float32)
    expected = case.expected("lstm_layer_norm", "training")
    samples = expected["samples"]
    assert len(samples) == 7  # the input's 7 neighbours; with the input itself, 8 errors per result
    assert all(len(errors) == 8 for errors in expected["reference_errors"].values())
    assert all(not torch.equal(x, case.x) and (x - case.x).abs().max() <= 2 * torch.finfo(torch.float32).eps * case.x.abs().max()
               for x, _ in samples)
    # the reference itself passes; weights moved by 1e-3 do not
    reference = case.reference("lstm_layer_norm")
    checked = measure.check(case, Model("lstm_layer_norm", [reference]), "training")
    assert 0 < checked.error <= checked.bound  # held to 3x the reference's error, not to the tolerance of 0
    wrong = rnnkit_module(case.variant, case.shape, "reference", "cpu", torch.float32)
    wrong.load_state_dict(reference.state_dict())
    with torch.no_grad():
        wrong.flat_weights.add_(1e-3)
    with pytest.raises(measure.CheckFailed, match="median relative RMS error over 8 inputs"):
        measure.check(case, Model("lstm_layer_norm", [wrong]), "training")


# ---- int8 (BENCH.md "Also measured: Low precision"): checked against float32 within INT8_TOLERANCE -------

INT8_RUNNERS = ["int8", "torch.ao-int8", "onnxruntime-int8"]


def _require_int8_libraries():
    pytest.importorskip("onnxruntime.quantization")
    pytest.importorskip("torch.ao.quantization")
    require_fused_kernels()


@pytest.mark.parametrize("flags, variants", [
    (["--variants", "lstm", "gru", "lstm_peephole"], {"lstm", "gru", "lstm_peephole"}),
    (["--step", "--variants", "lstm_cell", "lstm_t1"], {"lstm_cell", "lstm_t1"}),
], ids=["sequence", "step"])
def test_int8_runners_are_checked_with_the_int8_tolerance_and_timed(tmp_path, flags, variants):
    _require_int8_libraries()
    status, report_, _ = _run(tmp_path, *flags, "--runners", "torch.nn", *INT8_RUNNERS, "--modes", "inference")
    assert status == 0
    records = {(r["runner"], r["variant"]): r for r in report_["records"]}
    assert {variant for _, variant in records} == variants
    expected_ok = {("int8", v) for v in variants} | {("torch.ao-int8", v) for v in variants if VARIANTS[v].torch_nn}
    expected_ok |= {("onnxruntime-int8", v) for v in variants if v in ("lstm", "lstm_peephole")}
    for (runner, variant), record in records.items():
        if runner == "torch.nn":
            continue
        if (runner, variant) in expected_ok:
            assert record["status"] == "ok", record
            assert TIMED_FIELDS <= set(record) and record["speedup_vs_torch_nn"] > 0
            assert record["tolerance"] == INT8_TOLERANCE
            assert TOLERANCE[torch.float32] < record["max_rel_rms_error"] <= INT8_TOLERANCE  # int8 indeed, within its bound
            if runner == "int8":  # which kernels ran, in the record and the table's note
                assert record["int8_kernel"] == rnnkit.quantized.int8_kernel()
                assert f"int8 (int8, {record['int8_kernel']} kernels)" in (tmp_path / "results" / "bench.md").read_text()
        else:
            assert record["status"] == "unsupported", record
    # what they cannot run, they say, rather than time float32 under an int8 name
    if "gru" in variants:
        assert "leaves GRU in float32" in records[("onnxruntime-int8", "gru")]["reason"]
    if "lstm_peephole" in variants:
        assert "torch.nn lacks lstm_peephole" in records[("torch.ao-int8", "lstm_peephole")]["reason"]


class ScaledInt8(RnnkitInt8):
    """rnnkit's int8 module with its outputs 1.1x: an int8 runner the check must catch."""

    name, title = "int8-scaled", "int8, outputs x1.1"

    def build(self, case):
        model = super().build(case)
        model.forward = lambda x, lengths=None: [1.1 * t for t in Model.forward(model, x, lengths)]
        return model


def test_a_wrong_int8_runner_is_reported_failed_and_not_timed(tmp_path):
    require_fused_kernels()
    status, report_, out = _run_with_runner(tmp_path, ScaledInt8, "--variants", "lstm", "gru", "--runners", "torch.nn",
                                            "int8", "int8-scaled", "--modes", "inference")
    assert status == 1
    by_runner = {}
    for record in report_["records"]:
        by_runner.setdefault(record["runner"], []).append(record)
    assert all(r["status"] == "ok" for r in by_runner["int8"])
    for record in by_runner["int8-scaled"]:
        assert record["status"] == "failed" and "relative RMS error" in record["reason"], record
        assert not TIMED_FIELDS & set(record)
    assert "FAILED" in (out / "bench.md").read_text()



# ---- bfloat16: the modules cast, checked against float64 within bfloat16's tolerance ------------


@pytest.mark.parametrize("flags, variants", [
    (["--variants", "lstm", "gru", "lstm_peephole"], {"lstm", "gru", "lstm_peephole"}),
    (["--step", "--variants", "gru_cell", "lstm_t1"], {"gru_cell", "lstm_t1"}),
], ids=["sequence", "step"])
def test_bf16_runners_are_checked_with_the_bf16_tolerance_and_timed(tmp_path, flags, variants):
    require_fused_kernels()
    status, report_, _ = _run(tmp_path, *flags, "--runners", "torch.nn", "bf16", "torch.nn-bf16")
    assert status == 0
    records = [r for r in report_["records"] if r["runner"] != "torch.nn"]
    assert {r["variant"] for r in records} == variants
    for record in records:
        assert record["status"] == "ok", record
        assert record["precision"] == "bfloat16" and record["weights"] == "bfloat16"
        assert record["tolerance"] == TOLERANCE[torch.bfloat16]
        # bfloat16 indeed (a float32 computation would be within float32's bound), and within its own
        assert TOLERANCE[torch.float32] < record["max_rel_rms_error"] <= TOLERANCE[torch.bfloat16], record
        assert TIMED_FIELDS <= set(record)


class ScaledBf16(RnnkitBf16):
    """rnnkit's bfloat16 module with its outputs 1.05x: a bfloat16 runner the check must catch."""

    name, title = "bf16-scaled", "bf16, outputs x1.05"

    def build(self, case):
        model = super().build(case)
        forward = model.forward
        model.forward = lambda x, lengths=None: [1.05 * t for t in forward(x, lengths)]
        return model


def test_a_wrong_bf16_runner_is_reported_failed_and_not_timed(tmp_path):
    require_fused_kernels()
    status, report_, _ = _run_with_runner(tmp_path, ScaledBf16, "--variants", "lstm_peephole", "--runners", "torch.nn",
                                          "bf16", "bf16-scaled")
    assert status == 1
    for record in report_["records"]:
        if record["runner"] == "bf16":
            assert record["status"] == "ok", record
        elif record["runner"] == "bf16-scaled":
            assert record["status"] == "failed" and "relative RMS error" in record["reason"], record
            assert not TIMED_FIELDS & set(record)


# ---- the float32 GEMM choice, measured in the same process ---------------------------------------


def test_the_fused_mkl_runner_times_the_fused_passes_on_mkl(tmp_path, monkeypatch):
    """"fused-mkl" is the fused backend with its float32 GEMMs on MKL for its whole timed call
    (forward and backward), beside "fused" on the CPU's choice; the table names that choice."""
    require_fused_kernels()
    from rnnkit import fused

    seen = []
    original = fused.use_fp32_gemm

    def spy(name):
        seen.append(name)
        return original(name)

    monkeypatch.setattr(fused, "use_fp32_gemm", spy)
    status, report_, out = _run(tmp_path, "--variants", "lstm", "gru", "--runners", "torch.nn", "fused", "fused-mkl")
    assert status == 0
    records = [r for r in report_["records"] if r["runner"] == "fused-mkl"]
    assert {r["variant"] for r in records} == {"lstm", "gru"} and {r["mode"] for r in records} == {"inference", "training"}
    for record in records:
        assert record["status"] == "ok", record
        assert record["fp32_gemm"] == "mkl" and TIMED_FIELDS <= set(record)
    assert seen and set(seen) == {"mkl"}
    assert report_["environment"]["fp32_gemm"] == fused.fp32_gemm()
    assert f"fused float32 GEMM: {fused.fp32_gemm()}" in (out / "bench.md").read_text()


@pytest.mark.parametrize("script, columns, options, count", [
    ("fp32_gemm.py", "| MKL | oneDNN |", [], 8),
    ("fp32_gemm.py", "| MKL | rnnkit", ["--weight-gradients"], 10),
    ("int8_gemm.py", "| MKL fp32 | oneDNN fp32 |", [], 8),
    ("bf16_gemm.py", "| MKL fp32 | oneDNN fp32 | oneDNN bf16 |", [], 8)])
def test_gemm_benchmark_scripts_write_their_tables(tmp_path, script, columns, options, count):
    """benchmarks/fp32_gemm.py, int8_gemm.py and bf16_gemm.py (the README's GEMM rates) run and write
    a row per product of the grid, every rate a positive number."""
    require_fused_kernels()
    path = Path(__file__).resolve().parent.parent / "benchmarks" / script
    out = tmp_path / "table.md"
    done = subprocess.run([sys.executable, str(path), "--repeats", "1", "--out", str(out), *options],
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 1 and "nothing to compare" in done.stderr:
        pytest.skip(done.stderr.strip())  # no own float32 kernels, or no bfloat16 ones, on this CPU
    assert done.returncode == 0, done.stderr
    lines = out.read_text().splitlines()
    assert columns in lines[2]
    rows = [line for line in lines[4:] if line.startswith("| ")]
    assert len(rows) == count
    for row in rows:
        cells = row.strip("|").split("|")[2:]
        if options:  # the last cell: which kernel a pass takes (MKL's where the build's own do not take them: AVX2)
            from rnnkit.fused import build
            taken = ("in place", "packed") if build.extension().f32_own_weight_gradients() else ("MKL",)
            assert cells.pop().strip() in taken, row
        rates = [float(cell) for cell in cells]
        assert rates and all(rate > 0 for rate in rates), row


@pytest.mark.parametrize("flag, value, expected", [
    ("--threads", "-1", "an integer from 1 to 1,024"), ("--threads", "0", "an integer from 1 to 1,024"),
    ("--threads", "100000", "an integer from 1 to 1,024"),
    ("--repeats", "0", "a positive integer"), ("--warmup", "-2", "a non-negative integer"),
])
def test_bench_refuses_bad_counts_in_one_line(flag, value, expected, capsys):
    """--threads -1 was a traceback from torch.set_num_threads, and --threads 0 quietly meant all
    cores (train, sample and eval refuse 0): argparse's one-line error, exit status 2, nothing run."""
    from rnnkit.app import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", flag, value, "--list"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: expected {expected}, got '{value}'" in capsys.readouterr().err


def test_bench_refuses_an_out_it_cannot_write_before_measuring(tmp_path, capsys, monkeypatch):
    """An --out under a file failed after the first case's measurements; now before any."""
    from rnnkit.app import bench, cli

    monkeypatch.setattr(bench, "measure_case", lambda *a, **k: pytest.fail("measured before checking --out"))
    (tmp_path / "a-file").write_text("")
    status = cli.main(["bench", "--quick", "--shapes", "tiny", "--variants", "lstm", "--out", str(tmp_path / "a-file" / "out")])
    err = capsys.readouterr().err
    assert status == 1
    assert err.strip().splitlines() == [
        f"rnnkit: error: --out {tmp_path / 'a-file' / 'out'}: cannot create the directory: Not a directory"]
    for out, why in ((tmp_path / "a-file", "got a file"), ("", "got an empty path")):
        assert cli.main(["bench", "--quick", "--shapes", "tiny", "--variants", "lstm", "--out", str(out)]) == 1
        assert capsys.readouterr().err.strip() == (
            f"rnnkit: error: --out {str(out) or repr(str(out))}: expected a directory for bench.json, bench.md and "
            f"bench.png, {why}")


def test_a_run_stopped_early_marks_its_files_partial_and_leaves_no_earlier_plot(tmp_path, monkeypatch):
    """An interrupted run keeps the cases it finished (bench.json, bench.md, written atomically after
    every case), marked as partial, and no plot of an earlier run stays beside them."""
    from rnnkit.app import bench

    out = tmp_path / "results"
    out.mkdir()
    (out / "bench.png").write_bytes(b"an earlier run's plot")
    real, done = bench.measure_case, []

    def measure(*args, **kwargs):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "measure_case", measure)
    status = bench.main(["--quick", "--threads", "1", "--default-malloc", "--shapes", "tiny", "--variants", "lstm",
                         "gru", "--runners", "torch.nn", "reference", "--out", str(out)])
    assert status == 130  # the command's report of an interrupt
    environment = json.loads((out / "bench.json").read_text())["environment"]
    assert (environment["cases_done"], environment["cases_planned"]) == (2, 4)
    table = (out / "bench.md").read_text()
    assert table.startswith("**Partial results**: this run stopped after 2 of its 4 cases")
    assert table.count("| tiny |") == 2
    assert not (out / "bench.png").exists()
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]  # no temporaries left


def test_bench_step_refuses_sequence_variants(capsys, tmp_path):
    """--step with --variants lstm timed the sequence LSTM and said nothing."""
    from rnnkit.app import cli

    status = cli.main(["bench", "--step", "--quick", "--variants", "lstm", "--out", str(tmp_path / "out")])
    assert status == 2 and "--variants: with --step" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_bench_without_cuda_says_what_train_says(capsys, tmp_path):
    """bench --device cuda without CUDA exited 2 (a usage status) with its own wording."""
    from rnnkit.app import cli

    train = cli.main(["train", "--device", "cuda", "--out", str(tmp_path / "t"), "--steps", "1"])
    train_err = capsys.readouterr().err
    status = cli.main(["bench", "--device", "cuda", "--quick", "--out", str(tmp_path / "b")])
    assert (status, capsys.readouterr().err) == (train, train_err) == (1, train_err)
    assert train_err.startswith("rnnkit: error: --device cuda:")


def test_runtime_errors_are_the_commands_one_line_reports(tmp_path, capsys, monkeypatch):
    """Not usage errors: status 1 and ``rnnkit: error: ...``, as rnnkit train reports them."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert bench.main(["--quick", "--out", str(blocker / "results")]) == 1
    assert capsys.readouterr().err.startswith(f"rnnkit: error: --out {blocker / 'results'}: ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--quick", "--device", "cuda", "--out", str(tmp_path)]) == 1
    assert "rnnkit: error: --device cuda: " in capsys.readouterr().err


def test_onnxruntime_is_not_applicable_to_dtypes_its_kernels_lack(tmp_path):
    """float64 and bfloat16 are n/a for onnxruntime (its CPU LSTM has no such kernels), not FAILED:
    FAILED means a correctness check failed, and it made the whole run exit 1."""
    pytest.importorskip("onnxruntime")
    for dtype in ("float64", "bfloat16"):
        status, report_, _ = _run(tmp_path / dtype, "--variants", "lstm", "--modes", "inference", "--dtype", dtype,
                                  "--runners", "torch.nn", "onnxruntime")
        record = [r for r in report_["records"] if r["runner"] == "onnxruntime"][0]
        assert status == 0 and record["status"] == "unsupported", record
        assert f"take float32 and float16, not torch.{dtype}" in record["reason"]
