"""Where one call's time goes on a GPU (issue 16).

The second H200 session (2026-11-28, README "GPU") answered its first questions: triton's CUDA
graphs replay (one graph launch a pass), and at `small` over 90% of the GPU's time is cuBLAS's
float32 per-step GEMMs ([16, 128] x [128, 512] in 22.5 µs on 4 thread blocks; the backward's in
49 µs), not the host. The question now: does the Triton per-step GEMM (gemm.py,
``RNNKIT_TRITON_STEP_GEMM=triton``) beat them, and by how much a call? And in bfloat16, do a half
dtype's GEMMs on its own operands (``--dtype bfloat16 --ab RNNKIT_TRITON_HALF_GEMM=half``) beat the
float32 ones the passes run by default?

For each variant and mode: the median wall time of one call (synchronized before and after), for
torch.nn (its plain cell of the variant's mode where it lacks the variant), rnnkit's native backend
(plain variants) and its triton backend with CUDA graphs on and off, and with graphs and the
``--ab`` setting (default the Triton step GEMM); then one profiled triton call without and with it
(graphs on, after the warm-up that captures): the GPU time of its kernels, how many kernels and graph launches ran, and how long the
host spent; with ``--top N`` each profiled call's N costliest kernels and host events.

    python benchmarks/gpu_profile.py                                    # small and deepbench-h512-b32
    python benchmarks/gpu_profile.py --shapes long-h768 --variants lstm --modes training
    python benchmarks/gpu_profile.py --dtype bfloat16 --ab RNNKIT_TRITON_HALF_GEMM=half --shapes deepbench-h2048-b32
    TRITON_INTERPRET=1 RNNKIT_TRITON_INTERPRET=1 python benchmarks/gpu_profile.py --device cpu --tiny
        # the script's own check, on the CPU under Triton's interpreter (tests/test_bench.py)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from rnnkit.app.bench.registry import SHAPES, VARIANTS, Shape
from rnnkit.app.bench.runners import TORCH_MODULES, rnnkit_module

TINY = Shape("tiny", 4, 2, 8, 8, 1, "the script's own check")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(call, device: str, repeats: int, warmup: int = 3) -> float:
    """The median wall time of ``call()`` in microseconds, synchronized before and after each call."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def make_call(module, x, training: bool):
    """One call: forward (and backward of a sum of squares, in training) of ``module`` on ``x``."""
    def call():
        if training:
            y, _ = module(x)
            y.square().sum().backward()
        else:
            with torch.no_grad():
                module(x)
    return call


def profile_call(call, device: str, top: int = 0) -> dict:
    """One profiled call: its kernels' GPU time, kernel and graph-launch counts, and wall time;
    with ``top``, also its ``top`` kernels by GPU time and host events by their own (self) CPU time,
    each as (name, count, total us)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        call()
        _sync(device)
    wall = (time.perf_counter() - start) * 1e6
    events = prof.events()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    return {
        "wall_us": wall,
        "kernels": len(kernels),
        "kernel_us": sum(e.device_time_total for e in kernels) if kernels else 0.0,
        "graph_launches": sum(1 for e in events if e.name == "cudaGraphLaunch"),
        "kernel_launches": sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")),
        "top_kernels": _top(kernels, lambda e: e.device_time_total, top),
        "top_host": _top([e for e in events if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA
                          and e.name not in _NOT_HOST_WORK], lambda e: e.self_cpu_time_total, top),
    }


# host events that are waits for the GPU (the synchronization inside the profiled region) or the
# profiler's own bookkeeping, not work of the call's
_NOT_HOST_WORK = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "Activity Buffer Request"}


def _top(events, time_of, n: int) -> list:
    """The ``n`` names of ``events`` with the most time (``time_of``): [(name, count, total us)]."""
    totals = {}
    for e in events:
        count, total = totals.get(e.name, (0, 0.0))
        totals[e.name] = (count + 1, total + time_of(e))
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:n]
    return [(name, count, total) for name, (count, total) in ranked]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=["small", "deepbench-h512-b32"], choices=sorted(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["lstm", "lstm_layer_norm", "gru"],
                        choices=[n for n, v in VARIANTS.items() if v.api == "sequence" and not v.lengths])
    parser.add_argument("--modes", nargs="+", default=["inference", "training"], choices=["inference", "training"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed calls before each runner's timed ones and before each profiled call (default "
                             "3; on CUDA at least 2, as the second call captures the graph the profiled one replays)")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape instead of --shapes (the CPU check)")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="after each row, the profiled call's N kernels by GPU time and N host events by "
                             "self CPU time (name, count, total us)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="every runner's dtype (float32: TF32 off)")
    parser.add_argument("--ab", default="RNNKIT_TRITON_STEP_GEMM=triton", metavar="NAME=VALUE",
                        help="the triton setting timed and profiled against the default (default: the Triton "
                             "per-step GEMM; RNNKIT_TRITON_HALF_GEMM=half for a half dtype's GEMMs on its own "
                             "operands)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: expected 1 or more, got {args.repeats}")
    if args.warmup < (2 if args.device == "cuda" else 0):
        parser.error(f"--warmup: expected {'2' if args.device == 'cuda' else '0'} or more on {args.device}, "
                     f"got {args.warmup}")
    ab_name, _, ab_value = args.ab.partition("=")
    if not ab_name.startswith("RNNKIT_TRITON_") or not ab_value:
        parser.error(f"--ab: expected RNNKIT_TRITON_...=VALUE, got {args.ab!r}")
    dtype = getattr(torch, args.dtype)
    device = args.device
    if device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_profile: no CUDA device here", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 throughout, as the bench's float32 grid
        torch.backends.cudnn.allow_tf32 = False  # (a half dtype: torch's default flags otherwise)
        print(f"gpu_profile: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
              f"{torch.backends.cudnn.version()}")
    shapes = [TINY] if args.tiny else [SHAPES[name] for name in args.shapes]
    before = {name: os.environ.get(name) for name in ("RNNKIT_TRITON_CUDA_GRAPHS", ab_name)}
    default = os.environ.get(ab_name)  # the setting's own value in this process (unset: the library's default)

    def setting(graphs: str, ab: bool) -> None:
        os.environ["RNNKIT_TRITON_CUDA_GRAPHS"] = graphs
        if ab:
            os.environ[ab_name] = ab_value
        elif default is None:
            os.environ.pop(ab_name, None)
        else:
            os.environ[ab_name] = default

    print(f"{args.dtype}; A/B: {args.ab}")
    print(f"shape | variant | mode | torch.nn us | native us | triton us (graphs) | triton us (no graphs) | "
          f"triton us (graphs, {args.ab}) | triton profiled, then with {args.ab}: GPU kernel us / "
          "wall us, kernels, graph launches, kernel launches")
    try:
        for shape in shapes:
            for name in args.variants:
                variant = VARIANTS[name]
                for mode in args.modes:
                    training = mode == "training"
                    torch.manual_seed(0)
                    reference = rnnkit_module(variant, shape, "reference", device, dtype)
                    x = torch.randn(shape.T, shape.B, reference.input_size, device=device, dtype=dtype)
                    row = [shape.name, name, mode]
                    torch_variant = variant if variant.torch_nn else VARIANTS[variant.mode]
                    baseline = TORCH_MODULES[torch_variant.mode](**torch_variant.module_kwargs(shape)).to(device, dtype)
                    row.append(f"{time_call(make_call(baseline, x, training), device, args.repeats, args.warmup):.0f}")
                    native = rnnkit_module(variant, shape, "auto", device, dtype)
                    native.backend = "native"
                    try:
                        row.append(f"{time_call(make_call(native, x, training), device, args.repeats, args.warmup):.0f}")
                    except Exception as error:  # noqa: BLE001 - a variant native does not run
                        row.append(f"n/a ({type(error).__name__})")
                    triton = rnnkit_module(variant, shape, "triton", device, dtype)
                    for graphs, ab in (("1", False), ("0", False), ("1", True)):
                        setting(graphs, ab)
                        row.append(f"{time_call(make_call(triton, x, training), device, args.repeats, args.warmup):.0f}")
                    for ab in (False, True):  # a profiled call without and with the A/B setting, graphs on
                        setting("1", ab)
                        call = make_call(triton, x, training)
                        for _ in range(args.warmup):  # the second call captures; the profiled one replays
                            call()
                        p = profile_call(call, device, args.top)
                        row.append(f"{p['kernel_us']:.0f} / {p['wall_us']:.0f}, {p['kernels']}, {p['graph_launches']}, "
                                   f"{p['kernel_launches']}")
                        tops = [(kind, p[kind]) for kind in ("top_kernels", "top_host")]
                        if not ab:
                            first = tops
                    print(" | ".join(row), flush=True)
                    for label, found in (("default", first), (args.ab, tops)):
                        if any(events for _, events in found):
                            print(f"  {label}:")
                        for kind, events in found:
                            for event, count, total in events:
                                print(f"    {kind[4:]:7s} {total:9.0f} us {count:5d}x  {event[:110]}")
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


if __name__ == "__main__":
    sys.exit(main())
