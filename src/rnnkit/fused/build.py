"""Compiling the fused CPU kernels: once, on first use, into a per-torch-version cache.

``import rnnkit`` compiles nothing; the first call that needs the fused backend does, and
says so in one line on stderr. A failed build is remembered with its reason, said once, and
reported by ``FusedCPUBackend.unavailable_reason()`` so that ``backend="auto"`` falls back
and ``backend="fused"`` raises with it.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

_SOURCES = ("module.cpp", "lstm.cpp", "gru.cpp", "rnn.cpp")
_NAME = "rnnkit_fused_cpu"
_lock = threading.Lock()
_extension = None
_failure: Optional[str] = None


def _source_digest() -> str:
    """Hash of the C++ sources and flags: two checkouts with different sources never share a build."""
    digest = hashlib.sha256(" ".join(_flags()).encode())
    for path in sorted(Path(__file__).with_name("csrc").iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    """Where the build lives: $TORCH_EXTENSIONS_DIR or ~/.cache/rnnkit/<torch>/, then rnnkit_fused_cpu/<sources hash>."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / _NAME / _source_digest()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "rnnkit" / torch.__version__.replace("+", "_") / _NAME / _source_digest()


def _compile():
    from torch.utils import cpp_extension

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    csrc = Path(__file__).with_name("csrc")
    if not any(folder.glob(f"{_NAME}*.so")):
        print(f"rnnkit: compiling the fused CPU kernels into {folder} (once; a minute or two)", file=sys.stderr)
    return cpp_extension.load(
        name=_NAME,
        sources=[str(csrc / s) for s in _SOURCES],
        build_directory=str(folder),
        extra_cflags=_flags(),
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def _flags() -> list:
    """-O3, OpenMP for at::parallel_for, and the widest at::vec (SIMD σ / tanh) that torch itself
    dispatches to on this CPU: AVX-512 (16 floats a vector) or AVX2 (8)."""
    flags = ["-O3", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
        flags += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    elif capability == "AVX2":
        flags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def extension():
    """The compiled module; raises RuntimeError with the build failure's reason."""
    global _extension, _failure
    with _lock:
        if _extension is None and _failure is None:
            try:
                _extension = _compile()
                _extension.set_poison(os.environ.get("RNNKIT_POISON", "0") == "1")
            except Exception as error:  # a missing compiler, ninja, headers, ...: all mean "unavailable"
                lines = [line.strip() for line in str(error).splitlines() if line.strip()]
                first_error = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
                _failure = f"the C++ build failed ({type(error).__name__}: {first_error})"
                print(f"rnnkit: fused CPU backend unavailable: {_failure}", file=sys.stderr)
        if _extension is None:
            raise RuntimeError(_failure)
        return _extension


def loaded():
    """The compiled module if it is already built and loaded, else None (never builds)."""
    return _extension


def failure() -> Optional[str]:
    """None when the kernels are built (building them now if needed), else why they can't be."""
    try:
        extension()
    except RuntimeError as error:
        return str(error)
    return None


def set_poison(on: bool) -> None:
    """Fill every buffer the kernels allocate with NaN (tests: unwritten memory shows up)."""
    extension().set_poison(bool(on))
