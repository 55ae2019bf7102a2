// The buffer cache of the fused passes (see BufferCache) and the buffer helpers of buffers.h.
#include "buffers.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>

#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <unordered_map>

#include <pthread.h>

namespace rnnkit {

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

size_t cached_buffer_bytes() { return BufferCache::get().cached(); }

void release_cached_buffers() { BufferCache::get().release(); }

}  // namespace rnnkit
