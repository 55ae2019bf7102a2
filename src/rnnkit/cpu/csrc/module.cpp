// The extension module: shared helpers (common.h) and the Python bindings of the passes.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ops/empty.h>

#include <limits>

#include "common.h"
#include "passes.h"

extern "C" {
// BLAS from the MKL that libtorch_cpu links and exports (LP64: int sizes).
// float64 GEMM (torch's MKL exports no packed dgemm).
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
// MKL's packed GEMM: pack one operand once, multiply many times.
size_t sgemm_pack_get_size_(const char* id, const int* m, const int* n, const int* k);
void sgemm_pack_(const char* id, const char* trans, const int* m, const int* n, const int* k, const float* alpha,
                 const float* src, const int* ld, float* dest);
void sgemm_compute_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* a,
                    const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc);
}

namespace rnnkit {

// In column-major terms Cᵀ[N, rows] = op(M)ᵀ[N, K] · Xᵀ[K, rows]: op(M)ᵀ is BLAS's packed "A".
template <>
PackedRight<float>::PackedRight(const float* M, int64_t ldm, bool trans, int64_t rows, int64_t N, int64_t K,
                                const Tensor& like)
    : rows_(rows), N_(N), K_(K), ldm_(ldm), matrix_(M), trans_(trans) {
  const char id = 'A', ta = trans ? 'T' : 'N';
  const int m = int(N), n = int(rows), k = int(K), ld = int(ldm);
  const float one = 1;
  const size_t bytes = sgemm_pack_get_size_(&id, &m, &n, &k);
  storage_ = at::empty({int64_t(bytes / sizeof(float) + 1)}, like.options());
  sgemm_pack_(&id, &ta, &m, &n, &k, &one, M, &ld, storage_.data_ptr<float>());
}

template <>
void PackedRight<float>::multiply(const float* X, int64_t ldx, float beta, float* C, int64_t ldc) const {
  const char ta = 'P', tb = 'N';
  const int m = int(N_), n = int(rows_), k = int(K_), lda = int(ldm_), ldb = int(ldx), lc = int(ldc);
  sgemm_compute_(&ta, &tb, &m, &n, &k, storage_.data_ptr<float>(), &lda, X, &ldb, &beta, C, &lc);
}

// float64 (gradcheck, not speed): torch's MKL exports no packed dgemm, so keep M and call dgemm.
template <>
PackedRight<double>::PackedRight(const double* M, int64_t ldm, bool trans, int64_t rows, int64_t N, int64_t K,
                                 const Tensor& like)
    : rows_(rows), N_(N), K_(K), ldm_(ldm), matrix_(M), trans_(trans) {}

template <>
void PackedRight<double>::multiply(const double* X, int64_t ldx, double beta, double* C, int64_t ldc) const {
  const char ta = trans_ ? 'T' : 'N', tb = 'N';
  const int m = int(N_), n = int(rows_), k = int(K_), la = int(ldm_), lb = int(ldx), lc = int(ldc);
  const double one = 1;
  dgemm_(&ta, &tb, &m, &n, &k, &one, matrix_, &la, X, &lb, &beta, C, &lc);
}

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

// LN_x(W x) + bias of the rows of x2 [n, I] -> [n, G·H].
static Tensor project_rows(const PassArgs& a, const Tensor& x2, const Tensor& bias, bool training, Tensor& raw,
                           Tensor& mean, Tensor& rstd) {
  Tensor gx = new_buffer({x2.size(0), a.GH}, a.x);
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

Tensor input_projection(const PassArgs& a, const Tensor& bias, bool training, Tensor& raw, Tensor& mean,
                        Tensor& rstd) {
  return project_rows(a, a.x.view({a.T * a.B, a.I}), bias, training, raw, mean, rstd);
}

InputSteps::InputSteps(const PassArgs& a, const Tensor& bias, bool training, Tensor& raw, Tensor& mean,
                       Tensor& rstd)
    : a_(a), bias_(bias) {
  chunk_steps_ = std::max<int64_t>(1, kChunkRows / std::max<int64_t>(1, a.B));
  if (training || chunk_steps_ >= a.T) all_ = input_projection(a, bias, training, raw, mean, rstd);
}

void InputSteps::compute_chunk(int64_t s) {
  const int64_t count = std::min(chunk_steps_, a_.T - s);
  first_ = a_.reverse ? a_.T - s - count : s;
  Tensor unused_raw, unused_mean, unused_rstd;
  chunk_ = project_rows(a_, a_.x.narrow(0, first_, count).view({count * a_.B, a_.I}), bias_, false, unused_raw,
                        unused_mean, unused_rstd);
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
  m.def(
      "activations",
      [](const at::Tensor& v) {  // σ(v) and tanh(v) as the passes compute them (tests)
        TORCH_CHECK(v.dim() == 1 && v.is_contiguous(), "activations: a contiguous 1-D tensor");
        at::Tensor s = v.clone(), t = v.clone();
        AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "activations", [&] {
          rnnkit::sigmoid_inplace(s.data_ptr<scalar_t>(), s.numel());
          rnnkit::tanh_inplace(t.data_ptr<scalar_t>(), t.numel());
        });
        return std::make_pair(s, t);
      },
      "σ and tanh of a 1-D tensor through the passes' vectorized activations");
  m.def("lstm_forward", &rnnkit::lstm_forward);
  m.def("lstm_backward", &rnnkit::lstm_backward);
  m.def("gru_forward", &rnnkit::gru_forward);
  m.def("gru_backward", &rnnkit::gru_backward);
  m.def("rnn_forward", &rnnkit::rnn_forward);
  m.def("rnn_backward", &rnnkit::rnn_backward);
}
