// The extension module: shared helpers (common.h) and the Python bindings of the passes.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/cpu/vec/functional.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>

#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <unordered_map>

#include <pthread.h>

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

namespace {
using FVec = at::vec::Vectorized<float>;

// One batch row (B = 1, streaming): C = x · op(M) is a matrix-vector product that reads all of M
// per step. These two loops stream a 1 MB M from L2 at ~140 GB/s here, MKL's packed GEMM and its
// gemv at ~100 and ~70 (C++ microbenchmark, H = 256 LSTM's R). Both read M once, in order.
// Threads split the output when M is large enough to pay for them.
constexpr int64_t kGemvGrain = 1 << 16;  // matrix values per thread, at least

inline float hsum(const FVec& v) {
  return at::vec::vec_reduce_all<float>([](const FVec& a, const FVec& b) { return a + b; }, v);
}

inline void put(float* c, float value, float beta) { *c = beta == 0 ? value : value + beta * *c; }

// C[n] = Σ_k x[k]·M[n, k] + beta·C[n] for n in [0, N): dot products, four rows of M at a time.
void gemv_rows(const float* M, int64_t ldm, int64_t N, int64_t K, const float* x, float beta, float* C) {
  at::parallel_for(0, (N + 3) / 4, std::max<int64_t>(1, kGemvGrain / (4 * K)), [&](int64_t begin, int64_t end) {
    const int64_t stop = std::min(N, 4 * end);
    int64_t n = 4 * begin;
    for (; n + 4 <= stop; n += 4) {
      const float* m = M + n * ldm;
      FVec s0(0), s1(0), s2(0), s3(0);
      vec_loop<float>(K, [&](int64_t k, int64_t count) {
        const FVec xv = FVec::loadu(x + k, count);
        s0 = at::vec::fmadd(FVec::loadu(m + k, count), xv, s0);
        s1 = at::vec::fmadd(FVec::loadu(m + ldm + k, count), xv, s1);
        s2 = at::vec::fmadd(FVec::loadu(m + 2 * ldm + k, count), xv, s2);
        s3 = at::vec::fmadd(FVec::loadu(m + 3 * ldm + k, count), xv, s3);
      });
      put(C + n, hsum(s0), beta), put(C + n + 1, hsum(s1), beta);
      put(C + n + 2, hsum(s2), beta), put(C + n + 3, hsum(s3), beta);
    }
    for (; n < stop; ++n) {
      FVec s(0);
      vec_loop<float>(K, [&](int64_t k, int64_t count) {
        s = at::vec::fmadd(FVec::loadu(M + n * ldm + k, count), FVec::loadu(x + k, count), s);
      });
      put(C + n, hsum(s), beta);
    }
  });
}

// C[n] = Σ_k x[k]·M[k, n] + beta·C[n]: rows of M scaled and summed into four SIMD registers'
// worth of columns at a time.
void gemv_columns(const float* M, int64_t ldm, int64_t N, int64_t K, const float* x, float beta, float* C) {
  constexpr int64_t w = FVec::size(), block = 4 * w;
  at::parallel_for(0, (N + block - 1) / block, std::max<int64_t>(1, kGemvGrain / (block * K)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * block; n < std::min(N, end * block); n += block) {
      const int64_t width = std::min(block, N - n);
      FVec acc[4] = {FVec(0), FVec(0), FVec(0), FVec(0)};
      if (width == block) {
        for (int64_t k = 0; k < K; ++k) {
          const FVec xk(x[k]);
          const float* m = M + k * ldm + n;
          for (int j = 0; j < 4; ++j) acc[j] = at::vec::fmadd(FVec::loadu(m + j * w), xk, acc[j]);
        }
      } else {
        for (int64_t k = 0; k < K; ++k) {
          const FVec xk(x[k]);
          const float* m = M + k * ldm + n;
          for (int64_t j = 0; j * w < width; ++j) {
            acc[j] = at::vec::fmadd(FVec::loadu(m + j * w, std::min(w, width - j * w)), xk, acc[j]);
          }
        }
      }
      for (int64_t j = 0; j * w < width; ++j) {
        const int64_t count = std::min(w, width - j * w);
        float* c = C + n + j * w;
        const FVec out = beta == 0 ? acc[j] : at::vec::fmadd(FVec(beta), FVec::loadu(c, count), acc[j]);
        out.store(c, count);
      }
    }
  });
}
}  // namespace

// In column-major terms Cᵀ[N, rows] = op(M)ᵀ[N, K] · Xᵀ[K, rows]: op(M)ᵀ is BLAS's packed "A".
// One row needs no packing: multiply() runs the matrix-vector loops above on M itself.
template <>
PackedRight<float>::PackedRight(const float* M, int64_t ldm, bool trans, int64_t rows, int64_t N, int64_t K,
                                const Tensor& like)
    : rows_(rows), N_(N), K_(K), ldm_(ldm), matrix_(M), trans_(trans) {
  if (rows == 1) return;
  const char id = 'A', ta = trans ? 'T' : 'N';
  const int m = int(N), n = int(rows), k = int(K), ld = int(ldm);
  const float one = 1;
  const size_t bytes = sgemm_pack_get_size_(&id, &m, &n, &k);
  storage_ = cached_empty({int64_t(bytes / sizeof(float) + 1)}, like);
  sgemm_pack_(&id, &ta, &m, &n, &k, &one, M, &ld, storage_.data_ptr<float>());
}

template <>
void PackedRight<float>::multiply(const float* X, int64_t ldx, float beta, float* C, int64_t ldc) const {
  if (rows_ == 1) {
    // op(M) = Mᵀ: M is [N, K] and C[n] = M[n, :]·x; otherwise M is [K, N] and C = Σ_k x[k]·M[k, :].
    (trans_ ? gemv_rows : gemv_columns)(matrix_, ldm_, N_, K_, X, beta, C);
    return;
  }
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

// Large buffers come from blocks that earlier passes freed. A fresh block from the system costs
// a page fault per 4 KB page on first touch: a small LN-LSTM's training call (T 100, B 16, H 128,
// 2 layers) faults on ~25 MB of buffers, ~13% of its time here. The blocks are a tensor's storage
// like any other (resizable; back into this cache when the tensor dies). The cache keeps at most
// RNNKIT_CPU_CACHE_MB (default 512; 0 turns it off), dropping its largest blocks first when a
// freed one does not fit; release() gives the kept blocks back to the system.
class BufferCache final : public c10::Allocator {
 public:
  static BufferCache& get() {
    static BufferCache* cache = new BufferCache();  // never destroyed: storages may outlive static destruction
    return *cache;
  }

  bool on() const { return limit_ > 0; }

  c10::DataPtr allocate(size_t bytes) override {
    const size_t want = (std::max<size_t>(bytes, 1) + kGranule - 1) / kGranule * kGranule;
    std::unique_lock<std::mutex> lock(mutex_);
    void* block = nullptr;
    auto it = free_.lower_bound(want);  // the smallest kept block that fits, if it wastes at most a quarter
    if (it != free_.end() && it->first <= want + want / 4) {
      block = it->second;
      cached_ -= it->first;
      free_.erase(it);
    } else {
      lock.unlock();
      block = c10::alloc_cpu(want);  // 64-byte aligned
      lock.lock();
      size_of_[block] = want;
    }
    return {block, block, &BufferCache::free_block, at::Device(at::kCPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  size_t cached() {
    std::lock_guard<std::mutex> guard(mutex_);
    return cached_;
  }

  void release() {
    std::lock_guard<std::mutex> guard(mutex_);
    while (!free_.empty()) drop(free_.begin());
  }

  static constexpr size_t kMinBytes = 256 << 10;  // smaller buffers: malloc's heap has them without faults

 private:
  static constexpr size_t kGranule = 64 << 10;

  BufferCache() {
    limit_ = size_t(512) << 20;
    if (const char* text = std::getenv("RNNKIT_CPU_CACHE_MB")) {
      char* end = nullptr;
      const long mb = std::strtol(text, &end, 10);
      if (end != text && *end == '\0' && mb >= 0 && mb <= (1L << 30)) {
        limit_ = size_t(mb) << 20;
      } else {
        TORCH_WARN("rnnkit: RNNKIT_CPU_CACHE_MB must be a whole number of MB (0 turns the cache off), got '",
                   text, "'; using 512");
      }
    }
    // A child forked while another thread held the lock would wait on it forever.
    pthread_atfork(nullptr, nullptr, [] { new (&get().mutex_) std::mutex(); });
  }

  void drop(std::multimap<size_t, void*>::iterator it) {  // mutex_ held
    cached_ -= it->first;
    size_of_.erase(it->second);
    c10::free_cpu(it->second);
    free_.erase(it);
  }

  static void free_block(void* block) {
    BufferCache& cache = get();
    std::lock_guard<std::mutex> guard(cache.mutex_);
    const size_t size = cache.size_of_.at(block);
    while (!cache.free_.empty() && cache.cached_ + size > cache.limit_) cache.drop(std::prev(cache.free_.end()));
    if (cache.cached_ + size <= cache.limit_) {
      cache.free_.emplace(size, block);
      cache.cached_ += size;
    } else {
      cache.size_of_.erase(block);
      c10::free_cpu(block);
    }
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> free_;         // kept blocks: size -> block
  std::unordered_map<void*, size_t> size_of_;  // every block this cache made, in use or kept
  size_t cached_ = 0, limit_ = 0;
};

Tensor cached_empty(at::IntArrayRef sizes, const Tensor& like) {
  const int64_t bytes = c10::multiply_integers(sizes) * int64_t(like.element_size());
  BufferCache& cache = BufferCache::get();
  if (bytes < int64_t(BufferCache::kMinBytes) || !cache.on()) return at::empty(sizes, like.options());
  return at::detail::empty_generic(sizes, &cache, c10::DispatchKeySet(c10::DispatchKey::CPU), like.scalar_type(),
                                   std::nullopt);
}

Tensor mm_cached(const Tensor& a, const Tensor& b) {
  Tensor out = cached_empty({a.size(0), b.size(1)}, a);
  at::mm_out(out, a, b);
  return out;
}

Tensor new_buffer(at::IntArrayRef sizes, const Tensor& like) {
  Tensor t = cached_empty(sizes, like);
  if (poison_flag()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

Tensor zero_buffer(at::IntArrayRef sizes, const Tensor& like) { return cached_empty(sizes, like).zero_(); }

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
  for_rows(rows, n, [&](int64_t r0, int64_t r1) {
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
      for_rows(rows, n, [&](int64_t r0, int64_t r1) {
        scalar_t* mine = acc_p + at::get_thread_num() * 2 * n;
        for (int64_t i = r0; i < r1; ++i)
          row_layer_norm_backward(d + i * n, v + i * n, n, m[i], r[i], gain, out + i * n, mine, mine + n);
      });
    });
    const Tensor sums = acc.sum(0);
    dgain = sums[0], dshift = sums[1];
  }
  const Tensor x2 = a.x.view({a.T * a.B, a.I});
  Tensor dW = mm_cached(dA.t(), x2);  // [G·H, I]
  Tensor dx = need_dx ? mm_cached(dA, a.W).view({a.T, a.B, a.I}) : Tensor();
  return {dx, dW, dgain, dshift};
}

}  // namespace rnnkit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rnnkit fused CPU passes (LSTM, GRU, RNN): forward and backward time loops";
  m.def("set_poison", [](bool on) { rnnkit::poison_flag() = on; }, "NaN-fill every buffer the kernels allocate");
  m.def("cached_buffer_bytes", [] { return rnnkit::BufferCache::get().cached(); },
        "bytes of freed buffers the kernels keep for reuse");
  m.def("release_cached_buffers", [] { rnnkit::BufferCache::get().release(); },
        "give the kept buffers back to the system");
  m.def(
      "cached_empty",
      [](std::vector<int64_t> sizes, const at::Tensor& like) { return rnnkit::cached_empty(sizes, like); },
      "an uninitialized tensor of like's dtype, from the buffer cache when 256 KB or more");
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
