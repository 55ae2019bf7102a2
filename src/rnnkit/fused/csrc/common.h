// Pieces every fused CPU pass shares: the argument pack, buffers, BLAS, layer norm, threading.
//
// Layout of every pass (SPEC.md): x [T, B, I], h [B, Hr], c [B, H], gates stacked along the
// feature axis in SPEC.md's order. All matrices are row-major and contiguous.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include <cmath>
#include <optional>
#include <vector>

namespace rnnkit {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr double kLayerNormEps = 1e-5;

// Tests set this to fill every buffer the kernels allocate with NaN, so a value that is read
// before it is written shows up as a NaN in the outputs or gradients.
bool& poison_flag();

// Uninitialized, from the cache of freed large buffers (module.cpp) when at least 256 KB.
Tensor cached_empty(at::IntArrayRef sizes, const Tensor& like);
// a · b into a buffer from that cache (the weight gradients: freed again once copied out).
Tensor mm_cached(const Tensor& a, const Tensor& b);

// A buffer that is always fully written before it is read (NaN-filled under poison_flag()).
Tensor new_buffer(at::IntArrayRef sizes, const Tensor& like);
// A buffer that must start at zero (accumulators).
Tensor zero_buffer(at::IntArrayRef sizes, const Tensor& like);

// The right operand of the per-step GEMMs, packed once per pass into BLAS's internal layout
// (MKL's packed GEMM) so that T steps do not re-pack the same weights T times:
// row-major C[rows, N] = X[rows, K] · op(M) + beta · C, op(M) = Mᵀ when `trans`.
template <typename scalar_t>
class PackedRight {
 public:
  PackedRight(const scalar_t* M, int64_t ldm, bool trans, int64_t rows, int64_t N, int64_t K, const Tensor& like);
  void multiply(const scalar_t* X, int64_t ldx, scalar_t beta, scalar_t* C, int64_t ldc) const;

 private:
  Tensor storage_;
  int64_t rows_, N_, K_, ldm_;
  const scalar_t* matrix_;
  bool trans_;
};

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

// γ ∘ (v − mean) · rstd + β for the `count` values at j: the one expression (and rounding order)
// every layer-norm apply uses, forward and recomputed.
template <typename scalar_t>
inline at::vec::Vectorized<scalar_t> layer_norm_apply(const at::vec::Vectorized<scalar_t>& v,
                                                      const at::vec::Vectorized<scalar_t>& mean,
                                                      const at::vec::Vectorized<scalar_t>& rstd, const scalar_t* gain,
                                                      const scalar_t* shift, int64_t j, int64_t count) {
  return at::vec::fmadd((v - mean) * rstd, vload(gain + j, count), vload(shift + j, count));
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

// Mean and 1/sqrt(var + eps) of one row (biased variance), two passes (the second sums
// squared deviations from the mean, so no cancellation).
template <typename scalar_t>
inline void row_stats(const scalar_t* v, int64_t n, scalar_t& mean, scalar_t& rstd) {
  using Vec = at::vec::Vectorized<scalar_t>;
  const double m = vec_sum<scalar_t>(n, [&](int64_t j, int64_t c) { return vload(v + j, c); }) / double(n);
  const Vec vm = Vec(scalar_t(m));
  const double sq = vec_sum<scalar_t>(n, [&](int64_t j, int64_t c) {
    const Vec d = vload(v + j, c) - vm;
    return c == Vec::size() ? d * d : Vec::set(Vec(0), d * d, c);  // the tail's unread lanes stay 0
  });
  mean = scalar_t(m);
  rstd = scalar_t(1.0 / std::sqrt(sq / double(n) + kLayerNormEps));
}

// LN backward of one row: given dout (grad of γ·x̂ + β) and the raw input v, writes dv and
// accumulates dγ, dβ. dout and dv may alias. Two passes: the sums (with dγ, dβ), then dv.
template <typename scalar_t>
inline void row_layer_norm_backward(const scalar_t* dout, const scalar_t* v, int64_t n, scalar_t mean,
                                    scalar_t rstd, const scalar_t* gain, scalar_t* dv, scalar_t* dgain,
                                    scalar_t* dshift) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t w = Vec::size();
  const Vec vm(mean), vr(rstd);
  // vload zero-fills a tail's unread lanes: there d = 0, so dxh and dxh·x̂ add nothing.
  Vec s_dxh0(0), s_dxh1(0), s_x0(0), s_x1(0);
  int64_t j = 0;
  auto pass = [&](int64_t k, int64_t c, Vec& s_dxh, Vec& s_x) {
    const Vec d = vload(dout + k, c), xh = (vload(v + k, c) - vm) * vr, dxh = d * vload(gain + k, c);
    s_dxh = s_dxh + dxh, s_x = at::vec::fmadd(dxh, xh, s_x);
    vstore(at::vec::fmadd(d, xh, vload(dgain + k, c)), dgain + k, c);
    vstore(vload(dshift + k, c) + d, dshift + k, c);
  };
  for (; j + 2 * w <= n; j += 2 * w) pass(j, w, s_dxh0, s_x0), pass(j + w, w, s_dxh1, s_x1);
  for (; j < n; j += w) pass(j, std::min(w, n - j), s_dxh0, s_x0);
  const Vec mean_dxh(scalar_t(lane_sum<scalar_t>(s_dxh0 + s_dxh1) / double(n)));
  const Vec mean_dxh_xh(scalar_t(lane_sum<scalar_t>(s_x0 + s_x1) / double(n)));
  vec_loop<scalar_t>(n, [&](int64_t k, int64_t c) {
    const Vec xh = (vload(v + k, c) - vm) * vr, dxh = vload(dout + k, c) * vload(gain + k, c);
    vstore(vr * (dxh - mean_dxh - xh * mean_dxh_xh), dv + k, c);
  });
}

// Zoneout keep-old coefficient d at (t, b): the training indicators [T, B, n], the
// evaluation probability p, or 0 when off.
template <typename scalar_t>
struct Zoneout {
  const scalar_t* d = nullptr;  // [T, B, n] or null
  scalar_t p = 0;
  int64_t B = 0, n = 0;
  bool on() const { return d != nullptr || p != 0; }
  // Row pointer, or null when the coefficient is the constant p.
  const scalar_t* row(int64_t t, int64_t b) const { return d ? d + (t * B + b) * n : nullptr; }
};

// Everything one layer-direction pass receives, unpacked once (see launcher.py for the order).
struct PassArgs {
  Tensor x, h0, c0, W, R, b_W, b_R, W_hr, peephole;
  Tensor ln_x_gain, ln_x_shift, ln_h_gain, ln_h_shift, ln_c_gain, ln_c_shift;
  Tensor step_mask, recurrent_mask, zoneout_h, zoneout_c;
  double cell_clip = 0, proj_clip = 0, zoneout_h_p = 0, zoneout_c_p = 0;
  bool reverse = false, coupled = false, reset_after = true, relu = false;
  int64_t T = 0, B = 0, I = 0, H = 0, Hr = 0, GH = 0;

  PassArgs(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars);
  bool layer_norm() const { return ln_h_gain.defined(); }
  // Step t of row b runs (not past the sequence's length).
  const bool* mask_ptr() const { return step_mask.defined() ? step_mask.data_ptr<bool>() : nullptr; }
  template <typename scalar_t>
  Zoneout<scalar_t> zone_h() const {
    return make_zone<scalar_t>(zoneout_h, zoneout_h_p, Hr);
  }
  template <typename scalar_t>
  Zoneout<scalar_t> zone_c() const {
    return make_zone<scalar_t>(zoneout_c, zoneout_c_p, H);
  }

 private:
  template <typename scalar_t>
  Zoneout<scalar_t> make_zone(const Tensor& d, double p, int64_t n) const {
    Zoneout<scalar_t> z;
    z.d = d.defined() ? d.data_ptr<scalar_t>() : nullptr;
    z.p = scalar_t(p);
    z.B = B;
    z.n = n;
    return z;
  }
};

// h entering each step [T, B, Hr], rebuilt by a backward from the pass's output y and h0 (so
// the forward saves no copy of it): the previous step's y where that step ran for the row,
// else h0 (the reverse direction starts at each sequence's length from h0).
template <typename scalar_t>
Tensor hidden_entering(const PassArgs& a, const Tensor& y) {
  const int64_t T = a.T, B = a.B, n = y.size(2);
  Tensor out = new_buffer({T, B, n}, a.x);
  const scalar_t *y_p = y.data_ptr<scalar_t>(), *h0_p = a.h0.data_ptr<scalar_t>();
  const bool* mask = a.mask_ptr();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t prev = a.reverse ? t + 1 : t - 1;
      for (int64_t b = 0; b < B; ++b) {
        const bool ran = prev >= 0 && prev < T && (mask == nullptr || mask[prev * B + b]);
        const scalar_t* src = ran ? y_p + (prev * B + b) * n : h0_p + b * n;
        std::copy(src, src + n, o + (t * B + b) * n);
      }
    }
  });
  return out;
}

// The input projection LN_x(W x) + bias of the steps a forward loop runs, computed a chunk of
// steps at a time just before the loop reaches them, so the rows each step reads are still in
// cache (one projection of all T steps up front left them in memory: a small layer-norm LSTM
// ran 10% slower). Training writes the chunks into one [T·B, G·H] buffer the backward reads
// (the LSTM overwrites it with its gates) and, with layer norm, keeps the raw W x and its row
// statistics; inference reuses one chunk buffer, so its memory does not grow with T.
class InputSteps {
 public:
  InputSteps(const PassArgs& a, const Tensor& bias, bool training, Tensor& raw, Tensor& mean, Tensor& rstd);
  // The [B, G·H] rows of time step t, the s-th step the loop runs (s = 0, 1, ... in order).
  template <typename scalar_t>
  scalar_t* step(int64_t s, int64_t t) {
    if (s % chunk_steps_ == 0) compute_chunk(s);
    return out_.data_ptr<scalar_t>() + (training_ ? t : t - first_) * a_.B * a_.GH;
  }
  // Training: the whole [T·B, G·H] projection, complete once the loop has run every step.
  const Tensor& all() const { return out_; }

 private:
  void compute_chunk(int64_t s);
  const PassArgs& a_;
  bool training_;
  Tensor bias_, out_, raw_, mean_, rstd_;
  int64_t chunk_steps_ = 1, first_ = 0;
};

// Backward of the input projection from dA [T·B, G·H] (the gradient of its output):
// returns dx (undefined unless need_dx), dW, d ln_x gain, d ln_x shift (undefined without LN).
// With layer norm, dA is overwritten with the gradient of W x (callers read dA before).
std::vector<Tensor> input_projection_backward(const PassArgs& a, const Tensor& dA, const Tensor& raw,
                                              const Tensor& mean, const Tensor& rstd, bool need_dx);

// The sum of optional bias pieces (undefined when none): folded into the input projection.
Tensor sum_biases(const Tensor& first, const Tensor& second);

inline Tensor or_undefined(bool keep, const Tensor& t) { return keep ? t : Tensor(); }

// The entry points of a cell family: unpack the arguments, dispatch on float / double.
template <template <typename> class Cell>
std::vector<Tensor> dispatch_forward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                     bool training) {
  PassArgs a(tensors, scalars);
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(a.x.scalar_type(), "rnnkit_forward", [&] { out = Cell<scalar_t>(a).forward(training); });
  return out;
}

template <template <typename> class Cell>
std::vector<Tensor> dispatch_backward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                      const std::vector<OptTensor>& saved, const std::vector<Tensor>& grads,
                                      bool need_dx) {
  PassArgs a(tensors, scalars);
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(a.x.scalar_type(), "rnnkit_backward",
                             [&] { out = Cell<scalar_t>(a).backward(saved, grads, need_dx); });
  return out;
}

}  // namespace rnnkit
