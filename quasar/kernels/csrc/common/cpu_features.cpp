// CPU feature detection and the kernel-path switch (see cpu_features.h).
#include "common/cpu_features.h"

#include <atomic>
#include <cstring>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace quasar {
namespace {

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
// libgcc's checks include the OS saving the AVX / AVX512 register state (XCR0).
// F16C (vcvtph2ps, the W4A8 kernels' half-precision scales) came with every AVX2 CPU; asked anyway.
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx_vnni() {
#if __GNUC__ >= 11 || defined(__clang__)
  return has_avx2() && __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}
bool has_avx512_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}
bool has_amx() {
#if defined(__linux__) && defined(__x86_64__) && (__GNUC__ >= 11 || defined(__clang__))
  if (!has_avx512_vnni() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
  // Linux (>= 5.16) hands a process the tile data state only when asked, once per process.
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#else
bool has_avx2() { return false; }
bool has_avx_vnni() { return false; }
bool has_avx512_vnni() { return false; }
bool has_amx() { return false; }
#endif

struct Supported {
  bool by_path[kNumKernelPaths];
};

const Supported& supported() {
  static const Supported s = {{true, has_avx2(), has_avx_vnni(), has_avx512_vnni(), has_amx()}};
  return s;
}

KernelPath highest_at_or_below(KernelPath cap) {
  for (int p = static_cast<int>(cap); p > 0; --p)
    if (supported().by_path[p]) return static_cast<KernelPath>(p);
  return KernelPath::kPortable;
}

std::atomic<int> g_path{-1};  // -1: not asked yet (then the highest the CPU runs)

}  // namespace

const char* kernel_path_name(KernelPath p) {
  switch (p) {
    case KernelPath::kPortable: return "portable";
    case KernelPath::kAvx2: return "avx2";
    case KernelPath::kAvxVnni: return "avx-vnni";
    case KernelPath::kAvx512Vnni: return "avx512-vnni";
    case KernelPath::kAmx: return "amx";
  }
  return "portable";
}

bool parse_kernel_path(const char* name, KernelPath* out) {
  for (int p = 0; p < kNumKernelPaths; ++p)
    if (std::strcmp(name, kernel_path_name(static_cast<KernelPath>(p))) == 0) {
      *out = static_cast<KernelPath>(p);
      return true;
    }
  return false;
}

bool resolve_kernel_path(const char* name, KernelPath* out) {
  if (name[0] == '\0') {
    *out = kernel_path();
    return true;
  }
  return parse_kernel_path(name, out) && cpu_runs(*out);
}

bool cpu_runs(KernelPath p) { return supported().by_path[static_cast<int>(p)]; }

KernelPath kernel_path() {
  int p = g_path.load(std::memory_order_relaxed);
  if (p < 0) {
    p = static_cast<int>(highest_at_or_below(KernelPath::kAmx));
    g_path.store(p, std::memory_order_relaxed);
  }
  return static_cast<KernelPath>(p);
}

KernelPath set_kernel_path(KernelPath cap) {
  const KernelPath p = highest_at_or_below(cap);
  g_path.store(static_cast<int>(p), std::memory_order_relaxed);
  return p;
}

}  // namespace quasar
