"""How it is measured (BENCH.md's protocol): check first, then time interleaved, then memory.

One `Case` is one shape x variant on one device and dtype: the shared inputs, the
rnnkit reference modules whose weights every runner loads, and the reference results the
runners are checked against. `measure_case` runs the protocol for one mode.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

import rnnkit
from rnnkit.testing import TOLERANCE, RoundedProducts, int8_reference, rel_rms

from .registry import VARIANTS, Shape, Variant
from .runners import Model, Runner, Unsupported, leaves, rnnkit_module

try:
    import resource  # page-fault counts (getrusage); not on Windows
except ImportError:
    resource = None


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class CheckFailed(Exception):
    """A runner's results differ from the reference beyond the tolerance (the dtype's, or the runner's own)."""


def variable_lengths(T: int, B: int, generator: torch.Generator) -> torch.Tensor:
    """BENCH.md's variable-length batch: B lengths spread evenly from T/8 to T, shuffled (CPU int64)."""
    spread = torch.linspace(max(1, T // 8), T, B).round().long() if B > 1 else torch.tensor([T])
    return spread[torch.randperm(B, generator=generator)]


class Case:
    """One shape x variant: inputs, reference modules and reference results, built once."""

    def __init__(self, shape: Shape, variant: Variant, device: str, dtype: torch.dtype, seed: int = 0):
        self.shape, self.variant, self.device, self.dtype, self.seed = shape, variant, device, dtype, seed
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(shape.T, shape.B, shape.I, generator=generator).to(device, dtype)
        self.lengths = variable_lengths(shape.T, shape.B, generator) if variant.lengths else None
        self._references: Dict[str, torch.nn.Module] = {}
        self._expected: Dict[tuple, dict] = {}

    def reference(self, variant_name: str) -> torch.nn.Module:
        """The rnnkit module (backend="reference") of a variant on this shape; its weights are the case's."""
        if variant_name not in self._references:
            torch.manual_seed(self.seed)
            module = rnnkit_module(VARIANTS[variant_name], self.shape, "reference", self.device, self.dtype)
            self._references[variant_name] = module
        return self._references[variant_name]

    def expected(self, variant_name: str, mode: str) -> dict:
        """Reference results of a variant: in the case's dtype and, as ground truth, in float64.

        -> {"outputs", "grads", "upstream", "truth": (outputs, grads) in float64,
            "samples": [(x, truth)], inputs one ulp away where one run's error is luck (`_samples`),
            "reference_errors": {result name: the reference's error on the input, then on each sample}}.
        """
        key = (variant_name, mode)
        if key not in self._expected:
            module = self.reference(variant_name)
            model = Model(variant_name, [module], feed=self.variant.lengths or "lengths")
            upstream = None
            if mode == "training":
                with torch.no_grad():
                    shapes = [o.shape for o in self.forward(model, mode)]
                generator = torch.Generator().manual_seed(self.seed + 2)
                upstream = [torch.randn(s, generator=generator).to(self.device, self.dtype) for s in shapes]
            outputs, grads = self.run(model, mode, upstream)
            truth = (outputs, grads)
            if self.dtype != torch.float64:  # the same weights, input, upstream and masks, in float64
                model64 = Model(variant_name, [copy.deepcopy(module).double()], feed=model.feed)
                upstream64 = None if upstream is None else [u.double() for u in upstream]
                truth = self.run(model64, mode, upstream64, x=self.x.double())
            errors = {name: [rel_rms(a, t)] for name, a, t in _results((outputs, grads), truth)}
            samples = self._samples(model, mode, upstream, errors, truth)
            self._expected[key] = {"outputs": outputs, "grads": grads, "upstream": upstream, "truth": truth,
                                   "samples": samples, "reference_errors": errors}
        return self._expected[key]

    def int8_reference_errors(self, variant_name: str) -> Dict[str, List[float]]:
        """The error of int8 at its best on the case: `rnnkit.testing.int8_reference` (the reference
        backend on the reference module's `rnnkit.quantize` weights, each GEMM's input rounded to the
        int8 grid) against the float64 truth, per result (inference) -> {result name: [error]}.

        The int8 runners' counterpart of ``reference_errors``: where the float network itself
        amplifies a 1% perturbation beyond the int8 tolerance (the grid's layer-norm LSTM: 0.1%
        noise on the input moves its float64 outputs by 30% on stream), no int8 computation comes
        close to float32, and the check allows twice this instead (`check`).
        """
        key = (variant_name, "int8")
        if key not in self._expected:
            y, hy = int8_reference(rnnkit.quantize(self.reference(variant_name)), self.x, lengths=self.lengths)
            truth = self.expected(variant_name, "inference")["truth"]
            self._expected[key] = {name: [rel_rms(a, t)] for name, a, t in _results(([y] + leaves(hy), None), truth)}
        return self._expected[key]

    def rounded_reference_errors(self, variant_name: str, mode: str, dtype: torch.dtype) -> Dict[str, List[float]]:
        """The error of a ``dtype`` computation at its best on the case: the reference module in
        float32 on the weights and input rounded to ``dtype``, each of its products on operands
        rounded to ``dtype`` (h entering R; in backward the gradient entering the product:
        `rnnkit.testing.RoundedProducts`, the roundings no GEMM on ``dtype`` operands avoids)
        against the float64 truth, per result -> {result name: [error]}.

        The bfloat16 runners' counterpart of `int8_reference_errors`: where the float network
        amplifies these roundings beyond the dtype's tolerance (the grid's layer-norm LSTM on long
        sequences: its gradients on stream 190% off the truth in the reference, as in the fused
        kernels, which match the reference on the same roundings within 2%), the check allows twice
        this instead (`check`).
        """
        key = (variant_name, mode, str(dtype))
        if key not in self._expected:
            module = copy.deepcopy(self.reference(variant_name))
            with torch.no_grad():
                for p in module.parameters():
                    p.copy_(p.to(dtype).to(p.dtype))
            model = Model(variant_name, [module], feed=self.variant.lengths or "lengths")
            expected = self.expected(variant_name, mode)
            with RoundedProducts(dtype):
                result = self.run(model, mode, expected["upstream"], x=self.x.to(dtype).to(self.x.dtype))
            self._expected[key] = {name: [rel_rms(a, t)] for name, a, t in _results(result, expected["truth"])}
        return self._expected[key]

    def _samples(self, model: Model, mode: str, upstream, errors: Dict[str, List[float]], truth, samples: int = 7) -> list:
        """Where the reference's error in the case's dtype is above the dtype's tolerance (long
        float32 sequences through layer norm: the recurrence amplifies rounding to ~1e-4 and
        beyond), one run's distance from the truth is luck: on inputs one ulp apart the same
        computation lands 5-20x closer or further. Then the check compares medians over the
        input and ``samples`` copies of it moved by one ulp at random (inputs float32 cannot tell
        apart), each with its own float64 truth. -> [(x, truth)], empty where one run is
        enough; the reference's error on each is appended to ``errors`` (per result name).
        """
        if self.dtype == torch.float64 or max(e[0] for e in errors.values()) <= TOLERANCE[self.dtype]:
            return []
        model64 = Model(model.timed_variant, [copy.deepcopy(model.modules[0]).double()], feed=model.feed)
        upstream64 = None if upstream is None else [u.double() for u in upstream]
        eps = torch.finfo(self.dtype).eps
        found = []
        for k in range(samples):
            generator = torch.Generator().manual_seed(self.seed + 10 + k)
            ulp = torch.randint(-1, 2, self.x.shape, generator=generator).double().to(self.device)
            x = (self.x.double() * (1 + ulp * eps)).to(self.dtype)
            truth_k = self.run(model64, mode, upstream64, x=x.double())
            for name, a, t in _results(self.run(model, mode, upstream, x=x), truth_k):
                errors[name].append(rel_rms(a, t))
            found.append((x, truth_k))
        return found

    def forward(self, model: Model, mode: str, x: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """The model's forward on the case's input, with the case's mask seed; grad mode is the caller's."""
        model.train(mode == "training")
        if mode == "training" and self.reference(self.variant.name).spec.uses_dropout_masks:
            torch.manual_seed(self.seed + 1)  # zoneout / dropout masks: the same draw for every runner
        return model.forward(self.x if x is None else x, self.lengths)

    def run(self, model: Model, mode: str, upstream=None, x: Optional[torch.Tensor] = None):
        """One call as timed: -> (outputs, grads); grads is {"input": dx, name: dW, ...} in training."""
        x = self.x if x is None else x
        with model.context():
            if mode == "inference":
                with torch.no_grad():
                    return self.forward(model, mode, x), None
            x = x.detach().requires_grad_(True)
            outputs = self.forward(model, mode, x)
            if len(outputs) != len(upstream):
                raise CheckFailed(f"{len(outputs)} outputs, the reference has {len(upstream)}")
            params = model.parameters()
            grads = torch.autograd.grad(outputs, [x] + params, upstream)
        named = {"input": grads[0], **model.named_grads(grads[1:])}
        return [o.detach() for o in outputs], named


def _results(actual, truth):
    """(name, actual, truth) for each output and gradient of two (outputs, grads) results."""
    (outputs, grads), (truth_outputs, truth_grads) = actual, truth
    triples = [(f"output[{k}]", a, t) for k, (a, t) in enumerate(zip(outputs, truth_outputs))]
    if grads is not None:
        triples += [(f"grad {name}", grads[name], truth_grads[name]) for name in truth_grads]
    return triples


def runner_tolerance(case: Case, runner: Runner) -> float:
    """The relative RMS error a runner's check allows: its own (`Runner.tolerance`, the int8
    runners') or the case dtype's (rnnkit.testing.TOLERANCE)."""
    return TOLERANCE[case.dtype] if runner.tolerance is None else runner.tolerance


class Checked(NamedTuple):
    """What `check` found: the worst relative RMS error over the outputs and gradients, and the
    bound that result was held to (the tolerance, or a multiple of the reference's own error)."""

    error: float
    bound: float


def check(case: Case, model: Model, mode: str, tolerance: Optional[float] = None,
          precision: Optional[str] = None) -> Checked:
    """Compare a model with the float64 reference of its timed variant; -> `Checked`.

    A runner passes when its error against the float64 ground truth is within ``tolerance``
    (default the dtype's; a low-precision runner's own, see `runner_tolerance`), or within twice the error
    of the rnnkit reference run in the same dtype — for ``precision`` "int8" (the int8 runners),
    of `rnnkit.testing.int8_reference` (`Case.int8_reference_errors`), for "bfloat16" of the
    reference on bfloat16-rounded weights, input and products (`Case.rounded_reference_errors`), one run each. Where
    the reference itself is beyond the tolerance (long float32 sequences through layer norm:
    no float32 computation reaches 1e-5, and where one run lands is luck), the runner's median
    error over the input and its 7 one-ulp neighbours (`Case._samples`) must be within 3x the
    reference's median there: the medians of 8 such errors still differ by up to 2.4x between
    two equally exact computations (small layer-norm LSTM, training: over 16 inputs fused and
    the reference were within 7% of each other), while a wrong kernel is off by orders of
    magnitude. Raises CheckFailed otherwise.
    """
    expected = case.expected(model.timed_variant, mode)
    outputs, grads = case.run(model, mode, expected["upstream"])
    if len(outputs) != len(expected["outputs"]):
        raise CheckFailed(f"{len(outputs)} outputs, the reference has {len(expected['outputs'])}")
    if grads is not None:
        missing = sorted(set(expected["truth"][1]) - set(grads))
        if missing:
            raise CheckFailed(f"no gradient for {', '.join(missing)}")
    for name, actual, truth in _results((outputs, grads), expected["truth"]):
        if tuple(actual.shape) != tuple(truth.shape):
            raise CheckFailed(f"{name}: shape {tuple(actual.shape)}, the reference's is {tuple(truth.shape)}")
    if precision == "int8":
        reference = case.int8_reference_errors(model.timed_variant)
    elif precision is not None:  # a floating-point dtype's name: "bfloat16"
        reference = case.rounded_reference_errors(model.timed_variant, mode, getattr(torch, precision))
    else:
        reference = expected["reference_errors"]
    samples = expected["samples"] if precision is None else []  # low precision's error is its rounding's, not float32 luck
    runner = {name: [rel_rms(a, t)] for name, a, t in _results((outputs, grads), expected["truth"])}
    for x, truth in samples:
        for name, a, t in _results(case.run(model, mode, expected["upstream"], x=x), truth):
            runner[name].append(rel_rms(a, t))
    tolerance = TOLERANCE[case.dtype] if tolerance is None else tolerance
    worst = Checked(0.0, tolerance)
    for name, errors in runner.items():
        error = statistics.median(errors)
        bound = max(tolerance, (2 if len(errors) == 1 else 3) * statistics.median(reference[name]))
        if not error <= bound:  # NaN fails too
            what = "relative RMS error" if len(errors) == 1 else f"median relative RMS error over {len(errors)} inputs one ulp apart"
            raise CheckFailed(f"{name}: {what} {error:.3e} against float64 > {bound:.1e}")
        if error > worst.error:
            worst = Checked(error, bound)
    return worst


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def keep_freed_memory() -> str:
    """Make this process's malloc keep the memory it frees (glibc: no block mapped on its own,
    ``mallopt(M_MMAP_MAX, 0)``, and no trimming of the heap, ``mallopt(M_TRIM_THRESHOLD, -1)``),
    so that no runner pays, call after call, for pages its allocator handed back to the OS
    (torch.nn's medium LSTM training took 14,824 page faults a call with glibc's defaults). For
    the rest of the process: glibc cannot put its adaptive defaults back. -> what was done, for
    the record ("kept: ...", or "default: <why not>" where there is no glibc)."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return f"default: no glibc mallopt here ({platform.system()} {platform.libc_ver()[0] or 'libc'})"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as error:
        return f"default: mallopt not found ({error})"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, -1)):  # mallopt returns 1 on success
        return "default: mallopt refused M_MMAP_MAX 0 / M_TRIM_THRESHOLD -1"
    return "kept: glibc mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, -1)"


def minor_faults() -> Optional[int]:
    """Page faults this process has taken that the OS served without I/O (each maps a fresh page of
    memory: what an allocator that hands memory back to the OS pays again at its next call); None
    where the OS does not count them."""
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_call(case: Case, model: Model, mode: str, upstream, calls: int = 1) -> Tuple[float, Optional[int]]:
    """-> (seconds per call, minor page faults per call, or None where the OS does not count them),
    over ``calls`` back-to-back calls synchronized before and after."""
    synchronize(case.device)
    faults = minor_faults()
    start = time.perf_counter()
    for _ in range(calls):
        case.run(model, mode, upstream)
    synchronize(case.device)
    seconds = (time.perf_counter() - start) / calls
    faults = None if faults is None else minor_faults() - faults
    return seconds, faults if faults is None or calls == 1 else faults / calls


CUDA_REPEAT_S = 0.02  # on CUDA, one timed repeat runs back-to-back calls for at least this long
CUDA_MAX_CALLS = 200


def calls_per_repeat(device, seconds_per_call: float) -> int:
    """Calls in one timed repeat: 1 on the CPU (each call synchronized alone); on CUDA enough
    back-to-back calls to last `CUDA_REPEAT_S` (at most `CUDA_MAX_CALLS`), as a training loop runs
    them: the host queues the next call while the GPU runs this one. One synchronized call of a few
    milliseconds read 10-60% apart between repeats on an H200 (2026-11-28), its launch and
    synchronization latency included; a loop of them reads what a loop of calls costs."""
    if torch.device(device).type != "cuda":
        return 1
    if not seconds_per_call > 0:
        return CUDA_MAX_CALLS
    return max(1, min(CUDA_MAX_CALLS, int(CUDA_REPEAT_S / seconds_per_call + 0.999)))


def saved_activation_bytes(case: Case, model: Model) -> int:
    """Bytes autograd saves for backward in one training forward, weights and input excluded."""
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()} | {case.x.untyped_storage().data_ptr()}
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    x = case.x.detach().requires_grad_(True)
    exclude.add(x.untyped_storage().data_ptr())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = case.forward(model, "training", x)
    del outputs
    return sum(storages.values())


def peak_bytes(case: Case, model: Model, mode: str, upstream) -> Optional[int]:
    """Peak device memory of one call above what was allocated before it (CUDA only; None on CPU)."""
    if torch.device(case.device).type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    case.run(model, mode, upstream)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def flops(case: Case, timed_variant: str, mode: str) -> int:
    """GEMM FLOPs of one call: 2·G·H·(I_k + Hr)·B·T per layer-direction (+ projection), x3 in training."""
    spec = case.reference(timed_variant).spec
    T, B = case.shape.T, case.shape.B
    total = 0
    for layer in range(spec.num_layers):
        cell = spec.cell(layer)
        per_step = cell.gates * cell.hidden_size * (spec.layer_input_size(layer) + cell.output_size)
        if cell.proj_size:
            per_step += cell.output_size * cell.hidden_size
        total += 2 * per_step * B * T * spec.num_directions
    if case.lengths is not None:  # the steps actually run: the lengths' sum, not T·B
        total = total * int(case.lengths.sum()) // (T * B)
    return total * (3 if mode == "training" else 1)


def gemm_shapes(shapes, n: int) -> List[tuple]:
    """(M, K, N) of the kernels' own GEMMs on these shapes: each layer's input projection
    (T·B rows), each step's recurrent product (B rows, where B > 1: one row is a matrix-vector
    product, bound by memory, not by the GEMM), and an n x n square."""
    found = {(n, n, n)}
    for shape in shapes:
        for G in (4, 3):  # LSTM and GRU gate blocks
            found.add((shape.T * shape.B, shape.I, G * shape.H))
            if shape.B > 1:
                found.add((shape.B, shape.H, G * shape.H))
    return sorted(found)


def _gemm_libraries(device: str) -> Dict[str, Callable]:
    """The fp32 GEMMs this process can reach, each computing a · bᵀ for a (M, K), b (N, K)."""
    if torch.device(device).type == "cuda":
        return {"cuBLAS": lambda a, b: torch.mm(a, b.t())}
    libraries = {"MKL": lambda a, b: torch.mm(a, b.t())}  # torch.mm on CPU: MKL (or OpenBLAS)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        # oneDNN's matmul, the library torch.nn's CPU RNNs run on
        libraries["oneDNN"] = lambda a, b: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return libraries


def sgemm_gflops(device: str, n: int, shapes=(), repeats: int = 5) -> Tuple[float, Dict[str, float]]:
    """The machine's fp32 GEMM limit (BENCH.md): the fastest GEMM in the process, the best rate of
    each library over `gemm_shapes` -> (limit GFLOP/s, {library: its best GFLOP/s}).

    The best, not the median: it is the limit, and other processes only ever lower it. On some
    CPUs oneDNN is well ahead of MKL (25-40% on an AVX-512 AMD EPYC), so MKL alone would
    under-state the limit.
    """
    rates: Dict[str, float] = {}
    generator = torch.Generator().manual_seed(0)
    libraries = _gemm_libraries(device)
    for M, K, N in gemm_shapes(shapes, n):
        a = torch.randn(M, K, generator=generator).to(device)
        b = torch.randn(N, K, generator=generator).to(device)
        for name, gemm in libraries.items():
            try:
                gemm(a, b)
            except RuntimeError:  # a library that cannot run here does not set the limit
                continue
            times = []
            for _ in range(repeats):
                synchronize(device)
                start = time.perf_counter()
                gemm(a, b)
                synchronize(device)
                times.append(time.perf_counter() - start)
            rates[name] = max(rates.get(name, 0.0), 2 * M * K * N / min(times) / 1e9)
    return max(rates.values()), rates


def repeat_spread(times: List[float]) -> float:
    """How much the repeats of one runner disagree: (slowest - fastest) / median."""
    return (max(times) - min(times)) / statistics.median(times)


def measure_case(case: Case, mode: str, runners: List[Runner], repeats: int, warmup: int, sgemm: float) -> List[dict]:
    """BENCH.md's protocol for one case and mode: build, check, warm up, time interleaved, memory.

    Returns one record per runner. Only runners whose check passed are timed.
    """
    records, timed = [], []
    for runner in runners:
        record = {"runner": runner.name, "runner_title": runner.title, "shape": case.shape.name,
                  "variant": case.variant.name, "mode": mode, "timed_variant": case.variant.name}
        if runner.precision is not None:
            record["precision"] = runner.precision
        records.append(record)
        reason = runner.unavailable_reason()
        if reason is not None:
            record.update(status="unavailable", reason=reason)
            continue
        if mode not in runner.modes:
            record.update(status="unsupported", reason=f"runs {', '.join(runner.modes)} only")
            continue
        try:
            model = runner.build(case)
            record["timed_variant"] = model.timed_variant
            record.update(model.info)
            limit = runner_tolerance(case, runner)
            checked = check(case, model, mode, limit, runner.precision)
            # the bound can exceed the tolerance: where the reference's own error in the case's dtype
            # does (check), and then the record says so rather than show an error above "tolerance"
            record.update(max_rel_rms_error=checked.error, tolerance=limit, error_bound=checked.bound)
        except (Unsupported, rnnkit.BackendUnavailableError) as error:
            record.update(status="unsupported", reason=str(error))
            continue
        except CheckFailed as error:
            record.update(status="failed", reason=f"check against the reference: {error}")
            continue
        except Exception as error:  # a runner that crashes is reported, and the others still run
            record.update(status="failed", reason=f"{type(error).__name__}: {error}")
            continue
        record["status"] = "ok"
        timed.append((record, model, case.expected(model.timed_variant, mode)["upstream"]))

    def survives(record: dict, call: Callable[[], object]) -> bool:
        """Runs ``call``; a runner that crashes while it is timed or its memory measured (out of memory in
        a loop of calls, say) is reported as failed, as in its check, and the others still run."""
        try:
            call()
            return True
        except Exception as error:  # noqa: BLE001
            record.update(status="failed", reason=f"while timed: {type(error).__name__}: {error}")
            return False

    for _ in range(warmup):
        timed = [t for t in timed if survives(t[0], lambda: case.run(t[1], mode, t[2]))]
    # on CUDA one more untimed call per runner sizes its repeats (calls_per_repeat); on the CPU none
    calls: Dict[int, int] = {id(r): 1 for r, _, _ in timed}
    if torch.device(case.device).type == "cuda":
        def size(record, model, upstream):
            calls[id(record)] = calls_per_repeat(case.device, time_call(case, model, mode, upstream)[0])
        timed = [t for t in timed if survives(t[0], lambda: size(*t))]
    times: Dict[int, List[float]] = {id(r): [] for r, _, _ in timed}
    faults: Dict[int, List[Optional[int]]] = {id(r): [] for r, _, _ in timed}

    def timed_repeat(record, model, upstream):
        seconds, call_faults = time_call(case, model, mode, upstream, calls[id(record)])
        times[id(record)].append(seconds)
        faults[id(record)].append(call_faults)

    for _ in range(repeats):
        timed = [t for t in timed if survives(t[0], lambda: timed_repeat(*t))]  # interleaved: A, B, A, B, ...

    memory: Dict[int, Tuple[int, int]] = {}  # one more call each (peak memory; saved activations in training)

    def measure_memory(record, model, upstream):
        saved = saved_activation_bytes(case, model) if mode == "training" else 0
        memory[id(record)] = peak_bytes(case, model, mode, upstream), saved

    timed = [t for t in timed if survives(t[0], lambda: measure_memory(*t))]
    baseline = next((statistics.median(times[id(r)]) for r, _, _ in timed if r["runner"] == "torch.nn"), None)
    for record, model, upstream in timed:
        seconds = statistics.median(times[id(record)])
        work = flops(case, model.timed_variant, mode)
        if case.variant.api != "sequence":  # the step API: one call per step, T calls per timed loop
            record["per_step_us"] = seconds / case.shape.T * 1e6
        record.update(
            calls_per_repeat=calls[id(record)],
            median_ms=seconds * 1e3,
            times_ms=[t * 1e3 for t in times[id(record)]],
            repeat_spread=repeat_spread(times[id(record)]),
            speedup_vs_torch_nn=None if baseline is None else baseline / seconds,
            gflop=work / 1e9,
            gflops_per_s=work / seconds / 1e9,
            fraction_of_sgemm=work / seconds / 1e9 / sgemm,
            page_faults_per_call=None if None in faults[id(record)] else statistics.median(faults[id(record)]),
            peak_memory_bytes=memory[id(record)][0],
            saved_activation_bytes=memory[id(record)][1],
        )
    return records
