// The fused passes, one per cell family (lstm.cpp, gru.cpp, rnn.cpp).
//
// forward(tensors, scalars, training) -> {y [T, B, Hr], h_n [B, Hr], c_n [B, H] or undefined,
//   saved...}: `tensors` and `scalars` are the argument pack of PassArgs (launcher.py builds
//   it); with training=false nothing per step is kept.
// backward(tensors, scalars, saved, {dy, dh_n, dc_n}, need_dx) -> the gradients of the first
//   15 tensors of the pack (undefined where the piece is absent).
#pragma once

#include "common.h"

namespace rnnkit {

// Slots of the saved list (undefined where a configuration has nothing to keep).
enum Saved : int {
  kInputRaw, kInputMean, kInputRstd,  // W x before LN_x, its row statistics
  kGates,                             // post-activation gates [T, B, ·]
  kCellPrev,                          // LSTM: c entering each step [T, B, H]
  kRecurrentRaw, kRecurrentMean, kRecurrentRstd,  // R h before LN_h, its row statistics
  kCellMean, kCellRstd,               // LSTM: LN_c statistics [T, B]
  kProjClipped,                       // LSTM: |W_hr m| > proj_clip [T, B, P] (bool; with a proj clip)
  kOutput,                            // y [T, B, Hr]: the backward rebuilds h entering each step from it
  kNumSaved
};

std::vector<Tensor> lstm_forward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                 bool training);
std::vector<Tensor> lstm_backward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                  const std::vector<OptTensor>& saved, const std::vector<Tensor>& grads,
                                  bool need_dx);
std::vector<Tensor> gru_forward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                bool training);
std::vector<Tensor> gru_backward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                 const std::vector<OptTensor>& saved, const std::vector<Tensor>& grads,
                                 bool need_dx);
std::vector<Tensor> rnn_forward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                bool training);
std::vector<Tensor> rnn_backward(const std::vector<OptTensor>& tensors, const std::vector<double>& scalars,
                                 const std::vector<OptTensor>& saved, const std::vector<Tensor>& grads,
                                 bool need_dx);

// Saved-list helpers shared by the three families.
inline std::vector<Tensor> saved_slots() { return std::vector<Tensor>(kNumSaved); }
inline Tensor slot(const std::vector<OptTensor>& saved, int i) {
  return (size_t(i) < saved.size() && saved[i].has_value()) ? *saved[i] : Tensor();
}

}  // namespace rnnkit
