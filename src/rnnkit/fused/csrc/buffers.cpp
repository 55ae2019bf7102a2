// The buffer cache of the fused passes (see BufferCache) and the buffer helpers of buffers.h.
#include "buffers.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

namespace rnnkit {

bool& poison_flag() {
  static bool on = false;
  return on;
}

// Large buffers come from blocks that earlier passes freed. A fresh block from the system costs
// a page fault per 4 KB page on first touch: a small LN-LSTM's training call (T 100, B 16,
// H 128, 2 layers) uses ~36 MB of such buffers. The blocks are a tensor's storage like any other
// (resizable; back into this cache when the tensor dies).
//
// What is kept follows what recent calls use: at most the most bytes that were in use at once
// (handed out, not yet freed) during this window of kWindow requests and the last, and a quarter
// more (limit() says why), and never more
// than RNNKIT_CPU_CACHE_MB (default: an eighth of the machine's memory, at least 256 MB; 0 turns
// the cache off). A loop over one shape keeps its
// working set, so every call after the first finds all its blocks here; a stream of new shapes
// keeps about one call's worth; what a burst of large calls left is given back a window or two
// after it ends. When a freed block does not fit, the longest-kept blocks go first. Blocks are
// mapped straight from the system (mmap, not malloc's heap), so a dropped block, and release(),
// return their memory at once: with malloc, which keeps freed large chunks in its heap once its
// adaptive mmap threshold has risen, and a fixed 512 MB limit, 3,000 calls of random shapes grew a
// process from 223 to 846 MB and release() brought it back only to 424 MB.
class BufferCache final : public c10::Allocator {
 public:
  static BufferCache& get() {
    static BufferCache* cache = new BufferCache();  // never destroyed: storages may outlive static destruction
    return *cache;
  }

  bool on() const { return cap_ > 0; }

  c10::DataPtr allocate(size_t bytes) override {
    const size_t want = (std::max<size_t>(bytes, 1) + kGranule - 1) / kGranule * kGranule;
    std::unique_lock<std::mutex> lock(mutex_);
    if (requests_.fetch_add(1) % kWindow == kWindow - 1) next_window();
    void* block = nullptr;
    size_t size = want;
    auto it = free_.lower_bound(want);  // the smallest kept block that fits, if it wastes at most a quarter
    if (it != free_.end() && it->first <= want + want / 4) {
      block = it->second, size = it->first;
      forget(it);
    } else {
      lock.unlock();
      block = map_block(want);
      lock.lock();
      size_of_[block] = want;
    }
    in_use_ += size;
    peak_ = std::max(peak_, in_use_);
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

  // A request below kMinBytes (malloc's): counted toward the window too, so that calls asking for
  // small buffers only (a generation loop after training) still end windows, and what a large call
  // left is given back (it stayed, up to the cap, for as long as no large request came).
  void tick() {
    if (requests_.fetch_add(1) % kWindow == kWindow - 1) {
      std::lock_guard<std::mutex> guard(mutex_);
      next_window();
    }
  }

  static constexpr size_t kMinBytes = 256 << 10;  // smaller buffers: malloc's heap has them without faults

 private:
  static constexpr size_t kGranule = 64 << 10;
  static constexpr uint64_t kWindow = 256;  // requests: about ten calls (a training call makes 10-40)
  static constexpr long kMinDefaultCapMB = 256;

  // An eighth of the machine's memory, at least kMinDefaultCapMB: the cap bounds what the cache may
  // keep; what it keeps follows recent calls (limit()). A fixed 256 MB made a layer-norm LSTM's
  // training at T 100, B 64, H 512 (a working set of 320 MB) unmap ~60 MB of blocks a call and
  // map them again in the next: 15,296 page faults a call and 971 ms against 893 without.
  static long default_cap_mb() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return kMinDefaultCapMB;
    return std::max<long>(kMinDefaultCapMB, long(double(pages) * double(page) / 8 / (1 << 20)));
  }

  BufferCache() {
    const long default_mb = default_cap_mb();
    cap_ = size_t(default_mb) << 20;
    if (const char* text = std::getenv("RNNKIT_CPU_CACHE_MB")) {
      char* end = nullptr;
      const long mb = std::strtol(text, &end, 10);
      if (end != text && *end == '\0' && mb >= 0 && mb <= (1L << 30)) {
        cap_ = size_t(mb) << 20;
      } else {
        TORCH_WARN("rnnkit: RNNKIT_CPU_CACHE_MB must be a whole number of MB (0 turns the cache off), got '",
                   text, "'; using the default, ", default_mb,
                   " MB (an eighth of this machine's memory, at least ", kMinDefaultCapMB, " MB)");
      }
    }
    // A child forked while another thread held the lock would wait on it forever.
    pthread_atfork(nullptr, nullptr, [] { new (&get().mutex_) std::mutex(); });
  }

  static void* map_block(size_t bytes) {
    void* block = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);  // page-aligned
    TORCH_CHECK(block != MAP_FAILED, "rnnkit fused: out of memory mapping a ", bytes, "-byte buffer");
    return block;
  }

  // The most the cache may keep now: what was in use at once in this window and the last, and a
  // quarter more. A call's blocks can add up to more than its peak in use: a block freed early is
  // kept for a later request of its size, while a request it is too small or large for maps another.
  // Without the quarter a 2-layer LSTM's training call (T 100, B 16 / 32, H 128 / 256) unmapped one
  // [T, B, 4H] block a call and mapped it again in the next: 3.2 / 13 MB of page faults a call.
  size_t limit() const {
    const size_t peak = std::max(peak_, last_peak_);
    return std::min(cap_, peak + peak / 4);
  }

  void next_window() {  // mutex_ held
    last_peak_ = peak_, peak_ = in_use_;
    trim(limit());
  }

  void trim(size_t bytes) {  // mutex_ held: drop the longest-kept blocks until at most `bytes` are kept
    while (cached_ > bytes) {
      const auto range = free_.equal_range(size_of_.at(age_.front()));
      drop(std::find_if(range.first, range.second, [&](const auto& kept) { return kept.second == age_.front(); }));
    }
  }

  void keep(void* block, size_t size) {  // mutex_ held
    free_.emplace(size, block);
    position_[block] = age_.insert(age_.end(), block);
    cached_ += size;
  }

  void forget(std::multimap<size_t, void*>::iterator it) {  // mutex_ held: a kept block leaves the cache's lists
    cached_ -= it->first;
    const auto where = position_.find(it->second);
    age_.erase(where->second);
    position_.erase(where);
    free_.erase(it);
  }

  void drop(std::multimap<size_t, void*>::iterator it) {  // mutex_ held
    void* block = it->second;
    const size_t size = it->first;
    forget(it);
    size_of_.erase(block);
    munmap(block, size);
  }

  static void free_block(void* block) {
    BufferCache& cache = get();
    std::lock_guard<std::mutex> guard(cache.mutex_);
    const size_t size = cache.size_of_.at(block);
    cache.in_use_ -= size;
    const size_t limit = cache.limit();
    if (size <= limit) {
      cache.trim(limit - size);
      cache.keep(block, size);
    } else {
      cache.size_of_.erase(block);
      munmap(block, size);
    }
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> free_;         // kept blocks: size -> block
  std::list<void*> age_;                      // kept blocks, longest-kept first
  std::unordered_map<void*, std::list<void*>::iterator> position_;  // kept block -> its place in age_
  std::unordered_map<void*, size_t> size_of_;  // every block this cache made, in use or kept
  size_t cached_ = 0, in_use_ = 0, peak_ = 0, last_peak_ = 0, cap_ = 0;
  std::atomic<uint64_t> requests_{0};
};

Tensor cached_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  const int64_t bytes = c10::multiply_integers(sizes) * int64_t(c10::elementSize(dtype));
  BufferCache& cache = BufferCache::get();
  if (bytes < int64_t(BufferCache::kMinBytes) || !cache.on()) {
    if (cache.on()) cache.tick();
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  }
  return at::detail::empty_generic(sizes, &cache, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt);
}

Tensor cached_empty(at::IntArrayRef sizes, const Tensor& like) { return cached_empty(sizes, like.scalar_type()); }

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
