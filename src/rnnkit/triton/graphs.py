"""Run a pass's per-step loop eagerly, or replay it from a CUDA graph captured once per shape.

A loop is ``loop(cfg, buffers)``: per-step GEMMs (``out=``) and Triton launches on the
tensors of ``buffers`` only, allocating nothing, so that it can be captured. On a CUDA
device the first call with a given key (loop, PassConfig, buffer shapes and dtypes) runs
eagerly; the second captures the loop into a ``torch.cuda.CUDAGraph`` over private static
buffers, and it and later calls copy their inputs in, replay the whole sequence as one
launch, and clone the outputs out. A shape met once (an epoch's last, smaller batch) thus
costs no capture and holds no graph. ``RNNKIT_TRITON_GRAPHS_KEPT`` graphs are kept (default
8, least recently used dropped: `graphs_kept`); `release_graphs` drops them all.

Graphs are kept per stream (two streams must not share one graph's static buffers), captured
outside inference mode, in ``capture_error_mode="thread_local"`` (other threads' CUDA calls, a
DataLoader's pin-memory thread, do not invalidate it); a capture that fails anyway is said once
(a RuntimeWarning) and its passes run eagerly. Inside a caller's own capture nothing is captured.

Written without a GPU (issue 6); the test suite runs its logic on CPU with CUDA's graph and stream
calls emulated (tests/test_triton.py), and the loops eagerly under Triton's interpreter. On an H200
(2026-11-28) tests/test_triton.py passed compiled, with capture and without, and a profiled call
(benchmarks/gpu_profile.py) launched one graph a pass: the per-step time at short shapes is the
per-step GEMMs' on the device, not launches. ``RNNKIT_TRITON_CUDA_GRAPHS=0`` turns capture off (eager
per-step launches).
"""
from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from typing import Callable, Dict, Iterable, Optional, Union

import torch

from .. import masks


def graphs_kept() -> int:
    """How many graphs are kept (each holds its static buffers; the least recently used is dropped):
    ``$RNNKIT_TRITON_GRAPHS_KEPT``, default 8, read at each capture (not on import: a bad value must
    not stop ``import rnnkit`` where no graph is ever captured)."""
    value = os.environ.get("RNNKIT_TRITON_GRAPHS_KEPT", "8")
    if not value.strip().isdecimal() or int(value) < 1:
        raise ValueError(f"RNNKIT_TRITON_GRAPHS_KEPT: expected a whole number of graphs, 1 or more, got {value!r}")
    return int(value)


_EAGER = "eager"  # cached for a key whose capture failed: its passes run without a graph
_cache: "OrderedDict[tuple, Union[_Graphed, str]]" = OrderedDict()
_seen: "OrderedDict[tuple, None]" = OrderedDict()  # keys met once (their second call captures), the most recent
_lock = threading.Lock()  # the cache, and one capture at a time
_capture_failure: Optional[str] = None  # the first failed capture's error (warned once)


def error_summary(error: BaseException) -> str:
    """An error in one line for a message said once: its type and first non-empty line (300 characters)."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first[:300]}"


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def graphs_enabled(device: torch.device) -> bool:
    return (
        _on_gpu(device)
        and os.environ.get("RNNKIT_TRITON_CUDA_GRAPHS", "1") != "0"
        and not masks.stream_capturing(device)  # inside a caller's capture: its graph records our launches
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

    def __init__(self, loop: Callable, cfg, buffers: Dict[str, torch.Tensor], device: torch.device):
        self.loop, self.cfg, self.device = loop, cfg, device
        self.lock = threading.Lock()
        # Not inference tensors, even when the first call runs under torch.inference_mode: a later
        # call outside it could not copy its inputs into them (copies into normal tensors are allowed
        # inside inference mode).
        with torch.inference_mode(False):
            self.static = _clone(buffers, buffers)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up: compiles the Triton kernels outside the capture
                loop(cfg, self.static)
            torch.cuda.current_stream(device).wait_stream(side)

    def capture(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        try:
            with torch.inference_mode(False):
                # "thread_local": CUDA calls other threads make meanwhile (a DataLoader's pin-memory thread,
                # NCCL's watchdog) do not invalidate the capture, as they do in the default "global" mode
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                    self.loop(self.cfg, self.static)
        except BaseException:
            torch.cuda.set_stream(stream)  # torch.cuda.graph leaves its capture stream current when capture_end raises
            raise

    def __call__(self, buffers, outputs: Iterable[str], write_only: Iterable[str]) -> Dict[str, torch.Tensor]:
        skip = set(write_only)
        copied = set()  # (static, input) pairs: names that alias one tensor (h and the h entering R without
        # a recurrent mask; the zero tensor standing in for absent biases, peepholes, LN parameters, recurrent
        # mask and W_hr) are copied once, not once a name
        with self.lock:  # two threads on one stream: each one's copy in, replay and copy out in one piece
            for name, value in buffers.items():
                target = self.static[name]
                if name not in skip and (id(target), id(value)) not in copied:
                    copied.add((id(target), id(value)))
                    target.copy_(value)
            self.graph.replay()
            return {**buffers, **_clone(self.static, outputs)}


def _captured(loop: Callable, cfg, buffers: Dict[str, torch.Tensor], device: torch.device) -> Union[_Graphed, str]:
    """A new graph of the loop, or _EAGER where the capture fails: a pass never fails for its graph."""
    global _capture_failure
    graphed = _Graphed(loop, cfg, buffers, device)  # an error in the warm-up is the loop's own: raised
    try:
        graphed.capture()
    except Exception as error:  # noqa: BLE001 (whatever the capture hit, the eager loop can run the pass)
        if _capture_failure is None:
            _capture_failure = error_summary(error)
            warnings.warn(f"rnnkit's triton backend could not capture a CUDA graph ({_capture_failure}); a pass "
                          "whose capture fails runs without one, launching its steps one by one "
                          "(RNNKIT_TRITON_CUDA_GRAPHS=0 turns capture off)", RuntimeWarning, stacklevel=2)
        return _EAGER
    return graphed


def run_loop(loop: Callable, cfg, buffers: Dict[str, torch.Tensor], outputs: Iterable[str],
             write_only: Iterable[str] = ()) -> Dict[str, torch.Tensor]:
    """Run ``loop(cfg, buffers)``; returns the buffers with ``outputs`` holding the results.

    ``outputs`` name the buffers the caller reads afterwards; ``write_only`` those the loop
    writes before reading (not copied into a graph's static buffers).
    """
    device = next(iter(buffers.values())).device
    if not graphs_enabled(device) or cfg.B == 0:  # an empty batch launches nothing: no graph to keep
        loop(cfg, buffers)
        return buffers
    stream = torch.cuda.current_stream(device)
    # keyed by stream: calls on two streams sharing one graph's static buffers would copy into them
    # and replay with nothing ordering one call after the other
    key = (loop.__module__, loop.__qualname__, cfg, device, stream.cuda_stream,
           tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(buffers.items())))
    with _lock:
        graphed = _cache.pop(key, None)
        if graphed is None:
            if key not in _seen:  # a first call: eager, remembered
                _seen[key] = None
                while len(_seen) > 4 * graphs_kept():
                    _seen.popitem(last=False)
            else:
                del _seen[key]
                graphed = _captured(loop, cfg, buffers, device)
        if graphed is not None:
            _cache[key] = graphed
            kept = graphs_kept()
            while len(_cache) > kept:
                _cache.popitem(last=False)
    if graphed is None or graphed is _EAGER:
        loop(cfg, buffers)
        return buffers
    return graphed(buffers, outputs, write_only)


def release_graphs() -> int:
    """Drop every kept CUDA graph and its static buffers (``torch.cuda.empty_cache()`` then returns their
    memory to the device) and forget the shapes met once; returns how many graphs were dropped. Later calls
    capture again as they would have the first time."""
    with _lock:
        dropped = sum(1 for g in _cache.values() if isinstance(g, _Graphed))
        _cache.clear()
        _seen.clear()
    return dropped
