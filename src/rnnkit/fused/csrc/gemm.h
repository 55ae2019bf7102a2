// The right operand of the per-step GEMMs, packed once per pass so that T steps do not re-pack the
// same weights T times: into the own float32 kernels' panels (fgemm.h) or, where f32_kernel() is
// "mkl", into MKL's internal layout (its packed GEMM):
// row-major C[rows, N] = X[rows, K] · op(M) + beta · C, op(M) = Mᵀ when `trans`.
// With one row (batch of one) it packs nothing and runs the kernels' own matrix-vector loops.
// int8 weights (quantized inference, float only) are packed once per pass by qgemm_pack.
// bfloat16 / float16 weights (a half-precision module, float32 math) are read as they are for one
// row or a few rows once, packed for the CPU's bfloat16 products (bgemm.h) where it has them, and
// widened to float32 once per pass otherwise; in inference and in training's products.
#pragma once

#include <ATen/core/Tensor.h>

#include "bgemm.h"
#include "qgemm.h"

namespace rnnkit {

using at::Tensor;

// A bfloat16 or float16 row-major matrix [N, K] (leading dimension ld): the weights of a
// half-precision module, which the kernels read as float32 (exactly: every such value is one).
struct HalfRows {
  const void* data = nullptr;
  int64_t ld = 0;
  bool bf16 = true;  // else float16
  HalfRows rows_from(int64_t first) const;  // the matrix from row `first` on
};

// out[n, k] = M[n, k] as float32, [N, K] contiguous.
void widen_rows(const HalfRows& M, int64_t N, int64_t K, float* out);

template <typename scalar_t>
class PackedRight {
 public:
  // `pack` false: M is used for one product only (a one-step call), so it is not packed.
  PackedRight(const scalar_t* M, int64_t ldm, bool trans, int64_t rows, int64_t N, int64_t K, const Tensor& like,
              bool pack = true);
  // C = X · Mᵀ with M [N, K] int8 per row; `like`: an int8 tensor (the packed buffer's type);
  // `pack` false multiplies M as it is (a single product of a few rows does not pay for packing).
  PackedRight(const QuantizedRows& M, int64_t rows, int64_t N, int64_t K, const Tensor& like, bool pack);
  // C = X · Mᵀ with M [N, K] bfloat16 / float16: read as it is for one row, or a few rows once
  // (`pack` false), else packed for the CPU's bfloat16 products (bgemm.h) or widened to float32
  // once and packed as a float M. `transposed`: C = X · M with M [K, N] (a backward's products),
  // never read as it is.
  PackedRight(const HalfRows& M, int64_t rows, int64_t N, int64_t K, const Tensor& like, bool pack,
              bool transposed = false);
  void multiply(const scalar_t* X, int64_t ldx, scalar_t beta, scalar_t* C, int64_t ldc) const;
  // Whether M is packed for the CPU's bfloat16 products, where X may come rounded already (below).
  bool takes_rounded() const { return bf16_packed_ != nullptr; }
  // The product of X rounded by bf16_round (or pieced by bf16_round_part), rows_ of them: what
  // multiply gives for the float32 X they were rounded from, bit for bit. Needs takes_rounded().
  void multiply(const Bf16RoundedX& X, float beta, float* C, int64_t ldc) const;

 private:
  void pack_float(const Tensor& like, bool pack);  // matrix_ into storage_ with MKL's packing (float32)
  Tensor storage_;
  int64_t rows_, N_, K_, ldm_;
  const scalar_t* matrix_ = nullptr;
  bool trans_ = true;
  const float* quantized_scale_ = nullptr;  // int8 M: its scales (storage_ holds it packed, for rows > 1)
  QuantizedRows quantized_;                  // int8 M as given (used unpacked for a single product)
  Tensor widened_;                           // half M widened to float32 (matrix_ points into it)
  HalfRows half_;                            // half M read as it is (gemv_small_batch) where data is set
  const uint16_t* bf16_packed_ = nullptr;    // bfloat16 M packed by bf16_pack (in storage_)
  const float* f32_packed_ = nullptr;        // float32 M packed by f32_pack for the own kernels (in storage_)
  mutable bool backwards_ = false;           // the direction of the last one-row product (gemv_rows / columns)
};

// C[N] = M[N, K] · x[K] (+ beta · C): one row times Mᵀ, the matrix-vector loop of PackedRight.
// backwards: rows of M from the last to the first (the same values).
void gemv_rows(const float* M, int64_t ldm, int64_t N, int64_t K, const float* x, float beta, float* C,
               bool backwards);

// One product of at most this many rows by an unpacked M goes through gemv_small_batch, not sgemm.
constexpr int64_t kSmallBatch = 8;

// C[rows, N] = X[rows, K] · Mᵀ (+ beta · C), M [N, K] row-major, for a few rows (≤ kSmallBatch):
// the matrix-vector loops widened to four rows of X per read of M.
void gemv_small_batch(const float* M, int64_t ldm, int64_t N, int64_t K, const float* X, int64_t ldx, int64_t rows,
                      float beta, float* C, int64_t ldc);
// The same with M bfloat16 / float16, widened as it is read (half float32's bytes).
void gemv_small_batch(const HalfRows& M, int64_t N, int64_t K, const float* X, int64_t ldx, int64_t rows, float beta,
                      float* C, int64_t ldc);

}  // namespace rnnkit
