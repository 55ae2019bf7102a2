// int8 GEMMs of quantized inference (qgemm.h): AVX2 byte products read straight off row-major M.
#include "qgemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rnnkit {

#if defined(__AVX2__)

namespace {

constexpr int64_t kGrain = 1 << 16;    // multiply-adds per thread, at least
constexpr int64_t kTileBytes = 1 << 18;  // bytes of M per N tile: stays in L2 while every X row passes over it

// Quantized X, one row per `ld` bytes: qx in 32-byte chunks (the K tail last, see `quantize`),
// then |qx| in the same layout; sx[r] the row's scale.
struct QuantizedX {
  const int8_t* q;
  const float* sx;
  int64_t ld, chunks, full;  // full: chunks without the tail
};

struct Scratch {
  std::vector<int8_t> bytes;
  std::vector<float> scales;
};

// 32 floats times inv, rounded to nearest even, as 32 int8 in memory order.
inline __m256i quantize32(const float* x, __m256 inv) {
  const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));
  const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), inv));
  const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), inv));
  const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), inv));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Each row of X into chunks of qx and |qx|. The K tail (K % 32 values) is one more chunk aligned to
// end at K: its lanes before the tail are zero, so M is read there as the 32 bytes ending at K.
void quantize(const float* X, int64_t rows, int64_t ldx, int64_t K, Scratch& s, QuantizedX& out) {
  const int64_t full = K / 32, chunks = full + (K % 32 != 0), ld = 64 * chunks;
  s.bytes.resize(rows * ld + 32);
  s.scales.resize(rows);
  int8_t* base = s.bytes.data() + ((32 - reinterpret_cast<uintptr_t>(s.bytes.data()) % 32) % 32);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * ldx;
    __m256 vmax = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    for (; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    s.scales[r] = amax / 127.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    int8_t* q = base + r * ld;
    int8_t* a = q + 32 * chunks;
    for (int64_t c = 0; c < full; ++c) {
      const __m256i v = quantize32(x + 32 * c, vinv);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * c), v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32 * c), _mm256_abs_epi8(v));
    }
    if (chunks > full) {
      alignas(32) int8_t tail[32] = {};
      const int64_t rem = K - 32 * full;
      for (int64_t j = 0; j < rem; ++j) tail[32 - rem + j] = int8_t(std::nearbyint(x[32 * full + j] * inv));
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * full), v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32 * full), _mm256_abs_epi8(v));
    }
  }
  out = {base, s.scales.data(), ld, chunks, full};
}

// 8 int32 lanes each of a[0..3] summed: one int32 per a[i].
inline __m128i hsum4(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// One 32-byte chunk: acc[r][i] += Σ x[r]·w[i] over it, each M vector loaded once for all XR rows.
template <int MR, int XR>
__attribute__((always_inline)) inline void step(__m256i (&acc)[XR][MR], const int8_t* w, int64_t ldw, const int8_t* x,
                                                int64_t ldx, int64_t abs_off) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i wv[MR];
  for (int i = 0; i < MR; ++i) wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * ldw));
  for (int r = 0; r < XR; ++r) {
    const __m256i xs = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + r * ldx));
    const __m256i xa = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + r * ldx + abs_off));
    for (int i = 0; i < MR; ++i) {
      const __m256i prod = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[i], xs));
      acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(prod, ones));
    }
  }
}

// C[XR rows, MR cols] from XR quantized X rows and MR rows of M (row i at w + i·ldw, its tail
// chunk at tw + i·ldt).
template <int MR, int XR>
void kernel(const QuantizedX& qx, int64_t r0, const int8_t* w, int64_t ldw, const int8_t* tw, int64_t ldt,
            const float* scale, float beta, float* C, int64_t ldc) {
  __m256i acc[XR][MR];
  for (int r = 0; r < XR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_setzero_si256();
  const int8_t* xq = qx.q + r0 * qx.ld;
  const int64_t abs_off = 32 * qx.chunks;
  for (int64_t c = 0; c < qx.full; ++c) step<MR, XR>(acc, w + 32 * c, ldw, xq + 32 * c, qx.ld, abs_off);
  if (qx.chunks > qx.full) step<MR, XR>(acc, tw, ldt, xq + 32 * qx.full, qx.ld, abs_off);
  for (int r = 0; r < XR; ++r) {
    const float sx = qx.sx[r0 + r];
    float* c = C + (r0 + r) * ldc;
    for (int i0 = 0; i0 < MR; i0 += 4) {
      if (i0 + 4 <= MR) {
        const __m128i sums = hsum4(acc[r][i0], acc[r][i0 + 1], acc[r][i0 + 2], acc[r][i0 + 3]);
        __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(sx), _mm_loadu_ps(scale + i0)), _mm_cvtepi32_ps(sums));
        if (beta != 0) {
          asm("" : "+x"(v));  // v rounded before the add: no fused multiply-add
          v = _mm_add_ps(v, _mm_mul_ps(_mm_set1_ps(beta), _mm_loadu_ps(c + i0)));
        }
        _mm_storeu_ps(c + i0, v);
      } else {
        for (int i = i0; i < MR; ++i) {
          const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[r][i]), _mm256_extracti128_si256(acc[r][i], 1));
          const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
          const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xb1)));
          float v = sx * scale[i] * float(sum);
          asm("" : "+x"(v));
          c[i] = beta == 0 ? v : v + beta * c[i];
        }
      }
    }
  }
}

constexpr int kMR = 4, kXR = 3;  // a block: 4 rows of M times 3 rows of X, 12 accumulators

template <int MR>
inline void kernel_rows(int xr, const QuantizedX& qx, int64_t r0, const int8_t* w, int64_t ldw, const int8_t* tw,
                        int64_t ldt, const float* scale, float beta, float* C, int64_t ldc) {
  switch (xr) {
    case 1: return kernel<MR, 1>(qx, r0, w, ldw, tw, ldt, scale, beta, C, ldc);
    case 2: return kernel<MR, 2>(qx, r0, w, ldw, tw, ldt, scale, beta, C, ldc);
    case 3: return kernel<MR, 3>(qx, r0, w, ldw, tw, ldt, scale, beta, C, ldc);
    default: return;
  }
}

// Columns [n, n + mr) of rows [r0, r0 + xr), mr ≤ kMR, xr ≤ kXR.
inline void block(int mr, int xr, const QuantizedX& qx, int64_t r0, const int8_t* w, int64_t ldw, const int8_t* tw,
                  int64_t ldt, const float* scale, float beta, float* C, int64_t ldc) {
  switch (mr) {
    case 1: return kernel_rows<1>(xr, qx, r0, w, ldw, tw, ldt, scale, beta, C, ldc);
    case 2: return kernel_rows<2>(xr, qx, r0, w, ldw, tw, ldt, scale, beta, C, ldc);
    case 3: return kernel_rows<3>(xr, qx, r0, w, ldw, tw, ldt, scale, beta, C, ldc);
    case 4: return kernel_rows<4>(xr, qx, r0, w, ldw, tw, ldt, scale, beta, C, ldc);
    default: return;
  }
}

}  // namespace

void qgemm_nt(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K, float beta,
              float* C, int64_t ldc) {
  if (rows <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < N; ++n) {
        const float v = 0.0f * M.scale[n] * 0.0f;
        C[r * ldc + n] = beta == 0 ? v : v + beta * C[r * ldc + n];
      }
    return;
  }
  thread_local Scratch scratch;
  QuantizedX qx;
  quantize(X, rows, ldx, K, scratch, qx);
  const int64_t blocks = (N + kMR - 1) / kMR;
  const int64_t tile = std::max<int64_t>(1, kTileBytes / (kMR * K));  // blocks of M per N tile
  const int64_t grain = std::max<int64_t>(1, kGrain / (kMR * K * rows));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    alignas(32) int8_t small[kMR * 32];  // K < 32: rows of M copied right-aligned into 32 bytes
    for (int64_t t0 = begin; t0 < end; t0 += tile) {
      const int64_t t1 = std::min(end, t0 + tile);
      for (int64_t r0 = 0; r0 < rows; r0 += kXR) {
        const int xr = int(std::min<int64_t>(kXR, rows - r0));
        for (int64_t b = t0; b < t1; ++b) {
          const int64_t n = b * kMR;
          const int mr = int(std::min<int64_t>(kMR, N - n));
          const int8_t* w = M.data + n * M.ld;
          const int8_t* tw = small;
          int64_t ldt = 32;
          if (K >= 32) {
            tw = w + K - 32;
            ldt = M.ld;
          } else {
            std::memset(small, 0, sizeof(small));
            for (int i = 0; i < mr; ++i) std::memcpy(small + 32 * i + 32 - K, w + i * M.ld, K);
          }
          block(mr, xr, qx, r0, w, M.ld, tw, ldt, M.scale + n, beta, C + n, ldc);
        }
      }
    }
  });
}

#else  // no AVX2: plain loops

void qgemm_nt(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K, float beta,
              float* C, int64_t ldc) {
  std::vector<int8_t> q(std::max<int64_t>(K, 0));
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * ldx;
    float amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f, sx = amax / 127.0f;
    for (int64_t k = 0; k < K; ++k) q[k] = int8_t(std::nearbyint(x[k] * inv));
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* m = M.data + n * M.ld;
      int32_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += int32_t(q[k]) * int32_t(m[k]);
      const float v = sx * M.scale[n] * float(acc);
      float* c = C + r * ldc + n;
      *c = beta == 0 ? v : v + beta * *c;
    }
  }
}

#endif

}  // namespace rnnkit
