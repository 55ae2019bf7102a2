"""The benchmark harness (rnnkit.bench): it writes its reports and refuses to time a wrong runner.

No timing assertions here (BENCH.md); these are smoke tests of the harness on a tiny shape.
"""
import importlib.util
import json

import pytest
import torch

from rnnkit import bench
from rnnkit.bench.measure import Case, flops
from rnnkit.bench.registry import SHAPES, VARIANTS
from rnnkit.bench.runners import Model, Runner, rnnkit_module

RECORD_FIELDS = {"runner", "runner_title", "shape", "variant", "timed_variant", "mode", "status"}
TIMED_FIELDS = {
    "median_ms", "times_ms", "speedup_vs_torch_nn", "gflop", "gflops_per_s", "fraction_of_sgemm",
    "peak_memory_bytes", "saved_activation_bytes", "max_rel_rms_error", "tolerance",
}
ENVIRONMENT_FIELDS = {"torch", "rnnkit", "threads", "cpu", "device", "dtype", "repeats", "sgemm_gflops", "rnnkit_backends"}


def _run(tmp_path, *flags):
    out = tmp_path / "results"
    status = bench.main(["--quick", "--threads", "1", "--out", str(out), *flags])
    return status, json.loads((out / "bench.json").read_text()), out


def test_quick_run_writes_json_markdown_and_png(tmp_path):
    variants = ["lstm", "lstm_peephole", "lstm_per_layer"]
    status, report, out = _run(tmp_path, "--variants", *variants, "--runners", "torch.nn", "reference")
    assert status == 0
    assert ENVIRONMENT_FIELDS <= set(report["environment"])
    records = report["records"]
    assert len(records) == len(variants) * 2 * 2  # variants x modes x runners
    for record in records:
        assert RECORD_FIELDS <= set(record), record
        assert record["status"] == "ok", record
        assert TIMED_FIELDS <= set(record), record
        assert record["max_rel_rms_error"] <= record["tolerance"]
        assert len(record["times_ms"]) == report["environment"]["repeats"]
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
    bench.register("wrong", WrongWeights)
    try:
        status, report, out = _run(tmp_path, "--variants", "lstm", "--runners", "torch.nn", "wrong")
    finally:
        bench.unregister("wrong")
    assert status == 1
    wrong = [r for r in report["records"] if r["runner"] == "wrong"]
    assert [r["mode"] for r in wrong] == ["inference", "training"]
    for record in wrong:
        assert record["status"] == "failed"
        assert "relative RMS error" in record["reason"]
        assert not TIMED_FIELDS & set(record)
    assert "FAILED" in (out / "bench.md").read_text()


def test_unavailable_runner_is_reported_with_its_reason(tmp_path):
    class Missing(Runner):
        name, title = "missing", "not installed"

        def unavailable_reason(self):
            return "ImportError: no module named missing"

    bench.register("missing", Missing)
    try:
        status, report, _ = _run(tmp_path, "--variants", "gru", "--runners", "missing", "--modes", "inference")
    finally:
        bench.unregister("missing")
    assert status == 0
    (missing,) = [r for r in report["records"] if r["runner"] == "missing"]
    assert missing["status"] == "unavailable" and "ImportError" in missing["reason"]


@pytest.mark.parametrize("flags", [["--shapes", "nope"], ["--variants", "nope"], ["--runners", "nope"], ["--modes", "nope"]],
                         ids=["shape", "variant", "runner", "mode"])
def test_unknown_names_are_refused(tmp_path, flags, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path), *flags]) == 2
    assert "nope" in capsys.readouterr().err


def test_flops_follow_bench_md():
    shape = SHAPES["fastrnns"]
    case = Case(shape, VARIANTS["lstm"], "cpu", torch.float32)
    forward = 2 * 4 * shape.H * (shape.I + shape.H) * shape.B * shape.T
    assert flops(case, "lstm", "inference") == forward
    assert flops(case, "lstm", "training") == 3 * forward
