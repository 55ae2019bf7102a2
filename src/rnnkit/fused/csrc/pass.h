// One layer-direction pass: what it receives (PassArgs, filled by name from the op schema of
// rnnkit/passes.py), what its training forward keeps for the backward (Saved), the gradient block
// its backward writes (WeightGrads), and the pieces the three cell families share.
//
// Layout of every pass (docs/spec.md): x [T, B, I], h [B, Hr], c [B, H], gates stacked along the
// feature axis in the spec's order. All matrices are row-major and contiguous.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <array>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "bgemm.h"
#include "buffers.h"
#include "fgemm.h"
#include "gemm.h"
#include "layer_norm.h"
#include "simd.h"

namespace rnnkit {

// The weights of a pass in the packed buffer's order (params.py, cell_pieces): also the order of
// the one gradient block a backward returns.
enum WeightSlot : int {
  kW, kR, kBiasW, kBiasR, kWhr, kPeephole,
  kLnXGain, kLnXShift, kLnHGain, kLnHShift, kLnCGain, kLnCShift,
  kNumWeightSlots
};

// Slots of the saved list (an empty tensor where a configuration keeps nothing); no two alias each
// other (they are the outputs of a custom op). The output y is saved by the caller and handed back
// to the backward beside this list (a half-precision call's backward reads kOutput instead).
enum Saved : int {
  kInputRaw, kInputMean, kInputRstd,  // W x before LN_x [T·B, G·H], its row statistics [T·B, 1]
  kGates,                             // post-activation gates [T, B, ·]
  kCellPrev,                          // LSTM: c entering each step [T, B, H]
  kRecurrentRaw, kRecurrentMean, kRecurrentRstd,  // R h before LN_h [T, B, G·H], its statistics [T, B]
  kCellMean, kCellRstd,               // LSTM: LN_c statistics [T, B]
  kProjClipped,                       // LSTM: |W_hr m| > proj_clip [T, B, P] (bool; with a proj clip)
  kOutput,                            // a half-precision call's y in float32 [T, B, Hr] (ops.cpp, HalfCall)
  kNumSaved
};

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

// Everything one pass receives. ops.cpp fills the named fields from the op's arguments and
// calls finish(), which checks them and derives the sizes and the step mask.
struct PassArgs {
  std::string mode;  // "lstm", "gru", "rnn_tanh", "rnn_relu"
  Tensor x, h0, c0;
  // A half-precision call's x as given (ops.cpp, HalfCall), bfloat16 / float16 [T, B, I]; `x` is
  // then a float32 buffer of its shape that x_values() fills on first use: the CPU's bfloat16
  // products read a bfloat16 x_half as it is (W x, W's gradient: bf16_x_rows), so the values are
  // widened only where something reads x in float32.
  Tensor x_half;
  Tensor W, R, b_W, b_R, W_hr, peephole;
  Tensor ln_x_gain, ln_x_shift, ln_h_gain, ln_h_shift, ln_c_gain, ln_c_shift;
  Tensor lengths, recurrent_mask, zoneout_h, zoneout_c;
  double zoneout_h_p = 0, zoneout_c_p = 0, cell_clip = 0, proj_clip = 0;  // clips: 0 = off
  bool coupled = false, reset_after = true, reverse = false, relu = false;
  // int8 inference (rnnkit.quantize): W, R, W_hr int8 [rows, cols] with a float scale per row.
  Tensor W_scale, R_scale, W_hr_scale;
  // derived by finish()
  Tensor step_mask;  // [T, B] bool, true where t < length (undefined without lengths)
  int64_t T = 0, B = 0, I = 0, H = 0, Hr = 0, GH = 0;

  void finish();
  void check_sizes() const;
  // x's values [T, B, I] in the pass's dtype: x, filled from x_half first where it was deferred.
  // Called outside parallel regions (the step loops' InputSteps, the backward's input projection).
  const Tensor& x_values() const;
  // x_half's rows [T·B, I] as the bfloat16 products take them as operands (bfloat16 bits, I even:
  // whole pairs with no padding), where they do: else an undefined tensor (then x_values()).
  Tensor bf16_x_rows() const;
  mutable bool x_deferred = false;  // x not filled yet (see x_half)
  const Tensor& weight(WeightSlot slot) const;
  bool layer_norm() const { return ln_h_gain.defined(); }
  bool quantized() const { return W.scalar_type() == at::kChar; }
  // A bfloat16 / float16 module: W, R (and W_hr) in that dtype, read by the GEMMs as they are
  // (gemm.h, bgemm.h); x, the states, every other weight and the gradients float32 here (a
  // half-precision call's widened by ops.cpp's HalfCall, its x kept in x_half).
  bool half_weights() const { return W.scalar_type() == at::kBFloat16 || W.scalar_type() == at::kHalf; }
  // σ and tanh in their quick forms (simd.h: within 2.5 float32 ulp, not 1.5) in a forward pass:
  // int8 inference, and a bfloat16 module's call without a gradient on the bfloat16 kernels, whose
  // products round h to bfloat16 at every step (2⁻⁹ relative, ~10⁴ times the quick forms' error).
  // A pass that will be differentiated keeps float32's forms, so its results and gradients are the
  // float32 reference's on the same roundings (tests/test_fused_half.py); a bfloat16 module whose
  // matrices are widened instead (kernels "none") computes float32's pass exactly.
  bool quick_activations(bool training) const {
    return quantized() || (!training && W.scalar_type() == at::kBFloat16 && bf16_products());
  }
  // Rows [first_row, ...) of a half-precision weight (W, R or W_hr).
  HalfRows half_rows(WeightSlot slot, int64_t first_row) const;
  // Rows [first_row, ...) of an int8 weight (W, R or W_hr) and their scales.
  QuantizedRows quantized_rows(WeightSlot slot, int64_t first_row) const;
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

// The right operand X · op(M) of a per-step GEMM, M = rows [first_row, first_row + N) of weight
// `slot` (float / double; int8 under quantized inference, or bfloat16 / float16 in a half-precision
// module's inference, where op(M) = Mᵀ).
template <typename scalar_t>
PackedRight<scalar_t> right_operand(const PassArgs& a, WeightSlot slot, int64_t first_row, bool trans, int64_t rows,
                                    int64_t N, int64_t K, const Tensor& like) {
  if (a.quantized()) {
    TORCH_CHECK(trans, "rnnkit fused: int8 weights are for inference (no backward)");
    const bool once = a.T == 1 && rows <= kUnpackedRows;  // a few rows, once (one step): not worth packing
    return PackedRight<scalar_t>(a.quantized_rows(slot, first_row), rows, N, K, a.weight(slot), !once);
  }
  if (a.half_weights()) {
    TORCH_CHECK(trans, "rnnkit fused: a backward's products take backward_operand");
    return PackedRight<scalar_t>(a.half_rows(slot, first_row), rows, N, K, like, a.T > 1);
  }
  const Tensor& M = a.weight(slot);
  const int64_t ld = M.size(1);
  // one step: M multiplies once (forward) or twice at most (backward), not worth packing
  return PackedRight<scalar_t>(M.data_ptr<scalar_t>() + first_row * ld, ld, trans, rows, N, K, like, a.T > 1);
}

// The right operand X · M of a backward's per-step GEMM, M = rows [first_row, first_row + K) of
// weight `slot` as [K, N] (float / double, or a half-precision module's matrices: widened to
// float32 once, or packed for the CPU's bfloat16 products, bgemm.h).
template <typename scalar_t>
PackedRight<scalar_t> backward_operand(const PassArgs& a, WeightSlot slot, int64_t first_row, int64_t rows, int64_t N,
                                       int64_t K, const Tensor& like) {
  if (a.half_weights()) return PackedRight<scalar_t>(a.half_rows(slot, first_row), rows, N, K, like, a.T > 1, true);
  const Tensor& M = a.weight(slot);
  const int64_t ld = M.size(1);
  return PackedRight<scalar_t>(M.data_ptr<scalar_t>() + first_row * ld, ld, false, rows, N, K, like, a.T > 1);
}

// Where two weight gradients take the same A (dR and dW without layer norm: dG both), A as their
// products read it: packed in the own float32 kernels' panels by the first of them (a float32
// gradient too large to read A in place, f32_weight_gradient_packed), or rounded to bfloat16 and
// transposed (the bfloat16 products): by the first of them for the GRU; the LSTM and the RNN fill
// `bf16`, and `bf16_rows` (A rounded as rows: dx's operand), a step at a time as they write dG and
// then pass an undefined A (RoundedSteps below).
struct SharedA {
  Bf16RoundedX bf16;
  Bf16RoundedX bf16_rows;
  Tensor f32_panels;
};

// A weight's gradient out[N, K] = Aᵀ · B over the T·B rows of A [T·B, N] and B [T·B, K] (float32 or
// float64; out row-major with unit stride). A half-precision module's on the CPU's bfloat16
// products (both operands rounded to bfloat16, sums float32) where it has them (bgemm.h), else
// the float GEMM: float32 on the own kernels where they take the weight gradients (AVX-512,
// f32_own_weight_gradients: f32_gemm_at_b reading both in place up to 2²¹ floats of A,
// f32_weight_gradient_packed above), else MKL's.
// `shared_A`: the caller's slot for an A that two gradients take (SharedA), or null; A undefined
// when the caller filled shared_A->bf16.
void weight_gradient(const PassArgs& a, const Tensor& out, const Tensor& A, const Tensor& B,
                     SharedA* shared_A = nullptr);

// out = Aᵀ · B in float32 as (Bᵀ · A)ᵀ on the own packed kernels: A [rows, N] packed once as the
// right operand (f32_pack_transposed: panels of 16 of its columns, kept in *panels when given and
// empty, or taken from it when filled), Bᵀ read from B [rows, K] in place as the left operand
// (f32_gemm_packed_xt), the [K, N] product transposed into out [N, K] in 16 x 16 blocks. MKL's
// sgemm of Aᵀ · B measured 86-93 GFLOP/s on the LSTM grid's medium to wide gradients, this 93-100
// (AMD EPYC Zen 4, 1 thread, benchmarks/results/2026-11-28s-fp32-weight-gradients.md).
void f32_weight_gradient_packed(const Tensor& out, const Tensor& A, const Tensor& B, Tensor* panels = nullptr);

// out = Aᵀ · B on the bfloat16 kernels (bf16_products()): both float32 operands read in place and
// rounded to bfloat16 (A transposed as it is rounded, B packed), sums in float32. A [rows, N], B
// [rows, K], out [N, K], each with unit-stride rows: a bfloat16 module's weight gradient. Aᵀ rounded
// into *rounded_A when given and empty, or taken from it when filled (the same A: its shape checked;
// A may then be undefined).
void bf16_weight_gradient(const Tensor& out, const Tensor& A, const Tensor& B, Bf16RoundedX* rounded_A = nullptr);

// Which gradients a backward computes; the others' work is skipped (their block slices are zero).
struct GradNeeds {
  bool dx = true, dW = true, dR = true, dW_hr = true;
};

// A bfloat16 module's backward on the CPU's bfloat16 products (lstm.cpp, rnn.cpp): dG, the gradient
// entering the products with R (dA, or under layer norm LN_h's input gradient), rounded to bfloat16
// once a step while it is in cache, into what each product that takes it reads: the step's rows (its
// product with R; without layer norm dx = dA · W too, so every step's rows are kept where dx is
// needed) and their place in dGᵀ (R's gradient, and without layer norm W's: kept where one of them is
// needed). The backward then holds dG for one step, never [T, B, N] in float32: the products'
// roundings of it from memory afterwards took 5% of a medium LSTM's bfloat16 training step (Zen 4).
// Off (`on` false) for float64 passes, half matrices widened (no bfloat16 products), and T·B = 0.
struct RoundedSteps {
  bool on = false, all_rows = false;  // all_rows: every step's rows kept (dx = dA · W), else one step's
  int64_t B = 0;
  Bf16RoundedX rows, columns;  // [T·B (or B), N]; [N, T·B] (empty where no weight gradient reads it)

  // Rounds step t's dG [B, N] (float32 rows, unit stride) into both, then C = dG_t · R (R_right's
  // product on the rounded rows; beta 0). False, with nothing done, where off.
  template <typename scalar_t>
  bool multiply_step(const PackedRight<scalar_t>& R_right, const scalar_t* dG, int64_t t, scalar_t* C,
                     int64_t ldc) const {
    if constexpr (std::is_same<scalar_t, float>::value) {
      if (!on) return false;
      const int64_t first = all_rows ? t * B : 0;
      bf16_round_part(dG, B, rows.K, false, rows.K, rows, first, 0);
      if (columns.data != nullptr) bf16_round_part(dG, rows.K, rows.K, true, B, columns, 0, t * B);
      R_right.multiply(bf16_rows_of(rows, first, B), 0, C, ldc);
      return true;
    }
    return false;
  }

  // The roundings for weight_gradient (dGᵀ) and input_projection_backward (every step's rows: dx),
  // where dG is dA.
  SharedA shared() const {
    SharedA s;
    s.bf16 = columns;
    if (all_rows) s.bf16_rows = rows;
    return s;
  }
};

// `dG_is_dA`: no layer norm (dx and W's gradient take dG too). On where R_right takes rounded
// operands (the CPU's bfloat16 products on bfloat16 R) and W is bfloat16 too.
template <typename scalar_t>
RoundedSteps rounded_steps(const PassArgs& a, const PackedRight<scalar_t>& R_right, bool dG_is_dA,
                           const GradNeeds& needs, int64_t T, int64_t B, int64_t N) {
  RoundedSteps r;
  if (std::is_same<scalar_t, float>::value && T * B > 0 && R_right.takes_rounded() &&
      a.W.scalar_type() == at::kBFloat16) {
    r.on = true, r.all_rows = dG_is_dA && needs.dx, r.B = B;
    r.rows = bf16_rounded_buffer(r.all_rows ? T * B : B, N);
    if (needs.dR || (dG_is_dA && needs.dW)) r.columns = bf16_rounded_buffer(N, T * B);
  }
  return r;
}

// The one gradient block of a pass's weights, [numel of the present weights] in WeightSlot order,
// with a view per present slot that the backward writes into (so nothing is copied afterwards).
struct WeightGrads {
  explicit WeightGrads(const PassArgs& a);
  Tensor block;
  std::array<Tensor, kNumWeightSlots> slot;  // views of block; undefined where a weight is absent
  // Write `value` into a slot if the weight is present.
  void put(WeightSlot s, const Tensor& value) {
    if (slot[s].defined()) slot[s].copy_(value);
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
  // The rows of step() are W x + bias; under layer norm W x as it is (no bias), which the cell's
  // loop normalizes itself (prepare_rows, normalized_row), in the pass that adds LN_h(R h) and the
  // biases: one pass over the row instead of two, the two rows' statistics computed side by side.
  InputSteps(const PassArgs& a, const Tensor& bias, bool training, Tensor& raw, Tensor& mean, Tensor& rstd);
  // The [B, G·H] rows of time step t, the s-th step the loop runs (s = 0, 1, ... in order).
  template <typename scalar_t>
  scalar_t* step(int64_t s, int64_t t) {
    if (s % chunk_steps_ == 0) compute_chunk(s);
    return out_.data_ptr<scalar_t>() + (training_ ? t : t - first_) * a_.B * a_.GH;
  }
  // Under layer norm, row b of step t (after step(s, t)): W x as it is (in inference the step's
  // own row, which the loop may overwrite) and `recurrent` (that row's R h), with the statistics
  // of LN_x and LN_h over them (prepare_rows, before the loop's work on the rows). input()
  // and recurrent() are the normalized Vecs at column q, in layer_norm_apply's one expression (the
  // GRU and RNN); the LSTM reads the fields and folds the shifts itself (lstm.cpp).
  template <typename scalar_t>
  struct NormalizedRow {
    using Vec = at::vec::Vectorized<scalar_t>;
    const scalar_t *raw, *rec, *x_gain, *x_shift, *h_gain, *h_shift;
    scalar_t h_mean, h_rstd;  // the cells keep these for the backward
    Vec xm, xr, hm, hr;
    Vec input(int64_t q, int64_t n) const { return layer_norm_apply(vload(raw + q, n), xm, xr, x_gain, x_shift, q, n); }
    Vec recurrent(int64_t q, int64_t n) const {
      return layer_norm_apply(vload(rec + q, n), hm, hr, h_gain, h_shift, q, n);
    }
  };
  // Under layer norm, before normalized_row of rows [b0, b1) of step t: the statistics of LN_x and
  // LN_h of those rows that run (W x's rows, and `recurrent`, the step's R h [B, G·H]), taken here
  // for all of them before any row's other work: each row's two sums walked side by side
  // (row_stats_pair), and the rows' sums, independent of each other, free to overlap where each
  // row's waited on its own chains before. With the LSTM's one shift vector (lstm.cpp), a
  // layer-norm LSTM's int8 inference at small (T 100, B 16, H 128) went from 1.19 to 1.14-1.15x
  // the plain LSTM's time (docs/speed.md). LN_x's are kept for the backward.
  template <typename scalar_t>
  void prepare_rows(int64_t t, const scalar_t* recurrent, int64_t b0, int64_t b1) {
    const LnPointers<scalar_t> p = ln_pointers<scalar_t>();
    const bool* mask = a_.mask_ptr();
    const int64_t B = a_.B, first = (training_ ? t : t - first_) * B;
    scalar_t* st = static_cast<scalar_t*>(row_stats_p_);  // [4, B]: LN_x's mean, rstd, LN_h's mean, rstd
    for (int64_t b = b0; b < b1; ++b) {
      if (mask != nullptr && !mask[t * B + b]) continue;
      scalar_t mean[2], rstd[2];
      row_stats_pair(p.rows + (first + b) * a_.GH, recurrent + b * a_.GH, a_.GH, mean, rstd);
      st[b] = mean[0], st[B + b] = rstd[0], st[2 * B + b] = mean[1], st[3 * B + b] = rstd[1];
      if (training_) p.mean[first + b] = mean[0], p.rstd[first + b] = rstd[0];
    }
  }
  // Row b of step t after prepare_rows: its normalized input and recurrent values.
  template <typename scalar_t>
  NormalizedRow<scalar_t> normalized_row(int64_t t, int64_t b, const scalar_t* recurrent) const {
    const int64_t B = a_.B, row = (training_ ? t : t - first_) * B + b;
    const LnPointers<scalar_t> p = ln_pointers<scalar_t>();
    const scalar_t* st = static_cast<const scalar_t*>(row_stats_p_);
    NormalizedRow<scalar_t> r;
    r.raw = p.rows + row * a_.GH, r.rec = recurrent;
    r.x_gain = p.x_gain, r.x_shift = p.x_shift, r.h_gain = p.h_gain, r.h_shift = p.h_shift;
    r.h_mean = st[2 * B + b], r.h_rstd = st[3 * B + b];
    r.xm = st[b], r.xr = st[B + b], r.hm = r.h_mean, r.hr = r.h_rstd;
    return r;
  }
  // A row that does not run (lengths, masks) under layer norm in training: LN_x's statistics
  // all the same, as the backward reads every row's.
  template <typename scalar_t>
  void skipped_row(int64_t t, int64_t b) {
    if (!training_) return;
    const int64_t row = t * a_.B + b;
    const LnPointers<scalar_t> p = ln_pointers<scalar_t>();
    row_stats(p.rows + row * a_.GH, a_.GH, p.mean[row], p.rstd[row]);
  }
  // Training: the whole [T·B, G·H] projection, complete once the loop has run every step.
  const Tensor& all() const { return out_; }

 private:
  void compute_chunk(int64_t s);
  const PassArgs& a_;
  bool training_, ln_;
  Tensor bias_, out_, raw_, mean_, rstd_;
  Tensor row_stats_;  // under layer norm, prepare_rows' statistics of one step's rows [4, B]
  // Under layer norm, the pointers normalized_row reads for every row of every step, taken once in
  // the constructor (per row, data_ptr's checks were 1.5% of an int8 layer-norm LSTM's time at
  // small): W x's rows (raw_ in training, else out_), LN_x's and LN_h's gains and shifts, and
  // LN_x's statistics (training), all of x's dtype.
  template <typename scalar_t>
  struct LnPointers {
    const scalar_t *rows, *x_gain, *x_shift, *h_gain, *h_shift;
    scalar_t *mean, *rstd;
  };
  template <typename scalar_t>
  LnPointers<scalar_t> ln_pointers() const {
    auto in = [](const void* p) { return static_cast<const scalar_t*>(p); };
    return {in(ln_rows_), in(ln_x_gain_), in(ln_x_shift_), in(ln_h_gain_), in(ln_h_shift_),
            static_cast<scalar_t*>(ln_mean_), static_cast<scalar_t*>(ln_rstd_)};
  }
  const void *ln_rows_ = nullptr, *ln_x_gain_ = nullptr, *ln_x_shift_ = nullptr, *ln_h_gain_ = nullptr,
             *ln_h_shift_ = nullptr;
  void *ln_mean_ = nullptr, *ln_rstd_ = nullptr, *row_stats_p_ = nullptr;
  Tensor packed_W_;  // int8 W packed by qgemm_pack, once per pass
  Tensor float_W_;   // half-precision W widened to float32 once per pass, when a chunk has many rows
  Tensor bf16_W_;    // or bfloat16 W packed by bf16_pack, where the CPU has bfloat16 dot products
  Tensor f32_W_;     // float32 W (or the widened one) packed by f32_pack for the own float32 kernels
  int64_t chunk_steps_ = 1, first_ = 0;
};

// Backward of the input projection from dA [T·B, G·H] (the gradient of its output): writes W's
// gradient and LN_x's gain / shift gradients into `grads` and returns dx (undefined unless
// needs.dx). With layer norm, dA is overwritten with the gradient of W x (callers read dA before).
// `shared_dA`: weight_gradient's shared preparation of dA (for W's gradient), where the caller's dR took it;
// dA undefined where the caller rounded it itself (SharedA's bf16 and bf16_rows filled; no layer norm).
Tensor input_projection_backward(const PassArgs& a, const Tensor& dA, const Tensor& raw, const Tensor& mean,
                                 const Tensor& rstd, const GradNeeds& needs, WeightGrads& grads,
                                 SharedA* shared_dA = nullptr);

// The sum of optional bias pieces (undefined when none): folded into the input projection.
// first + second[:second_count] (second's other entries taken as 0; second_count < 0: all of
// second), as a new vector; either may be undefined (then the other, as given, where it suffices).
Tensor sum_biases(const Tensor& first, const Tensor& second, int64_t second_count = -1);

// A pass's results: y, h_n, c_n (undefined unless LSTM), then kNumSaved saved tensors (undefined
// where nothing is kept; all undefined in inference).
using ForwardResult = std::vector<Tensor>;

// A backward's results: dx (undefined unless needed), dh0, dc0 (undefined unless LSTM), and the
// weights' gradient block.
struct BackwardResult {
  Tensor dx, dh0, dc0, dweights;
};

// The cell families (lstm.cpp, gru.cpp, rnn.cpp): forward(training) and backward(y, saved,
// dy, dh_n, dc_n) on float / double.
ForwardResult lstm_forward(const PassArgs& a, bool training);
BackwardResult lstm_backward(const PassArgs& a, const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy,
                             const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs);
ForwardResult gru_forward(const PassArgs& a, bool training);
BackwardResult gru_backward(const PassArgs& a, const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy,
                            const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs);
ForwardResult rnn_forward(const PassArgs& a, bool training);
BackwardResult rnn_backward(const PassArgs& a, const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy,
                            const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs);

// The entry points of a cell family: dispatch on float / double.
template <template <typename> class Cell>
ForwardResult dispatch_forward(const PassArgs& a, bool training) {
  ForwardResult out;
  AT_DISPATCH_FLOATING_TYPES(a.x.scalar_type(), "rnnkit_forward", [&] { out = Cell<scalar_t>(a).forward(training); });
  return out;
}

template <template <typename> class Cell>
BackwardResult dispatch_backward(const PassArgs& a, const Tensor& y, const std::vector<Tensor>& saved,
                                 const Tensor& dy, const Tensor& dh_n, const Tensor& dc_n, const GradNeeds& needs) {
  BackwardResult out;
  AT_DISPATCH_FLOATING_TYPES(a.x.scalar_type(), "rnnkit_backward",
                             [&] { out = Cell<scalar_t>(a).backward(y, saved, dy, dh_n, dc_n, needs); });
  return out;
}

// The rows of steps past a sequence's length, which a pass does not compute, zeroed in a training
// forward's saved buffer [T, B, ...] (contiguous): what the op returns is then a function of its
// inputs (torch.library's contract), whatever the buffer held before.
inline void zero_masked_rows(const PassArgs& a, const Tensor& buf) {
  const bool* mask = a.mask_ptr();
  if (mask == nullptr || a.T * a.B == 0) return;
  const int64_t n = buf.numel() / (a.T * a.B);
  AT_DISPATCH_FLOATING_TYPES(buf.scalar_type(), "rnnkit_zero_masked_rows", [&] {
    scalar_t* p = buf.data_ptr<scalar_t>();
    for (int64_t r = 0; r < a.T * a.B; ++r)
      if (!mask[r]) std::fill(p + r * n, p + (r + 1) * n, scalar_t(0));
  });
}

// Saved-list helper shared by the three families.
inline std::vector<Tensor> saved_slots() { return std::vector<Tensor>(kNumSaved); }

}  // namespace rnnkit
