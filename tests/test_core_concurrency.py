"""Concurrency and module lifecycle: a module shared with other processes keeps its one packed
buffer, a change to a weight's memory or layout reaches the very next call (the one-step plans
included), and a used module copies like any other."""
from __future__ import annotations

import copy
import multiprocessing
import warnings

import pytest
import torch
from torch.nn.utils import parametrize

import rnnkit
from helpers import assert_close, flatten

I, H = 4, 8
UNPACKED = "ignore:.*not views of one packed buffer"  # what `p.data = ...` and a parametrization say


def _make(kind: str, backend: str = "auto"):
    return {"lstm": lambda: rnnkit.LSTM(I, H, num_layers=2, backend=backend),
            "gru": lambda: rnnkit.GRU(I, H, layer_norm=True, backend=backend),
            "cell": lambda: rnnkit.LSTMCell(I, H, peephole=True, backend=backend)}[kind]()


def _input(module, steps: int = 3) -> torch.Tensor:
    return torch.randn(2, I) if isinstance(module, rnnkit.LSTMCell) else torch.randn(steps, 2, I)


@pytest.mark.parametrize("kind", ["lstm", "gru", "cell"])
def test_weights_moved_to_shared_memory_stay_one_packed_buffer(kind):
    """torch.multiprocessing moves a storage to shared memory in place when it sends a module to a
    spawned process or a DataLoader worker: the buffer and its views move together, so the
    module keeps computing on its packed buffer (no warning, flat_weights is that buffer)."""
    module = _make(kind)
    x = _input(module)
    for p in module.parameters():
        p.share_memory_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(x)
        flat = module.flat_weights
    assert flat.is_shared() and flat.data_ptr() == next(module.parameters()).data_ptr()
    before = flatten(module(x))
    with torch.no_grad():
        flat.mul_(0.5)  # cuDNN-style code writes the packed buffer
    assert all(not torch.equal(a, b) for a, b in zip(flatten(module(x)), before))


def test_a_spawned_process_updates_a_shared_module():
    """Hogwild (torch.multiprocessing's recipe) with the spawn start method: the parent's
    share_memory() module sees what the child writes into its parameters."""
    module = rnnkit.LSTM(I, H)
    module.share_memory()
    new = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    child = multiprocessing.get_context("spawn").Process(target=torch.nn.Module.load_state_dict, args=(module, new))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    for name, value in module.state_dict().items():
        assert torch.equal(value, new[name]), name


def _transposed(module, name: str) -> None:
    """Transpose a square weight in place: same address, the other layout."""
    p = getattr(module, name)
    p.data = p.data.t()


def _fresh_like(module, make):
    fresh = make()
    fresh.load_state_dict({k: v.contiguous() for k, v in module.state_dict().items()})
    return fresh


# (module, its square weight, a state that makes it count: R multiplies h_0)
SQUARE = {"rnn": (lambda backend: rnnkit.RNN(8, 8, backend=backend), "weight_hh_l0", lambda: torch.randn(1, 2, 8)),
          "lstm": (lambda backend: rnnkit.LSTM(8, 2, backend=backend), "weight_ih_l0", lambda: None),  # W: (8, 8)
          "cell": (lambda backend: rnnkit.RNNCell(8, 8, backend=backend), "weight_hh", lambda: torch.randn(2, 8))}


@pytest.mark.filterwarnings(UNPACKED)
@pytest.mark.parametrize("kind, steps", [(kind, steps) for kind in SQUARE for steps in ((1,) if kind == "cell" else (1, 3))])
@pytest.mark.parametrize("backend", ["reference", "fused", "native"])
def test_a_weight_transposed_in_place_is_read_transposed(backend, kind, steps):
    """``p.data = p.data.t()`` keeps a square weight's address: the next call (training, and the
    one-step plans of inference) computes with the transposed weight, not the packed buffer's
    (to rounding: a product may take another path for a transposed operand)."""
    make, name, state = SQUARE[kind]
    module = make(backend)
    x = (torch.randn(2, 8) if kind == "cell" else torch.randn(steps, 2, 8)).requires_grad_()
    h = state()
    with torch.no_grad():
        module(x, h)  # the one-step plans, where they run, are built here
    _transposed(module, name)
    fresh = _fresh_like(module, lambda: make(backend))
    with torch.no_grad():
        assert_close(flatten(module(x, h)), flatten(fresh(x, h)), "inference")
    out, expected = flatten(module(x, h)), flatten(fresh(x, h))
    assert_close(out, expected, "training")
    grad = torch.autograd.grad(sum(o.sum() for o in out), x)[0]
    assert_close(grad, torch.autograd.grad(sum(e.sum() for e in expected), x)[0], "dx")


@pytest.mark.parametrize("kind, steps", [("rnn", 1), ("rnn", 3), ("cell", 1)])
def test_an_int8_weight_transposed_in_place_is_read_transposed(kind, steps):
    """The same for an int8 module's buffers: the one-step plans (one step) and the general path's kept
    passes (three) are rebuilt for the transposed weight."""
    make = {"rnn": lambda: rnnkit.RNN(8, 8), "cell": lambda: rnnkit.RNNCell(8, 8)}[kind]
    name = "weight_hh_l0" if kind == "rnn" else "weight_hh"
    quantized = rnnkit.quantize(make())
    x = torch.randn(2, 8) if kind == "cell" else torch.randn(steps, 2, 8)
    h = torch.randn(2, 8) if kind == "cell" else torch.randn(1, 2, 8)
    with torch.no_grad():
        quantized(x, h)  # builds the one-step plans
        _transposed(quantized, name)
        fresh = _fresh_like(quantized, lambda: rnnkit.quantize(make()))
        assert_close(flatten(quantized(x, h)), flatten(fresh(x, h)))


def test_an_int8_buffer_narrowed_in_place_is_refused_not_read_as_before():
    """``buffer.data = buffer.data[:n]`` keeps the address and the strides: the plans and passes built for the
    old shape must not run on; the next call checks the buffers and names the one that no longer fits."""
    from rnnkit.errors import MismatchError

    quantized = rnnkit.quantize(rnnkit.LSTM(8, 8))
    x = torch.randn(1, 2, 8)
    with torch.no_grad():
        quantized(x)  # builds the one-step plans
        quantized(torch.randn(3, 2, 8))  # and the passes
        quantized.weight_hh_l0_scale.data = quantized.weight_hh_l0_scale.data[:16]
        for steps in (1, 3):
            with pytest.raises(MismatchError, match=r"weight_hh_l0_scale: expected shape \(32,\)"):
                quantized(torch.randn(steps, 2, 8))


class _Half(torch.nn.Module):
    def forward(self, weight):
        return weight * 0.5


@pytest.mark.filterwarnings(UNPACKED)
@pytest.mark.parametrize("kind", ["lstm", "cell"])
def test_a_used_module_deep_copies_after_a_parametrization(kind):
    """A parametrized module's deepcopy copies its __dict__ as it is (torch's parametrize skips
    __getstate__): the one-step plans a generation loop left there must not make it fail."""
    module = _make(kind)
    x = _input(module, steps=1)
    with torch.no_grad():
        module(x)  # one step: the plans are built and kept
    parametrize.register_parametrization(module, "weight_hh_l0" if kind == "lstm" else "weight_hh", _Half())
    replica = copy.deepcopy(module)
    with torch.no_grad():
        assert all(torch.equal(a, e) for a, e in zip(flatten(replica(x)), flatten(module(x))))
