// What the x86 W4A8 kernels share (x86_avx2.cpp, x86_avx512.cpp): prefetches, unaligned
// loads, and the table index of a form.
#pragma once

#include "gemm_w4a8/w4a8_gemm.h"

#include <cstring>

#include <immintrin.h>

namespace quasar {
namespace w4x86 {

inline int32_t load_u32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// The lines of `bytes` bytes at p, each asked for `ahead` bytes ahead (a superblock's header
// with its first group; a Q6_K group's lines).
inline void prefetch_lines(const uint8_t* p, int64_t bytes, int64_t ahead) {
  for (int64_t l = 0; l < bytes; l += 64) prefetch(p + l + ahead);
}

// A kernel for one form (STEPS = group / 8 a template argument) and row count, in tables
// indexed by form_index: groups of 32, 64, 128 with float16 parameters, then the Q4_K form,
// then the Q6_K form.
using StepsFn = void (*)(const uint8_t*, int64_t, const W4Acts&, float*, int64_t);
constexpr int kFormCount = 5;
inline int form_index(int64_t form) {
  return form == 32 ? 0 : form == 64 ? 1 : form == 128 ? 2 : form == kW4Q4K ? 3 : 4;
}

}  // namespace w4x86
}  // namespace quasar
