"""The float32 GEMMs the fused passes could run on, in one process, on the passes' own shapes: MKL
(``torch.mm``: its sgemm on unpacked weights; the passes' "mkl" choice uses MKL's packed API,
which ``rnnkit bench --runners fused fused-mkl`` measures in whole passes), oneDNN (``torch.ops.mkldnn._linear_pointwise``, the library torch.nn's RNNs run on)
and rnnkit's own kernels on weights packed once (as a pass packs them: the packing is not in the
timed product, and is reported on its own). The measurement behind ``rnnkit.fused.fp32_gemm``'s
choice (docs/reference/backends.md).

    python benchmarks/fp32_gemm.py --threads 1 --out benchmarks/results/NAME.md

Shapes: for each shape of the CPU grid with a batch, the per-step product R·h (B rows, K = H,
N = 4H) and a projection chunk W·x (128 rows, K = I, N = 4H). Best of ``--repeats`` calls.

With ``--weight-gradients``: each grid shape's two LSTM weight gradients Aᵀ · B over all T·B rows
(dW: A the gates' gradient [T·B, 4H], B the input [T·B, I]; dR: B the hidden state [T·B, H]):
MKL (``torch.mm(A.t(), B)``) against the own kernels reading both in place (``f32_gemm_at_b``)
and as (Bᵀ · A)ᵀ on A packed into panels (``f32_gemm_at_b_packed``: the packing, Bᵀ read in place
and the result's transpose timed), and which a pass takes (``f32_at_b_in_place``: in place while A is at most 2²¹
floats, packed beyond; MKL where the kernel in use does not take the weight gradients: ``avx512-mkl``,
``avx2``, ``mkl``).
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from rnnkit.app.bench.registry import SHAPES
from rnnkit.app.machine import cpu_flags, cpu_model
from rnnkit.fused import build, fp32_gemms, use_fp32_gemm


def best_seconds(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def arguments(doc: str, argv=None, weight_gradients: bool = False) -> argparse.Namespace:
    """--threads, --repeats, --out (set torch's thread count); --weight-gradients where asked."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", help="also write the markdown table here")
    if weight_gradients:
        parser.add_argument("--weight-gradients", action="store_true",
                            help="the LSTM weight gradients Aᵀ · B of each grid shape instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args


def grid_products() -> list[tuple[str, int, int, int]]:
    """(label, rows, K, N): each CPU grid shape's per-step R·h and a 128-row W·x chunk."""
    gemms = []
    for name in ("small", "medium", "fastrnns", "wide"):
        s = SHAPES[name]
        gemms += [(f"{name} R·h", s.B, s.H, 4 * s.H), (f"{name} W·x chunk", 128, s.I, 4 * s.H)]
    return gemms


def machine(args: argparse.Namespace) -> str:
    """The table header's conditions: CPU, flags, threads, torch, platform."""
    return (f"{cpu_model()} ({' '.join(cpu_flags() or [])}), {args.threads} thread(s), torch {torch.__version__}, "
            f"{platform.platform()}")


def write(lines: list[str], args: argparse.Namespace) -> None:
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


def weight_gradients(args: argparse.Namespace, extension, own: list[str]) -> list[str]:
    """The table of each grid shape's dW and dR, Aᵀ · B: MKL against the own kernels in place."""
    header = f"float32 weight gradients Aᵀ · B, GFLOP/s (best of {args.repeats}), {machine(args)}"
    lines = [header, "", "| gradient | A rows × N, B's K | MKL | "
             + " | ".join(f"rnnkit {k} {how}" for k in own for how in ("in place", "packed"))
             + " | a pass takes |", "|---|---|---|" + "---|" * (2 * len(own)) + "---|"]
    generator = torch.Generator().manual_seed(0)
    for name in ("stream", "small", "medium", "fastrnns", "wide"):
        s = SHAPES[name]
        rows, N = s.T * s.B, 4 * s.H
        A = torch.randn(rows, N, generator=generator)
        for label, K in (("dW", s.I), ("dR", s.H)):
            B = torch.randn(rows, K, generator=generator)
            flop = 2 * rows * N * K / 1e9
            rates = [flop / best_seconds(lambda: torch.mm(A.t(), B), args.repeats)]
            for kernel in own:
                with use_fp32_gemm(kernel):
                    rates.append(flop / best_seconds(lambda: extension.f32_gemm_at_b(A, B), args.repeats))
                    rates.append(flop / best_seconds(lambda: extension.f32_gemm_at_b_packed(A, B), args.repeats))
            if not extension.f32_own_weight_gradients():
                taken = "MKL"
            else:
                taken = "in place" if extension.f32_at_b_in_place(rows, N) else "packed"
            lines.append(f"| {name} {label} | {rows} × {N}, {K} | " + " | ".join(f"{r:.1f}" for r in rates)
                         + f" | {taken} |")
    return lines


def main(argv=None) -> int:
    args = arguments(__doc__, argv, weight_gradients=True)
    extension = build.extension()
    own = [name for name in fp32_gemms() if name not in ("mkl", "avx512-mkl")]  # avx512-mkl: avx512's kernels
    if not own:
        print("no own float32 kernels on this CPU: nothing to compare", file=sys.stderr)
        return 1
    if args.weight_gradients:
        write(weight_gradients(args, extension, own), args)
        return 0
    gemms = grid_products()
    header = f"float32 GEMM, GFLOP/s (best of {args.repeats}), {machine(args)}"
    lines = [header, "", "| product | rows × K × N | MKL | oneDNN | " + " | ".join(f"rnnkit {k}" for k in own)
             + " | packing once (µs) |", "|---|---|---|---|" + "---|" * len(own) + "---|"]
    generator = torch.Generator().manual_seed(0)
    for label, M, K, N in gemms:
        x, w = torch.randn(M, K, generator=generator), torch.randn(N, K, generator=generator)
        out = torch.empty(M, N)
        flop = 2 * M * K * N / 1e9
        rates = [flop / best_seconds(lambda: torch.mm(x, w.t(), out=out), args.repeats),
                 flop / best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                     args.repeats)]
        pack_us = None
        for kernel in own:
            with use_fp32_gemm(kernel):
                packed = extension.f32_pack(w, False)
                pack_us = best_seconds(lambda: extension.f32_pack(w, False), 5) * 1e6
                rates.append(flop / best_seconds(lambda: extension.f32_gemm_packed(x, packed, N), args.repeats))
        lines.append(f"| {label} | {M} × {K} × {N} | " + " | ".join(f"{r:.1f}" for r in rates) + f" | {pack_us:.0f} |")
    write(lines, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
