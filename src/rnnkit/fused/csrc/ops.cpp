// The extension's Python bindings: the two entry points of the fused pass ops (rnnkit/fused/ops.py
// registers them as the custom ops rnnkit::fused_pass_forward / fused_pass_backward), taking every
// argument by the name the op schema gives it (rnnkit/passes.py), and the buffer-cache controls.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <set>

#include "pass.h"

namespace py = pybind11;

namespace rnnkit {
namespace {

// The op's arguments, taken by name: a missing or an unknown name is an error that says which.
class Named {
 public:
  explicit Named(const py::kwargs& kwargs) : kwargs_(kwargs) {
    for (const auto& item : kwargs_) unread_.insert(item.first.cast<std::string>());
  }
  template <typename T>
  T get(const char* name) {
    TORCH_CHECK(kwargs_.contains(name), "rnnkit fused: missing argument '", name, "'");
    unread_.erase(name);
    return kwargs_[name].cast<T>();
  }
  Tensor tensor(const char* name) {  // an optional tensor: None -> undefined
    TORCH_CHECK(kwargs_.contains(name), "rnnkit fused: missing argument '", name, "'");
    unread_.erase(name);
    const py::handle value = kwargs_[name];
    return value.is_none() ? Tensor() : value.cast<Tensor>();
  }
  void done() const {
    TORCH_CHECK(unread_.empty(), "rnnkit fused: unknown argument '", *unread_.begin(), "'");
  }

 private:
  const py::kwargs& kwargs_;
  std::set<std::string> unread_;
};

Tensor contiguous(const Tensor& t) { return t.defined() ? t.contiguous() : t; }

// The pass description every op shares (rnnkit/passes.py, PASS_ARGUMENTS).
PassArgs pass_args(Named& in) {
  PassArgs a;
  a.mode = in.get<std::string>("mode");
  a.x = contiguous(in.tensor("x")), a.h0 = contiguous(in.tensor("h0")), a.c0 = contiguous(in.tensor("c0"));
  a.W = contiguous(in.tensor("W")), a.R = contiguous(in.tensor("R"));
  a.b_W = contiguous(in.tensor("b_W")), a.b_R = contiguous(in.tensor("b_R"));
  a.W_hr = contiguous(in.tensor("W_hr")), a.peephole = contiguous(in.tensor("peephole"));
  a.ln_x_gain = contiguous(in.tensor("ln_x_gain")), a.ln_x_shift = contiguous(in.tensor("ln_x_shift"));
  a.ln_h_gain = contiguous(in.tensor("ln_h_gain")), a.ln_h_shift = contiguous(in.tensor("ln_h_shift"));
  a.ln_c_gain = contiguous(in.tensor("ln_c_gain")), a.ln_c_shift = contiguous(in.tensor("ln_c_shift"));
  a.lengths = in.tensor("lengths");
  a.recurrent_mask = contiguous(in.tensor("recurrent_mask"));
  a.zoneout_h = contiguous(in.tensor("zoneout_h_mask")), a.zoneout_c = contiguous(in.tensor("zoneout_c_mask"));
  a.zoneout_h_p = in.get<double>("zoneout_h"), a.zoneout_c_p = in.get<double>("zoneout_c");
  const auto cell_clip = in.get<std::optional<double>>("cell_clip");
  const auto proj_clip = in.get<std::optional<double>>("proj_clip");
  a.cell_clip = cell_clip.value_or(0), a.proj_clip = proj_clip.value_or(0);
  a.coupled = in.get<bool>("coupled_gates"), a.reset_after = in.get<bool>("reset_after");
  a.reverse = in.get<bool>("reverse");
  a.finish();
  return a;
}

// Undefined results become empty tensors: an op returns tensors, never None.
Tensor or_empty(const Tensor& t, const Tensor& like) { return t.defined() ? t : at::empty({0}, like.options()); }

// -> (y, h_n, c_n, saved): c_n empty unless LSTM; saved has Saved::kNumSaved entries when
// training (empty where nothing is kept), none otherwise.
py::tuple pass_forward(const py::kwargs& kwargs) {
  Named in(kwargs);
  const PassArgs a = pass_args(in);
  const bool training = in.get<bool>("training");
  in.done();
  ForwardResult out;
  {
    py::gil_scoped_release no_gil;
    if (a.mode == "lstm") {
      out = lstm_forward(a, training);
    } else if (a.mode == "gru") {
      out = gru_forward(a, training);
    } else {
      out = rnn_forward(a, training);
    }
  }
  std::vector<Tensor> saved;
  for (size_t i = 3; i < out.size(); ++i) saved.push_back(or_empty(out[i], a.x));
  return py::make_tuple(out[0], out[1], or_empty(out[2], a.x), saved);
}

// -> (dx, dh0, dc0, dweights): dx empty unless need_dx, dc0 empty unless LSTM, dweights the
// gradient block of the present weights in the packed buffer's order.
py::tuple pass_backward(const py::kwargs& kwargs) {
  Named in(kwargs);
  const PassArgs a = pass_args(in);
  const Tensor y = in.tensor("y");
  const std::vector<Tensor> saved = in.get<std::vector<Tensor>>("saved");
  const Tensor dy = in.tensor("dy"), dh_n = in.tensor("dh_n"), dc_n = in.tensor("dc_n");
  GradNeeds needs;
  needs.dx = in.get<bool>("need_dx"), needs.dW = in.get<bool>("need_dW");
  needs.dR = in.get<bool>("need_dR"), needs.dW_hr = in.get<bool>("need_dW_hr");
  in.done();
  TORCH_CHECK(saved.size() == size_t(kNumSaved), "rnnkit fused: saved: expected ", int(kNumSaved), " tensors, got ",
              saved.size());
  BackwardResult g;
  {
    py::gil_scoped_release no_gil;
    if (a.mode == "lstm") {
      g = lstm_backward(a, y, saved, dy, dh_n, dc_n, needs);
    } else if (a.mode == "gru") {
      g = gru_backward(a, y, saved, dy, dh_n, dc_n, needs);
    } else {
      g = rnn_backward(a, y, saved, dy, dh_n, dc_n, needs);
    }
  }
  return py::make_tuple(or_empty(g.dx, a.x), g.dh0, or_empty(g.dc0, a.x), g.dweights);
}

}  // namespace
}  // namespace rnnkit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rnnkit fused CPU passes (LSTM, GRU, RNN): forward and backward time loops";
  m.def("pass_forward", &rnnkit::pass_forward, "one layer-direction pass forward; arguments by name");
  m.def("pass_backward", &rnnkit::pass_backward, "its backward; arguments by name");
  m.def("saved_count", [] { return int(rnnkit::kNumSaved); }, "entries of the saved list");
  m.def("set_poison", [](bool on) { rnnkit::poison_flag() = on; }, "NaN-fill every buffer the kernels allocate");
  m.def("cached_buffer_bytes", &rnnkit::cached_buffer_bytes, "bytes of freed buffers the kernels keep for reuse");
  m.def("release_cached_buffers", &rnnkit::release_cached_buffers, "give the kept buffers back to the system");
  m.def(
      "cached_empty",
      [](std::vector<int64_t> sizes, const at::Tensor& like) { return rnnkit::cached_empty(sizes, like); },
      "an uninitialized tensor of like's dtype, from the buffer cache when 256 KB or more (tests)");
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
}
