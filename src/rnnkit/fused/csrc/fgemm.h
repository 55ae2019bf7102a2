// float32 GEMMs on the kernels' own packed panels, for the passes' products with a weight matrix
// (per step R·h, the input projection W·x, the backward's products with R and W), and for the
// weight gradients (up to 2²¹ floats of A f32_gemm_at_b, both operands read in place, no panels;
// beyond, pass.cpp's f32_weight_gradient_packed: (Bᵀ · A)ᵀ with A packed as the right operand).
// The right operand is packed once per pass into panels of 16 output columns, and a block of
// panels times a few rows of X keeps its sums in registers (AVX-512: 4 panels x 6 rows, 24 zmm;
// AVX2: 1 panel x 6 rows, 12 ymm). Chosen over MKL by measurement (benchmarks/fp32_gemm.py): on an
// AVX-512 EPYC (Zen 4) MKL's sgemm reached 72-96 GFLOP/s on the per-step shapes, oneDNN's 53-105,
// these kernels 106-116, and the AVX2 kernel, run there as on a CPU without AVX-512, 75-113
// against MKL's 66-99 (MKL takes its AVX2 code on that CPU; benchmarks/results/2026-11-28zf-*),
// so "auto" takes it where AVX-512 is missing. The AVX2 kernel's weight gradients (strided blocks)
// read 40-80 there against MKL's 82-94: with it the weight gradients stay MKL's
// (f32_own_weight_gradients).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rnnkit {

// The float32 GEMM kernels in use: "avx512", "avx2" (the kernels' own, on the CPU's widest
// vectors), "avx512-mkl" (avx512's products, MKL's weight gradients: the choice on Intel's
// AVX-512 CPUs) or "mkl" (MKL's packed sgemm, as torch links it). The CPU's choice, or
// $RNNKIT_FP32_GEMM's (read once, at the first use).
const char* f32_kernel();

// Whether the passes multiply on the own kernels (f32_kernel() is not "mkl").
bool f32_own_products();

// Whether the weight gradients run on the own kernels too (f32_gemm_at_b, f32_gemm_packed_xt):
// "avx512" only; with "avx512-mkl", "avx2" or "mkl" they are MKL's.
bool f32_own_weight_gradients();

// The kernels this build and CPU can run ("mkl" always among them).
std::vector<std::string> f32_kernels();

// Use `name` ("auto": the CPU's choice) from now on; returns the previous name. A ValueError for a
// name not in f32_kernels().
std::string set_f32_kernel(const std::string& name);

// Floats of f32_pack's layout of an [N, K] matrix: panels of 16 rows of M, each [K][16]
// (element (n, k) of panel p = n / 16 at k * 16 + n % 16), N zero-padded to whole panels.
int64_t f32_packed_floats(int64_t N, int64_t K);

// M [N, K] (ld per row) into that layout: C = X · Mᵀ.
void f32_pack(const float* M, int64_t ld, int64_t N, int64_t K, float* dest);

// The same layout from M [K, N] (ld per row of M): C = X · M (a backward's products).
void f32_pack_transposed(const float* M, int64_t ld, int64_t N, int64_t K, float* dest);

// C[r, n] = Σ_k X[r, k] · M[n, k] + beta · C[r, n] (beta 0: C not read), M packed by f32_pack or
// f32_pack_transposed; X [rows, K], ldx per row. On the own kernel in use, or (the choice changed to
// "mkl" after M was packed) on the first own kernel this CPU runs.
void f32_gemm_packed(const float* X, int64_t rows, int64_t ldx, const float* packed, int64_t N, int64_t K,
                     float beta, float* C, int64_t ldc);

// f32_gemm_packed with X given as its transpose Xt [K, rows] (ldxt per row of Xt), read in place.
void f32_gemm_packed_xt(const float* Xt, int64_t ldxt, int64_t rows, const float* packed, int64_t N, int64_t K,
                        float beta, float* C, int64_t ldc);

// dest[c, r] = src[r, c] for src [rows, cols] (ld_src, ld_dest per row).
void f32_transpose(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dest, int64_t ld_dest);

// Whether a weight gradient Aᵀ · B with A [rows, N] goes to f32_gemm_at_b (f32_own_weight_gradients()
// and A is at most 2²¹ floats: measured faster there than MKL and than packing A), or not.
bool f32_at_b_in_place(int64_t rows, int64_t N);

// C[n, k] = Σ_r A[r, n] · B[r, k] (C [N, K] = Aᵀ · B, the weight gradients) on the own kernel in use,
// reading A [rows, N] (lda per row) and B [rows, K] (ldb per row) in place; C not read. Only
// where f32_own_products().
void f32_gemm_at_b(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t rows, int64_t N, int64_t K,
                   float* C, int64_t ldc);

// How many products f32_gemm_packed and f32_gemm_at_b have taken in this process (tests: that the passes reach it).
int64_t f32_gemm_count();

}  // namespace rnnkit
