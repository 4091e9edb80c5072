// The head dims the attention kernels are compiled for, and the one place where a run-time
// head_dim meets the templates: every kernel family (float32 AVX512, bfloat16, AMX tiles, the
// 8-float vectors of step/vec8.inc) picks its instantiation through for_head_dim.
// fused_step._HEAD_DIMS lists the same dims.
#pragma once

#include <cstdint>

namespace quasar {
namespace step {

// Kernel<D>::get() is a family's kernel for head_dim D (null where the family has none);
// for_head_dim returns it for d, or a null / empty value for a head_dim not listed here.
template <template <int> class Kernel>
auto for_head_dim(int64_t d) -> decltype(Kernel<64>::get()) {
  switch (d) {
    case 16: return Kernel<16>::get();
    case 32: return Kernel<32>::get();
    case 48: return Kernel<48>::get();
    case 64: return Kernel<64>::get();
    case 80: return Kernel<80>::get();
    case 96: return Kernel<96>::get();
    case 128: return Kernel<128>::get();
    case 256: return Kernel<256>::get();
    default: return {};
  }
}

}  // namespace step
}  // namespace quasar
