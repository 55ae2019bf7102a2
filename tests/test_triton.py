"""The Triton backend against the reference, on CPU under Triton's interpreter (issue 6).

Each case runs one module twice on the same weights, inputs and seed (so training masks are
the same draws): backend="reference", then backend="triton", with random upstream gradients
on y, h_n and c_n, and compares outputs and every gradient (input, initial states, each
piece of the packed weights). The whole backend path runs: the custom ops, autograd,
kernels. Shapes are tiny because the interpreter runs each kernel program in numpy.

TRITON_INTERPRET=1 is set before triton is imported (conftest.py), so Triton's library and the
kernels are defined for the interpreter; RNNKIT_TRITON_INTERPRET=1 (which lets the backend
accept CPU tensors) is set only while these tests run, so that backend="auto" elsewhere in the
suite never picks the interpreter. On a GPU machine the same comparisons run on CUDA tensors with
``RNNKIT_TEST_TRITON_DEVICE=cuda`` (and TRITON_INTERPRET unset).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

DEVICE = os.environ.get("RNNKIT_TEST_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernels are defined
triton = pytest.importorskip("triton")

import torch  # noqa: E402

import rnnkit  # noqa: E402
from rnnkit import backend as backends  # noqa: E402
from rnnkit.triton import TritonBackend  # noqa: E402
from helpers import assert_close, flatten, make_module, run_backend  # noqa: E402



def _interpreter_problem():
    """Why the kernels cannot run under the interpreter in this process, or None."""
    if DEVICE != "cpu":
        return None
    from rnnkit.triton import _interpreter_problem as problem

    return problem()


_PROBLEM = _interpreter_problem()
needs_kernels = pytest.mark.skipif(_PROBLEM is not None, reason=str(_PROBLEM))


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """CPU tensors are accepted only while these tests run (see the module docstring)."""
    if DEVICE == "cpu":
        monkeypatch.setenv("RNNKIT_TRITON_INTERPRET", "1")


def make(mode, I, H, dtype, **options):
    return make_module(mode, I, H, dtype, device=DEVICE, **options)


def inputs(module, mode, T, B, I, dtype):
    spec = module.spec
    D, L = spec.num_directions, spec.num_layers
    new = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE, requires_grad=True)  # noqa: E731
    x = new(T, B, I)
    h0 = new(L * D, B, spec.output_size(0))
    hx = (h0, new(L * D, B, spec.hidden_sizes[0])) if mode == "lstm" else h0
    return x, hx


def assert_triton_matches(mode, dtype=torch.float64, T=3, B=2, I=4, H=5, lengths=None, training=False, **options):
    module = make(mode, I, H, dtype, **options)
    x, hx = inputs(module, mode, T, B, I, dtype)
    out_r, grad_r = run_backend(module, "reference", x, hx, lengths, training)
    out_t, grad_t = run_backend(module, "triton", x, hx, lengths, training)
    for k, (a, e) in enumerate(zip(out_t, out_r)):
        assert_close(a, e, "y" if k == 0 else f"final state {k - 1}")
    names = ["dx"] + [f"d initial state {k}" for k in range(len(grad_r) - 2)] + ["d flat_weights"]
    for name, a, e in zip(names, grad_t, grad_r):
        assert_close(a, e, name)
    for entry in module.layout:  # so a failure names the parameter
        assert_close(module.layout.view(grad_t[-1], entry.name), module.layout.view(grad_r[-1], entry.name), entry.name)


LSTM_CASES = {
    "plain": {},
    "peephole": dict(peephole=True),
    "layer_norm": dict(layer_norm=True),
    "projection_proj_clip": dict(proj_size=3, proj_clip=0.1),
    "cell_clip": dict(cell_clip=0.2),
    "coupled_peephole": dict(coupled_gates=True, peephole=True),
    "zoneout": dict(zoneout=(0.3, 0.2)),
    "bias_none": dict(bias_mode="none"),
    "bias_single_input": dict(bias_mode="single_input"),
    "everything": dict(peephole=True, layer_norm=True, proj_size=3, proj_clip=0.3, cell_clip=0.5, zoneout=(0.2, 0.1)),
    "coupled_everything": dict(coupled_gates=True, peephole=True, layer_norm=True, cell_clip=0.4, proj_size=3),
}
GRU_CASES = {
    "plain": {},
    "reset_before": dict(reset_after=False),
    "layer_norm": dict(layer_norm=True),
    "zoneout": dict(zoneout=0.25),
    "reset_before_zoneout_single_recurrent": dict(reset_after=False, zoneout=0.25, bias_mode="single_recurrent"),
    "bias_single_recurrent": dict(bias_mode="single_recurrent"),
    "bias_none": dict(bias_mode="none"),
}
RNN_CASES = {
    "tanh-layer_norm_zoneout": ("rnn_tanh", dict(layer_norm=True, zoneout=0.25)),
    "relu-plain": ("rnn_relu", {}),
    "relu-single_input": ("rnn_relu", dict(bias_mode="single_input")),
}
CASES = (
    [pytest.param("lstm", o, id=f"lstm-{k}") for k, o in LSTM_CASES.items()]
    + [pytest.param("gru", o, id=f"gru-{k}") for k, o in GRU_CASES.items()]
    + [pytest.param(m, o, id=f"rnn_{k}") for k, (m, o) in RNN_CASES.items()]
)


@needs_kernels
@pytest.mark.parametrize("mode, options", CASES)
def test_matches_reference_eval_fp64(mode, options):
    assert_triton_matches(mode, **options)


LENGTHS_CASES = {
    "lstm-bidirectional_stack": ("lstm", dict(num_layers=2, bidirectional=True, peephole=True, layer_norm=True,
                                              proj_size=3)),
    "gru-bidirectional": ("gru", dict(bidirectional=True, layer_norm=True)),
    "gru_reset_before-bidirectional": ("gru", dict(bidirectional=True, reset_after=False)),
    "rnn_tanh-bidirectional_sum": ("rnn_tanh", dict(bidirectional=True, merge="sum", zoneout=0.2)),
}


@needs_kernels
@pytest.mark.parametrize("case", list(LENGTHS_CASES))
def test_matches_reference_with_lengths_fp32(case):
    mode, options = LENGTHS_CASES[case]
    assert_triton_matches(mode, dtype=torch.float32, T=4, B=3, lengths=[4, 1, 2], **options)


TRAINING_CASES = {
    "lstm-all": ("lstm", dict(bidirectional=True, input_dropout=0.2, recurrent_dropout=0.3, dropconnect=0.2,
                              zoneout=(0.3, 0.2), peephole=True, layer_norm=True, proj_size=3, cell_clip=0.5)),
    "lstm-coupled_zoneout_h": ("lstm", dict(coupled_gates=True, zoneout=0.3, recurrent_dropout=0.3)),
    "gru-all": ("gru", dict(bidirectional=True, recurrent_dropout=0.3, zoneout=0.2, layer_norm=True)),
    "gru-reset_before": ("gru", dict(reset_after=False, recurrent_dropout=0.3, dropconnect=0.2, zoneout=0.2)),
    "rnn_tanh-all": ("rnn_tanh", dict(recurrent_dropout=0.3, input_dropout=0.2, zoneout=0.2, layer_norm=True)),
    "rnn_relu-all": ("rnn_relu", dict(num_layers=2, dropout=0.3, recurrent_dropout=0.3, dropconnect=0.2,
                                      zoneout=0.2)),
}


@needs_kernels
@pytest.mark.parametrize("case", list(TRAINING_CASES))
def test_matches_reference_in_training(case):
    mode, options = TRAINING_CASES[case]
    assert_triton_matches(mode, training=True, T=4, B=3, lengths=[4, 2, 3], **options)


INFERENCE_CASES = {
    "lstm": ("lstm", dict(peephole=True, layer_norm=True, proj_size=3, zoneout=(0.2, 0.1))),
    "gru_reset_before": ("gru", dict(reset_after=False, zoneout=0.2)),
    "rnn_tanh": ("rnn_tanh", dict(layer_norm=True)),
}


@needs_kernels
@pytest.mark.parametrize("case", list(INFERENCE_CASES))
def test_inference_without_saved_activations(case):
    """Under no_grad the passes keep one step of scratch instead of every step's activations."""
    mode, options = INFERENCE_CASES[case]
    module = make(mode, 4, 5, torch.float64, bidirectional=True, **options).eval()
    x, hx = inputs(module, mode, 3, 2, 4, torch.float64)
    with torch.no_grad():
        expected = rnnkit.functional.forward_inference(module.spec, module.flat_weights, x, hx, [3, 1],
                                                       backend="reference")
        actual = rnnkit.functional.forward_inference(module.spec, module.flat_weights, x, hx, [3, 1],
                                                     backend="triton")
    assert_close(flatten(actual), flatten(expected), "outputs")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_accumulates_in_fp32(dtype):
    """bf16 / fp16 inputs: state and accumulation in float32, so the only error is the final
    rounding; compared with the float64 reference on the same (rounded) values."""
    module = make("lstm", 4, 5, dtype, peephole=True, layer_norm=True)
    x, hx = inputs(module, "lstm", 3, 2, 4, dtype)
    out_t, grad_t = run_backend(module, "triton", x, hx, None, False)
    exact = make("lstm", 4, 5, torch.float64, peephole=True, layer_norm=True)
    with torch.no_grad():
        exact.flat_weights.copy_(module.flat_weights)
    up = lambda t: t.detach().double().requires_grad_(True)  # noqa: E731
    out_r, grad_r = run_backend(exact, "reference", up(x), tuple(up(h) for h in hx), None, False)
    for name, a, e in zip(["y", "h_n", "c_n", "dx", "dh0", "dc0", "d flat_weights"], out_t + grad_t, out_r + grad_r):
        assert a.dtype == dtype, name
        assert_close(a, e, name, dtype=dtype)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU refusal")
def test_refuses_cpu_tensors_without_the_interpreter_variable(monkeypatch):
    monkeypatch.delenv("RNNKIT_TRITON_INTERPRET")
    backend = TritonBackend()
    if not torch.cuda.is_available():
        with pytest.raises(backends.BackendUnavailableError, match="no CUDA device"):
            rnnkit.LSTM(4, 5, peephole=True, backend="triton")
        assert "RNNKIT_TRITON_INTERPRET=1" in backend.unavailable_reason()
    spec = rnnkit.RNNSpec("lstm", 4, 5, peephole=True)
    assert "runs on CUDA tensors, got device cpu" in backend.unsupported_reason(spec, "cpu", torch.float32)
    assert "got torch.int32" in TritonBackend().unsupported_reason(spec, "cuda", torch.int32)


def test_import_rnnkit_does_not_import_triton():
    """Not at import, and not when the backend is asked whether it can run."""
    code = (
        "import sys, torch, rnnkit\n"
        "from rnnkit.triton import TritonBackend\n"
        "rnnkit.backends()\n"
        "spec = rnnkit.RNNSpec('lstm', 3, 4, peephole=True)\n"
        "TritonBackend().unsupported_reason(spec, 'cpu', torch.float32)\n"
        "rnnkit.LSTM(3, 4, peephole=True, backend='reference')(torch.randn(2, 1, 3))\n"
        "print('triton' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RNNKIT_TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

