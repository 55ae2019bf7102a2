// The shared pieces of a pass (pass.h): argument checks, the gradient block, the input projection.
#include "pass.h"

namespace rnnkit {

void PassArgs::finish() {
  TORCH_CHECK(x.dim() == 3, "rnnkit fused: x must be [T, B, I], got ", x.sizes());
  TORCH_CHECK(mode == "lstm" || mode == "gru" || mode == "rnn_tanh" || mode == "rnn_relu",
              "rnnkit fused: mode must be lstm, gru, rnn_tanh or rnn_relu, got '", mode, "'");
  relu = mode == "rnn_relu";
  T = x.size(0), B = x.size(1), I = x.size(2);
  // Layer norm's gains and shifts come together (LN_c's only for LSTM): the passes take
  // layer_norm() to mean all of them, and a layer-norm GRU needs reset_after (docs/spec.md).
  const bool ln = layer_norm(), lstm = mode == "lstm";
  for (const Tensor* t : {&ln_x_gain, &ln_x_shift, &ln_h_gain, &ln_h_shift, &ln_c_gain, &ln_c_shift}) {
    const bool cell = t == &ln_c_gain || t == &ln_c_shift;
    TORCH_CHECK(t->defined() == (ln && (lstm || !cell)),
                "rnnkit fused: layer norm needs the gains and shifts of LN_x and LN_h (and of LN_c on an LSTM, "
                "only there), all of them or none");
  }
  TORCH_CHECK(!ln || mode != "gru" || reset_after, "rnnkit fused: a layer-norm GRU needs reset_after (docs/spec.md)");
  TORCH_CHECK(W.dim() == 2 && R.dim() == 2, "rnnkit fused: W and R must be matrices, got ", W.sizes(), " and ",
              R.sizes());
  GH = W.size(0), Hr = R.size(1);
  H = W_hr.defined() ? W_hr.size(1) : (c0.defined() ? c0.size(1) : Hr);
  check_sizes();
  if (lengths.defined()) {
    // ValueError in Python, as functional.check_lengths raises (which leaves the values to this
    // check under torch.compile and vmap)
    TORCH_CHECK_VALUE(lengths.dim() == 1 && lengths.size(0) == B, "lengths: expected shape (", B, ",), got ",
                      lengths.sizes());
    const Tensor lens = lengths.to(at::kCPU, at::kLong).contiguous();
    const int64_t* len = lens.data_ptr<int64_t>();
    step_mask = at::empty({T, B}, x.options().dtype(at::kBool));
    bool* m = step_mask.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK_VALUE(len[b] >= 1 && len[b] <= T, "lengths: expected values in [1, T=", T, "], got ", len[b],
                        " at index ", b);
      for (int64_t t = 0; t < T; ++t) m[t * B + b] = t < len[b];
    }
  }
  if (quantized()) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rnnkit fused: int8 weights take float32 inputs, got ", x.scalar_type());
    const auto check = [&](const char* name, const Tensor& w, const Tensor& scale) {
      if (!w.defined()) return;
      TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2, name, ": expected a 2-D int8 matrix, got ",
                  w.scalar_type(), " ", w.sizes());
      TORCH_CHECK(scale.defined() && scale.scalar_type() == at::kFloat && scale.dim() == 1 &&
                      scale.size(0) == w.size(0),
                  name, "_scale: expected float32 of shape (", w.size(0), ",), got ",
                  scale.defined() ? scale.sizes() : at::IntArrayRef{});
    };
    check("W", W, W_scale), check("R", R, R_scale), check("W_hr", W_hr, W_hr_scale);
  }
  if (half_weights()) {
    // (a half-precision call's x, in the matrices' dtype, reaches here widened: ops.cpp, HalfCall)
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rnnkit fused: with ", W.scalar_type(), " matrices x is float32 or ",
                W.scalar_type(), ", got x ", x.scalar_type());
    for (const auto& [name, w] : {std::pair<const char*, const Tensor*>{"R", &R}, {"W_hr", &W_hr}}) {
      TORCH_CHECK(!w->defined() || w->scalar_type() == W.scalar_type(), "rnnkit fused: ", name, ": expected ",
                  W.scalar_type(), " like W, got ", w->scalar_type());
    }
    for (const Tensor* t : {&b_W, &b_R, &peephole, &ln_x_gain, &ln_x_shift, &ln_h_gain, &ln_h_shift, &ln_c_gain,
                            &ln_c_shift, &h0, &c0, &recurrent_mask, &zoneout_h, &zoneout_c}) {
      TORCH_CHECK(!t->defined() || t->scalar_type() == at::kFloat, "rnnkit fused: with ", W.scalar_type(),
                  " matrices and a float32 x, the biases, gains, states and masks are float32, got ",
                  t->scalar_type());
    }
  }
  // The passes read layer norm's gains and shifts as x's dtype (no per-row check), so here once
  for (const Tensor* t : {&ln_x_gain, &ln_x_shift, &ln_h_gain, &ln_h_shift, &ln_c_gain, &ln_c_shift}) {
    TORCH_CHECK(!t->defined() || t->scalar_type() == x.scalar_type(),
                "rnnkit fused: layer norm's gains and shifts: expected ", x.scalar_type(), " like x, got ",
                t->scalar_type());
  }
}

// Every tensor's shape against the sizes finish() derived: the kernels index them with those
// sizes, so a mismatch would read or write past an allocation.
void PassArgs::check_sizes() const {
  const bool lstm = mode == "lstm";
  const int64_t G = lstm ? (coupled ? 3 : 4) : (mode == "gru" ? 3 : 1);
  TORCH_CHECK(GH == G * H, "rnnkit fused: W has ", GH, " rows, expected ", G, " gates of H = ", H);
  // (an IntArrayRef over the braced list: no allocation; a one-step plan runs this at every step)
  const auto expect = [](const char* name, const Tensor& t, at::IntArrayRef sizes) {
    TORCH_CHECK(!t.defined() || t.sizes() == sizes, "rnnkit fused: ", name, ": expected shape ", sizes, ", got ",
                t.sizes());
  };
  expect("W", W, {GH, I});
  expect("R", R, {GH, Hr});
  expect("b_W", b_W, {GH});
  expect("b_R", b_R, {GH});
  TORCH_CHECK(W_hr.defined() || Hr == H, "rnnkit fused: R has ", Hr, " columns, expected H = ", H, " without W_hr");
  expect("W_hr", W_hr, {Hr, H});
  expect("peephole", peephole, {coupled ? 2 : 3, H});
  TORCH_CHECK(!peephole.defined() || lstm, "rnnkit fused: peepholes need mode lstm, got ", mode);
  expect("ln_x_gain", ln_x_gain, {GH});
  expect("ln_x_shift", ln_x_shift, {GH});
  expect("ln_h_gain", ln_h_gain, {GH});
  expect("ln_h_shift", ln_h_shift, {GH});
  expect("ln_c_gain", ln_c_gain, {H});
  expect("ln_c_shift", ln_c_shift, {H});
  expect("h0", h0, {B, Hr});
  TORCH_CHECK(!c0.defined() || lstm, "rnnkit fused: c0 is for an LSTM, got mode ", mode);
  expect("c0", c0, {B, H});
  expect("recurrent_mask", recurrent_mask, {B, Hr});
  expect("zoneout_h", zoneout_h, {T, B, Hr});
  expect("zoneout_c", zoneout_c, {T, B, H});
}

const Tensor& PassArgs::x_values() const {
  if (x_deferred) {
    if (x.numel() > 0) {
      widen_rows(HalfRows{x_half.const_data_ptr(), I, x_half.scalar_type() == at::kBFloat16}, T * B, I,
                 x.data_ptr<float>());
    }
    x_deferred = false;  // filled once, on the pass's own thread
  }
  return x;
}

Tensor PassArgs::bf16_x_rows() const {
  if (!x_half.defined() || x_half.scalar_type() != at::kBFloat16 || W.scalar_type() != at::kBFloat16 ||
      !bf16_products() || I % 2 != 0 || T * B == 0) {
    return Tensor();
  }
  return x_half.view({T * B, I});
}

HalfRows PassArgs::half_rows(WeightSlot slot, int64_t first_row) const {
  const Tensor& w = weight(slot);
  HalfRows rows;
  rows.data = w.data_ptr(), rows.ld = w.size(1), rows.bf16 = w.scalar_type() == at::kBFloat16;
  return rows.rows_from(first_row);
}

QuantizedRows PassArgs::quantized_rows(WeightSlot slot, int64_t first_row) const {
  const Tensor& w = weight(slot);
  const Tensor& scale = slot == kW ? W_scale : (slot == kR ? R_scale : W_hr_scale);
  QuantizedRows q;
  q.ld = w.size(1);
  q.data = w.data_ptr<int8_t>() + first_row * q.ld;
  q.scale = scale.data_ptr<float>() + first_row;
  return q;
}

const Tensor& PassArgs::weight(WeightSlot slot) const {
  switch (slot) {
    case kW: return W;
    case kR: return R;
    case kBiasW: return b_W;
    case kBiasR: return b_R;
    case kWhr: return W_hr;
    case kPeephole: return peephole;
    case kLnXGain: return ln_x_gain;
    case kLnXShift: return ln_x_shift;
    case kLnHGain: return ln_h_gain;
    case kLnHShift: return ln_h_shift;
    case kLnCGain: return ln_c_gain;
    case kLnCShift: return ln_c_shift;
    default: TORCH_CHECK(false, "rnnkit fused: no weight slot ", int(slot));
  }
}

WeightGrads::WeightGrads(const PassArgs& a) {
  int64_t total = 0;
  for (int s = 0; s < kNumWeightSlots; ++s) {
    const Tensor& w = a.weight(WeightSlot(s));
    if (w.defined()) total += w.numel();
  }
  block = cached_empty({total}, a.x);
  int64_t offset = 0;
  for (int s = 0; s < kNumWeightSlots; ++s) {
    const Tensor& w = a.weight(WeightSlot(s));
    if (!w.defined()) continue;
    slot[s] = block.narrow(0, offset, w.numel()).view(w.sizes());
    offset += w.numel();
  }
}

Tensor sum_biases(const Tensor& first, const Tensor& second, int64_t second_count) {
  if (!second.defined()) return first;
  const int64_t n = second.numel(), m = second_count < 0 ? n : second_count;
  if (!first.defined() && m == n) return second;
  // A loop, not ATen's add: a one-step call (the step API) pays a TensorIterator's set-up otherwise.
  const Tensor& like = first.defined() ? first : second;
  TORCH_CHECK(second.is_contiguous() && (!first.defined() || (first.is_contiguous() && first.numel() == n &&
                                                               first.scalar_type() == second.scalar_type())),
              "rnnkit fused: biases must be contiguous vectors of one size and dtype");
  Tensor out = at::empty({n}, like.options());
  AT_DISPATCH_FLOATING_TYPES(like.scalar_type(), "rnnkit_sum_biases", [&] {
    const scalar_t* a = first.defined() ? first.data_ptr<scalar_t>() : nullptr;
    const scalar_t* b = second.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t j = 0; j < n; ++j) o[j] = (a ? a[j] : scalar_t(0)) + (j < m ? b[j] : scalar_t(0));
  });
  return out;
}

InputSteps::InputSteps(const PassArgs& a, const Tensor& bias, bool training, Tensor& raw, Tensor& mean,
                       Tensor& rstd)
    : a_(a), training_(training), ln_(a.layer_norm()), bias_(bias) {
  TORCH_CHECK(!ln_ || !bias.defined(), "rnnkit fused: under layer norm the cell adds the biases");
  // Chunks of ~256 KB of gates (they stay in L2 until their steps read them), but at least 128
  // rows and at least I rows, so each chunk's GEMM stays about as efficient as one big one
  // (measured: a wide layer, I = 1024, ran 20% slower with 128-row chunks). One batch row with
  // int8 weights: 64 rows, so that R (a quarter of float32's bytes) stays in L2 beside the chunk
  // (H = 256 streaming: 12.5 µs a step instead of 19 with 128 rows; batches lost with 64).
  const bool small = a.quantized() && a.B == 1;
  const int64_t rows = std::max({small ? int64_t(64) : std::max(int64_t(128), a.I),
                                 (int64_t(256) << 10) / (a.GH * int64_t(a.x.element_size()))});
  chunk_steps_ = std::min(a.T, std::max<int64_t>(1, rows / std::max<int64_t>(1, a.B)));
  const int64_t n = (training ? a.T : chunk_steps_) * a.B;
  out_ = new_buffer({n, a.GH}, a.x);
  if (ln_ && training) {
    raw_ = new_buffer({n, a.GH}, a.x), mean_ = new_buffer({n, 1}, a.x), rstd_ = new_buffer({n, 1}, a.x);
    raw = raw_, mean = mean_, rstd = rstd_;
  }
  if (ln_) {  // read as x's dtype per row (ln_pointers): PassArgs::finish checked them
    ln_rows_ = (training ? raw_ : out_).data_ptr(), ln_x_gain_ = a.ln_x_gain.data_ptr();
    ln_x_shift_ = a.ln_x_shift.data_ptr(), ln_h_gain_ = a.ln_h_gain.data_ptr(), ln_h_shift_ = a.ln_h_shift.data_ptr();
    if (training) ln_mean_ = mean_.data_ptr(), ln_rstd_ = rstd_.data_ptr();
    row_stats_ = new_buffer({4, a.B}, a.x), row_stats_p_ = row_stats_.data_ptr();
  }
  if (a.half_weights() && chunk_steps_ * a.B > kSmallBatch) {  // else every chunk a few rows: W as it is
    const HalfRows W = a.half_rows(kW, 0);
    if (W.bf16 && bf16_products()) {  // a bfloat16 module's x: bfloat16 values
      bf16_W_ = cached_empty({bf16_packed_bytes(a.GH, a.I) / int64_t(sizeof(float))}, a.x);
      bf16_pack(W, a.GH, a.I, reinterpret_cast<uint16_t*>(bf16_W_.data_ptr<float>()));
    } else {
      float_W_ = cached_empty({a.GH, a.I}, a.x);
      widen_rows(W, a.GH, a.I, float_W_.data_ptr<float>());
    }
  }
  // float32 W (or the widened one) into the own kernels' panels, once per pass, for a pass of more
  // than one step (as right_operand packs R): for one step of a batch (the step API) the packing
  // costs more than it saves (measured 1.2-1.6x a one-step call's time at B 9-32)
  if (a.x.scalar_type() == at::kFloat && !a.quantized() && !bf16_W_.defined() && a.T > 1 &&
      chunk_steps_ * a.B > kSmallBatch && f32_own_products()) {
    const Tensor& W = float_W_.defined() ? float_W_ : a.W;
    f32_W_ = cached_empty({f32_packed_floats(a.GH, a.I)}, a.x);
    f32_pack(W.data_ptr<float>(), W.stride(0), a.GH, a.I, f32_W_.data_ptr<float>());
    float_W_ = Tensor();
  }
  if (a.quantized() && (a.T > 1 || a.B > kUnpackedRows)) {  // else a few rows, once: W as it is
    packed_W_ = cached_empty({qgemm_packed_bytes(a.GH, a.I)}, a.W);
    qgemm_pack(a.quantized_rows(kW, 0), a.GH, a.I, packed_W_.data_ptr<int8_t>());
  }
}

void InputSteps::compute_chunk(int64_t s) {
  const int64_t count = std::min(chunk_steps_, a_.T - s), B = a_.B, rows = count * B;
  first_ = a_.reverse ? a_.T - s - count : s;
  const int64_t row0 = training_ ? first_ * B : 0;
  const bool half = a_.half_weights() && !float_W_.defined() && !bf16_W_.defined() && !f32_W_.defined();  // as it is
  const Tensor& W = float_W_.defined() ? float_W_ : a_.W;
  const bool own_loops = a_.quantized() || half || bf16_W_.defined() || f32_W_.defined() ||
                         (rows <= kSmallBatch && out_.scalar_type() == at::kFloat);
  if (own_loops) {  // float32 rows (int8 weights take float32 x): plain pointers, no ATen views a step
    const Tensor bf16_x = bf16_W_.defined() ? a_.bf16_x_rows() : Tensor();  // a bfloat16 x as it is
    const float* x2 = bf16_x.defined() ? nullptr : a_.x_values().data_ptr<float>() + first_ * B * a_.I;  // [T, B, I]
    float* out = out_.data_ptr<float>() + row0 * a_.GH;
    float* raw = ln_ && raw_.defined() ? raw_.data_ptr<float>() + row0 * a_.GH : out;  // inference: the step's rows
    if (a_.quantized() && !packed_W_.defined()) {  // int8 W, a few rows once: W as it is
      qgemm_unpacked(x2, rows, a_.I, a_.quantized_rows(kW, 0), a_.GH, a_.I, 0, raw, a_.GH);
    } else if (a_.quantized()) {  // int8 W: x quantized per row
      qgemm_nt_packed(x2, rows, a_.I, packed_W_.data_ptr<int8_t>(), a_.W_scale.data_ptr<float>(), a_.GH, a_.I, 0, raw,
                      a_.GH);
    } else if (bf16_W_.defined()) {  // bfloat16 W packed: the CPU's bfloat16 dot products
      const uint16_t* W_panels = reinterpret_cast<const uint16_t*>(bf16_W_.data_ptr<float>());
      if (bf16_x.defined()) {  // x's bfloat16 rows as they are: what rounding their widening gives
        Bf16RoundedX rows_x;
        rows_x.data = reinterpret_cast<const uint16_t*>(bf16_x.const_data_ptr<at::BFloat16>()) + first_ * B * a_.I;
        rows_x.rows = rows, rows_x.K = a_.I, rows_x.ld = a_.I;
        bf16_gemm_rounded(rows_x, W_panels, a_.GH, 0, raw, a_.GH);
      } else {
        bf16_gemm_packed(x2, rows, a_.I, W_panels, a_.GH, a_.I, 0, raw, a_.GH);
      }
    } else if (f32_W_.defined()) {  // float32 W packed: the own kernels
      f32_gemm_packed(x2, rows, a_.I, f32_W_.data_ptr<float>(), a_.GH, a_.I, 0, raw, a_.GH);
    } else if (half) {  // bfloat16 / float16 W, a few rows: read once for four rows at a time
      gemv_small_batch(a_.half_rows(kW, 0), a_.GH, a_.I, x2, a_.I, rows, 0, raw, a_.GH);
    } else if (rows == 1) {  // a batch of one: the matrix-vector loop reads W once, without BLAS's packing
      gemv_rows(W.data_ptr<float>(), a_.I, a_.GH, a_.I, x2, 0, raw, false);
    } else {  // a few rows (one step of a small batch): W read once for four rows at a time
      gemv_small_batch(W.data_ptr<float>(), a_.I, a_.GH, a_.I, x2, a_.I, rows, 0, raw, a_.GH);
    }
    if (!ln_ && bias_.defined()) {
      const float* bias = bias_.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < a_.GH; ++j) out[r * a_.GH + j] += bias[j];
    }
  } else {
    const Tensor x2 = a_.x_values().narrow(0, first_, count).view({rows, a_.I});
    Tensor out = out_.narrow(0, row0, rows);
    Tensor raw = ln_ && raw_.defined() ? raw_.narrow(0, row0, rows) : out;  // inference: the step's rows
    if (!ln_ && bias_.defined()) {
      at::addmm_out(out, bias_, x2, W.t());
    } else {
      at::mm_out(raw, x2, W.t());
    }
  }
}

void bf16_weight_gradient(const Tensor& out, const Tensor& A, const Tensor& B, Bf16RoundedX* rounded_A) {
  Bf16RoundedX local;
  Bf16RoundedX& x = rounded_A ? *rounded_A : local;
  TORCH_CHECK(A.defined() || x.data != nullptr, "rnnkit fused: bf16_weight_gradient: no A and no rounding of it");
  TORCH_CHECK(out.stride(1) == 1 && (!A.defined() || A.stride(1) == 1) && B.stride(1) == 1,
              "rnnkit fused: bf16_weight_gradient: rows with unit stride");
  const int64_t rows = B.size(0), K = B.size(1);
  // Aᵀ's rows (N of T·B) read from A in place, transposed as they are rounded: once for every
  // gradient that shares A
  if (x.data == nullptr) x = bf16_round(A.data_ptr<float>(), A.size(1), A.stride(0), true, A.size(0));
  TORCH_CHECK(x.K == rows && x.rows == out.size(0) && (!A.defined() || (A.size(0) == rows && A.size(1) == x.rows)),
              "rnnkit fused: bf16_weight_gradient: a rounding of Aᵀ [", x.rows, ", ", x.K, "] for B [", rows, ", ", K,
              "] and out [", out.size(0), ", ", out.size(1), "]");
  Tensor packed = cached_empty({bf16_packed_bytes(K, rows) / int64_t(sizeof(float))}, out);
  uint16_t* panels = reinterpret_cast<uint16_t*>(packed.data_ptr<float>());
  if (B.scalar_type() == at::kBFloat16) {  // bfloat16 B (a half-precision call's x) as it is
    bf16_pack_transposed(HalfRows{B.const_data_ptr(), B.stride(0), true}, K, rows, panels);
  } else {
    bf16_pack_float_transposed(B.data_ptr<float>(), B.stride(0), K, rows, panels);
  }
  bf16_gemm_rounded(x, panels, K, 0, out.data_ptr<float>(), out.stride(0));
}

void f32_weight_gradient_packed(const Tensor& out, const Tensor& A, const Tensor& B, Tensor* panels) {
  TORCH_CHECK(out.stride(1) == 1 && A.stride(1) == 1 && B.stride(1) == 1,
              "rnnkit fused: f32_weight_gradient_packed: rows with unit stride");
  const int64_t rows = A.size(0), N = A.size(1), K = B.size(1);
  Tensor local;
  Tensor& packed = panels ? *panels : local;
  if (!packed.defined()) {
    packed = cached_empty({f32_packed_floats(N, rows)}, A);
    f32_pack_transposed(A.data_ptr<float>(), A.stride(0), N, rows, packed.data_ptr<float>());
  }
  TORCH_CHECK(packed.numel() == f32_packed_floats(N, rows), "rnnkit fused: f32_weight_gradient_packed: a shared A of ",
              packed.numel(), " floats of panels for A [", rows, ", ", N, "]");
  // (Aᵀ · B)ᵀ = Bᵀ · A on A's panels, Bᵀ read from B in place (its rows the product's k), then
  // transposed into out in 16 x 16 blocks: 2-7% quicker than copying B transposed first and
  // transposing with ATen's copy (benchmarks/fp32_gemm.py --weight-gradients, Zen 4)
  Tensor Ct = cached_empty({K, N}, A);
  f32_gemm_packed_xt(B.data_ptr<float>(), B.stride(0), K, packed.data_ptr<float>(), N, rows, 0, Ct.data_ptr<float>(), N);
  f32_transpose(Ct.data_ptr<float>(), N, K, N, out.data_ptr<float>(), out.stride(0));
}

void weight_gradient(const PassArgs& a, const Tensor& out, const Tensor& A, const Tensor& B, SharedA* shared_A) {
  TORCH_CHECK(B.scalar_type() != at::kBFloat16 || (a.W.scalar_type() == at::kBFloat16 && bf16_products() &&
                                                   B.size(0) > 0),
              "rnnkit fused: weight_gradient: a bfloat16 B is for the bfloat16 products");
  if (!A.defined()) {  // rounded by the caller
    TORCH_CHECK(shared_A != nullptr && shared_A->bf16.data != nullptr,
                "rnnkit fused: weight_gradient: no A and no rounding of it");
    bf16_weight_gradient(out, A, B, &shared_A->bf16);
    return;
  }
  if (a.W.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && A.scalar_type() == at::kFloat &&
      B.scalar_type() == at::kFloat && f32_own_weight_gradients() && out.stride(1) == 1 && A.stride(1) == 1 &&
      B.stride(1) == 1 && A.size(0) > 0) {
    if (f32_at_b_in_place(A.size(0), A.size(1))) {  // both operands read in place, where fgemm measured that faster
      f32_gemm_at_b(A.data_ptr<float>(), A.stride(0), B.data_ptr<float>(), B.stride(0), A.size(0), A.size(1),
                    B.size(1), out.data_ptr<float>(), out.stride(0));
    } else {
      f32_weight_gradient_packed(out, A, B, shared_A ? &shared_A->f32_panels : nullptr);
    }
    return;
  }
  if (a.W.scalar_type() != at::kBFloat16 || !bf16_products() || A.size(0) == 0) {
    at::mm_out(const_cast<Tensor&>(out), A.t(), B);
    return;
  }
  bf16_weight_gradient(out, A, B, shared_A ? &shared_A->bf16 : nullptr);
}

namespace {

// x [T·B, I] as W's gradient takes it: a bfloat16 x as the bfloat16 products read it, else x's values.
Tensor weight_gradient_x(const PassArgs& a) {
  const Tensor rows = a.bf16_x_rows();
  return rows.defined() ? rows : a.x_values().view({a.T * a.B, a.I});
}

}  // namespace

Tensor input_projection_backward(const PassArgs& a, const Tensor& dA, const Tensor& raw, const Tensor& mean,
                                 const Tensor& rstd, const GradNeeds& needs, WeightGrads& grads,
                                 SharedA* shared_dA) {
  if (!dA.defined()) {  // rounded to bfloat16 by the caller, as rows and transposed
    TORCH_CHECK(shared_dA != nullptr && !a.ln_x_gain.defined() && (!needs.dx || shared_dA->bf16_rows.data) &&
                    (!needs.dW || shared_dA->bf16.data),
                "rnnkit fused: input_projection_backward: no dA and no rounding of it");
    if (needs.dW) {
      weight_gradient(a, grads.slot[kW], Tensor(), weight_gradient_x(a), shared_dA);
    } else {
      grads.slot[kW].zero_();
    }
    if (!needs.dx) return Tensor();
    Tensor dx = cached_empty({a.T * a.B, a.I}, a.x);
    const PackedRight<float> W(a.half_rows(kW, 0), a.T * a.B, a.I, a.GH, a.x, false, true);
    W.multiply(shared_dA->bf16_rows, 0, dx.data_ptr<float>(), a.I);
    return dx.view({a.T, a.B, a.I});
  }
  if (a.ln_x_gain.defined()) {
    // LN_x's backward row by row; each thread accumulates dγ, dβ in its own row of `acc`.
    const int64_t rows = dA.size(0), n = a.GH;
    Tensor acc = zero_buffer({at::get_num_threads(), 2, n}, dA);
    AT_DISPATCH_FLOATING_TYPES(dA.scalar_type(), "rnnkit_input_layer_norm_backward", [&] {
      const scalar_t *d = dA.data_ptr<scalar_t>(), *v = raw.data_ptr<scalar_t>();
      const scalar_t *m = mean.data_ptr<scalar_t>(), *r = rstd.data_ptr<scalar_t>();
      const scalar_t* gain = a.ln_x_gain.data_ptr<scalar_t>();
      scalar_t *out = dA.data_ptr<scalar_t>(), *acc_p = acc.data_ptr<scalar_t>();  // in place
      for_rows(rows, n, [&](int64_t r0, int64_t r1) {
        scalar_t* mine = acc_p + at::get_thread_num() * 2 * n;
        for (int64_t i = r0; i < r1; ++i)
          row_layer_norm_backward(d + i * n, v + i * n, n, m[i], r[i], gain, out + i * n, mine, mine + n);
      });
    });
    const Tensor sums = acc.sum(0);
    grads.put(kLnXGain, sums[0]);
    grads.put(kLnXShift, sums[1]);
  }
  if (needs.dW) {
    // [G·H, I]; with layer norm dA was rewritten above: a rounding taken before it is not dA's
    weight_gradient(a, grads.slot[kW], dA, weight_gradient_x(a), a.ln_x_gain.defined() ? nullptr : shared_dA);
  } else {
    grads.slot[kW].zero_();
  }
  if (!needs.dx) return Tensor();
  if (!a.half_weights()) {
    // dA · W on the own float32 kernels, W [G·H, I] packed as [K, N], when the product has rows
    // enough to pay for the packing (as right_operand's: more than one step); else ATen's mm
    if (a.x.scalar_type() != at::kFloat || a.T <= 1 || !f32_own_products()) {
      return mm_cached(dA, a.W).view({a.T, a.B, a.I});
    }
    Tensor dx = cached_empty({a.T * a.B, a.I}, dA);
    const PackedRight<float> W(a.W.data_ptr<float>(), a.W.stride(0), false, a.T * a.B, a.I, a.GH, dA);
    W.multiply(dA.data_ptr<float>(), dA.stride(0), 0, dx.data_ptr<float>(), a.I);
    return dx.view({a.T, a.B, a.I});
  }
  // dA · W with W [G·H, I] in half precision, one product: packed for the CPU's bfloat16 products,
  // or widened and multiplied as it is (no MKL packing for a single product)
  Tensor dx = cached_empty({a.T * a.B, a.I}, dA);
  const PackedRight<float> W(a.half_rows(kW, 0), a.T * a.B, a.I, a.GH, dA, false, true);
  W.multiply(dA.data_ptr<float>(), a.GH, 0, dx.data_ptr<float>(), a.I);
  return dx.view({a.T, a.B, a.I});
}

}  // namespace rnnkit
