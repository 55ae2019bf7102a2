// SIMD helpers every fused pass shares: vector loops over a run of values, row threading,
// and the fast float σ / tanh / exp the pointwise passes put every transcendental through.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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

// 1 / d for float vectors of finite, positive d: the hardware reciprocal estimate and one
// Newton step (≤ 2 ulp), several times cheaper than a vector division, which dominated the
// LSTM's pointwise pass. Falls back to the division where there is no estimate instruction.
inline at::vec::Vectorized<float> fast_reciprocal(const at::vec::Vectorized<float>& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(x, _mm512_fnmadd_ps(d, x, _mm512_set1_ps(2.f)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 x = _mm256_rcp_ps(d);
  return _mm256_mul_ps(x, _mm256_fnmadd_ps(d, x, _mm256_set1_ps(2.f)));
#else
  return at::vec::Vectorized<float>(1.f) / d;
#endif
}

// float exp(x), inline: x = n·ln2 + r (ln2 split in two for an exact reduction), exp(r) by
// Cephes' degree-7 polynomial (≤ 1 ulp on |r| ≤ ln2/2), 2ⁿ built in the exponent bits. x is
// clamped to [−87, 88] so 2ⁿ stays a normal float (min / max take the constant first: a NaN x
// passes through them and comes out NaN).
// Sleef's exp is an out-of-line call, and was 15% of a small LSTM's inference.
inline at::vec::Vectorized<float> fast_exp(const at::vec::Vectorized<float>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x0 = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-87.f), v));
  const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(1.44269504088896341f)));
  const __m512 fn = _mm512_cvtepi32_ps(n);
  __m512 x = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), x0);
  x = _mm512_fnmadd_ps(fn, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), x, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 x0 = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), v));
  const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(x0, _mm256_set1_ps(1.44269504088896341f)));
  const __m256 fn = _mm256_cvtepi32_ps(n);
  __m256 x = _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), x0);
  x = _mm256_fnmadd_ps(fn, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
#else
  return v.exp();
#endif
}

// float σ: 1 / (1 + exp(−x)); fast_exp's clamp keeps exp(−x) finite (σ(x ≤ −88) ≈ 6e-39).
// (An extra at::vec::minimum / maximum clamp here, NaN-propagating compare-and-blend, made the
// loop 4× slower as built with the default -mtune: measured 1.6 vs 0.3-0.5 ns per value.)
template <>
inline void sigmoid_inplace<float>(float* v, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  const Vec one(1.f);
  vec_loop<float>(n, [&](int64_t j, int64_t count) {
    vstore(fast_reciprocal(one + fast_exp(vload(v + j, count).neg())), v + j, count);
  });
}

// float tanh: sign(x) (1 − t) / (1 + t) with t = exp(−2|x|) (fast_exp above, the division by
// fast_reciprocal), and its Taylor series to x⁹ below |x| = 0.25 where 1 − t would cancel:
// ≤ 3e-7 relative error against float64 and ≤ 1 ulp near ±1 (tested in test_fused_cpu.py), about
// 3× faster than Sleef's tanhf_u10, which was 15% of a small LSTM's inference. (A rational
// approximation was faster still, but its few-ulp bias near ±1 compounded over long layer-norm
// sequences beyond the float32 reference's error.)
inline at::vec::Vectorized<float> fast_tanh(const at::vec::Vectorized<float>& x) {
  using Vec = at::vec::Vectorized<float>;
  const Vec one(1.f), ax = x.abs();
  const Vec t = fast_exp(ax * Vec(-2.f));
  const Vec far = (one - t) * fast_reciprocal(one + t);
  const Vec x2 = x * x;  // x − x³/3 + 2x⁵/15 − 17x⁷/315 + 62x⁹/2835
  Vec p = at::vec::fmadd(x2, Vec(62.f / 2835.f), Vec(-17.f / 315.f));
  p = at::vec::fmadd(x2, p, Vec(2.f / 15.f));
  p = at::vec::fmadd(x2, p, Vec(-1.f / 3.f));
  const Vec near = at::vec::fmadd(x * x2, p, x);
  const Vec signed_far = far | (x & Vec(-0.f));  // far ≥ 0 takes x's sign bit
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.25f), _CMP_LT_OQ), signed_far, near);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_blendv_ps(signed_far, near, _mm256_cmp_ps(ax, _mm256_set1_ps(0.25f), _CMP_LT_OQ));
#else
  return Vec::blendv(signed_far, near, ax < Vec(0.25f));
#endif
}

template <>
inline void tanh_inplace<float>(float* v, int64_t n) {
  vec_loop<float>(n, [&](int64_t j, int64_t count) { vstore(fast_tanh(vload(v + j, count)), v + j, count); });
}

// tanh of one SIMD vector as tanh_inplace computes it (float: fast_tanh; double: Sleef), for
// loops that fuse it with other pointwise work.
inline at::vec::Vectorized<float> vtanh(const at::vec::Vectorized<float>& x) { return fast_tanh(x); }
inline at::vec::Vectorized<double> vtanh(const at::vec::Vectorized<double>& x) { return x.tanh(); }

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

// The sum of a row's values through four SIMD accumulators (each lane sums n / (4·width)
// values: float32 rows of thousands of values keep float32 accuracy), `term(j, count)` giving
// the Vec of terms at j; the lanes are added in double.
template <typename scalar_t, typename F>
inline double vec_sum(int64_t n, const F& term) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t w = Vec::size();
  Vec s0(0), s1(0), s2(0), s3(0);
  int64_t j = 0;
  for (; j + 4 * w <= n; j += 4 * w) {
    s0 = s0 + term(j, w), s1 = s1 + term(j + w, w), s2 = s2 + term(j + 2 * w, w), s3 = s3 + term(j + 3 * w, w);
  }
  for (; j < n; j += w) s0 = s0 + term(j, std::min(w, n - j));
  return lane_sum<scalar_t>((s0 + s1) + (s2 + s3));
}

}  // namespace rnnkit
