// The extension's Python bindings: the two entry points of the fused pass ops (rnnkit/fused/ops.py
// registers them as the custom ops rnnkit::fused_pass_forward / fused_pass_backward), with the op
// schema's argument names and order (rnnkit/passes.py), and the buffer-cache controls.
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/grad_mode.h>

#include "fgemm.h"
#include "pass.h"

namespace py = pybind11;

namespace rnnkit {
namespace {

using OptTensor = std::optional<Tensor>;

Tensor contiguous(const Tensor& t) { return t.defined() ? t.contiguous() : t; }
Tensor contiguous(const OptTensor& t) { return t.has_value() ? t->contiguous() : Tensor(); }

// The pass description every op shares, by name (rnnkit/passes.py, PASS_ARGUMENTS; the bindings
// below list the same names in the same order; tests/test_fused.py checks that they agree).
#define RNNKIT_PASS_PARAMETERS                                                                                   \
  const Tensor &x, const Tensor &h0, const OptTensor &c0, const Tensor &W, const Tensor &R, const OptTensor &b_W, \
      const OptTensor &b_R, const OptTensor &W_hr, const OptTensor &peephole, const OptTensor &ln_x_gain,          \
      const OptTensor &ln_x_shift, const OptTensor &ln_h_gain, const OptTensor &ln_h_shift,                       \
      const OptTensor &ln_c_gain, const OptTensor &ln_c_shift, const OptTensor &lengths,                          \
      const OptTensor &recurrent_mask, const OptTensor &zoneout_h_mask, const OptTensor &zoneout_c_mask,          \
      const std::string &mode, double zoneout_h, double zoneout_c, std::optional<double> cell_clip,               \
      std::optional<double> proj_clip, bool coupled_gates, bool reset_after, bool reverse
#define RNNKIT_PASS_ARGUMENTS                                                                                    \
  x, h0, c0, W, R, b_W, b_R, W_hr, peephole, ln_x_gain, ln_x_shift, ln_h_gain, ln_h_shift, ln_c_gain, ln_c_shift, \
      lengths, recurrent_mask, zoneout_h_mask, zoneout_c_mask, mode, zoneout_h, zoneout_c, cell_clip, proj_clip,  \
      coupled_gates, reset_after, reverse
#define RNNKIT_PASS_PY_ARGS                                                                                      \
  py::arg("x"), py::arg("h0"), py::arg("c0"), py::arg("W"), py::arg("R"), py::arg("b_W"), py::arg("b_R"),         \
      py::arg("W_hr"), py::arg("peephole"), py::arg("ln_x_gain"), py::arg("ln_x_shift"), py::arg("ln_h_gain"),    \
      py::arg("ln_h_shift"), py::arg("ln_c_gain"), py::arg("ln_c_shift"), py::arg("lengths"),                     \
      py::arg("recurrent_mask"), py::arg("zoneout_h_mask"), py::arg("zoneout_c_mask"), py::arg("mode"),           \
      py::arg("zoneout_h"), py::arg("zoneout_c"), py::arg("cell_clip"), py::arg("proj_clip"),                     \
      py::arg("coupled_gates"), py::arg("reset_after"), py::arg("reverse")

// A bfloat16 / float16 module's vectors (biases, peepholes, layer norm's gains and shifts) as the
// float32 the cells read, widened from the module's tensors at every call (HalfCall's; a step plan's: a copy
// kept in the plan would miss their in-place updates, an optimizer's step, load_state_dict,
// init.*_, which change neither the tensors nor their memory). One fresh buffer per call (returned:
// it must outlive the pass), so calls on several threads share nothing; a few vectors of G·H
// values, against a step's read of R (measured: 2-3 µs of a 30 µs bfloat16 layer-norm step at H = 64).
Tensor widen_vectors(PassArgs& a) {
  Tensor* const vectors[] = {&a.b_W, &a.b_R, &a.peephole, &a.ln_x_gain, &a.ln_x_shift, &a.ln_h_gain,
                             &a.ln_h_shift, &a.ln_c_gain, &a.ln_c_shift};
  int64_t total = 0;
  for (const Tensor* t : vectors)
    if (t->defined()) total += t->numel();
  Tensor buffer = at::empty({total}, a.W.options().dtype(at::kFloat));
  float* out = buffer.data_ptr<float>();
  for (Tensor* t : vectors) {  // contiguous (make_step_plan checks it; pass_args makes them so)
    if (!t->defined()) continue;
    const int64_t n = t->numel();
    const at::ScalarType type = t->scalar_type();
    if (type == at::kBFloat16 || type == at::kHalf) {
      widen_rows(HalfRows{t->const_data_ptr(), n, type == at::kBFloat16}, 1, n, out);
    } else {  // float32 beside half matrices: as it is
      const Tensor f = t->to(at::kFloat);
      std::copy(f.const_data_ptr<float>(), f.const_data_ptr<float>() + n, out);
    }
    *t = at::from_blob(out, t->sizes(), buffer.options());
    out += n;
  }
  return buffer;
}

// A contiguous float32 copy of a bfloat16 / float16 tensor (any other as it is), and a float32
// tensor rounded to `dtype` (nearest even, as Tensor::to: ATen's own vector conversion, in
// parallel chunks): a half-precision call's tensors, and a step plan's input, state and results,
// where ATen's cast (a TensorIterator per tensor, five a step) took ~6 of a bfloat16 LSTMCell's
// 35 µs per step at H = 128 (AMD EPYC Zen 4). The same values either way.
Tensor widened(const Tensor& t) {
  if (!t.defined() || (t.scalar_type() != at::kBFloat16 && t.scalar_type() != at::kHalf)) return t;
  const Tensor c = t.contiguous();
  Tensor out = at::empty(c.sizes(), c.options().dtype(at::kFloat));
  const int64_t K = c.dim() > 0 ? c.size(-1) : 1;
  if (c.numel() > 0) {  // as rows of its last dimension (at::vec::convert has no vector form of it)
    widen_rows(HalfRows{c.const_data_ptr(), K, c.scalar_type() == at::kBFloat16}, c.numel() / K, K,
               out.data_ptr<float>());
  }
  return out;
}

Tensor rounded(const Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "rnnkit fused: rounding a ", t.scalar_type(), " result");
  const Tensor c = t.contiguous();
  Tensor out = at::empty(c.sizes(), c.options().dtype(dtype));
  const float* in = c.const_data_ptr<float>();
  at::parallel_for(0, c.numel(), int64_t(1) << 15, [&](int64_t i0, int64_t i1) {
    if (dtype == at::kBFloat16) {
      at::vec::convert(in + i0, out.data_ptr<at::BFloat16>() + i0, i1 - i0);
    } else {
      at::vec::convert(in + i0, out.data_ptr<at::Half>() + i0, i1 - i0);
    }
  });
  return out;
}

// A half-precision call: a bfloat16 / float16 module's pass hands the op x, the states, the vectors
// and the masks in its matrices' dtype (rnnkit/fused/__init__.py), and takes its results in it (y,
// h_n, c_n; dx, dh0, dc0 and the weights' gradient block). The kernels compute in float32 as they do
// for a float32 x beside half matrices: what they read is widened here, once, and what they give
// back rounded here, so the bits are those of converting in Python around a float32 call, without
// its conversions' dispatches and autograd nodes (ten or more a layer; a two-layer bfloat16 LSTM's
// training call at T = B = 1 went from ~850 to ~750 µs, Zen 4), and a bfloat16 x reaches the
// bfloat16 products as it is (PassArgs::x_half), where they rounded its widening back. The
// training forward keeps its float32 y in saved[kOutput]: the backward reads y in float32 (the
// RNN's tanh', the GRU's h_prev, R's gradient off the CPU's bfloat16 products), not its rounding.
struct HalfCall {
  bool on = false;
  at::ScalarType dtype = at::kFloat;  // x's
  Tensor vectors;                     // the widened vectors (the PassArgs' point into it)

  // Widens a's half tensors (x, the states, the masks, the vectors) where x is in its matrices'
  // half dtype, each of which must then be in it too (the fake implementation gives dh0 h0's dtype,
  // and a float32 vector's gradient would come back rounded in the block); else nothing (a float32
  // x beside half matrices takes float32 for all of them: PassArgs::finish checks it).
  void widen(PassArgs& a) {
    if (!a.half_weights() || a.x.scalar_type() != a.W.scalar_type()) return;
    on = true, dtype = a.x.scalar_type();
    const std::pair<const char*, const Tensor*> given[] = {
        {"h0", &a.h0}, {"c0", &a.c0}, {"recurrent_mask", &a.recurrent_mask}, {"zoneout_h_mask", &a.zoneout_h},
        {"zoneout_c_mask", &a.zoneout_c}, {"b_W", &a.b_W}, {"b_R", &a.b_R}, {"peephole", &a.peephole},
        {"ln_x_gain", &a.ln_x_gain}, {"ln_x_shift", &a.ln_x_shift}, {"ln_h_gain", &a.ln_h_gain},
        {"ln_h_shift", &a.ln_h_shift}, {"ln_c_gain", &a.ln_c_gain}, {"ln_c_shift", &a.ln_c_shift}};
    for (const auto& [name, t] : given) {
      TORCH_CHECK(!t->defined() || t->scalar_type() == dtype, "rnnkit fused: ", name, ": expected ", dtype,
                  " like x and W (a half-precision call takes every tensor in the matrices' dtype), got ",
                  t->scalar_type());
    }
    // x widened where something reads it in float32 (PassArgs::x_values): the bfloat16 products take it as it is
    a.x_half = a.x, a.x_deferred = true;
    a.x = new_buffer(a.x.sizes(), at::empty({0}, a.x.options().dtype(at::kFloat)));
    for (Tensor* t : {&a.h0, &a.c0, &a.recurrent_mask, &a.zoneout_h, &a.zoneout_c}) *t = widened(*t);
    vectors = widen_vectors(a);
  }
  // A result in x's dtype (undefined: an empty one).
  Tensor back(const Tensor& t, const Tensor& like) const {
    const Tensor r = t.defined() ? t : at::empty({0}, like.options());
    return on ? rounded(r, dtype) : r;
  }
};

PassArgs pass_args(RNNKIT_PASS_PARAMETERS, const Tensor& W_scale = Tensor(), const Tensor& R_scale = Tensor(),
                   const Tensor& W_hr_scale = Tensor(), HalfCall* half = nullptr) {
  PassArgs a;
  a.W_scale = contiguous(W_scale), a.R_scale = contiguous(R_scale), a.W_hr_scale = contiguous(W_hr_scale);
  a.mode = mode;
  a.x = x.contiguous(), a.h0 = h0.contiguous(), a.c0 = contiguous(c0);
  a.W = W.contiguous(), a.R = R.contiguous(), a.b_W = contiguous(b_W), a.b_R = contiguous(b_R);
  a.W_hr = contiguous(W_hr), a.peephole = contiguous(peephole);
  a.ln_x_gain = contiguous(ln_x_gain), a.ln_x_shift = contiguous(ln_x_shift);
  a.ln_h_gain = contiguous(ln_h_gain), a.ln_h_shift = contiguous(ln_h_shift);
  a.ln_c_gain = contiguous(ln_c_gain), a.ln_c_shift = contiguous(ln_c_shift);
  a.lengths = lengths.has_value() ? *lengths : Tensor();
  a.recurrent_mask = contiguous(recurrent_mask);
  a.zoneout_h = contiguous(zoneout_h_mask), a.zoneout_c = contiguous(zoneout_c_mask);
  a.zoneout_h_p = zoneout_h, a.zoneout_c_p = zoneout_c;
  a.cell_clip = cell_clip.value_or(0), a.proj_clip = proj_clip.value_or(0);
  a.coupled = coupled_gates, a.reset_after = reset_after, a.reverse = reverse;
  if (half != nullptr) half->widen(a);
  a.finish();
  return a;
}

// A pass's forward by its cell family (the caller has released the GIL).
ForwardResult forward(const PassArgs& a, bool training) {
  if (a.mode == "lstm") return lstm_forward(a, training);
  return a.mode == "gru" ? gru_forward(a, training) : rnn_forward(a, training);
}

// Undefined results become empty tensors: an op returns tensors, never None.
Tensor or_empty(const Tensor& t, const Tensor& like) { return t.defined() ? t : at::empty({0}, like.options()); }

// -> (y, h_n, c_n, saved): c_n empty unless LSTM; saved has Saved::kNumSaved entries when
// training (empty where nothing is kept), none otherwise. A half-precision call (HalfCall): y,
// h_n, c_n in x's dtype, saved float32.
py::tuple pass_forward(RNNKIT_PASS_PARAMETERS, bool training) {
  const at::NoGradGuard no_grad;  // a kernel: below autograd, whoever calls it
  HalfCall half;
  std::array<Tensor, 3> results;
  std::vector<Tensor> saved;
  {
    py::gil_scoped_release no_gil;
    const PassArgs a = pass_args(RNNKIT_PASS_ARGUMENTS, Tensor(), Tensor(), Tensor(), &half);
    ForwardResult out = forward(a, training);
    if (half.on && training) out[3 + kOutput] = out[0];
    for (size_t i = 3; i < out.size(); ++i) saved.push_back(or_empty(out[i], a.x));
    for (size_t i = 0; i < 3; ++i) results[i] = half.back(out[i], a.x);
  }
  return py::make_tuple(results[0], results[1], results[2], saved);
}

// -> (dx, dh0, dc0, dweights): dx empty unless need_dx, dc0 empty unless LSTM, dweights the
// gradient block of the present weights in the packed buffer's order. A half-precision call
// (HalfCall): all four in x's dtype; y is read from saved[kOutput] (float32), dy, dh_n, dc_n widened.
py::tuple pass_backward(RNNKIT_PASS_PARAMETERS, const Tensor& y, const std::vector<Tensor>& saved, const Tensor& dy,
                        const Tensor& dh_n, const OptTensor& dc_n, bool need_dx, bool need_dW, bool need_dR,
                        bool need_dW_hr) {
  const at::NoGradGuard no_grad;
  TORCH_CHECK(saved.size() == size_t(kNumSaved), "rnnkit fused: saved: expected ", int(kNumSaved), " tensors, got ",
              saved.size());
  GradNeeds needs;
  needs.dx = need_dx, needs.dW = need_dW, needs.dR = need_dR, needs.dW_hr = need_dW_hr;
  std::array<Tensor, 4> results;
  {
    py::gil_scoped_release no_gil;
    HalfCall half;
    const PassArgs a = pass_args(RNNKIT_PASS_ARGUMENTS, Tensor(), Tensor(), Tensor(), &half);
    const Tensor& y_f = half.on ? saved[kOutput] : y;
    TORCH_CHECK(y_f.sizes() == y.sizes(), "rnnkit fused: a ", half.dtype, " call's backward reads the float32 y its "
                "training forward saved (saved[", int(kOutput), "]): expected shape ", y.sizes(), ", got ", y_f.sizes());
    const Tensor dc = dc_n.has_value() ? widened(*dc_n) : Tensor();
    BackwardResult g;
    if (a.mode == "lstm") {
      g = lstm_backward(a, y_f, saved, widened(dy), widened(dh_n), dc, needs);
    } else if (a.mode == "gru") {
      g = gru_backward(a, y_f, saved, widened(dy), widened(dh_n), dc, needs);
    } else {
      g = rnn_backward(a, y_f, saved, widened(dy), widened(dh_n), dc, needs);
    }
    results = {half.back(g.dx, a.x), half.back(g.dh0, a.x), half.back(g.dc0, a.x), half.back(g.dweights, a.x)};
  }
  return py::make_tuple(results[0], results[1], results[2], results[3]);
}

// -> (y, h_n, c_n) of an inference pass with int8 W, R (and W_hr), each with a float scale per
// row (rnnkit.quantize); c_n empty unless LSTM.
py::tuple pass_forward_int8(RNNKIT_PASS_PARAMETERS, const Tensor& W_scale, const Tensor& R_scale,
                            const OptTensor& W_hr_scale) {
  const at::NoGradGuard no_grad;
  TORCH_CHECK(W.scalar_type() == at::kChar && R.scalar_type() == at::kChar,
              "rnnkit fused int8 pass: W and R must be int8, got ", W.scalar_type(), " and ", R.scalar_type());
  const PassArgs a = pass_args(RNNKIT_PASS_ARGUMENTS, W_scale, R_scale, contiguous(W_hr_scale));
  ForwardResult out;
  {
    py::gil_scoped_release no_gil;
    out = forward(a, false);
  }
  return py::make_tuple(out[0], out[1], or_empty(out[2], a.x));
}

// Inference's fast path, for one-step cells (rnnkit.LSTMCell / GRUCell / RNNCell) and for the
// layers of a stack's call without a gradient: the pass's weights and scalars, fixed when the
// module builds it, and calls that take only x and the state. They return None instead of raising
// when the call is not one they can take (shapes, dtypes, devices), so that Python's checks give
// their errors naming the argument.
class StepPlan {
 public:
  explicit StepPlan(PassArgs weights) : base_(std::move(weights)) {}

  // One step: input [B, I] or unbatched [I], hx the cell's state -> h' (or (h', c')).
  py::object call(const Tensor& input, const py::object& hx) const {
    if (input.dim() < 1 || input.dim() > 2) return py::none();
    const bool unbatched = input.dim() == 1;
    const auto out = run(input, 1, unbatched ? 1 : input.size(0), unbatched, hx);
    if (!out) return py::none();
    const auto result = [&](const Tensor& t) { return unbatched ? t[0] : t; };
    if (base_.mode != "lstm") return py::cast(result(out->at(1)));
    return py::make_tuple(result(out->at(1)), result(out->at(2)));
  }

  // A layer's pass over a whole sequence: input [T, B, I], hx its state ([B, Hr], or a pair with
  // [B, H]) or None -> (y [T, B, Hr], h_n, c_n), or (y, h_n) without a cell state.
  py::object sequence(const Tensor& input, const py::object& hx) const {
    if (input.dim() != 3 || input.size(0) == 0 || input.size(1) == 0) return py::none();
    const auto out = run(input, input.size(0), input.size(1), false, hx);
    if (!out) return py::none();
    if (base_.mode != "lstm") return py::make_tuple(out->at(0), out->at(1));
    return py::make_tuple(out->at(0), out->at(1), out->at(2));
  }

 private:
  // The pass on x = input as [T, B, I] -> (y, h_n, c_n) in the input's dtype, or nothing.
  std::optional<std::array<Tensor, 3>> run(const Tensor& input, int64_t T, int64_t B, bool unbatched,
                                           const py::object& hx) const {
    const at::NoGradGuard no_grad;
    const Tensor& W = base_.W;
    // the input's and states' dtype: int8 weights take float32; a half-precision module's plan
    // takes its dtype and computes in float32 (its matrices read as they are)
    const at::ScalarType dtype = base_.quantized() ? at::kFloat : W.scalar_type();
    const bool half = base_.half_weights();
    const auto compute = [&](const Tensor& t) { return half ? widened(t) : t; };
    if (input.layout() != at::kStrided || input.size(-1) != W.size(1) || input.scalar_type() != dtype ||
        input.device() != W.device()) {
      return std::nullopt;
    }
    const bool lstm = base_.mode == "lstm";
    const int64_t Hr = base_.R.size(1);
    const int64_t H = base_.W_hr.defined() ? base_.W_hr.size(1) : (lstm ? W.size(0) / (base_.coupled ? 3 : 4) : Hr);
    PassArgs a = base_;
    const Tensor vectors = half ? widen_vectors(a) : Tensor();  // a's half vectors point into it
    a.x = compute(input.reshape({T, B, input.size(-1)})).contiguous();
    if (hx.is_none()) {
      a.h0 = at::zeros({B, Hr}, a.x.options());
      if (lstm) a.c0 = at::zeros({B, H}, a.x.options());
    } else {
      Tensor h, c;
      if (lstm) {
        if (!py::isinstance<py::tuple>(hx) && !py::isinstance<py::list>(hx)) return std::nullopt;
        const py::sequence pair = hx.cast<py::sequence>();
        if (pair.size() != 2 || !THPVariable_Check(pair[0].ptr()) || !THPVariable_Check(pair[1].ptr())) {
          return std::nullopt;
        }
        h = pair[0].cast<Tensor>(), c = pair[1].cast<Tensor>();
      } else {
        if (!THPVariable_Check(hx.ptr())) return std::nullopt;
        h = hx.cast<Tensor>();
      }
      const auto state_ok = [&](const Tensor& t, int64_t n) {
        return t.layout() == at::kStrided && t.scalar_type() == dtype && t.device() == W.device() &&
               (unbatched ? (t.dim() == 1 && t.size(0) == n) : (t.dim() == 2 && t.size(0) == B && t.size(1) == n));
      };
      if (!state_ok(h, Hr) || (lstm && !state_ok(c, H))) return std::nullopt;
      const auto as_rows = [&](const Tensor& t, int64_t n) {  // [B, n] contiguous (no new view when it is)
        return t.dim() == 2 && t.is_contiguous() ? t : t.reshape({B, n}).contiguous();
      };
      a.h0 = compute(as_rows(h, Hr)).contiguous();
      if (lstm) a.c0 = compute(as_rows(c, H)).contiguous();
    }
    a.finish();
    ForwardResult out;
    {
      py::gil_scoped_release no_gil;
      out = forward(a, false);
    }
    const auto back = [&](const Tensor& t) {  // half: rounded back
      return !t.defined() ? t : half ? rounded(t, dtype) : t.to(dtype);
    };
    return std::array<Tensor, 3>{back(out[0]), back(out[1]), back(out[2])};
  }



  PassArgs base_;
};

StepPlan make_step_plan(RNNKIT_PASS_PARAMETERS, const OptTensor& W_scale, const OptTensor& R_scale,
                        const OptTensor& W_hr_scale) {
  PassArgs a;
  a.W_scale = contiguous(W_scale), a.R_scale = contiguous(R_scale), a.W_hr_scale = contiguous(W_hr_scale);
  TORCH_CHECK(W.scalar_type() != at::kChar || (a.W_scale.defined() && a.R_scale.defined()),
              "rnnkit fused: a step plan with int8 weights needs their scales");
  a.mode = mode;
  a.W = W, a.R = R, a.b_W = b_W.value_or(Tensor()), a.b_R = b_R.value_or(Tensor());
  a.W_hr = W_hr.value_or(Tensor()), a.peephole = peephole.value_or(Tensor());
  a.ln_x_gain = ln_x_gain.value_or(Tensor()), a.ln_x_shift = ln_x_shift.value_or(Tensor());
  a.ln_h_gain = ln_h_gain.value_or(Tensor()), a.ln_h_shift = ln_h_shift.value_or(Tensor());
  a.ln_c_gain = ln_c_gain.value_or(Tensor()), a.ln_c_shift = ln_c_shift.value_or(Tensor());
  for (const Tensor* t : {&a.W, &a.R, &a.b_W, &a.b_R, &a.W_hr, &a.peephole, &a.ln_x_gain, &a.ln_x_shift, &a.ln_h_gain,
                          &a.ln_h_shift, &a.ln_c_gain, &a.ln_c_shift}) {
    TORCH_CHECK(!t->defined() || t->is_contiguous(), "rnnkit fused: a step plan needs contiguous weights");
  }
  // a bfloat16 / float16 module's vectors are kept as they are and widened at each call (widen_vectors)
  TORCH_CHECK(!lengths.has_value() && !recurrent_mask.has_value() && !zoneout_h_mask.has_value() &&
                  !zoneout_c_mask.has_value(),
              "rnnkit fused: a step plan is for inference (no lengths, no masks)");
  a.zoneout_h_p = zoneout_h, a.zoneout_c_p = zoneout_c;
  a.cell_clip = cell_clip.value_or(0), a.proj_clip = proj_clip.value_or(0);
  a.coupled = coupled_gates, a.reset_after = reset_after, a.reverse = reverse;
  a.relu = mode == "rnn_relu";
  return StepPlan(std::move(a));
}

}  // namespace

// The test bindings' operands: X float [rows, K] (unit stride), M int8 [N, K], scale float [N].
QuantizedRows int8_operands(const char* who, const at::Tensor& X, const at::Tensor& M, const at::Tensor& scale) {
  TORCH_CHECK(X.dim() == 2 && X.scalar_type() == at::kFloat && X.stride(1) == 1, who,
              ": x: expected float32 [rows, K] with unit stride, got ", X.scalar_type(), " ", X.sizes(), " strides ",
              X.strides());
  TORCH_CHECK(M.dim() == 2 && M.scalar_type() == at::kChar && M.stride(1) == 1 && M.size(1) == X.size(1), who,
              ": M: expected int8 [N, ", X.size(1), "] with unit stride, got ", M.scalar_type(), " ", M.sizes());
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.size(0) == M.size(0) &&
                  scale.is_contiguous(), who, ": scale: expected contiguous float32 [", M.size(0), "], got ",
              scale.scalar_type(), " ", scale.sizes());
  QuantizedRows q;
  q.data = M.data_ptr<int8_t>(), q.scale = scale.data_ptr<float>(), q.ld = M.stride(0);
  return q;
}

}  // namespace rnnkit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rnnkit fused CPU passes (LSTM, GRU, RNN): forward and backward time loops";
  m.def("pass_forward", &rnnkit::pass_forward, "one layer-direction pass forward", RNNKIT_PASS_PY_ARGS,
        py::arg("training"));
  m.def("pass_backward", &rnnkit::pass_backward, "its backward", RNNKIT_PASS_PY_ARGS, py::arg("y"),
        py::arg("saved"), py::arg("dy"), py::arg("dh_n"), py::arg("dc_n"), py::arg("need_dx"), py::arg("need_dW"),
        py::arg("need_dR"), py::arg("need_dW_hr"));
  m.def("pass_forward_int8", &rnnkit::pass_forward_int8, "an inference pass with int8 weights",
        RNNKIT_PASS_PY_ARGS, py::arg("W_scale"), py::arg("R_scale"), py::arg("W_hr_scale"));
  m.def(
      "qgemm",
      [](const at::Tensor& X, const at::Tensor& M, const at::Tensor& scale) {  // X · Mᵀ, int8 M (tests)
        const rnnkit::QuantizedRows q = rnnkit::int8_operands("qgemm", X, M, scale);
        at::Tensor C = at::empty({X.size(0), M.size(0)}, X.options());
        rnnkit::qgemm_nt(X.data_ptr<float>(), X.size(0), X.stride(0), q, M.size(0), X.size(1), 0, C.data_ptr<float>(),
                         M.size(0));
        return C;
      },
      "X · Mᵀ through the int8 kernel (X quantized per row)");
  m.def(
      "q_pack",
      [](const at::Tensor& M, const at::Tensor& scale) {  // for benchmarks/int8_gemm.py and tests
        const rnnkit::QuantizedRows q = rnnkit::int8_operands("q_pack", at::empty({0, M.size(1)}, scale.options()), M,
                                                              scale);
        at::Tensor packed = at::empty({rnnkit::qgemm_packed_bytes(M.size(0), M.size(1))}, M.options());
        rnnkit::qgemm_pack(q, M.size(0), M.size(1), packed.data_ptr<int8_t>());
        return packed;
      },
      py::arg("M"), py::arg("scale"), "int8 M [N, K] in the int8 kernels' panels (qgemm_pack)");
  m.def(
      "qgemm_packed",
      [](const at::Tensor& X, const at::Tensor& packed, const at::Tensor& scale) {
        TORCH_CHECK(X.dim() == 2 && X.scalar_type() == at::kFloat && X.stride(1) == 1,
                    "qgemm_packed: X: expected float32 [rows, K] with unit stride, got ", X.scalar_type(), " ",
                    X.sizes());
        const int64_t N = scale.numel(), K = X.size(1);
        TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                        packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                        packed.numel() == rnnkit::qgemm_packed_bytes(N, K),
                    "qgemm_packed: packed: expected q_pack of an M with N = ", N, " and K = ", K, " (",
                    rnnkit::qgemm_packed_bytes(N, K), " bytes), got ", packed.numel());
        at::Tensor C = at::empty({X.size(0), N}, X.options());
        rnnkit::qgemm_nt_packed(X.data_ptr<float>(), X.size(0), X.stride(0), packed.data_ptr<int8_t>(),
                                scale.data_ptr<float>(), N, K, 0, C.data_ptr<float>(), N);
        return C;
      },
      py::arg("X"), py::arg("packed"), py::arg("scale"), "X · Mᵀ on M packed by q_pack, through the int8 kernels");
  m.def(
      "qgemv",
      [](const at::Tensor& x, const at::Tensor& M, const at::Tensor& scale) {  // x · Mᵀ, one row, unpacked (tests)
        TORCH_CHECK(x.dim() == 1 && x.is_contiguous(), "qgemv: x: expected a contiguous vector [K], got ",
                    x.sizes(), " strides ", x.strides());
        const rnnkit::QuantizedRows q = rnnkit::int8_operands("qgemv", x.view({1, -1}), M, scale);
        at::Tensor C = at::empty({M.size(0)}, x.options());
        rnnkit::qgemv_rows(x.data_ptr<float>(), q, M.size(0), x.size(0), 0, C.data_ptr<float>());
        return C;
      },
      "x · Mᵀ through the one-row int8 kernel (M unpacked)");
  m.def(
      "qgemm_unpacked",
      [](const at::Tensor& X, const at::Tensor& M, const at::Tensor& scale) {  // X · Mᵀ, M unpacked (tests)
        const rnnkit::QuantizedRows q = rnnkit::int8_operands("qgemm_unpacked", X, M, scale);
        at::Tensor C = at::empty({X.size(0), M.size(0)}, X.options());
        rnnkit::qgemm_unpacked(X.data_ptr<float>(), X.size(0), X.stride(0), q, M.size(0), X.size(1), 0,
                               C.data_ptr<float>(), M.size(0));
        return C;
      },
      "X · Mᵀ through the int8 kernel for a few rows done once (M unpacked)");
  m.def(
      "half_gemm",
      [](const at::Tensor& X, const at::Tensor& M, bool pack) {  // X · Mᵀ, bfloat16 / float16 M (tests)
        TORCH_CHECK(X.dim() == 2 && X.scalar_type() == at::kFloat && X.is_contiguous(),
                    "half_gemm: X: expected contiguous float32 [rows, K], got ", X.scalar_type(), " ", X.sizes());
        TORCH_CHECK(M.dim() == 2 && (M.scalar_type() == at::kBFloat16 || M.scalar_type() == at::kHalf) &&
                        M.stride(1) == 1 && M.size(1) == X.size(1),
                    "half_gemm: M: expected bfloat16 or float16 [N, ", X.size(1), "] with unit stride, got ",
                    M.scalar_type(), " ", M.sizes());
        rnnkit::HalfRows rows;
        rows.data = M.data_ptr(), rows.ld = M.stride(0), rows.bf16 = M.scalar_type() == at::kBFloat16;
        at::Tensor C = at::empty({X.size(0), M.size(0)}, X.options());
        const rnnkit::PackedRight<float> right(rows, X.size(0), M.size(0), X.size(1), X, pack);
        right.multiply(X.data_ptr<float>(), X.size(1), 0, C.data_ptr<float>(), M.size(0));
        return C;
      },
      py::arg("X"), py::arg("M"), py::arg("pack"),
      "X · Mᵀ as a pass multiplies by half-precision weights (pack: M multiplies more than once)");
  m.def(
      "f32_pack",
      [](const at::Tensor& M, bool transposed) {  // for the own float32 kernels (tests, benchmarks/fp32_gemm.py)
        TORCH_CHECK(M.dim() == 2 && M.scalar_type() == at::kFloat && M.stride(1) == 1,
                    "f32_pack: M: expected float32 ", transposed ? "[K, N]" : "[N, K]", " with unit stride, got ",
                    M.scalar_type(), " ", M.sizes());
        const int64_t N = M.size(transposed ? 1 : 0), K = M.size(transposed ? 0 : 1);
        at::Tensor packed = rnnkit::cached_empty({rnnkit::f32_packed_floats(N, K)}, M);  // NaN under set_poison
        (transposed ? rnnkit::f32_pack_transposed : rnnkit::f32_pack)(M.data_ptr<float>(), M.stride(0), N, K,
                                                                      packed.data_ptr<float>());
        return packed;
      },
      py::arg("M"), py::arg("transposed"),
      "M [N, K] (for X · Mᵀ), or transposed M [K, N] (for X · M), in the own float32 kernels' panels");
  m.def(
      "f32_gemm_packed",
      [](const at::Tensor& X, const at::Tensor& packed, int64_t N) {
        TORCH_CHECK(X.dim() == 2 && X.scalar_type() == at::kFloat && X.stride(1) == 1,
                    "f32_gemm_packed: X: expected float32 [rows, K] with unit stride, got ", X.scalar_type(), " ",
                    X.sizes());
        TORCH_CHECK(N >= 0 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                        packed.numel() == rnnkit::f32_packed_floats(N, X.size(1)),
                    "f32_gemm_packed: packed: expected f32_pack of an M with N = ", N, " and K = ", X.size(1),
                    " (", rnnkit::f32_packed_floats(N, X.size(1)), " floats), got ", packed.numel());
        at::Tensor C = rnnkit::cached_empty({X.size(0), N}, X);
        rnnkit::f32_gemm_packed(X.data_ptr<float>(), X.size(0), X.stride(0), packed.data_ptr<float>(), N, X.size(1), 0,
                                C.data_ptr<float>(), N);
        return C;
      },
      py::arg("X"), py::arg("packed"), py::arg("N"), "X · Mᵀ on M packed by f32_pack, through the own float32 kernels");
  m.def(
      "bf16_pack",
      [](const at::Tensor& M) {  // for the bfloat16 kernels (tests, benchmarks/bf16_gemm.py)
        TORCH_CHECK(M.dim() == 2 && M.scalar_type() == at::kBFloat16 && M.stride(1) == 1,
                    "bf16_pack: M: expected bfloat16 [N, K] with unit stride, got ", M.scalar_type(), " ", M.sizes());
        TORCH_CHECK(rnnkit::bf16_products(), "bf16_pack: no bfloat16 GEMM kernels in use ('none')");
        rnnkit::HalfRows rows;
        rows.data = M.data_ptr(), rows.ld = M.stride(0), rows.bf16 = true;
        at::Tensor packed = at::empty({rnnkit::bf16_packed_bytes(M.size(0), M.size(1)) / 2}, M.options().dtype(at::kShort));
        rnnkit::bf16_pack(rows, M.size(0), M.size(1), reinterpret_cast<uint16_t*>(packed.data_ptr<int16_t>()));
        return packed;
      },
      py::arg("M"), "M [N, K] (for X · Mᵀ) in the bfloat16 kernels' panels");
  m.def(
      "bf16_gemm_packed",
      [](const at::Tensor& X, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& C) {
        const bool rounded = X.scalar_type() == at::kBFloat16;  // X rounded already: bf16_gemm_rounded's product
        TORCH_CHECK(X.dim() == 2 && (X.scalar_type() == at::kFloat || (rounded && X.size(1) % 2 == 0)) &&
                        X.stride(1) == 1 && (!rounded || X.size(0) <= 1 || (X.stride(0) % 2 == 0 && X.stride(0) >= X.size(1))),
                    "bf16_gemm_packed: X: expected float32 [rows, K] with unit stride, or bfloat16 with an even K "
                    "and an even row stride of at least K, got ", X.scalar_type(), " ", X.sizes(), " strides ",
                    X.strides());
        const int64_t K = X.size(1);
        TORCH_CHECK(N >= 0 && packed.scalar_type() == at::kShort && packed.is_contiguous() &&
                        packed.numel() * 2 == rnnkit::bf16_packed_bytes(N, K),
                    "bf16_gemm_packed: packed: expected bf16_pack of an M with N = ", N, " and K = ", K);
        TORCH_CHECK(rnnkit::bf16_products(), "bf16_gemm_packed: no bfloat16 GEMM kernels in use ('none')");
        at::Tensor out = C.has_value() ? *C : rnnkit::cached_empty({X.size(0), N}, at::kFloat);  // NaN under set_poison
        TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == X.size(0) && out.size(1) == N &&
                        out.stride(1) == 1,
                    "bf16_gemm_packed: C: expected float32 [", X.size(0), ", ", N, "] with unit stride, got ",
                    out.scalar_type(), " ", out.sizes());
        const float beta = C.has_value() ? 1.0f : 0.0f;
        const uint16_t* panels = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
        if (rounded) {
          rnnkit::Bf16RoundedX x;
          x.data = reinterpret_cast<const uint16_t*>(X.data_ptr()), x.rows = X.size(0), x.K = K, x.ld = X.stride(0);
          rnnkit::bf16_gemm_rounded(x, panels, N, beta, out.data_ptr<float>(), out.stride(0));
        } else {
          rnnkit::bf16_gemm_packed(X.data_ptr<float>(), X.size(0), X.stride(0), panels, N, K, beta,
                                   out.data_ptr<float>(), out.stride(0));
        }
        return out;
      },
      py::arg("X"), py::arg("packed"), py::arg("N"), py::arg("C") = py::none(),
      "X · Mᵀ (+ C, in place, where C is given) on M packed by bf16_pack, X rounded to bfloat16 as it is read "
      "(or given in bfloat16)");
  // The weight-gradient bindings: Aᵀ · B for float32 A [rows, N] and B [rows, K] with unit-stride
  // rows, into a new [N, K] (NaN under set_poison before the product writes it), where `usable`
  // says the kernels are in use (else `unusable`, the error's text).
  const auto at_b = [](const char* name, bool (*usable)(), const char* unusable,
                       void (*product)(const at::Tensor& C, const at::Tensor& A, const at::Tensor& B)) {
    return [=](const at::Tensor& A, const at::Tensor& B) {
      TORCH_CHECK(A.dim() == 2 && B.dim() == 2 && A.scalar_type() == at::kFloat && B.scalar_type() == at::kFloat &&
                      A.stride(1) == 1 && B.stride(1) == 1 && A.size(0) == B.size(0),
                  name, ": expected float32 A [rows, N] and B [rows, K] with unit-stride rows, got ", A.scalar_type(),
                  " ", A.sizes(), " and ", B.scalar_type(), " ", B.sizes());
      TORCH_CHECK(usable(), name, ": ", unusable);
      at::Tensor C = rnnkit::cached_empty({A.size(1), B.size(1)}, A);
      product(C, A, B);
      return C;
    };
  };
  m.def("f32_gemm_at_b",
        at_b("f32_gemm_at_b", &rnnkit::f32_own_products, "the float32 GEMM in use is MKL's",
             [](const at::Tensor& C, const at::Tensor& A, const at::Tensor& B) {
               rnnkit::f32_gemm_at_b(A.data_ptr<float>(), A.stride(0), B.data_ptr<float>(), B.stride(0), A.size(0),
                                     A.size(1), B.size(1), C.data_ptr<float>(), C.stride(0));
             }),
        py::arg("A"), py::arg("B"), "Aᵀ · B (a weight gradient) on the own float32 kernels, both read in place");
  m.def("f32_gemm_at_b_packed",
        at_b("f32_gemm_at_b_packed", &rnnkit::f32_own_products, "the float32 GEMM in use is MKL's",
             [](const at::Tensor& C, const at::Tensor& A, const at::Tensor& B) {
               rnnkit::f32_weight_gradient_packed(C, A, B);
             }),
        py::arg("A"), py::arg("B"),
        "Aᵀ · B (a weight gradient) as (Bᵀ · A)ᵀ on the own float32 kernels, A packed: a pass's larger ones");
  m.def("bf16_gemm_at_b",
        at_b("bf16_gemm_at_b", &rnnkit::bf16_products, "no bfloat16 GEMM kernels in use ('none')",
             [](const at::Tensor& C, const at::Tensor& A, const at::Tensor& B) { rnnkit::bf16_weight_gradient(C, A, B); }),
        py::arg("A"), py::arg("B"), "Aᵀ · B as a bfloat16 module's weight gradient: operands rounded to bfloat16");
  m.def("f32_at_b_in_place", &rnnkit::f32_at_b_in_place, py::arg("rows"), py::arg("N"),
        "whether a pass's weight gradient Aᵀ · B with A [rows, N] runs on f32_gemm_at_b (else "
        "f32_gemm_at_b_packed where f32_own_weight_gradients(), MKL's otherwise)");
  m.def("f32_own_weight_gradients", &rnnkit::f32_own_weight_gradients,
        "whether a pass's float32 weight gradients run on the own kernels (avx512), not MKL's");
  m.def("f32_gemm_count", &rnnkit::f32_gemm_count, "products the own float32 kernels have taken (tests)");
  m.def("bf16_round_part_count", &rnnkit::bf16_round_part_count,
        "pieces of dG the bfloat16 backward has rounded a step at a time (tests)");
  m.def("fp32_gemm", [] { return std::string(rnnkit::f32_kernel()); },
        "the float32 GEMM kernels in use: avx512, avx512-mkl (MKL's weight gradients), avx2 (the kernels' own) or mkl");
  m.def("fp32_gemms", &rnnkit::f32_kernels, "the float32 GEMM kernels this CPU can run");
  m.def("set_fp32_gemm", &rnnkit::set_f32_kernel, py::arg("name"),
        "use these float32 GEMM kernels from now on ('auto': the CPU's choice); returns the previous name");
  m.def("bf16_kernel", [] { return std::string(rnnkit::bf16_kernel()); },
        "the bfloat16 GEMM kernels in use: amx-bf16, avx512-bf16, emulated-bf16 or none (bfloat16 weights widened)");
  m.def("bf16_kernels", &rnnkit::bf16_kernels, "the bfloat16 GEMM kernels this CPU can run");
  m.def("set_bf16_kernel", &rnnkit::set_bf16_kernel, py::arg("name"),
        "use these bfloat16 GEMM kernels from now on ('auto': the CPU's choice); returns the previous name");
  m.def("int8_kernel", [] { return std::string(rnnkit::int8_kernel()); },
        "the int8 kernels in use: amx-int8, avx512-vnni, avx-vnni, avx2 or scalar");
  m.def("int8_kernels", &rnnkit::int8_kernels, "the int8 kernels this CPU can run");
  m.def("set_int8_kernel", &rnnkit::set_int8_kernel, py::arg("name"),
        "use these int8 kernels from now on ('auto': the CPU's choice); returns the previous name");
  m.def("saved_count", [] { return int(rnnkit::kNumSaved); }, "entries of the saved list");
  py::class_<rnnkit::StepPlan>(m, "StepPlan", "a pass's weights and scalars, fixed (inference): one step, or a whole sequence")
      .def("__call__", &rnnkit::StepPlan::call, py::arg("input"), py::arg("hx"))
      .def("sequence", &rnnkit::StepPlan::sequence, py::arg("input"), py::arg("hx"));
  m.def("step_plan", &rnnkit::make_step_plan, "a StepPlan (the pass arguments; x, h0, c0 are ignored)",
        RNNKIT_PASS_PY_ARGS, py::arg("W_scale") = py::none(), py::arg("R_scale") = py::none(),
        py::arg("W_hr_scale") = py::none());
  m.def("set_poison", [](bool on) { rnnkit::poison_flag() = on; }, "NaN-fill every buffer the kernels allocate");
  m.def("cached_buffer_bytes", &rnnkit::cached_buffer_bytes, "bytes of freed buffers the kernels keep for reuse");
  m.def("release_cached_buffers", &rnnkit::release_cached_buffers, "give the kept buffers back to the system");
  m.def(
      "cached_empty",
      [](std::vector<int64_t> sizes, const at::Tensor& like) { return rnnkit::cached_empty(sizes, like); },
      "an uninitialized tensor of like's dtype, from the buffer cache when 256 KB or more (tests)");
  m.def(
      "activations",
      [](const at::Tensor& v, bool quick) {  // σ(v) and tanh(v) as the passes compute them (tests)
        TORCH_CHECK(v.dim() == 1 && v.is_contiguous(), "activations: a contiguous 1-D tensor");
        at::Tensor s = v.clone(), t = v.clone();
        AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "activations", [&] {
          rnnkit::sigmoid_inplace(s.data_ptr<scalar_t>(), s.numel(), quick);
          rnnkit::tanh_inplace(t.data_ptr<scalar_t>(), t.numel(), quick);
        });
        return std::make_pair(s, t);
      },
      py::arg("v"), py::arg("quick") = false,
      "σ and tanh of a 1-D tensor through the passes' vectorized activations (quick: int8 inference's forms)");
}
