// Fused LSTM pass (docs/spec.md "Cells": gates i f g o, or i g o with coupled gates), with
// peepholes, layer norm, cell / projection clips, projection and zoneout. The reference is
// ref/lstm.py; the inner loops below follow its step line by line.
#include "pass.h"

namespace rnnkit {
namespace {

template <typename scalar_t>
scalar_t clip(scalar_t v, scalar_t bound) {
  return bound > 0 ? std::min(std::max(v, -bound), bound) : v;
}

template <typename scalar_t>
struct Lstm {
  const PassArgs& a;
  int64_t T, B, H, Hr, GH, P;
  int64_t gi, gf, gg, go;  // gate offsets in a G·H row (gf < 0 with coupled gates)
  bool proj, ln, peep;
  scalar_t cell_clip, proj_clip;
  const scalar_t *p_i, *p_f, *p_o, *rm;
  const scalar_t *ln_h_gain, *ln_h_shift, *ln_c_gain, *ln_c_shift;
  const bool* mask;
  Zoneout<scalar_t> zh, zc;
  bool quick;  // the quick σ and tanh (simd.h): PassArgs::quick_activations, set again by forward()

  explicit Lstm(const PassArgs& args) : a(args) {
    T = a.T, B = a.B, H = a.H, Hr = a.Hr, GH = a.GH, P = a.Hr;
    gi = 0, gf = a.coupled ? -1 : H, gg = a.coupled ? H : 2 * H, go = a.coupled ? 2 * H : 3 * H;
    proj = a.W_hr.defined(), ln = a.layer_norm(), peep = a.peephole.defined();
    cell_clip = scalar_t(a.cell_clip), proj_clip = scalar_t(a.proj_clip);
    p_i = peep ? a.peephole.data_ptr<scalar_t>() : nullptr;
    p_f = peep && !a.coupled ? p_i + H : nullptr;
    p_o = peep ? p_i + (a.peephole.size(0) - 1) * H : nullptr;
    rm = a.recurrent_mask.defined() ? a.recurrent_mask.data_ptr<scalar_t>() : nullptr;
    ln_h_gain = ln ? a.ln_h_gain.data_ptr<scalar_t>() : nullptr;
    ln_h_shift = ln ? a.ln_h_shift.data_ptr<scalar_t>() : nullptr;
    ln_c_gain = ln ? a.ln_c_gain.data_ptr<scalar_t>() : nullptr;
    ln_c_shift = ln ? a.ln_c_shift.data_ptr<scalar_t>() : nullptr;
    mask = a.mask_ptr();
    zh = a.zone_h<scalar_t>(), zc = a.zone_c<scalar_t>();
    quick = a.quick_activations(true);  // a backward recomputes a training forward's values
  }

  using Vec = at::vec::Vectorized<scalar_t>;  // every loop's vector type

  // tanh(LN_c(c̃)) of the n values at j of a clipped-c̃ row (LN_c with mean / rstd only under
  // layer norm): the forward's m = o ∘ this, and the backward's recomputation of it.
  Vec cell_tanh(const scalar_t* cc, const Vec& mean, const Vec& rstd, int64_t j, int64_t n) const {
    const Vec v = vload(cc + j, n);
    return vtanh(ln ? layer_norm_apply(v, mean, rstd, ln_c_gain, ln_c_shift, j, n) : v, quick);
  }

  int64_t step_time(int64_t s) const { return a.reverse ? T - 1 - s : s; }
  bool valid(int64_t t, int64_t b) const { return mask == nullptr || mask[t * B + b]; }

  // c̃ = f ∘ c_prev + i ∘ g of one vector of values (f = 1 − i with coupled gates, given by the
  // caller) and its clip: the one expression of the forward and of the backward, which recomputes it.
  Vec candidate(const Vec& i, const Vec& f, const Vec& g, const Vec& c) const { return f * c + i * g; }
  Vec clip_cell(const Vec& v) const {
    return cell_clip > 0 ? at::vec::minimum(at::vec::maximum(v, Vec(-cell_clip)), Vec(cell_clip)) : v;
  }

  // candidate() and clip_cell() over one row -> raw (optional) and clipped.
  // `keep` (training's forward): c_{t-1} copied there as it is read, for the backward.
  void cell_candidate(const scalar_t* gate, const scalar_t* cprev, scalar_t* raw, scalar_t* clipped,
                      scalar_t* keep = nullptr) const {
    const Vec one(1);
    vec_loop<scalar_t>(H, [&](int64_t j, int64_t n) {
      const Vec i = vload(gate + gi + j, n), g = vload(gate + gg + j, n), c = vload(cprev + j, n);
      if (keep) vstore(c, keep + j, n);
      const Vec f = gf < 0 ? one - i : vload(gate + gf + j, n);
      const Vec v = candidate(i, f, g, c);
      if (raw) vstore(v, raw + j, n);
      vstore(clip_cell(v), clipped + j, n);
    });
  }

  // state = z ∘ state + (1 − z) ∘ v over n values (z: the row's indicators, or the constant p).
  static void zone_into(scalar_t* state, const scalar_t* v, const scalar_t* zrow, scalar_t p, int64_t n) {
    if (zrow == nullptr && p == 0) {
      std::copy(v, v + n, state);
      return;
    }
    const Vec one(1), zp(p);
    vec_loop<scalar_t>(n, [&](int64_t j, int64_t cnt) {
      const Vec z = zrow ? vload(zrow + j, cnt) : zp;
      vstore(z * vload(state + j, cnt) + (one - z) * vload(v + j, cnt), state + j, cnt);
    });
  }

  ForwardResult forward(bool training) {
    quick = a.quick_activations(training);
    std::vector<Tensor> saved = saved_slots();
    const Tensor& like = a.x;
    // LN_x(W x) [T·B, G·H]; the biases are added in the pointwise pass (an addmm would first
    // broadcast-copy them over the whole [T·B, G·H] buffer). Each step's gates overwrite its
    // slice in place: when training this buffer is the saved gates.
    const Tensor bias = sum_biases(a.b_W, a.b_R);
    const scalar_t* bias_p = bias.defined() ? bias.data_ptr<scalar_t>() : nullptr;
    // Under layer norm the rows are W x as it is: the loop normalizes them (InputSteps).
    InputSteps steps(a, Tensor(), training, saved[kInputRaw], saved[kInputMean], saved[kInputRstd]);
    // Under layer norm every shift of a gate's sum in one vector, added once a row: β_x + β_h + bias
    // (a loop, not ATen's adds: a one-step call of the step API pays this at every step)
    const Tensor ln_shift = ln ? new_buffer({GH}, like) : Tensor();
    scalar_t* ln_shift_p = ln ? ln_shift.data_ptr<scalar_t>() : nullptr;
    if (ln) {
      const scalar_t* x_shift = a.ln_x_shift.data_ptr<scalar_t>();
      vec_loop<scalar_t>(GH, [&](int64_t q, int64_t n) {
        const auto v = vload(x_shift + q, n) + vload(ln_h_shift + q, n);
        vstore(bias_p ? v + vload(bias_p + q, n) : v, ln_shift_p + q, n);
      });
    }
    Tensor y = new_buffer({T, B, Hr}, like);
    Tensor h = a.h0.clone(), c = a.c0.clone();  // the running state [B, Hr], [B, H]
    Tensor h_in = rm ? h * a.recurrent_mask : h;  // what enters R
    // Per-step buffers: the whole sequence when training (backward reads them), one step otherwise.
    const int64_t keep = training ? T : 1;
    Tensor m = new_buffer({B, H}, like), cell_tmp = new_buffer({B, H}, like);  // m; clipped c̃
    Tensor h_tilde = proj ? new_buffer({B, P}, like) : Tensor();
    Tensor clipped = proj && proj_clip > 0 && training ? at::empty({T, B, P}, like.options().dtype(at::kBool)) : Tensor();
    Tensor gh = ln ? new_buffer({keep, B, GH}, like) : Tensor();
    Tensor stats = ln ? new_buffer({4, keep, B}, like) : Tensor();  // mean_h, rstd_h, mean_c, rstd_c
    Tensor cell_prev = training ? new_buffer({T, B, H}, like) : Tensor();

    scalar_t *y_p = y.data_ptr<scalar_t>(), *h_p = h.data_ptr<scalar_t>();
    scalar_t *c_p = c.data_ptr<scalar_t>(), *hin_p = h_in.data_ptr<scalar_t>();
    scalar_t *m_p = m.data_ptr<scalar_t>(), *tmp_p = cell_tmp.data_ptr<scalar_t>();
    scalar_t* ht_p = proj ? h_tilde.data_ptr<scalar_t>() : nullptr;
    bool* clipped_p = clipped.defined() ? clipped.data_ptr<bool>() : nullptr;
    scalar_t* gh_p = ln ? gh.data_ptr<scalar_t>() : nullptr;
    scalar_t* st_p = ln ? stats.data_ptr<scalar_t>() : nullptr;
    scalar_t* cp_p = training ? cell_prev.data_ptr<scalar_t>() : nullptr;
    const int64_t stat_stride = keep * B;

    // h̃ (m, or the clipped projection) -> zoneout -> state, y, and the next step's R input; the
    // row loop writes them itself where h is m (no projection, no zoneout of h).
    const bool m_is_h = !proj && !zh.on();
    auto finish_h = [&](int64_t t, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        scalar_t* hb = h_p + b * Hr;
        scalar_t* yb = y_p + (t * B + b) * Hr;
        bool* cl = clipped_p ? clipped_p + (t * B + b) * P : nullptr;
        if (!valid(t, b)) {
          std::fill(yb, yb + Hr, scalar_t(0));
          if (cl) std::fill(cl, cl + P, false);
          continue;
        }
        if (m_is_h) continue;
        scalar_t* src = proj ? ht_p + b * P : m_p + b * H;
        if (proj && proj_clip > 0) {
          if (cl)
            for (int64_t j = 0; j < P; ++j) cl[j] = std::abs(src[j]) > proj_clip;
          const Vec hi(proj_clip), lo(-proj_clip);
          vec_loop<scalar_t>(P, [&](int64_t j, int64_t n) {
            vstore(at::vec::minimum(at::vec::maximum(vload(src + j, n), lo), hi), src + j, n);
          });
        }
        zone_into(hb, src, zh.row(t, b), zh.p, Hr);
        std::copy(hb, hb + Hr, yb);
        if (rm)
          for (int64_t j = 0; j < Hr; ++j) hin_p[b * Hr + j] = hb[j] * rm[b * Hr + j];
      }
    };

    const PackedRight<scalar_t> R_right = right_operand<scalar_t>(a, kR, 0, true, B, GH, Hr, like);  // · Rᵀ
    const std::optional<PackedRight<scalar_t>> W_hr_right =
        proj ? std::make_optional(right_operand<scalar_t>(a, kWhr, 0, true, B, P, H, like)) : std::nullopt;  // · W_hrᵀ
    for (int64_t s = 0; s < T; ++s) {
      const int64_t t = step_time(s), k = training ? t : 0;
      scalar_t* gx_t = steps.step<scalar_t>(s, t);
      scalar_t* gh_t = ln ? gh_p + k * B * GH : nullptr;
      if (ln) {
        R_right.multiply(hin_p, Hr, 0, gh_t, GH);  // R h [B, G·H]
      } else {
        R_right.multiply(hin_p, Hr, 1, gx_t, GH);  // W x + R h
      }
      for_rows(B, GH * 8, [&](int64_t b0, int64_t b1) {
        if (ln) steps.prepare_rows(t, static_cast<const scalar_t*>(gh_t), b0, b1);
        for (int64_t b = b0; b < b1; ++b) {
          scalar_t* cb = c_p + b * H;
          scalar_t* c_saved = training ? cp_p + (t * B + b) * H : nullptr;  // c_{t-1}, for the backward
          scalar_t* gate = gx_t + b * GH;  // W x (+ R h) -> the gates, in place
          if (!valid(t, b)) {
            if (c_saved) std::copy(cb, cb + H, c_saved);
            if (ln && training) {  // the backward reads LN_x's statistics of every row; the saved gates
              steps.skipped_row<scalar_t>(t, b);  // of a step that did not run: zeros, not what
              std::fill(gate, gate + GH, scalar_t(0));  // the buffer held
            }
            continue;
          }
          scalar_t* mb = m_p + b * H;
          if (ln) {  // gate = LN_x(W x) + LN_h(R h) + bias = γ_x x̂ + (γ_h ĥ + (β_x + β_h + bias)): one
            // shift vector, 5 loads a vector where adding the three took 7 (int8 inference at small:
            // 1.17 -> 1.15x the plain LSTM's time). The activations stay passes of their own: one loop
            // of sums, peepholes, σ and tanh took 3% longer a call than these.
            const scalar_t* ghb = gh_t + b * GH;
            const auto row = steps.normalized_row(t, b, ghb);
            st_p[k * B + b] = row.h_mean, st_p[stat_stride + k * B + b] = row.h_rstd;
            vec_loop<scalar_t>(GH, [&](int64_t q, int64_t n) {
              const Vec xh = (vload(row.raw + q, n) - row.xm) * row.xr, hh = (vload(row.rec + q, n) - row.hm) * row.hr;
              const Vec v = at::vec::fmadd(vload(row.h_gain + q, n), hh, vload(ln_shift_p + q, n));
              vstore(at::vec::fmadd(vload(row.x_gain + q, n), xh, v), gate + q, n);
            });
          }
          // Without layer norm the bias is added in each gate's first pass over its row: the
          // peephole's, else the activation's (the same sums as a pass of its own before them)
          const scalar_t* add = ln ? nullptr : bias_p;
          const auto plus = [&](int64_t q) { return add ? gate[q] + add[q] : gate[q]; };
          if (peep) {  // i and f peek at c_{t-1}
            for (int64_t j = 0; j < H; ++j) gate[gi + j] = plus(gi + j) + p_i[j] * cb[j];
            if (gf >= 0)
              for (int64_t j = 0; j < H; ++j) gate[gf + j] = plus(gf + j) + p_f[j] * cb[j];
          }
          const auto folded = [&](int64_t q) { return peep || !add ? nullptr : add + q; };  // not added above
          activate_inplace<Activation::kSigmoid>(gate + gi, gf < 0 ? H : 2 * H, quick, folded(gi));  // i (and f, next to it)
          activate_inplace<Activation::kTanh>(gate + gg, H, quick, add ? add + gg : nullptr);
          // clipped c̃: straight into c without zoneout (each value read as c_{t-1} before it is written)
          scalar_t* cc = zc.on() ? tmp_p + b * H : cb;
          cell_candidate(gate, cb, nullptr, cc, c_saved);
          if (zc.on()) zone_into(cb, cc, zc.row(t, b), zc.p, H);
          if (peep)  // o peeks at the new c
            for (int64_t j = 0; j < H; ++j) gate[go + j] = plus(go + j) + p_o[j] * cc[j];
          activate_inplace<Activation::kSigmoid>(gate + go, H, quick, folded(go));
          scalar_t mc = 0, rc = 1;
          if (ln) {
            row_stats(cc, H, mc, rc);
            st_p[2 * stat_stride + k * B + b] = mc, st_p[3 * stat_stride + k * B + b] = rc;
          }
          const Vec vm(mc), vr(rc);
          if (m_is_h) {  // m is h: into h, y and (masked) R's next input, with no copies after
            scalar_t *hb = h_p + b * H, *yb = y_p + (t * B + b) * H;
            const scalar_t* rmb = rm ? rm + b * H : nullptr;
            vec_loop<scalar_t>(H, [&](int64_t j, int64_t n) {
              const Vec mv = vload(gate + go + j, n) * cell_tanh(cc, vm, vr, j, n);
              vstore(mv, hb + j, n), vstore(mv, yb + j, n);
              if (rmb) vstore(mv * vload(rmb + j, n), hin_p + b * H + j, n);
            });
            continue;
          }
          vec_loop<scalar_t>(H, [&](int64_t j, int64_t n) {  // m = o ∘ tanh(LN_c(c̃))
            vstore(vload(gate + go + j, n) * cell_tanh(cc, vm, vr, j, n), mb + j, n);
          });
        }
        if (!proj) finish_h(t, b0, b1);
      });
      if (proj) {
        W_hr_right->multiply(m_p, H, 0, ht_p, P);  // W_hr m [B, P]
        for_rows(B, P * 2, [&](int64_t b0, int64_t b1) { finish_h(t, b0, b1); });
      }
    }

    std::vector<Tensor> out = {y, h, c};
    if (training) {
      saved[kGates] = steps.all().view({T, B, GH}), saved[kCellPrev] = cell_prev;
      if (ln) {
        for (int64_t k = 0; k < 4; ++k) zero_masked_rows(a, stats[k]);
        saved[kRecurrentRaw] = gh, saved[kRecurrentMean] = stats[0].clone(), saved[kRecurrentRstd] = stats[1].clone();
        saved[kCellMean] = stats[2].clone(), saved[kCellRstd] = stats[3].clone();
      }
      saved[kProjClipped] = clipped;
      out.insert(out.end(), saved.begin(), saved.end());
    }
    return out;
  }

  BackwardResult backward(const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy_in,
                          const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs) {
    const Tensor& like = a.x;
    const Tensor dy = dy_in.contiguous();
    Tensor dh_dir = dh_n.contiguous().clone();  // dL/dh reaching h directly (zoneout, lengths)
    Tensor dh_rec = zero_buffer({B, Hr}, like);     // dL/d(h that entered R), from the later step
    Tensor dc = dc_n.contiguous().clone();
    const PackedRight<scalar_t> R_right = backward_operand<scalar_t>(a, kR, 0, B, Hr, GH, like);  // · R
    // A bfloat16 module's dG rounded a step at a time (pass.h); dA and dL/d(R h) then held for one
    // step where the roundings are all that read them after it
    const RoundedSteps rounded = rounded_steps<scalar_t>(a, R_right, !ln, needs, T, B, GH);
    const bool dA_one_step = rounded.on && !ln, dgh_one_step = rounded.on;
    Tensor dA = new_buffer({dA_one_step ? 1 : T, B, GH}, like);  // dL/d pre-activations (after LN, before biases)
    Tensor dgh = ln ? new_buffer({dgh_one_step ? 1 : T, B, GH}, like) : dA;  // dL/d(R h)
    Tensor dht = proj ? new_buffer({T, B, P}, like) : Tensor();
    Tensor m_all = proj ? new_buffer({T, B, H}, like) : Tensor();  // m, recomputed, for dW_hr
    Tensor dm = new_buffer({B, H}, like);
    Tensor scratch = new_buffer({B, 4, H}, like);  // per row: c̃, clipped c̃, tanh(LN_c(c̃)), dL/dcn
    const int64_t n_peep = peep ? a.peephole.size(0) : 0;
    Tensor acc_peep = peep ? zero_buffer({B, n_peep, H}, like) : Tensor();
    Tensor acc_ln_h = ln ? zero_buffer({2, B, GH}, like) : Tensor();
    Tensor acc_ln_c = ln ? zero_buffer({2, B, H}, like) : Tensor();
    // The bias gradient Σ dA, summed per batch row as each row's dA is written (in L1), then over
    // the rows: an at::sum over [T·B, G·H] afterwards read dA from memory again (0.94 ms a layer
    // at medium). Under layer norm LN_h's β accumulator is the bias gradient already.
    const bool bias_grad = !ln && (a.b_W.defined() || a.b_R.defined());
    Tensor acc_bias = bias_grad ? zero_buffer({B, GH}, like) : Tensor();

    const Tensor gates = saved[kGates], cell_prev = saved[kCellPrev];
    const Tensor clipped = saved[kProjClipped];
    const scalar_t *dy_p = dy.data_ptr<scalar_t>(), *gates_p = gates.data_ptr<scalar_t>();
    const scalar_t* cp_p = cell_prev.data_ptr<scalar_t>();
    const scalar_t* gh_p = ln ? saved[kRecurrentRaw].data_ptr<scalar_t>() : nullptr;
    const scalar_t* mh_p = ln ? saved[kRecurrentMean].data_ptr<scalar_t>() : nullptr;
    const scalar_t* rh_p = ln ? saved[kRecurrentRstd].data_ptr<scalar_t>() : nullptr;
    const scalar_t* mc_p = ln ? saved[kCellMean].data_ptr<scalar_t>() : nullptr;
    const scalar_t* rc_p = ln ? saved[kCellRstd].data_ptr<scalar_t>() : nullptr;
    const bool* clipped_p = proj && proj_clip > 0 ? clipped.data_ptr<bool>() : nullptr;
    scalar_t *dhd_p = dh_dir.data_ptr<scalar_t>(), *dhr_p = dh_rec.data_ptr<scalar_t>();
    scalar_t *dc_p = dc.data_ptr<scalar_t>(), *dA_p = dA.data_ptr<scalar_t>(), *dgh_p = dgh.data_ptr<scalar_t>();
    scalar_t* dht_p = proj ? dht.data_ptr<scalar_t>() : nullptr;
    scalar_t* mall_p = proj ? m_all.data_ptr<scalar_t>() : nullptr;
    scalar_t* dm_p = dm.data_ptr<scalar_t>();
    scalar_t* sc_p = scratch.data_ptr<scalar_t>();
    scalar_t* ap_p = peep ? acc_peep.data_ptr<scalar_t>() : nullptr;
    scalar_t* alh_p = ln ? acc_ln_h.data_ptr<scalar_t>() : nullptr;
    scalar_t* alc_p = ln ? acc_ln_c.data_ptr<scalar_t>() : nullptr;
    scalar_t* ab_p = bias_grad ? acc_bias.data_ptr<scalar_t>() : nullptr;

    // dL/dh_t -> through zoneout (and the projection clip) -> dL/dh̃ in dm (no projection) or dht.
    auto backward_h = [&](int64_t t, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        scalar_t* dhd = dhd_p + b * Hr;
        const scalar_t* dhr = dhr_p + b * Hr;
        const bool ok = valid(t, b);
        scalar_t* out = proj ? dht_p + (t * B + b) * P : dm_p + b * H;
        const scalar_t* d = zh.row(t, b);
        const scalar_t* dyb = dy_p + (t * B + b) * Hr;
        const bool* cl = clipped_p ? clipped_p + (t * B + b) * P : nullptr;
        const scalar_t* rmb = rm ? rm + b * Hr : nullptr;
        const Vec one(1), zp(zh.p);
        vec_loop<scalar_t>(Hr, [&](int64_t j, int64_t n) {
          const Vec dstate = vload(dhd + j, n) + (rmb ? vload(rmb + j, n) * vload(dhr + j, n) : vload(dhr + j, n));
          if (!ok) {
            vstore(dstate, dhd + j, n);
            return;
          }
          const Vec dtot = dstate + vload(dyb + j, n), z = d ? vload(d + j, n) : zp;
          vstore((one - z) * dtot, out + j, n);
          vstore(z * dtot, dhd + j, n);
        });
        if (!ok && proj) std::fill(out, out + P, scalar_t(0));
        if (ok && cl)
          for (int64_t j = 0; j < P; ++j)
            if (cl[j]) out[j] = 0;
      }
    };

    // dL/dm -> the gates, c_{t-1}, peepholes and LN_c; dA and dL/d(R h) of step t.
    auto backward_gates = [&](int64_t t, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t row = t * B + b;
        scalar_t* dAb = dA_p + (dA_one_step ? b : row) * GH;
        scalar_t* dghb = dgh_p + (dgh_one_step ? b : row) * GH;
        if (!valid(t, b)) {
          std::fill(dAb, dAb + GH, scalar_t(0));
          if (ln) std::fill(dghb, dghb + GH, scalar_t(0));
          if (proj) std::fill(mall_p + row * H, mall_p + (row + 1) * H, scalar_t(0));
          continue;
        }
        const scalar_t* gate = gates_p + row * GH;
        const scalar_t* cprev = cp_p + row * H;
        const scalar_t* dmb = dm_p + b * H;
        scalar_t* dcb = dc_p + b * H;
        scalar_t* craw = sc_p + b * 4 * H;  // c̃ before the clip
        scalar_t* cc = craw + H;            // clipped c̃
        scalar_t* tc = cc + H;              // tanh(LN_c(c̃))
        scalar_t* dcn = tc + H;             // dL/d LN_c(c̃), then dL/dc̃ through LN_c
        scalar_t mc = 0, rc = 0;
        if (ln) mc = mc_p[row], rc = rc_p[row];
        // Without layer norm or a projection nothing needs c̃ and tanh(c̃) as rows: the loop below
        // computes them in registers, and sums the bias gradient as it writes dA (the same values
        // as the passes of their own, in one pass over the row instead of four)
        const bool in_registers = !ln && !proj;
        if (!in_registers) {
          cell_candidate(gate, cprev, craw, cc);
          const Vec vm(mc), vr(rc);
          vec_loop<scalar_t>(H, [&](int64_t j, int64_t n) { vstore(cell_tanh(cc, vm, vr, j, n), tc + j, n); });
        }
        if (proj)
          for (int64_t j = 0; j < H; ++j) mall_p[row * H + j] = gate[go + j] * tc[j];
        if (ln) {
          for (int64_t j = 0; j < H; ++j) dcn[j] = dmb[j] * gate[go + j] * (scalar_t(1) - tc[j] * tc[j]);
          row_layer_norm_backward(dcn, cc, H, mc, rc, ln_c_gain, dcn, alc_p + b * H, alc_p + (B + b) * H);
        }
        const Vec one(1), zero(0), zp(zc.p), bound(cell_clip);
        const scalar_t* dz = zc.row(t, b);
        scalar_t* ap = peep ? ap_p + b * n_peep * H : nullptr;
        scalar_t* abb = in_registers && ab_p ? ab_p + b * GH : nullptr;  // the bias gradient's row
        const auto put = [&](const Vec& v, int64_t q, int64_t n) {  // dA at gate column q (and Σ dA)
          vstore(v, dAb + q, n);
          if (abb) vstore(vload(abb + q, n) + v, abb + q, n);
        };
        vec_loop<scalar_t>(H, [&](int64_t j, int64_t n) {
          const Vec i = vload(gate + gi + j, n), g = vload(gate + gg + j, n), o = vload(gate + go + j, n);
          const Vec f = gf < 0 ? one - i : vload(gate + gf + j, n);
          const Vec cp = vload(cprev + j, n), dmj = vload(dmb + j, n);
          Vec raw, clipped, tcj;
          if (in_registers) {  // cell_candidate's and cell_tanh's expressions
            raw = candidate(i, f, g, cp), clipped = clip_cell(raw), tcj = vtanh(clipped, quick);
          } else {
            raw = vload(craw + j, n), clipped = vload(cc + j, n), tcj = vload(tc + j, n);
          }
          const Vec dcj = vload(dcb + j, n), z = dz ? vload(dz + j, n) : zp;
          const Vec dao = dmj * tcj * o * (one - o);
          Vec dct = (ln ? vload(dcn + j, n) : dmj * o * (one - tcj * tcj)) + dcj * (one - z);
          if (peep) dct = dct + dao * vload(p_o + j, n);
          if (cell_clip > 0) dct = Vec::blendv(dct, zero, raw.abs() > bound);
          const Vec dai = (gf < 0 ? dct * (g - cp) : dct * g) * i * (one - i);
          const Vec dag = dct * i * (one - g * g);
          Vec dcp = dcj * z + dct * f;
          put(dai, gi + j, n), put(dag, gg + j, n), put(dao, go + j, n);
          if (peep) {
            dcp = dcp + dai * vload(p_i + j, n);
            vstore(vload(ap + j, n) + dai * cp, ap + j, n);
            scalar_t* apo = ap + (n_peep - 1) * H + j;
            vstore(vload(apo, n) + dao * clipped, apo, n);
          }
          if (gf >= 0) {
            const Vec daf = dct * cp * f * (one - f);
            put(daf, gf + j, n);
            if (peep) {
              dcp = dcp + daf * vload(p_f + j, n);
              vstore(vload(ap + H + j, n) + daf * cp, ap + H + j, n);
            }
          }
          vstore(dcp, dcb + j, n);
        });
        if (ln) {
          row_layer_norm_backward(dAb, gh_p + row * GH, GH, mh_p[row], rh_p[row], ln_h_gain, dghb,
                                  alh_p + b * GH, alh_p + (B + b) * GH);
        }
        if (ab_p && !abb) add_into(ab_p + b * GH, dAb, GH);
      }
    };

    const std::optional<PackedRight<scalar_t>> W_hr_right =
        proj ? std::make_optional(backward_operand<scalar_t>(a, kWhr, 0, B, H, P, like)) : std::nullopt;  // · W_hr
    for (int64_t s = T - 1; s >= 0; --s) {
      const int64_t t = step_time(s);
      if (proj) {
        for_rows(B, P * 2, [&](int64_t b0, int64_t b1) { backward_h(t, b0, b1); });
        W_hr_right->multiply(dht_p + t * B * P, P, 0, dm_p, H);  // dht W_hr
        for_rows(B, GH * 6, [&](int64_t b0, int64_t b1) { backward_gates(t, b0, b1); });
      } else {
        for_rows(B, GH * 6, [&](int64_t b0, int64_t b1) {
          backward_h(t, b0, b1);
          backward_gates(t, b0, b1);
        });
      }
      if (!rounded.multiply_step(R_right, dgh_p, t, dhr_p, Hr)) {
        R_right.multiply(dgh_p + t * B * GH, GH, 0, dhr_p, Hr);  // dgh R
      }
    }

    const int64_t TB = T * B;
    WeightGrads grads(a);
    Tensor dh0 = dh_dir + (rm ? dh_rec * a.recurrent_mask : dh_rec);
    // Without layer norm R's and W's gradients both take dG (dgh is dA): a bfloat16 module has
    // rounded its transpose once for the two, a step at a time (RoundedSteps), a float32 one packs
    // it once into the own kernels' panels where it is too large to read in place
    SharedA dG_prepared = rounded.shared();
    SharedA* shared_dG = ln ? nullptr : &dG_prepared;
    if (needs.dR) {
      Tensor hidden_prev = hidden_entering<scalar_t>(a, y);
      Tensor h_in = rm ? hidden_prev.mul_(a.recurrent_mask) : hidden_prev;
      weight_gradient(a, grads.slot[kR], rounded.on ? Tensor() : dgh.view({TB, GH}), h_in.view({TB, Hr}),
                      rounded.on ? &dG_prepared : shared_dG);
    } else {
      grads.slot[kR].zero_();
    }
    Tensor dA2 = dA_one_step ? Tensor() : dA.view({TB, GH});
    if (ln) {
      // The bias sits beside LN_h's β: the loop has summed its gradient already.
      const Tensor d_ln_h = acc_ln_h.sum(1), d_ln_c = acc_ln_c.sum(1);
      grads.put(kLnHGain, d_ln_h[0]), grads.put(kLnHShift, d_ln_h[1]);
      grads.put(kLnCGain, d_ln_c[0]), grads.put(kLnCShift, d_ln_c[1]);
      grads.put(kBiasW, d_ln_h[1]), grads.put(kBiasR, d_ln_h[1]);
    } else if (bias_grad) {
      const Tensor db = at::sum(acc_bias, 0);
      grads.put(kBiasW, db), grads.put(kBiasR, db);
    }
    if (proj) {
      if (needs.dW_hr) {
        weight_gradient(a, grads.slot[kWhr], dht.view({TB, P}), m_all.view({TB, H}));
      } else {
        grads.slot[kWhr].zero_();
      }
    }
    if (peep) at::sum_out(grads.slot[kPeephole], acc_peep, 0);
    Tensor dx = input_projection_backward(a, dA2, saved[kInputRaw], saved[kInputMean], saved[kInputRstd], needs,
                                          grads, shared_dG);
    return {dx, dh0, dc, grads.block};
  }
};

}  // namespace

ForwardResult lstm_forward(const PassArgs& a, bool training) { return dispatch_forward<Lstm>(a, training); }

BackwardResult lstm_backward(const PassArgs& a, const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy,
                             const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs) {
  return dispatch_backward<Lstm>(a, y, saved, dy, dh_n, dc_n, needs);
}

}  // namespace rnnkit
