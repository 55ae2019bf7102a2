// The run-time choice among a family of kernels compiled per instruction set (qgemm.cpp's int8,
// bgemm.cpp's bfloat16, fgemm.cpp's float32): the CPU's choice ("auto": the first automatic entry that runs here), or
// the one an environment variable names (read once, at the first use), or set_kernels' choice.
// A bad name in the variable is an error that every use raises until a choice is set.
#pragma once

#include <c10/util/Exception.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace rnnkit {

// Kernels: a struct with `const char* name`, `bool (*runs_here)()` and `bool automatic`; the
// table lists every entry compiled, the last automatic one running everywhere it is compiled.
template <typename Kernels, size_t N>
class KernelChoice {
 public:
  KernelChoice(const Kernels (&table)[N], const char* env, const char* what) : table_(table), what_(what) {
    const char* value = std::getenv(env);
    try {
      current_ = value && *value ? find(value, env) : automatic();
    } catch (const c10::Error& e) {
      error_ = e.what_without_backtrace();
    }
  }

  const Kernels& current() const {
    const Kernels* k = current_.load();
    TORCH_CHECK_VALUE(k != nullptr, error_);
    return *k;
  }

  // The names of the entries that run here.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const Kernels& k : table_)
      if (k.runs_here()) out.emplace_back(k.name);
    return out;
  }

  // Use `name` ("auto": the CPU's choice) from now on; the previous name ("auto" where a bad
  // environment value left none). A ValueError for a name that does not run here.
  std::string set(const std::string& name, const char* who) {
    const Kernels* previous = current_.exchange(find(name, who));
    return previous != nullptr ? previous->name : "auto";
  }

 private:
  const Kernels* automatic() const {
    for (const Kernels& k : table_)
      if (k.automatic && k.runs_here()) return &k;
    return &table_[0];  // not reached: the last automatic entry runs everywhere it is compiled
  }

  std::string runnable() const {
    std::string out;
    for (const std::string& name : names()) out += (out.empty() ? "" : ", ") + name;
    return out;
  }

  const Kernels* find(const std::string& name, const char* who) const {
    if (name == "auto") return automatic();
    for (const Kernels& k : table_) {
      if (name != k.name) continue;
      TORCH_CHECK_VALUE(k.runs_here(), who, ": ", what_, " kernel '", name,
                        "' needs instructions this CPU does not have; it runs 'auto', ", runnable());
      return &k;
    }
    TORCH_CHECK_VALUE(false, who, ": expected 'auto' or one of ", runnable(), " (this build and CPU); got '", name,
                      "'");
    return nullptr;
  }

  const Kernels (&table_)[N];
  const char* what_;
  std::atomic<const Kernels*> current_{nullptr};
  std::string error_;
};

// A table entry's runs_here for kernels every CPU the build targets runs.
inline bool runs_everywhere() { return true; }

#if defined(__x86_64__) && defined(__GNUC__)
// Whether this process may run AMX instructions of the feature at CPUID 7.0 EDX bit `feature` (22:
// AMX-BF16, 25: AMX-INT8): the CPU has it and AMX-TILE (bit 24), the OS enables the tiles' state
// (XSAVE on, XCR0 bits 17 and 18), and Linux grants this process the tiles' data (asked once:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), refused by kernels before 5.16).
inline bool amx_usable(unsigned feature) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv may run
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> feature) & 1) || !((d >> 24) & 1)) return false;
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3) != 3) return false;
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// The 64 bytes _tile_loadconfig reads (palette 1): each tile's rows and bytes a row; unused tiles 0 × 0.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The AMX kernels' least work a thread takes (multiply-adds; at::parallel_for's grain): 16 times the
// vector kernels' 1 << 16, as tdpbf16ps / tdpbssd do about that many times vdpbf16ps's / vpdpbusd's
// work a µs. With the vector kernels' grain, a product of 1M multiply-adds (16 × 128 × 512, a small
// LSTM's R·h) went to two threads as two pieces of ~2 µs and ran at 0.62× one thread's speed
// (bfloat16; int8 0.78×): the second thread's wake and join cost more than its half. Now products of
// up to 2M multiply-adds stay on one thread (there 2 threads read 1.07× / 1.14× one thread's speed),
// and larger ones split into pieces of at least 1M (Emerald Rapids, rounds interleaved; a bfloat16
// LSTM's training at small, 2 threads: 2-5% quicker in three runs; int8 inference there ±4%, noise).
constexpr int64_t kAmxGrain = int64_t(1) << 20;
#endif

// The one choice of a family (a kernels struct type), made at its first use: `env` names the
// environment variable, `what` the family in messages.
template <typename Kernels, size_t N>
KernelChoice<Kernels, N>& kernel_choice(const Kernels (&table)[N], const char* env, const char* what) {
  static KernelChoice<Kernels, N> choice(table, env, what);
  return choice;
}

// A loop over a block's constant count of rows or panels, unrolled whole: the GEMM kernels' accumulators
// stay in registers only when every index into them is a constant.
#define RNNKIT_UNROLL _Pragma("GCC unroll 16")

// C[rows, N] = beta · C (beta 0: zeros, C not read): a GEMM family's product over an empty sum (K = 0).
inline void empty_sum(int64_t rows, int64_t N, float beta, float* C, int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < N; ++n) C[r * ldc + n] = beta == 0 ? 0.0f : beta * C[r * ldc + n];
}

// Rows [first, first + count) of the i-th of `blocks` row blocks that split `rows` as evenly as
// possible (32 rows in blocks of at most 6: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2): the GEMM families'
// blocks of X's rows.
inline void row_block(int64_t rows, int64_t blocks, int64_t i, int64_t& first, int64_t& count) {
  const int64_t base = rows / blocks, extra = rows % blocks;
  first = i * base + std::min(i, extra);
  count = base + (i < extra ? 1 : 0);
}

}  // namespace rnnkit
