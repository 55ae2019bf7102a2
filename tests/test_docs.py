"""The documentation site builds with warnings as errors, and its API reference covers the
public API.

The build reads the docstrings by static analysis (no import of rnnkit), so it runs in
seconds. Skipped, with the reason, only when the docs toolchain (the ``docs`` extra) is
not installed.
"""
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import rnnkit

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLCHAIN = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
MISSING = [name for name in TOOLCHAIN if importlib.util.find_spec(name.split(".")[0]) is None
           or importlib.util.find_spec(name) is None]

pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"docs toolchain not installed (no {', '.join(MISSING)}): pip install -e '.[docs]'",
)


def build(root: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the project at ``root`` into ``site``."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's banner about MkDocs 2
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )


def warnings_of(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr + result.stdout).splitlines()
    return "\n".join(line for line in lines if not line.startswith("INFO"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    result = build(ROOT, site)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{warnings_of(result)}"
    return site


def test_every_public_name_is_in_the_reference(site):
    reference = "".join(page.read_text() for page in (site / "reference").rglob("*.html"))
    documented = set(re.findall(r'id="(rnnkit\.[\w.]+)"', reference))
    missing = [name for name in rnnkit.__all__ if f"rnnkit.{name}" not in documented]
    assert not missing, f"rnnkit.__all__ names without an entry in the API reference: {missing}"


def test_the_site_has_the_spec_and_the_command_line(site):
    for page in ("spec", "cli", "architecture", "reference/interop"):
        assert (site / page / "index.html").is_file(), f"no page {page}/ in the built site"
    spec = (site / "spec" / "index.html").read_text()
    for section in ("the-option-table", "gate-orders-elsewhere", "parameters-one-packed-buffer"):
        assert f'id="{section}"' in spec, f"spec.md has no section #{section}"


def _copy_project(dst: pathlib.Path) -> None:
    """What the build reads: mkdocs.yml, the top-level Markdown files, docs/ and src/."""
    dst.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", dst)
    for page in ROOT.glob("*.md"):
        shutil.copy(page, dst)
    shutil.copytree(ROOT / "docs", dst / "docs")
    shutil.copytree(ROOT / "src", dst / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build"))


def _break_a_page(root: pathlib.Path) -> None:
    page = root / "docs" / "reference" / "functional.md"
    page.write_text(page.read_text() + "\nSee also [rnnkit.no_such_name][].\n")


def _break_a_docstring(root: pathlib.Path) -> None:
    source = root / "src" / "rnnkit" / "functional.py"
    text = source.read_text()
    opening = text.index('"""', text.index("\ndef rnn(")) + 3
    source.write_text(text[:opening] + "See [rnnkit.no_such_name][]. " + text[opening:])


@pytest.mark.parametrize("breakage", [_break_a_page, _break_a_docstring], ids=["page", "docstring"])
def test_a_broken_reference_fails_the_build(breakage, tmp_path):
    _copy_project(tmp_path / "project")
    breakage(tmp_path / "project")
    result = build(tmp_path / "project", tmp_path / "site")
    assert result.returncode != 0, "mkdocs build --strict passed with a broken cross-reference"
    assert "no_such_name" in warnings_of(result)
