// int8 GEMMs of quantized inference (qgemm.h): M packed into panels of 8 rows × 4 k per vector,
// so AVX2 byte products accumulate 8 outputs per int32 vector with no horizontal sums.
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

namespace {

constexpr int64_t kPanel = 8;  // rows of M per panel: one int32 vector of outputs

inline int64_t groups_of(int64_t K) { return (K + 3) / 4; }

}  // namespace

int64_t qgemm_packed_bytes(int64_t N, int64_t K) {
  return (N + kPanel - 1) / kPanel * groups_of(K) * 4 * kPanel;
}

// dest[p][g][j][b] = M[8p + j, 4g + b], zero outside [N, K].
void qgemm_pack(const QuantizedRows& M, int64_t N, int64_t K, int8_t* dest) {
  const int64_t groups = groups_of(K), panels = (N + kPanel - 1) / kPanel, full = K / 4;
  at::parallel_for(0, panels, std::max<int64_t>(1, (int64_t(1) << 16) / (kPanel * std::max<int64_t>(K, 1))),
                   [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int8_t* panel = dest + p * groups * 4 * kPanel;
      std::memset(panel, 0, groups * 4 * kPanel);
      for (int64_t j = 0; j < kPanel && kPanel * p + j < N; ++j) {
        const int8_t* m = M.data + (kPanel * p + j) * M.ld;
        for (int64_t g = 0; g < full; ++g) std::memcpy(panel + g * 4 * kPanel + 4 * j, m + 4 * g, 4);
        for (int64_t k = 4 * full; k < K; ++k) panel[full * 4 * kPanel + 4 * j + k - 4 * full] = m[k];
      }
    }
  });
}

// Packed into a thread-local buffer per call: for callers that multiply by M once.
void qgemm_nt(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K, float beta,
              float* C, int64_t ldc) {
  thread_local std::vector<int8_t> packed;
  packed.resize(qgemm_packed_bytes(N, K));
  qgemm_pack(M, N, K, packed.data());
  qgemm_nt_packed(X, rows, ldx, packed.data(), M.scale, N, K, beta, C, ldc);
}

#if defined(__AVX2__)

namespace {

constexpr int64_t kGrain = 1 << 16;      // multiply-adds per thread, at least
constexpr int64_t kTileBytes = 1 << 18;  // bytes of packed M per N tile: stays in L2 while every X row passes over it

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

// Quantized X for the packed kernels, one row per `ld` bytes: qx (K zero-padded to 32), then |qx|.
struct RowsX {
  const int8_t* q;
  const float* sx;
  int64_t ld, abs_off;
};

// Each row of X into qx and |qx|, row-major, K zero-padded to 32 (the packed M's padding is zero).
void quantize_rows(const float* X, int64_t rows, int64_t ldx, int64_t K, Scratch& s, RowsX& out) {
  const int64_t full = K / 32, padded = 32 * ((K + 31) / 32), ld = 2 * padded;
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
    int8_t* a = q + padded;
    for (int64_t c = 0; c < full; ++c) {
      const __m256i v = quantize32(x + 32 * c, vinv);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * c), v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32 * c), _mm256_abs_epi8(v));
    }
    if (padded > 32 * full) {
      alignas(32) int8_t tail[32] = {};
      for (int64_t j = 0; j < K - 32 * full; ++j) tail[j] = int8_t(std::nearbyint(x[32 * full + j] * inv));
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * full), v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32 * full), _mm256_abs_epi8(v));
    }
  }
  out = {base, s.scales.data(), ld, padded};
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// C[XR rows, NR panels of 8 columns (the last cut at `width`)]: per 4 k, x's 4 bytes broadcast
// against each panel's [8][4] bytes, so each int32 lane sums one output (no horizontal sums).
template <int NR, int XR>
void packed_kernel(const RowsX& qx, int64_t r0, const int8_t* w, int64_t panel_bytes, int64_t groups,
                   const float* scale, int64_t width, float beta, float* C, int64_t ldc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[XR][NR];
  for (int r = 0; r < XR; ++r)
    for (int i = 0; i < NR; ++i) acc[r][i] = _mm256_setzero_si256();
  const int8_t* xq = qx.q + r0 * qx.ld;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[NR];
    for (int i = 0; i < NR; ++i)
      wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * panel_bytes + 32 * g));
    for (int r = 0; r < XR; ++r) {
      const __m256i xs = broadcast4(xq + r * qx.ld + 4 * g);
      const __m256i xa = broadcast4(xq + r * qx.ld + qx.abs_off + 4 * g);
      for (int i = 0; i < NR; ++i) {
        const __m256i prod = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[i], xs));
        acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(prod, ones));
      }
    }
  }
  for (int r = 0; r < XR; ++r) {
    const float sx = qx.sx[r0 + r];
    float* c = C + (r0 + r) * ldc;
    for (int i = 0; i < NR; ++i) {
      const int64_t n = kPanel * i;
      if (n + kPanel <= width) {
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(sx), _mm256_loadu_ps(scale + n)),
                                 _mm256_cvtepi32_ps(acc[r][i]));
        if (beta != 0) {
          asm("" : "+x"(v));  // v rounded before the add: no fused multiply-add
          v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(c + n)));
        }
        _mm256_storeu_ps(c + n, v);
      } else {
        alignas(32) int32_t sums[kPanel];
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc[r][i]);
        for (int64_t j = 0; n + j < width; ++j) {
          float v = sx * scale[n + j] * float(sums[j]);
          asm("" : "+x"(v));
          c[n + j] = beta == 0 ? v : v + beta * c[n + j];
        }
      }
    }
  }
}

constexpr int kNR = 3, kXR = 4;  // a block: 3 panels (24 columns) times 4 rows of X, 12 accumulators

template <int NR>
inline void packed_rows(int xr, const RowsX& qx, int64_t r0, const int8_t* w, int64_t panel_bytes, int64_t groups,
                        const float* scale, int64_t width, float beta, float* C, int64_t ldc) {
  switch (xr) {
    case 1: return packed_kernel<NR, 1>(qx, r0, w, panel_bytes, groups, scale, width, beta, C, ldc);
    case 2: return packed_kernel<NR, 2>(qx, r0, w, panel_bytes, groups, scale, width, beta, C, ldc);
    case 3: return packed_kernel<NR, 3>(qx, r0, w, panel_bytes, groups, scale, width, beta, C, ldc);
    case 4: return packed_kernel<NR, 4>(qx, r0, w, panel_bytes, groups, scale, width, beta, C, ldc);
    default: return;
  }
}

// Columns [0, width) of rows [r0, r0 + xr) from panels w, w + panel_bytes, ...: np ≤ kNR panels.
inline void packed_block(int np, int xr, const RowsX& qx, int64_t r0, const int8_t* w, int64_t panel_bytes,
                         int64_t groups, const float* scale, int64_t width, float beta, float* C, int64_t ldc) {
  switch (np) {
    case 1: return packed_rows<1>(xr, qx, r0, w, panel_bytes, groups, scale, width, beta, C, ldc);
    case 2: return packed_rows<2>(xr, qx, r0, w, panel_bytes, groups, scale, width, beta, C, ldc);
    case 3: return packed_rows<3>(xr, qx, r0, w, panel_bytes, groups, scale, width, beta, C, ldc);
    default: return;
  }
}

}  // namespace

// Four rows of M at a time against the one quantized row: sign trick per 32 bytes, then one
// horizontal sum per output; M's last partial 32 bytes go through a zeroed copy (never read past K).
void qgemv_rows(const float* x, const QuantizedRows& M, int64_t N, int64_t K, float beta, float* C) {
  if (N <= 0) return;
  if (K <= 0) return qgemm_nt_packed(x, 1, K, nullptr, M.scale, N, K, beta, C, N);
  thread_local Scratch scratch;
  RowsX qx;
  quantize_rows(x, 1, K, K, scratch, qx);
  const int64_t chunks = (K + 31) / 32, full = K / 32, tail = K - 32 * full;
  const float sx = qx.sx[0];
  const __m256i ones = _mm256_set1_epi16(1);
  // Σ_k q[k]·m_j[k] for the R ≤ 4 rows m_j = m + j·ld, into out[j].
  const auto row_sums = [&](const int8_t* m, int R, int32_t* out) {
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(qx.q + 32 * c));
      const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(qx.q + qx.abs_off + 32 * c));
      for (int j = 0; j < R; ++j) {
        const int8_t* row = m + j * M.ld + 32 * c;
        __m256i w;
        if (c < full) {
          w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        } else {
          alignas(32) int8_t part[32] = {};
          std::memcpy(part, row, tail);
          w = _mm256_load_si256(reinterpret_cast<const __m256i*>(part));
        }
        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(w, q)), ones));
      }
    }
    for (int j = 0; j < R; ++j) {
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc[j]), _mm256_extracti128_si256(acc[j], 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
      out[j] = _mm_cvtsi128_si32(t);
    }
  };
  at::parallel_for(0, (N + 3) / 4, std::max<int64_t>(1, kGrain / (4 * K)), [&](int64_t begin, int64_t end) {
    for (int64_t n = 4 * begin; n < std::min(N, 4 * end); n += 4) {
      const int R = int(std::min<int64_t>(4, N - n));
      int32_t sums[4];
      row_sums(M.data + n * M.ld, R, sums);
      for (int j = 0; j < R; ++j) {
        float v = sx * M.scale[n + j] * float(sums[j]);
        asm("" : "+x"(v));  // v rounded before the add: no fused multiply-add
        C[n + j] = beta == 0 ? v : v + beta * C[n + j];
      }
    }
  });
}

void qgemm_nt_packed(const float* X, int64_t rows, int64_t ldx, const int8_t* packed, const float* scale, int64_t N,
                     int64_t K, float beta, float* C, int64_t ldc) {
  if (rows <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < N; ++n) {
        const float v = 0.0f * scale[n] * 0.0f;
        C[r * ldc + n] = beta == 0 ? v : v + beta * C[r * ldc + n];
      }
    return;
  }
  thread_local Scratch scratch;
  RowsX qx;
  quantize_rows(X, rows, ldx, K, scratch, qx);
  const int64_t groups = groups_of(K), panel_bytes = groups * 4 * kPanel;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t tile = std::max<int64_t>(kNR, kTileBytes / panel_bytes);  // panels per N tile (L2)
  const int64_t grain = std::max<int64_t>(1, kGrain / (kPanel * K * rows));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += tile) {
      const int64_t t1 = std::min(end, t0 + tile);
      for (int64_t r0 = 0; r0 < rows; r0 += kXR) {
        const int xr = int(std::min<int64_t>(kXR, rows - r0));
        for (int64_t p = t0; p < t1; p += kNR) {
          const int np = int(std::min<int64_t>(kNR, t1 - p));
          const int64_t n = kPanel * p;
          packed_block(np, xr, qx, r0, packed + p * panel_bytes, panel_bytes, groups, scale + n,
                       std::min(kPanel * np, N - n), beta, C + n, ldc);
        }
      }
    }
  });
}

#else  // no AVX2: plain loops

void qgemm_nt_packed(const float* X, int64_t rows, int64_t ldx, const int8_t* packed, const float* scale, int64_t N,
                     int64_t K, float beta, float* C, int64_t ldc) {
  const int64_t groups = groups_of(K);
  std::vector<int8_t> q(std::max<int64_t>(4 * groups, 0));
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * ldx;
    float amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f, sx = amax / 127.0f;
    for (int64_t k = 0; k < K; ++k) q[k] = int8_t(std::nearbyint(x[k] * inv));
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* m = packed + (n / kPanel) * groups * 4 * kPanel + 4 * (n % kPanel);
      int32_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += int32_t(q[k]) * int32_t(m[(k / 4) * 4 * kPanel + k % 4]);
      const float v = sx * scale[n] * float(acc);
      float* c = C + r * ldc + n;
      *c = beta == 0 ? v : v + beta * *c;
    }
  }
}

void qgemv_rows(const float* x, const QuantizedRows& M, int64_t N, int64_t K, float beta, float* C) {
  std::vector<int8_t> q(std::max<int64_t>(K, 0));
  float amax = 0;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
  const float inv = amax > 0 ? 127.0f / amax : 0.0f, sx = amax / 127.0f;
  for (int64_t k = 0; k < K; ++k) q[k] = int8_t(std::nearbyint(x[k] * inv));
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* m = M.data + n * M.ld;
    int32_t acc = 0;
    for (int64_t k = 0; k < K; ++k) acc += int32_t(q[k]) * int32_t(m[k]);
    const float v = sx * M.scale[n] * float(acc);
    C[n] = beta == 0 ? v : v + beta * C[n];
  }
}

#endif

}  // namespace rnnkit
