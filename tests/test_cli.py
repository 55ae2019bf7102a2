"""The `rnnkit` command: train -> sample, exact resume, errors in one line, doctor, bench wiring.

Runs are tiny (a few steps of a small model on a short text) so the file stays fast; the
default run's numbers are measured once and written in docs/cli.md.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rnnkit
from rnnkit import charlm, cli

SENTENCE = "the quick brown fox jumps over the lazy dog. "
SMALL = ["--hidden", "24", "--embedding", "8", "--batch", "4", "--bptt", "16", "--eval-every", "4",
         "--eval-chars", "300"]


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


# ---- the forum toy -----------------------------------------------------------------------

def test_repeated_sentence_reaches_near_zero_loss():
    """One sentence repeated, a 2-layer LSTM with hidden size 20, next-character prediction."""
    text = "hello world, this is a tiny recurrent network. " * 4
    vocabulary = charlm.Vocabulary.of(text)
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
    assert {"checkpoint.safetensors", "config.json", "vocab.json", "log.jsonl", "curve.png"} <= set(snapshot(out))
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [4, 8]
    assert log[-1]["val_bpc"] < log[0]["val_bpc"]
    weights = load_file(str(out / "checkpoint.safetensors"))
    assert "model.rnn.weight_ih_l0" in weights and "optimizer.0.exp_avg" in weights  # torch.nn names

    first = run(capsys, "sample", out, "--prime", "the ", "--length", 40, "--seed", 3)
    again = run(capsys, "sample", out, "--prime", "the ", "--length", 40, "--seed", 3)
    other = run(capsys, "sample", out, "--prime", "the ", "--length", 40, "--seed", 4)
    assert first[0] == 0 and first == again
    assert first[1].startswith("the ") and len(first[1].rstrip("\n")) == 44
    assert other[1] != first[1]


@pytest.mark.parametrize("options", [[], ["--cell", "gru", "--layers", "2", "--dropout", "0.1", "--zoneout", "0.1"]],
                         ids=["lstm", "gru-dropout-zoneout"])
def test_resume_gives_the_uninterrupted_run(tmp_path, corpus, capsys, options):
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ["--text", corpus, *SMALL, *options]
    assert run(capsys, "train", "--out", whole, "--steps", 10, *common)[0] == 0
    assert run(capsys, "train", "--out", split, "--steps", 5, *common)[0] == 0  # stops between evaluations
    status, _, err = run(capsys, "train", "--out", split, "--steps", 10, "--resume")
    assert status == 0, err
    expected, actual = load_file(str(whole / "checkpoint.safetensors")), load_file(str(split / "checkpoint.safetensors"))
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    drop_timing = lambda r: {k: v for k, v in r.items() if k not in ("chars_per_sec", "elapsed_s")}  # noqa: E731
    records = lambda d: [drop_timing(json.loads(l)) for l in (d / "log.jsonl").read_text().splitlines()]  # noqa: E731
    assert records(split)[-1] == records(whole)[-1]
    assert [r["step"] for r in records(split)] == [4, 5, 8, 10]


def test_resume_when_already_done_does_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert run(capsys, "train", "--text", corpus, "--out", out, "--steps", 4, *SMALL)[0] == 0
    before = snapshot(out)
    status, _, err = run(capsys, "train", "--out", out, "--steps", 4, "--resume")
    assert status == 0 and "nothing to do" in err
    assert snapshot(out) == before


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


def test_corpus_too_small_for_the_batch(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("abcabcabc" * 10)
    status, _, err = run(capsys, "train", "--text", small, "--out", tmp_path / "run", "--batch", 64)
    assert_one_line_error(status, err)
    assert "--batch" in err


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
@pytest.mark.parametrize("command", ["sample", "resume"])
def test_damaged_checkpoint(trained, capsys, damage, command):
    checkpoint = trained / "checkpoint.safetensors"
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(b"not a checkpoint at all" if damage == "garbage" else data[: len(data) // 2])
    before = snapshot(trained)
    argv = ["sample", trained] if command == "sample" else ["train", "--out", trained, "--steps", 8, "--resume"]
    status, _, err = run(capsys, *argv)
    assert_one_line_error(status, err)
    assert "checkpoint" in err
    assert snapshot(trained) == before


def test_resume_with_another_configuration(trained, corpus, capsys):
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", trained, "--steps", 8, "--resume", "--hidden", 32)
    assert_one_line_error(status, err)
    assert "--hidden 32" in err
    assert snapshot(trained) == before


def test_resume_with_another_corpus(trained, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text("a different text entirely. " * 100)
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--text", other, "--out", trained, "--steps", 8, "--resume")
    assert_one_line_error(status, err)
    assert snapshot(trained) == before


def test_fresh_run_refuses_to_overwrite_a_checkpoint(trained, corpus, capsys):
    before = snapshot(trained)
    status, _, err = run(capsys, "train", "--text", corpus, "--out", trained, "--steps", 4)
    assert_one_line_error(status, err)
    assert "--resume" in err
    assert snapshot(trained) == before


def test_resume_without_a_checkpoint(tmp_path, capsys):
    status, _, err = run(capsys, "train", "--out", tmp_path / "empty", "--resume")
    assert_one_line_error(status, err)


@pytest.mark.parametrize("argv", [
    ["train", "--cell", "lsmt"],
    ["train", "--zoneout", "1.5"],
    ["train", "--hidden", "0"],
    ["train", "--backend", "nope"],
    ["train", "--no-such-flag"],
    ["sample", "DIR", "--temperature", "-1"],
], ids=["cell", "zoneout", "hidden", "backend", "unknown-flag", "temperature"])
def test_bad_flag_values(tmp_path, capsys, argv):
    status, _, err = run(capsys, *[str(tmp_path) if a == "DIR" else a for a in argv])
    assert_one_line_error(status, err)


def test_option_the_cell_does_not_have(tmp_path, corpus, capsys):
    status, _, err = run(capsys, "train", "--text", corpus, "--out", tmp_path / "run", "--cell", "gru", "--peephole", *SMALL)
    assert_one_line_error(status, err)
    assert "--peephole" in err


def test_sample_errors(trained, tmp_path, capsys):
    assert_one_line_error(*run(capsys, "sample", tmp_path / "missing")[::2])
    status, _, err = run(capsys, "sample", trained, "--prime", "€")
    assert_one_line_error(status, err)
    assert "vocabulary" in err


def test_console_script_error_has_no_traceback(tmp_path):
    """The installed entry point, in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "rnnkit.cli", "train", "--text", str(tmp_path / "missing.txt")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr


# ---- doctor and bench --------------------------------------------------------------------

def test_doctor(capsys):
    status, out, _ = run(capsys, "doctor")
    assert status == 0
    for word in ("rnnkit", "torch", "numpy", "python", "threads", "reference", "safetensors"):
        assert word in out


def test_bench_is_wired(capsys):
    pytest.importorskip("rnnkit.bench")
    status, out, _ = run(capsys, "bench", "--help")
    assert status == 0 and "usage: rnnkit bench" in out
