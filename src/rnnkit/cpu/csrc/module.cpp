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

// out = (v − mean) · rstd · gain + shift (+ bias) for each of `rows` rows of n values; v and
// out may alias; mean / rstd (one per row) are written when non-null.
template <typename scalar_t>
static void layer_norm_rows(const scalar_t* v, int64_t rows, int64_t n, const scalar_t* gain, const scalar_t* shift,
                            const scalar_t* bias, scalar_t* out, scalar_t* mean, scalar_t* rstd) {
  using Vec = at::vec::Vectorized<scalar_t>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
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

InputSteps::InputSteps(const PassArgs& a, const Tensor& bias, bool training, Tensor& raw, Tensor& mean,
                       Tensor& rstd)
    : a_(a), training_(training), bias_(bias) {
  // Chunks of ~256 KB of gates (they stay in L2 until their steps read them), but at least 128
  // rows and at least I rows, so each chunk's GEMM stays about as efficient as one big one
  // (measured: a wide layer, I = 1024, ran 20% slower with 128-row chunks).
  const int64_t rows = std::max({int64_t(128), a.I, (int64_t(256) << 10) / (a.GH * int64_t(a.x.element_size()))});
  chunk_steps_ = std::min(a.T, std::max<int64_t>(1, rows / std::max<int64_t>(1, a.B)));
  const int64_t n = (training ? a.T : chunk_steps_) * a.B;
  const bool ln = a.ln_x_gain.defined();
  out_ = new_buffer({n, a.GH}, a.x);
  if (ln && training) {
    raw_ = new_buffer({n, a.GH}, a.x), mean_ = new_buffer({n, 1}, a.x), rstd_ = new_buffer({n, 1}, a.x);
    raw = raw_, mean = mean_, rstd = rstd_;
  }
}

void InputSteps::compute_chunk(int64_t s) {
  const int64_t count = std::min(chunk_steps_, a_.T - s), B = a_.B, rows = count * B;
  first_ = a_.reverse ? a_.T - s - count : s;
  const int64_t row0 = training_ ? first_ * B : 0;
  const Tensor x2 = a_.x.narrow(0, first_, count).view({rows, a_.I});
  Tensor out = out_.narrow(0, row0, rows);
  if (!a_.ln_x_gain.defined()) {
    if (bias_.defined()) {
      at::addmm_out(out, bias_, x2, a_.W.t());
    } else {
      at::mm_out(out, x2, a_.W.t());
    }
    return;
  }
  Tensor raw = raw_.defined() ? raw_.narrow(0, row0, rows) : out;  // inference normalizes in place
  at::mm_out(raw, x2, a_.W.t());
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "rnnkit_input_layer_norm", [&] {
    layer_norm_rows<scalar_t>(raw.data_ptr<scalar_t>(), rows, a_.GH, a_.ln_x_gain.data_ptr<scalar_t>(),
                              a_.ln_x_shift.data_ptr<scalar_t>(),
                              bias_.defined() ? bias_.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(),
                              mean_.defined() ? mean_.data_ptr<scalar_t>() + row0 : nullptr,
                              rstd_.defined() ? rstd_.data_ptr<scalar_t>() + row0 : nullptr);
  });
}

std::vector<Tensor> input_projection_backward(const PassArgs& a, const Tensor& dA, const Tensor& raw,
                                              const Tensor& mean, const Tensor& rstd, bool need_dx) {
  Tensor dgain, dshift;
  if (a.ln_x_gain.defined()) {
    // LN_x's backward row by row; each thread accumulates dγ, dβ in its own row of `acc`.
    const int64_t rows = dA.size(0), n = a.GH;
    Tensor acc = zero_buffer({at::get_num_threads(), 2, n}, dA);
    AT_DISPATCH_FLOATING_TYPES(dA.scalar_type(), "rnnkit_input_layer_norm_backward", [&] {
      const scalar_t *d = dA.data_ptr<scalar_t>(), *v = raw.data_ptr<scalar_t>();
      const scalar_t *m = mean.data_ptr<scalar_t>(), *r = rstd.data_ptr<scalar_t>();
      const scalar_t* gain = a.ln_x_gain.data_ptr<scalar_t>();
      scalar_t *out = dA.data_ptr<scalar_t>(), *acc_p = acc.data_ptr<scalar_t>();  // in place
      at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
        scalar_t* mine = acc_p + at::get_thread_num() * 2 * n;
        for (int64_t i = r0; i < r1; ++i)
          row_layer_norm_backward(d + i * n, v + i * n, n, m[i], r[i], gain, out + i * n, mine, mine + n);
      });
    });
    const Tensor sums = acc.sum(0);
    dgain = sums[0], dshift = sums[1];
  }
  const Tensor x2 = a.x.view({a.T * a.B, a.I});
  Tensor dW = at::mm(dA.t(), x2);  // [G·H, I]
  Tensor dx = need_dx ? at::mm(dA, a.W).view({a.T, a.B, a.I}) : Tensor();
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
