// Fused LSTM pass (SPEC.md "Cells": gates i f g o, or i g o with coupled gates), with
// peepholes, layer norm, cell / projection clips, projection and zoneout. The reference is
// ref/lstm.py; the inner loops below follow its step line by line.
#include "passes.h"

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
  const scalar_t *R, *W_hr, *p_i, *p_f, *p_o, *rm;
  const scalar_t *ln_h_gain, *ln_h_shift, *ln_c_gain, *ln_c_shift;
  const bool* mask;
  Zoneout<scalar_t> zh, zc;

  explicit Lstm(const PassArgs& args) : a(args) {
    T = a.T, B = a.B, H = a.H, Hr = a.Hr, GH = a.GH, P = a.Hr;
    gi = 0, gf = a.coupled ? -1 : H, gg = a.coupled ? H : 2 * H, go = a.coupled ? 2 * H : 3 * H;
    proj = a.W_hr.defined(), ln = a.layer_norm(), peep = a.peephole.defined();
    cell_clip = scalar_t(a.cell_clip), proj_clip = scalar_t(a.proj_clip);
    R = a.R.data_ptr<scalar_t>();
    W_hr = proj ? a.W_hr.data_ptr<scalar_t>() : nullptr;
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
  }

  int64_t step_time(int64_t s) const { return a.reverse ? T - 1 - s : s; }
  bool valid(int64_t t, int64_t b) const { return mask == nullptr || mask[t * B + b]; }

  std::vector<Tensor> forward(bool training) {
    std::vector<Tensor> saved = saved_slots();
    const Tensor& like = a.x;
    // LN_x(W x) [T·B, G·H]; the biases are added in the pointwise pass (an addmm would first
    // broadcast-copy them over the whole [T·B, G·H] buffer).
    const Tensor bias = sum_biases(a.b_W, a.b_R);
    const scalar_t* bias_p = bias.defined() ? bias.data_ptr<scalar_t>() : nullptr;
    Tensor gx = input_projection(a, Tensor(), training, saved[kInputRaw], saved[kInputMean], saved[kInputRstd]);
    Tensor y = new_buffer({T, B, Hr}, like);
    Tensor h = a.h0.clone(), c = a.c0.clone();  // the running state [B, Hr], [B, H]
    Tensor h_in = rm ? h * a.recurrent_mask : h;  // what enters R
    // Per-step buffers: the whole sequence when training (backward reads them), one step otherwise.
    const int64_t keep = training ? T : 1;
    Tensor gates = new_buffer({keep, B, GH}, like), cell_raw = new_buffer({keep, B, H}, like);
    Tensor m = new_buffer({proj && training ? T : 1, B, H}, like);
    Tensor h_tilde = proj ? new_buffer({keep, B, P}, like) : Tensor();
    Tensor gh = ln ? new_buffer({keep, B, GH}, like) : Tensor();
    Tensor stats = ln ? new_buffer({4, keep, B}, like) : Tensor();  // mean_h, rstd_h, mean_c, rstd_c
    Tensor cell_prev = training ? new_buffer({T, B, H}, like) : Tensor();
    Tensor cell_tmp = new_buffer({keep, B, H}, like);  // tanh(LN_c(c̃)): kept per step when training
    Tensor hidden_prev = training ? new_buffer({T, B, Hr}, like) : Tensor();

    scalar_t *gx_p = gx.data_ptr<scalar_t>(), *y_p = y.data_ptr<scalar_t>(), *h_p = h.data_ptr<scalar_t>();
    scalar_t *c_p = c.data_ptr<scalar_t>(), *hin_p = h_in.data_ptr<scalar_t>();
    scalar_t *gates_p = gates.data_ptr<scalar_t>(), *craw_p = cell_raw.data_ptr<scalar_t>();
    scalar_t *m_p = m.data_ptr<scalar_t>(), *tmp_p = cell_tmp.data_ptr<scalar_t>();
    scalar_t* ht_p = proj ? h_tilde.data_ptr<scalar_t>() : nullptr;
    scalar_t* gh_p = ln ? gh.data_ptr<scalar_t>() : nullptr;
    scalar_t* st_p = ln ? stats.data_ptr<scalar_t>() : nullptr;
    scalar_t* cp_p = training ? cell_prev.data_ptr<scalar_t>() : nullptr;
    scalar_t* hp_p = training ? hidden_prev.data_ptr<scalar_t>() : nullptr;
    const int64_t stat_stride = keep * B;

    // h̃ (m, or the projection's output) -> zoneout -> state, y, and the next step's R input.
    auto finish_h = [&](int64_t t, int64_t k, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        scalar_t* hb = h_p + b * Hr;
        scalar_t* yb = y_p + (t * B + b) * Hr;
        if (training) std::copy(hb, hb + Hr, hp_p + (t * B + b) * Hr);
        if (!valid(t, b)) {
          std::fill(yb, yb + Hr, scalar_t(0));
          continue;
        }
        const scalar_t* src = proj ? ht_p + (k * B + b) * P : m_p + b * H;
        const scalar_t* d = zh.row(t, b);
        for (int64_t j = 0; j < Hr; ++j) {
          const scalar_t v = proj ? clip(src[j], proj_clip) : src[j];
          const scalar_t z = d ? d[j] : zh.p;
          const scalar_t hn = z * hb[j] + (scalar_t(1) - z) * v;
          hb[j] = hn;
          yb[j] = hn;
          if (rm) hin_p[b * Hr + j] = hn * rm[b * Hr + j];
        }
      }
    };

    const PackedRight<scalar_t> R_right(R, Hr, true, B, GH, Hr, like);  // · Rᵀ
    const std::optional<PackedRight<scalar_t>> W_hr_right =
        proj ? std::make_optional<PackedRight<scalar_t>>(W_hr, H, true, B, P, H, like) : std::nullopt;  // · W_hrᵀ
    for (int64_t s = 0; s < T; ++s) {
      const int64_t t = step_time(s), k = training ? t : 0;
      scalar_t* gx_t = gx_p + t * B * GH;
      scalar_t* gh_t = ln ? gh_p + k * B * GH : nullptr;
      if (ln) {
        R_right.multiply(hin_p, Hr, 0, gh_t, GH);  // R h [B, G·H]
      } else {
        R_right.multiply(hin_p, Hr, 1, gx_t, GH);  // W x + b + R h
      }
      for_rows(B, GH * 8, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          scalar_t* cb = c_p + b * H;
          if (training) std::copy(cb, cb + H, cp_p + (t * B + b) * H);
          if (!valid(t, b)) {
            if (proj) std::fill(m_p + (k * B + b) * H, m_p + (k * B + b + 1) * H, scalar_t(0));
            continue;
          }
          const scalar_t* ax = gx_t + b * GH;
          scalar_t* gate = gates_p + (k * B + b) * GH;
          scalar_t* craw = craw_p + (k * B + b) * H;
          scalar_t* mb = m_p + ((proj ? k : 0) * B + b) * H;
          scalar_t mh = 0, rh = 0;
          const scalar_t* ghb = ln ? gh_t + b * GH : nullptr;
          if (ln) {
            row_stats(ghb, GH, mh, rh);
            st_p[k * B + b] = mh, st_p[stat_stride + k * B + b] = rh;
          }
          if (ln) {
            if (bias_p) {
              for (int64_t q = 0; q < GH; ++q)
                gate[q] = ax[q] + bias_p[q] + ((ghb[q] - mh) * rh * ln_h_gain[q] + ln_h_shift[q]);
            } else {
              for (int64_t q = 0; q < GH; ++q) gate[q] = ax[q] + (ghb[q] - mh) * rh * ln_h_gain[q] + ln_h_shift[q];
            }
          } else if (bias_p) {
            for (int64_t q = 0; q < GH; ++q) gate[q] = ax[q] + bias_p[q];
          } else {
            std::copy(ax, ax + GH, gate);
          }
          if (peep) {  // i and f peek at c_{t-1}
            for (int64_t j = 0; j < H; ++j) gate[gi + j] += p_i[j] * cb[j];
            if (gf >= 0)
              for (int64_t j = 0; j < H; ++j) gate[gf + j] += p_f[j] * cb[j];
          }
          sigmoid_inplace(gate + gi, gf < 0 ? H : 2 * H);  // i (and f, stored next to it)
          tanh_inplace(gate + gg, H);
          scalar_t* cc = tmp_p + (k * B + b) * H;  // clipped c̃, then tanh(LN_c(c̃))
          const scalar_t* dc = zc.row(t, b);
          for (int64_t j = 0; j < H; ++j) {
            const scalar_t cprev = cb[j], i = gate[gi + j];
            const scalar_t f = gf < 0 ? scalar_t(1) - i : gate[gf + j];
            const scalar_t c_new = f * cprev + i * gate[gg + j];
            const scalar_t c_clip = clip(c_new, cell_clip);
            const scalar_t z = dc ? dc[j] : zc.p;
            craw[j] = c_new;
            cc[j] = c_clip;
            cb[j] = z * cprev + (scalar_t(1) - z) * c_clip;
          }
          if (peep)  // o peeks at the new c
            for (int64_t j = 0; j < H; ++j) gate[go + j] += p_o[j] * cc[j];
          sigmoid_inplace(gate + go, H);
          if (ln) {
            scalar_t mc, rc;
            row_stats(cc, H, mc, rc);
            st_p[2 * stat_stride + k * B + b] = mc, st_p[3 * stat_stride + k * B + b] = rc;
            for (int64_t j = 0; j < H; ++j) cc[j] = (cc[j] - mc) * rc * ln_c_gain[j] + ln_c_shift[j];
          }
          tanh_inplace(cc, H);
          for (int64_t j = 0; j < H; ++j) mb[j] = gate[go + j] * cc[j];
        }
        if (!proj) finish_h(t, k, b0, b1);
      });
      if (proj) {
        scalar_t* ht_t = ht_p + k * B * P;
        W_hr_right->multiply(m_p + k * B * H, H, 0, ht_t, P);  // W_hr m [B, P]
        for_rows(B, P * 2, [&](int64_t b0, int64_t b1) { finish_h(t, k, b0, b1); });
      }
    }

    std::vector<Tensor> out = {y, h, c};
    if (training) {
      saved[kGates] = gates, saved[kCellRaw] = cell_raw, saved[kCellPrev] = cell_prev;
      saved[kHiddenPrev] = hidden_prev;
      if (ln) {
        saved[kRecurrentRaw] = gh, saved[kRecurrentMean] = stats[0], saved[kRecurrentRstd] = stats[1];
        saved[kCellMean] = stats[2], saved[kCellRstd] = stats[3];
      }
      if (proj) saved[kProjIn] = m, saved[kProjOut] = h_tilde;
      saved[kCellTanh] = cell_tmp;
      out.insert(out.end(), saved.begin(), saved.end());
    }
    return out;
  }

  std::vector<Tensor> backward(const std::vector<OptTensor>& saved, const std::vector<Tensor>& grads,
                               bool need_dx) {
    const Tensor& like = a.x;
    const Tensor dy = grads[0].contiguous();
    Tensor dh_dir = grads[1].contiguous().clone();  // dL/dh reaching h directly (zoneout, lengths)
    Tensor dh_rec = zero_buffer({B, Hr}, like);     // dL/d(h that entered R), from the later step
    Tensor dc = grads[2].contiguous().clone();
    Tensor dA = new_buffer({T, B, GH}, like);  // dL/d pre-activations (after LN, before biases)
    Tensor dgh = ln ? new_buffer({T, B, GH}, like) : dA;  // dL/d(R h)
    Tensor dht = proj ? new_buffer({T, B, P}, like) : Tensor();
    Tensor dm = new_buffer({B, H}, like);
    Tensor scratch = new_buffer({B, 3, H}, like);  // per row: clipped c̃, tanh(LN_c(c̃)), dL/dcn
    const int64_t n_peep = peep ? a.peephole.size(0) : 0;
    Tensor acc_peep = peep ? zero_buffer({B, n_peep, H}, like) : Tensor();
    Tensor acc_ln_h = ln ? zero_buffer({2, B, GH}, like) : Tensor();
    Tensor acc_ln_c = ln ? zero_buffer({2, B, H}, like) : Tensor();

    const Tensor gates = slot(saved, kGates), cell_raw = slot(saved, kCellRaw);
    const Tensor cell_prev = slot(saved, kCellPrev), hidden_prev = slot(saved, kHiddenPrev);
    const scalar_t *dy_p = dy.data_ptr<scalar_t>(), *gates_p = gates.data_ptr<scalar_t>();
    const scalar_t *craw_p = cell_raw.data_ptr<scalar_t>(), *cp_p = cell_prev.data_ptr<scalar_t>();
    const scalar_t* gh_p = ln ? slot(saved, kRecurrentRaw).data_ptr<scalar_t>() : nullptr;
    const scalar_t* mh_p = ln ? slot(saved, kRecurrentMean).data_ptr<scalar_t>() : nullptr;
    const scalar_t* rh_p = ln ? slot(saved, kRecurrentRstd).data_ptr<scalar_t>() : nullptr;
    const scalar_t* mc_p = ln ? slot(saved, kCellMean).data_ptr<scalar_t>() : nullptr;
    const scalar_t* rc_p = ln ? slot(saved, kCellRstd).data_ptr<scalar_t>() : nullptr;
    const scalar_t* ht_p = proj ? slot(saved, kProjOut).data_ptr<scalar_t>() : nullptr;
    const Tensor cell_tanh = slot(saved, kCellTanh);
    const scalar_t* tanh_p = cell_tanh.defined() ? cell_tanh.data_ptr<scalar_t>() : nullptr;
    scalar_t *dhd_p = dh_dir.data_ptr<scalar_t>(), *dhr_p = dh_rec.data_ptr<scalar_t>();
    scalar_t *dc_p = dc.data_ptr<scalar_t>(), *dA_p = dA.data_ptr<scalar_t>(), *dgh_p = dgh.data_ptr<scalar_t>();
    scalar_t* dht_p = proj ? dht.data_ptr<scalar_t>() : nullptr;
    scalar_t* dm_p = dm.data_ptr<scalar_t>();
    scalar_t* sc_p = scratch.data_ptr<scalar_t>();
    scalar_t* ap_p = peep ? acc_peep.data_ptr<scalar_t>() : nullptr;
    scalar_t* alh_p = ln ? acc_ln_h.data_ptr<scalar_t>() : nullptr;
    scalar_t* alc_p = ln ? acc_ln_c.data_ptr<scalar_t>() : nullptr;

    // dL/dh_t -> through zoneout (and the projection clip) -> dL/dh̃ in dm (no projection) or dht.
    auto backward_h = [&](int64_t t, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        scalar_t* dhd = dhd_p + b * Hr;
        const scalar_t* dhr = dhr_p + b * Hr;
        const bool ok = valid(t, b);
        scalar_t* out = proj ? dht_p + (t * B + b) * P : dm_p + b * H;
        const scalar_t* d = zh.row(t, b);
        const scalar_t* dyb = dy_p + (t * B + b) * Hr;
        const scalar_t* htb = proj ? ht_p + (t * B + b) * P : nullptr;
        for (int64_t j = 0; j < Hr; ++j) {
          const scalar_t dstate = dhd[j] + (rm ? rm[b * Hr + j] * dhr[j] : dhr[j]);
          if (!ok) {
            dhd[j] = dstate;
            if (proj) out[j] = 0;
            continue;
          }
          const scalar_t dtot = dstate + dyb[j];
          const scalar_t z = d ? d[j] : zh.p;
          scalar_t dtilde = (scalar_t(1) - z) * dtot;
          if (proj && proj_clip > 0 && std::abs(htb[j]) > proj_clip) dtilde = 0;
          out[j] = dtilde;
          dhd[j] = z * dtot;
        }
      }
    };

    // dL/dm -> the gates, c_{t-1}, peepholes and LN_c; dA and dL/d(R h) of step t.
    auto backward_gates = [&](int64_t t, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t row = t * B + b;
        scalar_t* dAb = dA_p + row * GH;
        if (!valid(t, b)) {
          std::fill(dAb, dAb + GH, scalar_t(0));
          if (ln) std::fill(dgh_p + row * GH, dgh_p + (row + 1) * GH, scalar_t(0));
          continue;
        }
        const scalar_t* gate = gates_p + row * GH;
        const scalar_t* craw = craw_p + row * H;
        const scalar_t* cprev = cp_p + row * H;
        const scalar_t* dmb = dm_p + b * H;
        scalar_t* dcb = dc_p + b * H;
        scalar_t* cc = sc_p + b * 3 * H;  // clipped c̃
        scalar_t* tc_buf = cc + H;         // tanh(LN_c(c̃)) recomputed when not saved
        const scalar_t* tc = tc_buf;
        scalar_t* dcn = cc + 2 * H;        // dL/d LN_c(c̃), then dL/dc̃ through LN_c
        scalar_t mc = 0, rc = 0;
        if (ln) mc = mc_p[row], rc = rc_p[row];
        if (ln || peep)
          for (int64_t j = 0; j < H; ++j) cc[j] = clip(craw[j], cell_clip);
        if (tanh_p) {
          tc = tanh_p + row * H;  // saved by the forward
        } else {
          for (int64_t j = 0; j < H; ++j) {
            cc[j] = clip(craw[j], cell_clip);
            tc_buf[j] = ln ? (cc[j] - mc) * rc * ln_c_gain[j] + ln_c_shift[j] : cc[j];
          }
          tanh_inplace(tc_buf, H);
        }
        if (ln) {
          for (int64_t j = 0; j < H; ++j) dcn[j] = dmb[j] * gate[go + j] * (scalar_t(1) - tc[j] * tc[j]);
          row_layer_norm_backward(dcn, cc, H, mc, rc, ln_c_gain, dcn, alc_p + b * H, alc_p + (B + b) * H);
        }
        const scalar_t* dz = zc.row(t, b);
        for (int64_t j = 0; j < H; ++j) {
          const scalar_t i = gate[gi + j], g = gate[gg + j], o = gate[go + j];
          const scalar_t f = gf < 0 ? scalar_t(1) - i : gate[gf + j];
          const scalar_t cp = cprev[j], tcj = tc[j];
          const scalar_t dct0 = ln ? dcn[j] : dmb[j] * o * (scalar_t(1) - tcj * tcj);
          const scalar_t dao = dmb[j] * tcj * o * (scalar_t(1) - o);
          const scalar_t z = dz ? dz[j] : zc.p;
          scalar_t dct = dct0 + dcb[j] * (scalar_t(1) - z);
          if (peep) dct += dao * p_o[j];
          if (cell_clip > 0 && std::abs(craw[j]) > cell_clip) dct = 0;
          const scalar_t dai = (gf < 0 ? dct * (g - cp) : dct * g) * i * (scalar_t(1) - i);
          const scalar_t daf = gf < 0 ? scalar_t(0) : dct * cp * f * (scalar_t(1) - f);
          const scalar_t dag = dct * i * (scalar_t(1) - g * g);
          scalar_t dcp = dcb[j] * z + dct * f;
          if (peep) {
            scalar_t* ap = ap_p + b * n_peep * H;
            dcp += dai * p_i[j];
            ap[j] += dai * cp;
            if (gf >= 0) {
              dcp += daf * p_f[j];
              ap[H + j] += daf * cp;
            }
            ap[(n_peep - 1) * H + j] += dao * cc[j];
          }
          dcb[j] = dcp;
          dAb[gi + j] = dai, dAb[gg + j] = dag, dAb[go + j] = dao;
          if (gf >= 0) dAb[gf + j] = daf;
        }
        if (ln) {
          row_layer_norm_backward(dAb, gh_p + row * GH, GH, mh_p[row], rh_p[row], ln_h_gain, dgh_p + row * GH,
                                  alh_p + b * GH, alh_p + (B + b) * GH);
        }
      }
    };

    const PackedRight<scalar_t> R_right(R, Hr, false, B, Hr, GH, like);  // · R
    const std::optional<PackedRight<scalar_t>> W_hr_right =
        proj ? std::make_optional<PackedRight<scalar_t>>(W_hr, H, false, B, H, P, like) : std::nullopt;  // · W_hr
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
      R_right.multiply(dgh_p + t * B * GH, GH, 0, dhr_p, Hr);  // dgh R
    }

    const int64_t TB = T * B;
    Tensor dh0 = dh_dir + (rm ? dh_rec * a.recurrent_mask : dh_rec);
    Tensor h_in = rm ? hidden_prev * a.recurrent_mask : hidden_prev;
    Tensor dR = at::mm(dgh.view({TB, GH}).t(), h_in.view({TB, Hr}));
    Tensor dA2 = dA.view({TB, GH});
    Tensor db = at::sum(dA2, 0);
    auto inp = input_projection_backward(a, dA2, slot(saved, kInputRaw), slot(saved, kInputMean),
                                         slot(saved, kInputRstd), need_dx);
    Tensor dW_hr = proj ? at::mm(dht.view({TB, P}).t(), slot(saved, kProjIn).view({TB, H})) : Tensor();
    Tensor dpeep = peep ? acc_peep.sum(0) : Tensor();
    Tensor d_ln_h = ln ? acc_ln_h.sum(1) : Tensor(), d_ln_c = ln ? acc_ln_c.sum(1) : Tensor();
    return {inp[0],
            dh0,
            dc,
            inp[1],
            dR,
            or_undefined(a.b_W.defined(), db),
            or_undefined(a.b_R.defined(), db),
            dW_hr,
            dpeep,
            inp[2],
            inp[3],
            ln ? d_ln_h[0] : Tensor(),
            ln ? d_ln_h[1] : Tensor(),
            ln ? d_ln_c[0] : Tensor(),
            ln ? d_ln_c[1] : Tensor()};
  }
};

}  // namespace

std::vector<Tensor> lstm_forward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                 bool training) {
  return dispatch_forward<Lstm>(tensors, scalars, training);
}

std::vector<Tensor> lstm_backward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                  const std::vector<OptTensor>& saved, const std::vector<Tensor>& grads, bool need_dx) {
  return dispatch_backward<Lstm>(tensors, scalars, saved, grads, need_dx);
}

}  // namespace rnnkit
