"""``rnnkit bench``: rnnkit's runners against torch.nn, measured as BENCH.md says.

Registries (one entry each to add): shapes and variants in ``registry.py``, runners in
``runners.py`` (rnnkit backends are discovered from `rnnkit.backends`). The
protocol is ``measure.py``; the JSON, markdown and PNG, and the warnings, are ``report.py``.

    rnnkit bench                                  # the CPU grid, every variant and runner
    rnnkit bench --shapes medium --variants lstm lstm_peephole --modes training
    rnnkit bench --step                           # the step API's per-step cost (cells, T=1 calls)
    rnnkit bench --quick                          # a smoke test on a tiny shape
    rnnkit bench --runners int8 torch.ao-int8 onnxruntime-int8 --modes inference   # int8 against torch.nn fp32
    python -m rnnkit.app.bench --device cuda      # the GPU grid

The exit status is 1 when any runner failed its correctness check (it is then not timed).
Warnings (stderr, and in the JSON and markdown): repeats of a runner that disagree by more
than 10% of their median, and a load average that left the benchmark fewer free cores than
it needed.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, NamedTuple, Optional

import torch

from .. import errors
from ..files import atomic_write
from . import report
from .measure import Case, keep_freed_memory, measure_case, sgemm_gflops
from .registry import (CPU_GRID, DEFAULT_VARIANTS, GPU_GRID, QUICK_GRID, QUICK_STEP_GRID, SHAPES, STEP_GRID,
                       STEP_VARIANTS, VARIANTS, lookup)
from .runners import DEFAULT_EXCLUDED, MODES, RUNNERS, available_names, make, register, unregister

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["add_arguments", "run", "main", "SHAPES", "VARIANTS", "RUNNERS", "register", "unregister"]


def _names(values: Optional[List[str]]) -> Optional[List[str]]:
    """--flag a b,c -> [a, b, c]."""
    if values is None:
        return None
    return [name for value in values for name in value.split(",") if name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench flags, for ``rnnkit bench`` and ``python -m rnnkit.app.bench``."""
    parser.add_argument("--shapes", nargs="+", metavar="NAME",
                        help=f"shapes (default: the CPU grid {', '.join(CPU_GRID)}; with --device cuda the GPU grid); "
                             f"choices: {', '.join(SHAPES)}")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help=f"variants (default: every sequence variant; with --step the step API's "
                             f"{', '.join(STEP_VARIANTS)}); choices: {', '.join(VARIANTS)}")
    parser.add_argument("--step", action="store_true",
                        help=f"the step API's per-step cost: {', '.join(STEP_VARIANTS)} on shapes {', '.join(STEP_GRID)} "
                             "(batch 1, and 4 as a beam of four), inference, against torch.nn's LSTMCell / GRUCell / T=1 LSTM")
    parser.add_argument("--runners", nargs="+", metavar="NAME",
                        help="runners (default all but 'auto'; torch.nn, the baseline, is always run): "
                             + ", ".join(available_names()))
    parser.add_argument("--modes", nargs="+", metavar="MODE",
                        help=f"default both: {', '.join(MODES)} (the step API: inference only)")
    from ..cli import non_negative_int, positive_int, thread_count  # the command's number checks (cli imports bench lazily)

    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed repeats per runner, median reported (default 5)")
    parser.add_argument("--warmup", type=non_negative_int, default=None,
                        help="untimed calls per runner first (default 3; 1 with --quick)")
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="torch.set_num_threads for every runner (default: all cores)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--out", default="bench-results", metavar="DIR", help="where bench.json, bench.md, bench.png go")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 repeat: a smoke test, not a measurement")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as a fresh process has it, which hands large freed blocks back "
                             "to the OS: runners whose allocator does then pay page faults at every call, as many "
                             "as what ran before in the process leaves them (default: the process keeps the memory "
                             "it frees, so that runners are timed on their kernels)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the shapes, variants and runners, and exit")


def _print_registries() -> None:
    print("shapes:")
    for s in SHAPES.values():
        print(f"  {s.name:20s} T={s.T} B={s.B} I={s.I} H={s.H} L={s.L}  {s.why}")
    print("variants:")
    for v in VARIANTS.values():
        print(f"  {v.name:20s} {v.title}" + ("" if v.torch_nn else f"  (torch.nn baseline: plain {v.plain})")
              + ("" if v.api == "sequence" else "  (step API: inference, one layer)"))
    print("runners:")
    for name in available_names():
        runner = make(name)
        reason = runner.unavailable_reason()
        print(f"  {name:20s} {runner.title}" + (f"  [unavailable: {reason}]" if reason else ""))


class Plan(NamedTuple):
    """The run the flags describe, validated."""

    cases: list  # (shape, variant, [modes]) to run, in order
    runner_names: List[str]
    runners: list
    repeats: int
    warmup: int
    threads: int
    device: str
    dtype: torch.dtype
    sgemm_n: int
    seed: int
    out: str
    keep_memory: bool = True


def _plan(args: argparse.Namespace, notes: List[str]) -> Plan:
    """-> the validated plan, or ValueError naming the flag; combinations that cannot run are left
    out with a line in ``notes`` (the step API: inference only, one layer)."""
    if args.step:
        default_shapes, default_variants, default_modes = (QUICK_STEP_GRID if args.quick else STEP_GRID), STEP_VARIANTS, ["inference"]
    else:
        default_shapes = QUICK_GRID if args.quick else (GPU_GRID if args.device == "cuda" else CPU_GRID)
        default_variants, default_modes = DEFAULT_VARIANTS, list(MODES)
    modes = _names(args.modes) or default_modes
    lookup("--modes", {m: m for m in MODES}, modes)
    shapes = lookup("--shapes", SHAPES, _names(args.shapes) or default_shapes)
    variants = lookup("--variants", VARIANTS, _names(args.variants) or default_variants)
    sequence = [v.name for v in variants if v.api == "sequence"]
    if args.step and sequence:  # --step would have timed them as without it, saying nothing
        raise ValueError(f"--variants: with --step, expected the step API's ({', '.join(STEP_VARIANTS)}); "
                         f"got {', '.join(sequence)} (leave --step out to time those)")
    cases = []
    for shape in shapes:
        for variant in variants:
            if variant.api != "sequence" and shape.L != 1:
                notes.append(f"left out {shape.name} / {variant.name}: the step API runs one layer, the shape has L={shape.L}")
                continue
            left_out = [m for m in modes if m not in variant.modes]
            if left_out:
                notes.append(f"left out {shape.name} / {variant.name} / {', '.join(left_out)}: "
                             f"the step API is timed in {', '.join(variant.modes)} only")
            if any(m in variant.modes for m in modes):
                cases.append((shape, variant, [m for m in modes if m in variant.modes]))
    if not cases:
        raise ValueError("no shape x variant x mode of the flags can run: " + "; ".join(notes))
    runner_names = _names(args.runners) or [n for n in available_names() if n not in DEFAULT_EXCLUDED]
    runner_names = ["torch.nn"] + [n for n in dict.fromkeys(runner_names) if n != "torch.nn"]
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {repeats} and {warmup}")
    return Plan(
        cases=cases,
        runner_names=runner_names,
        runners=[make(name) for name in runner_names],
        repeats=repeats,
        warmup=warmup,
        threads=args.threads or os.cpu_count() or 1,
        device=args.device,
        dtype=DTYPES[args.dtype],
        sgemm_n=256 if args.quick else (8192 if args.device == "cuda" else 2048),
        seed=args.seed,
        out=args.out,
        keep_memory=not args.default_malloc,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed flags describe; write JSON, markdown and PNG; -> exit status."""
    if args.list:
        _print_registries()
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise errors.no_cuda()  # the command prints it, as for rnnkit train
    notes: List[str] = []
    try:
        plan = _plan(args, notes)
    except ValueError as error:  # flags that cannot go together: a usage error, as argparse reports one
        print(f"rnnkit bench: error: {error} (see rnnkit bench --help)", file=sys.stderr)
        return 2
    for note in notes:
        print(f"rnnkit bench: {note}", file=sys.stderr)
    unwritable = _unwritable(plan.out)
    if unwritable:  # now, not after the first case's minutes of measuring
        raise errors.UserError(f"--out {plan.out or repr(plan.out)}: {unwritable}")
    stale = os.path.join(plan.out, "bench.png")
    if os.path.exists(stale):  # an earlier run's plot must not sit beside this run's tables
        os.remove(stale)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(plan.threads)  # the same for every runner
    load_samples = [(report.load_average(), 0)]  # (1-minute load average, our threads running meanwhile)
    try:
        # Before anything is allocated: with glibc's defaults torch.nn's per-call buffers of several
        # megabytes come as fresh pages at every call or from the heap, by what ran before in the
        # process (its medium LSTM training 243 or 215 ms in two rows of one run, 14,824 page faults
        # a call or none; docs/speed.md), which times its allocator, not its kernels.
        malloc = keep_freed_memory() if plan.keep_memory else "default: --default-malloc"
        gemm_grid = [shape for shape, _, _ in plan.cases]
        sgemm, by_library = sgemm_gflops(plan.device, plan.sgemm_n, gemm_grid)
        env = report.environment(plan.device, plan.dtype, plan.threads, plan.repeats, plan.warmup, sgemm, plan.sgemm_n)
        env["sgemm_by_library"] = by_library
        env["malloc"] = malloc
        records = []
        # until the last case is done, bench.json says how many of how many are in it, and bench.md says
        # the results are partial: a run stopped early keeps what it measured, marked as such
        env["cases_planned"], env["cases_done"] = sum(len(modes) for _, _, modes in plan.cases), 0
        for shape, variant, modes in plan.cases:
            case = Case(shape, variant, plan.device, plan.dtype, plan.seed)
            for mode in modes:
                print(f"rnnkit bench: {shape.name} / {variant.name} / {mode}", file=sys.stderr, flush=True)
                records += measure_case(case, mode, plan.runners, plan.repeats, plan.warmup, sgemm)
                load_samples.append((report.load_average(), plan.threads))
                env["cases_done"] += 1
                table = _write(plan, env, records, load_samples)  # after every case: a run stopped early keeps its results
        # the rate again at the end, keeping the best: a busy moment at the start must not set the limit
        _, again = sgemm_gflops(plan.device, plan.sgemm_n, gemm_grid)
        by_library = {name: max(rate, again.get(name, 0.0)) for name, rate in by_library.items()}
        best = max(by_library.values())
        env["sgemm_gflops"], env["sgemm_by_library"] = best, by_library
        env["fp32_gemm"] = _fused_fp32_gemm()
        for record in records:
            if "gflops_per_s" in record:
                record["fraction_of_sgemm"] = record["gflops_per_s"] / best
        table = _write(plan, env, records, load_samples)
    finally:
        torch.set_num_threads(previous_threads)
    print(table)
    for warning in env["warnings"]:
        print(f"rnnkit bench: warning: {warning}", file=sys.stderr)
    _plot(plan, records)
    return 1 if any(r["status"] == "failed" for r in records) else 0


def _unwritable(out: str) -> Optional[str]:
    """Why the results cannot be written to the directory ``out`` (created if missing), or None."""
    if not out:
        return "expected a directory for bench.json, bench.md and bench.png, got an empty path"
    if os.path.exists(out) and not os.path.isdir(out):
        return "expected a directory for bench.json, bench.md and bench.png, got a file"
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as error:
        return f"cannot create the directory: {error.strerror or error}"
    if not os.access(out, os.W_OK | os.X_OK):
        return "the directory is not writable"
    return None


def _fused_fp32_gemm():
    """The float32 GEMM kernels the fused runner multiplied on (None where the fused kernels did not load)."""
    from rnnkit.fused import build

    extension = build.loaded()
    try:
        return extension.fp32_gemm() if extension is not None else None
    except ValueError as error:  # a bad $RNNKIT_FP32_GEMM: the runs that needed it failed and say so
        return f"unavailable ({error})"


def _write(plan: Plan, env: dict, records: List[dict], load_samples: list) -> str:
    os.makedirs(plan.out, exist_ok=True)
    samples = [(load, own) for load, own in load_samples if load is not None]
    env["load_average_samples"] = [load for load, _ in samples]
    loaded = report.load_warning(samples, report.usable_cores(), plan.threads)
    env["warnings"] = ([loaded] if loaded else []) + report.spread_warnings(records)
    report.add_plain_ratios(records)
    report.write_json(os.path.join(plan.out, "bench.json"), env, records)
    table = report.markdown(env, records, plan.runner_names)
    atomic_write(os.path.join(plan.out, "bench.md"), table.encode("utf-8"))
    return table


def _plot(plan: Plan, records: List[dict]) -> None:
    _, skipped = report.plot(os.path.join(plan.out, "bench.png"), records, plan.runner_names)
    if skipped:
        print(f"rnnkit bench: {skipped}", file=sys.stderr)
    print(f"rnnkit bench: wrote {plan.out}/bench.json, bench.md" + ("" if skipped else ", bench.png"), file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    """``rnnkit bench`` with these flags (``sys.argv[1:]`` when None): the command's parser and
    error reports; -> its exit status."""
    from ..cli import main as command

    return command(["bench", *(sys.argv[1:] if argv is None else argv)])
