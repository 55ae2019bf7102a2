"""Helpers the test files share. The tolerance table lives in the package (rnnkit.testing),
shared with the benchmark."""
import torch

import rnnkit
from rnnkit.testing import TOLERANCE, assert_close, rel_rms

MODULES = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU, "rnn_tanh": rnnkit.RNN, "rnn_relu": rnnkit.RNN}


def make_module(mode, I, H, dtype, device="cpu", **options):
    """An rnnkit module of ``mode`` with its weights nudged off their init."""
    extra = {"nonlinearity": "relu"} if mode == "rnn_relu" else {}
    module = MODULES[mode](I, H, dtype=dtype, device=device, **extra, **options)
    with torch.no_grad():  # break the symmetry of LN gains 1 / shifts 0 so their grads mean something
        module.flat_weights.add_(0.1 * torch.randn_like(module.flat_weights))
    return module


def flatten(tree) -> list:
    """Tensors of a state in the user's format (a tensor, a pair, per-layer lists) in order."""
    if isinstance(tree, (list, tuple)):
        return [t for part in tree for t in flatten(part)]
    return [tree]


def map_tree(tree, fn):
    """A state (a tensor, a pair, per-layer lists) with ``fn`` applied to each of its tensors."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(part, fn) for part in tree)
    return fn(tree)


def run_backend(module, backend, x, hx, lengths=None, training=False, upstream_dtype=None):
    """(outputs, gradients of x, initial states and flat weights) with random upstream gradients.

    Seeds are fixed, so two backends see the same masks and the same upstream gradients (drawn in
    float64, rounded to ``upstream_dtype`` first where given: a float64 truth of a bfloat16 run).
    """
    module.train(training)
    module.backend = backend
    torch.manual_seed(1)
    y, hy = module(x, hx, lengths)
    outputs = [y] + flatten(hy)
    generator = torch.Generator().manual_seed(2)
    upstream = [torch.randn(o.shape, dtype=torch.float64, generator=generator).to(upstream_dtype or o.dtype)
                .to(o.device, o.dtype) for o in outputs]
    weights = list(module.named_weights().values())  # buffer order
    grads = torch.autograd.grad(outputs, [x] + flatten(hx) + weights, upstream)
    n = len(grads) - len(weights)
    return [o.detach() for o in outputs], list(grads[:n]) + [packed(grads[n:])]


def packed(grads) -> torch.Tensor:
    """Per-weight gradients (buffer order) as one packed vector, like flat_weights.grad."""
    return torch.cat([g.reshape(-1) for g in grads])


__all__ = ["TOLERANCE", "assert_close", "rel_rms", "MODULES", "make_module", "flatten", "map_tree", "run_backend", "packed"]


def require_fused_kernels() -> None:
    """Build (or load) the fused kernels now; a build failure fails the test module that needs them."""
    import pytest
    from rnnkit.fused import build

    try:
        build.extension()
    except RuntimeError as error:
        pytest.fail(f"the fused CPU backend did not build: {error}")


def random_states(module, B, dtype=torch.float64):
    """Random initial states in the module's format: (h0, c0) for LSTM, else h0; per-layer lists
    [(D, B, size of layer k)] where the layers' sizes differ, else (L·D, B, size) tensors."""
    spec = module.spec
    D, L = spec.num_directions, spec.num_layers
    if spec.per_layer:
        h0 = [torch.randn(D, B, spec.output_size(k), dtype=dtype) for k in range(L)]
        c0 = [torch.randn(D, B, spec.hidden_sizes[k], dtype=dtype) for k in range(L)]
    else:
        h0 = torch.randn(L * D, B, spec.output_size(0), dtype=dtype)
        c0 = torch.randn(L * D, B, spec.hidden_sizes[0], dtype=dtype)
    return (h0, c0) if spec.mode == "lstm" else h0
