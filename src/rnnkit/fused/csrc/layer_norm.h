// Layer normalization of rows (docs/spec.md "Layer normalization": biased variance, eps 1e-5): the
// statistics, the apply every LN uses forward and recomputed, a whole-buffer apply, and the
// row backward.
#pragma once

#include "simd.h"

namespace rnnkit {

constexpr double kLayerNormEps = 1e-5;

// γ ∘ (v − mean) · rstd + β for the `count` values at j: the one expression (and rounding order)
// every layer-norm apply uses, forward and recomputed.
template <typename scalar_t>
inline at::vec::Vectorized<scalar_t> layer_norm_apply(const at::vec::Vectorized<scalar_t>& v,
                                                      const at::vec::Vectorized<scalar_t>& mean,
                                                      const at::vec::Vectorized<scalar_t>& rstd, const scalar_t* gain,
                                                      const scalar_t* shift, int64_t j, int64_t count) {
  return at::vec::fmadd((v - mean) * rstd, vload(gain + j, count), vload(shift + j, count));
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

// out = (v − mean) · rstd · gain + shift (+ bias) for each of `rows` rows of n values; v and
// out may alias; mean / rstd (one per row) are written when non-null.
template <typename scalar_t>
void layer_norm_rows(const scalar_t* v, int64_t rows, int64_t n, const scalar_t* gain, const scalar_t* shift,
                     const scalar_t* bias, scalar_t* out, scalar_t* mean, scalar_t* rstd) {
  using Vec = at::vec::Vectorized<scalar_t>;
  for_rows(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* vr = v + r * n;
      scalar_t* o = out + r * n;
      scalar_t m, rs;
      row_stats(vr, n, m, rs);
      if (mean) mean[r] = m, rstd[r] = rs;
      const Vec vm(m), vrs(rs);
      vec_loop<scalar_t>(n, [&](int64_t j, int64_t cnt) {
        Vec y = layer_norm_apply(vload(vr + j, cnt), vm, vrs, gain, shift, j, cnt);
        if (bias) y = y + vload(bias + j, cnt);
        vstore(y, o + j, cnt);
      });
    }
  });
}

}  // namespace rnnkit
