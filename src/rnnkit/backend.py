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


_HALF = (torch.bfloat16, torch.float16)


def select(name: str, spec: RNNSpec, device: torch.device, dtype: torch.dtype, steps: Optional[int] = None,
           grad: bool = False, batch: Optional[int] = None):
    """The backend that will run this call; raises BackendUnavailableError for a named one that can't.

    ``"auto"`` tries the backends by priority, except that on the CPU the fused kernels go first
    for a call of one time step (the step API, generation loops: their per-call cost and
    matrix-vector loops beat oneDNN's; README, "Speed": the step-API rows), for bfloat16 /
    float16 GRUs and RNNs (oneDNN's bfloat16 GRU took 1.0-1.4x torch.nn's float32 time where the
    fused kernels took 0.34-0.43x on an AVX512_BF16 CPU) and for bfloat16 / float16 LSTMs that
    record a graph (``grad``: training; oneDNN's bfloat16 LSTM trained in 0.76-0.92x torch.nn's
    float32 time at stream and wide where the fused kernels took 0.34-0.37x, and 0.45-0.52x
    against its 0.47-0.61x on the other shapes) or run a batch of one (0.41x against 0.52x at
    stream); oneDNN's bfloat16 LSTM inference of batches is 5-15% faster and keeps its place. A backend
    that must be built is built here, by the first call that chooses it (never when it is only
    asked about, as ``backends()`` does); if that fails, ``"auto"`` moves on to the next one.
    """
    check_name(name)
    if name == "auto":
        order = _REGISTRY
        half_first = dtype in _HALF and (spec.mode != "lstm" or grad or batch == 1)
        if torch.device(device).type == "cpu" and (steps == 1 or half_first):
            order = sorted(_REGISTRY, key=lambda b: b.name != "fused")  # stable: the rest keep their order
        for backend in order:
            if (backend.unavailable_reason() is None and backend.unsupported_reason(spec, device, dtype) is None
                    and _prepare(backend) is None):
                return backend
        raise BackendUnavailableError("backend='auto': no registered backend can run this call")
    backend = get(name)
    reason = backend.unavailable_reason() or backend.unsupported_reason(spec, device, dtype) or _prepare(backend)
    if reason:
        raise BackendUnavailableError(f"backend={name!r} cannot run here: {reason}")
    return backend


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
