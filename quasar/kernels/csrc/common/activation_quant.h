// Dynamic activation quantization's scalar pieces, shared by the int8 ops (gemm_w8a8/)
// and the W4A8 ones (gemm_w4a8/): the same amax, scale and rounding as
// quasar/runtime/w8a8_numerics.py's quantize_activation, bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace quasar {

inline uint32_t float_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline float bits_float(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// The elementwise loops of the ops (quantization, epilogue) are forced inline, so wrappers
// with an AVX512 target attribute (on CPUs that run the small-M kernel) compile them with
// wide vectors while the generic callers keep the baseline ISA. Elementwise IEEE operations
// give the same bits at any vector width.
#ifndef QUASAR_INLINE
#define QUASAR_INLINE inline __attribute__((always_inline))
#endif

// max |r[k]|: the bit patterns of non-negative floats order like the values, and NaN's
// sort above +inf, so an integer max (which vectorizes) is exact and propagates NaN.
QUASAR_INLINE float row_absmax(const float* r, int64_t k_len) {
  uint32_t m = 0;
  for (int64_t k = 0; k < k_len; ++k) {
    uint32_t b = float_bits(r[k]) & 0x7fffffffu;
    m = b > m ? b : m;
  }
  return bits_float(m);
}

// Round half to even for |v| < 2**22 in the default rounding mode (|x / s_x| <= 127 here):
// adding 1.5 * 2**23 leaves no fraction bits. Same result as std::nearbyint / torch.round,
// but it vectorizes on any SSE2 / NEON target.
QUASAR_INLINE int32_t round_to_int(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23
  float r = (v + kMagic) - kMagic;
  return r == r ? static_cast<int32_t>(r) : 0;  // NaN (inf / inf, NaN input) -> 0
}

// A row's activation scale from its amax (amax_scale) or its values (row_scale), as
// quantize_activation computes it for |q| <= limit (127, or 16383 for 15 bits):
// amax.clamp_min_(limit * 1e-12).div_(limit), the double scalars cast to float; NaN propagates.
QUASAR_INLINE float amax_scale(float amax, double limit) {
  const float min_amax = static_cast<float>(limit * 1e-12);
  return (amax == amax ? (amax < min_amax ? min_amax : amax) : amax) / static_cast<float>(limit);
}
QUASAR_INLINE float row_scale(const float* r, int64_t k_len, double limit) {
  return amax_scale(row_absmax(r, k_len), limit);
}

}  // namespace quasar
