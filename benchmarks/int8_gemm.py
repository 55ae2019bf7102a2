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

import sys

import torch

from fp32_gemm import arguments, best_seconds, grid_products, machine, write  # benchmarks/, beside this file
from rnnkit.fused import build


def main(argv=None) -> int:
    args = arguments(__doc__, argv)
    extension = build.extension()
    kernels = [name for name in extension.int8_kernels() if name != "scalar"]
    header = f"int8 and float32 GEMMs, GOP/s (best of {args.repeats}), {machine(args)}"
    lines = [header, "", "| product | rows × K × N | MKL fp32 | oneDNN fp32 | "
             + " | ".join(f"rnnkit int8 {k}" for k in kernels) + " |",
             "|---|---|---|---|" + "---|" * len(kernels)]
    generator = torch.Generator().manual_seed(0)
    previous = extension.set_int8_kernel("auto")  # the choice in force, put back at the end
    try:
        for label, M, K, N in grid_products():
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
        extension.set_int8_kernel(previous)
    write(lines, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
