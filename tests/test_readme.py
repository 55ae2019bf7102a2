"""README.md's examples run as written (so the README stays true): its Python blocks, and the
`rnnkit` commands of its command-line section (and of docs/cli.md)."""
import pathlib
import re
import shlex

import pytest
import torch

from rnnkit.app import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
COMMAND_SECTION = README.split("## The `rnnkit` command", 1)[1].split("\n## ", 1)[0]


def commands(markdown: str) -> list:
    """The `rnnkit ...` lines of the ```bash blocks, comments dropped (plain ``` blocks show output,
    and the refused commands of docs/cli.md's error examples)."""
    lines, fence = [], None
    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence == "bash":
            line = line.split("  #", 1)[0].strip()
            if line.startswith("rnnkit "):
                lines.append(line)
    return lines


README_COMMANDS = commands(COMMAND_SECTION)
DOCS_COMMANDS = commands((ROOT / "docs" / "cli.md").read_text())

# appended so that the suite stays fast: a tiny model, a few steps, one quick timing per runner
SMALLER = {
    "train": ["--steps", "2", "--hidden", "16", "--embedding", "8", "--batch", "4", "--bptt", "16",
              "--eval-every", "2", "--eval-chars", "200"],
    "train --resume": ["--steps", "4", "--eval-chars", "200"],
    "bench": ["--runners", "torch.nn", "--repeats", "1", "--warmup", "0", "--threads", "1"],
}


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{k}" for k in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path, monkeypatch):
    assert BLOCKS, "README has no python examples"
    monkeypatch.chdir(tmp_path)  # examples may write files (lstm.onnx)
    exec(compile(code, "README.md", "exec"), {})


@pytest.mark.parametrize("line", README_COMMANDS + DOCS_COMMANDS)
def test_documented_commands_parse_as_written(line):
    argv = shlex.split(line)[1:]
    cli.build_parser(with_bench=argv[0] == "bench").parse_args(argv)  # argparse exits on anything it refuses


def test_readme_commands_run_in_order(tmp_path, monkeypatch, capsys):
    """README's command-line block, in order, in an empty directory: train, resume, sample, doctor, bench
    (with SMALLER's flags appended, which only shrink the work)."""
    assert [shlex.split(line)[1] for line in README_COMMANDS][:2] == ["train", "train"], README_COMMANDS
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for line in README_COMMANDS:
            argv = shlex.split(line)[1:]
            key = "train --resume" if argv[0] == "train" and "--resume" in argv else argv[0]
            status = cli.main(argv + SMALLER.get(key, []))
            captured = capsys.readouterr()
            assert status == 0, f"{line}\n{captured.err[-2000:]}"
            if argv[0] == "sample":
                assert captured.out.startswith("def ")
    finally:
        torch.set_num_threads(threads)
