"""The examples run: seq2seq improves in a short run, truncated BPTT runs, DDP over 2 processes
gives the weights of one process on the same global batch."""
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from helpers import assert_close
from safetensors.torch import load_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SENTENCE = "the quick brown fox jumps over the lazy dog. "


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_thread_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_seq2seq_short_run_improves():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = load_example("seq2seq").main(["--steps", "60", "--eval-every", "1000", "--test-size", "200"])
    finally:
        torch.set_num_threads(threads)
    assert result["last_loss"] < 0.6 * result["first_loss"]
    assert result["accuracy"] > 0.05  # a random decoder gets ~0 strings exactly right


def test_truncated_bptt_runs():
    result = subprocess.run([sys.executable, str(EXAMPLES / "truncated_bptt.py")], capture_output=True, text=True,
                            timeout=300, env=one_thread_env())
    assert result.returncode == 0, result.stderr
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines()]
    assert losses[-1] < losses[0] / 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_one(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SENTENCE * 100, encoding="utf-8")
    flags = ["--text", str(corpus), "--steps", "3", "--hidden", "32", "--batch", "4", "--bptt", "16"]
    logs = tmp_path / "logs"  # each rank's own stdout/stderr: torchrun's summary alone hides why a rank died
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--log-dir", str(logs),
              "--tee", "3", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    for command, out in ((launch, "two"), ([sys.executable], "one")):
        result = subprocess.run([*command, str(EXAMPLES / "ddp.py"), *flags, "--out", str(tmp_path / out)],
                                capture_output=True, text=True, timeout=300, env=one_thread_env())
        ranks = "".join(f"--- {log.relative_to(logs)}\n{log.read_text()[-1500:]}\n" for log in sorted(logs.rglob("*.log")))
        assert result.returncode == 0, ranks + result.stderr[-1500:]
    one, two = load_file(str(tmp_path / "one" / "weights.safetensors")), load_file(str(tmp_path / "two" / "weights.safetensors"))
    assert one.keys() == two.keys()
    for key in one:
        assert_close(two[key], one[key], key)
