"""What the CPU is: its model name and the SIMD features that decide the kernels' speed,
read from /proc/cpuinfo (Linux); one place for the doctor, the trainer's bf16 note and the
benchmark's table headers."""
from __future__ import annotations

import platform
from pathlib import Path
from typing import List, Optional

SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile",
              "amx_bf16", "amx_int8")


def _field(name: str) -> Optional[str]:
    """The first /proc/cpuinfo line's value for ``name`` (None where there is no such file or line)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.split(":", 1)[0].strip() == name), None)


def cpu_model() -> str:
    return _field("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_vendor() -> Optional[str]:
    """The CPU's vendor string ("GenuineIntel", "AuthenticAMD"; None where unknown)."""
    return _field("vendor_id")


def cpu_flags() -> Optional[List[str]]:
    """The CPU's features among `SIMD_FLAGS`, in that order (None where unknown)."""
    flags = _field("flags")
    if flags is None:
        return None
    present = set(flags.split())
    return [flag for flag in SIMD_FLAGS if flag in present]


def has_bf16() -> Optional[bool]:
    """Whether the CPU has bfloat16 instructions (AVX512_BF16 or AMX-BF16); None where unknown."""
    flags = cpu_flags()
    return None if flags is None else ("avx512_bf16" in flags or "amx_bf16" in flags)


def expected_bf16_kernel(flags: Optional[List[str]], torch_capability: str) -> str:
    """The bfloat16 GEMM kernels `rnnkit.fused.bf16_kernel()` will report once the fused kernels are
    built, without building them."""
    del torch_capability  # compiled for their instruction set whatever torch dispatches to (bgemm.cpp)
    present = set(flags or ())
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= present:
        return "none"
    # AMX also needs the kernel's permission (Linux 5.16 and later grant it): asked when the kernels load
    return "amx-bf16" if {"amx_tile", "amx_bf16"} <= present else "avx512-bf16"


def expected_fp32_gemm(flags: Optional[List[str]], torch_capability: str, vendor: Optional[str] = None) -> str:
    """The float32 GEMM kernels `rnnkit.fused.fp32_gemm()` will report once the fused kernels are
    built, without building them."""
    del torch_capability  # compiled for their instruction set whatever torch dispatches to (fgemm.cpp)
    present = set(flags or ())
    if "avx512f" in present:
        # the weight gradients on MKL's where it was measured faster: Intel's CPUs (fgemm.cpp)
        return "avx512-mkl" if (cpu_vendor() if vendor is None else vendor) == "GenuineIntel" else "avx512"
    return "avx2" if {"avx2", "fma"} <= present else "mkl"


def expected_int8_kernel(flags: Optional[List[str]], torch_capability: str) -> str:
    """The int8 kernels `rnnkit.quantized.int8_kernel()` will report once the fused kernels are
    built (they follow torch's CPU capability, then pick by the CPU's features), without building them."""
    if torch_capability not in ("AVX2", "AVX512"):
        return "scalar"
    present = set(flags or ())
    if {"avx512_vnni", "avx512vl", "avx512bw"} <= present:
        # AMX also needs the kernel's permission (Linux 5.16 and later grant it): asked when the kernels load
        return "amx-int8" if {"amx_tile", "amx_int8"} <= present else "avx512-vnni"
    return "avx-vnni" if "avx_vnni" in present else "avx2"
