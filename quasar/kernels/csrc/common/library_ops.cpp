// The library-wide ops: the kernel path (cpu_features.h) and the threads of its parallel loops.
#include "common/cpu_features.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <string>

// The active kernel path's name (cpu_features.h); with a name, first cap the path there
// (the highest path at or below it that this CPU runs). Names: portable, avx2, avx-vnni,
// avx512-vnni, amx.
std::string kernel_path_op(const std::string& cap) {
  if (!cap.empty()) {
    quasar::KernelPath p;
    TORCH_CHECK(quasar::parse_kernel_path(cap.c_str(), &p), "unknown kernel path '", cap, "'");
    quasar::set_kernel_path(p);
  }
  return quasar::kernel_path_name(quasar::kernel_path());
}

// Whether this CPU can run kernel path `name`.
bool cpu_runs_path(const std::string& name) {
  quasar::KernelPath p;
  TORCH_CHECK(quasar::parse_kernel_path(name.c_str(), &p), "unknown kernel path '", name, "'");
  return quasar::cpu_runs(p);
}

// How many distinct threads one at::parallel_for of this library runs on. at::parallel_for
// is a header template: its OpenMP pragma is compiled here, so a build without -fopenmp
// silently runs every "parallel" loop of these ops on one thread; tests check this.
int64_t parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 4096, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() & 63));
  });
  return __builtin_popcountll(seen.load());
}