// int8 GEMMs of quantized inference (qgemm.h): M packed into panels of 8 rows × 4 k per vector,
// so byte products accumulate 8 outputs per int32 vector with no horizontal sums. One kernel
// source (qgemm_kernels.h) is compiled per instruction set: AVX2 (vpmaddubsw on |x| and
// sign(w, x)), AVX512-VNNI and AVX-VNNI (vpdpbusd on x + 128, less 128·Σw), and plain loops
// without AVX2; the CPU picks one at run time. All sum the same products exactly in int32, so
// every kernel gives the same results bit for bit.
#include "qgemm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel_choice.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rnnkit {

namespace {

constexpr int64_t kPanel = 8;  // rows of M per panel: one int32 vector of outputs

inline int64_t groups_of(int64_t K) { return (K + 3) / 4; }
inline int64_t panels_of(int64_t N) { return (N + kPanel - 1) / kPanel; }

// After the panels: Σ_k M[n, k] for each n of the padded N, as int32 (the VNNI kernels' correction).
inline const int32_t* packed_sums(const int8_t* packed, int64_t N, int64_t K) {
  return reinterpret_cast<const int32_t*>(packed + panels_of(N) * groups_of(K) * 4 * kPanel);
}

struct Int8Kernels {
  const char* name;
  void (*unpacked)(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K,
                   float beta, float* C, int64_t ldc);
  void (*packed)(const float* X, int64_t rows, int64_t ldx, const int8_t* packed, const float* scale, int64_t N,
                 int64_t K, float beta, float* C, int64_t ldc);
  bool (*runs_here)();
  bool automatic;  // chosen by "auto" when it runs here (the first such in kKernels' order)
};

}  // namespace

int64_t qgemm_packed_bytes(int64_t N, int64_t K) {
  return panels_of(N) * (groups_of(K) * 4 * kPanel + kPanel * int64_t(sizeof(int32_t)));
}

#if defined(__AVX2__)
namespace {

// Groups [0, 8·blocks) of a panel: its (up to 8) rows' 32-byte runs (8 groups of 4 k each) as an
// 8 × 8 matrix of 32-bit words, transposed in registers (rows past `width` read as zeros); each
// row's sum over those groups into sums[j] (the loaded bytes summed in registers: a second,
// scalar pass over the rows took 40% of the packing's time).
template <bool kFull>
void pack_groups_transposed(const int8_t* const rows[kPanel], int64_t width, int64_t blocks, int8_t* panel,
                            int32_t sums[kPanel]) {
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  __m256i acc[kPanel];
  for (int j = 0; j < kPanel; ++j) acc[j] = _mm256_setzero_si256();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i r[kPanel];
    for (int j = 0; j < kPanel; ++j) {
      r[j] = kFull || j < width ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + 32 * b))
                                : _mm256_setzero_si256();
      // 1·w in pairs (int16, |sum| ≤ 256), then pairs of those (int32): exact
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, r[j]), ones16));
    }
    __m256i t[kPanel], u[kPanel];
    for (int j = 0; j < kPanel; j += 2)
      t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]), t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
    for (int j = 0; j < kPanel; j += 4) {
      u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]), u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
      u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]), u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    __m256i* out = reinterpret_cast<__m256i*>(panel + 8 * b * 4 * kPanel);  // group 8b + i at out[i]
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_si256(out + i, _mm256_permute2x128_si256(u[i], u[i + 4], 0x20));
      _mm256_storeu_si256(out + i + 4, _mm256_permute2x128_si256(u[i], u[i + 4], 0x31));
    }
  }
  for (int j = 0; j < kPanel; ++j) {
    __m128i v = _mm_add_epi32(_mm256_castsi256_si128(acc[j]), _mm256_extracti128_si256(acc[j], 1));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
    sums[j] = _mm_cvtsi128_si32(v);
  }
}

}  // namespace
#endif

// dest[p][g][j][b] = M[8p + j, 4g + b], zero outside [N, K]; then the row sums.
void qgemm_pack(const QuantizedRows& M, int64_t N, int64_t K, int8_t* dest) {
  const int64_t groups = groups_of(K), panels = panels_of(N), full = K / 4;
  int8_t* sums = dest + panels * groups * 4 * kPanel;
  at::parallel_for(0, panels, std::max<int64_t>(1, (int64_t(1) << 16) / (kPanel * std::max<int64_t>(K, 1))),
                   [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int8_t* panel = dest + p * groups * 4 * kPanel;
      int64_t first = 0;  // the first group the copies below take
      int32_t row_sums[kPanel] = {};  // over groups [0, first)
#if defined(__AVX2__)
      // 8 groups of 8 rows at a time, an 8 × 8 transpose of 32-bit words (the 4-byte copies
      // below took 5.6% of an int8 stream LSTM's time on Zen 4, repacking R every call); it
      // writes every byte of its groups, zeros for rows past N
      const int8_t* rows[kPanel];
      const int64_t width = std::min(kPanel, N - kPanel * p);
      for (int64_t j = 0; j < kPanel; ++j) rows[j] = M.data + (kPanel * p + std::min(j, width - 1)) * M.ld;
      if (width == kPanel) {
        pack_groups_transposed<true>(rows, width, full / 8, panel, row_sums);
      } else {
        pack_groups_transposed<false>(rows, width, full / 8, panel, row_sums);
      }
      first = full / 8 * 8;
#endif
      std::memset(panel + first * 4 * kPanel, 0, (groups - first) * 4 * kPanel);
      for (int64_t j = 0; j < kPanel; ++j) {
        int32_t sum = row_sums[j];
        if (kPanel * p + j < N) {
          const int8_t* m = M.data + (kPanel * p + j) * M.ld;
          for (int64_t g = first; g < full; ++g) std::memcpy(panel + g * 4 * kPanel + 4 * j, m + 4 * g, 4);
          for (int64_t k = 4 * full; k < K; ++k) panel[full * 4 * kPanel + 4 * j + k - 4 * full] = m[k];
          for (int64_t k = 4 * first; k < K; ++k) sum += m[k];
        }
        std::memcpy(sums + (kPanel * p + j) * int64_t(sizeof(int32_t)), &sum, sizeof(sum));
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
constexpr int kNR = 3, kXR = 4;          // a block: 3 panels (24 columns) times 4 rows of X, 12 accumulators
                                         // (4 × 4, 3 × 6, 4 × 6 measured within 2% of it on Zen 4)
constexpr int kOneRowPanels = 8;         // a block of one row of X: 8 panels, 8 accumulators

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

// Quantized X for the kernels, one row per `ld` bytes: qx (K zero-padded to 32), then its
// companion bytes at abs_off: |qx|, or qx + 128 as unsigned bytes (`offset`).
struct RowsX {
  const int8_t* q;
  const float* sx;
  int64_t ld, abs_off;
};

template <bool offset>
inline __m256i companion(__m256i q) {
  return offset ? _mm256_xor_si256(q, _mm256_set1_epi8(int8_t(0x80))) : _mm256_abs_epi8(q);
}

// Each row of X into qx and its companion, row-major, K zero-padded to 32 (the packed M's padding
// is zero, so the padding's products are zero whatever the companion byte). A row with a NaN or an
// infinity has no int8 form: its scale is NaN and its bytes zero, so every product it enters is NaN
// (as the float32 product would be NaN, or ±inf where the float module may saturate it; never a
// finite value the row did not have). Maxima alone would drop a NaN (maxps returns its second
// operand), so the loop also sums x − x, which is NaN exactly where x is not finite.
template <bool offset>
void quantize_rows(const float* X, int64_t rows, int64_t ldx, int64_t K, Scratch& s, RowsX& out) {
  const int64_t full = K / 32, padded = 32 * ((K + 31) / 32), ld = 2 * padded;
  s.bytes.resize(rows * ld + 32);
  s.scales.resize(rows);
  int8_t* base = s.bytes.data() + ((32 - reinterpret_cast<uintptr_t>(s.bytes.data()) % 32) % 32);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * ldx;
    __m256 vmax = _mm256_setzero_ps(), vnonfinite = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_loadu_ps(x + k);
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, abs_mask));
      vnonfinite = _mm256_add_ps(vnonfinite, _mm256_sub_ps(v, v));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    bool finite = _mm256_movemask_ps(_mm256_cmp_ps(vnonfinite, vnonfinite, _CMP_UNORD_Q)) == 0;
    for (; k < K; ++k) amax = std::max(amax, std::abs(x[k])), finite = finite && std::isfinite(x[k]);
    int8_t* q = base + r * ld;
    int8_t* a = q + padded;
    if (!finite) {
      s.scales[r] = std::numeric_limits<float>::quiet_NaN();
      const __m256i zero = _mm256_setzero_si256();
      for (int64_t c = 0; c < padded / 32; ++c) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * c), zero);
        _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32 * c), companion<offset>(zero));
      }
      continue;
    }
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    s.scales[r] = amax / 127.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t c = 0; c < full; ++c) {
      const __m256i v = quantize32(x + 32 * c, vinv);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * c), v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32 * c), companion<offset>(v));
    }
    if (padded > 32 * full) {
      alignas(32) int8_t tail[32] = {};
      for (int64_t j = 0; j < K - 32 * full; ++j) tail[j] = int8_t(std::nearbyint(x[32 * full + j] * inv));
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * full), v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32 * full), companion<offset>(v));
    }
  }
  out = {base, s.scales.data(), ld, padded};
}

// *c = sx · scale · sum (+ beta · *c), rounded before the add (no fused multiply-add): the output
// of every kernel that finishes its sums one at a time, as the vector epilogues compute it.
inline void put_output(float sx, float scale, int32_t sum, float beta, float* c) {
  float v = sx * scale * float(sum);
  asm("" : "+x"(v));
  *c = beta == 0 ? v : v + beta * *c;
}

// c[j] = sx · scale[j] · acc[j] (+ beta · c[j]) for the first `count` of 8 sums (none where count ≤ 0),
// rounded before the add: the epilogue of every kernel that holds a panel's 8 sums in one vector.
inline void put_outputs8(__m256i acc, float sx, const float* scale, int64_t count, float beta, float* c) {
  if (count >= 8) {
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(sx), _mm256_loadu_ps(scale)), _mm256_cvtepi32_ps(acc));
    if (beta != 0) {
      asm("" : "+x"(v));  // v rounded before the add: no fused multiply-add
      v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(c)));
    }
    _mm256_storeu_ps(c, v);
    return;
  }
  alignas(32) int32_t sums[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc);
  for (int64_t j = 0; j < count; ++j) put_output(sx, scale[j], sums[j], beta, c + j);
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// VNNI's vpdpbusd (acc + Σ of 4 unsigned × signed byte products per int32 lane, exact) in AVX2:
// even and odd bytes widened to 16 bits, two vpmaddwd.
inline __m256i emulated_dpbusd(__m256i acc, __m256i u, __m256i s) {
  const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00ff)), u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}

// AVX2: |x| times sign(w, x) with vpmaddubsw (no pair reaches int16's limit: 2·127·127 < 32768),
// pairs summed by vpmaddwd.
namespace avx2 {
constexpr bool kOffset = false;
inline __m256i dot_sign(__m256i acc, __m256i x_abs, __m256i x_q, __m256i w) {
  const __m256i pairs = _mm256_maddubs_epi16(x_abs, _mm256_sign_epi8(w, x_q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline __m256i dot_packed(__m256i acc, __m256i x_aux, __m256i x_q, __m256i w) { return dot_sign(acc, x_aux, x_q, w); }
#include "qgemm_kernels.h"
}  // namespace avx2

// The VNNI kernels' arithmetic with AVX2 instructions: how CPUs without VNNI test it.
namespace emulated_vnni {
constexpr bool kOffset = true;
inline __m256i dot_sign(__m256i acc, __m256i x_abs, __m256i x_q, __m256i w) {
  return emulated_dpbusd(acc, x_abs, _mm256_sign_epi8(w, x_q));
}
inline __m256i dot_packed(__m256i acc, __m256i x_aux, __m256i, __m256i w) { return emulated_dpbusd(acc, x_aux, w); }
#include "qgemm_kernels.h"
}  // namespace emulated_vnni

// The VNNI kernels need GCC 11 or later (#pragma GCC target with "avxvnni"); other compilers
// build the AVX2 and emulated ones only (clang ignores the pragma, GCC 10 lacks avxvnni).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define RNNKIT_VNNI_KERNELS 1

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
namespace avx512_vnni {  // vpdpbusd on 256-bit vectors (AVX512_VNNI + VL): Ice Lake, Sapphire Rapids, Zen 4
constexpr bool kOffset = true;
// acc + Σ of 4 products u8(a) · s8(b) a lane, in inline assembly: with the intrinsic GCC (11-13)
// treats the accumulator as a fresh register and, in the kernels' loops, copied every
// accumulator twice per group (24 register moves for 12 products: 300-335 GOP/s against 385-435
// on Zen 4); the assembly updates it in place.
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
inline __m256i dot_sign(__m256i acc, __m256i x_abs, __m256i x_q, __m256i w) {
  return dpbusd(acc, x_abs, _mm256_sign_epi8(w, x_q));
}
inline __m256i dot_packed(__m256i acc, __m256i x_aux, __m256i, __m256i w) { return dpbusd(acc, x_aux, w); }
#include "qgemm_kernels.h"

inline __m512i dpbusd512(__m512i acc, __m512i a, __m512i b) {  // in place, as dpbusd
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// 16 vectors' lane sums, lane j of the result Σ acc[j] (exact: int32 addition in any order).
inline __m512i lane_sums16(const __m512i acc[16]) {
  __m512i s[8], t[4];
  for (int j = 0; j < 8; ++j)  // per 128 bits: a0[0]+a0[2], a1[0]+a1[2], a0[1]+a0[3], a1[1]+a1[3]
    s[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2 * j], acc[2 * j + 1]),
                            _mm512_unpackhi_epi32(acc[2 * j], acc[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // per 128 bits: the partial sums of rows 4j .. 4j + 3, in order
    t[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(s[2 * j], s[2 * j + 1]),
                            _mm512_unpackhi_epi64(s[2 * j], s[2 * j + 1]));
  const __m512i v01 = _mm512_add_epi32(_mm512_shuffle_i32x4(t[0], t[1], 0x44), _mm512_shuffle_i32x4(t[0], t[1], 0xee));
  const __m512i v23 = _mm512_add_epi32(_mm512_shuffle_i32x4(t[2], t[3], 0x44), _mm512_shuffle_i32x4(t[2], t[3], 0xee));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(v01, v23, 0x88), _mm512_shuffle_i32x4(v01, v23, 0xdd));
}

// w with its signs flipped where x is negative: |x| · ±w = x · w (AVX-512 has no vpsignb).
inline __m512i signed_like(__m512i w, __mmask64 negative) {
  return _mm512_mask_sub_epi8(w, negative, _mm512_setzero_si512(), w);
}

// Σ_k x[k] · M[n, k] for the 16 rows of M at `row` (past N, repeats of the last row, unused), K in
// CH chunks of 64 bytes (the last cut by `tail`): |x| and x's signs in registers for the whole
// block, two accumulators a row.
template <int CH>
inline void rows16_held(const __m512i* a, const __mmask64* negative, const int8_t* const row[16], __mmask64 tail,
                        __m512i acc[16]) {
  __m512i x[CH];
  __mmask64 n[CH];
  for (int c = 0; c < CH; ++c) x[c] = a[c], n[c] = negative[c];
  for (int j = 0; j < 16; ++j) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int c = 0; c < CH; ++c) {
      const __m512i w = _mm512_maskz_loadu_epi8(c + 1 < CH ? ~__mmask64(0) : tail, row[j] + 64 * c);
      if (c % 2 == 0) {
        s0 = dpbusd512(s0, x[c], signed_like(w, n[c]));
      } else {
        s1 = dpbusd512(s1, x[c], signed_like(w, n[c]));
      }
    }
    acc[j] = _mm512_add_epi32(s0, s1);
  }
}

// The same for any number of chunks, |x| and its signs read from the block's arrays.
inline void rows16_read(const __m512i* a, const __mmask64* negative, int64_t chunks, const int8_t* const row[16],
                        __mmask64 tail, __m512i acc[16]) {
  for (int j = 0; j < 16; ++j) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    int64_t c = 0;
    for (; c + 2 < chunks; c += 2) {
      s0 = dpbusd512(s0, a[c], signed_like(_mm512_loadu_si512(row[j] + 64 * c), negative[c]));
      s1 = dpbusd512(s1, a[c + 1], signed_like(_mm512_loadu_si512(row[j] + 64 * c + 64), negative[c + 1]));
    }
    for (; c < chunks; ++c) {
      const __m512i w = _mm512_maskz_loadu_epi8(c + 1 < chunks ? ~__mmask64(0) : tail, row[j] + 64 * c);
      s0 = dpbusd512(s0, a[c], signed_like(w, negative[c]));
    }
    acc[j] = _mm512_add_epi32(s0, s1);
  }
}

template <int CH = 8>
inline void rows16(const __m512i* a, const __mmask64* negative, int64_t chunks, const int8_t* const row[16],
                   __mmask64 tail, __m512i acc[16]) {
  if (chunks == CH) return rows16_held<CH>(a, negative, row, tail, acc);
  if constexpr (CH > 1) return rows16<CH - 1>(a, negative, chunks, row, tail, acc);
  rows16_read(a, negative, chunks, row, tail, acc);
}

// One row of X against row-major M (no packing) on 512-bit vectors, 16 rows of M at a time, one
// reduction per 16 outputs: a one-step call of batch one (the step API) reads M as it is, 25-30%
// faster than the 256-bit loop (which sums each output horizontally).
void unpacked_one_row(const RowsX& qx, const QuantizedRows& M, int64_t N, int64_t K, float beta, float* C) {
  constexpr int64_t kRows = 16;
  const int64_t chunks = (K + 63) / 64;
  const __mmask64 tail = K % 64 == 0 ? ~__mmask64(0) : (__mmask64(1) << (K % 64)) - 1;
  // |x| and its signs, 64 bytes a chunk (never read past K), in this thread's buffers: the loop's
  // threads read them through the pointers (their own thread_locals are others)
  // (bytes aligned by hand: a std::vector<__m512i> instantiated outside this target region, in a
  // build for AVX2, allocated with 32-byte alignment, and the aligned stores below faulted)
  thread_local std::vector<int8_t> a_buffer;
  thread_local std::vector<__mmask64> negative_buffer;
  a_buffer.resize(64 * chunks + 64), negative_buffer.resize(chunks);
  const uintptr_t a_address = reinterpret_cast<uintptr_t>(a_buffer.data());
  __m512i* const a = reinterpret_cast<__m512i*>(a_buffer.data() + (64 - a_address % 64) % 64);
  __mmask64* const negative = negative_buffer.data();
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask64 m = c + 1 < chunks ? ~__mmask64(0) : tail;
    a[c] = _mm512_maskz_loadu_epi8(m, qx.q + qx.abs_off + 64 * c);
    negative[c] = _mm512_movepi8_mask(_mm512_maskz_loadu_epi8(m, qx.q + 64 * c));
  }
  const float sx = qx.sx[0];
  at::parallel_for(0, (N + kRows - 1) / kRows, std::max<int64_t>(1, kGrain / (kRows * K)), [&](int64_t begin,
                                                                                                int64_t end) {
    for (int64_t n = kRows * begin; n < std::min(N, kRows * end); n += kRows) {
      const int64_t rows_m = std::min(kRows, N - n);
      const int8_t* row[kRows];
      for (int64_t j = 0; j < kRows; ++j) row[j] = M.data + (n + std::min(j, rows_m - 1)) * M.ld;  // past N: unused
      __m512i acc[kRows];
      rows16(a, negative, chunks, row, tail, acc);
      const __mmask16 out = __mmask16((1u << rows_m) - 1);
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(sx), _mm512_maskz_loadu_ps(out, M.scale + n)),
                               _mm512_cvtepi32_ps(lane_sums16(acc)));
      if (beta != 0) {
        asm("" : "+v"(v));  // v rounded before the add: no fused multiply-add
        v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(out, C + n)));
      }
      _mm512_mask_storeu_ps(C + n, out, v);
    }
  });
}

// Rows [r0, r0 + XR) of X (1 to 4) against row-major M (no packing), MR = 16 / (XR + 1) rows of M
// at a time: x + 128 as unsigned bytes times w, less 128·Σw as the packed kernels do, Σw summed on
// the way (a vpdpbusd of ones), so that each 64 bytes of M take XR + 1 products for the XR rows;
// the MR·XR sums and MR row sums of a block are one reduction of 16 vectors.
template <int XR>
void unpacked_rows_512(const RowsX& qx, int64_t r0, const QuantizedRows& M, int64_t N, int64_t K, float beta,
                       float* C, int64_t ldc) {
  constexpr int MR = 16 / (XR + 1);
  const int64_t chunks = (K + 63) / 64;
  const __mmask64 tail = K % 64 == 0 ? ~__mmask64(0) : (__mmask64(1) << (K % 64)) - 1;
  const __m512i ones = _mm512_set1_epi8(1);
  const int8_t* xu[XR];  // x + 128, unsigned
  for (int r = 0; r < XR; ++r) xu[r] = qx.q + (r0 + r) * qx.ld + qx.abs_off;
  at::parallel_for(0, (N + MR - 1) / MR, std::max<int64_t>(1, kGrain / (MR * XR * K)), [&](int64_t begin,
                                                                                            int64_t end) {
    for (int64_t n = MR * begin; n < std::min(N, MR * end); n += MR) {
      const int64_t rows_m = std::min<int64_t>(MR, N - n);
      const int8_t* row[MR];
      for (int64_t j = 0; j < MR; ++j) row[j] = M.data + (n + std::min(j, rows_m - 1)) * M.ld;  // past N: unused
      __m512i acc[16];  // [j · XR + r]: row j of M times row r of X; [MR · XR + j]: Σ row j
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
      for (int64_t c = 0; c < chunks; ++c) {
        const __mmask64 m = c + 1 < chunks ? ~__mmask64(0) : tail;  // never read past K
        __m512i x[XR];
        for (int r = 0; r < XR; ++r) x[r] = _mm512_maskz_loadu_epi8(m, xu[r] + 64 * c);
        for (int j = 0; j < MR; ++j) {
          const __m512i w = _mm512_maskz_loadu_epi8(m, row[j] + 64 * c);
          for (int r = 0; r < XR; ++r) acc[j * XR + r] = dpbusd512(acc[j * XR + r], x[r], w);
          acc[MR * XR + j] = dpbusd512(acc[MR * XR + j], ones, w);
        }
      }
      alignas(64) int32_t sums[16];
      _mm512_store_si512(sums, lane_sums16(acc));
      for (int r = 0; r < XR; ++r) {
        const float sx = qx.sx[r0 + r];
        float* out = C + (r0 + r) * ldc;
        for (int64_t j = 0; j < rows_m; ++j)
          put_output(sx, M.scale[n + j], sums[j * XR + r] - 128 * sums[MR * XR + j], beta, out + n + j);
      }
    }
  });
}

// `unpacked` on 512-bit loops: one row of X (a one-step call of batch one) with w's signs flipped,
// more (a step of a beam, a small batch) up to four rows at a time with M's row sums.
void unpacked_512(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K, float beta,
                  float* C, int64_t ldc) {
  thread_local Scratch scratch;
  RowsX qx;
  if (rows == 1) {
    quantize_rows<false>(X, 1, ldx, K, scratch, qx);
    return unpacked_one_row(qx, M, N, K, beta, C);
  }
  quantize_rows<true>(X, rows, ldx, K, scratch, qx);
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1: unpacked_rows_512<1>(qx, r0, M, N, K, beta, C, ldc); break;
      case 2: unpacked_rows_512<2>(qx, r0, M, N, K, beta, C, ldc); break;
      case 3: unpacked_rows_512<3>(qx, r0, M, N, K, beta, C, ldc); break;
      default: unpacked_rows_512<4>(qx, r0, M, N, K, beta, C, ldc); break;
    }
  }
}
}  // namespace avx512_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace avx_vnni {  // the VEX encoding (AVX-VNNI): Alder Lake and later client cores, Sierra Forest
constexpr bool kOffset = true;
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {  // as avx512_vnni's, VEX-encoded
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  return acc;
}
inline __m256i dot_sign(__m256i acc, __m256i x_abs, __m256i x_q, __m256i w) {
  return dpbusd(acc, x_abs, _mm256_sign_epi8(w, x_q));
}
inline __m256i dot_packed(__m256i acc, __m256i x_aux, __m256i, __m256i w) { return dpbusd(acc, x_aux, w); }
#include "qgemm_kernels.h"
}  // namespace avx_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")
// AMX-INT8 (Sapphire Rapids and later Xeons): tdpbssd sums a tile of 16 rows × 64 k of the quantized
// X (signed bytes) times 16 groups of 4 k of a packed panel (8 columns × 4 bytes a group, the
// layout the VNNI kernels read) into a 16 × 8 tile of int32, exactly: the same sums, so the same
// results bit for bit, as every other int8 kernel (the epilogue is packed_kernel's). Signed times
// signed, so no +128 offset and no correction by Σw. A tile of 8 columns does half a full tile's
// work per instruction; packing M 16 columns wide for AMX alone was not worth a second layout.
namespace amx_int8 {

constexpr int64_t kRows = 16;    // rows of X (and C) per tile
constexpr int64_t kChunk = 64;   // k per tile of X (16 groups of 4)
// Fewer rows stay on vpdpbusd, whose blocks of rows waste nothing on padding: 2 × 256 × 1024 took
// 7.3 µs there against 8.5 on tiles, 4 rows 9.2 against 9.1, 8 rows 17.1 against 10.4 (Emerald Rapids,
// 1 thread, quantizing X included).
constexpr int64_t kMinRows = 4;

// C in tiles 0-3 (16 rows × 8 int32), X in 4 and 5 (16 rows × 64 bytes), M in 6 and 7 (16 groups × 32 bytes).
inline void configure() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = t == 4 || t == 5 ? 64 : 32;
  _tile_loadconfig(&config);
}

// Rows [r0, r0 + rows) (rows ≤ 16) × columns [n, n + width) (width ≤ 8) of C from a tile's sums, as
// packed_kernel finishes them.
inline void finish(const int32_t* sums, const float* sx, const float* scale, int64_t rows, int64_t width, float beta,
                   float* C, int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r)
    put_outputs8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + r * kPanel)), sx[r], scale, width, beta,
                 C + r * ldc);
}

struct Operands {
  const int8_t* x[2] = {};       // the tiles of rows' first chunk
  int64_t x_stride = 0;          // bytes
  const int8_t* x_tail[2] = {};  // the last, partial chunk, padded (64 bytes a row)
  const int8_t* m[2] = {};       // the panels' first chunk
  const int8_t* m_tail[2] = {};  // their last, partial chunk, padded (32 bytes a group)
};

template <int MT, int NT>
void block(const Operands& o, int64_t chunks, bool tail, int32_t* sums) {
  _tile_zero(0);
  if (NT > 1) _tile_zero(1);
  if (MT > 1) _tile_zero(2);
  if (MT > 1 && NT > 1) _tile_zero(3);
  for (int64_t k = 0; k < chunks; ++k) {
    _tile_loadd(4, o.x[0] + k * kChunk, o.x_stride);
    if (MT > 1) _tile_loadd(5, o.x[1] + k * kChunk, o.x_stride);
    _tile_loadd(6, o.m[0] + k * 16 * 4 * kPanel, 4 * kPanel);
    if (NT > 1) _tile_loadd(7, o.m[1] + k * 16 * 4 * kPanel, 4 * kPanel);
    _tile_dpbssd(0, 4, 6);
    if (NT > 1) _tile_dpbssd(1, 4, 7);
    if (MT > 1) _tile_dpbssd(2, 5, 6);
    if (MT > 1 && NT > 1) _tile_dpbssd(3, 5, 7);
  }
  if (tail) {
    _tile_loadd(4, o.x_tail[0], kChunk);
    if (MT > 1) _tile_loadd(5, o.x_tail[1], kChunk);
    _tile_loadd(6, o.m_tail[0], 4 * kPanel);
    if (NT > 1) _tile_loadd(7, o.m_tail[1], 4 * kPanel);
    _tile_dpbssd(0, 4, 6);
    if (NT > 1) _tile_dpbssd(1, 4, 7);
    if (MT > 1) _tile_dpbssd(2, 5, 6);
    if (MT > 1 && NT > 1) _tile_dpbssd(3, 5, 7);
  }
  constexpr int64_t kTile = kRows * kPanel;  // int32 sums per tile
  _tile_stored(0, sums, 4 * kPanel);
  if (NT > 1) _tile_stored(1, sums + kTile, 4 * kPanel);
  if (MT > 1) _tile_stored(2, sums + 2 * kTile, 4 * kPanel);
  if (MT > 1 && NT > 1) _tile_stored(3, sums + 3 * kTile, 4 * kPanel);
}

// qgemm_nt_packed for rows, N, K > 0.
void packed(const float* X, int64_t rows, int64_t ldx, const int8_t* packed, const float* scale, int64_t N, int64_t K,
            float beta, float* C, int64_t ldc) {
  if (rows < kMinRows) return avx512_vnni::packed(X, rows, ldx, packed, scale, N, K, beta, C, ldc);
  thread_local Scratch scratch;
  RowsX qx;
  quantize_rows<false>(X, rows, ldx, K, scratch, qx);  // q [rows][ld], zero from K to a multiple of 32
  const int64_t groups = groups_of(K), panel_bytes = groups * 4 * kPanel, panels = panels_of(N);
  const int64_t full_chunks = groups / 16, tail_groups = groups % 16;
  const int64_t tile = std::max<int64_t>(2, (kTileBytes / panel_bytes) & ~int64_t(1));
  const int64_t grain = std::max<int64_t>(2, kAmxGrain / (kPanel * K * rows));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    configure();
    alignas(64) int32_t sums[4 * kRows * kPanel];
    thread_local std::vector<int8_t> row_tail, x_tails, m_tails;
    const int64_t tail_rows = rows % kRows, whole_rows = rows - tail_rows;
    if (tail_rows) {  // the last tile of rows, 16 rows with zeros past the last
      row_tail.assign(kRows * qx.ld, 0);
      for (int64_t r = 0; r < tail_rows; ++r)
        std::memcpy(row_tail.data() + r * qx.ld, qx.q + (whole_rows + r) * qx.ld, qx.abs_off);
    }
    if (tail_groups) {  // each panel's last chunk, 16 groups with zeros past the tail
      m_tails.assign((end - begin) * 16 * 4 * kPanel, 0);
      for (int64_t p = begin; p < end; ++p)
        std::memcpy(m_tails.data() + (p - begin) * 16 * 4 * kPanel, packed + p * panel_bytes + full_chunks * 16 * 4 * kPanel,
                    tail_groups * 4 * kPanel);
      x_tails.assign(2 * kRows * kChunk, 0);
    }
    for (int64_t t0 = begin; t0 < end; t0 += tile) {
      const int64_t t1 = std::min(end, t0 + tile);
      for (int64_t r0 = 0; r0 < rows; r0 += 2 * kRows) {
        const int mt = r0 + kRows < rows ? 2 : 1;
        Operands o;
        o.x_stride = qx.ld;
        for (int i = 0; i < mt; ++i) {
          const int64_t r = r0 + i * kRows;
          const int8_t* src = r >= whole_rows ? row_tail.data() : qx.q + r * qx.ld;
          o.x[i] = src;
          if (tail_groups) {
            int8_t* dest = x_tails.data() + i * kRows * kChunk;
            for (int64_t j = 0; j < kRows; ++j)
              std::memcpy(dest + j * kChunk, src + j * qx.ld + full_chunks * kChunk, tail_groups * 4);
            o.x_tail[i] = dest;
          }
        }
        if (mt == 1) o.x[1] = o.x[0], o.x_tail[1] = o.x_tail[0];
        for (int64_t p = t0; p < t1; p += 2) {
          const int nt = p + 1 < t1 ? 2 : 1;
          for (int j = 0; j < 2; ++j) {
            const int64_t q = p + std::min(j, nt - 1);
            o.m[j] = packed + q * panel_bytes;
            o.m_tail[j] = tail_groups ? m_tails.data() + (q - begin) * 16 * 4 * kPanel : nullptr;
          }
          if (mt == 2 && nt == 2) block<2, 2>(o, full_chunks, tail_groups > 0, sums);
          else if (mt == 2) block<2, 1>(o, full_chunks, tail_groups > 0, sums);
          else if (nt == 2) block<1, 2>(o, full_chunks, tail_groups > 0, sums);
          else block<1, 1>(o, full_chunks, tail_groups > 0, sums);
          for (int i = 0; i < mt; ++i)
            for (int j = 0; j < nt; ++j) {
              const int64_t r = r0 + i * kRows, n = kPanel * (p + j);
              finish(sums + (2 * i + j) * kRows * kPanel, qx.sx + r, scale + n, std::min(kRows, rows - r),
                     std::min(kPanel, N - n), beta, C + r * ldc + n, ldc);
            }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx_int8
#pragma GCC pop_options

bool has_avx512_vnni() {
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw");
}

bool has_amx_int8() {  // AMX-INT8 (kernel_choice.h)
  static const bool yes = has_avx512_vnni() && amx_usable(25);
  return yes;
}
bool has_avx_vnni() { return __builtin_cpu_supports("avxvnni"); }
#endif

// In the order `auto` tries them; emulated-vnni only on request (tests).
const Int8Kernels kKernels[] = {
#ifdef RNNKIT_VNNI_KERNELS
    {"amx-int8", avx512_vnni::unpacked_512, amx_int8::packed, has_amx_int8, true},
    {"avx512-vnni", avx512_vnni::unpacked_512, avx512_vnni::packed, has_avx512_vnni, true},
    {"avx-vnni", avx_vnni::unpacked, avx_vnni::packed, has_avx_vnni, true},
#endif
    {"avx2", avx2::unpacked, avx2::packed, runs_everywhere, true},
    {"emulated-vnni", emulated_vnni::unpacked, emulated_vnni::packed, runs_everywhere, false},
};

}  // namespace

#else  // no AVX2: plain loops

namespace {

namespace scalar {

// Row r of X quantized as the vector kernels do it (round to nearest even) -> its scale (NaN, and
// the bytes zero, for a row with a NaN or an infinity, as there).
float quantize_row(const float* x, int64_t K, std::vector<int8_t>& q) {
  q.assign(std::max<int64_t>(K, 0), 0);
  float amax = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (!std::isfinite(x[k])) return std::numeric_limits<float>::quiet_NaN();
    amax = std::max(amax, std::abs(x[k]));
  }
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  for (int64_t k = 0; k < K; ++k) q[k] = int8_t(std::nearbyint(x[k] * inv));
  return amax / 127.0f;
}

void packed(const float* X, int64_t rows, int64_t ldx, const int8_t* packed, const float* scale, int64_t N, int64_t K,
            float beta, float* C, int64_t ldc) {
  const int64_t groups = groups_of(K);
  std::vector<int8_t> q;
  for (int64_t r = 0; r < rows; ++r) {
    const float sx = quantize_row(X + r * ldx, K, q);
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

void unpacked(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K, float beta,
              float* C, int64_t ldc) {
  std::vector<int8_t> q;
  for (int64_t r = 0; r < rows; ++r) {
    const float sx = quantize_row(X + r * ldx, K, q);
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

}  // namespace scalar

const Int8Kernels kKernels[] = {{"scalar", scalar::unpacked, scalar::packed, runs_everywhere, true}};

}  // namespace

#endif

namespace {

// The kernels in use: the CPU's choice, or $RNNKIT_INT8_KERNEL's (read at the first int8 product).
auto& choice() { return kernel_choice(kKernels, "RNNKIT_INT8_KERNEL", "int8"); }

const Int8Kernels& current() { return choice().current(); }

}  // namespace

const char* int8_kernel() { return current().name; }

std::vector<std::string> int8_kernels() { return choice().names(); }

std::string set_int8_kernel(const std::string& name) { return choice().set(name, "set_int8_kernel"); }

void qgemm_unpacked(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K,
                    float beta, float* C, int64_t ldc) {
  if (rows <= 0 || N <= 0) return;
  if (K <= 0) return qgemm_nt_packed(X, rows, ldx, nullptr, M.scale, N, K, beta, C, ldc);
  current().unpacked(X, rows, ldx, M, N, K, beta, C, ldc);
}

void qgemv_rows(const float* x, const QuantizedRows& M, int64_t N, int64_t K, float beta, float* C) {
  qgemm_unpacked(x, 1, K, M, N, K, beta, C, N);
}

void qgemm_nt_packed(const float* X, int64_t rows, int64_t ldx, const int8_t* packed, const float* scale, int64_t N,
                     int64_t K, float beta, float* C, int64_t ldc) {
  if (rows <= 0 || N <= 0) return;
  if (K <= 0) {  // empty sums: 0 · scale (a NaN or infinite scale still shows)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < N; ++n) {
        const float v = 0.0f * scale[n] * 0.0f;
        C[r * ldc + n] = beta == 0 ? v : v + beta * C[r * ldc + n];
      }
    return;
  }
  current().packed(X, rows, ldx, packed, scale, N, K, beta, C, ldc);
}

}  // namespace rnnkit
