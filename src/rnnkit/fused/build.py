"""Compiling the fused CPU kernels: once, on first use, into a cache keyed by everything that
changes the build.

``import rnnkit`` compiles nothing, and neither does asking what can run
(`unavailable_reason`, ``rnnkit.backends()``, ``rnnkit doctor``, ``backend="auto"``): they
report "not built yet". The first call that runs a fused pass builds the extension and says so in
one line on stderr. A failed build is remembered with its reason, said once, and reported from
then on, so that ``backend="auto"`` moves on and ``backend="fused"`` raises with it.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

_SOURCES = ("buffers.cpp", "gemm.cpp", "qgemm.cpp", "bgemm.cpp", "fgemm.cpp", "pass.cpp", "lstm.cpp", "gru.cpp", "rnn.cpp", "ops.cpp")
_NAME = "rnnkit_fused_cpu"
_lock = threading.Lock()
_extension = None
_failure: Optional[str] = None
_PROBED = object()
_missing_tool = _PROBED  # not probed yet; then None or what is missing (compiler, ninja)


def _compiler() -> Optional[str]:
    """The C++ compiler torch.utils.cpp_extension will use ($CXX, else c++), if it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


@lru_cache(maxsize=8)
def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build_key() -> str:
    """Hash of what changes the binary: the sources, the flags, the compiler and its version, the
    torch build (install path and git revision: two environments with the same torch version
    have different include paths) and the Python ABI. Environments and installed copies that agree
    on all of it share one build (it compiles a copy of the sources: `_copy_sources`)."""
    digest = hashlib.sha256()
    compiler = _compiler() or ""
    version = _compiler_version(compiler)
    for part in (
        " ".join(_flags()), compiler, version, torch.__version__, str(getattr(torch.version, "git_version", "")),
        str(Path(torch.__file__).parent), sys.implementation.cache_tag, sysconfig.get_platform(),
    ):
        digest.update(part.encode() + b"\0")
    for path in sorted(Path(__file__).with_name("csrc").iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the build lives: $TORCH_EXTENSIONS_DIR or ~/.cache/rnnkit/<torch>/, then
    rnnkit_fused_cpu/<build key> (see `_build_key`)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / _NAME / _build_key()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "rnnkit" / torch.__version__.replace("+", "_") / _NAME / _build_key()


_SOURCE_TIME = 1_000_000_000  # the copies' fixed modification time (2001): never newer than a build


def _copy_sources(folder: Path) -> Path:
    """The C++ sources copied into the build's folder, and that copy's path. The build compiles the
    copy: its build file then names the same paths whichever installed copy of rnnkit asks (two
    environments, or a checkout and an installed wheel, with the same sources and key share one
    build instead of recompiling over each other). Each file is written atomically, only when it
    differs (it never does for a given key: the key hashes these bytes), with a fixed old
    modification time, so a copy two processes both write never looks newer than the build."""
    target = folder / "csrc"
    target.mkdir(exist_ok=True)
    for path in sorted(Path(__file__).with_name("csrc").iterdir()):
        data, copy = path.read_bytes(), target / path.name
        if not copy.exists() or copy.read_bytes() != data:
            handle, partial = tempfile.mkstemp(dir=target, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.utime(partial, (_SOURCE_TIME, _SOURCE_TIME))
            os.replace(partial, copy)
    return target


@contextlib.contextmanager
def _builder(folder: Path):
    """This process as the folder's only builder, across processes: an OS lock on ``build.flock``
    (released by the OS when its holder exits, however it exits). Its holder first removes torch's
    own ``lock`` file, which a build killed midway leaves behind: torch waits on that file for as
    long as it exists, so every later process would hang in silence (`_compile` clears the rest
    of such a build). Another process's build in progress is waited for, with one line saying so.
    Where there are no POSIX locks (Windows), torch's file alone."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - POSIX everywhere the tests run
        yield
        return
    with open(folder / "build.flock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"rnnkit: waiting for another process's build of the fused CPU kernels in {folder}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)  # only a holder of build.flock builds here
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_DONE = "build.done"  # written once a build in the folder has loaded


def _clear_unfinished(folder: Path) -> None:
    """What a build killed midway left in `folder` (objects, the library, ninja's logs, torch's
    lock), removed: a truncated ``.ninja_deps`` makes ninja recompile a file on every later load,
    20 s each time and without a word. Kept: the sources and the lock file."""
    for path in folder.iterdir():
        if path.name in ("csrc", "build.flock"):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _compile():
    from torch.utils import cpp_extension

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with _builder(folder):
        done = folder / _DONE
        finished = done.exists()
        if not finished:  # never built, or a build was killed: start from the sources alone
            _clear_unfinished(folder)
        csrc = _copy_sources(folder)
        if not any(folder.glob(f"{_NAME}*.so")):
            print(f"rnnkit: compiling the fused CPU kernels into {folder} (once; a minute or two)", file=sys.stderr)
        module = cpp_extension.load(
            name=_NAME,
            sources=[str(csrc / s) for s in _SOURCES],
            build_directory=str(folder),
            extra_cflags=_flags(),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        if not finished:
            done.touch()
        return module


def _flags() -> list:
    """-O3, OpenMP for at::parallel_for, and the widest at::vec (SIMD σ / tanh) that torch itself
    dispatches to on this CPU: AVX-512 (16 floats a vector) or AVX2 (8). -ffp-contract=off: the
    kernels compute the expressions as written, a multiply-add fused only where the source calls
    fmadd. g++ otherwise fuses ``a * b + c`` where its inlining happens to put them together, so
    the same line rounded differently from one build to the next (a peephole's ``a + p * c``, or
    c̃ = f c + i g, which the forward computes and the backward recomputes); the reference, in
    torch ops, rounds each product. Time: within noise (int8 and float32 LSTMs, small and medium)."""
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
        flags += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    elif capability == "AVX2":
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def extension():
    """The compiled module, building it on first use; raises RuntimeError with the build failure's reason."""
    global _extension, _failure
    if _extension is not None:
        return _extension
    with _lock:
        if _extension is None and _failure is None:
            try:
                _extension = _compile()
                _extension.set_poison(os.environ.get("RNNKIT_POISON", "0") == "1")
            except Exception as error:  # a missing compiler, ninja, headers, ...: all mean "unavailable"
                lines = [line.strip() for line in str(error).splitlines() if line.strip()]
                # the compiler's first "error:" line says more than the build tool's summary
                first_error = next((line for line in lines if "error:" in line),
                                   next((line for line in lines if "error" in line.lower()), lines[-1] if lines else ""))
                _failure = f"the C++ build failed ({type(error).__name__}: {first_error})"
                print(f"rnnkit: fused CPU backend unavailable: {_failure}", file=sys.stderr)
        if _extension is None:
            raise RuntimeError(_failure)
        return _extension


def loaded():
    """The compiled module if it is already built and loaded, else None (never builds)."""
    return _extension


def _probe_tools() -> Optional[str]:
    """What the build needs and this machine lacks (a C++ compiler, ninja), or None."""
    if _compiler() is None:
        return f"no C++ compiler on PATH ({os.environ.get('CXX', 'c++')}; set CXX to choose one)"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts the binary on PATH inside its own folder)
        except ImportError:
            return "ninja is not installed (pip install ninja)"
    return None


def unavailable_reason() -> Optional[str]:
    """Why the kernels cannot run here, or None; never builds. Before the first build this checks
    only (once) that a compiler and ninja are present; a build that then fails is reported from
    then on. Under torch.compile it reads only what is known (no file system probes in a graph)."""
    global _missing_tool
    if torch.compiler.is_compiling():
        # no guard on this module's state (loading the kernels would recompile the graph): the op
        # builds, or says why it cannot, when it runs; torch.compile needs a compiler on the CPU anyway
        return None
    if _failure is not None:
        return _failure
    if _extension is not None:
        return None
    if _missing_tool is _PROBED:
        _missing_tool = _probe_tools()
    return _missing_tool


def status() -> str:
    """"loaded", "built (loads on first use)", "not built yet (builds on first use)", or why it
    cannot run; never builds or loads anything."""
    if _extension is not None:
        return "loaded"
    reason = unavailable_reason()
    if reason:
        return reason
    if any(cache_dir().glob(f"{_NAME}*.so")):
        return f"built (in {cache_dir()}; loads on first use)"
    return "not built yet (builds on first use, about a minute)"


def set_poison(on: bool) -> None:
    """Fill every buffer the kernels allocate with NaN (tests: unwritten memory shows up)."""
    extension().set_poison(bool(on))
