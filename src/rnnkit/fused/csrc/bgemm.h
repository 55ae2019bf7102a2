// bfloat16 GEMMs of a bfloat16 module's batched passes on CPUs with AVX512_BF16: both operands in
// bfloat16 (X rounded to nearest even as it is packed; W, R and W_hr are bfloat16 already), products
// summed in float32 by vdpbf16ps, results in float32. Elsewhere the passes widen the weights to
// float32 instead (gemm.h), so this is a speed path with the same contract: GEMM operands in
// bfloat16, accumulation, pointwise math and the carried state in float32.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace rnnkit {

struct HalfRows;

// The kernels in use: "avx512-bf16" (vdpbf16ps), "emulated-bf16" (its arithmetic in AVX-512F
// instructions: how a CPU without BF16 tests the code, never chosen by itself), or "none" (no
// such kernels: the passes widen bfloat16 weights to float32). The CPU's choice, or
// $RNNKIT_BF16_KERNEL's (read once, at the first use).
const char* bf16_kernel();

// Whether the kernels in use multiply (bf16_kernel() is not "none"): where the passes pack bfloat16
// weights for bf16_gemm_packed rather than widen them.
bool bf16_products();

// The kernels this CPU can run ("none" always among them).
std::vector<std::string> bf16_kernels();

// Use `name` ("auto": the CPU's choice) from now on; returns the previous name. A ValueError for a
// name not in bf16_kernels().
std::string set_bf16_kernel(const std::string& name);

// Bytes of bf16_pack's layout of an [N, K] matrix: panels of 16 rows, each [ceil(K / 2)][16][2]
// (2 consecutive k of 16 rows per 64 bytes), N and K zero-padded to whole panels and pairs.
int64_t bf16_packed_bytes(int64_t N, int64_t K);

// M (bfloat16 [N, K], M.bf16 true) into that layout, once per pass.
void bf16_pack(const HalfRows& M, int64_t N, int64_t K, uint16_t* dest);

// The same layout from M [K, N] (M.ld per row of M): panels of 16 of its columns, for C = X · M.
void bf16_pack_transposed(const HalfRows& M, int64_t N, int64_t K, uint16_t* dest);

// The same layout from float32 M [K, N] (ld per row of M), rounded to bfloat16 (nearest even): a
// weight gradient's right operand (h or x over the T·B rows, as the columns of Mᵀ).
void bf16_pack_float_transposed(const float* M, int64_t ld, int64_t N, int64_t K, uint16_t* dest);

// C[r, n] = Σ_k bf16(X[r, k]) · M[n, k] + beta · C[r, n] (beta 0: C not read), M packed by
// bf16_pack; float32 X is rounded to bfloat16 (nearest even) as it is read. Needs bf16_kernel()
// other than "none".
void bf16_gemm_packed(const float* X, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t N, int64_t K,
                      float beta, float* C, int64_t ldc);

// The same with X given transposed, read in place: X[r, k] = A[k, r] for float32 A [K, rows] (lda
// per row of A): a weight gradient's dGᵀ · (h or x) where a pass keeps dG [T·B, G·H] whole (the GRU's).
void bf16_gemm_packed_t(const float* A, int64_t rows, int64_t lda, const uint16_t* packed, int64_t N, int64_t K,
                        float beta, float* C, int64_t ldc);

// X rounded to bfloat16 once, for several products that read it (an LSTM's dR and dW both take dGᵀ):
// [rows, ld] bits, K zero-padded to whole pairs (ld), in a buffer it owns.
struct Bf16RoundedX {
  at::Tensor storage;
  const uint16_t* data = nullptr;
  int64_t rows = 0, K = 0, ld = 0;
};

// float32 X [rows, K] (ldx per row), or with `transposed` X[r, k] = A[k, r] for A [K, rows] (ldx per
// row of A), rounded to nearest even as bf16_gemm_packed(_t) rounds it. Needs bf16_kernel() other than "none".
Bf16RoundedX bf16_round(const float* X, int64_t rows, int64_t ldx, bool transposed, int64_t K);

// A rounding of X [rows, K] to be written piece by piece with bf16_round_part (a backward's dG, a
// step's rows at a time while they are in cache): K's padding zeroed, the rest left to the pieces.
Bf16RoundedX bf16_rounded_buffer(int64_t rows, int64_t K);

// float32 X [rows, K] (ldx per row), or with `transposed` X[r, k] = A[k, r] for A [K, rows], rounded
// as bf16_round rounds it into rows [first_row, first_row + rows) and columns [first_k, first_k + K) of
// `out` (from bf16_rounded_buffer), nothing else written.
void bf16_round_part(const float* X, int64_t rows, int64_t ldx, bool transposed, int64_t K, const Bf16RoundedX& out,
                     int64_t first_row, int64_t first_k);

// How many bf16_round_part calls this process has made (tests: that the passes round dG a step at a time).
int64_t bf16_round_part_count();

// Rows [first_row, first_row + rows) of a rounding, as a rounding of their own (sharing X's storage).
Bf16RoundedX bf16_rows_of(const Bf16RoundedX& X, int64_t first_row, int64_t rows);

// C[r, n] = Σ_k X[r, k] · M[n, k] + beta · C[r, n] for X rounded by bf16_round (or pieced by
// bf16_round_part into a bf16_rounded_buffer, or rows of either by bf16_rows_of), M [N, X.K] packed by
// bf16_pack / bf16_pack_(float_)transposed: bf16_gemm_packed(_t)'s result, bit for bit.
void bf16_gemm_rounded(const Bf16RoundedX& X, const uint16_t* packed, int64_t N, float beta, float* C, int64_t ldc);

}  // namespace rnnkit
