"""The backend registry: which implementations exist, which can run, and the choice for "auto".

A backend is an object with ``name``, ``unavailable_reason()`` (None when it can run on
this machine), ``unsupported_reason(spec, device, dtype)`` (None when it can run this
configuration) and ``run_pass(cell, x, h0, c0, weights, step_mask, reverse, masks)``,
which must be differentiable. Backends are tried for ``"auto"`` in registration order,
so faster ones are registered first; the reference backend is always last.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .ref import ReferenceBackend
from .spec import RNNSpec


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name and cannot run the call; the message says why."""


_REGISTRY: List[object] = []


def register(backend, *, first: bool = True) -> None:
    """Add a backend; ``first`` puts it ahead of the others for ``backend="auto"``."""
    global _REGISTRY
    others = [b for b in _REGISTRY if b.name != backend.name]
    _REGISTRY = [backend] + others if first else others + [backend]


def names() -> List[str]:
    return ["auto"] + [b.name for b in _REGISTRY]


def check_name(name) -> str:
    if name not in names():
        raise ValueError(f"backend: expected one of {tuple(names())}, got {name!r}")
    return name


def select(name: str, spec: RNNSpec, device: torch.device, dtype: torch.dtype):
    """The backend that will run this call; raises BackendUnavailableError for a named one that can't."""
    check_name(name)
    if name == "auto":
        for backend in _REGISTRY:
            if backend.unavailable_reason() is None and backend.unsupported_reason(spec, device, dtype) is None:
                return backend
        raise BackendUnavailableError("backend='auto': no registered backend can run this call")
    backend = next(b for b in _REGISTRY if b.name == name)
    reason = backend.unavailable_reason() or backend.unsupported_reason(spec, device, dtype)
    if reason:
        raise BackendUnavailableError(f"backend={name!r} cannot run here: {reason}")
    return backend


def backends() -> Dict[str, Dict[str, object]]:
    """Every registered backend: whether it is available on this machine, and if not why.

    Example:
        >>> rnnkit.backends()["reference"]
        {'available': True, 'reason': None}
    """
    report = {}
    for backend in _REGISTRY:
        reason = backend.unavailable_reason()
        report[backend.name] = {"available": reason is None, "reason": reason}
    return report


register(ReferenceBackend(), first=False)
