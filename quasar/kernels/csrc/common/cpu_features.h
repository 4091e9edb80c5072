// Which kernel path this process runs: asked of the CPU once, capped by a switch.
//
// Every op of this library computes the same contract on every path (exact int32 sums of
// int8 products, one float order per path, every row alone); the path only decides how the
// sums are made and which vector width the float kernels use. Paths, lowest first:
//   portable     plain C++ (any CPU; where NEON sdot would slot in)
//   avx2         AVX2 + FMA: vpsignb / vpmaddubsw / vpmaddwd int8 products
//   avx-vnni     256-bit vpdpbusd (the VEX-encoded AVX-VNNI extension)
//   avx512-vnni  512-bit vpdpbusd, AVX512 float kernels, bf16 KV cache with AVX512-BF16
//   amx          AMX-INT8 tile multiplies for steps of 2+ rows (and AMX-BF16 attention)
// Every op takes the path it runs as an argument (resolve_kernel_path: a name, or "" for the
// process default) and hands it down to each kernel it calls; nothing below an op reads the
// default. The default is the highest path the CPU runs that is not above the cap
// (set_kernel_path; quasar/kernels/ext.py passes QUASAR_ISA there), so a test can force a
// lower path on a CPU that has a higher one, for a whole model or for one call.
#pragma once

#include <cstdint>

namespace quasar {

enum class KernelPath : int { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAmx = 4 };
constexpr int kNumKernelPaths = 5;

// "portable", "avx2", "avx-vnni", "avx512-vnni", "amx".
const char* kernel_path_name(KernelPath p);

// The path named `name` into *out; false for an unknown name.
bool parse_kernel_path(const char* name, KernelPath* out);

// The path an op runs: `name`, or the process default (kernel_path()) for "". False for an
// unknown name or a path this CPU does not run (the op then raises, naming it).
bool resolve_kernel_path(const char* name, KernelPath* out);

// Whether this CPU (and OS: AVX512 state, AMX tile permission) can run path p.
bool cpu_runs(KernelPath p);

// The path the ops use now.
KernelPath kernel_path();

// Caps the path at `cap` (the highest path the CPU runs at or below it); returns the new path.
KernelPath set_kernel_path(KernelPath cap);

// Whether `path` is `p` or a higher one.
inline bool path_at_least(KernelPath path, KernelPath p) { return static_cast<int>(path) >= static_cast<int>(p); }

}  // namespace quasar
