"""The triton backend against the reference on one device, for every cell family and option the
triton backend runs (issue 16, step 3): outputs and every gradient, in float32, bfloat16 and float16.

    python benchmarks/gpu_correctness.py                          # on CUDA (TRITON_INTERPRET unset or 0)
    python benchmarks/gpu_correctness.py --filter lstm-peephole --dtypes float32
    python benchmarks/gpu_correctness.py --tiny --device cpu      # under Triton's interpreter (tests/test_gpu.py)

Each case builds one module and runs it on backend="reference" and backend="triton" with the same
weights, inputs, mask seed and random upstream gradients on y and the final states, and compares
y, the final states, dx, the initial states' gradients and each weight's gradient (by name):

- float32 (and float64 with ``--dtypes float64``): relative RMS error ||a - e|| / ||e|| within
  rnnkit.testing.TOLERANCE (1e-5; 1e-10), with TF32 off for cuBLAS and cuDNN. The triton backend's
  GEMMs (W·x, R·h, the weight gradients) are torch.mm, i.e. cuBLAS, so these flags govern them;
  its Triton kernels are pointwise and use no tl.dot. A tensor over the tolerance is then held
  to a float64 ground truth (below): within twice the float32 reference's own error there, and
  never more than 10x the tolerance off. On
  the H200 (2026-11-28) three cases' gradients were 1.0-2.7e-5 apart, and against float64 the
  reference was 1.0e-5 to 1.6e-5 off, triton 0.4-1.3 times that: conditioning, not a kernel.
- bfloat16 / float16: both against a float64 ground truth (the reference backend on the module's
  rounded weights and the same inputs, upstream gradients and masks, in float64); the triton run
  must be within twice the error of the reference backend run in the same dtype, that error taken
  no lower than the error of the ground truth rounded to the dtype (a reference that lands closer
  than rounding does on a tensor of a few elements is luck, not a bound). ReLU RNNs are compared
  on their outputs only in these dtypes: their gradients jump where a pre-activation crosses 0,
  and the roundings both backends share and the ground truth lacks (DropConnect's R ∘ mask, a
  layer's output) can move a unit across it (measured under the interpreter, rnn_relu-all-train in
  float16: the triton pass exact to 2e-4 on the float64 R ∘ mask, 4% off on the float16-rounded
  one, where the float16 reference happened to stay on the ground truth's side). Cases with a
  cell or projection clip likewise: a cell within a few bf16 ulps of the clip lands on either
  side, zeroing or passing its gradient (lstm-all-train in bfloat16 failed at 2.5x its bound on
  an H200, 2026-11-28; under the interpreter on CPU, 2 of 10 seeds failed at 2.1-4.9x with the
  clip and none without, worst 0.50; with the float64 truth's clip gates forced to the backend's
  own, triton's error fell to 0.3-1x the reference's: the gates, not the arithmetic). float32
  compares all their gradients, both backends seeing the same inputs.

Each case calls the triton backend six times: once (on CUDA eagerly: a shape's first call is
not captured), twice more on new inputs and perturbed weights (the second captures the CUDA
graph, the third replays it, so stale buffers show), and three times under no_grad (the passes'
inference buffers: eagerly, captured, replayed on new inputs). Allocations from Python are
NaN-filled (as tests/conftest.py does), so an unwritten output fails. One line per case and
dtype; the last line counts them; the exit status is 1 when any case failed.

Training cases draw their masks from a fixed seed, as tests/test_triton.py does, in float32 and
rounded to the dtype under test (`same_masks`), so that the float64 ground truth of a bfloat16
run sees the masks it saw.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from typing import Dict, List, NamedTuple, Optional

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


class Case(NamedTuple):
    """One module configuration: ``mode``, its options, train or eval, with or without lengths.
    ``size``: "base" (odd sizes, so the kernels' masked lanes are exercised) or "wide" (H 1024:
    the largest blocks one program holds; skipped with --tiny)."""

    id: str
    mode: str
    options: dict
    training: bool = False
    lengths: bool = False
    size: str = "base"


def _cases() -> List[Case]:
    lstm = {
        "plain": {},
        "peephole": dict(peephole=True),
        "layer_norm": dict(layer_norm=True),
        "proj": dict(proj_size="P"),
        "proj_clip": dict(proj_size="P", proj_clip=0.1),
        "cell_clip": dict(cell_clip=0.2),
        "coupled": dict(coupled_gates=True),
        "coupled_peephole": dict(coupled_gates=True, peephole=True),
        "zoneout": dict(zoneout=(0.3, 0.2)),
        "bias_none": dict(bias_mode="none"),
        "bias_single_input": dict(bias_mode="single_input"),
        "bias_single_recurrent": dict(bias_mode="single_recurrent"),
        "everything": dict(peephole=True, layer_norm=True, proj_size="P", proj_clip=0.3, cell_clip=0.5,
                           zoneout=(0.2, 0.1)),
        "coupled_everything": dict(coupled_gates=True, peephole=True, layer_norm=True, cell_clip=0.4, proj_size="P"),
    }
    gru = {
        "plain": {},
        "reset_before": dict(reset_after=False),
        "layer_norm": dict(layer_norm=True),
        "zoneout": dict(zoneout=0.25),
        "bias_none": dict(bias_mode="none"),
        "bias_single_input": dict(bias_mode="single_input"),
        "bias_single_recurrent": dict(bias_mode="single_recurrent"),
        "reset_before_zoneout_single_recurrent": dict(reset_after=False, zoneout=0.25, bias_mode="single_recurrent"),
        "layer_norm_zoneout": dict(layer_norm=True, zoneout=0.2),
    }
    rnn = {
        "tanh-plain": ("rnn_tanh", {}),
        "relu-plain": ("rnn_relu", {}),
        "tanh-layer_norm": ("rnn_tanh", dict(layer_norm=True)),
        "relu-layer_norm_zoneout": ("rnn_relu", dict(layer_norm=True, zoneout=0.25)),
        "tanh-zoneout": ("rnn_tanh", dict(zoneout=0.25)),
        "tanh-bias_none": ("rnn_tanh", dict(bias_mode="none")),
        "relu-bias_single_input": ("rnn_relu", dict(bias_mode="single_input")),
    }
    cells = ([(f"lstm-{k}", "lstm", o) for k, o in lstm.items()] + [(f"gru-{k}", "gru", o) for k, o in gru.items()]
             + [(f"rnn_{k}", m, o) for k, (m, o) in rnn.items()])
    cases = [Case(f"{name}-eval", mode, options) for name, mode, options in cells]

    stacks = {  # lengths, both directions, layers, per-layer sizes (evaluation)
        "lstm-bidirectional_stack": ("lstm", dict(num_layers=2, bidirectional=True, peephole=True, layer_norm=True,
                                                  proj_size="P")),
        "lstm-bidirectional_sum": ("lstm", dict(bidirectional=True, merge="sum", cell_clip=0.3)),
        "lstm-per_layer_sizes": ("lstm", dict(num_layers=2, hidden_size=["H", "H2"], peephole=True)),
        "lstm-plain_stack": ("lstm", dict(num_layers=2, bidirectional=True)),
        "gru-bidirectional": ("gru", dict(bidirectional=True, layer_norm=True)),
        "gru-reset_before_stack": ("gru", dict(num_layers=2, bidirectional=True, reset_after=False)),
        "gru-per_layer_sizes": ("gru", dict(num_layers=2, hidden_size=["H", "H2"], layer_norm=True)),
        "rnn_tanh-bidirectional_sum": ("rnn_tanh", dict(bidirectional=True, merge="sum", zoneout=0.2)),
        "rnn_relu-stack": ("rnn_relu", dict(num_layers=2, bidirectional=True)),
    }
    cases += [Case(f"{name}-lengths", mode, options, lengths=True) for name, (mode, options) in stacks.items()]

    training = {  # masks from a fixed seed; lengths
        "lstm-all": ("lstm", dict(bidirectional=True, input_dropout=0.2, recurrent_dropout=0.3, dropconnect=0.2,
                                  zoneout=(0.3, 0.2), peephole=True, layer_norm=True, proj_size="P", cell_clip=0.5)),
        "lstm-stack_dropout": ("lstm", dict(num_layers=2, dropout=0.3, zoneout=0.1, proj_size="P", proj_clip=0.2)),
        "lstm-coupled_zoneout_h": ("lstm", dict(coupled_gates=True, zoneout=0.3, recurrent_dropout=0.3)),
        "lstm-plain_input_dropout": ("lstm", dict(input_dropout=0.3)),
        "gru-all": ("gru", dict(bidirectional=True, recurrent_dropout=0.3, zoneout=0.2, layer_norm=True,
                                input_dropout=0.1)),
        "gru-reset_before": ("gru", dict(reset_after=False, recurrent_dropout=0.3, dropconnect=0.2, zoneout=0.2)),
        "rnn_tanh-all": ("rnn_tanh", dict(recurrent_dropout=0.3, input_dropout=0.2, zoneout=0.2, layer_norm=True)),
        "rnn_relu-all": ("rnn_relu", dict(num_layers=2, dropout=0.3, recurrent_dropout=0.3, dropconnect=0.2,
                                          zoneout=0.2)),
    }
    cases += [Case(f"{name}-train", mode, options, training=True, lengths=True)
              for name, (mode, options) in training.items()]

    wide = {  # H 1024: one program holds G blocks of 1024 lanes (and LN rows of G·1024)
        "lstm-plain": ("lstm", {}),
        "lstm-peephole_layer_norm": ("lstm", dict(peephole=True, layer_norm=True)),
        "lstm-proj": ("lstm", dict(proj_size="P")),
        "gru-layer_norm": ("gru", dict(layer_norm=True)),
        "rnn_tanh-layer_norm": ("rnn_tanh", dict(layer_norm=True)),
    }
    cases += [Case(f"{name}-wide", mode, options, lengths=True, size="wide") for name, (mode, options) in wide.items()]
    return cases


CASES = _cases()

# T steps, B batch, I input, H hidden (H2 a second layer's, P a projection's), lengths (B of them, any order)
SIZES = {
    "tiny": dict(T=4, B=3, I=4, H=5, H2=3, P=3, lengths=[4, 1, 2]),  # tests/test_triton.py's, for the interpreter
    "base": dict(T=9, B=5, I=12, H=37, H2=21, P=19, lengths=[9, 1, 5, 9, 3]),
    "wide": dict(T=6, B=4, I=64, H=1024, H2=512, P=384, lengths=[6, 2, 5, 1]),
}

MASK_SEED, UPSTREAM_SEED = 1, 2


def _sized(options: dict, size: dict) -> dict:
    """The case's options with the size placeholders ("P", ["H", "H2"]) replaced."""
    value = lambda v: size[v] if isinstance(v, str) and v in ("H", "H2", "P") else v  # noqa: E731
    return {k: [value(x) for x in v] if isinstance(v, list) else value(v) for k, v in options.items()}


# ---- what one run computes ---------------------------------------------------------------------

def leaves(tree) -> list:
    """Tensors of a state in the user's format (a tensor, a pair, per-layer lists), in order."""
    if isinstance(tree, (list, tuple)):
        return [t for part in tree for t in leaves(part)]
    return [tree]


def initial_state(module, B: int, dtype, device, generator):
    """Random initial states in the module's format, requiring grad."""
    import torch

    spec = module.spec
    D, L = spec.num_directions, spec.num_layers
    new = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype)  # noqa: E731
    if spec.per_layer:
        h0 = [new(D, B, spec.output_size(k)) for k in range(L)]
        c0 = [new(D, B, spec.hidden_sizes[k]) for k in range(L)]
    else:
        h0 = new(L * D, B, spec.output_size(0))
        c0 = new(L * D, B, spec.hidden_sizes[0])
    state = (h0, c0) if spec.mode == "lstm" else h0
    for t in leaves(state):
        t.requires_grad_(True)
    return state


class Result(NamedTuple):
    names: List[str]
    tensors: list  # detached, in names' order


def run(module, backend: str, x, hx, lengths, training: bool, grad: bool = True, upstream_dtype=None) -> Result:
    """The module on ``backend``: outputs, and (``grad``) the gradients of x, the initial states and
    each weight under upstream gradients drawn in float64 from a fixed seed and rounded to
    ``upstream_dtype`` (default: each output's dtype)."""
    import torch

    module.train(training)
    module.backend = backend
    torch.manual_seed(MASK_SEED)
    context = contextlib.nullcontext() if grad else torch.no_grad()
    with context:
        y, hy = module(x, hx, lengths)
    if module.last_backend != backend:
        raise RuntimeError(f"backend={backend!r} was asked for and {module.last_backend!r} ran")
    outputs = [y] + leaves(hy)
    names = ["y"] + [f"final state {k}" for k in range(len(outputs) - 1)]
    if not grad:
        return Result(names, [o.detach() for o in outputs])
    generator = torch.Generator().manual_seed(UPSTREAM_SEED)
    upstream = [torch.randn(o.shape, generator=generator, dtype=torch.float64).to(upstream_dtype or o.dtype)
                .to(o.device, o.dtype) for o in outputs]
    weights = module.named_weights()
    inputs = [x] + leaves(hx)
    grads = torch.autograd.grad(outputs, inputs + list(weights.values()), upstream)
    names += ["dx"] + [f"d initial state {k}" for k in range(len(inputs) - 1)] + [f"d {n}" for n in weights]
    return Result(names, [t.detach() for t in outputs + list(grads)])


def rel_rms(actual, expected) -> float:
    from rnnkit.testing import rel_rms as rel

    return rel(actual, expected)


# ---- test hygiene ------------------------------------------------------------------------------

def poisoned():
    """torch.empty / empty_like / Tensor.new_empty from Python fill float tensors with NaN (as
    tests/conftest.py does), so a kernel that leaves part of an output unwritten fails."""
    from rnnkit.testing import nan_poisoned_allocations

    return nan_poisoned_allocations()


@contextlib.contextmanager
def same_masks(dtype):
    """Masks drawn in float32 and scaled masks rounded to ``dtype``, whatever the input's dtype: the
    same seed then gives the same masks to a ``dtype`` run and to its float64 ground truth (CUDA
    draws float64 uniforms from another stream than float32 ones, and 1 / (1 - p) rounds)."""
    import torch
    from rnnkit import masks

    bernoulli, dropout_mask = masks._bernoulli, masks._dropout_mask

    def float32_like(like):
        return torch.empty(0, dtype=torch.float32, device=like.device)

    masks._bernoulli = lambda shape, q, like: bernoulli(shape, q, float32_like(like)).to(like.dtype)
    masks._dropout_mask = lambda shape, p, like: dropout_mask(shape, p, float32_like(like)).to(dtype).to(like.dtype)
    try:
        yield
    finally:
        masks._bernoulli, masks._dropout_mask = bernoulli, dropout_mask


# ---- one case ----------------------------------------------------------------------------------

class Outcome(NamedTuple):
    passed: bool
    worst: float  # the largest error / bound ratio over every compared tensor and call
    detail: str  # where the worst ratio is, or the failures


def _module(case: Case, size: dict, dtype, device):
    import torch
    import rnnkit

    modules = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU, "rnn_tanh": rnnkit.RNN, "rnn_relu": rnnkit.RNN}
    options = _sized(case.options, size)
    hidden = options.pop("hidden_size", size["H"])
    extra = {"nonlinearity": "relu"} if case.mode == "rnn_relu" else {}
    module = modules[case.mode](size["I"], hidden, backend="reference", device=device, dtype=dtype, **extra, **options)
    with torch.no_grad():  # off the init: LN gains 1 / shifts 0 would make their gradients trivial
        module.flat_weights.add_(0.1 * torch.randn_like(module.flat_weights))
    return module


def _inputs(module, size: dict, dtype, device, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size["T"], size["B"], size["I"], generator=generator, dtype=torch.float64).to(device, dtype)
    x.requires_grad_(True)
    return x, initial_state(module, size["B"], dtype, device, generator)


def _compare(label: str, actual: Result, expected: Result, bound_of) -> List[tuple]:
    """[(error / bound, text)] for each tensor; NaN and a shape mismatch count as infinite."""
    rows = []
    for name, a, e in zip(expected.names, actual.tensors, expected.tensors):
        bound = bound_of(name)
        if tuple(a.shape) != tuple(e.shape):
            rows.append((float("inf"), f"{label} {name}: shape {tuple(a.shape)} != {tuple(e.shape)}"))
            continue
        error = rel_rms(a, e)
        ratio = error / bound if bound > 0 else (0.0 if error == 0 else float("inf"))
        if error != error:  # NaN
            ratio = float("inf")
        rows.append((ratio, f"{label} {name}: {error:.2e} (bound {bound:.1e}, {e.numel()} values)"))
    return rows


def check_case(case: Case, dtype, device: str, size: dict) -> Outcome:
    """Every comparison of one case in one dtype (six calls of the triton backend)."""
    import torch
    from rnnkit.testing import TOLERANCE

    low = dtype in (torch.bfloat16, torch.float16)
    torch.manual_seed(0)
    module = _module(case, size, dtype, device)
    lengths = size["lengths"] if case.lengths else None
    rows = []
    calls = [("call 1", 10, True), ("call 2", 20, True), ("call 3", 30, True), ("no_grad", 20, False),
             ("no_grad 2", 30, False), ("no_grad 3", 40, False)]
    for label, seed, grad in calls:
        if label in ("call 2", "call 3"):  # new weights too: a graph replay must read them, not the capture's
            with torch.no_grad():
                module.flat_weights.add_(0.05 * torch.randn_like(module.flat_weights))
        x, hx = _inputs(module, size, dtype, device, seed)
        with poisoned():
            reference = run(module, "reference", x, hx, lengths, case.training, grad)
            triton = run(module, "triton", x, hx, lengths, case.training, grad)
        if not low:
            compared = _compare(label, triton, reference, lambda name: TOLERANCE[dtype])
            if any(not ratio <= 1.0 for ratio, _ in compared):  # where float32 itself is off: both against float64
                truth = _truth(case, size, module, x, hx, lengths, grad, dtype, device)
                compared = [row if row[0] <= 1.0 else _against_truth(label, n, a, r, t, 10 * TOLERANCE[dtype])
                            for row, n, a, r, t in zip(compared, truth.names, triton.tensors, reference.tensors,
                                                       truth.tensors)]
            rows += compared
            continue
        truth = _truth(case, size, module, x, hx, lengths, grad, dtype, device)
        # the reference's error in dtype, never below what storing the exact result in dtype costs
        errors = {name: max(rel_rms(r, t), rel_rms(t.to(dtype), t))
                  for name, r, t in zip(truth.names, reference.tensors, truth.tensors)}
        if _kinked(case) and "dx" in truth.names:  # gradients that jump (ReLU at 0, a clip): outputs only (docstring)
            n = truth.names.index("dx")
            truth = Result(truth.names[:n], truth.tensors[:n])
        rows += _compare(label, triton, truth, lambda name: 2 * errors[name])
    worst = max(rows, key=lambda row: row[0])
    failures = [text for ratio, text in rows if not ratio <= 1.0]
    note = (" (ReLU: outputs only)" if case.mode == "rnn_relu" else " (a clip: outputs only)") if low and _kinked(case) \
        else ""
    return Outcome(not failures, worst[0], ("; ".join(failures[:4]) if failures else worst[1]) + note)


def _against_truth(label: str, name: str, actual, reference, truth, cap: float) -> tuple:
    """(error / bound, text) of a float32 tensor that missed the tolerance against the float32
    reference: its error against the float64 ground truth, within twice the reference's own error
    there (the rule of the low dtypes and of `rnnkit bench`'s check: where the reference itself
    lands 1e-5 or more off the exact result, another order of the same sums can land as far on the
    other side), and never above ``cap`` (10x the tolerance: one badly conditioned element of the
    reference must not excuse a wrong column of triton's). A shape mismatch and NaN count as infinite."""
    if tuple(actual.shape) != tuple(truth.shape):
        return float("inf"), f"{label} {name}: shape {tuple(actual.shape)} != {tuple(truth.shape)}"
    error, bound = rel_rms(actual, truth), min(cap, 2 * rel_rms(reference, truth))
    ratio = error / bound if bound > 0 else (0.0 if error == 0 else float("inf"))
    if error != error:
        ratio = float("inf")
    return ratio, (f"{label} {name}: {error:.2e} against float64 (bound {bound:.1e}: 2x the float32 "
                   f"reference's error there, at most {cap:.0e}; {truth.numel()} values)")


def _kinked(case: Case) -> bool:
    """Whether the case's gradients jump where a value crosses a point (ReLU's 0, a cell or projection
    clip): in bfloat16 / float16 those are compared on their outputs only (docstring)."""
    return case.mode == "rnn_relu" or bool(case.options.get("cell_clip") or case.options.get("proj_clip"))


def _truth(case: Case, size: dict, module, x, hx, lengths, grad: bool, dtype, device) -> Result:
    """The reference backend in float64 on the module's weights (as rounded to its dtype), the same
    inputs, masks and upstream gradients (drawn in float64, rounded to ``dtype``)."""
    import torch

    exact = _module(case, size, torch.float64, device)
    with torch.no_grad():
        exact.load_state_dict(module.state_dict())  # by name: on CUDA each dtype has its own placement
    up = lambda t: t.detach().double().requires_grad_(True)  # noqa: E731
    hx64 = _regroup(hx, [up(t) for t in leaves(hx)])
    return run(exact, "reference", up(x), hx64, lengths, case.training, grad, upstream_dtype=dtype)


def _regroup(like, flat: list):
    """``flat`` tensors in the structure of the state ``like``."""
    it = iter(flat)

    def build(tree):
        if isinstance(tree, (list, tuple)):
            return type(tree)(build(part) for part in tree)
        return next(it)

    return build(like)


# ---- the command -------------------------------------------------------------------------------

def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu under Triton's interpreter")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes (T 4, B 3, I 4, H 5) for the interpreter; leaves out the wide cases")
    parser.add_argument("--filter", action="append", default=[], metavar="TEXT",
                        help="run the cases whose id contains TEXT (repeat for several; default all)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"], choices=DTYPE_NAMES)
    parser.add_argument("--list", action="store_true", help="print the case ids and exit")
    return parser.parse_args(argv)


def _prepare_device(device: str) -> Optional[str]:
    """Environment and flags for ``device``, before triton is imported; -> why it cannot run, or None."""
    interpret = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton defines its language (not imported yet)
        os.environ["RNNKIT_TRITON_INTERPRET"] = "1"  # lets the backend take CPU tensors
        return None
    if interpret:
        return ("TRITON_INTERPRET is set: the kernels would run in Triton's interpreter, not compiled for the GPU; "
                "unset it (or set TRITON_INTERPRET=0)")
    import torch

    if not torch.cuda.is_available():
        return f"--device {device}: no CUDA device (torch.cuda.is_available() is False)"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs in float32, as the bound assumes
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return None


def main(argv=None) -> int:
    args = arguments(argv)
    cases = [c for c in CASES if not args.filter or any(f in c.id for f in args.filter)]
    if args.tiny:
        cases = [c for c in cases if c.size != "wide"]
    if args.list:
        print("\n".join(c.id for c in cases))
        return 0
    if not cases:
        print(f"gpu_correctness: no case id contains any of {args.filter}", file=sys.stderr)
        return 2
    problem = _prepare_device(args.device)
    if problem:
        print(f"gpu_correctness: {problem}", file=sys.stderr)
        return 2
    import torch
    import rnnkit

    reason = rnnkit.backends()["triton"]["reason"]
    if reason:
        print(f"gpu_correctness: the triton backend cannot run: {reason}", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, name) for name in args.dtypes]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (Triton's interpreter)"
    print(f"gpu_correctness: {len(cases)} cases x {', '.join(args.dtypes)} on {where}; torch {torch.__version__}; "
          f"CUDA graphs {'off' if os.environ.get('RNNKIT_TRITON_CUDA_GRAPHS') == '0' else 'on (on CUDA)'}", flush=True)
    counts: Dict[str, int] = {"PASS": 0, "FAIL": 0}
    failed: List[str] = []
    start = time.perf_counter()
    for case in cases:
        size = SIZES["tiny" if args.tiny else case.size]
        for dtype in dtypes:
            name = str(dtype).replace("torch.", "")
            began = time.perf_counter()
            try:
                with same_masks(dtype):
                    outcome = check_case(case, dtype, args.device, size)
            except Exception as error:  # a crash is this case's failure; the others still run
                if len(failed) < 3:
                    traceback.print_exc()
                message = str(error).strip().splitlines()[0] if str(error).strip() else ""
                outcome = Outcome(False, float("inf"), f"{type(error).__name__}: {message}"[:300])
            verdict = "PASS" if outcome.passed else "FAIL"
            counts[verdict] += 1
            if not outcome.passed:
                failed.append(f"{case.id} {name}")
            print(f"{verdict} {case.id:52s} {name:9s} worst/bound {outcome.worst:8.2e}  "
                  f"{time.perf_counter() - began:6.2f}s  {outcome.detail}", flush=True)
    total = counts["PASS"] + counts["FAIL"]
    print(f"gpu_correctness: {counts['PASS']}/{total} passed, {counts['FAIL']} failed "
          f"({time.perf_counter() - start:.0f} s)" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
