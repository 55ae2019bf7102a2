// The per-step GEMMs of the fused passes: the own float32 kernels (fgemm.h) or MKL's packed sgemm
// for the right operand packed once per pass, dgemm for float64, and the kernels' own
// matrix-vector loops for one batch row (and for a few rows once), on float32 or half-precision
// (bfloat16 / float16) weights.
#include "gemm.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>

#include "bgemm.h"
#include "buffers.h"
#include "fgemm.h"
#include "simd.h"

extern "C" {
// BLAS from the MKL that libtorch_cpu links and exports (LP64: int sizes).
// GEMMs: float32 for a right operand used once (not worth packing), float64 (torch's MKL exports
// no packed dgemm).
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
// MKL's packed GEMM: pack one operand once, multiply many times.
size_t sgemm_pack_get_size_(const char* id, const int* m, const int* n, const int* k);
void sgemm_pack_(const char* id, const char* trans, const int* m, const int* n, const int* k, const float* alpha,
                 const float* src, const int* ld, float* dest);
void sgemm_compute_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* a,
                    const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc);
}

namespace rnnkit {

namespace {
using FVec = at::vec::Vectorized<float>;

// One batch row (B = 1, streaming): C = x · op(M) is a matrix-vector product that reads all of M
// per step. These two loops stream a 1 MB M from L2 at ~140 GB/s here, MKL's packed GEMM and its
// gemv at ~100 and ~70 (C++ microbenchmark, H = 256 LSTM's R). Both read M once, in order.
// Threads split the output when M is large enough to pay for them.
constexpr int64_t kGemvGrain = 1 << 16;  // matrix values per thread, at least

inline float hsum(const FVec& v) {
  return at::vec::vec_reduce_all<float>([](const FVec& a, const FVec& b) { return a + b; }, v);
}

inline void put(float* c, float value, float beta) { *c = beta == 0 ? value : value + beta * *c; }

// put(c + r, hsum(s[r]), beta) for r < count (≤ 4): with AVX-512 the four sums reduced side by side
// in one register (15 instructions for the four, where four hsums and scalar stores take 40; perf
// put a fifth of the loop's samples on them; a stream LSTM's inference 2-3% faster at H 192-320),
// each on hsum's tree (lanes 8, 4, 2, 1 apart), so the same values bit for bit.
inline void put4(float* c, const FVec* s, int count, float beta) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 s0 = s[0], s1 = count > 1 ? __m512(s[1]) : s0, s2 = count > 2 ? __m512(s[2]) : s0,
               s3 = count > 3 ? __m512(s[3]) : s0;
  // lanes 8 apart: the halves of rows 0, 1 (2, 3) side by side in one register
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x44), _mm512_shuffle_f32x4(s0, s1, 0xee));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(s2, s3, 0x44), _mm512_shuffle_f32x4(s2, s3, 0xee));
  // lanes 4 apart: row r in the r-th quarter
  __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xdd));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));  // 2 apart
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));  // 1 apart
  __m128 sums = _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, v));
  const __mmask8 lanes = __mmask8((1u << count) - 1);
  if (beta != 0) sums = _mm_add_ps(sums, _mm_mul_ps(_mm_set1_ps(beta), _mm_maskz_loadu_ps(lanes, c)));
  _mm_mask_storeu_ps(c, lanes, sums);
#else
  for (int r = 0; r < count; ++r) put(c + r, hsum(s[r]), beta);
#endif
}

}  // namespace

// C[n] = Σ_k x[k]·M[n, k] + beta·C[n] for n in [0, N): dot products, four rows of M at a time; from
// the last row back to the first when `backwards` (the same values, bit for bit).
void gemv_rows(const float* M, int64_t ldm, int64_t N, int64_t K, const float* x, float beta, float* C,
               bool backwards) {
  at::parallel_for(0, (N + 3) / 4, std::max<int64_t>(1, kGemvGrain / (4 * K)), [&](int64_t begin, int64_t end) {
    const int64_t first = 4 * begin, stop = std::min(N, 4 * end), full = first + (stop - first) / 4 * 4;
    auto four = [&](int64_t n) {
      const float* m = M + n * ldm;
      FVec s0(0), s1(0), s2(0), s3(0);
      vec_loop<float>(K, [&](int64_t k, int64_t count) {
        const FVec xv = FVec::loadu(x + k, count);
        s0 = at::vec::fmadd(FVec::loadu(m + k, count), xv, s0);
        s1 = at::vec::fmadd(FVec::loadu(m + ldm + k, count), xv, s1);
        s2 = at::vec::fmadd(FVec::loadu(m + 2 * ldm + k, count), xv, s2);
        s3 = at::vec::fmadd(FVec::loadu(m + 3 * ldm + k, count), xv, s3);
      });
      const FVec sums[4] = {s0, s1, s2, s3};
      put4(C + n, sums, 4, beta);
    };
    auto one = [&](int64_t n) {
      FVec s(0);
      vec_loop<float>(K, [&](int64_t k, int64_t count) {
        s = at::vec::fmadd(FVec::loadu(M + n * ldm + k, count), FVec::loadu(x + k, count), s);
      });
      put(C + n, hsum(s), beta);
    };
    if (backwards) {
      for (int64_t n = stop - 1; n >= full; --n) one(n);
      for (int64_t n = full - 4; n >= first; n -= 4) four(n);
    } else {
      for (int64_t n = first; n < full; n += 4) four(n);
      for (int64_t n = full; n < stop; ++n) one(n);
    }
  });
}

namespace {

// C[r, n] = Σ_k X[r, k]·M[n, k] + beta·C[r, n] for the R ≤ 4 rows of X: two rows of M at a time,
// each read once for all R rows (R·2 accumulators). M float32, or bfloat16 / float16 widened as read.
template <int R, typename m_t>
void gemv_rows_block(const m_t* M, int64_t ldm, int64_t N, int64_t K, const float* X, int64_t ldx, float beta,
                     float* C, int64_t ldc) {
  at::parallel_for(0, (N + 1) / 2, std::max<int64_t>(1, kGemvGrain / (2 * K)), [&](int64_t begin, int64_t end) {
    const int64_t stop = std::min(N, 2 * end);
    for (int64_t n = 2 * begin; n < stop; n += 2) {
      const bool pair = n + 1 < stop;
      const m_t* m0 = M + n * ldm;
      const m_t* m1 = pair ? m0 + ldm : m0;  // the last odd row: computed twice, stored once
      FVec a0[R], a1[R];
      for (int r = 0; r < R; ++r) a0[r] = FVec(0), a1[r] = FVec(0);
      vec_loop<float>(K, [&](int64_t k, int64_t count) {
        const FVec w0 = load_float(m0 + k, count), w1 = load_float(m1 + k, count);
        for (int r = 0; r < R; ++r) {
          const FVec xv = FVec::loadu(X + r * ldx + k, count);
          a0[r] = at::vec::fmadd(w0, xv, a0[r]);
          a1[r] = at::vec::fmadd(w1, xv, a1[r]);
        }
      });
      for (int r = 0; r < R; ++r) {
        put(C + r * ldc + n, hsum(a0[r]), beta);
        if (pair) put(C + r * ldc + n + 1, hsum(a1[r]), beta);
      }
    }
  });
}

// gemv_rows_block over `rows` rows of X, four at a time.
template <typename m_t>
void small_batch(const m_t* M, int64_t ldm, int64_t N, int64_t K, const float* X, int64_t ldx, int64_t rows,
                 float beta, float* C, int64_t ldc) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const float* x = X + r0 * ldx;
    float* c = C + r0 * ldc;
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1: gemv_rows_block<1>(M, ldm, N, K, x, ldx, beta, c, ldc); break;
      case 2: gemv_rows_block<2>(M, ldm, N, K, x, ldx, beta, c, ldc); break;
      case 3: gemv_rows_block<3>(M, ldm, N, K, x, ldx, beta, c, ldc); break;
      default: gemv_rows_block<4>(M, ldm, N, K, x, ldx, beta, c, ldc); break;
    }
  }
}

// C[n] = Σ_k x[k]·M[n, k] + beta·C[n] for one row x and half-precision M: four rows of M at a
// time, each with two accumulators (eight independent chains: the widening loads leave the FMAs
// latency-bound with fewer; the float loop above, with four, is bound by reading twice the bytes).
template <typename m_t>
void gemv_rows_widened(const m_t* M, int64_t ldm, int64_t N, int64_t K, const float* x, float beta, float* C) {
  constexpr int64_t w = FVec::size();
  at::parallel_for(0, (N + 3) / 4, std::max<int64_t>(1, kGemvGrain / (4 * K)), [&](int64_t begin, int64_t end) {
    const int64_t stop = std::min(N, 4 * end);
    for (int64_t n = 4 * begin; n < stop; n += 4) {
      const int64_t count_rows = std::min<int64_t>(4, stop - n);
      const m_t* m[4];
      for (int r = 0; r < 4; ++r) m[r] = M + (n + std::min<int64_t>(r, count_rows - 1)) * ldm;  // past the end: repeat
      FVec a[4] = {FVec(0), FVec(0), FVec(0), FVec(0)}, b[4] = {FVec(0), FVec(0), FVec(0), FVec(0)};
      int64_t k = 0;
      for (; k + 2 * w <= K; k += 2 * w) {
        const FVec x0 = FVec::loadu(x + k), x1 = FVec::loadu(x + k + w);
        for (int r = 0; r < 4; ++r) {
          a[r] = at::vec::fmadd(load_float(m[r] + k, w), x0, a[r]);
          b[r] = at::vec::fmadd(load_float(m[r] + k + w, w), x1, b[r]);
        }
      }
      for (; k < K; k += w) {
        const int64_t count = std::min(w, K - k);
        const FVec x0 = FVec::loadu(x + k, count);
        for (int r = 0; r < 4; ++r) a[r] = at::vec::fmadd(load_float(m[r] + k, count), x0, a[r]);
      }
      for (int r = 0; r < 4; ++r) a[r] = a[r] + b[r];
      put4(C + n, a, int(count_rows), beta);
    }
  });
}

}  // namespace

void gemv_small_batch(const float* M, int64_t ldm, int64_t N, int64_t K, const float* X, int64_t ldx, int64_t rows,
                      float beta, float* C, int64_t ldc) {
  small_batch(M, ldm, N, K, X, ldx, rows, beta, C, ldc);
}

void gemv_small_batch(const HalfRows& M, int64_t N, int64_t K, const float* X, int64_t ldx, int64_t rows, float beta,
                      float* C, int64_t ldc) {
  if (M.bf16) {
    const auto* m = static_cast<const c10::BFloat16*>(M.data);
    rows == 1 ? gemv_rows_widened(m, M.ld, N, K, X, beta, C) : small_batch(m, M.ld, N, K, X, ldx, rows, beta, C, ldc);
  } else {
    const auto* m = static_cast<const c10::Half*>(M.data);
    rows == 1 ? gemv_rows_widened(m, M.ld, N, K, X, beta, C) : small_batch(m, M.ld, N, K, X, ldx, rows, beta, C, ldc);
  }
}

HalfRows HalfRows::rows_from(int64_t first) const {
  HalfRows out = *this;
  out.data = static_cast<const char*>(data) + first * ld * int64_t(sizeof(uint16_t));
  return out;
}

void widen_rows(const HalfRows& M, int64_t N, int64_t K, float* out) {
  const auto widen = [&](const auto* m) {
    at::parallel_for(0, N, std::max<int64_t>(1, kGemvGrain / std::max<int64_t>(1, K)), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        vec_loop<float>(K, [&](int64_t k, int64_t count) {
          vstore(load_float(m + n * M.ld + k, count), out + n * K + k, count);
        });
      }
    });
  };
  if (M.bf16) {
    widen(static_cast<const c10::BFloat16*>(M.data));
  } else {
    widen(static_cast<const c10::Half*>(M.data));
  }
}

namespace {

// C[n] = Σ_k x[k]·M[k, n] + beta·C[n]: rows of M scaled and summed into V SIMD registers' worth
// of columns at a time, from the last block of columns back to the first when `backwards` (the
// same values, bit for bit: each column's sum runs over k in order either way). V = 8 (128
// floats): eight independent multiply-add chains per row of M hide the reads' latency, where four
// left the loop waiting (T = 200, B = 1, H = 256 LSTM training: 12 -> 9 µs a step); sixteen
// measured the same as eight and would leave a H = 256 R one block, for one thread.
void gemv_columns(const float* M, int64_t ldm, int64_t N, int64_t K, const float* x, float beta, float* C,
                  bool backwards) {
  constexpr int V = 8;
  constexpr int64_t w = FVec::size(), block = V * w;
  at::parallel_for(0, (N + block - 1) / block, std::max<int64_t>(1, kGemvGrain / (block * K)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = (backwards ? begin + end - 1 - i : i) * block;
      const int64_t width = std::min(block, N - n);
      FVec acc[V];
      for (int j = 0; j < V; ++j) acc[j] = FVec(0);
      if (width == block) {
        for (int64_t k = 0; k < K; ++k) {
          const FVec xk(x[k]);
          const float* m = M + k * ldm + n;
          for (int j = 0; j < V; ++j) acc[j] = at::vec::fmadd(FVec::loadu(m + j * w), xk, acc[j]);
        }
      } else {
        for (int64_t k = 0; k < K; ++k) {
          const FVec xk(x[k]);
          const float* m = M + k * ldm + n;
          for (int64_t j = 0; j * w < width; ++j) {
            acc[j] = at::vec::fmadd(FVec::loadu(m + j * w, std::min(w, width - j * w)), xk, acc[j]);
          }
        }
      }
      for (int64_t j = 0; j * w < width; ++j) {
        const int64_t count = std::min(w, width - j * w);
        float* c = C + n + j * w;
        const FVec out = beta == 0 ? acc[j] : at::vec::fmadd(FVec(beta), FVec::loadu(c, count), acc[j]);
        out.store(c, count);
      }
    }
  });
}
}  // namespace

// matrix_ into storage_ by the own kernels' packing (or MKL's), unless it multiplies once or one
// row (gemv loops).
template <>
void PackedRight<float>::pack_float(const Tensor& like, bool pack) {
  if (rows_ <= 1 || !pack) return;  // an empty batch multiplies nothing
  if (f32_own_products()) {
    storage_ = cached_empty({f32_packed_floats(N_, K_)}, like);
    f32_packed_ = storage_.data_ptr<float>();
    (trans_ ? f32_pack : f32_pack_transposed)(matrix_, ldm_, N_, K_, storage_.data_ptr<float>());
    return;
  }
  const char id = 'A', ta = trans_ ? 'T' : 'N';
  const int m = int(N_), n = int(rows_), k = int(K_), ld = int(ldm_);
  const float one = 1;
  const size_t bytes = sgemm_pack_get_size_(&id, &m, &n, &k);
  storage_ = cached_empty({int64_t(bytes / sizeof(float) + 1)}, like);
  sgemm_pack_(&id, &ta, &m, &n, &k, &one, matrix_, &ld, storage_.data_ptr<float>());
}

template <>
void PackedRight<double>::pack_float(const Tensor&, bool) {}

// In column-major terms Cᵀ[N, rows] = op(M)ᵀ[N, K] · Xᵀ[K, rows]: op(M)ᵀ is BLAS's packed "A".
// One row needs no packing: multiply() runs the matrix-vector loops above on M itself; nor does
// a single product (`pack` false: a one-step call), which calls sgemm on M as it is (packing
// reads and writes all of M, so one product with it took 2-3x torch.nn's time at B = 2..16).
template <>
PackedRight<float>::PackedRight(const float* M, int64_t ldm, bool trans, int64_t rows, int64_t N, int64_t K,
                                const Tensor& like, bool pack)
    : rows_(rows), N_(N), K_(K), ldm_(ldm), matrix_(M), trans_(trans) {
  pack_float(like, pack);
}


// int8: qgemm's packed panels (faster at every batch size, one row included), unless M is used
// for only one product of a few rows (`pack` false: a one-step call, the step API), where packing
// would cost more than it saves and qgemm_unpacked multiplies M as it is.
template <>
PackedRight<float>::PackedRight(const QuantizedRows& M, int64_t rows, int64_t N, int64_t K, const Tensor& like,
                                bool pack)
    : rows_(rows), N_(N), K_(K), ldm_(M.ld), quantized_scale_(M.scale), quantized_(M) {
  if (!pack || rows == 0) return;
  storage_ = cached_empty({qgemm_packed_bytes(N, K)}, like);
  qgemm_pack(M, N, K, storage_.data_ptr<int8_t>());
}

// bfloat16 / float16: a few rows once, or one row of a float16 M (every step of a batch of one
// streams M from cache or memory, so half the bytes is the gain), are read as they are. Otherwise
// a bfloat16 M is packed for the CPU's bfloat16 dot products where it has them (bgemm.h: X is
// then rounded to bfloat16 as the GEMM's operand), one row included when M multiplies more than
// once (a batch of one over T steps: R as 2 k x 16 columns per vdpbf16ps, with no widening and
// no horizontal sums: 0.80 -> 0.41 of torch.nn float32's time for a stream LSTM on Zen 4), and any
// other M widened to float32 once and taken as a float M (packed when it multiplies more than
// once), so the GEMM of a batch runs at float32's speed and the pass pays one read of M for the
// widening.
template <>
PackedRight<float>::PackedRight(const HalfRows& M, int64_t rows, int64_t N, int64_t K, const Tensor& like, bool pack,
                                bool transposed)
    : rows_(rows), N_(N), K_(K), ldm_(transposed ? N : K), trans_(!transposed) {
  if (rows == 0) return;
  const bool products = M.bf16 && bf16_products();
  if (!transposed && ((rows == 1 && !(products && pack)) || (!pack && rows <= kSmallBatch))) {
    half_ = M;
    return;
  }
  if (products) {  // the CPU's bfloat16 products (bgemm.h)
    storage_ = cached_empty({bf16_packed_bytes(N, K) / int64_t(sizeof(float))}, like);
    bf16_packed_ = reinterpret_cast<const uint16_t*>(storage_.data_ptr<float>());
    (transposed ? bf16_pack_transposed : bf16_pack)(M, N, K, const_cast<uint16_t*>(bf16_packed_));
    return;
  }
  widened_ = cached_empty({N * K}, like);
  if (transposed) {
    widen_rows(M, K, N, widened_.data_ptr<float>());  // M [K, N]
  } else {
    widen_rows(M, N, K, widened_.data_ptr<float>());
  }
  matrix_ = widened_.data_ptr<float>();
  pack_float(like, pack);
  if (storage_.defined()) widened_ = Tensor(), matrix_ = nullptr;  // the packed copy is what multiplies
}

template <>
void PackedRight<float>::multiply(const Bf16RoundedX& X, float beta, float* C, int64_t ldc) const {
  TORCH_CHECK(bf16_packed_ != nullptr && X.rows == rows_ && X.K == K_, "rnnkit fused: a rounded [", X.rows, ", ", X.K,
              "] operand for a product of [", rows_, ", ", K_, "] that ", bf16_packed_ ? "takes" : "does not take",
              " rounded operands");
  bf16_gemm_rounded(X, bf16_packed_, N_, beta, C, ldc);
}

template <>
void PackedRight<float>::multiply(const float* X, int64_t ldx, float beta, float* C, int64_t ldc) const {
  if (rows_ == 0) return;
  if (quantized_scale_ != nullptr && !storage_.defined()) {  // unpacked: M read once per four rows
    qgemm_unpacked(X, rows_, ldx, quantized_, N_, K_, beta, C, ldc);
    return;
  }
  if (bf16_packed_ != nullptr) {  // bfloat16 M packed for the CPU's bfloat16 products; X rounded to bfloat16
    bf16_gemm_packed(X, rows_, ldx, bf16_packed_, N_, K_, beta, C, ldc);
    return;
  }
  if (f32_packed_ != nullptr) {  // float32 M in the own kernels' panels
    f32_gemm_packed(X, rows_, ldx, f32_packed_, N_, K_, beta, C, ldc);
    return;
  }
  if (half_.data != nullptr) {  // bfloat16 / float16 M as it is: one row, or a few rows once
    gemv_small_batch(half_, N_, K_, X, ldx, rows_, beta, C, ldc);
    return;
  }
  if (quantized_scale_ != nullptr) {
    qgemm_nt_packed(X, rows_, ldx, storage_.data_ptr<int8_t>(), quantized_scale_, N_, K_, beta, C, ldc);
    return;
  }
  if (rows_ == 1) {
    // op(M) = Mᵀ: M is [N, K] and C[n] = M[n, :]·x; otherwise M is [K, N] and C = Σ_k x[k]·M[k, :].
    // Each call reads M the other way: M beyond L2 (float32 R of H = 256 is 1 MB) then finds in L2
    // the part the last call read last, where reading in one order would evict every line before
    // its reuse.
    backwards_ = !backwards_;
    (trans_ ? gemv_rows : gemv_columns)(matrix_, ldm_, N_, K_, X, beta, C, backwards_);
    return;
  }
  const int m = int(N_), n = int(rows_), k = int(K_), lda = int(ldm_), ldb = int(ldx), lc = int(ldc);
  const char tb = 'N';
  if (!storage_.defined() && trans_ && rows_ <= kSmallBatch) {  // one product of a few rows: M read once
    gemv_small_batch(matrix_, ldm_, N_, K_, X, ldx, rows_, beta, C, ldc);
    return;
  }
  if (!storage_.defined()) {  // not packed: one product
    const char ta = trans_ ? 'T' : 'N';
    const float one = 1;
    sgemm_(&ta, &tb, &m, &n, &k, &one, matrix_, &lda, X, &ldb, &beta, C, &lc);
    return;
  }
  const char ta = 'P';
  sgemm_compute_(&ta, &tb, &m, &n, &k, storage_.data_ptr<float>(), &lda, X, &ldb, &beta, C, &lc);
}

// float64 (gradcheck, not speed): torch's MKL exports no packed dgemm, so keep M and call dgemm.
template <>
PackedRight<double>::PackedRight(const double* M, int64_t ldm, bool trans, int64_t rows, int64_t N, int64_t K,
                                 const Tensor& like, bool)
    : rows_(rows), N_(N), K_(K), ldm_(ldm), matrix_(M), trans_(trans) {}

template <>
PackedRight<double>::PackedRight(const QuantizedRows&, int64_t, int64_t, int64_t, const Tensor&, bool) {
  TORCH_CHECK(false, "rnnkit fused: int8 weights compute in float32, not float64");
}

template <>
PackedRight<double>::PackedRight(const HalfRows&, int64_t, int64_t, int64_t, const Tensor&, bool, bool) {
  TORCH_CHECK(false, "rnnkit fused: bfloat16 / float16 weights compute in float32, not float64");
}

template <>
void PackedRight<double>::multiply(const Bf16RoundedX&, float, float*, int64_t) const {
  TORCH_CHECK(false, "rnnkit fused: float64 products take no bfloat16 operands");
}

template <>
void PackedRight<double>::multiply(const double* X, int64_t ldx, double beta, double* C, int64_t ldc) const {
  if (rows_ == 0) return;
  const char ta = trans_ ? 'T' : 'N', tb = 'N';
  const int m = int(N_), n = int(rows_), k = int(K_), la = int(ldm_), lb = int(ldx), lc = int(ldc);
  const double one = 1;
  dgemm_(&ta, &tb, &m, &n, &k, &one, matrix_, &la, X, &lb, &beta, C, &lc);
}

}  // namespace rnnkit
