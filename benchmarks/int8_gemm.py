"""The int8 GEMM kernels of ``rnnkit.quantize`` against float32 GEMMs, in one process, on the
passes' own shapes: rnnkit's int8 kernels (each this CPU runs, on weights packed once as a pass
packs them; the row quantization of X is in the timed product, as in a pass), MKL's sgemm
(``torch.mm``) and oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the library
torch.nn's RNNs run on). Rates count 2·rows·K·N operations per product, int8 or float.

    python benchmarks/int8_gemm.py --threads 1 --out benchmarks/results/NAME.md

Shapes: for each shape of the CPU grid with a batch, the per-step product R·h (B rows, K = H,
N = 4H) and a projection chunk W·x (128 rows, K = I, N = 4H). Best of ``--repeats`` calls.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from rnnkit.app.bench.registry import SHAPES
from rnnkit.app.machine import cpu_flags, cpu_model
from rnnkit.fused import build


def best_seconds(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    extension = build.extension()
    kernels = [name for name in extension.int8_kernels() if name != "scalar"]
    gemms = []
    for name in ("small", "medium", "fastrnns", "wide"):
        s = SHAPES[name]
        gemms += [(f"{name} R·h", s.B, s.H, 4 * s.H), (f"{name} W·x chunk", 128, s.I, 4 * s.H)]
    header = (f"int8 and float32 GEMMs, GOP/s (best of {args.repeats}), {cpu_model()} "
              f"({' '.join(cpu_flags() or [])}), {args.threads} thread(s), torch {torch.__version__}, "
              f"{platform.platform()}")
    lines = [header, "", "| product | rows × K × N | MKL fp32 | oneDNN fp32 | "
             + " | ".join(f"rnnkit int8 {k}" for k in kernels) + " |",
             "|---|---|---|---|" + "---|" * len(kernels)]
    generator = torch.Generator().manual_seed(0)
    previous = os.environ.get("RNNKIT_INT8_KERNEL")
    try:
        for label, M, K, N in gemms:
            x, w = torch.randn(M, K, generator=generator), torch.randn(N, K, generator=generator)
            scale = w.abs().amax(1) / 127
            q = torch.round(w / scale[:, None]).to(torch.int8)
            packed = extension.q_pack(q, scale)
            out = torch.empty(M, N)
            flop = 2 * M * K * N / 1e9
            rates = [flop / best_seconds(lambda: torch.mm(x, w.t(), out=out), args.repeats),
                     flop / best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                         args.repeats)]
            for kernel in kernels:
                extension.set_int8_kernel(kernel)
                rates.append(flop / best_seconds(lambda: extension.qgemm_packed(x, packed, scale), args.repeats))
            lines.append(f"| {label} | {M} × {K} × {N} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")
    finally:
        extension.set_int8_kernel(previous or "auto")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
