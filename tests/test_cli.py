"""The `rnnkit` command: train -> sample, exact resume (after SIGINT, SIGTERM, SIGKILL), the
schedule, keep-best, the curve's data, the log after a kill, errors in one line, doctor, bench wiring.

Runs are tiny (a few steps of a small model on a short text) so the file stays fast; the
default run's numbers are measured once and written in docs/cli.md.
"""
import json
import shlex
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import rnnkit
from rnnkit.app import cli
from rnnkit.app.charlm import checkpoint, data, history, train

SENTENCE = "the quick brown fox jumps over the lazy dog. "
SMALL = ["--hidden", "24", "--embedding", "8", "--batch", "4", "--bptt", "16", "--eval-every", "4",
         "--eval-chars", "300"]
TIMING = ("chars_per_sec", "elapsed_s", "elapsed", "interval_seconds")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and the machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(SENTENCE * 60 + "Pack my box with five dozen liquor jugs.\n" * 20, encoding="utf-8")
    return path


def run(capsys, *argv):
    """cli.main in-process -> (exit status, stdout, stderr); argparse's exits included."""
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exit:
        status = exit.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())} if directory.exists() else {}


def assert_one_line_error(status, err):
    assert status != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err and "error" in lines[0]


def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING}


def log_records(directory: Path) -> list:
    return [untimed(json.loads(line)) for line in (directory / "log.jsonl").read_text().splitlines()]


def metadata(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    return {
        "progress": untimed(json.loads(meta["progress"])),
        "param_groups": json.loads(meta["param_groups"]),
        "evaluations": [untimed(r) for r in json.loads(meta["evaluations"])],
    }


def assert_same_run(expected_dir: Path, actual_dir: Path, extra_evaluation: int = None):
    """Every tensor of the checkpoint bit for bit, its metadata and the log (timings aside).

    ``extra_evaluation``: the step where the actual run once ended (and so evaluated) before
    resuming; that record is left out, and the best-so-far bookkeeping it may have moved.
    """
    name = "checkpoint.safetensors"
    expected, actual = load_file(str(expected_dir / name)), load_file(str(actual_dir / name))
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    expected_meta, actual_meta = metadata(expected_dir / name), metadata(actual_dir / name)
    expected_log, actual_log = log_records(expected_dir), log_records(actual_dir)
    if extra_evaluation is not None:
        def drop(records):
            return [{k: v for k, v in r.items() if k != "best"} for r in records
                    if not (r["kind"] == "eval" and r["step"] == extra_evaluation)]

        actual_meta["evaluations"], expected_meta["evaluations"] = drop(actual_meta["evaluations"]), drop(expected_meta["evaluations"])
        actual_log, expected_log = drop(actual_log), drop(expected_log)
        for meta in (actual_meta, expected_meta):
            del meta["progress"]["best_val_bpc"], meta["progress"]["best_step"]
    assert actual_meta == expected_meta
    assert actual_log == expected_log


# ---- the forum toy -----------------------------------------------------------------------

def test_repeated_sentence_reaches_near_zero_loss():
    """One sentence repeated, a 2-layer LSTM with hidden size 20, next-character prediction."""
    text = "hello world, this is a tiny recurrent network. " * 4
    vocabulary = data.Vocabulary.of(text)
    ids = vocabulary.encode(text)
    x = torch.nn.functional.one_hot(ids[:-1], len(vocabulary)).float().unsqueeze(1)  # [T, 1, V]
    lstm = rnnkit.LSTM(len(vocabulary), 20, num_layers=2)
    head = torch.nn.Linear(20, len(vocabulary))
    optimizer = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=0.02)
    for _ in range(300):
        y, _ = lstm(x)
        loss = torch.nn.functional.cross_entropy(head(y[:, 0]), ids[1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05


# ---- train and sample --------------------------------------------------------------------

def test_train_writes_a_checkpoint_that_sample_reads_deterministically(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 8, *SMALL)
    assert status == 0, err
    assert set(snapshot(out)) == {"checkpoint.safetensors", "best.safetensors", "config.json", "vocab.json",
                                  "log.jsonl", "curve.png"}
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "train"] == list(range(1, 9))
    evaluations = [r for r in log if r["kind"] == "eval"]
    assert [r["step"] for r in evaluations] == [4, 8]
    assert evaluations[-1]["val_bpc"] < evaluations[0]["val_bpc"]
    # the one training number: the mean of the steps since the previous evaluation
    steps = [r for r in log if r["kind"] == "train"]
    assert evaluations[1]["train_bpc"] == pytest.approx(sum(r["bpc"] for r in steps[4:8]) / 4)
    assert evaluations[1]["train_steps"] == 4
    weights = load_file(str(out / "checkpoint.safetensors"))
    assert "model.rnn.weight_ih_l0" in weights and "optimizer.0.exp_avg" in weights  # torch.nn names
    assert "train 5." in err or "train 4." in err or "train 3." in err  # the labelled training number
    assert "mean of the last 4 steps" in err

    first = run(capsys, "sample", out, "--prime", "the ", "--length", 40, "--seed", 3)
    again = run(capsys, "sample", out, "--prime", "the ", "--length", 40, "--seed", 3)
    other = run(capsys, "sample", out, "--prime", "the ", "--length", 40, "--seed", 4)
    assert first[0] == 0 and first == again
    assert first[1].startswith("the ") and len(first[1].rstrip("\n")) == 44
    assert other[1] != first[1]


@pytest.mark.parametrize("options", [
    [],
    ["--cell", "gru", "--layers", "2", "--dropout", "0.1", "--zoneout", "0.1"],
    ["--schedule", "cosine", "--warmup-steps", "3", "--final-lr-fraction", "0.2", "--dropout", "0.1"],
], ids=["lstm", "gru-dropout-zoneout", "cosine-warmup"])
def test_resume_gives_the_uninterrupted_run(tmp_path, corpus, capsys, options):
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ["--text", corpus, *SMALL, *options]
    if "cosine" in options:
        common += ["--decay-steps", "10"]  # the schedule's horizon, the same for both runs
    assert run(capsys, "train", "--out", whole, "--steps", 10, *common)[0] == 0
    assert run(capsys, "train", "--out", split, "--steps", 5, *common)[0] == 0  # stops between evaluations
    status, _, err = run(capsys, "train", "--out", split, "--steps", 10, "--resume")
    assert status == 0, err
    assert_same_run(whole, split, extra_evaluation=5)
    evaluations = [r["step"] for r in log_records(split) if r["kind"] == "eval"]
    assert evaluations == [4, 5, 8, 10]


def test_resume_when_already_done_does_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)[0] == 0
    before = snapshot(out)
    status, _, err = run(capsys, "train", "--out", out, "--steps", 4, "--resume")
    assert status == 0 and "nothing to do" in err
    assert snapshot(out) == before
    status, _, err = run(capsys, "train", "--out", out, "--steps", 3, "--resume", "--eval-every", 1)
    assert status == 0 and "nothing to do" in err
    assert snapshot(out) == before  # a setting that would apply to steps that do not run is not saved


def test_an_out_that_cannot_be_created_is_named(tmp_path, corpus, capsys):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "run"
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 2, *SMALL)
    assert_one_line_error(status, err)
    assert err.startswith(f"rnnkit: error: --out {out}: cannot create the directory (")


# ---- the learning-rate schedule ----------------------------------------------------------

def test_schedule_warmup_then_cosine():
    config = train.TrainConfig(lr=1.0, schedule="cosine", warmup_steps=4, final_lr_fraction=0.1, decay_steps=14)
    rates = [train.learning_rate(config, step) for step in range(1, 20)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up, the 4th update at the full rate
    assert rates[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert rates[13] == pytest.approx(0.1) and rates[18] == pytest.approx(0.1)  # then constant at the floor
    assert all(a >= b for a, b in zip(rates[3:], rates[4:]))
    constant = train.TrainConfig(lr=0.5, warmup_steps=2)
    assert [train.learning_rate(constant, s) for s in (1, 2, 3, 100)] == [0.25, 0.5, 0.5, 0.5]
    assert train.learning_rate(train.TrainConfig(), 1) == train.TrainConfig().lr  # the default: constant, exact


def test_the_log_records_the_learning_rate_of_every_step(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    flags = ["--schedule", "cosine", "--warmup-steps", "2", "--final-lr-fraction", "0.5", "--lr", "0.01"]
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 6, *SMALL, *flags)[0] == 0
    config = train.TrainConfig(**json.loads((out / "config.json").read_text())["training"])
    assert config.decay_steps == 6  # the first run's --steps
    rates = [r["lr"] for r in log_records(out) if r["kind"] == "train"]
    assert rates == [train.learning_rate(config, s) for s in range(1, 7)]
    assert rates[0] == 0.005 and rates[-1] == pytest.approx(0.005)


# ---- interruption: SIGINT / SIGTERM checkpoint the step in progress ----------------------

@pytest.fixture
def signal_at_step(monkeypatch):
    """Deliver real signals to this process while training step ``step`` runs."""

    def arm(number, step, times=1):
        calls = []
        original = train.train_step

        def train_step(*args, **kwargs):
            calls.append(1)
            if len(calls) == step:
                for _ in range(times):
                    os.kill(os.getpid(), number)
            return original(*args, **kwargs)

        monkeypatch.setattr(train, "train_step", train_step)

    return arm


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_checkpoints_the_current_step_and_resume_is_exact(tmp_path, corpus, capsys, signal_at_step, number):
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ["--text", corpus, *SMALL, "--dropout", "0.1", "--schedule", "cosine", "--warmup-steps", "2",
              "--decay-steps", "10"]
    assert run(capsys, "train", "--out", whole, "--steps", 10, *common)[0] == 0
    signal_at_step(number, 3)
    status, _, err = run(capsys, "train", "--out", split, "--steps", 10, *common)
    assert status == 128 + number, err
    assert "--resume" in err and "step 3" in err
    progress = json.loads(safe_open(str(split / "checkpoint.safetensors"), "pt").metadata()["progress"])
    assert progress["step"] == 3  # the step that was running, before the first evaluation (4)
    assert [r["step"] for r in log_records(split)] == [1, 2, 3]
    status, _, err = run(capsys, "train", "--out", split, "--steps", 10, "--resume")
    assert status == 0, err
    assert_same_run(whole, split)


def test_a_second_signal_stops_at_once_keeping_the_last_checkpoint(tmp_path, corpus, capsys, signal_at_step):
    out = tmp_path / "run"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)[0] == 0
    before = load_file(str(out / "checkpoint.safetensors"))
    signal_at_step(signal.SIGINT, 2, times=2)
    status, _, err = run(capsys, "train", "--out", out, "--steps", 8, "--resume")
    assert status == 130 and "step 4" in err
    after = load_file(str(out / "checkpoint.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def _wait_for_steps(process, log: Path, steps: int, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"training ended early: {process.stderr.read()[-2000:]}")
        if log.exists() and sum(1 for line in log.read_text().splitlines() if '"train"' in line) >= steps:
            return
        time.sleep(0.02)
    process.kill()
    raise AssertionError("training made no progress")


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_killed_process_resumes_exactly(tmp_path, corpus, capsys, number):
    """A real signal to a `python -m rnnkit train` process at an arbitrary moment, then --resume:
    the weights, optimizer, generator, history and log equal those of an uninterrupted run."""
    split, whole = tmp_path / "split", tmp_path / "whole"
    common = ["--text", corpus, *SMALL, "--dropout", "0.1"]
    process = subprocess.Popen([sys.executable, "-m", "rnnkit", "train", "--out", str(split), "--steps", "100000",
                                *map(str, common)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    _wait_for_steps(process, split / "log.jsonl", 6)
    process.send_signal(number)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == (-signal.SIGKILL if number == signal.SIGKILL else 128 + number), stderr[-2000:]
    if number == signal.SIGKILL:
        # a write killed before its rename leaves a temporary; plant one from a process that is gone
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        (split / f".checkpoint.safetensors.tmp-{int(gone.stdout)}").write_bytes(b"half a checkpoint")
    else:
        assert "saved the checkpoint of step" in stderr
    stopped = json.loads(safe_open(str(split / "checkpoint.safetensors"), "pt").metadata()["progress"])["step"]
    target = stopped + 3
    status, _, err = run(capsys, "train", "--out", split, "--steps", target, "--resume")
    assert status == 0, err
    assert run(capsys, "train", "--out", whole, "--steps", target, *common)[0] == 0
    assert_same_run(whole, split)
    assert not [p.name for p in split.iterdir() if ".tmp-" in p.name]


# ---- issue 18 item 8: stale temporaries and the log after a kill -------------------------

def test_stale_temporaries_are_removed_on_start(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)[0] == 0
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    stale = [f".checkpoint.safetensors.tmp-{dead}", f".best.safetensors.tmp-{dead}", f".log.jsonl.tmp-{dead}",
             f".curve.png.tmp-{os.getpid()}"]
    # a live PID (1, or a PID reused since the write was killed: containers): stale too, since the
    # run holds the directory's lock and only a training run writes these files (it stayed for good)
    reused = f".config.json.tmp-{os.getppid()}"
    for name in stale + [reused]:
        (out / name).write_bytes(b"partial")
    status, _, err = run(capsys, "train", "--out", out, "--steps", 5, "--resume")
    assert status == 0, err
    assert "removed 5 temporary file(s)" in err
    assert not {p.name for p in out.iterdir()} & set(stale + [reused])
    # without the lock only the PID tells: a running process's write in progress is left alone
    (out / reused).write_bytes(b"partial")
    (out / stale[0]).write_bytes(b"partial")
    assert checkpoint.remove_stale_temporaries(out) == [stale[0]]
    assert (out / reused).exists()
    assert checkpoint.remove_stale_temporaries(tmp_path / "missing") == []


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the command catches it."""


def test_the_log_is_rebuilt_from_the_checkpoint_after_a_kill(tmp_path, corpus, capsys, monkeypatch):
    """Killed after the checkpoint of step 8 landed but before its evaluation reached log.jsonl
    (and with a cut line and the lines of steps past the checkpoint in the log)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ["--text", corpus, *SMALL]
    assert run(capsys, "train", "--out", whole, "--steps", 10, *common)[0] == 0
    original = train.append_log

    def append_log(directory, records):
        if records[0]["kind"] == "eval" and records[0]["step"] == 8:
            raise Killed
        original(directory, records)

    monkeypatch.setattr(train, "append_log", append_log)
    with pytest.raises(Killed):
        cli.main([str(a) for a in ["train", "--out", split, "--steps", 10, *common]])
    monkeypatch.setattr(train, "append_log", original)
    capsys.readouterr()
    assert [r["step"] for r in log_records(split) if r["kind"] == "eval"] == [4]  # step 8's line is lost
    with open(split / "log.jsonl", "a") as log:
        log.write(json.dumps({"kind": "train", "step": 9, "loss": 1.0, "bpc": 1.4, "lr": 0.003}) + "\n")
        log.write('{"kind": "train", "st')  # a line cut by the kill
    status, _, err = run(capsys, "train", "--out", split, "--steps", 10, "--resume")
    assert status == 0, err
    assert_same_run(whole, split)


def test_rewrite_log_leaves_a_consistent_log_alone(tmp_path):
    record = history.History([1.0, 0.5], [0.1, 0.1], [{"kind": "eval", "step": 2, "val_bpc": 1.0}])
    assert history.rewrite_log(tmp_path, record) is True
    assert history.rewrite_log(tmp_path, record) is False
    assert [r["step"] for r in history.read_log(tmp_path)] == [1, 2, 2]


# ---- keep-best and the curve -------------------------------------------------------------

def test_best_checkpoint_keeps_the_lowest_validation(tmp_path, corpus, capsys, monkeypatch):
    scores = iter([3.0, 2.0, 2.5])
    monkeypatch.setattr(train, "evaluate", lambda *args, **kwargs: next(scores))
    out = tmp_path / "run"
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 12, *SMALL)
    assert status == 0, err
    evaluations = [r for r in log_records(out) if r["kind"] == "eval"]
    assert [(r["step"], r["best"]) for r in evaluations] == [(4, True), (8, True), (12, False)]
    progress = lambda name: json.loads(safe_open(str(out / name), "pt").metadata()["progress"])  # noqa: E731
    assert progress("best.safetensors")["step"] == 8 and progress("checkpoint.safetensors")["step"] == 12
    assert progress("checkpoint.safetensors")["best_step"] == 8
    assert "best 2.000 at step 8" in err
    best, latest = load_file(str(out / "best.safetensors")), load_file(str(out / "checkpoint.safetensors"))
    assert not torch.equal(best["model.rnn.weight_hh_l0"], latest["model.rnn.weight_hh_l0"])
    assert run(capsys, "sample", out, "--best", "--length", 20)[0] == 0


def test_the_curve_plots_every_training_step_and_the_validation_points(tmp_path, corpus, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    drawn = []
    original = history.plot_curve

    def plot_curve(*args, **kwargs):
        result = original(*args, **kwargs)
        drawn.append(result[0])
        return result

    monkeypatch.setattr(history, "plot_curve", plot_curve)
    out = tmp_path / "run"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 10, *SMALL)[0] == 0
    last = drawn[-1]
    log = log_records(out)
    training = [r for r in log if r["kind"] == "train"]
    validation = [r for r in log if r["kind"] == "eval"]
    assert last["series"][history.TRAINING_LABEL] == ([r["step"] for r in training], [r["bpc"] for r in training])
    assert last["series"][history.VALIDATION_LABEL] == ([r["step"] for r in validation], [r["val_bpc"] for r in validation])
    assert len(last["series"][history.TRAINING_LABEL][0]) == 10  # one point per step, not per evaluation
    assert last["legend"] == [history.TRAINING_LABEL, history.VALIDATION_LABEL]
    assert last["xlabel"] == "step" and last["ylabel"] == "bits per character"
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- device and precision ----------------------------------------------------------------

def test_bf16_trains_and_samples(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL, "--precision", "bf16",
                         "--backend", "reference", "--device", "cpu")
    assert status == 0, err
    assert json.loads((out / "config.json").read_text())["training"]["precision"] == "bf16"
    assert math.isfinite([r for r in log_records(out) if r["kind"] == "eval"][-1]["val_bpc"])
    assert run(capsys, "sample", out, "--length", 10, "--backend", "reference")[0] == 0


@pytest.mark.parametrize("has_bf16, noted", [(False, True), (True, False), (None, False)], ids=["no-bf16", "bf16", "unknown"])
def test_bf16_on_a_cpu_without_bf16_instructions_is_noted(tmp_path, corpus, capsys, monkeypatch, has_bf16, noted):
    from rnnkit.app import machine

    monkeypatch.setattr(machine, "has_bf16", lambda: has_bf16)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", "--steps", 1, *SMALL,
                         "--precision", "bf16", "--backend", "reference", "--device", "cpu")
    assert status == 0, err
    assert ("no bfloat16 instructions" in err) == noted


def test_bf16_that_the_backend_cannot_run_is_one_line(tmp_path, corpus, capsys, monkeypatch):
    """torch's oneDNN LSTM has no bfloat16 kernel on CPUs without bf16 instructions (emulated here: oneDNN's
    probe says no): --backend native with --precision bf16 is refused in one line, naming the backend and the
    dtype, before training (the check's message on every CPU; it asserted --precision's wording, which only a
    CPU with the instructions never reached)."""
    from rnnkit import native

    monkeypatch.setitem(native._LOW, torch.bfloat16, lambda: False)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", "--steps", 2, *SMALL,
                         "--precision", "bf16", "--backend", "native", "--device", "cpu")
    assert_one_line_error(status, err)
    assert "--backend" in err and "native" in err and "bfloat16" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda(tmp_path, corpus, capsys):
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", "--device", "cuda")
    assert_one_line_error(status, err)
    assert "--device cuda" in err and not (tmp_path / "run").exists()


# ---- errors: one line, non-zero, nothing lost ---------------------------------------------

@pytest.fixture
def trained(tmp_path, corpus, capsys):
    out = tmp_path / "trained"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)[0] == 0
    return out


def test_missing_corpus(tmp_path, capsys):
    status, _, err = run(capsys, "train", "--text", tmp_path / "nope.txt", "--out", tmp_path / "run")
    assert_one_line_error(status, err)
    assert "no such file" in err and not (tmp_path / "run").exists()


def test_empty_corpus(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    status, _, err = run(capsys, "train", "--text", empty, "--out", tmp_path / "run")
    assert_one_line_error(status, err)
    assert "empty" in err


def test_a_whitespace_corpus_is_not_called_empty(tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n" * 10000)
    status, _, err = run(capsys, "train", "--text", blank, "--out", tmp_path / "run")
    assert_one_line_error(status, err)
    assert "the file holds only whitespace (20,000 bytes)" in err


def test_corpus_too_small_for_the_batch(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("abcabcabc" * 10)
    status, _, err = run(capsys, "train", "--text", small, "--out", tmp_path / "run", "--batch", 64)
    assert_one_line_error(status, err)
    assert "--batch" in err


def _flip_data_bytes(data: bytes) -> bytes:
    """50 bytes of the tensor data inverted (the header intact: safetensors loads it)."""
    start, damaged = 8 + int.from_bytes(data[:8], "little"), bytearray(data)
    for k in range(50):
        damaged[start + (k * 7919) % (len(data) - start)] ^= 0xFF
    return bytes(damaged)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "data-bytes"])
@pytest.mark.parametrize("command", ["sample", "resume", "eval"])
def test_damaged_checkpoint(trained, capsys, damage, command):
    """One line and status 1, the run's files untouched; flipped bytes in the tensor data (which
    safetensors loads) too: eval reported 8.09 bits/char for 5.35 and resume diverged."""
    path = trained / "checkpoint.safetensors"
    data = path.read_bytes()
    path.write_bytes({"garbage": lambda: b"not a checkpoint at all", "truncated": lambda: data[: len(data) // 2],
                      "data-bytes": lambda: _flip_data_bytes(data)}[damage]())
    before = snapshot(trained)
    argv = {"sample": ["sample", trained], "eval": ["eval", trained],
            "resume": ["train", "--out", trained, "--steps", 8, "--resume"]}[command]
    status, _, err = run(capsys, *argv)
    assert_one_line_error(status, err)
    assert "checkpoint" in err
    assert snapshot(trained) == before


def test_resume_with_another_configuration(trained, corpus, capsys):
    before = snapshot(trained)
    for flags, word in ((["--hidden", 32], "--hidden 32"), (["--schedule", "cosine"], "--schedule cosine"),
                        (["--precision", "bf16"], "--precision bf16")):
        status, _, err = run(capsys, "train", "--text", corpus, "--out", trained, "--steps", 8, "--resume", *flags)
        assert_one_line_error(status, err)
        assert word in err
    assert snapshot(trained) == before


def test_resume_with_another_corpus(trained, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text("a different text entirely. " * 100)
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--text", other, "--out", trained, "--steps", 8, "--resume")
    assert_one_line_error(status, err)
    assert snapshot(trained) == before


@pytest.mark.parametrize("keep", ["checkpoint.safetensors", "best.safetensors"])
def test_fresh_run_refuses_to_overwrite_a_checkpoint(trained, corpus, capsys, keep):
    for name in {"checkpoint.safetensors", "best.safetensors"} - {keep}:
        (trained / name).unlink()
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", trained, "--steps", 4)
    assert_one_line_error(status, err)
    assert "--resume" in err and keep in err
    assert snapshot(trained) == before


def test_resume_without_a_checkpoint(tmp_path, capsys):
    status, _, err = run(capsys, "train", "--out", tmp_path / "empty", "--resume")
    assert_one_line_error(status, err)


@pytest.mark.parametrize("argv", [
    ["train", "--cell", "lsmt"],
    ["train", "--zoneout", "1.5"],
    ["train", "--hidden", "0"],
    ["train", "--backend", "nope"],
    ["train", "--device", "tpu"],
    ["train", "--precision", "fp16"],
    ["train", "--schedule", "linear"],
    ["train", "--final-lr-fraction", "1.5"],
    ["train", "--no-such-flag"],
    ["sample", "DIR", "--temperature", "-1"],
    ["train", "--hidden", "99999999999999999999"],
    ["train", "--embedding", "1000000000"],
    ["train", "--layers", "99999999999999999999"],
    ["train", "--proj", "99999999999"],
    ["train", "--threads", "100000"],
    ["sample", "DIR", "--threads", "99999999999999999999"],
    ["eval", "DIR", "--threads", "100000"],
    ["bench", "--threads", "100000"],
], ids=["cell", "zoneout", "hidden", "backend", "device", "precision", "schedule", "final-lr", "unknown-flag",
        "temperature", "huge-hidden", "huge-embedding", "huge-layers", "huge-proj", "train-threads", "sample-threads",
        "eval-threads", "bench-threads"])
def test_bad_flag_values(tmp_path, capsys, argv):
    status, _, err = run(capsys, *[str(tmp_path) if a == "DIR" else a for a in argv])
    assert_one_line_error(status, err)


@pytest.mark.parametrize("flags, word", [
    (["--final-lr-fraction", "0.1"], "--final-lr-fraction"),
    (["--decay-steps", "10"], "--decay-steps"),
    (["--schedule", "cosine", "--warmup-steps", "10", "--decay-steps", "10"], "--decay-steps"),
], ids=["final-lr-without-cosine", "decay-without-cosine", "warmup-past-decay"])
def test_schedule_flags_that_do_not_fit(tmp_path, corpus, capsys, flags, word):
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", *SMALL, *flags)
    assert_one_line_error(status, err)
    assert word in err and not (tmp_path / "run").exists()


def test_a_model_larger_than_the_memory_is_refused_before_it_is_allocated(tmp_path, corpus, capsys, monkeypatch):
    """Sizes each within their flag's range whose parameters exceed the machine's memory: one line,
    counted on the meta device, nothing allocated and nothing written."""
    from rnnkit.app.charlm import model

    monkeypatch.setattr(model, "memory_bytes", lambda: 2**20)  # 1 MiB: a 256-wide LSTM's 4 x 256 x 320 floats exceed it
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", *SMALL, "--hidden", 256)
    assert_one_line_error(status, err)
    assert "does not fit in memory" in err and "parameters alone take" in err
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "huge", *SMALL, "--hidden", 16_777_216,
                         "--layers", 1024)  # the largest sizes the flags take: counted, not allocated
    assert_one_line_error(status, err)
    assert "does not fit in memory" in err


def test_a_non_finite_validation_stops_the_run_and_is_never_the_best(tmp_path, corpus, capsys, monkeypatch):
    """A validation that overflows (finite training loss) ends the run with one line, as a non-finite loss
    does: it is not taken as the best (nothing is lower than NaN), nor written into the log as NaN, which
    strict JSON refuses; the last checkpoint stays as it was and resumes."""
    scores = iter([3.0, float("nan")])
    monkeypatch.setattr(train, "evaluate", lambda *args, **kwargs: next(scores))
    out = tmp_path / "run"
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 12, *SMALL)
    assert status == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("rnnkit: error: the validation bits/char became nan at step 8 ")
    for line in (out / "log.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in the log"))
    progress = json.loads(safe_open(str(out / "checkpoint.safetensors"), "pt").metadata()["progress"])
    assert progress["step"] == 4 and progress["best_val_bpc"] == 3.0
    monkeypatch.setattr(train, "evaluate", lambda *args, **kwargs: 2.5)
    status, _, err = run(capsys, "train", "--out", out, "--resume", "--steps", 8)
    assert status == 0, err


def test_option_the_cell_does_not_have(tmp_path, corpus, capsys):
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", "--cell", "gru", "--peephole", *SMALL)
    assert_one_line_error(status, err)
    assert "--peephole" in err


def test_sample_errors(trained, tmp_path, capsys):
    assert_one_line_error(*run(capsys, "sample", tmp_path / "missing")[::2])
    status, _, err = run(capsys, "sample", trained, "--prime", "€")
    assert_one_line_error(status, err)
    assert "vocabulary" in err


def test_eval_scores_fp32_bf16_and_int8(trained, capsys):
    """The validation bits/char of a checkpoint three ways: int8 close to fp32; what train logged."""
    scores = {}
    for precision in ("fp32", "bf16", "int8"):
        status, out, err = run(capsys, "eval", trained, "--precision", precision)
        assert status == 0, err
        assert f"({precision}," in out
        scores[precision] = float(out.split("bits/char")[1].split()[0])
    log = [json.loads(line) for line in (trained / "log.jsonl").read_text().splitlines()]
    last = [r for r in log if r["kind"] == "eval"][-1]
    assert scores["fp32"] != scores["int8"]  # it did run the int8 model
    assert abs(scores["int8"] - scores["fp32"]) < 0.02 and abs(scores["bf16"] - scores["fp32"]) < 0.02
    status, out, _ = run(capsys, "eval", trained, "--chars", 300)  # what training scored (--eval-chars 300)
    assert status == 0 and float(out.split("bits/char")[1].split()[0]) == pytest.approx(last["val_bpc"], abs=1e-4)
    status, out, _ = run(capsys, "sample", trained, "--prime", "the ", "--length", 20, "--int8")
    assert status == 0 and out.startswith("the ")


def test_int8_under_device_auto_runs_on_the_cpu_where_cuda_is_there(trained, capsys, monkeypatch):
    """--device auto picks CUDA where there is one; int8 runs on the CPU's kernels only, so with
    --int8 / --precision int8 auto means the CPU (docs/cli.md's example works as written there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    expected = run(capsys, "eval", trained, "--precision", "int8", "--device", "cpu")
    assert expected[0] == 0, expected[2]
    assert run(capsys, "eval", trained, "--precision", "int8") == expected
    status, out, err = run(capsys, "sample", trained, "--int8", "--length", 30)
    assert status == 0 and out == run(capsys, "sample", trained, "--int8", "--length", 30, "--device", "cpu")[1], err


def test_sample_writes_the_text_as_it_is_drawn(trained, capsys, monkeypatch):
    """rnnkit sample prints the prime, then each line (or 256 characters) as it is drawn, not the whole
    text at the end; what it prints is `sample.sample`'s text, the same for a seed."""
    from rnnkit.app.charlm import sample

    pieces = []
    original = sample.generate

    def recorded(*args, **kwargs):
        for piece in original(*args, **kwargs):
            pieces.append(piece)
            yield piece

    monkeypatch.setattr(sample, "generate", recorded)
    status, out, err = run(capsys, "sample", trained, "--prime", "the ", "--length", 600, "--seed", 3)
    assert status == 0, err
    assert pieces[0] == "the " and out in ("".join(pieces), "".join(pieces) + "\n")
    assert all(len(p) <= 256 and ("\n" not in p[:-1]) for p in pieces[1:]) and len(pieces) >= 4
    assert all(p.endswith("\n") or len(p) == 256 for p in pieces[1:-1])
    network, saved = cli._trained(cli.build_parser().parse_args(["sample", str(trained)]))
    assert "".join(pieces) == sample.sample(network, saved.vocabulary, "the ", 600, 0.8, 3, "fp32")


def test_eval_errors(trained, tmp_path, capsys):
    assert_one_line_error(*run(capsys, "eval", tmp_path / "missing")[::2])
    other = tmp_path / "other.txt"
    other.write_text("a different corpus " * 200, encoding="utf-8")
    status, _, err = run(capsys, "eval", trained, "--text", other)
    assert_one_line_error(status, err)
    assert "not the corpus this run was trained on" in err


def test_python_m_rnnkit_error_has_no_traceback(tmp_path):
    """`python -m rnnkit`, in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "rnnkit", "train", "--text", str(tmp_path / "missing.txt")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr


# ---- doctor and bench --------------------------------------------------------------------

def test_doctor(capsys):
    status, out, _ = run(capsys, "doctor")
    assert status == 0
    for word in ("rnnkit", "torch", "numpy", "python", "threads", "reference", "safetensors", "int8", "bf16"):
        assert word in out


@pytest.mark.parametrize("placement, says", [
    (None, "declined"), ("canonical", "as the spec's layout"), ("own", "its own way"), ("off", "disabled"),
    ("no cudnn", "not available"),
])
def test_doctor_says_how_cudnn_places_a_plain_stack(placement, says, monkeypatch):
    """rnnkit doctor's cudnn line, on a GPU machine: cuDNN's version and whether it reads rnnkit's
    buffers in place, in its own placement or the spec's layout (cuDNN asked through stand-ins here)."""
    import rnnkit.native as native

    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None if placement == "no cudnn" else 91900)
    monkeypatch.setattr(torch.backends.cudnn, "enabled", placement != "off")

    def ask(spec, layout, device, dtype):
        if placement is None:
            return None
        offsets = [e.offset for e in layout.entries]
        return (tuple(offsets if placement == "canonical" else reversed(offsets)), layout.numel)

    monkeypatch.setattr(native, "cudnn_placement", ask)
    line = native.cudnn_report()
    assert says in line and (placement == "no cudnn" or line.startswith("9.19.0")), line


def test_doctor_reports_the_fused_backend_as_it_found_it():
    """In a fresh process (the kernels built, not loaded) the backend's line says so: it said
    "loaded", having loaded them itself to name their GEMM kernels."""
    import rnnkit

    rnnkit.quantized.int8_kernel()  # built, if need be, in this process
    done = subprocess.run([sys.executable, "-m", "rnnkit", "doctor"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.split()[:1] == ["fused"])
    assert line.split(None, 1)[1].startswith("built (in "), line


def test_doctor_names_the_int8_kernels_that_run(capsys):
    import rnnkit

    expected = rnnkit.quantized.int8_kernel()  # builds the fused kernels if need be: the doctor then asks them
    status, out, _ = run(capsys, "doctor")
    line = next(line for line in out.splitlines() if line.startswith("int8"))
    assert f"{expected} kernels (in use)" in line and rnnkit.quantized.INT8_KERNELS[expected] in line


@pytest.mark.parametrize("prefix, ask, table", [("bf16", "bf16_kernel", "BF16_KERNELS"),
                                                ("fp32", "fp32_gemm", "FP32_GEMMS")])
def test_doctor_names_the_fused_gemm_kernels_that_run(capsys, prefix, ask, table):
    from rnnkit import fused

    expected = getattr(fused, ask)()  # builds the fused kernels if need be: the doctor then asks them
    status, out, _ = run(capsys, "doctor")
    line = next(line for line in out.splitlines() if line.startswith(prefix))
    assert f"{expected} kernels (in use)" in line and getattr(fused, table)[expected] in line


def test_expected_bf16_kernel():
    from rnnkit.app.machine import expected_bf16_kernel

    assert expected_bf16_kernel(["avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"], "AVX512") == "avx512-bf16"
    amx = ["avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert expected_bf16_kernel(amx, "AVX512") == "amx-bf16"
    assert expected_bf16_kernel(amx[:-1], "AVX512") == "avx512-bf16"
    assert expected_bf16_kernel(["avx2", "avx512f", "avx512bw", "avx512vl"], "AVX512") == "none"
    assert expected_bf16_kernel(["avx2", "fma"], "AVX2") == "none"
    assert expected_bf16_kernel(None, "AVX2") == "none"


def test_expected_int8_kernel():
    from rnnkit.app.machine import expected_int8_kernel

    assert expected_int8_kernel(["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"], "AVX512") == "avx512-vnni"
    amx = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"]
    assert expected_int8_kernel(amx, "AVX512") == "amx-int8"
    assert expected_int8_kernel(amx[:-1], "AVX512") == "avx512-vnni"
    assert expected_int8_kernel(["avx2", "fma", "avx512f", "avx512_vnni"], "AVX512") == "avx2"  # no VL: no 256-bit vpdpbusd
    assert expected_int8_kernel(["avx2", "fma", "avx_vnni"], "AVX2") == "avx-vnni"
    assert expected_int8_kernel(["avx2", "fma"], "AVX2") == "avx2"
    assert expected_int8_kernel(["avx2", "avx_vnni"], "DEFAULT") == "scalar"  # torch without AVX2: a build without it
    assert expected_int8_kernel(None, "AVX2") == "avx2"


def test_bench_is_wired(capsys):
    status, out, _ = run(capsys, "bench", "--help")
    assert status == 0 and "usage: rnnkit bench" in out and "--step" in out


def test_machine_reads_the_cpu_model_and_its_simd_features(monkeypatch):
    from rnnkit.app import machine

    class CpuInfo:
        text = "processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse avx2 fma avx512f avx512_bf16 sse4_2\n"

        def __init__(self, path):
            assert str(path) == "/proc/cpuinfo"

        def read_text(self):
            if self.text is None:
                raise OSError("no such file")
            return self.text

    monkeypatch.setattr(machine, "Path", CpuInfo)
    assert machine.cpu_model() == "Some CPU 9000"
    assert machine.cpu_flags() == ["avx2", "fma", "avx512f", "avx512_bf16"]
    assert machine.has_bf16() is True
    CpuInfo.text = "model name\t: Old CPU\nflags\t: fpu sse avx2\n"
    assert machine.cpu_flags() == ["avx2"] and machine.has_bf16() is False
    CpuInfo.text = None  # not Linux: unknown, not "absent"
    assert machine.cpu_flags() is None and machine.has_bf16() is None and machine.cpu_model()


def test_expected_fp32_gemm():
    from rnnkit.app.machine import expected_fp32_gemm

    assert expected_fp32_gemm(["avx2", "fma", "avx512f", "avx512bw"], "AVX512", "AuthenticAMD") == "avx512"
    assert expected_fp32_gemm(["avx2", "fma", "avx512f", "avx512bw"], "AVX512", "GenuineIntel") == "avx512-mkl"
    assert expected_fp32_gemm(["avx2", "fma", "avx512f", "avx512bw"], "AVX512", "HygonGenuine") == "avx512"
    assert expected_fp32_gemm(["avx2", "fma", "avx512f", "avx512bw"], "AVX512", "") == "avx512"  # unknown
    assert expected_fp32_gemm(["avx2", "fma"], "AVX2") == "avx2"
    assert expected_fp32_gemm(["avx2"], "AVX2") == "mkl"  # no FMA: the own AVX2 kernel does not run
    assert expected_fp32_gemm(None, "DEFAULT") == "mkl"


# ---- a run's files belong together; damaged ones are one line ---------------------------

def _other_run(tmp_path, capsys, corpus, *flags):
    out = tmp_path / "other"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL, *flags)[0] == 0
    return out


@pytest.mark.parametrize("flags, word", [(["--lr", "0.01"], "--lr"), (["--batch", "2"], "--batch"),
                                         (["--seed", "3"], "--seed")], ids=["lr", "batch", "seed"])
def test_resume_refuses_another_runs_checkpoint(trained, corpus, tmp_path, capsys, flags, word):
    """A checkpoint copied in from a run of the same model but other training flags: before,
    --lr / --seed continued silently as this run, --batch failed with a traceback."""
    other = _other_run(tmp_path, capsys, corpus, *flags)
    (trained / "checkpoint.safetensors").write_bytes((other / "checkpoint.safetensors").read_bytes())
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--out", trained, "--steps", 8, "--resume")
    assert_one_line_error(status, err)
    assert "belongs to another run" in err and word in err
    assert snapshot(trained) == before


def test_sample_refuses_a_checkpoint_of_another_corpus(trained, tmp_path, capsys):
    """Same characters, same model: the weights load, but their ids mean other characters."""
    text = (trained / "config.json").read_text()
    source = json.loads(text)["corpus"]["source"]
    shuffled = tmp_path / "shuffled.txt"
    shuffled.write_text("".join(reversed(Path(source).read_text(encoding="utf-8"))), encoding="utf-8")
    other = _other_run(tmp_path, capsys, shuffled)
    assert json.loads((other / "vocab.json").read_text()) == json.loads((trained / "vocab.json").read_text())
    (trained / "best.safetensors").write_bytes((other / "best.safetensors").read_bytes())
    for argv in (["sample", trained, "--best"], ["eval", trained, "--best"]):
        status, _, err = run(capsys, *argv)
        assert_one_line_error(status, err)
        assert "another corpus" in err
    assert run(capsys, "sample", trained, "--length", 5)[0] == 0  # its own checkpoint still samples


def _without_identity(path: Path) -> None:
    """Rewrite a checkpoint as rnnkit wrote it before checkpoints named their run."""
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        meta = {k: v for k, v in handle.metadata().items() if k != "run"}
    save_file(load_file(str(path)), str(path), metadata=meta)


def test_an_older_checkpoint_of_another_batch_is_one_line(trained, corpus, tmp_path, capsys):
    other = _other_run(tmp_path, capsys, corpus, "--batch", "2")
    _without_identity(other / "checkpoint.safetensors")
    (trained / "checkpoint.safetensors").write_bytes((other / "checkpoint.safetensors").read_bytes())
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--out", trained, "--steps", 8, "--resume")
    assert_one_line_error(status, err)
    assert "--batch 4" in err and "carried state" in err
    assert snapshot(trained) == before


def test_an_older_checkpoint_of_another_model_names_the_mismatch(trained, tmp_path, capsys):
    _without_identity(trained / "checkpoint.safetensors")
    config = json.loads((trained / "config.json").read_text())
    config["model"]["hidden"] = 20
    (trained / "config.json").write_text(json.dumps(config))
    status, _, err = run(capsys, "sample", trained)
    assert_one_line_error(status, err)
    assert "size mismatch" in err  # load_state_dict's detail, not its heading


@pytest.mark.parametrize("files", [["config.json"], ["log.jsonl", "curve.png"], ["vocab.json"]],
                         ids=["config", "log-and-curve", "vocab"])
def test_a_fresh_run_keeps_files_it_did_not_write(tmp_path, corpus, capsys, files):
    out = tmp_path / "mine"
    out.mkdir()
    for name in files:
        (out / name).write_text(f"the user's own {name}\n")
    before = snapshot(out)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)
    assert_one_line_error(status, err)
    assert "no rnnkit run wrote" in err and files[0] in err
    assert snapshot(out) == before


def test_a_fresh_run_replaces_a_run_that_never_checkpointed(tmp_path, corpus, capsys, signal_at_step):
    out = tmp_path / "run"
    signal_at_step(signal.SIGINT, 1, times=2)  # stopped at once: no checkpoint
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)
    assert status == 130 and not (out / "checkpoint.safetensors").exists() and (out / "config.json").exists()
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL, "--hidden", 16)
    assert status == 0, err
    assert json.loads((out / "config.json").read_text())["model"]["hidden"] == 16


DAMAGE = {
    "cell": ("config.json", lambda c: c["model"].update(cell="lsmt"), "--cell"),
    "hidden-bool": ("config.json", lambda c: c["model"].update(hidden=True), "--hidden"),
    "zoneout": ("config.json", lambda c: c["model"].update(zoneout=1.5), "--zoneout"),
    "corpus-null": ("config.json", lambda c: c.update(corpus=None), "corpus"),
    "sha-missing": ("config.json", lambda c: c["corpus"].pop("sha256") and None, "sha256"),
    "batch-string": ("config.json", lambda c: c["training"].update(batch="32"), "--batch"),
    "lr-negative": ("config.json", lambda c: c["training"].update(lr=-1), "--lr"),
    "eval-every-zero": ("config.json", lambda c: c["settings"].update(eval_every=0), "--eval-every"),
    "settings-list": ("config.json", lambda c: c.update(settings=[1, 2]), "settings"),
    "unknown-setting": ("config.json", lambda c: c["settings"].update(eval_evry=5), "eval_evry"),
    "not-an-object": ("config.json", lambda c: [1], "JSON object"),
    "vocab-short": ("vocab.json", lambda v: v[:-1], "vocab_size"),
    "vocab-repeats": ("vocab.json", lambda v: v[:-1] + v[:1], "distinct"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("command", ["resume", "sample", "eval"])
def test_a_damaged_config_is_one_line_naming_the_file(trained, capsys, damage, command):
    name, change, word = DAMAGE[damage]
    path = trained / name
    value = json.loads(path.read_text())
    changed = change(value)
    path.write_text(json.dumps(value if changed is None else changed))
    before = snapshot(trained)
    argv = {"resume": ["train", "--out", trained, "--steps", 8, "--resume"], "sample": ["sample", trained],
            "eval": ["eval", trained]}[command]
    status, _, err = run(capsys, *argv)
    assert_one_line_error(status, err)
    assert f"{path}:" in err and word in err
    assert snapshot(trained) == before


def test_a_moved_corpus_says_where_it_was_looked_for(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)[0] == 0
    moved = tmp_path / "moved.txt"
    corpus.rename(moved)
    status, _, err = run(capsys, "train", "--out", out, "--steps", 6, "--resume")
    assert_one_line_error(status, err)
    assert str(corpus) in err and "config.json" in err and "--text" in err and "moved" in err
    status, _, err = run(capsys, "train", "--out", out, "--steps", 6, "--resume", "--text", moved)
    assert status == 0, err


# ---- what runs where ---------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["eval", "--precision", "int8"], ["sample", "--int8"]], ids=["eval", "sample"])
def test_a_backend_with_int8_is_refused(trained, capsys, argv):
    """int8 runs on rnnkit.quantize's kernels: a --backend there was quietly ignored."""
    status, _, err = run(capsys, argv[0], trained, *argv[1:], "--backend", "reference")
    assert_one_line_error(status, err)
    assert "--backend reference" in err and "int8" in err


def test_a_backend_that_cannot_train_the_model_writes_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--backend", "native", "--peephole", *SMALL)
    assert_one_line_error(status, err)
    assert "--backend" in err and not out.exists()


@pytest.mark.parametrize("variable", ["RNNKIT_FP32_GEMM", "RNNKIT_INT8_KERNEL"])
def test_a_bad_kernel_variable_is_one_line(trained, variable):
    """The kernels read the variable at their first use, once per process: a fresh process."""
    command = [sys.executable, "-m", "rnnkit", "eval", str(trained), "--chars", "100", "--precision", "int8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, variable: "bogus"})
    assert result.returncode == 1
    assert_one_line_error(result.returncode, result.stderr)
    assert f"${variable}" in result.stderr and "bogus" in result.stderr


def test_the_printed_command_continues_the_run(tmp_path, corpus, capsys, signal_at_step):
    """The interrupted run's 'continue with' line, run as printed (quoting, where it runs)."""
    out = tmp_path / "a run"
    signal_at_step(signal.SIGINT, 2)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 6, *SMALL,
                         "--backend", "reference", "--device", "cpu")
    assert status == 130, err
    line = err.strip().splitlines()[-1]
    argv = shlex.split(line.split("continue with: ")[1])
    assert argv[:2] == ["rnnkit", "train"] and argv[argv.index("--out") + 1] == str(out)
    assert argv[argv.index("--backend") + 1] == "reference" and argv[argv.index("--device") + 1] == "cpu"
    status, _, err = run(capsys, *argv[1:])
    assert status == 0, err
    assert json.loads(safe_open(str(out / "checkpoint.safetensors"), "pt").metadata()["progress"])["step"] == 6


def test_evaluate_scores_every_character():
    """evaluate cuts the text into streams; none of the characters asked for is left out (it
    dropped up to batch - 1 of them) and each is predicted from its own stream's past."""
    torch.manual_seed(0)
    network = train.build_model(train.ModelConfig(vocab_size=7, hidden=8, embedding=4))
    ids = torch.randint(0, 7, (23,))
    got = train.evaluate(network, ids, batch=4, bptt=3)
    rows = [ids[k * 6: k * 6 + 7] for k in range(4)]  # 22 targets in 4 streams of 6, the last one of 4
    total = 0.0
    with torch.no_grad():
        for row in rows:
            logits, _ = network(row[:-1].unsqueeze(1))
            total += torch.nn.functional.cross_entropy(logits[:, 0], row[1:], reduction="sum").item()
    assert got == pytest.approx(total / 22 / math.log(2), rel=1e-6)


# ---- the second review: one run per directory, and what a run's files may not disagree on -----

def test_a_vocabulary_edited_after_training_is_refused(trained, capsys):
    """Two characters swapped in vocab.json: the same ids, other characters, scored and sampled silently."""
    chars = json.loads((trained / "vocab.json").read_text())
    i, j = chars.index("e"), chars.index("t")
    chars[i], chars[j] = chars[j], chars[i]
    (trained / "vocab.json").write_text(json.dumps(chars))
    for argv in (["eval", trained], ["sample", trained], ["train", "--out", trained, "--steps", 8, "--resume"]):
        status, _, err = run(capsys, *argv)
        assert_one_line_error(status, err)
        assert "vocab.json" in err and "belongs to another run" in err


def test_eval_refuses_what_resume_refuses(trained, corpus, tmp_path, capsys):
    other = _other_run(tmp_path, capsys, corpus, "--lr", "0.01")
    (trained / "checkpoint.safetensors").write_bytes((other / "checkpoint.safetensors").read_bytes())
    for argv in (["eval", trained], ["sample", trained]):
        status, _, err = run(capsys, *argv)
        assert_one_line_error(status, err)
        assert "--lr" in err


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_second_training_in_one_directory_is_refused(trained, corpus, tmp_path, capsys, resume):
    out = trained if resume else tmp_path / "new"
    lock = checkpoint.DirectoryLock(out).acquire()  # as another process training there holds it
    try:
        before = snapshot(out)
        argv = ["--resume"] if resume else ["--text", corpus, *SMALL]
        status, _, err = run(capsys, "train", "--out", out, "--steps", 8, *argv)
        assert_one_line_error(status, err)
        assert "another rnnkit train is running" in err
        assert snapshot(out) == before
    finally:
        lock.release()
    assert run(capsys, "train", "--out", out, "--steps", 8, *argv)[0] == 0  # free again


def test_a_users_temporary_looking_file_is_left_alone(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".notes.txt.tmp-99999999").write_text("mine")
    status, _, err = run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)
    assert status == 0, err
    assert (out / ".notes.txt.tmp-99999999").read_text() == "mine" and "removed" not in err


def test_resume_saves_a_new_eval_every_and_refuses_another_eval_chars(trained, capsys):
    status, _, err = run(capsys, "train", "--out", trained, "--steps", 6, "--resume", "--eval-every", 1)
    assert status == 0, err
    assert json.loads((trained / "config.json").read_text())["settings"]["eval_every"] == 1
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--out", trained, "--steps", 8, "--resume", "--eval-chars", 50)
    assert_one_line_error(status, err)
    assert "--eval-chars 50" in err
    assert snapshot(trained) == before


@pytest.mark.parametrize("flag", ["--text", "--out"])
def test_an_empty_path_is_refused(tmp_path, capsys, flag):
    """--text '' trained on the standard library; --out '' wrote into the current directory."""
    status, _, err = run(capsys, "train", flag, "", "--out" if flag == "--text" else "--text", tmp_path / "x")
    assert status == 2 and f"argument {flag}: expected a path, got ''" in err


def test_resuming_a_moved_corpus_remembers_where_it_is(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)[0] == 0
    moved = tmp_path / "moved.txt"
    corpus.rename(moved)
    assert run(capsys, "train", "--out", out, "--steps", 5, "--resume", "--text", moved)[0] == 0
    assert json.loads((out / "config.json").read_text())["corpus"]["source"] == str(moved.resolve())
    status, _, err = run(capsys, "train", "--out", out, "--steps", 6, "--resume")  # as the printed command says
    assert status == 0, err


def test_a_fresh_run_keeps_the_log_of_a_run_whose_checkpoints_are_gone(trained, corpus, capsys):
    for name in ("checkpoint.safetensors", "best.safetensors"):
        (trained / name).unlink()
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", trained, "--steps", 4, *SMALL)
    assert_one_line_error(status, err)
    assert "step 4" in err
    assert snapshot(trained) == before


def test_a_corpus_path_that_is_not_utf8_trains_and_plots(tmp_path, corpus, capsys):
    pytest.importorskip("matplotlib")
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/c\xffo.txt"))
    odd.write_bytes(corpus.read_bytes())
    out = tmp_path / "run"
    status, _, err = run(capsys, "train", "--text", odd, "--out", out, "--steps", 4, *SMALL)
    assert status == 0, err
    assert (out / "curve.png").exists() and "Traceback" not in err


def test_a_tiny_temperature_is_greedy(trained, capsys):
    outs = [run(capsys, "sample", trained, "--length", 30, "--temperature", t)[1] for t in ("0", "1e-310")]
    assert outs[0] == outs[1] and outs[0]


def test_a_seed_torch_cannot_take_is_refused(tmp_path, capsys):
    status, _, err = run(capsys, "sample", tmp_path, "--seed", 2**70)
    assert status == 2 and "--seed" in err


def test_the_default_prime_is_in_the_vocabulary(tmp_path, capsys):
    text = tmp_path / "spaces.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 80)  # no newline
    out = tmp_path / "run"
    assert run(capsys, "train", "--text", text, "--out", out, "--steps", 2, *SMALL)[0] == 0
    status, printed, err = run(capsys, "sample", out, "--length", 5)
    assert status == 0 and printed.startswith(" "), err


CHECKPOINT_DAMAGE = {
    "evaluations-object": lambda meta, tensors: meta.update(evaluations="{}"),
    "evaluations-numbers": lambda meta, tensors: meta.update(evaluations="[1]"),
    "evaluations-empty-records": lambda meta, tensors: meta.update(evaluations="[{}]"),
    "run-list": lambda meta, tensors: meta.update(run="[]"),
    "best-a-string": lambda meta, tensors: meta.update(
        progress=json.dumps({**json.loads(meta["progress"]), "best_val_bpc": "low"})),
    "step-a-string": lambda meta, tensors: meta.update(progress=json.dumps({**json.loads(meta["progress"]), "step": "4"})),
    "position-past-the-corpus": lambda meta, tensors: meta.update(
        progress=json.dumps({**json.loads(meta["progress"]), "position": 10 ** 12})),
    # tensors changed after writing: the SHA-256 of the tensors refuses them, so these drop it (as
    # files written before it had none) to reach the checks behind it
    "state-shape": lambda meta, tensors: (meta.pop("sha256"), tensors.update({"state.0": torch.zeros(1, 4, 5)})),
    "nan-weight": lambda meta, tensors: (meta.pop("sha256"), tensors["model.head.bias"].__setitem__(3, float("nan"))),
    "digest-differs": lambda meta, tensors: tensors["model.head.bias"].__setitem__(3, 0.5),
}


@pytest.mark.parametrize("damage", list(CHECKPOINT_DAMAGE))
@pytest.mark.parametrize("command", ["resume", "sample"])
def test_damaged_checkpoint_metadata_is_one_line(trained, capsys, damage, command):
    from safetensors.torch import save_file

    path = trained / "checkpoint.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        meta = dict(handle.metadata())
    tensors = load_file(str(path))
    CHECKPOINT_DAMAGE[damage](meta, tensors)
    save_file(tensors, str(path), metadata=meta)
    before = snapshot(trained)
    argv = ["sample", trained] if command == "sample" else ["train", "--out", trained, "--steps", 8, "--resume"]
    status, _, err = run(capsys, *argv)
    if command == "sample" and damage not in ("evaluations-object", "evaluations-numbers", "evaluations-empty-records",
                                              "run-list", "nan-weight", "digest-differs"):
        assert status == 0, err  # sampling reads the weights only
    else:
        assert_one_line_error(status, err)
        assert str(path) in err
    assert snapshot(trained) == before


def test_a_decay_steps_error_says_it_came_from_steps(tmp_path, corpus, capsys):
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", "--schedule", "cosine",
                         "--warmup-steps", 10, "--steps", 10)
    assert_one_line_error(status, err)
    assert "defaults to --steps" in err


def test_resume_with_a_switch_the_run_did_not_use(trained, capsys):
    status, _, err = run(capsys, "train", "--out", trained, "--steps", 8, "--resume", "--peephole")
    assert_one_line_error(status, err)
    assert "--peephole: the run in" in err and "without it" in err


def test_printed_commands_read_a_dash_path_as_a_path(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = run(capsys, "train", "--text", corpus, "--out=-dash", "--steps", 4, *SMALL)
    assert status == 0, err
    assert err.strip().endswith("try: rnnkit sample ./-dash")


def test_a_model_too_large_for_memory_is_one_line(tmp_path, corpus, capsys):
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", *SMALL, "--embedding", 16_000_000,
                         "--hidden", 4096)  # 262 G parameters
    assert_one_line_error(status, err)
    assert "memory" in err and not (tmp_path / "run").exists()


def test_paths_that_are_not_run_directories_say_what_they_are(tmp_path, corpus, capsys):
    (tmp_path / "file").write_text("")
    status, _, err = run(capsys, "sample", tmp_path / "file")
    assert_one_line_error(status, err)
    assert "not a directory" in err
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "link", *SMALL)
    assert_one_line_error(status, err)
    assert "symbolic link" in err and "does not exist" in err


@pytest.mark.parametrize("command", ["train", "sample", "eval", "doctor", "bench"])
def test_an_unknown_flag_is_named_by_its_subcommand(capsys, command):
    """argparse blamed the top-level command ("rnnkit: error: ... (see rnnkit --help)")."""
    argv = [command] + (["somewhere"] if command in ("sample", "eval") else []) + ["--bogus", "1"]
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert err == f"rnnkit {command}: error: unrecognized arguments: --bogus 1 (see rnnkit {command} --help)\n"


def test_a_diverged_loss_says_what_to_do(tmp_path, corpus, capsys, monkeypatch):
    """The advice holds for a resumed run too (--resume refuses a changed --lr)."""
    real = train.train_step

    def diverging(model, optimizer, x, y, state, *rest):
        loss, state = real(model, optimizer, x, y, state, *rest)
        return (float("nan") if optimizer.state_dict()["state"][0]["step"] >= 3 else loss), state

    monkeypatch.setattr(train, "train_step", diverging)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", "--steps", 5, *SMALL)
    assert status == 1
    assert err.splitlines()[-1] == ("rnnkit: error: the loss became nan at step 3; start again with a smaller --lr "
                                    "in another --out (--resume keeps a run's --lr)")
