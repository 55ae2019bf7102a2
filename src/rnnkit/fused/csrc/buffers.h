// Where the fused passes' buffers come from: a cache of freed large blocks (buffers.cpp), and
// the poison switch the tests use to show reads of unwritten memory.
#pragma once

#include <ATen/core/Tensor.h>

namespace rnnkit {

using at::Tensor;

// Tests set this to fill every buffer the kernels allocate with NaN, so a value that is read
// before it is written shows up as a NaN in the outputs or gradients.
bool& poison_flag();

// Uninitialized, from the cache of freed large buffers when at least 256 KB.
Tensor cached_empty(at::IntArrayRef sizes, const Tensor& like);
// The same for a CPU tensor of `dtype` (scratch not shaped after an operand).
Tensor cached_empty(at::IntArrayRef sizes, at::ScalarType dtype);
// a · b into a buffer from that cache.
Tensor mm_cached(const Tensor& a, const Tensor& b);

// A buffer that is always fully written before it is read (NaN-filled under poison_flag()).
Tensor new_buffer(at::IntArrayRef sizes, const Tensor& like);
// A buffer that must start at zero (accumulators).
Tensor zero_buffer(at::IntArrayRef sizes, const Tensor& like);

// The cache's bookkeeping, for rnnkit.fused.cached_buffer_bytes / release_cached_buffers.
size_t cached_buffer_bytes();
void release_cached_buffers();

}  // namespace rnnkit
