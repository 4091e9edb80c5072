// The fused step's float kernels with AVX2 (8-float ymm vectors); the code is
// vec8.inc's, the same as the portable set's, so the two give bitwise the same results.
#include "common/head_dim.h"
#include "step/step_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>

// Everything below is compiled for AVX2 (the library itself has no -march flag); it runs
// only on the avx2 and avx-vnni paths (cpu_features.h), which need a CPU with AVX2.
#pragma GCC push_options
#pragma GCC target("avx2")

namespace quasar {
namespace step {
namespace avx2 {

#define QUASAR_V inline __attribute__((always_inline))

struct V {
  __m256 v;
  static QUASAR_V V zero() { return {_mm256_setzero_ps()}; }
  static QUASAR_V V set1(float f) { return {_mm256_set1_ps(f)}; }
  static QUASAR_V V load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static QUASAR_V void store(float* p, V a) { _mm256_storeu_ps(p, a.v); }
  static QUASAR_V V load_b16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static QUASAR_V __m256i first_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static QUASAR_V V load_first(const float* p, int64_t n, float fill) {
    const __m256i m = first_mask(n);
    return {_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m))};
  }
  static QUASAR_V void store_first(float* p, int64_t n, V a) { _mm256_maskstore_ps(p, first_mask(n), a.v); }
  static QUASAR_V V keep_first(V a, int64_t n) { return {_mm256_and_ps(a.v, _mm256_castsi256_ps(first_mask(n)))}; }
  static QUASAR_V V round_even(V a) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2**23: no fraction bits left
    return {_mm256_sub_ps(_mm256_add_ps(a.v, magic), magic)};
  }
  static QUASAR_V V pow2(V n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
  }
  static QUASAR_V float reduce_add(V a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
  static QUASAR_V float reduce_max(V a) {
    const __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_max_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};
QUASAR_V V add(V a, V b) { return {_mm256_add_ps(a.v, b.v)}; }
QUASAR_V V sub(V a, V b) { return {_mm256_sub_ps(a.v, b.v)}; }
QUASAR_V V mul(V a, V b) { return {_mm256_mul_ps(a.v, b.v)}; }
QUASAR_V V div(V a, V b) { return {_mm256_div_ps(a.v, b.v)}; }
QUASAR_V V max(V a, V b) { return {_mm256_max_ps(a.v, b.v)}; }
QUASAR_V V min(V a, V b) { return {_mm256_min_ps(a.v, b.v)}; }
#undef QUASAR_V

#include "step/vec8.inc"

}  // namespace avx2

const FloatKernels& float_kernels_avx2() { return avx2::kKernels; }

}  // namespace step
}  // namespace quasar

#pragma GCC pop_options

#else  // not x86: the avx2 path never runs here

namespace quasar {
namespace step {
const FloatKernels& float_kernels_avx2() { return float_kernels_portable(); }
}  // namespace step
}  // namespace quasar

#endif
