// float32 GEMMs (fgemm.h): M packed into panels of 16 columns of C, [K][16] each, so one k of a
// panel is one 64-byte row that a zmm (or two ymm) loads; a block of panels times a few rows of X
// broadcasts each X value once per k against every panel of the block.
#include "fgemm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "kernel_choice.h"

#include <ATen/cpu/vec/vec.h>

// GCC's per-function targets (#pragma GCC target); clang ignores the pragma, so it builds "mkl" only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RNNKIT_F32_KERNELS 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace rnnkit {

namespace {

constexpr int64_t kPanel = 16;  // columns of C per panel

inline int64_t panels_of(int64_t N) { return (N + kPanel - 1) / kPanel; }

struct F32Kernels {
  const char* name;
  void (*packed)(const float* X, int64_t rows, int64_t ldx, const float* packed, int64_t N, int64_t K, float beta,
                 float* C, int64_t ldc);
  void (*strided)(const float* X, int64_t rows, int64_t ldx, int64_t xk, const float* w, int64_t panel_floats,
                  int64_t wk, int64_t N, int64_t K, float beta, float* C, int64_t ldc);
  bool (*runs_here)();
  bool automatic;  // chosen by "auto" when it runs here (the first such in kKernels' order)
  // The weight gradients on these kernels too (else MKL's): where their strided blocks were measured
  // faster than MKL (f32_own_weight_gradients)
  bool weight_gradients;
};

// dest[p][k][j] = value(16p + j, k) for n < N, zero for the padding columns.
template <typename Value>
void pack_panels(int64_t N, int64_t K, float* dest, const Value& value) {
  const int64_t panels = panels_of(N);
  at::parallel_for(0, panels, std::max<int64_t>(1, (int64_t(1) << 16) / (kPanel * std::max<int64_t>(K, 1))),
                   [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* panel = dest + p * K * kPanel;
      const int64_t width = std::min(kPanel, N - kPanel * p);
      value(panel, kPanel * p, width);
    }
  });
}

}  // namespace

int64_t f32_packed_floats(int64_t N, int64_t K) { return panels_of(N) * K * kPanel; }

void f32_pack(const float* M, int64_t ld, int64_t N, int64_t K, float* dest) {
  pack_panels(N, K, dest, [&](float* panel, int64_t n0, int64_t width) {
    if (width < kPanel) std::memset(panel, 0, K * kPanel * sizeof(float));
#if defined(CPU_CAPABILITY_AVX512)
    // 16 × 16 blocks transposed in zmm registers (ATen's; masked stores leave the padding's zeros):
    // 4096 × 1024 in 2.3 ms against the loop's 2.7 on Zen 4
    at::vec::transpose_mxn<float>(M + n0 * ld, ld, panel, kPanel, int(width), int(K));
#else
    constexpr int64_t kSpan = 64;  // k per span: its 4 KB of the panel stay in L1 while 16 rows fill it
    for (int64_t k0 = 0; k0 < K; k0 += kSpan) {
      const int64_t k1 = std::min(K, k0 + kSpan);
      for (int64_t j = 0; j < width; ++j) {  // row n0 + j of M, read in order, into column j
        const float* m = M + (n0 + j) * ld;
        for (int64_t k = k0; k < k1; ++k) panel[k * kPanel + j] = m[k];
      }
    }
#endif
  });
}

void f32_pack_transposed(const float* M, int64_t ld, int64_t N, int64_t K, float* dest) {
  // Row by row of M, each read once in order, its 16-float pieces to row k of every panel: panel
  // by panel instead (64 bytes a row at M's row stride) packed a weight gradient's dG [3200, 1024]
  // at half the speed, a page of M a piece (Zen 4)
  const int64_t panels = panels_of(N), whole = N / kPanel, tail = N - whole * kPanel;
  at::parallel_for(0, K, std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(N, 1)), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const float* m = M + k * ld;
      float* out = dest + k * kPanel;
      using Vec = at::vec::Vectorized<float>;  // vector moves: a memcpy (or a copy loop, which the compiler
      for (int64_t p = 0; p < whole; ++p)       // makes one) is a call a 64-byte piece
        for (int64_t j = 0; j < kPanel; j += Vec::size()) Vec::loadu(m + p * kPanel + j).store(out + p * K * kPanel + j);
      if (tail > 0) {
        float* last = out + (panels - 1) * K * kPanel;
        std::memcpy(last, m + whole * kPanel, tail * sizeof(float));
        std::memset(last + tail, 0, (kPanel - tail) * sizeof(float));
      }
    }
  });
}

#if defined(RNNKIT_F32_KERNELS)

namespace {

constexpr int64_t kGrain = 1 << 16;      // multiply-adds per thread, at least
constexpr int64_t kTileBytes = 1 << 18;  // bytes of packed M per N tile: stays in L2 while every X row block passes
constexpr int64_t kDepth = 512;          // k per pass over C: a block's panels stay in L1 / L2 across its rows
constexpr int64_t kAhead = 24;           // strided blocks: X's column prefetched this many k ahead

// Row blocks per chunk of a product on packed panels (drive<false>): all of them for one pass over
// K; for more (K > kDepth), chunks whose C over one tile of panels fills ~kTileBytes, each chunk
// taking its tiles one at a time through every pass over K. So C stays in L2 across the passes,
// where taking every row through one pass before the next read and wrote all of C once per pass.
// The sums are the same, in the same order: each C value adds its K in passes from the first to the
// last. M is read once per chunk, X once per tile. Measured (GFLOP/s, AMD EPYC Zen 4, 1 thread, the other order -> this one):
// a backward's dx = dA · W, 6400 x 2048 x 512 (fastrnns) 100-103 -> 113, 3200 x 1024 x 256 (medium)
// 101-108 -> 111-112, 800 x 4096 x 1024 (wide) 110-113 -> 113; a wide forward's chunk W·x, 128 x
// 1024 x 4096, 106-113 -> 111. The weight gradients' strided products (drive<true>) keep the passes
// over K outermost: there X is the larger operand, one pass's slice of it reused across the tiles,
// and this order measured 10-20% slower on them (fastrnns dW, dR).
inline int64_t chunk_blocks(int64_t blocks, int64_t K, int64_t depth_step, int64_t tile_panels, int64_t xr) {
  if (K <= depth_step) return std::max<int64_t>(1, blocks);
  const int64_t block_bytes = xr * kPanel * tile_panels * int64_t(sizeof(float));
  return std::max<int64_t>(1, std::min(blocks, kTileBytes / block_bytes));
}

}  // namespace

// The kernels, once per instruction set: V (kLanes floats), vzero, vload, vbroadcast, vfmadd,
// vstore. A block is NR panels x XR rows: NR * kVecs vectors of M per k, XR broadcasts of X.
#define RNNKIT_F32_KERNEL_BODY                                                                                   \
  constexpr int kVecs = int(kPanel / kLanes); /* vectors per panel */                                         \
                                                                                                               \
  /* C[XR rows, NR panels (the last cut at `width`)] (+)= X[XR rows, depth] · the panels' depth rows.  \
     Packed (S false): X's k at unit stride, a panel's k at kPanel floats. Strided (S true): X's k   \
     at xk floats, a panel's k at wk (the weight gradients, read in place).                         */ \
  template <int NR, int XR, bool S>                                                                            \
  void block(const float* x, int64_t ldx, int64_t xk, const float* w, int64_t panel_floats, int64_t wk,        \
             int64_t depth, int64_t width, float beta, float* C, int64_t ldc) {                                \
    /* Every loop over XR and NR unrolled (RNNKIT_UNROLL): with the accumulators indexed by constants          \
       they stay in registers, where GCC otherwise kept them in a stack array across the k loop. */            \
    V acc[XR][NR * kVecs];                                                                                     \
    RNNKIT_UNROLL for (int r = 0; r < XR; ++r)                                                                 \
      RNNKIT_UNROLL for (int i = 0; i < NR * kVecs; ++i) acc[r][i] = vzero();                                  \
    for (int64_t k = 0; k < depth; ++k) {                                                                      \
      V wv[NR * kVecs];                                                                                        \
      const float* wk_row = w + k * (S ? wk : kPanel);                                                         \
      for (int i = 0; i < NR * kVecs; ++i) wv[i] = vload(wk_row + (i / kVecs) * panel_floats + (i % kVecs) * kLanes); \
      const float* xk_col = x + k * (S ? xk : 1);                                                              \
      if (S) _mm_prefetch(reinterpret_cast<const char*>(xk_col + kAhead * xk), _MM_HINT_T0);                   \
      for (int r = 0; r < XR; ++r) {                                                                           \
        const V xb = vbroadcast(xk_col + r * ldx);                                                             \
        for (int i = 0; i < NR * kVecs; ++i) acc[r][i] = vfmadd(wv[i], xb, acc[r][i]);                         \
      }                                                                                                        \
    }                                                                                                          \
    RNNKIT_UNROLL for (int r = 0; r < XR; ++r) {                                                               \
      float* c = C + r * ldc;                                                                                  \
      RNNKIT_UNROLL for (int i = 0; i < NR * kVecs; ++i) {                                                     \
        const int64_t n = kLanes * i;                                                                          \
        if (n >= width) continue;                                                                              \
        vstore(c + n, std::min<int64_t>(kLanes, width - n), acc[r][i], beta);                                  \
      }                                                                                                        \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  template <int NR, bool S>                                                                                    \
  void rows_of(int64_t xr, const float* x, int64_t ldx, int64_t xk, const float* w, int64_t panel_floats,      \
               int64_t wk, int64_t depth, int64_t width, float beta, float* C, int64_t ldc) {                  \
    static_assert(kXR == 6, "rows_of covers 1..6 rows");                                                       \
    switch (xr) {                                                                                              \
      case 1: return block<NR, 1, S>(x, ldx, xk, w, panel_floats, wk, depth, width, beta, C, ldc);             \
      case 2: return block<NR, 2, S>(x, ldx, xk, w, panel_floats, wk, depth, width, beta, C, ldc);             \
      case 3: return block<NR, 3, S>(x, ldx, xk, w, panel_floats, wk, depth, width, beta, C, ldc);             \
      case 4: return block<NR, 4, S>(x, ldx, xk, w, panel_floats, wk, depth, width, beta, C, ldc);             \
      case 5: return block<NR, 5, S>(x, ldx, xk, w, panel_floats, wk, depth, width, beta, C, ldc);             \
      default: return block<NR, 6, S>(x, ldx, xk, w, panel_floats, wk, depth, width, beta, C, ldc);            \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  /* C[rows, N] (+)= X · M over K: X's (r, k) at X + r·ldx + k·xk, M's (n, k) at panel n / 16's        \
     w + (n / 16)·panel_floats + k·wk + n % 16 (S false: xk 1, wk kPanel). */                                  \
  template <bool S>                                                                                            \
  void drive(const float* X, int64_t rows, int64_t ldx, int64_t xk, const float* w, int64_t panel_floats,      \
             int64_t wk, int64_t N, int64_t K, float beta, float* C, int64_t ldc) {                            \
    const int64_t panels = panels_of(N);                                                                       \
    const int64_t blocks = (rows + kXR - 1) / kXR;                                                             \
    const int64_t depth_step = std::min(K, kDepth);                                                            \
    const int64_t tile = std::max<int64_t>(kNR, kTileBytes / (int64_t(sizeof(float)) * kPanel * depth_step));  \
    const int64_t grain = std::max<int64_t>(1, kGrain / (kPanel * K * rows));                                  \
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {                                       \
      const int64_t chunk = S ? blocks : chunk_blocks(blocks, K, depth_step, std::min(tile, end - begin), kXR);  \
      auto pass = [&](int64_t c0, int64_t c1, int64_t k0, int64_t t0, int64_t t1) {                            \
        const int64_t depth = std::min(depth_step, K - k0);                                                    \
        const float b = k0 == 0 ? beta : 1.0f;                                                                 \
        for (int64_t i = c0; i < c1; ++i) {                                                                    \
          int64_t r0, xr;                                                                                      \
          row_block(rows, blocks, i, r0, xr);                                                                  \
          for (int64_t p = t0; p < t1; p += kNR) {                                                             \
            const int64_t np = std::min<int64_t>(kNR, t1 - p);                                                 \
            const int64_t n = kPanel * p, width = std::min(kPanel * np, N - n);                                \
            const float* x = X + r0 * ldx + k0 * (S ? xk : 1);                                                 \
            const float* wp = w + p * panel_floats + k0 * (S ? wk : kPanel);                                   \
            float* c = C + r0 * ldc + n;                                                                       \
            switch (np) {                                                                                      \
              case 1: rows_of<1, S>(xr, x, ldx, xk, wp, panel_floats, wk, depth, width, b, c, ldc); break;     \
              case 2: rows_of<kNR < 2 ? 1 : 2, S>(xr, x, ldx, xk, wp, panel_floats, wk, depth, width, b, c, ldc); break; \
              case 3: rows_of<kNR < 3 ? 1 : 3, S>(xr, x, ldx, xk, wp, panel_floats, wk, depth, width, b, c, ldc); break; \
              default: rows_of<kNR, S>(xr, x, ldx, xk, wp, panel_floats, wk, depth, width, b, c, ldc); break;   \
            }                                                                                                  \
          }                                                                                                    \
        }                                                                                                      \
      };                                                                                                       \
      for (int64_t c0 = 0; c0 < blocks; c0 += chunk) {                                                         \
        const int64_t c1 = std::min(blocks, c0 + chunk);                                                       \
        if (!S) { /* chunk_blocks: one tile through every pass over K, then the next */                  \
          for (int64_t t0 = begin; t0 < end; t0 += tile)                                                       \
            for (int64_t k0 = 0; k0 < K; k0 += depth_step) pass(c0, c1, k0, t0, std::min(end, t0 + tile));     \
        } else {                                                                                               \
          for (int64_t k0 = 0; k0 < K; k0 += depth_step)                                                       \
            for (int64_t t0 = begin; t0 < end; t0 += tile) pass(c0, c1, k0, t0, std::min(end, t0 + tile));     \
        }                                                                                                      \
      }                                                                                                        \
    });                                                                                                        \
  }                                                                                                            \
                                                                                                               \
  void packed(const float* X, int64_t rows, int64_t ldx, const float* w, int64_t N, int64_t K, float beta,      \
              float* C, int64_t ldc) {                                                                         \
    drive<false>(X, rows, ldx, 1, w, K * kPanel, kPanel, N, K, beta, C, ldc);                                  \
  }                                                                                                            \
                                                                                                               \
  void strided(const float* X, int64_t rows, int64_t ldx, int64_t xk, const float* w, int64_t panel_floats,    \
               int64_t wk, int64_t N, int64_t K, float beta, float* C, int64_t ldc) {                          \
    drive<true>(X, rows, ldx, xk, w, panel_floats, wk, N, K, beta, C, ldc);                                    \
  }

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {  // 32 zmm: 4 panels x 6 rows of sums
using V = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t kNR = 4, kXR = 6;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* c, int64_t count, V v, float beta) {
  const __mmask16 m = count == kLanes ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  if (beta != 0) v = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m, c), v);
  _mm512_mask_storeu_ps(c, m, v);
}
RNNKIT_F32_KERNEL_BODY
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {  // 16 ymm: 1 panel (2 ymm) x 6 rows of sums
using V = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t kNR = 1, kXR = 6;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* c, int64_t count, V v, float beta) {
  if (count == kLanes) {
    if (beta != 0) v = _mm256_fmadd_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(c), v);
    _mm256_storeu_ps(c, v);
    return;
  }
  alignas(32) float part[kLanes];
  _mm256_store_ps(part, v);
  for (int64_t j = 0; j < count; ++j) c[j] = beta == 0 ? part[j] : part[j] + beta * c[j];
}
RNNKIT_F32_KERNEL_BODY
}  // namespace avx2
#pragma GCC pop_options

#undef RNNKIT_F32_KERNEL_BODY

namespace {

bool has_avx512() { return __builtin_cpu_supports("avx512f"); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// Where MKL's sgemm takes a pass's weight gradients faster than the own strided blocks: Intel's
// CPUs, MKL's vendor's (GFLOP/s, 1 thread, the grid's dW / dR, benchmarks/fp32_gemm.py
// --weight-gradients: Emerald Rapids MKL 122-156, own 69-151; Zen 4 own 100-113, MKL 83-96: MKL
// takes slower code paths on other vendors' CPUs).
bool mkl_weight_gradients_faster() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
  return std::strcmp(vendor, "GenuineIntel") == 0;
}

const F32Kernels kKernels[] = {
    {"avx512-mkl", avx512::packed, avx512::strided, has_avx512, mkl_weight_gradients_faster(), false},
    {"avx512", avx512::packed, avx512::strided, has_avx512, true, true},
    {"avx2", avx2::packed, avx2::strided, has_avx2, true, false},
    {"mkl", nullptr, nullptr, runs_everywhere, true, false},
};

}  // namespace

#else

namespace {
const F32Kernels kKernels[] = {{"mkl", nullptr, nullptr, runs_everywhere, true, false}};
}  // namespace

#endif

namespace {

auto& choice() { return kernel_choice(kKernels, "RNNKIT_FP32_GEMM", "float32"); }

const F32Kernels& current() { return choice().current(); }

// The kernels that multiply by panels already packed: the choice in use; or, where it changed to
// "mkl" since they were packed (another thread's use_fp32_gemm), the first own kernel that runs
// here (every own kernel reads the same panels).
const F32Kernels& panels_kernel(const char* caller) {
  const F32Kernels* k = &current();
  for (const F32Kernels& other : kKernels)
    if (k->packed == nullptr && other.packed != nullptr && other.runs_here()) k = &other;
  TORCH_CHECK(k->packed != nullptr, "rnnkit fused: ", caller, ": no own float32 kernels run on this CPU");
  return *k;
}

std::atomic<int64_t>& products() {
  static std::atomic<int64_t> count{0};
  return count;
}

}  // namespace

const char* f32_kernel() { return current().name; }

bool f32_own_products() { return current().packed != nullptr; }

bool f32_own_weight_gradients() { return f32_own_products() && current().weight_gradients; }

std::vector<std::string> f32_kernels() { return choice().names(); }

std::string set_f32_kernel(const std::string& name) { return choice().set(name, "set_fp32_gemm"); }

void f32_gemm_packed(const float* X, int64_t rows, int64_t ldx, const float* packed, int64_t N, int64_t K, float beta,
                     float* C, int64_t ldc) {
  if (rows <= 0 || N <= 0) return;
  const F32Kernels& k = panels_kernel("f32_gemm_packed");
  if (K <= 0) return empty_sum(rows, N, beta, C, ldc);
  k.packed(X, rows, ldx, packed, N, K, beta, C, ldc);
  products().fetch_add(1, std::memory_order_relaxed);
}

void f32_gemm_packed_xt(const float* Xt, int64_t ldxt, int64_t rows, const float* packed, int64_t N, int64_t K,
                        float beta, float* C, int64_t ldc) {
  if (rows <= 0 || N <= 0) return;
  const F32Kernels& k = panels_kernel("f32_gemm_packed_xt");
  if (K <= 0) return empty_sum(rows, N, beta, C, ldc);
  // X's (r, k) is Xt[k, r]: row stride 1, k stride ldxt; the panels as f32_gemm_packed reads them
  k.strided(Xt, rows, 1, ldxt, packed, K * kPanel, kPanel, N, K, beta, C, ldc);
  products().fetch_add(1, std::memory_order_relaxed);
}

void f32_transpose(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dest, int64_t ld_dest) {
  // strips of 16 rows of src, each into 16 columns of dest in 16 x 16 blocks
  const int64_t strips = (rows + kPanel - 1) / kPanel;
  at::parallel_for(0, strips, std::max<int64_t>(1, (int64_t(1) << 16) / (kPanel * std::max<int64_t>(cols, 1))),
                   [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t r0 = s * kPanel, height = std::min(kPanel, rows - r0);
      // in zmm registers under AVX-512 (ATen's), a loop elsewhere
      at::vec::transpose_mxn<float>(src + r0 * ld_src, ld_src, dest + r0, ld_dest, int(height), int(cols));
    }
  });
}

bool f32_at_b_in_place(int64_t rows, int64_t N) {
  // Measured on Zen 4 (1 thread, GFLOP/s own / MKL, benchmarks/fp32_gemm.py --weight-gradients):
  // the stream and small grid shapes' 102-112 / 83-93, [1600, 1024] by [1600, 256] 100 / 89; from
  // medium's A [3200, 1024] on 82-92 / 90-96, where MKL's copies into its panels pay off.
  constexpr int64_t kInPlaceFloats = int64_t(1) << 21;
  return f32_own_weight_gradients() && rows * N <= kInPlaceFloats;
}

void f32_gemm_at_b(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t rows, int64_t N, int64_t K,
                   float* C, int64_t ldc) {
  if (N <= 0 || K <= 0) return;
  const F32Kernels& k = current();
  TORCH_CHECK(k.strided != nullptr, "rnnkit fused: f32_gemm_at_b: the float32 GEMM in use is MKL's");
  if (rows <= 0) return empty_sum(N, K, 0, C, ldc);
  // Aᵀ's (n, r) is A[r, n]: the X operand at row stride 1 and k stride lda. B's whole panels are
  // read in place (16 columns of a row, k stride ldb); the columns past the last whole panel are
  // copied into one zero-padded panel, since a panel's loads read all 16 columns.
  const int64_t whole = K / kPanel * kPanel;
  if (whole > 0) k.strided(A, N, 1, lda, B, kPanel, ldb, whole, rows, 0, C, ldc);
  if (whole < K) {
    const int64_t tail = K - whole;
    std::vector<float> panel(size_t(f32_packed_floats(tail, rows)));
    f32_pack_transposed(B + whole, ldb, tail, rows, panel.data());
    k.strided(A, N, 1, lda, panel.data(), rows * kPanel, kPanel, tail, rows, 0, C + whole, ldc);
  }
  products().fetch_add(1, std::memory_order_relaxed);
}

int64_t f32_gemm_count() { return products().load(std::memory_order_relaxed); }

}  // namespace rnnkit
