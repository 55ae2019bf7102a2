"""What `pip install rnnkit` gives a user: a wheel built from this tree carries everything rnnkit
reads at run time (the fused kernels' C++ sources are compiled on the user's machine), and the
installed copy runs the fused and int8 kernels from outside the source tree."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from helpers import require_fused_kernels

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "rnnkit"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tree (pip builds in place: nothing is written into the
    checkout, and nothing left there from an earlier build reaches the wheel)."""
    out, tree = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # no build isolation: the setuptools installed here builds it, with no download
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "--wheel-dir", str(out), str(tree)], capture_output=True, text=True, timeout=600,
                            cwd=out)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = out.glob("rnnkit-*.whl")
    return path


def test_wheel_carries_every_runtime_file(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    needed = {"rnnkit/" + p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    assert any(name.startswith("rnnkit/fused/csrc/") for name in needed)
    assert needed <= names, sorted(needed - names)


def test_installed_wheel_runs_the_fused_and_int8_kernels(wheel, tmp_path):
    from rnnkit.fused import build

    require_fused_kernels()  # built here, from this tree
    built = {path: path.stat().st_mtime_ns for path in build.cache_dir().iterdir() if path.is_file()}
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)  # torch from this environment
    python = env_dir / "bin" / "python"
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                             str(wheel)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    script = (
        "import torch, rnnkit\n"
        "lstm = rnnkit.LSTM(8, 16, peephole=True, backend='fused').eval()\n"
        "y = lstm(torch.randn(5, 2, 8))[0]\n"
        "q = rnnkit.quantize(lstm)(torch.randn(5, 2, 8))[0]\n"
        "print(rnnkit.__file__, lstm.last_backend, tuple(y.shape), tuple(q.shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    where, backend, *shapes = result.stdout.split()
    assert Path(where).is_relative_to(env_dir), where  # the installed copy, not this tree
    assert backend == "fused" and shapes == ["(5,", "2,", "16)", "(5,", "2,", "16)"]
    # the same sources, so the same build: the installed copy loads the one this tree built, and
    # neither recompiles nor relinks it (ninja would rewrite its log and the library)
    assert "compiling the fused CPU kernels" not in result.stderr, result.stderr[-3000:]
    assert {path: path.stat().st_mtime_ns for path in built} == built
