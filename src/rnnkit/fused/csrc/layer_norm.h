// Layer normalization of rows (docs/spec.md "Layer normalization": biased variance, eps 1e-5): the
// statistics, the apply every LN uses forward and recomputed, and the row backward.
#pragma once

#include "simd.h"

#include <cmath>
#include <limits>

namespace rnnkit {

constexpr double kLayerNormEps = 1e-5;

// γ ∘ (v − mean) · rstd + β for the `count` values at j: the one expression (and rounding order)
// of every layer-norm apply a backward recomputes (LN_c's) and of the GRU's and RNN's forward
// sums. The LSTM's forward sums LN_x and LN_h with their shifts folded into one vector (lstm.cpp):
// its gates differ from this expression's in the last bits, and no backward recomputes them.
template <typename scalar_t>
inline at::vec::Vectorized<scalar_t> layer_norm_apply(const at::vec::Vectorized<scalar_t>& v,
                                                      const at::vec::Vectorized<scalar_t>& mean,
                                                      const at::vec::Vectorized<scalar_t>& rstd, const scalar_t* gain,
                                                      const scalar_t* shift, int64_t j, int64_t count) {
  return at::vec::fmadd((v - mean) * rstd, vload(gain + j, count), vload(shift + j, count));
}

// Σ(v − K) and Σ(v − K)² over each of R rows of n values (K = 0 when !shifted: Σv, Σv²), each in
// blocks of kLaneBlock values a lane (the blocks' lanes added in double). Four pairs of
// accumulators a row: a row of 512 floats is 8 rounds of 4 independent adds and FMAs rather than
// 16 of 2 (the chains' latency, not the loads, bound this loop). R = 2 walks two rows side by side
// (16 accumulators), each row's sums in the same order as alone: the same results, bit for bit.
template <bool shifted, int R, typename scalar_t>
inline void shifted_sums_rows(const scalar_t* const* v, int64_t n, const scalar_t* K, double* sum_d, double* sum_d2) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t w = Vec::size(), block = kLaneBlock * 4 * w;
  Vec vk[R];
  for (int r = 0; r < R; ++r) vk[r] = Vec(shifted ? K[r] : scalar_t(0)), sum_d[r] = 0, sum_d2[r] = 0;
  for (int64_t j = 0; j < n;) {
    const int64_t end = std::min(n, j + block);
    Vec s_d[R][4], s_d2[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) s_d[r][i] = Vec(0), s_d2[r][i] = Vec(0);
    auto add = [&](int r, int64_t k, int64_t c, int i) {
      const Vec x = vload(v[r] + k, c);  // a tail's unread lanes are 0
      const Vec d = !shifted ? x : c == w ? x - vk[r] : Vec::set(Vec(0), x - vk[r], c);
      s_d[r][i] = s_d[r][i] + d, s_d2[r][i] = at::vec::fmadd(d, d, s_d2[r][i]);
    };
    for (; j + 4 * w <= end; j += 4 * w)
      for (int r = 0; r < R; ++r) add(r, j, w, 0), add(r, j + w, w, 1), add(r, j + 2 * w, w, 2), add(r, j + 3 * w, w, 3);
    for (int i = 0; j < end; j += w, ++i)  // < 4 Vecs and a part: i ≤ 3
      for (int r = 0; r < R; ++r) add(r, j, std::min(w, end - j), i);
    for (int r = 0; r < R; ++r) {
      sum_d[r] += lane_sum<scalar_t>((s_d[r][0] + s_d[r][1]) + (s_d[r][2] + s_d[r][3]));
      sum_d2[r] += lane_sum<scalar_t>((s_d2[r][0] + s_d2[r][1]) + (s_d2[r][2] + s_d2[r][3]));
    }
  }
}

template <bool shifted, typename scalar_t>
inline void shifted_sums(const scalar_t* v, int64_t n, scalar_t K, double& sum_d, double& sum_d2) {
  shifted_sums_rows<shifted, 1>(&v, n, &K, &sum_d, &sum_d2);
}

namespace detail {
// row_stats' answer from a row's Σv and Σv² (sum_d, sum_d2; shifted_sums<false>): the second pass
// about the float mean where one pass loses bits, the double pass where squares overflow.
template <typename scalar_t>
inline void finish_row_stats(const scalar_t* v, int64_t n, double sum_d, double sum_d2, scalar_t& mean,
                             scalar_t& rstd) {
  const double inv_n = 1.0 / double(n);
  double m = sum_d * inv_n;
  if (!(m * m <= 0.25 * (sum_d2 * inv_n)) && std::isfinite(m)) {  // cancellation, or v² overflowed
    const scalar_t K = scalar_t(m);
    shifted_sums<true>(v, n, K, sum_d, sum_d2);
    m = double(K) + sum_d * inv_n;
  }
  double var = sum_d2 * inv_n - (sum_d * inv_n) * (sum_d * inv_n);
  if (!std::isfinite(var) || !std::isfinite(m)) {
    double total = 0;
    for (int64_t j = 0; j < n; ++j) total += double(v[j]);
    m = total / double(n), var = 0;
    for (int64_t j = 0; j < n; ++j) var += (double(v[j]) - m) * (double(v[j]) - m) / double(n);
    if (!std::isfinite(var)) var = std::numeric_limits<double>::quiet_NaN();
  }
  mean = scalar_t(m);
  rstd = scalar_t(1.0 / std::sqrt(std::max(var, 0.0) + kLayerNormEps));
}
}  // namespace detail

// Mean and 1/sqrt(var + eps) of one row (biased variance), in one pass where that is exact
// enough: Σv and Σv², var = mean(v²) − mean(v)². That difference loses bits as mean² nears mean(v²),
// so where mean(v)² exceeds a quarter of mean(v²) (|mean| > 0.58 sd: at most a third of var's
// rounding added), or v² overflows, the row is summed again about its float mean K: d = v − K,
// var = mean(d²) − mean(d)², mean = K + mean(d) (the corrected two-pass formula, which every row
// took before). Rows whose values all sit away from zero, as W x's rows of a biased input can, pay
// the two passes; pre-activation rows centred near zero take one. Where a float square overflows
// about the mean too (|v − mean| ≳ 1.8e19) the row is summed again in double: LN is
// scale-invariant, so such a row still has a finite, exact answer (rstd ≈ 1e-19 is a normal
// float); a row holding inf or NaN gives rstd NaN, so its whole output is NaN (as the reference's).
// The sums are a chain of dependent adds: one row of 128 / 512 floats takes 39 / 66 ns in one
// pass (AMD EPYC of README's tables, rows each waiting on the last). The cells' LN_x and LN_h
// statistics of a step's rows are taken before the rows' other work, each row's two walked side
// by side (row_stats_pair, InputSteps::prepare_rows).
template <typename scalar_t>
inline void row_stats(const scalar_t* v, int64_t n, scalar_t& mean, scalar_t& rstd) {
  double sum_d, sum_d2;
  shifted_sums<false>(v, n, scalar_t(0), sum_d, sum_d2);
  detail::finish_row_stats(v, n, sum_d, sum_d2, mean, rstd);
}

// row_stats of two rows of n values, walked side by side: the same results as two row_stats calls.
template <typename scalar_t>
inline void row_stats_pair(const scalar_t* v0, const scalar_t* v1, int64_t n, scalar_t* mean, scalar_t* rstd) {
  const scalar_t* rows[2] = {v0, v1};
  const scalar_t zero[2] = {scalar_t(0), scalar_t(0)};
  double sum_d[2], sum_d2[2];
  shifted_sums_rows<false, 2>(rows, n, zero, sum_d, sum_d2);
  detail::finish_row_stats(v0, n, sum_d[0], sum_d2[0], mean[0], rstd[0]);
  detail::finish_row_stats(v1, n, sum_d[1], sum_d2[1], mean[1], rstd[1]);
}

// LN backward of a row of one or two values, in closed form. The general formula
// rstd (g − mean(g) − x̂ mean(g x̂)) projects g onto what is orthogonal to 1 and x̂; for n ≤ 2 that
// is nothing, and the true derivative is the eps term alone: for n = 1, x̂ ≡ 0 and dv = 0 exactly;
// for n = 2, x̂ = ±δ·rstd with δ = (v₀ − v₁)/2, and dv₀ = −dv₁ = (g₀ − g₁)/2 · eps · rstd³. The
// general formula gets there by cancellation: noise of size ε·rstd·|g| (rstd = 316 at var = 0),
// or 1e5 times the answer's own rounding in float32 at var ≈ 1.
template <typename scalar_t>
inline void short_row_layer_norm_backward(const scalar_t* dout, const scalar_t* v, int64_t n, scalar_t mean,
                                          scalar_t rstd, const scalar_t* gain, scalar_t* dv, scalar_t* dgain,
                                          scalar_t* dshift) {
  if (n == 1) {
    dshift[0] += dout[0];  // dγ += d · x̂ = 0
    dv[0] = 0;
    return;
  }
  const scalar_t d0 = dout[0], d1 = dout[1];  // read before dv (may alias dout) is written
  const scalar_t x0 = (v[0] - mean) * rstd, x1 = (v[1] - mean) * rstd;
  dgain[0] += d0 * x0, dgain[1] += d1 * x1;
  dshift[0] += d0, dshift[1] += d1;
  const scalar_t dv0 = (d0 * gain[0] - d1 * gain[1]) * scalar_t(0.5 * kLayerNormEps) * (rstd * rstd * rstd);
  dv[0] = dv0, dv[1] = -dv0;
}

// LN backward of one row: given dout (grad of γ·x̂ + β) and the raw input v, writes dv and
// accumulates dγ, dβ. dout and dv may alias. Two passes: the sums (with dγ, dβ), then dv.
template <typename scalar_t>
inline void row_layer_norm_backward(const scalar_t* dout, const scalar_t* v, int64_t n, scalar_t mean,
                                    scalar_t rstd, const scalar_t* gain, scalar_t* dv, scalar_t* dgain,
                                    scalar_t* dshift) {
  if (n <= 2) return short_row_layer_norm_backward(dout, v, n, mean, rstd, gain, dv, dgain, dshift);
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t w = Vec::size(), block = kLaneBlock * 2 * w;
  const Vec vm(mean), vr(rstd);
  // vload zero-fills a tail's unread lanes: there d = 0, so dxh and dxh·x̂ add nothing.
  auto pass = [&](int64_t k, int64_t c, Vec& s_dxh, Vec& s_x) {
    const Vec d = vload(dout + k, c), xh = (vload(v + k, c) - vm) * vr, dxh = d * vload(gain + k, c);
    s_dxh = s_dxh + dxh, s_x = at::vec::fmadd(dxh, xh, s_x);
    vstore(at::vec::fmadd(d, xh, vload(dgain + k, c)), dgain + k, c);
    vstore(vload(dshift + k, c) + d, dshift + k, c);
  };
  double sum_dxh = 0, sum_dxh_xh = 0;  // blocks of kLaneBlock values a lane, as shifted_sums
  for (int64_t j = 0; j < n;) {
    const int64_t end = std::min(n, j + block);
    Vec s_dxh0(0), s_dxh1(0), s_x0(0), s_x1(0);
    for (; j + 2 * w <= end; j += 2 * w) pass(j, w, s_dxh0, s_x0), pass(j + w, w, s_dxh1, s_x1);
    for (; j < end; j += w) pass(j, std::min(w, end - j), s_dxh0, s_x0);
    sum_dxh += lane_sum<scalar_t>(s_dxh0 + s_dxh1), sum_dxh_xh += lane_sum<scalar_t>(s_x0 + s_x1);
  }
  const Vec mean_dxh(scalar_t(sum_dxh / double(n)));
  const Vec mean_dxh_xh(scalar_t(sum_dxh_xh / double(n)));
  vec_loop<scalar_t>(n, [&](int64_t k, int64_t c) {
    const Vec xh = (vload(v + k, c) - vm) * vr, dxh = vload(dout + k, c) * vload(gain + k, c);
    vstore(vr * (dxh - mean_dxh - xh * mean_dxh_xh), dv + k, c);
  });
}

}  // namespace rnnkit
