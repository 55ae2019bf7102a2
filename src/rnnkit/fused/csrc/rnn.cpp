// Fused Elman RNN pass (docs/spec.md "Cells": h = act(W x + b_W + R h + b_R), tanh or relu), with
// layer norm and zoneout. The reference is ref/rnn.py.
#include "pass.h"

namespace rnnkit {
namespace {

template <typename scalar_t>
struct Rnn {
  const PassArgs& a;
  int64_t T, B, H;
  bool ln, relu;
  const scalar_t *rm, *ln_h_gain, *ln_h_shift;
  const bool* mask;
  Zoneout<scalar_t> zh;
  bool quick;  // the quick σ and tanh (simd.h): PassArgs::quick_activations, set again by forward()

  explicit Rnn(const PassArgs& args) : a(args) {
    T = a.T, B = a.B, H = a.H;
    ln = a.layer_norm(), relu = a.relu;
    rm = a.recurrent_mask.defined() ? a.recurrent_mask.data_ptr<scalar_t>() : nullptr;
    ln_h_gain = ln ? a.ln_h_gain.data_ptr<scalar_t>() : nullptr;
    ln_h_shift = ln ? a.ln_h_shift.data_ptr<scalar_t>() : nullptr;
    mask = a.mask_ptr();
    zh = a.zone_h<scalar_t>();
    quick = a.quick_activations(true);  // a backward recomputes a training forward's values
  }

  int64_t step_time(int64_t s) const { return a.reverse ? T - 1 - s : s; }
  bool valid(int64_t t, int64_t b) const { return mask == nullptr || mask[t * B + b]; }

  ForwardResult forward(bool training) {
    quick = a.quick_activations(training);
    std::vector<Tensor> saved = saved_slots();
    const Tensor& like = a.x;
    // W x + biases, [B, H] a step; under layer norm W x as it is, which the loop normalizes
    // and adds the biases to (InputSteps).
    const Tensor bias = sum_biases(a.b_W, a.b_R);
    const scalar_t* bias_p = ln && bias.defined() ? bias.data_ptr<scalar_t>() : nullptr;
    InputSteps steps(a, ln ? Tensor() : bias, training, saved[kInputRaw], saved[kInputMean], saved[kInputRstd]);
    Tensor y = new_buffer({T, B, H}, like);
    Tensor h = a.h0.clone();
    Tensor h_in = rm ? h * a.recurrent_mask : h;
    const int64_t keep = training ? T : 1;
    Tensor h_tilde = training ? new_buffer({T, B, H}, like) : Tensor();  // act(a), before zoneout
    Tensor gh = ln ? new_buffer({keep, B, H}, like) : Tensor();
    Tensor stats = ln ? new_buffer({2, keep, B}, like) : Tensor();
    Tensor act_tmp = training ? Tensor() : new_buffer({B, H}, like);

    scalar_t *y_p = y.data_ptr<scalar_t>(), *h_p = h.data_ptr<scalar_t>();
    scalar_t* hin_p = h_in.data_ptr<scalar_t>();
    scalar_t* ht_p = training ? h_tilde.data_ptr<scalar_t>() : nullptr;
    scalar_t* tmp_p = training ? nullptr : act_tmp.data_ptr<scalar_t>();
    scalar_t* gh_p = ln ? gh.data_ptr<scalar_t>() : nullptr;
    scalar_t* st_p = ln ? stats.data_ptr<scalar_t>() : nullptr;

    const PackedRight<scalar_t> R_right = right_operand<scalar_t>(a, kR, 0, true, B, H, H, like);  // · Rᵀ
    for (int64_t s = 0; s < T; ++s) {
      const int64_t t = step_time(s), k = training ? t : 0;
      scalar_t* gx_t = steps.step<scalar_t>(s, t);
      scalar_t* gh_t = ln ? gh_p + k * B * H : nullptr;
      if (ln) {
        R_right.multiply(hin_p, H, 0, gh_t, H);  // R h
      } else {
        R_right.multiply(hin_p, H, 1, gx_t, H);  // W x + b + R h
      }
      for_rows(B, H * 4, [&](int64_t b0, int64_t b1) {
        if (ln) steps.prepare_rows(t, static_cast<const scalar_t*>(gh_t), b0, b1);
        for (int64_t b = b0; b < b1; ++b) {
          scalar_t* hb = h_p + b * H;
          scalar_t* yb = y_p + (t * B + b) * H;
          if (!valid(t, b)) {
            std::fill(yb, yb + H, scalar_t(0));
            if (ln) steps.skipped_row<scalar_t>(t, b);  // the backward reads LN_x's statistics of every row
            continue;
          }
          const scalar_t* ax = gx_t + b * H;
          scalar_t* act = training ? ht_p + (t * B + b) * H : tmp_p + b * H;  // h̃ = act(a)
          if (ln) {  // a = (LN_x(W x) + biases) + LN_h(R h)
            using Vec = at::vec::Vectorized<scalar_t>;
            const scalar_t* ghb = gh_t + b * H;
            const auto row = steps.normalized_row(t, b, ghb);
            st_p[k * B + b] = row.h_mean, st_p[keep * B + k * B + b] = row.h_rstd;
            vec_loop<scalar_t>(H, [&](int64_t j, int64_t n) {
              Vec x = row.input(j, n);
              if (bias_p) x = x + vload(bias_p + j, n);
              vstore(x + row.recurrent(j, n), act + j, n);
            });
          } else {
            std::copy(ax, ax + H, act);
          }
          if (relu) {
            for (int64_t j = 0; j < H; ++j) act[j] = std::max(act[j], scalar_t(0));
          } else {
            tanh_inplace(act, H, quick);
          }
          const scalar_t* d = zh.row(t, b);
          const bool zoned = zh.on();  // without zoneout h is act itself: 0 · h_prev is NaN where h_prev is ±inf
          for (int64_t j = 0; j < H; ++j) {
            const scalar_t zo = d ? d[j] : zh.p;
            const scalar_t hn = zoned ? zo * hb[j] + (scalar_t(1) - zo) * act[j] : act[j];
            hb[j] = hn;
            yb[j] = hn;
            if (rm) hin_p[b * H + j] = hn * rm[b * H + j];
          }
        }
      });
    }

    std::vector<Tensor> out = {y, h, Tensor()};
    if (training) {
      zero_masked_rows(a, h_tilde);
      if (ln) zero_masked_rows(a, stats[0]), zero_masked_rows(a, stats[1]);
      saved[kGates] = h_tilde;
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
    const PackedRight<scalar_t> R_right = backward_operand<scalar_t>(a, kR, 0, B, H, H, like);  // · R
    // A bfloat16 module's dG rounded a step at a time (pass.h); dA and dgh then held for one step
    // where the roundings are all that read them after it
    const RoundedSteps rounded = rounded_steps<scalar_t>(a, R_right, !ln, needs, T, B, H);
    const bool dA_one_step = rounded.on && !ln, dgh_one_step = rounded.on;
    Tensor dA = new_buffer({dA_one_step ? 1 : T, B, H}, like);
    Tensor dgh = ln ? new_buffer({dgh_one_step ? 1 : T, B, H}, like) : dA;
    Tensor acc_ln_h = ln ? zero_buffer({2, B, H}, like) : Tensor();
    // The bias gradient Σ dA summed per batch row as each row is written (lstm.cpp); under layer
    // norm LN_h's β accumulator has it
    const bool bias_grad = !ln && (a.b_W.defined() || a.b_R.defined());
    Tensor acc_bias = bias_grad ? zero_buffer({B, H}, like) : Tensor();
    scalar_t* ab_p = bias_grad ? acc_bias.data_ptr<scalar_t>() : nullptr;

    const Tensor h_tilde = saved[kGates], hidden_prev = hidden_entering<scalar_t>(a, y);
    const scalar_t *dy_p = dy.data_ptr<scalar_t>(), *ht_p = h_tilde.data_ptr<scalar_t>();
    const scalar_t* gh_p = ln ? saved[kRecurrentRaw].data_ptr<scalar_t>() : nullptr;
    const scalar_t* mh_p = ln ? saved[kRecurrentMean].data_ptr<scalar_t>() : nullptr;
    const scalar_t* rh_p = ln ? saved[kRecurrentRstd].data_ptr<scalar_t>() : nullptr;
    scalar_t *dhd_p = dh_dir.data_ptr<scalar_t>(), *dhr_p = dh_rec.data_ptr<scalar_t>();
    scalar_t *dA_p = dA.data_ptr<scalar_t>(), *dgh_p = dgh.data_ptr<scalar_t>();
    scalar_t* alh_p = ln ? acc_ln_h.data_ptr<scalar_t>() : nullptr;

    for (int64_t s = T - 1; s >= 0; --s) {
      const int64_t t = step_time(s);
      for_rows(B, H * 4, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t row = t * B + b;
          scalar_t* dhd = dhd_p + b * H;
          const scalar_t* dhr = dhr_p + b * H;
          scalar_t* dAb = dA_p + (dA_one_step ? b : row) * H;
          scalar_t* dghb = dgh_p + (dgh_one_step ? b : row) * H;
          const bool ok = valid(t, b);
          const scalar_t* d = zh.row(t, b);
          const bool zoned = zh.on();
          const scalar_t* dyb = dy_p + row * H;
          const scalar_t* htb = ht_p + row * H;
          for (int64_t j = 0; j < H; ++j) {
            const scalar_t dstate = dhd[j] + (rm ? rm[b * H + j] * dhr[j] : dhr[j]);
            if (!ok) {
              dhd[j] = dstate;
              dAb[j] = 0;
              continue;
            }
            const scalar_t dtot = dstate + dyb[j];
            const scalar_t zo = d ? d[j] : zh.p;
            const scalar_t dht = zoned ? (scalar_t(1) - zo) * dtot : dtot;
            dhd[j] = zoned ? zo * dtot : scalar_t(0);  // no zoneout: h_prev reaches h through R alone
            const scalar_t ht = htb[j];
            dAb[j] = relu ? (ht > 0 ? dht : scalar_t(0)) : dht * (scalar_t(1) - ht * ht);
          }
          if (ab_p && ok) add_into(ab_p + b * H, dAb, H);
          if (ln) {
            if (ok) {
              row_layer_norm_backward(dAb, gh_p + row * H, H, mh_p[row], rh_p[row], ln_h_gain, dghb,
                                      alh_p + b * H, alh_p + (B + b) * H);
            } else {
              std::fill(dghb, dghb + H, scalar_t(0));
            }
          }
        }
      });
      if (!rounded.multiply_step(R_right, dgh_p, t, dhr_p, H)) {
        R_right.multiply(dgh_p + t * B * H, H, 0, dhr_p, H);  // dgh R
      }
    }

    const int64_t TB = T * B;
    WeightGrads grads(a);
    Tensor dh0 = dh_dir + (rm ? dh_rec * a.recurrent_mask : dh_rec);
    // without layer norm dgh is dA: R's and W's gradients share its preparation (lstm.cpp)
    SharedA dG_prepared = rounded.shared();
    SharedA* shared_dG = ln ? nullptr : &dG_prepared;
    if (needs.dR) {
      Tensor h_in = rm ? hidden_prev * a.recurrent_mask : hidden_prev;
      weight_gradient(a, grads.slot[kR], rounded.on ? Tensor() : dgh.view({TB, H}), h_in.view({TB, H}),
                      rounded.on ? &dG_prepared : shared_dG);
    } else {
      grads.slot[kR].zero_();
    }
    Tensor dA2 = dA_one_step ? Tensor() : dA.view({TB, H});
    if (ln) {
      const Tensor d_ln_h = acc_ln_h.sum(1);
      grads.put(kLnHGain, d_ln_h[0]), grads.put(kLnHShift, d_ln_h[1]);
      grads.put(kBiasW, d_ln_h[1]), grads.put(kBiasR, d_ln_h[1]);  // the bias sits beside LN_h's β: summed already
    } else if (bias_grad) {
      const Tensor db = at::sum(acc_bias, 0);
      grads.put(kBiasW, db), grads.put(kBiasR, db);
    }
    Tensor dx = input_projection_backward(a, dA2, saved[kInputRaw], saved[kInputMean], saved[kInputRstd], needs,
                                          grads, shared_dG);
    return {dx, dh0, Tensor(), grads.block};
  }
};

}  // namespace

ForwardResult rnn_forward(const PassArgs& a, bool training) { return dispatch_forward<Rnn>(a, training); }

BackwardResult rnn_backward(const PassArgs& a, const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy,
                             const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs) {
  return dispatch_backward<Rnn>(a, y, saved, dy, dh_n, dc_n, needs);
}

}  // namespace rnnkit
