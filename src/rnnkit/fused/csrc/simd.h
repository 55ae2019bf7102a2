// SIMD helpers every fused pass shares: vector loops over a run of values, row threading,
// and the fast float σ / tanh / exp the pointwise passes put every transcendental through.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The σ / tanh / exp of one vector, inlined into the loops that call them even where a loop's body
// is large enough that the compiler would call them instead (a layer-norm LSTM's cell loop: a call
// per vector, 3% of its int8 inference at small).
#if defined(__GNUC__)
#define RNNKIT_INLINE inline __attribute__((always_inline))
#else
#define RNNKIT_INLINE inline
#endif

namespace rnnkit {

// Pointwise work over the batch rows [0, B); threads only when a step has enough work.
template <typename F>
inline void for_rows(int64_t B, int64_t work_per_row, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, work_per_row));
  if (B <= grain) {
    fn(0, B);
  } else {
    at::parallel_for(0, B, grain, fn);
  }
}

// A run of n values as full SIMD vectors and one partial tail: body(j, count) with count ==
// Vec::size() except at the tail. vload / vstore read and write `count` lanes (the rest zero).
template <typename scalar_t, typename F>
inline void vec_loop(int64_t n, const F& body) {
  constexpr int64_t width = at::vec::Vectorized<scalar_t>::size();
  int64_t j = 0;
  for (; j + width <= n; j += width) body(j, width);
  if (j < n) body(j, n - j);
}

template <typename scalar_t>
inline at::vec::Vectorized<scalar_t> vload(const scalar_t* p, int64_t count) {
  using Vec = at::vec::Vectorized<scalar_t>;
  return count == Vec::size() ? Vec::loadu(p) : Vec::loadu(p, count);
}

template <typename scalar_t>
inline void vstore(const at::vec::Vectorized<scalar_t>& v, scalar_t* p, int64_t count) {
  if (count == at::vec::Vectorized<scalar_t>::size()) {
    v.store(p);
  } else {
    v.store(p, int(count));
  }
}

// `count` weights at p as float32 lanes (the others zero): float32 as they are, bfloat16 and
// float16 widened exactly (every such value is a float). How the kernels read the half-precision
// weights of a bfloat16 / float16 module: half the bytes of float32 from memory, float32 math.
inline at::vec::Vectorized<float> load_float(const float* p, int64_t count) { return vload(p, count); }

namespace detail {
template <typename half_t>
inline at::vec::Vectorized<float> widen_full(const half_t* p) {
  using Vec = at::vec::Vectorized<float>;
  constexpr bool bf16 = std::is_same<half_t, c10::BFloat16>::value;
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (bf16) return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  else return Vec(_mm512_cvtph_ps(raw));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (bf16) return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  else return Vec(_mm256_cvtph_ps(raw));  // F16C: every AVX2 CPU has it (build.py: -mf16c)
#else
  (void)bf16;
  float wide[Vec::size()];
  for (int64_t j = 0; j < Vec::size(); ++j) wide[j] = float(p[j]);
  return Vec::loadu(wide);
#endif
}
}  // namespace detail

template <typename half_t>
inline at::vec::Vectorized<float> load_float(const half_t* p, int64_t count) {
  constexpr int64_t width = at::vec::Vectorized<float>::size();
  if (count == width) return detail::widen_full(p);
  half_t tail[width] = {};  // zeros: widen to +0
  std::copy(p, p + count, tail);
  return detail::widen_full(tail);
}

template <typename scalar_t>
inline scalar_t sigmoid(scalar_t v) {
  return scalar_t(1) / (scalar_t(1) + std::exp(-v));
}

// In-place σ and tanh over a contiguous run: SIMD (Sleef, 1 ulp) where built for it; float has
// the faster specializations below. The pointwise passes put every transcendental through
// these; the rest of their loops is plain arithmetic the compiler vectorizes.
template <typename scalar_t>
inline void sigmoid_inplace(scalar_t* v, int64_t n) {
  using Vec = at::vec::Vectorized<scalar_t>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    (Vec(scalar_t(1)) / (Vec(scalar_t(1)) + Vec::loadu(v + j).neg().exp())).store(v + j);
  }
  for (; j < n; ++j) v[j] = sigmoid(v[j]);
}

template <typename scalar_t>
inline void tanh_inplace(scalar_t* v, int64_t n) {
  using Vec = at::vec::Vectorized<scalar_t>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) Vec::loadu(v + j).tanh().store(v + j);
  for (; j < n; ++j) v[j] = std::tanh(v[j]);
}

// Float σ and tanh, inline: one exp (exp_parts) and one division each, the division corrected
// once (s + rem / d) against what rounding took from its operands, carried as float pairs
// hi + lo. Against float64 over dense grids of [−30, 30]: σ 0.23-0.30 ulp on average, at most 1.5
// (torch's: 0.34-0.44, 2.5); tanh 0.24-0.25 on average, at most 0.8 (torch's: 0.24, 0.5). The
// earlier forms (a rounded exp, a reciprocal estimate with one Newton step, tanh's Taylor branch)
// averaged 0.6-0.8 ulp and were up to 5 ulp off (issue 18). Per value on one AVX2 core (EPYC):
// σ 0.54 ns, tanh 0.85 ns, against 0.43 and 0.77 for the earlier forms, about 1% of a small
// LSTM step. The arithmetic is written once on at::vec::Vectorized<float>, so AVX2 and AVX-512
// compute the same expressions; only the reciprocal estimate, the exponent-bit shift and the
// sign-bit blend are per instruction set.
using VecF = at::vec::Vectorized<float>;

// The hardware reciprocal estimate (AVX2 12 bits, AVX-512 14 bits): the correction step's 1 / d,
// whose error only scales the already tiny remainder.
inline VecF reciprocal_estimate(const VecF& d) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_rcp14_ps(d);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_rcp_ps(d);
#else
  return VecF(1.f) / d;
#endif
}

// 2ⁿ from k = n + 127 + 1.5·2²³ held in a float (exp_parts' rounding step): k's low mantissa bits
// are n + 127, which the shift moves into the exponent field (n in [−127, 127]; −127 gives +0).
inline VecF exponent_of(const VecF& k) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(k), 23));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(k), 23));
#else
  float lanes[VecF::size()];
  k.store(lanes);
  for (float& lane : lanes) {
    uint32_t bits;
    std::memcpy(&bits, &lane, sizeof bits);
    bits <<= 23;
    std::memcpy(&lane, &bits, sizeof bits);
  }
  return VecF::loadu(lanes);
#endif
}

// `if_negative` where x's sign bit is set, else `if_not`.
inline VecF select_negative(const VecF& x, const VecF& if_not, const VecF& if_negative) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(x)), if_not, if_negative);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_blendv_ps(if_not, if_negative, x);
#else
  return VecF::blendv(if_not, if_negative, x < VecF(0.f));  // −0 and NaN: either operand gives the same σ
#endif
}

// exp(y) = p · (1 + q + q_lo) for y in [−88, 88] (NaN y: NaN q): y = n·ln2 + r with |r| ≤ ln2/2
// (ln2 in two parts, the first exact times n), p = 2ⁿ, and q + q_lo = expm1(r) = r + r²·P(r): P a
// degree-4 minimax fit of float coefficients (q's relative error < 0.25 ulp; degree 5 cost 5%
// more time for 0.05 ulp), q_lo what q's rounding dropped.
struct ExpParts {
  VecF p, q, q_lo;
};

RNNKIT_INLINE ExpParts exp_parts(const VecF& y) {
  using at::vec::fmadd;
  using at::vec::fnmadd;
  const VecF shifter(12582912.f + 127.f);  // 1.5·2²³ + 127: the sum rounds y·log2(e) to a whole number
  const VecF k = fmadd(y, VecF(1.44269504088896341f), shifter);
  const VecF n = k - shifter;
  VecF r = fnmadd(n, VecF(0.693359375f), y);
  r = fnmadd(n, VecF(-2.12194440e-4f), r);
  const VecF r2 = r * r;
  VecF P = fmadd(VecF(1.38827285e-3f), r, VecF(8.36664066e-3f));
  P = fmadd(P, r, VecF(4.16673459e-2f));
  P = fmadd(P, r, VecF(1.66665435e-1f));
  P = fmadd(P, r, VecF(4.99999970e-1f));
  const VecF q = fmadd(P, r2, r);
  return {exponent_of(k), q, fmadd(P, r2, r - q)};  // r − q is exact (|r²P| < |r| / 5)
}

// float σ(x) = num / (1 + t) with t = exp(−|x|) ≤ 1 (num = 1, or t for x < 0: no overflow, and the
// sum's rounding error is (1 − d) + t exactly). σ(x ≥ 17.4) is exactly 1; σ(x ≤ −87.7) is 0 (2ⁿ
// at n = −127 is 0); NaN stays NaN (clamp_min's instruction passes a NaN second operand).
RNNKIT_INLINE VecF fast_sigmoid(const VecF& x) {
  using at::vec::fmadd;
  using at::vec::fnmadd;
  const VecF one(1.f);
  const ExpParts e = exp_parts(at::vec::clamp_min(x | VecF(-0.f), VecF(-88.f)));  // −|x|
  const VecF t = fmadd(e.p, e.q, e.p);
  const VecF d = one + t;
  const VecF d_lo = (one - d) + t;
  const VecF num = select_negative(x, one, t);
  const VecF s = num / d;
  return fmadd(fnmadd(d_lo, s, fnmadd(d, s, num)), reciprocal_estimate(d), s);
}

// float tanh(x) = sign(x) · w / (2 − w) with w = −expm1(−2|x|) = 1 − p(1 + q) ≥ 0: no cancellation
// anywhere (expm1, not 1 − exp), so one formula covers the whole range. w and 2 − w are float
// pairs; w's low part also keeps the p that 1 − p drops for n < −24, so |x| ≥ 9.02 gives exactly
// ±1 (−2|x| is clamped at −20, n = −29). The quotient is ≥ 0 and takes x's sign bit (±0 stay ±0).
// NaN stays NaN.
RNNKIT_INLINE VecF fast_tanh(const VecF& x) {
  using at::vec::fmadd;
  using at::vec::fnmadd;
  const VecF one(1.f), two(2.f);
  const ExpParts e = exp_parts(at::vec::clamp_min(x.abs() * VecF(-2.f), VecF(-20.f)));
  const VecF omp = one - e.p;
  const VecF w = fnmadd(e.p, e.q, omp);
  const VecF w_lo = fnmadd(e.p, e.q_lo, fnmadd(e.p, e.q, omp - w) + ((one - omp) - e.p));  // omp − w is exact
  const VecF d = two - w;
  const VecF d_lo = ((two - d) - w) - w_lo;  // Fast2Sum: w ≤ 1
  const VecF s0 = w / d;
  const VecF s = fmadd(fnmadd(d_lo, s0, fnmadd(d, s0, w) + w_lo), reciprocal_estimate(d), s0);  // tanh|x|
  return s | (x & VecF(-0.f));
}

// The quick forms for int8 inference, whose weights and inputs are quantized to about 1% (rnnkit.quantize):
// the same exp_parts and one division left uncorrected, ~40% fewer instructions than σ's and tanh's
// above (an int8 LSTM's pointwise pass is 18-25% of its time: 2-4% less time, medium, small and stream
// on Zen 4). Against float64 over the accuracy test's grid: σ within 2.3 ulp, tanh within 2.5, 0.34 and
// 0.25 on average (test_fused.py).
RNNKIT_INLINE VecF quick_sigmoid(const VecF& x) {
  const VecF one(1.f);
  const ExpParts e = exp_parts(at::vec::clamp_min(x | VecF(-0.f), VecF(-88.f)));  // −|x|
  const VecF t = at::vec::fmadd(e.p, e.q, e.p);
  return select_negative(x, one, t) / (one + t);
}

RNNKIT_INLINE VecF quick_tanh(const VecF& x) {
  const ExpParts e = exp_parts(at::vec::clamp_min(x.abs() * VecF(-2.f), VecF(-20.f)));
  const VecF w = at::vec::fnmadd(e.p, e.q, VecF(1.f) - e.p);  // −expm1(−2|x|)
  return (w / (VecF(2.f) - w)) | (x & VecF(-0.f));
}

template <>
inline void sigmoid_inplace<float>(float* v, int64_t n) {
  vec_loop<float>(n, [&](int64_t j, int64_t count) { vstore(fast_sigmoid(vload(v + j, count)), v + j, count); });
}

template <>
inline void tanh_inplace<float>(float* v, int64_t n) {
  vec_loop<float>(n, [&](int64_t j, int64_t count) { vstore(fast_tanh(vload(v + j, count)), v + j, count); });
}

// σ and tanh in place, the quick forms where `quick` (float only: float64 passes are never quantized).
template <typename scalar_t>
inline void sigmoid_inplace(scalar_t* v, int64_t n, bool quick) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (quick) {
      vec_loop<float>(n, [&](int64_t j, int64_t count) { vstore(quick_sigmoid(vload(v + j, count)), v + j, count); });
      return;
    }
  }
  sigmoid_inplace(v, n);
}

template <typename scalar_t>
inline void tanh_inplace(scalar_t* v, int64_t n, bool quick) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (quick) {
      vec_loop<float>(n, [&](int64_t j, int64_t count) { vstore(quick_tanh(vload(v + j, count)), v + j, count); });
      return;
    }
  }
  tanh_inplace(v, n);
}

// acc[j] += v[j] for j < n: a gradient summed into a row's accumulator as the row is written.
template <typename scalar_t>
inline void add_into(scalar_t* acc, const scalar_t* v, int64_t n) {
  vec_loop<scalar_t>(n, [&](int64_t j, int64_t count) { vstore(vload(acc + j, count) + vload(v + j, count), acc + j, count); });
}

// σ(v + add) or tanh(v + add) in place, the quick forms where `quick`: a bias added in the
// activation's own pass over the row rather than in one of its own (the same sum, rounded once,
// then the same activation). add null: sigmoid_inplace / tanh_inplace above.
enum class Activation { kSigmoid, kTanh };

template <Activation kind, typename scalar_t>
inline void activate_inplace(scalar_t* v, int64_t n, bool quick, const scalar_t* add) {
  constexpr bool sigmoid = kind == Activation::kSigmoid;
  if (add == nullptr) return sigmoid ? sigmoid_inplace(v, n, quick) : tanh_inplace(v, n, quick);
  if constexpr (std::is_same_v<scalar_t, float>) {
    const auto pass = [&](const auto& f) {
      vec_loop<float>(n, [&](int64_t j, int64_t count) { vstore(f(vload(v + j, count) + vload(add + j, count)), v + j, count); });
    };
    if (quick) {
      pass([](const VecF& x) {
        if constexpr (sigmoid) return quick_sigmoid(x); else return quick_tanh(x);
      });
    } else {
      pass([](const VecF& x) {
        if constexpr (sigmoid) return fast_sigmoid(x); else return fast_tanh(x);
      });
    }
  } else {
    for (int64_t j = 0; j < n; ++j) v[j] += add[j];
    activate_inplace<kind, scalar_t>(v, n, quick, nullptr);
  }
}

// tanh of one SIMD vector as tanh_inplace computes it (float: fast_tanh, or quick_tanh; double:
// Sleef), for loops that fuse it with other pointwise work.
RNNKIT_INLINE at::vec::Vectorized<float> vtanh(const at::vec::Vectorized<float>& x, bool quick = false) {
  return quick ? quick_tanh(x) : fast_tanh(x);
}
inline at::vec::Vectorized<double> vtanh(const at::vec::Vectorized<double>& x, bool = false) { return x.tanh(); }

// The lanes of v added in double.
template <typename scalar_t>
inline double lane_sum(const at::vec::Vectorized<scalar_t>& v) {
  constexpr int64_t w = at::vec::Vectorized<scalar_t>::size();
  scalar_t lanes[w];
  v.store(lanes);
  double total = 0;
  for (int64_t k = 0; k < w; ++k) total += double(lanes[k]);
  return total;
}

// Float lanes widened to double in registers and added as a tree: the scalar loop above is a
// chain of 16 dependent double adds (~64 cycles), three of them in each layer-norm row's
// statistics (13% of an int8 layer-norm LSTM's time at H = 128). The sum is the same up to the
// order of the double additions (exact unless the lanes' exponents lie ~29 apart).
#if defined(CPU_CAPABILITY_AVX512)
template <>
inline double lane_sum<float>(const at::vec::Vectorized<float>& v) {
  const __m512 x = v;
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}
#elif defined(CPU_CAPABILITY_AVX2)
template <>
inline double lane_sum<float>(const at::vec::Vectorized<float>& v) {
  const __m256 x = v;
  const __m256d s = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
  const __m128d t = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
  return _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
}
#endif

// How many values each SIMD lane adds in scalar_t before the lanes go into a double total: the
// float error of a lane's sum grows with its length (rows of 8192 floats summed in one run of
// four accumulators were up to 2.2 ulp off in rstd; in blocks, under 1 ulp, as short rows).
constexpr int64_t kLaneBlock = 16;

}  // namespace rnnkit
