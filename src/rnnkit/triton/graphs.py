"""Run a pass's per-step loop eagerly, or replay it from a CUDA graph captured once per shape.

A loop is ``loop(cfg, buffers)``: per-step GEMMs (``out=``) and Triton launches on the
tensors of ``buffers`` only, allocating nothing, so that it can be captured. On a CUDA
device the first call with a given key (loop, PassConfig, buffer shapes and dtypes)
captures the loop into a ``torch.cuda.CUDAGraph`` over private static buffers; later calls
copy their inputs in, replay the whole sequence as one launch, and clone the outputs out.

UNTESTED ON HARDWARE: this module was written without a GPU (issue 6); the test suite
runs the loops eagerly under Triton's interpreter. ``RNNKIT_TRITON_CUDA_GRAPHS=0`` turns
capture off (eager per-step launches, the path the interpreter tests cover).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, Dict, Iterable

import torch

_CACHE_SIZE = 8  # graphs kept (each holds its static buffers), least recently used dropped
_cache: "OrderedDict[tuple, _Graphed]" = OrderedDict()


def graphs_enabled(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and os.environ.get("RNNKIT_TRITON_CUDA_GRAPHS", "1") != "0"
        and not torch.cuda.is_current_stream_capturing()
    )


def _clone(buffers: Dict[str, torch.Tensor], names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """Clones of the named buffers; names that alias one tensor get one clone (and stay aliased)."""
    clones: Dict[int, torch.Tensor] = {}
    for name in names:
        tensor = buffers[name]
        if id(tensor) not in clones:
            clones[id(tensor)] = tensor.clone()
    return {name: clones[id(buffers[name])] for name in names}


class _Graphed:
    """One captured loop and the static buffers it reads and writes."""

    def __init__(self, loop: Callable, cfg, buffers: Dict[str, torch.Tensor]):
        self.static = _clone(buffers, buffers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles the Triton kernels outside the capture
            loop(cfg, self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            loop(cfg, self.static)

    def __call__(self, buffers, outputs: Iterable[str], write_only: Iterable[str]) -> Dict[str, torch.Tensor]:
        skip = set(write_only)
        for name, value in buffers.items():
            if name not in skip:
                self.static[name].copy_(value)
        self.graph.replay()
        return {**buffers, **_clone(self.static, outputs)}


def run_loop(loop: Callable, cfg, buffers: Dict[str, torch.Tensor], outputs: Iterable[str],
             write_only: Iterable[str] = ()) -> Dict[str, torch.Tensor]:
    """Run ``loop(cfg, buffers)``; returns the buffers with ``outputs`` holding the results.

    ``outputs`` name the buffers the caller reads afterwards; ``write_only`` those the loop
    writes before reading (not copied into a graph's static buffers).
    """
    device = next(iter(buffers.values())).device
    if not graphs_enabled(device):
        loop(cfg, buffers)
        return buffers
    key = (loop.__module__, loop.__qualname__, cfg, device,
           tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(buffers.items())))
    graphed = _cache.pop(key, None) or _Graphed(loop, cfg, buffers)
    _cache[key] = graphed
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return graphed(buffers, outputs, write_only)
