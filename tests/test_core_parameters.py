"""Parameters that behave like torch.nn's (issue 12): named leaf parameters aliasing one packed buffer.

Every configuration runs on every backend that computes it here, and is checked against the same
code run on its torch.nn twin (the same state_dict) where torch.nn has the configuration, else
against the reference backend. Float64 throughout, so five optimizer steps compare at the
float64 tolerance. The two-process runs (DDP, FSDP2) launch tests/distributed_worker.py.
(The state_dict round trips of every torch.nn module: test_core_params.py.)
"""
from __future__ import annotations

import copy
import math
import os
import pickle
import subprocess
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import distributed_worker
import rnnkit
from helpers import assert_close, flatten
from rnnkit.fused.ops import OPS
from rnnkit.interop._common import torch_pieces
from rnnkit.params import TORCH_PIECES
from rnnkit.passes import BACKWARD_NAMES, FORWARD_NAMES, SLOTS

I, H, P, T, B = 3, 4, 2, 4, 2
F64 = torch.float64


@dataclass(frozen=True)
class Config:
    kit: type
    options: dict = field(default_factory=dict)
    twin: Optional[type] = None  # torch.nn's class, where torch.nn has the configuration
    native: bool = False  # torch's own ops compute it on the CPU


CONFIGS = {
    "lstm": Config(rnnkit.LSTM, {"num_layers": 2}, torch.nn.LSTM, native=True),
    "lstm-peephole-ln": Config(rnnkit.LSTM, {"peephole": True, "layer_norm": True}),
    "lstm-proj": Config(rnnkit.LSTM, {"num_layers": 2, "proj_size": P}, torch.nn.LSTM),  # native refuses it on CPU
    "lstm-sizes": Config(rnnkit.LSTM, {"num_layers": 2, "hidden_size": [H, H + 1]}),
    "lstm-bi": Config(rnnkit.LSTM, {"num_layers": 2, "bidirectional": True}, torch.nn.LSTM, native=True),
    "gru": Config(rnnkit.GRU, {}, torch.nn.GRU, native=True),  # reset_after=True is torch.nn's GRU
    "gru-reset-before": Config(rnnkit.GRU, {"reset_after": False}),
    "rnn-tanh": Config(rnnkit.RNN, {}, torch.nn.RNN, native=True),
    "rnn-relu": Config(rnnkit.RNN, {"nonlinearity": "relu", "num_layers": 2}, torch.nn.RNN, native=True),
}
TWINNED = [name for name, c in CONFIGS.items() if c.twin]


def backends_of(name: str) -> list:
    return ["reference", "fused"] + (["native"] if CONFIGS[name].native else [])


CASES = [pytest.param(name, backend, id=f"{name}-{backend}") for name in CONFIGS for backend in backends_of(name)]


# ---- building and running ----------------------------------------------------------------------

def build(name: str, backend: str, dtype=F64, device=None, seed: int = 0):
    c = CONFIGS[name]
    options = dict(c.options)
    hidden = options.pop("hidden_size", H)
    torch.manual_seed(seed)
    return c.kit(I, hidden, backend=backend, dtype=dtype, device=device, **options)


def make(name: str, backend: str, dtype=F64, seed: int = 0):
    """(rnnkit module with its weights nudged off their init, its torch.nn twin with the same
    state_dict or None)."""
    kit = build(name, backend, dtype, seed=seed)
    with torch.no_grad():  # LN gains off 1 and shifts off 0, so their gradients mean something
        kit.flat_weights.add_(0.1 * torch.randn_like(kit.flat_weights))
    c = CONFIGS[name]
    twin = None
    if c.twin:
        options = dict(c.options)
        twin = c.twin(I, options.pop("hidden_size", H), dtype=dtype, **options)
        twin.load_state_dict(kit.state_dict())
    return kit, twin


def reference_of(kit):
    """The same module on the reference backend: the expectation where torch.nn has no twin."""
    reference = copy.deepcopy(kit)
    reference.backend = "reference"
    return reference


def inputs(seed: int, dtype=F64) -> torch.Tensor:
    """Batch ``seed``: the same values in every dtype (drawn in float64)."""
    return torch.randn(T, B, I, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def loss_of(out, seed: int) -> torch.Tensor:
    """A scalar whose gradients are random upstream gradients on y and every final state."""
    generator = torch.Generator().manual_seed(1000 + seed)
    return sum((t * torch.randn(t.shape, generator=generator, dtype=F64).to(t.dtype)).sum() for t in flatten(out))


def run_step(module, seed: int, cached: bool = False) -> list:
    """Forward and backward on batch ``seed``; the outputs, detached."""
    with parametrize.cached() if cached else nullcontext():
        out = module(inputs(seed, module_dtype(module)))
    loss_of(out, seed).backward()
    return [t.detach() for t in flatten(out)]


def module_dtype(module) -> torch.dtype:
    return next(module.parameters()).dtype


def train(module, optimizer, steps: int = 5, first: int = 10, cached: bool = False) -> list:
    """``steps`` optimizer steps -> per step: the outputs, and {name: (weight after the step, its gradient)}."""
    history = []
    for step in range(first, first + steps):
        optimizer.zero_grad()
        outputs = run_step(module, step, cached)
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
        optimizer.step()
        history.append((outputs, {n: (p.detach().clone(), grads[n]) for n, p in module.named_parameters()}))
    return history


def adamw(module_or_groups):
    params = module_or_groups.parameters() if isinstance(module_or_groups, torch.nn.Module) else module_or_groups
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def assert_same_history(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for step, ((out_a, state_a), (out_e, state_e)) in enumerate(zip(actual, expected)):
        assert_close(out_a, out_e, f"step {step}: outputs")
        assert sorted(state_a) == sorted(state_e), f"step {step}: parameter names"
        for name, (value, grad) in state_e.items():
            assert_close(state_a[name][1], grad, f"step {step}: grad of {name}")
            assert_close(state_a[name][0], value, f"step {step}: {name}")


def expected_history(kit, twin, optimizer_of, steps: int = 5, cached: bool = False) -> list:
    """The trajectory of torch.nn's twin, or of the reference backend where torch.nn lacks the configuration."""
    expectation = twin if twin is not None else reference_of(kit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the expectation's own warnings are not under test here
        return train(expectation, optimizer_of(expectation), steps, cached=cached)


def assert_zero_copy(module) -> None:
    """Every weight is a leaf nn.Parameter whose memory is its slot of flat_weights."""
    flat = module.flat_weights
    assert flat.is_contiguous() and not flat.requires_grad
    size = flat.element_size()
    assert sorted(n for n, _ in module.named_parameters()) == sorted(e.name for e in module.layout)
    for name, p in module.named_parameters():
        entry = module.layout.index[name]
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf, name
        assert p.data_ptr() == flat.data_ptr() + entry.offset * size, f"{name} is not its slot of flat_weights"
        assert p.shape == entry.shape, name


def assert_grads_are_views(module) -> None:
    """Each weight's .grad is its slot of flat_weights.grad: equal values, the same memory."""
    grad = module.flat_weights.grad
    assert grad is not None and grad.shape == module.flat_weights.shape
    size = grad.element_size()
    for name, p in module.named_weights().items():
        entry = module.layout.index[name]
        assert torch.equal(p.grad, module.layout.view(grad, name)), name
        assert p.grad.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr(), f"{name}.grad: own storage"
        assert p.grad.data_ptr() == grad.data_ptr() + entry.offset * size, f"{name}.grad: not its slot"


def ours(caught) -> list:
    """rnnkit's "aliasing broken" warnings among the caught ones."""
    return [w for w in caught if issubclass(w.category, UserWarning) and "flatten_parameters" in str(w.message)]


def torch_order(module) -> list:
    """Parameter names as torch.nn registers them, rnnkit's extras after."""
    entries = module.layout.entries
    return [e.name for e in entries if e.piece in TORCH_PIECES] + [e.name for e in entries if e.piece not in TORCH_PIECES]


# ---- 1. the torch.nn parameter idioms --------------------------------------------------------------

def init_by_name(module, seed: int) -> list:
    """The everyday loop: orthogonal recurrent matrices, found by name."""
    torch.manual_seed(seed)
    touched = []
    for n, p in module.named_parameters():
        if "weight_hh" in n:
            torch.nn.init.orthogonal_(p)
            touched.append(n)
    return touched


def grouped(module):
    """The everyday recipe: no weight decay on biases and 1-D gains, a lower learning rate for the
    recurrent matrices -> ({group: names}, optimizer param groups)."""
    groups = {"decay": [], "no_decay": [], "recurrent": []}
    for n, p in module.named_parameters():
        key = "recurrent" if "weight_hh" in n else "no_decay" if ("bias" in n or p.dim() == 1) else "decay"
        groups[key].append((n, p))
    names = {key: [n for n, _ in members] for key, members in groups.items()}
    params = {key: [p for _, p in members] for key, members in groups.items()}
    return names, [{"params": params["decay"]}, {"params": params["no_decay"], "weight_decay": 0.0},
                   {"params": params["recurrent"], "lr": 3e-3}]


@pytest.mark.parametrize("name,backend", CASES)
def test_init_by_name_and_param_groups_train_as_torch_nn(name, backend):
    kit, twin = make(name, backend)
    assert [n for n, _ in kit.named_parameters()] == torch_order(kit)
    touched = init_by_name(kit, seed=3)
    assert touched == [n for n in torch_order(kit) if n.startswith("weight_hh")] and touched
    for n in touched:  # orthogonal, and in the buffer the kernels read
        p = getattr(kit, n)
        assert_close(p.T @ p, torch.eye(p.shape[1], dtype=F64), f"{n}: columns orthonormal")
        assert torch.equal(kit.layout.view(kit.flat_weights, n), p), n
    names, groups = grouped(kit)
    assert sorted(sum(names.values(), [])) == sorted(kit.named_weights())  # each weight in exactly one group
    assert names["no_decay"] and all(n.startswith(("bias", "layer_norm")) for n in names["no_decay"])
    if twin is not None:
        assert init_by_name(twin, seed=3) == touched
        assert grouped(twin)[0] == names
    start = {n: p.detach().clone() for n, p in kit.named_parameters()}
    expected = expected_history(kit, twin, lambda m: adamw(grouped(m)[1]))
    actual = train(kit, adamw(groups))
    assert_same_history(actual, expected)
    for n, p in kit.named_parameters():
        assert not torch.equal(p, start[n]), f"{n} did not train"
    assert kit.last_backend == backend
    assert_zero_copy(kit)


# ---- 2. requires_grad_(False) ------------------------------------------------------------------------

@pytest.mark.parametrize("name,backend", CASES)
def test_frozen_weight_hh_stays_bit_identical_under_adamw(name, backend):
    kit, twin = make(name, backend)
    for module in filter(None, (kit, twin)):
        module.weight_hh_l0.requires_grad_(False)
    start = {n: p.detach().clone() for n, p in kit.named_parameters()}
    expected = expected_history(kit, twin, adamw)
    actual = train(kit, adamw(kit))  # weight decay 0.1: it would move the weight if AdamW saw it
    for step, (_, state) in enumerate(actual):
        assert state["weight_hh_l0"][1] is None, f"step {step}: the frozen weight got a gradient"
    assert kit.weight_hh_l0.grad is None
    assert torch.equal(kit.weight_hh_l0, start["weight_hh_l0"])
    assert torch.equal(kit.layout.view(kit.flat_weights, "weight_hh_l0"), start["weight_hh_l0"])
    for n, p in kit.named_parameters():
        if n != "weight_hh_l0":
            assert not torch.equal(p, start[n]), f"{n} did not train"
    assert_same_history(actual, expected)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_backward_skips_frozen_recurrent_matrices(name, monkeypatch):
    """The issue: "the fused kernels skip work for frozen weights where that is cheap": with every
    weight_hh frozen, no backward pass is asked for dR."""
    kit, _ = make(name, "fused")
    for n, p in kit.named_parameters():
        if "weight_hh" in n:
            p.requires_grad_(False)
    asked = []
    backward = OPS.backward_impl

    def recording(*values):
        asked.append(values[BACKWARD_NAMES.index("need_dR")])
        return backward(*values)

    monkeypatch.setattr(OPS, "backward_impl", recording)
    run_step(kit, 1)
    assert len(asked) == kit.spec.num_layers * kit.spec.num_directions
    assert not any(asked), f"need_dR per pass: {asked}"


# ---- 3. hooks and gradients --------------------------------------------------------------------------

def expected_grads(kit, twin, seed: int) -> dict:
    expectation = twin if twin is not None else reference_of(kit)
    names, params = zip(*expectation.named_parameters())
    out = expectation(inputs(seed))
    return dict(zip(names, torch.autograd.grad(loss_of(out, seed), params)))


@pytest.mark.parametrize("name,backend", CASES)
def test_hooks_fire_once_and_grads_are_slices_of_the_packed_gradient(name, backend):
    kit, twin = make(name, backend)
    expected = [expected_grads(kit, twin, seed) for seed in (1, 2, 3)]
    calls = {n: [] for n, _ in kit.named_parameters()}
    for n, p in kit.named_parameters():
        p.register_hook(lambda g, n=n: calls[n].append(g.detach().clone()))
    optimizer = torch.optim.SGD(kit.parameters(), lr=0.1)

    run_step(kit, 1)
    for n, p in kit.named_parameters():
        assert len(calls[n]) == 1, f"{n}: hook fired {len(calls[n])} times in one backward"
        assert_close(calls[n][0], expected[0][n], f"{n}: hook's gradient")
        assert_close(p.grad, expected[0][n], f"{n}.grad")
    assert_grads_are_views(kit)

    run_step(kit, 2)  # no zero_grad: the gradients accumulate
    for n, p in kit.named_parameters():
        assert len(calls[n]) == 2, f"{n}: hook fired {len(calls[n])} times in two backwards"
        assert_close(calls[n][1], expected[1][n], f"{n}: hook's second gradient")
        assert_close(p.grad, expected[0][n] + expected[1][n], f"{n}.grad accumulated")
    assert_grads_are_views(kit)

    optimizer.zero_grad()  # set_to_none
    assert all(p.grad is None for p in kit.parameters()) and kit.flat_weights.grad is None
    run_step(kit, 3)
    for n, p in kit.named_parameters():
        assert_close(p.grad, expected[2][n], f"{n}.grad after zero_grad")
    assert_grads_are_views(kit)


# ---- 4. parametrizations -----------------------------------------------------------------------------

PARAMETRIZATIONS = {
    "weight_norm": lambda m: weight_norm(m, "weight_hh_l0"),
    "spectral_norm": lambda m: spectral_norm(m, "weight_hh_l0"),
}
# torch.nn's twin where it has the configuration; else the fused kernels against the reference backend
PARAMETRIZED_CASES = [
    pytest.param(name, backend, kind, id=f"{name}-{backend}-{kind}")
    for kind in PARAMETRIZATIONS
    for name in CONFIGS
    for backend in (backends_of(name) if CONFIGS[name].twin else ["fused"])
]


@pytest.mark.parametrize("name,backend,kind", PARAMETRIZED_CASES)
def test_parametrized_weight_hh_trains_as_the_reference_and_flatten_restores_zero_copy(name, backend, kind):
    kit, twin = make(name, backend)
    twin = twin if twin is not None else reference_of(kit)
    for module in (kit, twin):
        torch.manual_seed(4)  # spectral_norm draws its power-iteration vectors here
        PARAMETRIZATIONS[kind](module)
    # torch.nn's LSTM reads each parametrized weight 4 times a forward (each a power iteration of
    # spectral_norm); parametrize.cached() makes it once on both sides, so the two compute the same
    cached = kind == "spectral_norm"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(kit, adamw(kit), steps=3, cached=cached)
    assert len(ours(caught)) == 1, [str(w.message) for w in ours(caught)]
    expected = expected_history(kit, twin, adamw, steps=3, cached=cached)
    assert any(n.startswith("parametrizations.weight_hh_l0.original") for n in actual[0][1])
    assert_same_history(actual, expected)

    for module in (kit, twin):
        parametrize.remove_parametrizations(module, "weight_hh_l0")
    kit.flatten_parameters()
    assert_zero_copy(kit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(kit, adamw(kit), steps=2)
    assert not ours(caught), "warned after flatten_parameters"
    assert_same_history(actual, expected_history(kit, twin, adamw, steps=2))
    assert_grads_are_views(kit)


@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_flat_weights_of_a_parametrized_module_is_a_quiet_copy(kind):
    """flat_weights while weight_hh_l0 is parametrized: the current weights packed (a copy, as
    documented), with rnnkit's one warning and no other."""
    kit, _ = make("lstm", "fused")
    PARAMETRIZATIONS[kind](kit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one warning: checked in the test above
        run_step(kit, 1)
    # spectral_norm's weight moves on at every read in training (one power iteration): read it once
    with warnings.catch_warnings(record=True) as caught, torch.nn.utils.parametrize.cached():
        warnings.simplefilter("always")
        flat = kit.flat_weights
        with torch.no_grad():
            for n in kit.layout.index:
                assert_close(kit.layout.view(flat, n), getattr(kit, n), n)
    others = [str(w.message)[:120] for w in caught if w not in ours(caught)]
    assert not others, others


def test_a_pruned_module_trains_as_torch_nns_and_is_read_as_it_computes():
    """torch.nn.utils.prune (its forward pre-hook, mask and ``_orig`` parameter) trains as on
    torch.nn's LSTM; between forwards, after an optimizer step, the module's weights as converters,
    flat_weights and named_weights read them are orig * mask (what the next forward computes with),
    not the attribute prune's hook set at the last forward; a forward computes with what the hooks
    left (a later hook's edit of the masked weight too); prune.remove leaves them in place."""
    prune = pytest.importorskip("torch.nn.utils.prune")
    kit, twin = make("lstm", "fused")
    masks = {}
    for module in (kit, twin):
        torch.manual_seed(3)
        prune.random_unstructured(module, "weight_hh_l0", 0.5)
        prune.l1_unstructured(module, "weight_ih_l0", 0.3)
        masks[module] = module.weight_hh_l0_mask
    assert torch.equal(masks[kit], masks[twin])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that the pruned weights run unpacked
        assert_same_history(train(kit, adamw(kit), steps=2), expected_history(kit, twin, adamw, steps=2))
        masked = (kit.weight_hh_l0_orig * kit.weight_hh_l0_mask).detach()
        assert not torch.equal(kit.weight_hh_l0.detach(), masked)  # stale: the last step came after the forward
        assert torch.equal(kit.named_weights()["weight_hh_l0"].detach(), masked)
        assert torch.equal(kit.layout.view(kit.flat_weights, "weight_hh_l0"), masked)
        assert torch.equal(torch_pieces(kit)["weight_hh_l0"], masked)  # every converter's reading
        for module in (kit, twin):  # a later hook that edits the masked weight (noise, fake quantization): the
            module.register_forward_pre_hook(  # forward computes with what the hooks left, as torch.nn's
                lambda m, args: setattr(m, "weight_hh_l0", m.weight_hh_l0 * 0.5))
        assert_close(run_step(kit, 21), run_step(twin, 21), "with a hook after prune's")
        kit._forward_pre_hooks.popitem(), twin._forward_pre_hooks.popitem()
        prune.remove(kit, "weight_hh_l0"), prune.remove(kit, "weight_ih_l0")
        assert torch.equal(kit.weight_hh_l0.detach(), masked)
        kit.flatten_parameters()
        assert_close(run_step(kit, 20), run_step(twin, 20), "after prune.remove")


# ---- aliasing broken by hand, and flatten_parameters -------------------------------------------------

def _rebind_data(module):
    module.weight_ih_l0.data = module.weight_ih_l0.detach() + 0.5


def _assign_state(module):
    module.load_state_dict({k: v + 0.5 for k, v in module.state_dict().items()}, assign=True)


def _set_(module):
    with torch.no_grad():
        module.weight_ih_l0.set_(module.weight_ih_l0.detach() + 0.5)


BREAKERS = {"p.data": _rebind_data, "assign": _assign_state, "set_": _set_}
BREAKER_CASES = [pytest.param(name, backend, "p.data", id=f"{name}-{backend}-p.data") for name in CONFIGS
                 for backend in backends_of(name)]
BREAKER_CASES += [pytest.param(name, "fused", breaker, id=f"{name}-fused-{breaker}") for breaker in ("assign", "set_")
                  for name in CONFIGS]


@pytest.mark.parametrize("name,backend,breaker", BREAKER_CASES)
def test_broken_aliasing_warns_once_computes_right_and_flatten_repacks(name, backend, breaker):
    kit, twin = make(name, backend)
    expectation = twin if twin is not None else reference_of(kit)
    BREAKERS[breaker](kit)
    expectation.load_state_dict(kit.state_dict())
    optimizer, expectation_optimizer = adamw(kit), adamw(expectation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(kit, optimizer, steps=2)
        flat = kit.flat_weights  # a copy while broken: the current weights, packed
    assert len(ours(caught)) == 1, [str(w.message) for w in ours(caught)]
    for n, p in kit.named_weights().items():
        assert torch.equal(kit.layout.view(flat, n), p), n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same_history(actual, train(expectation, expectation_optimizer, steps=2))

    kit.flatten_parameters()  # the optimizer goes on with the same Parameter objects
    assert_zero_copy(kit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(kit, optimizer, steps=2, first=20)
    assert not ours(caught), "warned after flatten_parameters"
    assert_grads_are_views(kit)
    assert_same_history(actual, train(expectation, expectation_optimizer, steps=2, first=20))


# ---- 5. torch.func and safetensors -------------------------------------------------------------------

def _perturbed(module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module


@pytest.mark.parametrize("name,backend", CASES)
def test_functional_call_with_torch_nn_names(name, backend):
    kit, twin = make(name, backend)
    own = {n: p.detach().clone() for n, p in kit.named_parameters()}
    y_own = [t.detach() for t in flatten(kit(inputs(1)))]
    source = _perturbed(copy.deepcopy(twin if twin is not None else reference_of(kit)))
    params = dict(source.named_parameters())  # torch.nn's names; the twin's own Parameters
    expected = copy.deepcopy(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # whether it warns: test_functional_call_does_not_warn
        out = torch.func.functional_call(kit, params, (inputs(1),))
    loss_of(out, 1).backward()
    loss_of(expected(inputs(1)), 1).backward()
    assert_close(flatten(out), flatten(expected(inputs(1))), "outputs")
    for n, p in params.items():
        assert_close(p.grad, dict(expected.named_parameters())[n].grad, f"grad of {n} through functional_call")
    assert all(p.grad is None for p in kit.parameters())
    for n, p in kit.named_parameters():  # the module itself is untouched
        assert torch.equal(p, own[n]), n
    assert_zero_copy(kit)
    assert_close([t.detach() for t in flatten(kit(inputs(1)))], y_own, "outputs after functional_call")


@pytest.mark.parametrize("backend", ["reference", "fused", "native"])
def test_functional_call_does_not_warn_and_a_later_break_still_does(backend):
    """functional_call swaps parameters for one call: nothing is broken, so no "call
    flatten_parameters()" warning, and the one warning is still there for a real break."""
    kit, twin = make("lstm", backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.func.functional_call(kit, dict(twin.named_parameters()), (inputs(1),))
        torch.func.functional_call(kit, {n: p.detach() for n, p in twin.named_parameters()}, (inputs(1),))
        kit(inputs(1))
    assert not ours(caught), [str(w.message) for w in ours(caught)]
    _rebind_data(kit)
    with pytest.warns(UserWarning, match="flatten_parameters"):
        kit(inputs(1))


@pytest.mark.parametrize("steps", [1, 4])
def test_a_call_without_a_gradient_warns_of_a_break_as_training_does(steps):
    """Calls without a gradient run on the plans (nn.planned_call), not through _pass_weights: they
    say just the same once the weights stopped aliasing the packed buffer (p.data = ...), once."""
    kit, _ = make("lstm", "fused")
    x = torch.randn(steps, 2, kit.input_size, dtype=F64)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        kit(x)
        _rebind_data(kit)
        kit(x)
        kit(x)
    assert len(ours(caught)) == 1, [str(w.message) for w in ours(caught)]
    assert "_plan" in kit.__dict__  # the plans ran the calls


ENSEMBLE_CASES = [pytest.param(name, backend, id=f"{name}-{backend}") for name in CONFIGS
                  for backend in ("reference", "fused")]
# torch's own RNN ops have no vmap rule (torch.nn's LSTM fails under vmap too); "auto" is what a user
# writes, and should pick a backend that runs under vmap
ENSEMBLE_CASES += [pytest.param(name, "auto", id=f"{name}-auto") for name in ("lstm", "gru")]


@pytest.mark.parametrize("name,backend", ENSEMBLE_CASES)
def test_stack_module_state_and_vmap_ensemble(name, backend):
    members = [make(name, backend, seed=seed)[0] for seed in range(3)]
    params, buffers = torch.func.stack_module_state(members)
    assert list(params) == [n for n, _ in members[0].named_parameters()]
    for n, p in members[0].named_parameters():
        assert params[n].shape == (3, *p.shape), n
    base = copy.deepcopy(members[0]).to("meta")
    x = inputs(1)
    generator = torch.Generator().manual_seed(2)  # drawn outside vmap, which refuses random ops
    upstream = [torch.randn(t.shape, generator=generator, dtype=F64) for t in flatten(members[0](x))]

    def member(p, b, x):
        return tuple(flatten(torch.func.functional_call(base, (p, b), (x,))))

    def member_loss(p, b, x):
        return sum((o * u).sum() for o, u in zip(member(p, b, x), upstream))

    out = torch.vmap(member, in_dims=(0, 0, None))(params, buffers, x)
    grads = torch.vmap(torch.func.grad(member_loss), in_dims=(0, 0, None))(params, buffers, x)
    for k, m in enumerate(members):
        expected = flatten(m(x))
        assert_close([o[k] for o in out], [e.detach() for e in expected], f"member {k}: outputs")
        names, weights = zip(*m.named_parameters())
        loss = sum((o * u).sum() for o, u in zip(expected, upstream))
        for n, g in zip(names, torch.autograd.grad(loss, weights)):
            assert_close(grads[n][k], g, f"member {k}: grad of {n}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_safetensors_round_trip(name, tmp_path):
    from safetensors.torch import load_file, load_model, save_file, save_model

    kit, twin = make(name, "reference")
    save_model(kit, str(tmp_path / "model.safetensors"))
    fresh = build(name, "reference", seed=1)
    missing, unexpected = load_model(fresh, str(tmp_path / "model.safetensors"))
    assert not missing and not unexpected
    for n, p in kit.named_parameters():
        assert torch.equal(getattr(fresh, n), p), n
    assert_zero_copy(fresh)
    assert_close(flatten(fresh(inputs(1))), flatten(kit(inputs(1))), "outputs after load_model")

    save_file(kit.state_dict(), str(tmp_path / "state.safetensors"))
    loaded = load_file(str(tmp_path / "state.safetensors"))
    state = kit.state_dict()
    assert sorted(loaded) == sorted(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    if twin is not None:
        reference = copy.deepcopy(twin)
        _perturbed(reference).load_state_dict(loaded, strict=True)
        assert_close(flatten(reference(inputs(1))), flatten(kit(inputs(1))), "torch.nn from the file")


@pytest.mark.parametrize("parametrize_", [
    pytest.param(lambda m: weight_norm(m, "weight_ih_l0"), id="weight_norm-first_piece"),
    pytest.param(lambda m: weight_norm(m, "weight_hh_l1"), id="weight_norm"),
    pytest.param(lambda m: parametrize.register_parametrization(m, "weight_hh_l0", _Clamp()), id="no_right_inverse"),
])
def test_safetensors_saves_a_parametrized_module(parametrize_, tmp_path):
    """A parametrization keeps a view of the packed buffer (its original, or weight_norm's direction);
    save_model takes the module as it takes torch.nn's, and load_model gives it back."""
    from safetensors.torch import load_model, save_model

    torch.manual_seed(0)
    kit = rnnkit.LSTM(4, 5, num_layers=2, peephole=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weights are no longer one packed buffer's views: said once
        parametrize_(kit)
        save_model(kit, str(tmp_path / "model.safetensors"))
        fresh = rnnkit.LSTM(4, 5, num_layers=2, peephole=True)
        parametrize_(fresh)
        missing, unexpected = load_model(fresh, str(tmp_path / "model.safetensors"))
        assert not missing and not unexpected
        x = torch.randn(3, 2, 4)
        assert torch.equal(fresh(x)[0], kit(x)[0])
    state = kit.state_dict()
    originals = [k for k in state if k.startswith("parametrizations.")]
    assert originals
    for key in originals:
        value = state[key]
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), key  # its own storage
        assert value.data_ptr() == kit.get_parameter(key).data_ptr(), key  # still the module's memory


class _Clamp(torch.nn.Module):
    def forward(self, w):
        return w.clamp(-0.1, 0.1)


# ---- 6. DDP and FSDP2, two processes -----------------------------------------------------------------

@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    """Run tests/distributed_worker.py under torchrun once: 2 processes, gloo, CPU."""
    import socket

    out = tmp_path_factory.mktemp("distributed")
    logs = out / "logs"  # each rank's own output: torchrun's summary alone hides why a rank died
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = Path(__file__).resolve().parent
    package_root = Path(rnnkit.__file__).resolve().parent.parent  # the rnnkit under test, in the workers too
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(package_root), str(here), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--log-dir", str(logs),
               "--tee", "3", "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(here / "distributed_worker.py"), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    ranks = "".join(f"--- {log.relative_to(logs)}\n{log.read_text()[-2000:]}\n" for log in sorted(logs.rglob("*.log")))
    assert result.returncode == 0, ranks + result.stderr[-2000:]
    return out


@pytest.mark.parametrize("case", list(distributed_worker.CASES))
@pytest.mark.parametrize("wrapper", distributed_worker.WRAPPERS)
def test_two_processes_match_one(two_process_results, wrapper, case):
    two = torch.load(two_process_results / f"{wrapper}-{case}.pt")
    one = distributed_worker.train(distributed_worker.build(case), case)
    assert two["backend"] == one["backend"]
    for step, (g2, g1) in enumerate(zip(two["grads"], one["grads"])):
        assert sorted(g2) == sorted(g1)
        for n in g1:
            assert_close(g2[n], g1[n], f"step {step}: grad of {n}")
    for n, value in one["params"].items():
        assert_close(two["params"][n], value, n)


# ---- 7. no copy of the packed buffer -----------------------------------------------------------------

def _pointers(tensors) -> tuple:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


NO_COPY_CASES = [pytest.param(name, backend, id=f"{name}-{backend}") for name in CONFIGS
                 for backend in backends_of(name) if backend != "reference"]


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("name,backend", NO_COPY_CASES)
def test_kernels_take_the_packed_buffer_without_a_copy(name, backend, grad, monkeypatch):
    kit, _ = make(name, backend, dtype=torch.float32)  # float32: oneDNN's own path for native
    assert_zero_copy(kit)
    weights = kit.layout.group(kit.named_weights())  # PassWeights per layer-direction
    calls = []
    if backend == "fused":
        forward, backward = OPS.forward_impl, OPS.backward_impl
        first = FORWARD_NAMES.index(SLOTS[0])
        blocks = []

        def recording_forward(*values):
            calls.append(("forward", _pointers(values[first:first + len(SLOTS)])))
            return forward(*values)

        def recording_backward(*values):
            calls.append(("backward", _pointers(values[first:first + len(SLOTS)])))
            out = backward(*values)
            blocks.append(out[3])
            return out

        def recording_plans(spec, passes, *args):  # a call without a gradient runs on the plans (nn.planned_call)
            calls.extend(("forward", _pointers(w)) for w in passes)
            return plans(spec, passes, *args)

        plans = rnnkit.nn.step_plans
        monkeypatch.setattr(OPS, "forward_impl", recording_forward)
        monkeypatch.setattr(OPS, "backward_impl", recording_backward)
        monkeypatch.setattr(rnnkit.nn, "step_plans", recording_plans)
        expected = sorted(_pointers(w) for w in weights)
    else:
        op_name = kit.spec.mode
        op = getattr(torch._VF, op_name)

        def recording_op(*args):
            calls.append(("forward", _pointers(args[2])))
            return op(*args)

        monkeypatch.setattr(torch._VF, op_name, recording_op)
        expected = [_pointers([getattr(kit, n) for n in torch_order(kit)])]

    with torch.set_grad_enabled(grad):
        out = kit(inputs(1, torch.float32))
    assert kit.last_backend == backend
    assert sorted(p for kind, p in calls if kind == "forward") == expected, "a kernel got a copy of the weights"
    if not grad:
        return
    loss_of(out, 1).backward()
    assert_grads_are_views(kit)
    if backend != "fused":
        return
    assert sorted(p for kind, p in calls if kind == "backward") == expected, "a backward got a copy of the weights"
    if kit.spec.num_layers == 1 and kit.spec.num_directions == 1:  # the kernel's gradient block IS flat_weights.grad
        block = blocks[0]
        assert kit.flat_weights.grad.data_ptr() == block.data_ptr(), "the packed gradient is a copy of the kernel's"
        for n, p in kit.named_parameters():
            assert p.grad.untyped_storage().data_ptr() == block.untyped_storage().data_ptr(), n


# ---- 8. what stays: state_dicts, conversions, copies, meta construction ------------------------------

@pytest.mark.parametrize("name", TWINNED)
def test_torch_nn_state_dicts_load_both_ways_and_keep_the_aliasing(name):
    kit, twin = make(name, "reference")
    _perturbed(twin)
    fresh = build(name, "reference", seed=1)
    result = fresh.load_state_dict(twin.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert_zero_copy(fresh)
    assert list(fresh.state_dict()) == list(twin.state_dict())
    for key, value in twin.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    back = _perturbed(copy.deepcopy(twin))
    back.load_state_dict(kit.state_dict(), strict=True)
    for key, value in kit.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert_close(flatten(fresh(inputs(1))), flatten(twin(inputs(1))), "outputs")


CONVERSIONS = {
    "to-float64": lambda m: m.to(torch.float64),
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
}


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_conversions_and_copies_keep_the_aliasing(name, conversion):
    kit, _ = make(name, "auto", dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in kit.named_parameters()}
    expected = reference_of(kit).double()
    converted = CONVERSIONS[conversion](kit)
    dtype = module_dtype(converted)
    assert converted.flat_weights.dtype == dtype
    assert_zero_copy(converted)
    for n, value in before.items():
        assert torch.equal(getattr(converted, n), value.to(dtype)), n
    y = run_step(converted, 1)
    assert_grads_are_views(converted)
    expected_y = [t.detach() for t in flatten(expected(inputs(1)))]
    assert_close([t.double() for t in y], expected_y, "outputs", dtype=dtype)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_construction_to_empty_reset_parameters(name):
    module = build(name, "reference", device="meta")
    assert all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")
    torch.manual_seed(5)
    module.reset_parameters()
    assert_zero_copy(module)
    spec = module.spec
    uniform = []
    for n, value in module.named_weights().items():
        entry = module.layout.index[n]
        if entry.piece.startswith("layer_norm_"):
            assert torch.all(value == (1.0 if entry.piece.endswith("_weight") else 0.0)), n
            continue
        bound = spec.hidden_sizes[entry.layer] ** -0.5
        assert value.abs().max() <= bound and value.std() > 0, n
        uniform.append((value.detach() / bound).flatten())
    uniform = torch.cat(uniform).sort().values  # should be U(-1, 1): Kolmogorov-Smirnov at p = 0.001
    n = uniform.numel()
    cdf = (uniform + 1) / 2
    steps = torch.arange(n + 1, dtype=F64) / n
    distance = torch.maximum(steps[1:] - cdf, cdf - steps[:-1]).max()
    assert distance < 1.95 / n**0.5, f"the weights are not uniform in ±1/sqrt(H): KS distance {distance:.3f}, n={n}"
    c = CONFIGS[name]
    if c.twin is not None:  # torch.nn's own draws, under the same seed
        options = dict(c.options)
        twin = c.twin(I, options.pop("hidden_size", H), dtype=F64, device="meta", **options)
        twin.to_empty(device="cpu")
        torch.manual_seed(5)
        twin.reset_parameters()
        for key, value in twin.state_dict().items():
            assert torch.equal(module.state_dict()[key], value), key
    run_step(module, 1)
    assert_grads_are_views(module)


# ---- torch.nn's attributes, read at every call --------------------------------------------

ATTRIBUTE_TWINS = [
    (lambda: torch.nn.LSTM(I, H, num_layers=2, dropout=0.5, dtype=F64),
     lambda: rnnkit.LSTM(I, H, num_layers=2, dropout=0.5, dtype=F64)),
    (lambda: torch.nn.GRU(I, H, dtype=F64), lambda: rnnkit.GRU(I, H, dtype=F64)),
    (lambda: torch.nn.RNN(I, H, dtype=F64), lambda: rnnkit.RNN(I, H, dtype=F64)),
]


@pytest.mark.parametrize("twins", ATTRIBUTE_TWINS, ids=["lstm", "gru", "rnn"])
def test_attributes_set_after_construction_take_effect_as_in_torch_nn(twins):
    """m.dropout = 0 (a schedule), m.batch_first = True, rnn.nonlinearity = 'relu': torch.nn reads
    them at every call; rnnkit kept copies that nothing read, so they quietly did nothing."""
    torch.manual_seed(0)
    ours, theirs = twins[1](), twins[0]()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(T, B, I, dtype=F64)
    ours.dropout = theirs.dropout = 0.0
    assert_close(ours(x)[0], theirs(x)[0])  # training mode: dropout off now, so equal
    ours.batch_first = theirs.batch_first = True
    assert_close(ours(x)[0], theirs(x)[0])
    for name in ("mode", "input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional",
                 "proj_size"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_a_new_nonlinearity_takes_effect_in_every_path():
    """torch.nn.RNNCell reads nonlinearity at every call; torch.nn.RNN reads the mode it set at
    construction, so there setting it quietly does nothing: rnnkit's RNN takes it, as its cell."""
    torch.manual_seed(0)
    x = torch.randn(T, B, I, dtype=F64)
    for value in ("relu", "tanh", "relu"):
        theirs = torch.nn.RNN(I, H, nonlinearity=value, dtype=F64)
        ours = rnnkit.RNN(I, H, nonlinearity="relu" if value == "tanh" else "tanh", dtype=F64)
        ours.load_state_dict(theirs.state_dict())
        ours.nonlinearity = value
        assert ours.mode == theirs.mode and ours.nonlinearity == value
        assert_close(ours(x)[0], theirs(x)[0])
        theirs_cell, ours_cell = torch.nn.RNNCell(I, H, dtype=F64), rnnkit.RNNCell(I, H, dtype=F64)
        ours_cell.load_state_dict(theirs_cell.state_dict())
        ours_cell(x[0])  # the first call builds its one-step plan with the old function
        ours_cell.nonlinearity = theirs_cell.nonlinearity = value
        assert_close(ours_cell(x[0]), theirs_cell(x[0]))
        with torch.no_grad():  # the one-step plan of an inference call, rebuilt for the new function
            assert_close(ours_cell(x[0]), theirs_cell(x[0]))


# (option, value at construction, the value set later): each set value must act as if the module
# had been built with it (same outputs in training under one seed, on a fresh twin)
RNNKIT_SETTABLE = [
    ("zoneout", 0.5, 0.0), ("zoneout", 0.0, [0.2, 0.3]), ("input_dropout", 0.4, 0.0), ("recurrent_dropout", 0.0, 0.3),
    ("dropconnect", 0.5, 0.1), ("cell_clip", 0.05, None), ("proj_clip", None, 0.1),
]


@pytest.mark.parametrize("name,before,after", RNNKIT_SETTABLE, ids=[f"{n}-{a}" for n, _, a in RNNKIT_SETTABLE])
@pytest.mark.parametrize("cell", [False, True], ids=["stack", "cell"])
def test_rnnkit_options_set_after_construction_take_effect(name, before, after, cell):
    """m.zoneout = 0 for fine-tuning, m.recurrent_dropout = 0.3 in a schedule: kept as plain
    attributes that nothing read, so the old masks were still drawn, silently."""
    if cell and name in ("input_dropout", "recurrent_dropout", "dropconnect"):
        module = rnnkit.LSTMCell(I, H, proj_size=3)
        assert not hasattr(module, name) and not hasattr(module, "dropout")  # as torch.nn's cells
        with pytest.raises(AttributeError, match=f"LSTMCell.{name}: a per-sequence option"):
            setattr(module, name, after or 0.5)
        setattr(module, name, 0)  # the off value: nothing to refuse
        return
    make = (lambda **kw: rnnkit.LSTMCell(I, H, proj_size=3, dtype=F64, **kw)) if cell else \
        (lambda **kw: rnnkit.LSTM(I, H, num_layers=2, proj_size=3, dtype=F64, **kw))
    module, twin = make(**{name: before}), make(**{name: after})
    twin.load_state_dict(module.state_dict())
    with torch.no_grad():  # one-step plans and the general path built with the old value first
        module.eval()(torch.randn(B, I, dtype=F64) if cell else torch.randn(1, B, I, dtype=F64))
        module(torch.randn(B, I, dtype=F64) if cell else torch.randn(T, B, I, dtype=F64))
    setattr(module, name, after)
    assert getattr(module, name) == getattr(twin, name) and module.spec == twin.spec
    x = torch.randn(B, I, dtype=F64) if cell else torch.randn(T, B, I, dtype=F64)
    for train in (True, False):
        module.train(train), twin.train(train)
        torch.manual_seed(1)
        ours = module(x)
        torch.manual_seed(1)
        assert_close(ours[0], twin(x)[0])


@pytest.mark.parametrize("name", ["peephole", "coupled_gates", "layer_norm", "bias_mode", "merge", "reset_after"])
def test_rnnkit_options_that_fix_the_parameters_refuse_to_change(name):
    module = rnnkit.LSTM(I, H)
    with pytest.raises(AttributeError, match=f"LSTM.{name} is fixed at construction"):
        setattr(module, name, getattr(module, name))


@pytest.mark.parametrize("name", ["input_size", "hidden_size", "num_layers", "bias", "bidirectional", "proj_size", "mode"])
def test_attributes_that_fix_the_shapes_refuse_to_change(name):
    module = rnnkit.LSTM(I, H)
    with pytest.raises(AttributeError, match=f"LSTM.{name} is fixed at construction"):
        setattr(module, name, getattr(module, name))


def test_bad_values_of_settable_attributes_are_refused():
    module = rnnkit.LSTM(I, H, num_layers=2)
    with pytest.raises(ValueError, match=r"dropout: expected a probability in \[0, 1\], got 2"):
        module.dropout = 2
    with pytest.raises(TypeError, match="batch_first: expected a bool"):
        module.batch_first = "yes"
    with pytest.raises(ValueError, match="nonlinearity: expected 'tanh' or 'relu', got 'gelu'"):
        rnnkit.RNN(I, H).nonlinearity = "gelu"
    assert module.dropout == 0.0 and module.batch_first is False


def test_numpy_bools_are_taken_as_torch_nn_takes_them():
    import numpy as np

    assert rnnkit.LSTM(I, H, bidirectional=np.bool_(True)).bidirectional is True
    assert rnnkit.LSTMCell(I, H, bias=np.bool_(False)).bias is False


@pytest.mark.parametrize("name", ["weight_ih_l0", "bias_hh_l0", "weight_hh_l1"])
def test_an_in_place_edit_of_a_parameter_before_backward_is_refused(name):
    """The gradient would be computed with the edited weights (wrong): autograd must see the
    edit, as it does for torch.nn's LSTM (README: state_dict() values are the one limit)."""
    module = rnnkit.LSTM(I, H, num_layers=2)
    y, _ = module(torch.randn(5, 2, I))
    with torch.no_grad():
        getattr(module, name).mul_(0.5)
    with pytest.raises(RuntimeError, match="modified"):
        y.sum().backward()


@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_a_module_on_the_meta_device_gives_the_shapes(name):
    """A module built on the meta device computes shapes, as torch.nn's does, for a tensor, lengths
    and a PackedSequence (asking whether autocast is on for "meta" raised)."""
    cls = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU}[name]
    module = cls(5, 7, num_layers=2, device="meta")
    x = torch.randn(4, 3, 5, device="meta")
    assert module(x)[0].shape == (4, 3, 7) and module(x)[0].device.type == "meta"
    assert module(x, lengths=torch.tensor([4, 2, 1]))[0].shape == (4, 3, 7)
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(4, 3, 5), torch.tensor([4, 2, 1]))
    y, _ = module(torch.nn.utils.rnn.PackedSequence(packed.data.to("meta"), packed.batch_sizes))
    assert y.data.shape == (7, 7)


def test_reset_parameters_keeps_the_constructors_forget_bias():
    """reset_parameters() (and so meta -> to_empty -> reset_parameters()) drew the forget gate's
    bias uniformly again, dropping forget_bias=1 silently."""
    def forget(module):
        return (module.bias_ih_l0 + module.bias_hh_l0)[H:2 * H]

    module = rnnkit.LSTM(I, H, forget_bias=1.0)
    module.reset_parameters()
    assert torch.equal(forget(module), torch.ones(H))
    late = rnnkit.LSTM(I, H, forget_bias=1.0, device="meta").to_empty(device="cpu")
    late.reset_parameters()
    assert torch.equal(forget(late), torch.ones(H))
    module.reset_parameters(forget_bias=2.0)
    assert torch.equal(forget(module), torch.full((H,), 2.0))
    module.forget_bias = None  # torch.nn's uniform draw
    module.reset_parameters()
    assert not torch.equal(forget(module), torch.ones(H))


def test_reset_parameters_draws_into_the_packed_buffer_as_torch_nn_draws():
    """reset_parameters() draws straight into the buffer the parameters alias (a full-size
    temporary doubled the peak memory of constructing a wide stack): the same values as torch.nn's
    under one seed, the parameters still views of the same buffer; a parametrized module's
    other weights (not views of a buffer any more) through a temporary as before, the same values."""
    module, twin = rnnkit.LSTM(I, H, num_layers=2), torch.nn.LSTM(I, H, num_layers=2)
    flat, pointers = module.flat_weights, [p.data_ptr() for p in module.parameters()]
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
                self.sizes.append(math.prod(args[0]))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(7)
    with Allocations():
        module.reset_parameters(forget_bias=None)
    assert not [n for n in Allocations.sizes if n >= flat.numel() // 2], Allocations.sizes  # no temporary buffer
    torch.manual_seed(7)
    twin.reset_parameters()
    assert module.flat_weights.data_ptr() == flat.data_ptr() and [p.data_ptr() for p in module.parameters()] == pointers
    for name, value in twin.state_dict().items():
        assert torch.equal(getattr(module, name), value), name
    parametrized = parametrize.register_parametrization(rnnkit.LSTM(I, H, num_layers=2), "weight_hh_l0",
                                                        torch.nn.Identity())
    torch.manual_seed(7)
    parametrized.reset_parameters(forget_bias=None)
    for name, value in twin.state_dict().items():
        assert name == "weight_hh_l0" or torch.equal(getattr(parametrized, name), value), name


def test_deepcopy_copies_the_packed_buffer_once():
    """copy.deepcopy gives a copy whose parameters are views of its own buffer (requires_grad as
    they were, no .grad, as torch's), made with one copy of the weights (torch's Parameter deepcopy
    cloned each and the copy packed them again: three copies at once); a parameter shared with
    another module stays shared, whichever is copied first; a parametrized module copies as before."""
    import copy
    from torch.utils._python_dispatch import TorchDispatchMode

    module = rnnkit.LSTM(I, H, num_layers=2, proj_size=2, peephole=True)
    module.weight_ih_l0.requires_grad_(False)
    x = torch.randn(5, 2, I)
    module(x)[0].sum().backward()
    numel = module.flat_weights.numel()

    class Copies(TorchDispatchMode):
        sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() >= numel // 4 and func.overloadpacket not in (
                    torch.ops.aten.view, torch.ops.aten.slice, torch.ops.aten.alias, torch.ops.aten.detach):
                self.sizes.append((str(func), out.numel()))
            return out

    with Copies():
        twin = copy.deepcopy(module)
    assert len(Copies.sizes) == 1, Copies.sizes
    assert twin._aliased(twin._current()) and twin.flat_weights.data_ptr() != module.flat_weights.data_ptr()
    assert [p.requires_grad for p in twin.parameters()] == [p.requires_grad for p in module.parameters()]
    assert all(p.grad is None for p in twin.parameters())
    assert torch.equal(twin(x)[0], module(x)[0])
    with torch.no_grad():
        twin.weight_hh_l1.add_(1)
    assert not torch.equal(twin(x)[0], module(x)[0])
    for first in (True, False):
        linear = torch.nn.Linear(I, 4 * H)
        linear.weight = module.weight_ih_l0
        pair = copy.deepcopy(torch.nn.ModuleList([module, linear] if first else [linear, module]))
        copied, lin = (pair[0], pair[1]) if first else (pair[1], pair[0])
        assert lin.weight is copied.weight_ih_l0
    normed = weight_norm(rnnkit.LSTM(I, H), "weight_hh_l0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that the parametrized weights run unpacked
        assert torch.equal(copy.deepcopy(normed)(x)[0], normed(x)[0])


def test_reset_parameters_redraws_pruned_and_parametrized_weights():
    """reset_parameters() re-draws a pruned weight's _orig (the mask kept) and a parametrized
    weight (through right_inverse: the weight is the draw; without one, each original uniformly,
    as torch.nn's reset draws everything parameters() lists): it left both as they were."""
    prune = pytest.importorskip("torch.nn.utils.prune")

    class Twice(torch.nn.Module):  # no right_inverse
        def forward(self, x):
            return 2 * x

    twin = rnnkit.LSTM(I, H)
    torch.manual_seed(5)
    twin.reset_parameters()
    pruned = rnnkit.LSTM(I, H)
    prune.l1_unstructured(pruned, "weight_hh_l0", 0.5)
    mask = pruned.weight_hh_l0_mask.clone()
    normed = weight_norm(rnnkit.LSTM(I, H), "weight_hh_l0")
    doubled = parametrize.register_parametrization(rnnkit.LSTM(I, H), "weight_hh_l0", Twice())
    before = doubled.parametrizations.weight_hh_l0.original.clone()
    for module in (pruned, normed, doubled):
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the note that the weights run unpacked
            module.reset_parameters()
        for name, value in twin.state_dict().items():
            assert name == "weight_hh_l0" or torch.equal(getattr(module, name), value), name
    assert torch.equal(pruned.weight_hh_l0_orig, twin.weight_hh_l0) and torch.equal(pruned.weight_hh_l0_mask, mask)
    assert_close(normed.weight_hh_l0, twin.weight_hh_l0, "weight_norm's weight")
    original = doubled.parametrizations.weight_hh_l0.original
    assert not torch.equal(original, before) and original.abs().max() <= 1 / math.sqrt(H)


# ---- a buffer placed as cuDNN places its weight space ------------------------------------------

def _scattered_placement(spec, layout, device, dtype, between=0):
    """A stand-in for cuDNN's placement (`native.cudnn_placement`), on any device: the matrices
    first, in reverse order, then the vectors, then room (cuDNN 9.19 puts every matrix before every
    bias, and keeps room for the biases a stack without them lacks); ``between``: room between pieces."""
    from rnnkit.spec import options_in_use

    if options_in_use(spec, native=False):
        return None
    entries = layout.entries
    order = [e for e in reversed(entries) if len(e.shape) == 2] + [e for e in entries if len(e.shape) == 1]
    offsets, at = {}, 0
    for e in order:
        offsets[e.name] = at
        at += e.numel + between
    return tuple(offsets[e.name] for e in entries), at + 6


PLACED_CASES = {
    "lstm-proj-bidirectional": (rnnkit.LSTM, dict(num_layers=2, proj_size=3, bidirectional=True)),
    "gru-2layers-no-bias": (rnnkit.GRU, dict(num_layers=2, bias=False)),
    "rnn_relu": (rnnkit.RNN, dict(nonlinearity="relu")),
}


@pytest.mark.parametrize("case, backend", [(c, b) for c in PLACED_CASES for b in ("native", "fused", "reference")
                                           if not (c.startswith("lstm-proj") and b == "native")])  # oneDNN: no LSTMP
def test_a_buffer_placed_as_cudnn_places_it_computes_as_the_spec_layout_does(case, backend, monkeypatch):  # noqa: C901
    """On CUDA a plain stack's buffer follows cuDNN's placement, not the spec's layout: the
    parameters alias it at those offsets, outputs and every gradient are those of a module in the
    spec's layout, flat_weights.grad is placed the same way (zeros between pieces), and the
    placement survives .to(dtype), deepcopy, flatten_parameters, reset_parameters, state_dicts and
    the converters' reads and writes. Here on the CPU, with a scattered stand-in placement."""
    import rnnkit.nn as rnn_nn
    from rnnkit.interop._common import load_pieces, torch_pieces

    cls, options = PLACED_CASES[case]
    torch.manual_seed(0)
    plain = cls(5, 4, **options, backend=backend)
    monkeypatch.setattr(rnn_nn, "cudnn_placement", _scattered_placement)
    placed = cls(5, 4, **options, backend=backend)
    placed.load_state_dict(plain.state_dict())
    offsets = placed.flat_offsets
    assert list(offsets.values()) != [e.offset for e in placed.layout.entries]
    flat = placed.flat_weights
    assert flat.numel() == placed.layout.numel  # the room past the pieces (cuDNN's bias slots) is not shown
    room = placed._flat[placed.layout.numel:]
    assert room.numel() == 6 and not room.any()
    for name, p in placed.named_parameters():
        assert p.data_ptr() == flat.data_ptr() + offsets[name] * flat.element_size(), name
    x = torch.randn(6, 3, 5)
    for given in (flat, flat.detach(), placed.weight_views()["weight_ih_l0"].view(-1)):  # the spec's layout is read
        with pytest.raises(ValueError, match="placed as cuDNN places"):
            rnnkit.forward_inference(placed.spec, given, x)
    rnnkit.forward_inference(plain.spec, plain.flat_weights, x)
    outs = []
    for module in (plain, placed):
        xi = x.clone().requires_grad_()
        y, state = module(xi)
        leaves = [y] + list(state if isinstance(state, tuple) else (state,))
        torch.manual_seed(1)
        torch.autograd.backward(leaves, [torch.randn_like(t) for t in leaves])
        outs.append((leaves, xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (ya, dxa, ga), (yb, dxb, gb) = outs
    for a, b in zip(ya, yb):
        assert_close(b, a)
    assert_close(dxb, dxa)
    for name in ga:
        assert_close(gb[name], ga[name])
    grad = placed.flat_weights.grad
    assert grad.shape == flat.shape
    for name, view in placed.weight_views(grad).items():
        assert_close(view, ga[name])
        assert view.data_ptr() == gb[name].data_ptr(), "each .grad is a view of flat_weights.grad"
    for _ in range(2):  # writes to the whole buffer, as cuDNN-style code makes them, never reach the room
        placed.flat_weights.add_(1.0)
        placed.flat_weights.sub_(placed.flat_weights.grad)
    assert not room.any()
    placed.load_state_dict(plain.state_dict())

    for moved in (placed.double(), copy.deepcopy(placed)):
        assert moved.flat_offsets == offsets
        for name, p in moved.named_parameters():
            assert p.data_ptr() == moved.flat_weights.data_ptr() + offsets[name] * p.element_size(), name
    assert_close(torch_pieces(placed)["weight_hh_l0"], plain.weight_hh_l0.double().detach())
    placed.weight_ih_l0.data = placed.weight_ih_l0.data.clone()
    with pytest.warns(UserWarning, match="not views of one packed buffer"):
        copied = placed.flat_weights  # a copy, placed as the buffer is
    assert copied.numel() == flat.numel() and torch.equal(placed.weight_views(copied)["weight_ih_l0"], placed.weight_ih_l0)
    placed.flatten_parameters()
    assert placed.flat_offsets == offsets
    assert placed.weight_ih_l0.data_ptr() == placed.flat_weights.data_ptr() + offsets["weight_ih_l0"] * 8
    assert not placed._flat[placed.layout.numel:].any()
    load_pieces(placed, {n: torch.full_like(t, 0.5) for n, t in torch_pieces(plain).items()})
    assert all(bool((p == 0.5).all()) for p in placed.parameters())
    placed.reset_parameters()
    assert all(bool((p.abs() <= 0.5).all()) and bool((p != 0.5).any()) for p in placed.parameters())


def test_the_functional_calls_refuse_a_placed_buffer_however_it_reaches_them(monkeypatch, tmp_path):
    """The functional calls read the spec's layout, so a buffer in cuDNN's placement would be read
    wrong: refused after torch.save / torch.load, as the copy flat_weights makes when the aliasing
    is broken, as flat_weights.grad, under torch.compile and torch.func, and as backward_weights'
    dweights; a buffer in the spec's layout still runs."""
    import rnnkit.nn as rnn_nn

    monkeypatch.setattr(rnn_nn, "cudnn_placement", _scattered_placement)
    spec = rnnkit.RNNSpec("lstm", 5, 4, num_layers=2)
    x = torch.randn(3, 2, 5)
    module = rnnkit.LSTM(5, 4, num_layers=2)
    module(x)[0].sum().backward()
    torch.save(module, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert loaded.flat_offsets == module.flat_offsets
    given = {"flat_weights": module.flat_weights, "loaded": loaded.flat_weights, "grad": module.flat_weights.grad,
             "a slice": module.flat_weights[:10]}
    unpacked = rnnkit.LSTM(5, 4, num_layers=2)
    unpacked.weight_hh_l0.data = unpacked.weight_hh_l0.data.clone()
    with pytest.warns(UserWarning, match="not views of one packed buffer"):
        given["the copy of unpacked weights"] = unpacked.flat_weights
    for what, weights in given.items():
        with pytest.raises(ValueError, match="placed as cuDNN places"):
            rnnkit.forward_inference(spec, weights, x)
    compiled = torch.compile(lambda w: rnnkit.forward_inference(spec, w, x)[0], backend="eager")
    with pytest.raises(ValueError, match="placed as cuDNN places"):
        compiled(module.flat_weights)
    with pytest.raises(ValueError, match="placed as cuDNN places"):
        torch.func.grad(lambda w: rnnkit.forward_inference(spec, w, x)[0].sum())(module.flat_weights)
    mine = rnnkit.Layout(spec).new_buffer()
    _, _, reserve = rnnkit.forward_training(spec, mine, x)
    rnnkit.backward_data(reserve, torch.randn(3, 2, 4), None, None)
    with pytest.raises(ValueError, match="dweights"):
        rnnkit.backward_weights(reserve, module.flat_weights.grad)
    assert compiled(mine).shape == (3, 2, 4)
    whole = torch.compile(lambda w: rnnkit.forward_inference(spec, w, x)[0], backend="eager", fullgraph=True)
    assert torch.equal(whole(mine), rnnkit.forward_inference(spec, mine, x)[0])  # no graph break for the check


def test_a_modules_own_load_pre_hooks_run_once_before_its_checks():
    """torch runs a module's load_state_dict pre-hooks before it copies; rnnkit's checks of the values
    (int8 codes refused by a float module, float weights by an int8 one) judge what those hooks leave,
    so a hook that migrates a checkpoint (dequantizes it, quantizes it) works as on torch.nn, once."""
    torch.manual_seed(0)
    calls = []

    def dequantize(module, state_dict, prefix, *args):
        calls.append(prefix)
        for key in [k for k in state_dict if k.startswith(prefix) and k.endswith("_scale")]:
            name = key[: -len("_scale")]
            state_dict[name] = state_dict[name].float() * state_dict.pop(key)[:, None]

    source = rnnkit.LSTM(4, 5, num_layers=2, peephole=True).eval()
    quantized = rnnkit.quantize(source)
    codes = quantized.state_dict()
    for module in (rnnkit.LSTM(4, 5, num_layers=2, peephole=True), torch.nn.Sequential(
            rnnkit.LSTM(4, 5, num_layers=2, peephole=True))):
        target = module if isinstance(module, rnnkit.LSTM) else module[0]
        target.register_load_state_dict_pre_hook(dequantize)
        calls.clear()
        state = {("" if module is target else "0.") + k: v for k, v in codes.items()}
        assert not module.load_state_dict(state).missing_keys
        assert calls == ["" if module is target else "0."]  # once, not again inside torch's load
        expected = dict(codes)
        dequantize(None, expected, "")
        for name, value in target.state_dict().items():
            assert torch.equal(value, expected[name]), name

    def quantize_floats(module, state_dict, prefix, *args):
        calls.append(prefix)
        for key in [k for k in state_dict if k[len(prefix):].startswith(("weight_ih", "weight_hh"))]:
            if state_dict[key].is_floating_point():
                state_dict[key], state_dict[key + "_scale"] = rnnkit.quantized.quantize_rows(state_dict[key])

    twin = rnnkit.quantize(rnnkit.LSTM(4, 5, num_layers=2, peephole=True).eval())
    twin.register_load_state_dict_pre_hook(quantize_floats)
    calls.clear()
    twin.load_state_dict(source.state_dict())
    assert calls == [""]
    x = torch.randn(3, 2, 4)
    assert torch.equal(twin(x)[0], quantized(x)[0])
    # a hook that leaves integers where floats belong is still refused, by name
    bad = rnnkit.LSTM(4, 5)
    bad.register_load_state_dict_pre_hook(lambda m, sd, prefix, *a: sd.update(weight_hh_l0=sd["weight_hh_l0"].long()))
    with pytest.raises(ValueError, match="weight_hh_l0: expected floating-point weights, got torch.int64$"):
        bad.load_state_dict(rnnkit.LSTM(4, 5).state_dict())  # (no int8 module's hint: it is not one's)


PICKLES = Path(__file__).parent / "fixtures" / "pickles"


@pytest.mark.parametrize("version", ["2e66bde", "b759250"])
def test_modules_pickled_by_older_rnnkit_load(version):
    """A whole module saved by an older rnnkit (torch.save(module): its __dict__ as that version kept
    it) loads, aliases one packed buffer and computes what it did (fixtures/pickles/README.md)."""
    modules = torch.load(PICKLES / f"modules_{version}.pt", weights_only=False)  # our own file
    ref = torch.load(PICKLES / f"modules_{version}.ref.pt")
    lstm, cell = modules["lstm"], modules["cell"]
    for module in (lstm, cell):
        flat = module.flat_weights
        assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in module.parameters())
    assert_close(lstm(ref["x"])[0], ref["y"], "an older pickle's LSTM")
    if "xc" in ref:
        assert_close(cell(ref["xc"]), ref["yc"], "an older pickle's GRUCell")
    fresh = rnnkit.LSTM(4, 5, num_layers=2, peephole=True)
    fresh.load_state_dict(lstm.state_dict())
    assert torch.equal(fresh(ref["x"])[0], lstm(ref["x"])[0])
    lstm(ref["x"])[0].sum().backward()
    assert lstm.flat_weights.grad is not None and lstm.weight_hh_l1.grad is not None


def test_a_spec_and_layout_without_later_fields_unpickle_as_this_version_builds_them():
    """What a later rnnkit derives (a spec's per_layer and cells, a layout's suffixes and pass slots) is
    rebuilt on unpickling, not read from the pickle; options a pickle lacks take their defaults."""
    for module in (rnnkit.LSTM(3, [5, 4], num_layers=2, bidirectional=True, layer_norm=True, zoneout=(0.1, 0.2)),
                   rnnkit.GRUCell(3, 4), rnnkit.RNN(3, 4, num_layers=2, proj_size=0)):
        module.eval()  # zoneout's expectation: no random masks
        twin = copy.deepcopy(module)
        for name in ("per_layer", "_cells", "_in_use", "input_dropout"):
            twin.spec.__dict__.pop(name, None)
        for name in ("suffixes", "_pass_slots", "index"):
            twin.layout.__dict__.pop(name, None)
        back = pickle.loads(pickle.dumps(twin))
        assert back.spec == module.spec and back.layout.suffixes == module.layout.suffixes
        assert [e.name for e in back.layout] == [e.name for e in module.layout]
        x = torch.randn(4, 3) if isinstance(module, rnnkit.GRUCell) else torch.randn(2, 4, 3)
        out, expected = back(x), module(x)
        assert torch.equal(out if isinstance(out, torch.Tensor) else out[0],
                           expected if isinstance(expected, torch.Tensor) else expected[0])


def test_the_spec_rebuilt_from_a_pickle_keeps_every_constructor_option():
    """RNNSpec.__setstate__ passes every constructor keyword on (a new one must be added there)."""
    import inspect

    from rnnkit import spec as spec_module

    given = set(inspect.signature(spec_module.RNNSpec.__init__).parameters) - {"self"}
    handled = set(spec_module._KEPT_AS_GIVEN) | {"mode", "input_size", "hidden_size", "proj_size", "zoneout"}
    assert given == handled


def test_a_module_loaded_where_the_placement_differs_is_placed_again(monkeypatch, tmp_path):
    """A buffer is placed as its device's kernels read it: a module saved where cuDNN placed it and
    loaded where the spec's layout holds (a GPU module loaded on the CPU), or the reverse, is packed
    again by name, with the same weights and outputs."""
    import rnnkit.nn as rnn_nn

    x = torch.randn(3, 2, 5)
    with monkeypatch.context() as patch:
        patch.setattr(rnn_nn, "cudnn_placement", _scattered_placement)
        placed = rnnkit.LSTM(5, 4, num_layers=2)
        torch.save(placed, tmp_path / "placed.pt")
        canonical_offsets = [e.offset for e in placed.layout.entries]
        assert list(placed.flat_offsets.values()) != canonical_offsets
    plain = torch.load(tmp_path / "placed.pt", weights_only=False)  # no placement here
    assert list(plain.flat_offsets.values()) == canonical_offsets and plain.flat_weights.numel() == plain.layout.numel
    for name, p in plain.named_parameters():
        assert torch.equal(p, getattr(placed, name)), name
        assert p.data_ptr() == plain.flat_weights.data_ptr() + plain.flat_offsets[name] * 4, name
    assert torch.equal(plain(x)[0], placed(x)[0])
    torch.save(plain, tmp_path / "plain.pt")
    monkeypatch.setattr(rnn_nn, "cudnn_placement", _scattered_placement)
    again = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert again.flat_offsets == placed.flat_offsets and again._cudnn_placed
    assert torch.equal(again(x)[0], placed(x)[0])
    with pytest.raises(ValueError, match="placed as cuDNN places"):
        rnnkit.forward_inference(again.spec, again.flat_weights, x)


def test_a_cudnn_placement_with_room_between_pieces_is_not_taken(monkeypatch):
    """Room between pieces could not be kept out of flat_weights' reach (cuDNN reads a bias-less
    stack's room as biases): such a placement gives way to the spec's layout; and cells, which
    never run cuDNN's RNN op, keep the spec's layout whatever cuDNN would say."""
    import rnnkit.nn as rnn_nn

    monkeypatch.setattr(rnn_nn, "cudnn_placement", lambda *args: _scattered_placement(*args, between=3))
    lstm = rnnkit.LSTM(5, 4, num_layers=2, bias=False)
    assert list(lstm.flat_offsets.values()) == [e.offset for e in lstm.layout.entries]
    assert lstm.flat_weights.numel() == lstm.layout.numel and not lstm._cudnn_placed
    monkeypatch.setattr(rnn_nn, "cudnn_placement", _scattered_placement)
    cell = rnnkit.LSTMCell(5, 4, bias=False)
    assert list(cell.flat_offsets.values()) == [e.offset for e in cell.layout.entries]
    rnnkit.forward_inference(cell.spec, cell.flat_weights, torch.randn(2, 1, 5))  # the spec's layout: taken
