// The fused step's float kernels on the AVX512 paths (16-float vectors, FMAs): RMSNorm,
// SiLU * up, residual adds and attention over a float32 KV cache (step_kernels.h). The
// bfloat16-cache attention is in attention/x86_avx512_bf16.cpp and amx/attention.cpp.
#include "common/head_dim.h"
#include "common/simd_avx512.h"
#include "step/step_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace quasar {
namespace step {

#ifdef QUASAR_SIMD512
namespace {

using namespace quasar::avx512;

// out[r] = w[r] * (x[r] * (1 / sqrt(mean(x^2) + eps))) for each of `rows` rows of length n.
QUASAR_AVX512 void rms_norm(const float* x, int64_t rows, int64_t n, const float* w, float eps,
                            float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    const float inv = 1.0f / std::sqrt(dot(xr, xr, n) / static_cast<float>(n) + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t d = 0; d < n; d += 16) {
      const __mmask16 m = tail_mask(n - d);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + d), vinv);
      _mm512_mask_storeu_ps(o + d, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + d), v));
    }
  }
}

// Attention of several query vectors that share one kv head (the heads of a GQA group and
// the rows of a step): out_i = softmax(q_i . K[0..n_i) * scale) V over query i's logical keys
// (see KeyMap; Paths = false: every query's keys are rows 0..n_i), K and V [S, 16C] rows.
// Keys are visited 16 at a time and each chunk of K (then V) is used by every query while
// it sits in L1, so a kv head's cache is streamed once per call instead of once per query.
// Each query's arithmetic (its scores, exp-sum and the two accumulation chains of its
// output) is the same whatever the other queries are: grouping never changes a bit.
// Scratch: `scores` nq * stride floats (stride >= max n), `acc` nq * 32C floats.
// attend_group's phases (forced inline: one function as before).
// Scores = q . k * scale, 16 keys at a time; vmax: each query's running lane max.
template <int C, bool Paths>
QUASAR_AVX512_INLINE void f32_scores(const float* const* qs, const int64_t* ns, const KeyMap& keys, int64_t nq,
                                     int64_t n_max, const float* k, float scale, float* scores, int64_t stride,
                                     float* vmax) {
  constexpr int64_t d = 16 * C;
  for (int64_t j0 = 0; j0 < n_max; j0 += 16) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t cnt = std::min<int64_t>(16, ns[i] - j0);
      if (cnt <= 0) continue;
      __m512 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qs[i] + 16 * c);
      __m512 a[16];
#pragma GCC unroll 16
      for (int jj = 0; jj < 16; ++jj) {
        a[jj] = _mm512_setzero_ps();
        if (jj < cnt) {
          const float* kr = k + key_row<Paths>(keys, i, j0 + jj) * d;
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) a[jj] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), a[jj]);
        }
      }
      const __mmask16 m = tail_mask(cnt);
      const __m512 sc = _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + i * stride + j0, m, sc);
      _mm512_store_ps(vmax + 16 * i, _mm512_mask_max_ps(_mm512_load_ps(vmax + 16 * i), m,
                                                        _mm512_load_ps(vmax + 16 * i), sc));
    }
  }
}

// Softmax numerators in place; 1 / their sum per query into inv.
QUASAR_AVX512_INLINE void f32_softmax(const int64_t* ns, int64_t nq, float* scores, int64_t stride,
                                      const float* vmax, float* inv) {
  for (int64_t i = 0; i < nq; ++i) {
    float* s = scores + i * stride;
    const __m512 vmx = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_load_ps(vmax + 16 * i)));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < ns[i]; j += 16) {
      const __mmask16 m = tail_mask(ns[i] - j);
      const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx)));
      _mm512_mask_storeu_ps(s + j, m, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    inv[i] = 1.0f / _mm512_reduce_add_ps(vsum);
  }
}

// out = sum_j e_j v_j: even keys into one accumulator, odd keys into another (two
// independent FMA chains), kept in `acc` between 16-key chunks of V.
template <int C, bool Paths>
QUASAR_AVX512_INLINE void f32_values(const int64_t* ns, const KeyMap& keys, int64_t nq, int64_t n_max,
                                     const float* v, const float* scores, int64_t stride, float* acc) {
  constexpr int64_t d = 16 * C;
  std::fill_n(acc, nq * 2 * d, 0.0f);
  for (int64_t j0 = 0; j0 < n_max; j0 += 16) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t j1 = std::min(j0 + 16, ns[i]);
      if (j1 <= j0) continue;
      const float* s = scores + i * stride;
      float* ai = acc + i * 2 * d;
      __m512 a0[C], a1[C];
      for (int c = 0; c < C; ++c) {
        a0[c] = _mm512_loadu_ps(ai + 16 * c);
        a1[c] = _mm512_loadu_ps(ai + d + 16 * c);
      }
      int64_t j = j0;
      for (; j + 2 <= j1; j += 2) {
        const __m512 w0 = _mm512_set1_ps(s[j]), w1 = _mm512_set1_ps(s[j + 1]);
        const float* v0 = v + key_row<Paths>(keys, i, j) * d;
        const float* v1 = v + key_row<Paths>(keys, i, j + 1) * d;
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          a0[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * c), a0[c]);
          a1[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * c), a1[c]);
        }
      }
      if (j < j1) {  // an odd last key (chunks start even, so only at the query's end)
        const __m512 w0 = _mm512_set1_ps(s[j]);
        const float* v0 = v + key_row<Paths>(keys, i, j) * d;
        for (int c = 0; c < C; ++c) a0[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * c), a0[c]);
      }
      for (int c = 0; c < C; ++c) {
        _mm512_storeu_ps(ai + 16 * c, a0[c]);
        _mm512_storeu_ps(ai + d + 16 * c, a1[c]);
      }
    }
  }
}

template <int C, bool Paths>
QUASAR_AVX512 void attend_group(const float* const* qs, const int64_t* ns, const KeyMap& keys,
                                float* const* outs, int64_t nq, const float* k, const float* v, float scale,
                                float* scores, int64_t stride, float* acc) {
  constexpr int64_t d = 16 * C;
  int64_t n_max = 0;
  for (int64_t i = 0; i < nq; ++i) n_max = std::max(n_max, ns[i]);
  alignas(64) float vmax[kMaxGroupQueries * 16];
  for (int64_t i = 0; i < nq; ++i)
    _mm512_store_ps(vmax + 16 * i, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
  f32_scores<C, Paths>(qs, ns, keys, nq, n_max, k, scale, scores, stride, vmax);
  alignas(64) float inv[kMaxGroupQueries];
  f32_softmax(ns, nq, scores, stride, vmax, inv);
  f32_values<C, Paths>(ns, keys, nq, n_max, v, scores, stride, acc);
  for (int64_t i = 0; i < nq; ++i) {
    const float* ai = acc + i * 2 * d;
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(outs[i] + 16 * c, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(ai + 16 * c),
                                                                     _mm512_loadu_ps(ai + d + 16 * c)),
                                                       _mm512_set1_ps(inv[i])));
  }
}

template <bool Paths>
struct F32Attention {
  template <int D>
  struct Kernel {
    static AttendF32Fn get() { return attend_group<D / 16, Paths>; }
  };
};

// act[r, c] = silu(gu[r, c]) * gu[r, inter + c] for c in [c0, c1): gate and up side by side in gu.
QUASAR_AVX512 void silu_mul(const float* gu, int64_t rows, int64_t inter, int64_t c0, int64_t c1, float* act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* o = act + r * inter;
    for (int64_t c = c0; c < c1; c += 16) {
      const __mmask16 m = tail_mask(c1 - c);
      const __m512 gv = _mm512_maskz_loadu_ps(m, g + c);
      const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_mask_storeu_ps(o + c, m, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(m, u + c)));
    }
  }
}

QUASAR_AVX512 void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

AttendF32Fn attend_f32(int64_t d, bool paths) {
  return paths ? for_head_dim<F32Attention<true>::Kernel>(d) : for_head_dim<F32Attention<false>::Kernel>(d);
}

}  // namespace

const FloatKernels& float_kernels_avx512() {
  static const FloatKernels kernels = {rms_norm, silu_mul, add_into, attend_f32, nullptr, nullptr};
  return kernels;
}

#else  // not x86: the AVX512 paths never run here

const FloatKernels& float_kernels_avx512() { return float_kernels_portable(); }

#endif

}  // namespace step
}  // namespace quasar
