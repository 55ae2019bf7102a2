"""Comparison helpers shared by the test suite and the benchmark's correctness checks.

One tolerance table: relative RMS error allowed per dtype. Nobody loosens it to make a
comparison pass; a failing comparison is a bug.
"""
from __future__ import annotations

import torch

# relative RMS error allowed, by dtype (1e-5 in fp32, 1e-10 in fp64)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64 on the CPU (the absolute norm when expected is zero)."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom


def assert_close(actual, expected, name: str = "tensor", dtype=None, tol=None) -> None:
    """Assert relative RMS error within the dtype's tolerance; recurses into lists and tuples."""
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{name}: structure differs"
        for k, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{name}[{k}]", dtype, tol)
        return
    if expected is None:
        assert actual is None, f"{name}: expected None"
        return
    assert tuple(actual.shape) == tuple(expected.shape), f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: has NaN"
    limit = tol if tol is not None else TOLERANCE[dtype or expected.dtype]
    err = rel_rms(actual, expected)
    assert err <= limit, f"{name}: relative RMS error {err:.3e} > {limit:.1e}"
