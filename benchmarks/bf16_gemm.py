"""The bfloat16 GEMM kernels of a bfloat16 module's passes against float32 GEMMs, in one process, on
the passes' own shapes: rnnkit's bfloat16 kernels (each this CPU runs but the emulation, on weights
packed once as a pass packs them and X already rounded to bfloat16, as a pass's products mostly
take it), MKL's sgemm (``torch.mm``), oneDNN's float32 matmul and oneDNN's bfloat16 matmul
(``torch.mm`` on bfloat16 tensors: bfloat16 results, where the passes' kernels sum into float32).
The measurement behind ``rnnkit.fused.bf16_kernel``'s choice. Rates count 2·rows·K·N operations
per product.

    python benchmarks/bf16_gemm.py --threads 1 --out benchmarks/results/NAME.md

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
    kernels = [name for name in extension.bf16_kernels() if name not in ("none", "emulated-bf16")]
    if not kernels:
        print("no bfloat16 GEMM kernels on this CPU (AVX512_BF16 or AMX-BF16 needed): nothing to compare",
              file=sys.stderr)
        return 1
    header = f"bfloat16 and float32 GEMMs, GFLOP/s (best of {args.repeats}), {machine(args)}"
    lines = [header, "", "| product | rows × K × N | MKL fp32 | oneDNN fp32 | oneDNN bf16 | "
             + " | ".join(f"rnnkit {k}" for k in kernels) + " |",
             "|---|---|---|---|---|" + "---|" * len(kernels)]
    generator = torch.Generator().manual_seed(0)
    previous = extension.set_bf16_kernel("auto")  # the choice in force, put back at the end
    try:
        for label, M, K, N in grid_products():
            x, w = torch.randn(M, K, generator=generator), torch.randn(N, K, generator=generator)
            xb, wb = x.bfloat16(), w.bfloat16()
            wbt = wb.t()
            out = torch.empty(M, N)
            flop = 2 * M * K * N / 1e9
            rates = [flop / best_seconds(lambda: torch.mm(x, w.t(), out=out), args.repeats),
                     flop / best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                         args.repeats),
                     flop / best_seconds(lambda: torch.mm(xb, wbt), args.repeats)]
            for kernel in kernels:
                extension.set_bf16_kernel(kernel)
                packed = extension.bf16_pack(wb)
                rates.append(flop / best_seconds(lambda: extension.bf16_gemm_packed(xb, packed, N, out),
                                                 args.repeats))
            lines.append(f"| {label} | {M} × {K} × {N} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")
    finally:
        extension.set_bf16_kernel(previous)
    write(lines, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
