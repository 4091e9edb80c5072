// AVX512 building blocks shared by the fused step's AVX512 float kernels (step/x86_avx512.cpp)
// and its attention over a bfloat16 cache (attention/x86_avx512_bf16.cpp, amx/attention.cpp). Each
// function carries its own target attribute (the library is built without -march flags);
// they run only on the AVX512 kernel paths (cpu_features.h).
#pragma once

#include <cstdint>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define QUASAR_SIMD512 1
#include <immintrin.h>
#define QUASAR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define QUASAR_BF16 __attribute__((target("avx512f,avx512bw,avx512vnni,avx512bf16")))
// The same, forced inline: the phases of one kernel, written as functions of their own.
#define QUASAR_AVX512_INLINE QUASAR_AVX512 __attribute__((always_inline)) inline
#define QUASAR_BF16_INLINE QUASAR_BF16 __attribute__((always_inline)) inline

namespace quasar {
namespace avx512 {

QUASAR_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x) for x <= 88: 2^n * p(r), n = round(x / ln 2), |r| <= ln 2 / 2, p the degree-7
// Taylor-like polynomial of Cephes' expf (relative error ~1e-7); inputs below -87 give ~0.
QUASAR_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 2^x for x <= 0 with ~3e-6 relative error: 2^n * p(f), n = round(x), |f| <= 1/2, p the
// degree-5 Taylor polynomial of 2^f; very negative x gives 0. For softmax numerators that
// are rounded to bfloat16 (relative step 2^-8) anyway: 9 instructions against exp512's 16.
QUASAR_AVX512 inline __m512 exp2_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);  // (ln 2)^k / k!, k = 5 .. 0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

QUASAR_AVX512 inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 m = tail_mask(n - d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// The 16 lane sums of a[0..15] as one vector, in key order: a tree of shuffles and adds
// (each level halves the vectors) instead of 16 horizontal reductions.
QUASAR_AVX512 inline __m512 sum16(const __m512* a) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // [a(2i) 8 partials | a(2i+1) 8 partials]
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit lane l: 4 partials of key 4i + l
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // lane l: 2 partials of key 8i + l, then of key 8i + 4 + l
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // element 4l + m holds key 4m + l; put key k at element k.
  const __m512 out = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), out);
}

// out[c] = dword c of rows r[0..15] (a 16 x 16 transpose of 32-bit elements).
QUASAR_BF16 inline void transpose16x16(const __m512i* r, __m512i* out) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // lane L of a[2i]: (r2i, r2i+1) dwords 4L, 4L+1; a[2i+1]: 4L+2, 4L+3
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // lane L of b[4g + e]: dword 4L + e of rows 4g..4g+3
    b[4 * g + 0] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
    b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
    b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
    b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // gather lane L of b[e], b[4 + e], b[8 + e], b[12 + e]
    const __m512i p_lo = _mm512_shuffle_i32x4(b[e], b[4 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i p_hi = _mm512_shuffle_i32x4(b[e], b[4 + e], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i q_lo = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i q_hi = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], _MM_SHUFFLE(3, 2, 3, 2));
    out[e] = _mm512_shuffle_i32x4(p_lo, q_lo, _MM_SHUFFLE(2, 0, 2, 0));
    out[4 + e] = _mm512_shuffle_i32x4(p_lo, q_lo, _MM_SHUFFLE(3, 1, 3, 1));
    out[8 + e] = _mm512_shuffle_i32x4(p_hi, q_hi, _MM_SHUFFLE(2, 0, 2, 0));
    out[12 + e] = _mm512_shuffle_i32x4(p_hi, q_hi, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

QUASAR_BF16 inline __m512i load_row(const uint16_t* row, int b) {
  return row ? _mm512_loadu_si512(row + 32 * b) : _mm512_setzero_si512();
}

// kt[16b + c] = bf16 pair (32b + 2c, 32b + 2c + 1) of key rows[0..15] (nullptr: zeros).
template <int C>
QUASAR_BF16 inline void load_kt(const uint16_t* const* rows, __m512i* kt) {
  for (int b = 0; b < C / 2; ++b) {
    __m512i r[16];
    for (int jj = 0; jj < 16; ++jj) r[jj] = load_row(rows[jj], b);
    transpose16x16(r, kt + 16 * b);
  }
}

// vt[jp * C + 2b + h]: keys 2jp and 2jp + 1 interleaved as bf16 pairs over dims 32b..32b+31
// (h = 0: dims 8g + e, h = 1: dims 8g + 4 + e in lane 4g + e).
template <int C>
QUASAR_BF16 inline void load_vt(const uint16_t* const* rows, __m512i* vt) {
  for (int jp = 0; jp < 8; ++jp)
    for (int b = 0; b < C / 2; ++b) {
      const __m512i x = load_row(rows[2 * jp], b), y = load_row(rows[2 * jp + 1], b);
      vt[jp * C + 2 * b] = _mm512_unpacklo_epi16(x, y);
      vt[jp * C + 2 * b + 1] = _mm512_unpackhi_epi16(x, y);
    }
}

// Output vector c of a head in load_vt's lane order (c = 2b + h: lane 4g + e is dim
// 32b + 8g + 4h + e), times w, into the head vector o in dim order.
inline void store_lanes(const float* lanes, int64_t c, float w, float* o) {
  const int64_t base = 32 * (c / 2) + 4 * (c % 2);
  for (int l = 0; l < 16; ++l) o[base + 8 * (l / 4) + l % 4] = lanes[l] * w;
}

QUASAR_BF16 inline __m512 dp_bf16(__m512 acc, __m512i a, uint32_t pair) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
}

// n floats (a multiple of 16) as bfloat16, round to nearest even.
QUASAR_BF16 inline void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

}  // namespace avx512
}  // namespace quasar

#endif
