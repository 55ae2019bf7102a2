// Fused GRU pass (docs/spec.md "Cells": gates r z n), both reset conventions, with layer norm
// (reset_after only) and zoneout. The reference is ref/gru.py.
//
// reset_after=True: one GEMM R h per step; n = tanh(x_n + r ∘ (LN_h(R h)_n + b_Rn)).
// reset_after=False: R_rz h, then R_n (r ∘ h): the second GEMM needs r, so two per step.
#include "pass.h"

namespace rnnkit {
namespace {

template <typename scalar_t>
struct Gru {
  const PassArgs& a;
  int64_t T, B, H, GH;
  bool ln, after;
  const scalar_t *rm, *b_Rn, *ln_h_gain, *ln_h_shift;
  const bool* mask;
  Zoneout<scalar_t> zh;
  bool quick;  // the quick σ and tanh (simd.h): PassArgs::quick_activations, set again by forward()
  // Saved gate row: r z n, and with reset_after the recurrent n term hn = LN_h(R h)_n + b_Rn.
  int64_t GS;

  explicit Gru(const PassArgs& args) : a(args) {
    T = a.T, B = a.B, H = a.H, GH = a.GH;
    ln = a.layer_norm(), after = a.reset_after;
    rm = a.recurrent_mask.defined() ? a.recurrent_mask.data_ptr<scalar_t>() : nullptr;
    b_Rn = (after && a.b_R.defined()) ? a.b_R.data_ptr<scalar_t>() + 2 * H : nullptr;
    ln_h_gain = ln ? a.ln_h_gain.data_ptr<scalar_t>() : nullptr;
    ln_h_shift = ln ? a.ln_h_shift.data_ptr<scalar_t>() : nullptr;
    mask = a.mask_ptr();
    zh = a.zone_h<scalar_t>();
    quick = a.quick_activations(true);  // a backward recomputes a training forward's values
    GS = after ? 4 * H : 3 * H;
  }

  int64_t step_time(int64_t s) const { return a.reverse ? T - 1 - s : s; }
  bool valid(int64_t t, int64_t b) const { return mask == nullptr || mask[t * B + b]; }

  // r ∘ h_in [T, B, H] (reset_after=False) for R_n's weight gradient; 0 where a step did not run.
  Tensor reset_hidden(const Tensor& gates, const Tensor& h_in) const {
    Tensor out = new_buffer({T, B, H}, a.x);
    const scalar_t *g = gates.data_ptr<scalar_t>(), *h = h_in.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t row = 0; row < T * B; ++row) {
      if (!valid(row / B, row % B)) {
        std::fill(o + row * H, o + (row + 1) * H, scalar_t(0));
        continue;
      }
      for (int64_t j = 0; j < H; ++j) o[row * H + j] = g[row * GS + j] * h[row * H + j];
    }
    return out;
  }

  // Biases folded into the input projection: all of them, except b_Rn with reset_after.
  Tensor folded_bias() const { return sum_biases(a.b_W, a.b_R, after ? 2 * H : -1); }

  ForwardResult forward(bool training) {
    quick = a.quick_activations(training);
    std::vector<Tensor> saved = saved_slots();
    const Tensor& like = a.x;
    // W x + folded biases, [B, 3H] a step; under layer norm W x as it is, which the loop
    // normalizes and adds the biases to (InputSteps).
    const Tensor bias = folded_bias();
    const scalar_t* fb = ln && bias.defined() ? bias.data_ptr<scalar_t>() : nullptr;
    InputSteps steps(a, ln ? Tensor() : bias, training, saved[kInputRaw], saved[kInputMean], saved[kInputRstd]);
    Tensor y = new_buffer({T, B, H}, like);
    Tensor h = a.h0.clone();
    Tensor h_in = rm ? h * a.recurrent_mask : h;
    const int64_t keep = training ? T : 1;
    Tensor gates = new_buffer({keep, B, GS}, like);
    Tensor gh = after ? new_buffer({ln ? keep : 1, B, GH}, like) : Tensor();  // R h
    Tensor rh = after ? Tensor() : new_buffer({B, H}, like);                   // r ∘ h_in of a step
    Tensor stats = ln ? new_buffer({2, keep, B}, like) : Tensor();

    scalar_t *y_p = y.data_ptr<scalar_t>(), *h_p = h.data_ptr<scalar_t>();
    scalar_t *hin_p = h_in.data_ptr<scalar_t>(), *gates_p = gates.data_ptr<scalar_t>();
    scalar_t* gh_p = after ? gh.data_ptr<scalar_t>() : nullptr;
    scalar_t* rh_p = after ? nullptr : rh.data_ptr<scalar_t>();
    scalar_t* st_p = ln ? stats.data_ptr<scalar_t>() : nullptr;

    // h̃ = (1 − z) ∘ n + z ∘ h -> zoneout -> state, y, next R input. Gate row holds r z n.
    auto finish_h = [&](int64_t t, int64_t k, int64_t b) {
      scalar_t* hb = h_p + b * H;
      scalar_t* yb = y_p + (t * B + b) * H;
      if (!valid(t, b)) {
        std::fill(yb, yb + H, scalar_t(0));
        return;
      }
      const scalar_t* gate = gates_p + (k * B + b) * GS;
      const scalar_t* d = zh.row(t, b);
      for (int64_t j = 0; j < H; ++j) {
        const scalar_t z = gate[H + j], n = gate[2 * H + j];
        const scalar_t ht = (scalar_t(1) - z) * n + z * hb[j];
        const scalar_t zo = d ? d[j] : zh.p;
        const scalar_t hn = zo * hb[j] + (scalar_t(1) - zo) * ht;
        hb[j] = hn;
        yb[j] = hn;
        if (rm) hin_p[b * H + j] = hn * rm[b * H + j];
      }
    };

    // · Rᵀ with reset_after; otherwise · R_rzᵀ and · R_nᵀ
    const PackedRight<scalar_t> R_right = right_operand<scalar_t>(a, kR, 0, true, B, after ? GH : 2 * H, H, like);
    const std::optional<PackedRight<scalar_t>> R_n_right =
        after ? std::nullopt : std::make_optional(right_operand<scalar_t>(a, kR, 2 * H, true, B, H, H, like));
    for (int64_t s = 0; s < T; ++s) {
      const int64_t t = step_time(s), k = training ? t : 0;
      scalar_t* gx_t = steps.step<scalar_t>(s, t);
      if (after) {
        scalar_t* gh_t = gh_p + (ln ? k : 0) * B * GH;
        R_right.multiply(hin_p, H, 0, gh_t, GH);  // R h [B, 3H]
        for_rows(B, GH * 8, [&](int64_t b0, int64_t b1) {
          using Vec = at::vec::Vectorized<scalar_t>;
          if (ln) steps.prepare_rows(t, static_cast<const scalar_t*>(gh_t), b0, b1);
          for (int64_t b = b0; b < b1; ++b) {
            if (valid(t, b) && ln) {
              const scalar_t* ghb = gh_t + b * GH;
              scalar_t* gate = gates_p + (k * B + b) * GS;
              const auto row = steps.normalized_row(t, b, ghb);
              st_p[k * B + b] = row.h_mean, st_p[keep * B + k * B + b] = row.h_rstd;
              auto input = [&](int64_t q, int64_t n) {  // LN_x(W x) + folded biases at gate column q
                const Vec v = row.input(q, n);
                return fb ? v + vload(fb + q, n) : v;
              };
              vec_loop<scalar_t>(2 * H, [&](int64_t q, int64_t n) {
                vstore(input(q, n) + row.recurrent(q, n), gate + q, n);
              });
              sigmoid_inplace(gate, 2 * H, quick);  // r, z
              vec_loop<scalar_t>(H, [&](int64_t j, int64_t n) {
                const Vec rec = row.recurrent(2 * H + j, n);
                const Vec hn = b_Rn ? rec + vload(b_Rn + j, n) : rec;
                vstore(hn, gate + 3 * H + j, n);
                vstore(input(2 * H + j, n) + vload(gate + j, n) * hn, gate + 2 * H + j, n);
              });
              tanh_inplace(gate + 2 * H, H, quick);  // n
            } else if (valid(t, b)) {
              const scalar_t* ax = gx_t + b * GH;
              const scalar_t* ghb = gh_t + b * GH;
              scalar_t* gate = gates_p + (k * B + b) * GS;
              for (int64_t q = 0; q < 2 * H; ++q) gate[q] = ax[q] + ghb[q];
              sigmoid_inplace(gate, 2 * H, quick);  // r, z
              for (int64_t j = 0; j < H; ++j) {
                const scalar_t hn = ghb[2 * H + j] + (b_Rn ? b_Rn[j] : scalar_t(0));
                gate[3 * H + j] = hn;
                gate[2 * H + j] = ax[2 * H + j] + gate[j] * hn;
              }
              tanh_inplace(gate + 2 * H, H, quick);  // n
            } else if (ln) {
              steps.skipped_row<scalar_t>(t, b);  // the backward reads LN_x's statistics of every row
            }
            finish_h(t, k, b);
          }
        });
      } else {
        R_right.multiply(hin_p, H, 1, gx_t, GH);  // += R_rz h
        scalar_t* rh_t = rh_p;
        for_rows(B, H * 8, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) {
            scalar_t* rhb = rh_t + b * H;
            if (!valid(t, b)) {
              std::fill(rhb, rhb + H, scalar_t(0));
              continue;
            }
            const scalar_t* ax = gx_t + b * GH;
            scalar_t* gate = gates_p + (k * B + b) * GS;
            std::copy(ax, ax + 2 * H, gate);
            sigmoid_inplace(gate, 2 * H, quick);  // r, z
            for (int64_t j = 0; j < H; ++j) rhb[j] = gate[j] * hin_p[b * H + j];
          }
        });
        R_n_right->multiply(rh_t, H, 1, gx_t + 2 * H, GH);  // += R_n (r∘h)
        for_rows(B, H * 8, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) {
            if (valid(t, b)) {
              const scalar_t* ax = gx_t + b * GH;
              scalar_t* gate = gates_p + (k * B + b) * GS;
              std::copy(ax + 2 * H, ax + 3 * H, gate + 2 * H);
              tanh_inplace(gate + 2 * H, H, quick);  // n
            }
            finish_h(t, k, b);
          }
        });
      }
    }

    std::vector<Tensor> out = {y, h, Tensor()};
    if (training) {
      zero_masked_rows(a, gates);
      if (ln) zero_masked_rows(a, stats[0]), zero_masked_rows(a, stats[1]);
      saved[kGates] = gates;
      if (ln) saved[kRecurrentRaw] = gh, saved[kRecurrentMean] = stats[0].clone(), saved[kRecurrentRstd] = stats[1].clone();
      out.insert(out.end(), saved.begin(), saved.end());
    }
    return out;
  }

  BackwardResult backward(const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy_in,
                          const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs) {
    const Tensor& like = a.x;
    const Tensor dy = dy_in.contiguous();
    Tensor dh_dir = dh_n.contiguous().clone();
    Tensor dh_rec = zero_buffer({B, H}, like);
    Tensor dA = new_buffer({T, B, GH}, like);                       // dL/d input-side pre-activations
    Tensor dAh = after ? new_buffer({T, B, GH}, like) : Tensor();  // dL/d LN_h(R h) + b_R
    Tensor dgh = (after && ln) ? new_buffer({T, B, GH}, like) : dAh;  // dL/d(R h)
    Tensor drh = after ? Tensor() : new_buffer({B, H}, like);
    Tensor acc_ln_h = ln ? zero_buffer({2, B, GH}, like) : Tensor();
    // The biases' gradients Σ dA (b_W; b_R too with the reset before) and Σ dAh (b_R with the reset
    // after, unless layer norm's β accumulator has it), summed per batch row as each row is written
    // (in L1), not by at::sum over [T·B, G·H] afterwards, which read them from memory again.
    const bool sum_dA = a.b_W.defined() || (!after && a.b_R.defined());
    const bool sum_dAh = after && !ln && a.b_R.defined();
    Tensor acc_bias = zero_buffer({int64_t(sum_dA) + int64_t(sum_dAh), B, GH}, like);
    scalar_t* acc_dA_p = sum_dA ? acc_bias.data_ptr<scalar_t>() : nullptr;
    scalar_t* acc_dAh_p = sum_dAh ? acc_bias.data_ptr<scalar_t>() + int64_t(sum_dA) * B * GH : nullptr;

    const Tensor gates = saved[kGates], hidden_prev = hidden_entering<scalar_t>(a, y);
    const scalar_t *dy_p = dy.data_ptr<scalar_t>(), *gates_p = gates.data_ptr<scalar_t>();
    const scalar_t* hp_p = hidden_prev.data_ptr<scalar_t>();
    const scalar_t* gh_p = ln ? saved[kRecurrentRaw].data_ptr<scalar_t>() : nullptr;
    const scalar_t* mh_p = ln ? saved[kRecurrentMean].data_ptr<scalar_t>() : nullptr;
    const scalar_t* rh_p = ln ? saved[kRecurrentRstd].data_ptr<scalar_t>() : nullptr;
    scalar_t *dhd_p = dh_dir.data_ptr<scalar_t>(), *dhr_p = dh_rec.data_ptr<scalar_t>();
    scalar_t* dA_p = dA.data_ptr<scalar_t>();
    scalar_t* dAh_p = after ? dAh.data_ptr<scalar_t>() : nullptr;
    scalar_t* dgh_p = after ? dgh.data_ptr<scalar_t>() : nullptr;
    scalar_t* drh_p = after ? nullptr : drh.data_ptr<scalar_t>();
    scalar_t* alh_p = ln ? acc_ln_h.data_ptr<scalar_t>() : nullptr;

    // dL/dh_t -> zoneout -> h̃ = (1 − z) n + z h: the z and n pre-activation grads, and the
    // direct part of dL/dh_{t-1}. Returns false for a masked row (state passes through).
    auto backward_h = [&](int64_t t, int64_t b) {
      scalar_t* dhd = dhd_p + b * H;
      const scalar_t* dhr = dhr_p + b * H;
      scalar_t* dAb = dA_p + (t * B + b) * GH;
      if (!valid(t, b)) {
        for (int64_t j = 0; j < H; ++j) dhd[j] += rm ? rm[b * H + j] * dhr[j] : dhr[j];
        std::fill(dAb, dAb + GH, scalar_t(0));
        return false;
      }
      const scalar_t* gate = gates_p + (t * B + b) * GS;
      const scalar_t* hp = hp_p + (t * B + b) * H;
      const scalar_t* d = zh.row(t, b);
      const scalar_t* dyb = dy_p + (t * B + b) * H;
      for (int64_t j = 0; j < H; ++j) {
        const scalar_t dtot = dhd[j] + (rm ? rm[b * H + j] * dhr[j] : dhr[j]) + dyb[j];
        const scalar_t zo = d ? d[j] : zh.p;
        const scalar_t dht = (scalar_t(1) - zo) * dtot;
        const scalar_t z = gate[H + j], n = gate[2 * H + j];
        dhd[j] = zo * dtot + dht * z;
        dAb[H + j] = dht * (hp[j] - n) * z * (scalar_t(1) - z);
        dAb[2 * H + j] = dht * (scalar_t(1) - z) * (scalar_t(1) - n * n);
      }
      return true;
    };

    // · R with reset_after; otherwise · R_n and · R_rz
    const PackedRight<scalar_t> R_right = backward_operand<scalar_t>(a, kR, 0, B, H, after ? GH : 2 * H, like);
    const std::optional<PackedRight<scalar_t>> R_n_right =
        after ? std::nullopt : std::make_optional(backward_operand<scalar_t>(a, kR, 2 * H, B, H, H, like));
    for (int64_t s = T - 1; s >= 0; --s) {
      const int64_t t = step_time(s);
      if (after) {
        for_rows(B, GH * 6, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) {
            const int64_t row = t * B + b;
            scalar_t* dAb = dA_p + row * GH;
            scalar_t* dAhb = dAh_p + row * GH;
            if (!backward_h(t, b)) {
              std::fill(dAhb, dAhb + GH, scalar_t(0));
              if (ln) std::fill(dgh_p + row * GH, dgh_p + (row + 1) * GH, scalar_t(0));
              continue;
            }
            const scalar_t* gate = gates_p + row * GS;
            for (int64_t j = 0; j < H; ++j) {
              const scalar_t r = gate[j], hn = gate[3 * H + j], dan = dAb[2 * H + j];
              dAb[j] = dan * hn * r * (scalar_t(1) - r);
              dAhb[j] = dAb[j], dAhb[H + j] = dAb[H + j], dAhb[2 * H + j] = dan * r;
            }
            if (acc_dA_p) add_into(acc_dA_p + b * GH, dAb, GH);
            if (acc_dAh_p) add_into(acc_dAh_p + b * GH, dAhb, GH);
            if (ln) {
              row_layer_norm_backward(dAhb, gh_p + row * GH, GH, mh_p[row], rh_p[row], ln_h_gain,
                                      dgh_p + row * GH, alh_p + b * GH, alh_p + (B + b) * GH);
            }
          }
        });
        R_right.multiply(dgh_p + t * B * GH, GH, 0, dhr_p, H);  // dgh R
      } else {
        scalar_t* dA_t = dA_p + t * B * GH;
        for_rows(B, H * 6, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) backward_h(t, b);
        });
        R_n_right->multiply(dA_t + 2 * H, GH, 0, drh_p, H);  // d(r∘h)
        for_rows(B, H * 6, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) {
            scalar_t* dhr = dhr_p + b * H;
            if (!valid(t, b)) {
              std::fill(dhr, dhr + H, scalar_t(0));
              continue;
            }
            const scalar_t* gate = gates_p + (t * B + b) * GS;
            const scalar_t* hp = hp_p + (t * B + b) * H;
            const scalar_t* drhb = drh_p + b * H;
            scalar_t* dAb = dA_t + b * GH;
            for (int64_t j = 0; j < H; ++j) {
              const scalar_t r = gate[j], h_in = rm ? hp[j] * rm[b * H + j] : hp[j];
              dAb[j] = drhb[j] * h_in * r * (scalar_t(1) - r);
              dhr[j] = drhb[j] * r;
            }
            if (acc_dA_p) add_into(acc_dA_p + b * GH, dAb, GH);
          }
        });
        R_right.multiply(dA_t, GH, 1, dhr_p, H);  // += dA_rz R_rz
      }
    }

    const int64_t TB = T * B;
    WeightGrads grads(a);
    Tensor dh0 = dh_dir + (rm ? dh_rec * a.recurrent_mask : dh_rec);
    Tensor h_in = (rm ? hidden_prev * a.recurrent_mask : hidden_prev).view({TB, H});
    Tensor dA2 = dA.view({TB, GH});
    // before dA2 turns into dL/d(W x): b_W's gradient (and b_R's, reset before)
    if (sum_dA) {
      const Tensor dA_sum = at::sum(acc_bias[0], 0);
      grads.put(kBiasW, dA_sum);
      if (!after) grads.put(kBiasR, dA_sum);
    }
    if (ln) {
      const Tensor d_ln_h = acc_ln_h.sum(1);
      grads.put(kLnHGain, d_ln_h[0]), grads.put(kLnHShift, d_ln_h[1]);
      if (after) grads.put(kBiasR, d_ln_h[1]);  // b_R sits beside LN_h's β: summed already
    } else if (sum_dAh) {
      at::sum_out(grads.slot[kBiasR], acc_bias[int64_t(sum_dA)], 0);
    }
    Tensor& dR = grads.slot[kR];
    if (!needs.dR) {
      dR.zero_();
    } else if (after) {
      weight_gradient(a, dR, dgh.view({TB, GH}), h_in);
    } else {  // [R_rz; R_n]
      Tensor dR_rz = dR.narrow(0, 0, 2 * H), dR_n = dR.narrow(0, 2 * H, H);
      weight_gradient(a, dR_rz, dA2.narrow(1, 0, 2 * H), h_in);
      weight_gradient(a, dR_n, dA2.narrow(1, 2 * H, H), reset_hidden(gates, h_in).view({TB, H}));
    }
    Tensor dx = input_projection_backward(a, dA2, saved[kInputRaw], saved[kInputMean], saved[kInputRstd], needs,
                                          grads);
    return {dx, dh0, Tensor(), grads.block};
  }
};

}  // namespace

ForwardResult gru_forward(const PassArgs& a, bool training) { return dispatch_forward<Gru>(a, training); }

BackwardResult gru_backward(const PassArgs& a, const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy,
                             const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs) {
  return dispatch_backward<Gru>(a, y, saved, dy, dh_n, dc_n, needs);
}

}  // namespace rnnkit
