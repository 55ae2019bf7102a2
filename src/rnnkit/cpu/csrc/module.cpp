// The extension module: shared helpers (common.h) and the Python bindings of the passes.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ops/empty.h>

#include <limits>

#include "common.h"
#include "passes.h"

extern "C" {
// BLAS from the MKL that libtorch_cpu links and exports (LP64: int sizes).
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace rnnkit {

bool& poison_flag() {
  static bool on = false;
  return on;
}

Tensor new_buffer(at::IntArrayRef sizes, const Tensor& like) {
  Tensor t = at::empty(sizes, like.options());
  if (poison_flag()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

Tensor zero_buffer(at::IntArrayRef sizes, const Tensor& like) { return at::zeros(sizes, like.options()); }

// Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: swap the operands and the sizes.
template <>
void gemm<float>(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int m = int(N), n = int(M), k = int(K), la = int(ldb), lb = int(lda), lc = int(ldc);
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

template <>
void gemm<double>(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                  int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int m = int(N), n = int(M), k = int(K), la = int(ldb), lb = int(lda), lc = int(ldc);
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

static Tensor opt(const std::vector<OptTensor>& tensors, size_t i) {
  return (i < tensors.size() && tensors[i].has_value()) ? *tensors[i] : Tensor();
}

PassArgs::PassArgs(const std::vector<OptTensor>& t, const std::vector<double>& s) {
  TORCH_CHECK(t.size() == 19 && s.size() == 8, "rnnkit fused: bad argument pack");
  x = opt(t, 0), h0 = opt(t, 1), c0 = opt(t, 2), W = opt(t, 3), R = opt(t, 4);
  b_W = opt(t, 5), b_R = opt(t, 6), W_hr = opt(t, 7), peephole = opt(t, 8);
  ln_x_gain = opt(t, 9), ln_x_shift = opt(t, 10), ln_h_gain = opt(t, 11), ln_h_shift = opt(t, 12);
  ln_c_gain = opt(t, 13), ln_c_shift = opt(t, 14);
  step_mask = opt(t, 15), recurrent_mask = opt(t, 16), zoneout_h = opt(t, 17), zoneout_c = opt(t, 18);
  cell_clip = s[0], proj_clip = s[1], zoneout_h_p = s[2], zoneout_c_p = s[3];
  reverse = s[4] != 0, coupled = s[5] != 0, reset_after = s[6] != 0, relu = s[7] != 0;
  T = x.size(0), B = x.size(1), I = x.size(2);
  GH = W.size(0), Hr = R.size(1);
  H = W_hr.defined() ? W_hr.size(1) : (c0.defined() ? c0.size(1) : Hr);
}

Tensor sum_biases(const Tensor& first, const Tensor& second) {
  if (first.defined() && second.defined()) return first + second;
  return first.defined() ? first : second;
}

Tensor input_projection(const PassArgs& a, const Tensor& bias, bool training, Tensor& raw, Tensor& mean,
                        Tensor& rstd) {
  const Tensor x2 = a.x.view({a.T * a.B, a.I});
  Tensor gx = new_buffer({a.T * a.B, a.GH}, a.x);
  if (a.ln_x_gain.defined()) {
    at::mm_out(gx, x2, a.W.t());
    auto [out, row_mean, row_rstd] =
        at::native_layer_norm(gx, {a.GH}, a.ln_x_gain, a.ln_x_shift, kLayerNormEps);
    if (bias.defined()) out.add_(bias);
    if (training) raw = gx, mean = row_mean, rstd = row_rstd;
    return out;
  }
  if (bias.defined()) {
    at::addmm_out(gx, bias, x2, a.W.t());
  } else {
    at::mm_out(gx, x2, a.W.t());
  }
  return gx;
}

std::vector<Tensor> input_projection_backward(const PassArgs& a, const Tensor& dA, const Tensor& raw,
                                              const Tensor& mean, const Tensor& rstd, bool need_dx) {
  Tensor dpre = dA, dgain, dshift;
  if (a.ln_x_gain.defined()) {
    auto [d_in, d_gain, d_shift] = at::native_layer_norm_backward(
        dA, raw, {a.GH}, mean, rstd, a.ln_x_gain, a.ln_x_shift, {true, true, true});
    dpre = d_in, dgain = d_gain, dshift = d_shift;
  }
  const Tensor x2 = a.x.view({a.T * a.B, a.I});
  Tensor dW = at::mm(dpre.t(), x2);  // [G·H, I]
  Tensor dx = need_dx ? at::mm(dpre, a.W).view({a.T, a.B, a.I}) : Tensor();
  return {dx, dW, dgain, dshift};
}

}  // namespace rnnkit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rnnkit fused CPU passes (LSTM, GRU, RNN): forward and backward time loops";
  m.def("set_poison", [](bool on) { rnnkit::poison_flag() = on; }, "NaN-fill every buffer the kernels allocate");
  m.def("lstm_forward", &rnnkit::lstm_forward);
  m.def("lstm_backward", &rnnkit::lstm_backward);
  m.def("gru_forward", &rnnkit::gru_forward);
  m.def("gru_backward", &rnnkit::gru_backward);
  m.def("rnn_forward", &rnnkit::rnn_forward);
  m.def("rnn_backward", &rnnkit::rnn_backward);
}
