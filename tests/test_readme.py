"""README.md's Python examples run as written (so the README stays true)."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{k}" for k in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path, monkeypatch):
    assert BLOCKS, "README has no python examples"
    monkeypatch.chdir(tmp_path)  # examples may write files (lstm.onnx)
    exec(compile(code, str(README), "exec"), {})
