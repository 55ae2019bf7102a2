// int8 GEMMs of quantized inference (rnnkit.quantize): weights int8 per output row with a float
// scale each (symmetric, values in [-127, 127]), activations quantized per row as they arrive
// (symmetric, scale max|x| / 127), products summed exactly in int32, then scaled back to float.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rnnkit {

// M[n, k] ≈ scale[n] · data[n · ld + k]: a row-major int8 matrix with one scale per row.
struct QuantizedRows {
  const int8_t* data = nullptr;
  const float* scale = nullptr;
  int64_t ld = 0;
};

// C[r, n] = sx[r] · M.scale[n] · Σ_k qx[r, k] · M.data[n, k] + beta · C[r, n] for r < rows,
// n < N, where qx[r, :] = round(X[r, :] / sx[r]) and sx[r] = max_k |X[r, k]| / 127 (a zero row
// gives zeros). beta is 0 (C is not read) or 1.
void qgemm_nt(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K, float beta,
              float* C, int64_t ldc);

// Bytes of qgemm_pack's layout of an [N, K] matrix: panels of 8 rows, each [ceil(K / 4)][8][4]
// (4 consecutive k of 8 rows per 32 bytes), N and K zero-padded to whole panels and groups; then
// Σ_k M[n, k] for each n of the padded N as int32 (what the VNNI kernels' unsigned x + 128 adds).
int64_t qgemm_packed_bytes(int64_t N, int64_t K);

// M's values (not its scales) into that layout, once per pass, so that every GEMM of the pass
// reads 8 outputs' worth of products per vector with no horizontal sums.
void qgemm_pack(const QuantizedRows& M, int64_t N, int64_t K, int8_t* dest);

// Up to this many rows multiplied once by M (a one-step call) go through qgemm_unpacked on M as
// it is: packing M reads and writes all of it, which costs more than the few products.
constexpr int64_t kUnpackedRows = 8;

// qgemm_nt straight off row-major M (no packing), for a product of a few rows done once (a
// one-step call): bit for bit the same results.
void qgemm_unpacked(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K,
                    float beta, float* C, int64_t ldc);

// qgemm_nt of one row of X, straight off row-major M (no packing): for passes of a single row
// (a one-step call of batch one), where packing M would cost more than the product. Bit for bit
// the same results.
void qgemv_rows(const float* x, const QuantizedRows& M, int64_t N, int64_t K, float beta, float* C);

// qgemm_nt with M packed by qgemm_pack (scale: M.scale): the same results, bit for bit.
void qgemm_nt_packed(const float* X, int64_t rows, int64_t ldx, const int8_t* packed, const float* scale, int64_t N,
                     int64_t K, float beta, float* C, int64_t ldc);

// The kernels in use: "avx512-vnni", "avx-vnni" (GCC 11 or later builds these), "avx2" or
// "scalar" (a build without AVX2), the fastest this CPU runs; or $RNNKIT_INT8_KERNEL's choice
// (read once, at the first int8 product), which may also be "emulated-vnni". All give the same
// results bit for bit.
const char* int8_kernel();

// The kernels this CPU can run, "emulated-vnni" among them where AVX2 is (the VNNI kernels'
// arithmetic in AVX2 instructions: how a CPU without VNNI tests that code).
std::vector<std::string> int8_kernels();

// Use `name` ("auto": the CPU's choice) from now on, for every thread; returns the previous name
// ("auto" where a bad $RNNKIT_INT8_KERNEL left none). A ValueError for a name not in int8_kernels().
std::string set_int8_kernel(const std::string& name);

}  // namespace rnnkit
