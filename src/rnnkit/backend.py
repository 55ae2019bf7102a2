"""The backend registry: which implementations exist, which can run, and the choice for "auto".

A backend is an object with ``name``, ``unavailable_reason()`` (None when it can run on
this machine), ``unsupported_reason(spec, device, dtype)`` (None when it can run this
configuration), ``status()`` (a word on its state, e.g. "not built yet": asking never builds
or loads anything) and either ``run_pass(cell, x, h0, c0, weights, lengths, reverse, masks)``
(one layer in one direction; functional.run_stack loops over layers and directions) or
``run_stack(spec, weights, x, h0s, c0s, lengths, training)`` (the whole stack; ``weights`` one
PassWeights per layer-direction). Both must be differentiable. ``"auto"`` tries backends by
descending priority:
native (torch's own oneDNN / cuDNN ops, plain configurations) 30, triton (fused GPU
kernels, CUDA) 25, fused (compiled CPU kernels) 20, reference 0.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .fused import FusedCPUBackend
from .triton import TritonBackend  # imports triton only on its first pass
from .native import NativeBackend
from .ref import ReferenceBackend
from .spec import RNNSpec


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name and cannot run the call; the message says why."""


_REGISTRY: List[object] = []


def register(backend, priority: int) -> None:
    """Add (or replace) a backend; ``"auto"`` tries higher priorities first."""
    global _REGISTRY
    backend.priority = priority
    others = [b for b in _REGISTRY if b.name != backend.name]
    _REGISTRY = sorted(others + [backend], key=lambda b: -b.priority)


def get(name: str):
    """The registered backend called ``name``."""
    check_name(name)
    return next(b for b in _REGISTRY if b.name == name)


def names() -> List[str]:
    return ["auto"] + [b.name for b in _REGISTRY]


def check_name(name) -> str:
    if name not in names():
        raise ValueError(f"backend: expected one of {tuple(names())}, got {name!r}")
    return name


# An LSTM's inference of a padded batch of this many rows or more runs on oneDNN's LSTM (`native`) on the
# CPU, of fewer on the fused kernels (select's docstring has the measurements).
NATIVE_MIN_BATCH = 5


def fused_first(spec: RNNSpec, dtype: torch.dtype, steps: Optional[int] = None, grad: bool = False,
                batch: Optional[int] = None, lengths: bool = False) -> bool:
    """Whether ``"auto"`` tries ``fused`` before ``native`` for this call on the CPU (see select)."""
    if torch.compiler.is_compiling():  # native cannot be traced; and T, B may be symbolic (no guards on them)
        return True
    if spec.mode != "lstm" or steps == 1 or dtype == torch.float64:
        return True
    if batch is not None and batch < NATIVE_MIN_BATCH:
        return True
    if dtype in (torch.bfloat16, torch.float16):
        return grad  # their batched inference, with lengths or not, is oneDNN's
    # float32 padded batches of 5+ rows: training and lengths measured faster where the fused kernels
    # multiply on their own AVX-512 GEMM; on an AVX2-only CPU they read 0.95-1.28 on MKL's GEMM and
    # level (0.96-1.03, training, emulated on Zen 4) on the own AVX2 GEMM
    return (grad or lengths) and _avx512()


def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def select(name: str, spec: RNNSpec, device: torch.device, dtype: torch.dtype, steps: Optional[int] = None,
           grad: bool = False, batch: Optional[int] = None, lengths: bool = False):
    """The backend that will run this call; raises BackendUnavailableError for a named one that can't.

    ``"auto"`` tries the backends by priority, except that on the CPU the fused kernels go before
    torch's own (``native``) wherever they were measured faster. Time of fused ÷ native (AMD EPYC
    Zen 4, 1 thread, H 128-512, B 1-64, T 2-100; float32 unless said): every GRU and RNN (0.2-0.9:
    torch runs them without oneDNN; bfloat16 0.3-0.4), every call that records a graph (``grad``:
    LSTM training 0.8-1.04, 0.44-1.0 at a batch of one; bfloat16 0.34-1.06), every call with
    ``lengths`` (LSTM 0.44-0.89 in training and 0.78-0.97 in inference against torch's on a
    PackedSequence), a call of one time step (the step API), float64 (0.47-0.93: oneDNN has no
    float64 kernel) and an LSTM's inference of a padded batch of up to 4 rows (0.12-0.96 in
    float32, 0.71-1.03 in bfloat16). oneDNN's LSTM keeps the inference of larger padded batches:
    from 16 rows fused takes 0.95-1.03 of its time in float32 and from 8 rows 0.92-1.10 in bfloat16.
    With 2 threads the same (H 256-512, float32): 0.46-0.99 up to 4 rows, 1.00-1.12 from 8 rows, 0.33-0.95
    in training. On a CPU without AVX-512 the fused kernels' float32 LSTM training of padded batches
    read 0.95-1.22 of torch.nn's time on MKL's products, with lengths 0.72-1.28 in inference
    (docs/speed.md, AVX2 EPYC), and 0.96-1.03 in training on the own AVX2 GEMM that they now take
    (the Zen 4 EPYC running the AVX2 code, oneDNN limited to AVX2; not yet measured on a CPU without
    AVX-512): there a float32 LSTM of 5 rows or more stays on oneDNN, as a bfloat16 / float16 LSTM's
    inference of 5 rows or more does everywhere (lengths unmeasured).

    A backend that must be built is built here, by the first call that chooses it (never when it is
    only asked about, as ``backends()`` does); if that fails, ``"auto"`` moves on to the next one.
    """
    check_name(name)
    if name == "auto":
        order = _REGISTRY
        if torch.device(device).type == "cpu" and fused_first(spec, dtype, steps, grad, batch, lengths):
            order = sorted(_REGISTRY, key=lambda b: b.name != "fused")  # stable: the rest keep their order
        for backend in order:
            if _reason(backend, spec, device, dtype, grad) is None and _prepare(backend) is None:
                return backend
        raise BackendUnavailableError("backend='auto': no registered backend can run this call")
    backend = get(name)
    reason = _reason(backend, spec, device, dtype, grad) or _prepare(backend)
    if reason:
        raise BackendUnavailableError(f"backend={name!r} cannot run here: {reason}")
    return backend


def _reason(backend, spec: RNNSpec, device, dtype: torch.dtype, grad: bool) -> Optional[str]:
    """Why ``backend`` cannot run this call, or None: unavailable, the configuration unsupported, or
    (``grad``: a gradient is recorded) its ``training_reason``, for a backend that has one."""
    reason = backend.unavailable_reason() or backend.unsupported_reason(spec, device, dtype)
    training = getattr(backend, "training_reason", None) if grad else None
    return reason or (training(spec, device, dtype) if training is not None else None)


def _prepare(backend) -> Optional[str]:
    """Build what the backend needs (the fused kernels) before its first call; why it failed, or None.
    Nothing is built while torch.compile traces: the op runs, and builds, after tracing."""
    prepare = getattr(backend, "prepare", None)
    if prepare is None or torch.compiler.is_compiling():
        return None
    try:
        prepare()
    except RuntimeError as error:
        return str(error)
    return None


def backends() -> Dict[str, Dict[str, object]]:
    """Every registered backend: whether it can run on this machine (and if not why), and its
    status. Asking builds and loads nothing: the fused kernels report "not built yet" until their
    first use.

    Example:
        >>> rnnkit.backends()["reference"]
        {'available': True, 'reason': None, 'status': 'available'}
    """
    report = {}
    for backend in _REGISTRY:
        reason = backend.unavailable_reason()
        report[backend.name] = {"available": reason is None, "reason": reason, "status": backend.status()}
    return report


register(ReferenceBackend(), priority=0)
register(NativeBackend(), priority=30)
register(FusedCPUBackend(), priority=20)
register(TritonBackend(), priority=25)
