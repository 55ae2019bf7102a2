// bfloat16 GEMMs (bgemm.h): M packed into panels of 16 rows × 2 k per 512-bit vector, so each
// vdpbf16ps adds two products into each of 16 float32 outputs with no horizontal sums; a block of
// 4 panels × 6 rows of X keeps 24 accumulators in registers. The emulated kernels compute the
// instruction's two fused multiply-adds per lane (odd k first, as its definition orders them) in
// AVX-512F, for testing on CPUs without AVX512_BF16.
#include "bgemm.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "buffers.h"
#include "gemm.h"
#include "kernel_choice.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define RNNKIT_BF16_KERNELS 1
#include <immintrin.h>
#endif

namespace rnnkit {

namespace {

constexpr int64_t kPanel = 16;  // rows of M per panel: one float32 vector of outputs

inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }
inline int64_t panels_of(int64_t N) { return (N + kPanel - 1) / kPanel; }

// Panels a thread packs at least: ~64 K values of M each.
inline int64_t pack_grain(int64_t K) {
  return std::max<int64_t>(1, (int64_t(1) << 16) / (kPanel * std::max<int64_t>(K, 1)));
}

struct Bf16Kernels {
  const char* name;
  // X [rows, K] (or, transposed, A = Xᵀ [K, rows]) rounded into out [rows, ld], K padded with zeros to ld
  void (*round)(const float* X, int64_t rows, int64_t ldx, bool transposed, int64_t K, int64_t ld, uint16_t* out);
  // The same into columns [0, K) of out's rows only (no padding written)
  void (*round_part)(const float* X, int64_t rows, int64_t ldx, bool transposed, int64_t K, int64_t ld,
                     uint16_t* out);
  // C = x · Mᵀ (+ beta C) from rounded x [rows, ld], M packed
  void (*rounded)(const uint16_t* x, int64_t rows, int64_t ld, const uint16_t* packed, int64_t N, int64_t K,
                  float beta, float* C, int64_t ldc);
  void (*pack_float_transposed)(const float* M, int64_t ld, int64_t N, int64_t K, uint16_t* dest);
  void (*pack_transposed)(const uint16_t* M, int64_t ld, int64_t N, int64_t K, uint16_t* dest);
  bool (*runs_here)();
  bool automatic;  // chosen by "auto" when it runs here (the first such in kKernels' order)
};

}  // namespace

int64_t bf16_packed_bytes(int64_t N, int64_t K) { return panels_of(N) * pairs_of(K) * 2 * kPanel * 2; }

namespace {

// dest[p][g][j][b] = value(16p + j, 2g + b) for n < N, k < K, zero elsewhere: the panels of an
// [N, K] operand whose (n, k) element `value` gives as bfloat16 bits.
template <typename Value>
void pack_panels(int64_t N, int64_t K, uint16_t* dest, const Value& value) {
  const int64_t groups = pairs_of(K), panels = panels_of(N);
  at::parallel_for(0, panels, pack_grain(K),
                   [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint16_t* panel = dest + p * groups * 2 * kPanel;
      std::memset(panel, 0, groups * 2 * kPanel * sizeof(uint16_t));
      const int64_t width = std::min(kPanel, N - kPanel * p);
      for (int64_t k = 0; k < K; ++k) {
        uint16_t* out = panel + (k / 2) * 2 * kPanel + (k % 2);
        for (int64_t j = 0; j < width; ++j) out[2 * j] = value(kPanel * p + j, k);
      }
    }
  });
}

}  // namespace

void bf16_pack(const HalfRows& M, int64_t N, int64_t K, uint16_t* dest) {
  TORCH_CHECK(M.bf16, "rnnkit fused: bf16_pack takes bfloat16 rows");
  const uint16_t* m = static_cast<const uint16_t*>(M.data);
#if defined(CPU_CAPABILITY_AVX512)  // where the bfloat16 kernels run (AVX-512 builds)
  if (K % 2 == 0 && M.ld % 2 == 0) {
    // A panel is the transpose of 16 rows of M taken as 32-bit pairs of k: ATen's float transposes
    // (bits moved in registers, never computed on: 16 x 16 blocks)
    const int64_t groups = K / 2, panels = panels_of(N);
    at::parallel_for(0, panels, pack_grain(K),
                     [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        float* panel = reinterpret_cast<float*>(dest + p * groups * 2 * kPanel);
        const int64_t width = std::min(kPanel, N - kPanel * p);
        if (width < kPanel) std::memset(panel, 0, groups * kPanel * sizeof(float));
        at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(m + kPanel * p * M.ld), M.ld / 2, panel, kPanel,
                                      int(width), int(groups));
      }
    });
    return;
  }
#endif
  pack_panels(N, K, dest, [&](int64_t n, int64_t k) { return m[n * M.ld + k]; });
}

namespace {

void pack_transposed_loop(const uint16_t* m, int64_t ld, int64_t N, int64_t K, uint16_t* dest) {
  pack_panels(N, K, dest, [&](int64_t n, int64_t k) { return m[k * ld + n]; });
}

}  // namespace

namespace {

void pack_float_transposed_loop(const float* M, int64_t ld, int64_t N, int64_t K, uint16_t* dest) {
  pack_panels(N, K, dest, [&](int64_t n, int64_t k) { return c10::BFloat16(M[k * ld + n]).x; });  // nearest even
}

}  // namespace

#if defined(RNNKIT_BF16_KERNELS)

namespace {

constexpr int64_t kGrain = 1 << 16;      // multiply-adds per thread, at least
constexpr int64_t kTileBytes = 1 << 18;  // bytes of packed M per N tile: stays in L2 while every X row passes over it
constexpr int kNR = 4, kXR = 6;          // a block: 4 panels (64 columns) times 6 rows of X, 24 accumulators

}  // namespace

// The kernels, once per instruction set: `dot(acc, w, x)` adds w's and x's two bfloat16 products
// per 32-bit lane into acc's float32 lanes.
#define RNNKIT_BF16_KERNEL_BODY                                                                                  \
  /* 16 floats as bfloat16, rounded to nearest even (NaN stays a quiet NaN): each in the low half of */        \
  /* its 32-bit lane, the high half zero. */                                                                   \
  inline __m512i round32(__m512 v) {                                                                           \
    const __m512i bits = _mm512_castps_si512(v);                                                               \
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));                   \
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16); \
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                              \
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));                 \
  }                                                                                                            \
                                                                                                               \
  /* The same in memory order, 16 bfloat16 values. */                                                         \
  inline __m256i round16(__m512 v) { return _mm512_cvtepi32_epi16(round32(v)); }                                \
                                                                                                               \
  /* X's rows as bfloat16 into columns [0, K) of out's rows, one row per `ld` values (the padding is */      \
  /* round's, or bf16_rounded_buffer's). */                                                                    \
  void round_rows(const float* X, int64_t rows, int64_t ldx, int64_t K, int64_t ld, uint16_t* out) {           \
    for (int64_t r = 0; r < rows; ++r) {                                                                       \
      const float* x = X + r * ldx;                                                                            \
      uint16_t* o = out + r * ld;                                                                              \
      int64_t k = 0;                                                                                           \
      for (; k + 16 <= K; k += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), round16(_mm512_loadu_ps(x + k))); \
      if (k < K) {                                                                                             \
        const __mmask16 m = __mmask16((1u << (K - k)) - 1);                                                   \
        _mm256_mask_storeu_epi16(o + k, m, round16(_mm512_maskz_loadu_ps(m, x + k)));                         \
      }                                                                                                        \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  /* The same from X given as A = Xᵀ [K, rows] (lda per row of A), read in place: 16 × 16 float blocks */      \
  /* transposed in registers (ATen's), then rounded. A weight gradient's dGᵀ: ATen's transposing copy */       \
  /* of it took 2.2 ms for 512 × 1600 floats on Zen 4, a third of a small bfloat16 LSTM's training step. */     \
  /* A is walked in strips of 16 whole rows (each read in order once), not down 16-column stripes: */          \
  /* a stripe's 64 bytes a row at a stride of lda floats defeat the prefetchers and the TLB once A */           \
  /* outgrows the caches (Zen 4, 1 thread: dGᵀ of 3200 × 1024 floats 4.6 -> 1.9 ms, 6400 × 2048 */           \
  /* 25.6 -> 10.8, 800 × 4096 4.1 -> 2.5; 1600 × 512, in cache, 0.22 -> 0.19). */                         \
  void round_columns(const float* A, int64_t rows, int64_t lda, int64_t K, int64_t ld, uint16_t* out) {        \
    alignas(64) float tile[kPanel * kPanel];                                                                   \
    for (int64_t k0 = 0; k0 < K; k0 += kPanel) {                                                               \
      const int kc = int(std::min<int64_t>(kPanel, K - k0));                                                   \
      const __mmask16 m = __mmask16((1u << kc) - 1);                                                           \
      for (int64_t r0 = 0; r0 < rows; r0 += kPanel) {                                                          \
        const int rc = int(std::min<int64_t>(kPanel, rows - r0));                                              \
        at::vec::transpose_mxn<float>(A + k0 * lda + r0, lda, tile, kPanel, kc, rc); /* tile[r][k] */          \
        for (int r = 0; r < rc; ++r)                                                                           \
          _mm256_mask_storeu_epi16(out + (r0 + r) * ld + k0, m, round16(_mm512_maskz_loadu_ps(m, tile + r * kPanel))); \
      }                                                                                                        \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  /* Either, into columns [0, K) of out's rows and nothing else (bf16_round_part's pieces) */                  \
  void round_part(const float* X, int64_t rows, int64_t ldx, bool transposed, int64_t K, int64_t ld,           \
                  uint16_t* out) {                                                                             \
    (transposed ? round_columns : round_rows)(X, rows, ldx, K, ld, out);                                       \
  }                                                                                                            \
                                                                                                               \
  /* Either, K padded with zeros to ld */                                                                      \
  void round(const float* X, int64_t rows, int64_t ldx, bool transposed, int64_t K, int64_t ld, uint16_t* out) { \
    round_part(X, rows, ldx, transposed, K, ld, out);                                                          \
    if (K < ld)                                                                                                \
      for (int64_t r = 0; r < rows; ++r) std::fill(out + r * ld + K, out + (r + 1) * ld, uint16_t(0));         \
  }                                                                                                            \
                                                                                                               \
  /* bf16_pack_float_transposed's and bf16_pack_transposed's layout from M [K, N] (ld per row): rows */      \
  /* 2g and 2g + 1, 16 columns each as bfloat16 bits (`bits32(row, mask)`: in the low halves of 32-bit */     \
  /* lanes, zeros past N), interleaved into one 64-byte group (k = 2g in each lane's low half), as */          \
  /* pack_panels lays them out. */                                                                             \
  template <typename T, typename Bits>                                                                         \
  void interleave_pairs(const T* M, int64_t ld, int64_t N, int64_t K, uint16_t* dest, const Bits& bits32) {    \
    const int64_t groups = pairs_of(K), panels = panels_of(N);                                                 \
    at::parallel_for(0, panels, pack_grain(K), [&](int64_t begin, int64_t end) {                               \
      for (int64_t p = begin; p < end; ++p) {                                                                  \
        uint16_t* panel = dest + p * groups * 2 * kPanel;                                                      \
        const __mmask16 m = __mmask16((1u << std::min(kPanel, N - kPanel * p)) - 1);                          \
        const T* col = M + kPanel * p;                                                                         \
        for (int64_t g = 0; g < groups; ++g) {                                                                 \
          const __m512i even = bits32(col + 2 * g * ld, m);                                                     \
          const __m512i odd = 2 * g + 1 < K ? bits32(col + (2 * g + 1) * ld, m) : _mm512_setzero_si512();      \
          _mm512_storeu_si512(panel + 2 * kPanel * g, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));      \
        }                                                                                                      \
      }                                                                                                        \
    });                                                                                                        \
  }                                                                                                            \
                                                                                                               \
  /* float32 rows rounded to bfloat16 (nearest even) as they are read */                                       \
  void pack_float_transposed(const float* M, int64_t ld, int64_t N, int64_t K, uint16_t* dest) {              \
    interleave_pairs(M, ld, N, K, dest,                                                                        \
                     [](const float* row, __mmask16 m) { return round32(_mm512_maskz_loadu_ps(m, row)); });    \
  }                                                                                                            \
                                                                                                               \
  /* bfloat16 rows as they are */                                                                              \
  void pack_transposed(const uint16_t* M, int64_t ld, int64_t N, int64_t K, uint16_t* dest) {                  \
    interleave_pairs(M, ld, N, K, dest,                                                                        \
                     [](const uint16_t* row, __mmask16 m) {                                                    \
                       return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row));                         \
                     });                                                                                       \
  }                                                                                                            \
                                                                                                               \
  /* C[XR rows, NR panels of 16 columns (the last cut at `width`)]. */                                         \
  template <int NR, int XR>                                                                                    \
  void block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_elems, int64_t groups,           \
             int64_t width, float beta, float* C, int64_t ldc) {                                               \
    /* Every loop over XR and NR unrolled (RNNKIT_UNROLL): with the accumulators indexed by constants          \
       they stay in registers, where GCC otherwise kept them in a stack array across the k loop (48            \
       stores and loads a block: 1-10% of a standalone block's time at K 128-1024 on Zen 4). */                \
    __m512 acc[XR][NR];                                                                                        \
    RNNKIT_UNROLL for (int r = 0; r < XR; ++r)                                                                 \
      RNNKIT_UNROLL for (int i = 0; i < NR; ++i) acc[r][i] = _mm512_setzero_ps();                              \
    for (int64_t g = 0; g < groups; ++g) {                                                                     \
      __m512i wv[NR];                                                                                          \
      for (int i = 0; i < NR; ++i)                                                                             \
        wv[i] = _mm512_loadu_si512(reinterpret_cast<const void*>(w + i * panel_elems + 2 * kPanel * g));       \
      for (int r = 0; r < XR; ++r) {                                                                           \
        int32_t pair;                                                                                          \
        std::memcpy(&pair, x + r * ldx + 2 * g, sizeof(pair));                                                 \
        const __m512i xb = _mm512_set1_epi32(pair);                                                            \
        for (int i = 0; i < NR; ++i) acc[r][i] = dot(acc[r][i], wv[i], xb);                                    \
      }                                                                                                        \
    }                                                                                                          \
    RNNKIT_UNROLL for (int r = 0; r < XR; ++r) {                                                               \
      float* c = C + r * ldc;                                                                                  \
      RNNKIT_UNROLL for (int i = 0; i < NR; ++i) {                                                             \
        const int64_t n = kPanel * i;                                                                          \
        if (n >= width) continue;                                                                              \
        const __mmask16 m = n + kPanel <= width ? __mmask16(0xffff) : __mmask16((1u << (width - n)) - 1);      \
        __m512 v = acc[r][i];                                                                                  \
        if (beta != 0) v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m, c + n))); \
        _mm512_mask_storeu_ps(c + n, m, v);                                                                    \
      }                                                                                                        \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  template <int NR>                                                                                            \
  void rows_of(int xr, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_elems, int64_t groups, \
               int64_t width, float beta, float* C, int64_t ldc) {                                             \
    switch (xr) {                                                                                              \
      case 1: return block<NR, 1>(x, ldx, w, panel_elems, groups, width, beta, C, ldc);                        \
      case 2: return block<NR, 2>(x, ldx, w, panel_elems, groups, width, beta, C, ldc);                        \
      case 3: return block<NR, 3>(x, ldx, w, panel_elems, groups, width, beta, C, ldc);                        \
      case 4: return block<NR, 4>(x, ldx, w, panel_elems, groups, width, beta, C, ldc);                        \
      case 5: return block<NR, 5>(x, ldx, w, panel_elems, groups, width, beta, C, ldc);                        \
      default: return block<NR, 6>(x, ldx, w, panel_elems, groups, width, beta, C, ldc);                       \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  void rounded(const uint16_t* x, int64_t rows, int64_t ld, const uint16_t* w, int64_t N, int64_t K, float beta, \
               float* C, int64_t ldc) {                                                                        \
    const int64_t groups = pairs_of(K), panel_elems = groups * 2 * kPanel;                                     \
    const int64_t panels = panels_of(N);                                                                       \
    const int64_t tile = std::max<int64_t>(kNR, kTileBytes / (2 * panel_elems));                               \
    const int64_t grain = std::max<int64_t>(1, kGrain / (kPanel * K * rows));                                  \
    const int64_t blocks = (rows + kXR - 1) / kXR;                                                             \
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {                                       \
      for (int64_t t0 = begin; t0 < end; t0 += tile) {                                                         \
        const int64_t t1 = std::min(end, t0 + tile);                                                           \
        for (int64_t i = 0; i < blocks; ++i) {                                                                 \
          int64_t r0, rc;                                                                                      \
          row_block(rows, blocks, i, r0, rc);                                                                  \
          const int xr = int(rc);                                                                              \
          for (int64_t p = t0; p < t1; p += kNR) {                                                             \
            const int np = int(std::min<int64_t>(kNR, t1 - p));                                               \
            const int64_t n = kPanel * p, width = std::min(kPanel * np, N - n);                                \
            const uint16_t* xr0 = x + r0 * ld;                                                                 \
            const uint16_t* wp = w + p * panel_elems;                                                          \
            float* c = C + r0 * ldc + n;                                                                       \
            switch (np) {                                                                                      \
              case 1: rows_of<1>(xr, xr0, ld, wp, panel_elems, groups, width, beta, c, ldc); break;            \
              case 2: rows_of<2>(xr, xr0, ld, wp, panel_elems, groups, width, beta, c, ldc); break;            \
              case 3: rows_of<3>(xr, xr0, ld, wp, panel_elems, groups, width, beta, c, ldc); break;            \
              default: rows_of<4>(xr, xr0, ld, wp, panel_elems, groups, width, beta, c, ldc); break;           \
            }                                                                                                  \
          }                                                                                                    \
        }                                                                                                      \
      }                                                                                                        \
    });                                                                                                        \
  }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
namespace avx512_bf16 {  // vdpbf16ps: Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and later
inline __m512 dot(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
RNNKIT_BF16_KERNEL_BODY
}  // namespace avx512_bf16
#pragma GCC pop_options

#if __GNUC__ >= 11  // GCC 11 brought the AMX intrinsics
#define RNNKIT_AMX_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
// AMX (Sapphire Rapids and later Xeons): tdpbf16ps multiplies a tile of 16 rows × 32 k of X by a
// tile of 16 pairs of k × 16 columns, summing into a 16 × 16 float32 tile: 8 times vdpbf16ps's
// multiply-adds a cycle. M's panels are already that tile's layout (16 columns × 2 k per 64-byte
// row), so the product reads the same packed M and rounded X as the vdpbf16ps kernels. Each output
// adds its k in pairs, in order, as vdpbf16ps does; within a pair the instruction orders the two
// products its own way (and the hardware rounds as it does), so the sums may differ from
// vdpbf16ps's by float32 roundings (both within bfloat16's tolerance of float64 on the operands).
// A product of one row runs on vdpbf16ps (kMinRows): a batch of one and a row of a larger batch
// may differ so. The tiles flush subnormal values to zero, C's too where beta 1 loads it into a
// tile (vdpbf16ps flushes its inputs' and products' but adds C as it is): a C of 1e-40 becomes 0.
namespace amx_bf16 {

constexpr int64_t kRows = 16;         // rows of X (and C) per tile
constexpr int64_t kChunk = 32;        // k per tile of X (16 pairs)
constexpr int64_t kKBlock = 1024;     // k per block: C goes through memory between blocks (same values)
constexpr int64_t kTileBytes = 1 << 19;  // bytes of packed M over one k block kept in L2 while X passes

// Every tile 16 rows × 64 bytes: C in tiles 0-3, X in 4 and 5, M in 6 and 7.
inline void configure() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// A tile of X: its 16 rows' 32 k at `x` (ld values per row), or a padded copy where fewer rows or k remain.
struct XTile {
  const uint16_t* data;
  int64_t stride;  // bytes
};

// C tile (rows r0 + [0, 16), columns n0 + [0, 16)) of `C` as the tile loads and stores it: in place where
// whole, else through `spill` (16 × 16 floats).
struct CTile {
  float* c;
  int64_t ldc;
  int rows, cols;
  bool whole() const { return rows == kRows && cols == 16; }
};

inline void spill_in(const CTile& t, float* spill) {
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 16; ++j) spill[r * 16 + j] = r < t.rows && j < t.cols ? t.c[r * t.ldc + j] : 0.0f;
}

inline void spill_out(const CTile& t, const float* spill, float beta) {
  for (int r = 0; r < t.rows; ++r)
    for (int j = 0; j < t.cols; ++j) {
      float& out = t.c[r * t.ldc + j];
      out = beta == 0 ? spill[r * 16 + j] : spill[r * 16 + j] + beta * out;
    }
}

// The 2 × 2 tiles (MT rows of tiles, NT columns) of one block over one k block. `load`: C's tiles
// start from C (a later k block, or beta 1), else from zero; `beta`: where C is not 0 or 1, the first k
// block adds beta · C as it stores. x_tail / m_tail: the k block's last, partial chunk, padded.
template <int MT, int NT>
void block(const XTile (&x)[2], const XTile (&x_tail)[2], const uint16_t* const (&m)[2],
           const uint16_t* const (&m_tail)[2], int64_t chunks, bool tail, const CTile (&c)[2][2], bool load,
           float beta, float* spill) {
#define RNNKIT_AMX_C(i, j, T)                                                                           \
  if (MT > i && NT > j) {                                                                               \
    if (!load) {                                                                                        \
      _tile_zero(T);                                                                                    \
    } else if (c[i][j].whole()) {                                                                       \
      _tile_loadd(T, c[i][j].c, c[i][j].ldc * 4);                                                       \
    } else {                                                                                            \
      spill_in(c[i][j], spill);                                                                         \
      _tile_loadd(T, spill, 64);                                                                        \
    }                                                                                                   \
  }
  RNNKIT_AMX_C(0, 0, 0) RNNKIT_AMX_C(0, 1, 1) RNNKIT_AMX_C(1, 0, 2) RNNKIT_AMX_C(1, 1, 3)
#undef RNNKIT_AMX_C
  for (int64_t k = 0; k < chunks; ++k) {
    _tile_loadd(4, x[0].data + k * kChunk, x[0].stride);
    if (MT > 1) _tile_loadd(5, x[1].data + k * kChunk, x[1].stride);
    _tile_loadd(6, m[0] + k * kChunk * 16, 64);
    if (NT > 1) _tile_loadd(7, m[1] + k * kChunk * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if (MT > 1 && NT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  if (tail) {
    _tile_loadd(4, x_tail[0].data, x_tail[0].stride);
    if (MT > 1) _tile_loadd(5, x_tail[1].data, x_tail[1].stride);
    _tile_loadd(6, m_tail[0], 64);
    if (NT > 1) _tile_loadd(7, m_tail[1], 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if (MT > 1 && NT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  const float add = load ? 0.0f : beta;  // beta 0 or 1 came in through the tile's start
#define RNNKIT_AMX_STORE(i, j, T)                                                                       \
  if (MT > i && NT > j) {                                                                               \
    if (c[i][j].whole() && add == 0) {                                                                  \
      _tile_stored(T, c[i][j].c, c[i][j].ldc * 4);                                                      \
    } else {                                                                                            \
      _tile_stored(T, spill, 64);                                                                       \
      spill_out(c[i][j], spill, add);                                                                   \
    }                                                                                                   \
  }
  RNNKIT_AMX_STORE(0, 0, 0) RNNKIT_AMX_STORE(0, 1, 1) RNNKIT_AMX_STORE(1, 0, 2) RNNKIT_AMX_STORE(1, 1, 3)
#undef RNNKIT_AMX_STORE
}

// A product of one row reads M at vdpbf16ps's speed, where the tiles of 16 rows spend their time on
// the row's padded copy: 11.7 against 13.7 µs for 1 × 256 × 1024, 11.7 against 21.3 for 1 × 1024 × 256;
// from 2 rows AMX is ahead (13.6 against 17.6 µs at 2 × 256 × 1024). Emerald Rapids, 1 thread.
constexpr int64_t kMinRows = 2;

// C = x · Mᵀ (+ beta C) for rounded x [rows, ld] (k zero past K up to ld) and M packed in panels.
void rounded(const uint16_t* x, int64_t rows, int64_t ld, const uint16_t* w, int64_t N, int64_t K, float beta,
             float* C, int64_t ldc) {
  if (rows < kMinRows) return avx512_bf16::rounded(x, rows, ld, w, N, K, beta, C, ldc);
  const int64_t groups = pairs_of(K), panel_elems = groups * 2 * kPanel, panels = panels_of(N);
  const int64_t full_chunks = groups / 16, tail_pairs = groups % 16;  // the last chunk: tail_pairs pairs
  const int64_t blocks_k = std::max<int64_t>(1, (full_chunks * kChunk + kKBlock - 1) / kKBlock);
  const int64_t chunks_per_block = kKBlock / kChunk;
  const int64_t block_bytes = 2 * kPanel * std::min<int64_t>(2 * groups, kKBlock);
  const int64_t tile = std::max<int64_t>(2, (kTileBytes / block_bytes) & ~int64_t(1));
  const int64_t grain = std::max<int64_t>(2, kAmxGrain / (kPanel * K * rows));
  const bool beta_in_tiles = beta == 0 || beta == 1;
  // the last tile of rows' padded copy: 16 rows of every pair of k, whole chunks of 32 k, zeros past both
  const int64_t tail_ld = kChunk * ((2 * groups + kChunk - 1) / kChunk);
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float spill[kRows * 16];
    // padded copies: the last tile of rows (fewer than 16), the partial chunk's X and M
    thread_local std::vector<uint16_t> row_tail, x_tails, m_tails;
    const int64_t tail_rows = rows % kRows, full_rows = rows - tail_rows;
    if (tail_rows) {  // row by row: X's rows lie ld apart, and only the first 2 · groups values of each are read
      row_tail.assign(kRows * tail_ld, 0);
      for (int64_t r = 0; r < tail_rows; ++r)
        std::memcpy(row_tail.data() + r * tail_ld, x + (full_rows + r) * ld, 2 * groups * sizeof(uint16_t));
    }
    if (tail_pairs) {
      // M's last chunk of each panel, 16 pairs with zeros past the tail
      m_tails.assign((end - begin) * 16 * 2 * kPanel, 0);
      for (int64_t p = begin; p < end; ++p)
        std::memcpy(m_tails.data() + (p - begin) * 16 * 2 * kPanel, w + p * panel_elems + full_chunks * 16 * 2 * kPanel,
                    tail_pairs * 2 * kPanel * sizeof(uint16_t));
      x_tails.assign(2 * kRows * kChunk, 0);
    }
    configure();  // after the allocations above: an exception there leaves no tile state loaded
    for (int64_t t0 = begin; t0 < end; t0 += tile) {
      const int64_t t1 = std::min(end, t0 + tile);
      for (int64_t b = 0; b < blocks_k; ++b) {
        const int64_t c0 = b * chunks_per_block, c1 = std::min(full_chunks, c0 + chunks_per_block);
        const bool last = b == blocks_k - 1, tail = last && tail_pairs > 0;
        for (int64_t r0 = 0; r0 < rows; r0 += 2 * kRows) {
          const int mt = r0 + kRows < rows ? 2 : 1;
          XTile xt[2], xtail[2];
          for (int i = 0; i < mt; ++i) {
            const int64_t r = r0 + i * kRows;
            const bool partial = r >= full_rows;
            const uint16_t* src = partial ? row_tail.data() : x + r * ld;
            const int64_t src_ld = partial ? tail_ld : ld;
            xt[i] = XTile{src + c0 * kChunk, src_ld * 2};
            if (tail) {
              uint16_t* dest = x_tails.data() + i * kRows * kChunk;
              for (int64_t j = 0; j < kRows; ++j)
                std::memcpy(dest + j * kChunk, src + j * src_ld + full_chunks * kChunk, tail_pairs * 2 * sizeof(uint16_t));
              xtail[i] = XTile{dest, kChunk * 2};
            }
          }
          for (int64_t p = t0; p < t1; p += 2) {
            const int nt = p + 1 < t1 ? 2 : 1;
            const uint16_t* m[2] = {w + p * panel_elems + c0 * 16 * 2 * kPanel,
                                    w + (p + nt - 1) * panel_elems + c0 * 16 * 2 * kPanel};
            const uint16_t* mtail[2] = {nullptr, nullptr};
            if (tail) {
              mtail[0] = m_tails.data() + (p - begin) * 16 * 2 * kPanel;
              mtail[1] = m_tails.data() + (p + nt - 1 - begin) * 16 * 2 * kPanel;
            }
            CTile ct[2][2];
            for (int i = 0; i < 2; ++i)
              for (int j = 0; j < 2; ++j) {
                const int64_t r = r0 + i * kRows, n = kPanel * (p + j);
                ct[i][j] = CTile{C + r * ldc + n, ldc, int(std::min<int64_t>(kRows, std::max<int64_t>(0, rows - r))),
                                 int(std::min<int64_t>(16, std::max<int64_t>(0, N - n)))};
              }
            const bool load = b > 0 || (beta != 0 && beta_in_tiles);
            const float add = b > 0 || beta_in_tiles ? 0.0f : beta;
            if (mt == 2 && nt == 2) block<2, 2>(xt, xtail, m, mtail, c1 - c0, tail, ct, load, add, spill);
            else if (mt == 2) block<2, 1>(xt, xtail, m, mtail, c1 - c0, tail, ct, load, add, spill);
            else if (nt == 2) block<1, 2>(xt, xtail, m, mtail, c1 - c0, tail, ct, load, add, spill);
            else block<1, 1>(xt, xtail, m, mtail, c1 - c0, tail, ct, load, add, spill);
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx_bf16

#pragma GCC pop_options
#endif

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
namespace emulated_bf16 {  // vdpbf16ps's definition: acc += w_odd·x_odd, then += w_even·x_even, each rounded
inline __m512 dot(__m512 acc, __m512i w, __m512i x) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)), _mm512_castsi512_ps(_mm512_and_si512(x, high)),
                        acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                         acc);
}
RNNKIT_BF16_KERNEL_BODY
}  // namespace emulated_bf16
#pragma GCC pop_options

#undef RNNKIT_BF16_KERNEL_BODY

namespace {

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

#ifdef RNNKIT_AMX_BF16
bool has_amx_bf16() {  // AMX-BF16 (kernel_choice.h)
  static const bool yes = has_avx512_bf16() && amx_usable(22);
  return yes;
}
#endif

const Bf16Kernels kKernels[] = {
#ifdef RNNKIT_AMX_BF16
    {"amx-bf16", avx512_bf16::round, avx512_bf16::round_part, amx_bf16::rounded,
     avx512_bf16::pack_float_transposed, avx512_bf16::pack_transposed, has_amx_bf16, true},
#endif
    {"avx512-bf16", avx512_bf16::round, avx512_bf16::round_part, avx512_bf16::rounded,
     avx512_bf16::pack_float_transposed, avx512_bf16::pack_transposed, has_avx512_bf16, true},
    {"emulated-bf16", emulated_bf16::round, emulated_bf16::round_part, emulated_bf16::rounded,
     emulated_bf16::pack_float_transposed, emulated_bf16::pack_transposed, has_avx512, false},
    {"none", nullptr, nullptr, nullptr, nullptr, nullptr, runs_everywhere, true},
};

}  // namespace

#else

namespace {
const Bf16Kernels kKernels[] = {{"none", nullptr, nullptr, nullptr, nullptr, nullptr, runs_everywhere, true}};
}  // namespace

#endif

namespace {

// The kernels in use: the CPU's choice, or $RNNKIT_BF16_KERNEL's (read at the first use).
auto& choice() { return kernel_choice(kKernels, "RNNKIT_BF16_KERNEL", "bfloat16"); }

const Bf16Kernels& current() { return choice().current(); }

}  // namespace

const char* bf16_kernel() { return current().name; }

bool bf16_products() { return current().rounded != nullptr; }

std::vector<std::string> bf16_kernels() { return choice().names(); }

std::string set_bf16_kernel(const std::string& name) { return choice().set(name, "set_bf16_kernel"); }

namespace {

const Bf16Kernels& in_use() {
  const Bf16Kernels& k = current();
  TORCH_CHECK(k.rounded != nullptr, "rnnkit fused: no bfloat16 GEMM kernels here (bf16_kernel() is 'none')");
  return k;
}

// Rounded X up to this many bytes goes to a thread's own reused vector (the per-step products);
// larger (a weight gradient's dGᵀ, G·H rows of T·B) to the buffer cache, which keeps it between calls
// without holding it for good: a vector zero-filled and page-faulted anew on every call took 3% of a
// bfloat16 LSTM's training step (medium, Zen 4).
constexpr int64_t kThreadScratchBytes = int64_t(1) << 21;

void multiply(const float* X, int64_t rows, int64_t ldx, bool transposed, const uint16_t* packed, int64_t N,
              int64_t K, float beta, float* C, int64_t ldc) {
  if (rows <= 0 || N <= 0) return;
  const Bf16Kernels& k = in_use();
  if (K <= 0) return empty_sum(rows, N, beta, C, ldc);
  const int64_t ld = 2 * pairs_of(K);
  if (rows * ld * 2 > kThreadScratchBytes) {
    const Bf16RoundedX x = bf16_round(X, rows, ldx, transposed, K);
    return k.rounded(x.data, rows, ld, packed, N, K, beta, C, ldc);
  }
  thread_local std::vector<uint16_t> scratch;
  if (scratch.size() < size_t(rows * ld)) scratch.resize(rows * ld);
  k.round(X, rows, ldx, transposed, K, ld, scratch.data());
  k.rounded(scratch.data(), rows, ld, packed, N, K, beta, C, ldc);
}

}  // namespace

void bf16_gemm_packed(const float* X, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t N, int64_t K,
                      float beta, float* C, int64_t ldc) {
  multiply(X, rows, ldx, false, packed, N, K, beta, C, ldc);
}

void bf16_gemm_packed_t(const float* A, int64_t rows, int64_t lda, const uint16_t* packed, int64_t N, int64_t K,
                        float beta, float* C, int64_t ldc) {
  multiply(A, rows, lda, true, packed, N, K, beta, C, ldc);
}

Bf16RoundedX bf16_rounded_buffer(int64_t rows, int64_t K) {
  in_use();
  Bf16RoundedX x;
  x.rows = rows, x.K = K, x.ld = 2 * pairs_of(K);
  x.storage = cached_empty({std::max<int64_t>(1, rows * x.ld)}, at::kShort);
  uint16_t* out = reinterpret_cast<uint16_t*>(x.storage.data_ptr<int16_t>());
  if (poison_flag()) x.storage.fill_(-1);  // 0xffff, a bfloat16 NaN: what no rounding writes shows
  if (K < x.ld)
    for (int64_t r = 0; r < rows; ++r) std::fill(out + r * x.ld + K, out + (r + 1) * x.ld, uint16_t(0));
  x.data = out;
  return x;
}

Bf16RoundedX bf16_round(const float* X, int64_t rows, int64_t ldx, bool transposed, int64_t K) {
  Bf16RoundedX x = bf16_rounded_buffer(rows, K);  // the padding zeroed there
  if (rows > 0 && K > 0) in_use().round_part(X, rows, ldx, transposed, K, x.ld, const_cast<uint16_t*>(x.data));
  return x;
}

namespace {

std::atomic<int64_t>& round_parts() {
  static std::atomic<int64_t> count{0};
  return count;
}

}  // namespace

int64_t bf16_round_part_count() { return round_parts().load(std::memory_order_relaxed); }

void bf16_round_part(const float* X, int64_t rows, int64_t ldx, bool transposed, int64_t K, const Bf16RoundedX& out,
                     int64_t first_row, int64_t first_k) {
  round_parts().fetch_add(1, std::memory_order_relaxed);
  TORCH_CHECK(first_row >= 0 && first_k >= 0 && first_row + rows <= out.rows && first_k + K <= out.K,
              "rnnkit fused: bf16_round_part: [", rows, ", ", K, "] at (", first_row, ", ", first_k,
              ") outside a rounding of [", out.rows, ", ", out.K, "]");
  if (rows <= 0 || K <= 0) return;
  in_use().round_part(X, rows, ldx, transposed, K, out.ld, const_cast<uint16_t*>(out.data) + first_row * out.ld + first_k);
}

Bf16RoundedX bf16_rows_of(const Bf16RoundedX& X, int64_t first_row, int64_t rows) {
  TORCH_CHECK(first_row >= 0 && rows >= 0 && first_row + rows <= X.rows, "rnnkit fused: bf16_rows_of: rows [",
              first_row, ", ", first_row + rows, ") of ", X.rows);
  Bf16RoundedX part = X;
  part.data = X.data + first_row * X.ld, part.rows = rows;
  return part;
}

void bf16_gemm_rounded(const Bf16RoundedX& X, const uint16_t* packed, int64_t N, float beta, float* C, int64_t ldc) {
  if (X.rows <= 0 || N <= 0) return;
  const Bf16Kernels& k = in_use();
  if (X.K <= 0) return empty_sum(X.rows, N, beta, C, ldc);
  k.rounded(X.data, X.rows, X.ld, packed, N, X.K, beta, C, ldc);
}

void bf16_pack_transposed(const HalfRows& M, int64_t N, int64_t K, uint16_t* dest) {
  TORCH_CHECK(M.bf16, "rnnkit fused: bf16_pack_transposed takes bfloat16 rows");
  const Bf16Kernels& k = current();
  (k.pack_transposed ? k.pack_transposed : pack_transposed_loop)(static_cast<const uint16_t*>(M.data), M.ld, N, K, dest);
}

void bf16_pack_float_transposed(const float* M, int64_t ld, int64_t N, int64_t K, uint16_t* dest) {
  const Bf16Kernels& k = current();
  (k.pack_float_transposed ? k.pack_float_transposed : pack_float_transposed_loop)(M, ld, N, K, dest);
}

}  // namespace rnnkit
