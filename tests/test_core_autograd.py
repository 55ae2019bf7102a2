"""Autograd of the compiled backends where a user reaches past one plain backward: second
derivatives through torch.func (a vjp_fn runs after its forward's transform has exited, so the
pass's saved tensors wrap a dead level), Jacobian penalties that train the parameters, and
autograd's own batched backward (``is_grads_batched``, torch.autograd.functional.jacobian with
``vectorize=True``). Every case is float64 and compared with the reference backend or torch.nn;
the wrong answers these guard against were silent (a zero Hessian, a penalty term missing from
the parameters' gradient) or refusals where torch.nn computes.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.func import functional_call, jacrev, vjp

import rnnkit
from helpers import assert_close, make_module, require_fused_kernels

DT = torch.float64
T, B, I, H = 3, 2, 2, 3
MODES = ["lstm", "gru", "rnn_tanh"]
TORCH_MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN}


@pytest.fixture(autouse=True, scope="module")
def fused_kernels():
    require_fused_kernels()
    yield


def _pair(mode, **options):
    """The same small module on the fused and the reference backend (same weights)."""
    torch.manual_seed(0)
    fused = make_module(mode, I, H, DT, backend="fused", **options)
    reference = make_module(mode, I, H, DT, backend="reference", **options)
    reference.load_state_dict(fused.state_dict())
    return fused, reference


def _x(seed=1):
    return torch.randn(T, B, I, dtype=DT, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", MODES)
def test_jacrev_of_jacrev_wrt_the_input(mode):
    """The Hessian of a scalar loss by jacrev(jacrev(f)) (the inner vjp_fn runs after its level has
    exited): it was all zeros on the fused backend, which auto picks under torch.func."""
    x = _x()
    fused, reference = _pair(mode, bidirectional=True)
    automatic = make_module(mode, I, H, DT, backend="auto", bidirectional=True)
    automatic.load_state_dict(fused.state_dict())
    hessians = [jacrev(jacrev(lambda v, m=m: m(v, None, torch.tensor([3, 2]))[0].tanh().sum()))(x)
                for m in (fused, automatic, reference)]
    assert hessians[-1].abs().max() > 1e-3
    assert_close(hessians[0], hessians[-1], f"{mode} Hessian wrt x")
    assert_close(hessians[1], hessians[-1], f"{mode} Hessian wrt x (auto)")


@pytest.mark.parametrize("mode", MODES)
def test_jacrev_of_jacrev_wrt_the_weights(mode):
    """The weights' Hessian through functional_call, with x a plain tensor (only the weights are
    dead-level wrappers): it was all zeros on the fused backend."""
    x = _x()
    results = []
    for module in _pair(mode, layer_norm=True):
        params = {name: p.detach().clone() for name, p in module.named_parameters()}
        loss = lambda p, m=module: functional_call(m, p, (x,))[0].tanh().sum()  # noqa: E731
        results.append(jacrev(jacrev(loss))(params)["weight_hh_l0"])
    for name in results[1]:
        assert_close(results[0][name], results[1][name], f"{mode} d2/dR d{name}")
    assert results[1]["weight_hh_l0"].abs().max() > 1e-3


def test_vjp_fn_is_differentiable_by_autograd():
    """torch.func.vjp's vjp_fn, called with grad mode on, gives a gradient that autograd
    differentiates again (a gradient penalty on it): it was detached from x on the fused backend."""
    results = []
    for module in _pair("lstm", peephole=True):
        x = _x().requires_grad_(True)
        _, vjp_fn = vjp(lambda v, m=module: m(v)[0].tanh().sum(), x)
        (dx,) = vjp_fn(torch.ones((), dtype=DT))
        penalty = dx.square().sum()
        results.append(torch.autograd.grad(penalty, [x] + list(module.parameters())))
    assert_close(list(results[0]), list(results[1]), "gradient-penalty gradients through vjp_fn")


@pytest.mark.parametrize("mode", MODES)
def test_jacobian_penalty_trains_the_parameters(mode):
    """A task loss plus a Jacobian penalty ||dy/dx||^2 (jacrev), backpropagated to the parameters:
    the penalty's part of their gradient was silently missing on the fused backend."""
    x = _x()
    grads = []
    for module in _pair(mode):
        y, _ = module(x)
        jacobian = jacrev(lambda v, m=module: m(v)[0])(x)
        loss = y.square().sum() + jacobian.square().sum()
        grads.append(torch.autograd.grad(loss, list(module.parameters())))
    assert_close(list(grads[0]), list(grads[1]), f"{mode} task + Jacobian-penalty gradients")


@pytest.mark.parametrize("mode", MODES)
def test_vectorized_jacobian_matches_torch_nn(mode):
    """torch.autograd.functional.jacobian(vectorize=True) batches the upstream gradients with
    autograd's is_grads_batched: the fused backward op has no rule for that batching and refused
    ("Batching rule not implemented for rnnkit::fused_pass_backward"), where torch.nn computes;
    with create_graph, a penalty on that Jacobian trains the parameters as torch.nn's does."""
    torch.manual_seed(0)
    module = make_module(mode, I, H, DT, backend="fused", bidirectional=True, num_layers=2)
    expected_module = TORCH_MODULES[mode](I, H, num_layers=2, bidirectional=True, dtype=DT)
    expected_module.load_state_dict(module.state_dict())
    modules, x = (module, expected_module), _x()
    jacobians = [torch.autograd.functional.jacobian(lambda v, m=m: m(v)[0], x, vectorize=True) for m in modules]
    assert_close(jacobians[0], jacobians[1], f"{mode} vectorized Jacobian")
    penalties = []
    for m in modules:
        jacobian = torch.autograd.functional.jacobian(lambda v: m(v)[0], x, vectorize=True, create_graph=True)
        penalties.append(torch.autograd.grad(jacobian.square().sum(), list(m.parameters())))
    assert_close(list(penalties[0]), list(penalties[1]), f"{mode} Jacobian penalty through vectorize")


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_batched_gradients_of_a_parameter_match_torch_nn(backend):
    """autograd.grad(..., is_grads_batched=True) with respect to a parameter: the gradients reach the
    module's packing of its parameters batched, with no storage to pack them into ('Cannot access
    storage of BatchedTensorImpl' on every backend); each comes back as it is, as torch.nn's."""
    torch.manual_seed(0)
    module = make_module("gru", I, H, DT, backend=backend)
    expected_module = torch.nn.GRU(I, H, dtype=DT)
    expected_module.load_state_dict(module.state_dict())
    x = _x()
    v = torch.randn(3, T, B, H, dtype=DT)
    got, expected = (torch.autograd.grad(m(x)[0], [m.weight_hh_l0, m.bias_ih_l0], v, is_grads_batched=True)
                     for m in (module, expected_module))
    assert_close(list(got), list(expected), "batched parameter gradients")


def _padded(t: torch.Tensor) -> torch.Tensor:
    """The same values in a buffer whose last-axis rows are padded (NaN between them), as a pool would keep them."""
    if t.dim() == 0 or not t.is_floating_point():
        return t.clone()
    rows = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
    pool = torch.full((rows.shape[0], rows.shape[1] + 3), float("nan"), dtype=t.dtype)
    pool[:, :rows.shape[1]] = rows
    return pool[:, :rows.shape[1]].view(t.shape) if t.dim() > 1 else pool[0, :t.shape[0]]


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values laid out with the axes' order reversed."""
    return t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim()))) if t.dim() > 1 \
        else t.clone()


@pytest.mark.parametrize("unpack", [_padded, _column_major], ids=["padded", "column_major"])
@pytest.mark.parametrize("make", [
    lambda: rnnkit.LSTM(3, 5, num_layers=2, backend="fused"),
    lambda: rnnkit.GRU(3, 5, bidirectional=True, backend="fused"),
    lambda: rnnkit.RNN(3, 5, backend="fused"),
    lambda: rnnkit.LSTM(3, 5, layer_norm=True, peephole=True, proj_size=2, backend="fused"),
], ids=["lstm", "gru_bidir", "rnn", "lstm_ln_peephole_proj"])
def test_saved_tensor_hooks_may_hand_back_another_layout(make, unpack):
    """torch asks an unpack hook for the same values, size, dtype and device, not the same strides: the
    fused backward reads its saved activations as the forward laid them out, so it must be given that
    layout (it read a pool's padding, NaN, and column-major values as row-major)."""
    require_fused_kernels()
    torch.manual_seed(0)
    m = make().double()
    x = torch.randn(6, 2, 3, dtype=torch.double, requires_grad=True)
    upstream = None
    results = []
    for hooked in (False, True):
        m.zero_grad()
        x.grad = None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack) if hooked else contextlib.nullcontext():
            y = m(x)[0]
        upstream = torch.randn_like(y) if upstream is None else upstream
        y.backward(upstream)
        results.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for expected, got in zip(*results):
        assert torch.equal(expected, got)


def test_allow_mutation_on_saved_tensors_keeps_the_weights_the_forward_used():
    """Under torch.autograd.graph.allow_mutation_on_saved_tensors an optimizer step between forward and
    backward must leave the gradients those of the forward's weights (torch.nn's are). The parameters,
    views of one buffer, share a version counter, which the context's bookkeeping keys on: the call's
    saved views are of a copy."""
    torch.manual_seed(0)
    for backend in ("auto", "fused", "reference", "native"):
        m = rnnkit.LSTM(3, 5, num_layers=2, backend=backend)
        x = torch.randn(6, 2, 3)
        upstream = torch.randn(6, 2, 5)
        before = [p.detach().clone() for p in m.parameters()]
        expected = torch.autograd.grad((m(x)[0] * upstream).sum(), list(m.parameters()))
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5, foreach=False)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            y = m(x)[0]
            for p in m.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()  # changes every weight in place
            got = torch.autograd.grad((y * upstream).sum(), list(m.parameters()))
        assert not any(torch.equal(a, p) for a, p in zip(before, m.parameters()))
        for e, g in zip(expected, got):
            assert torch.equal(e, g), backend
