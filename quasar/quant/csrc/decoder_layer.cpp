// All decoder layers of a W8A8 model for a verifier-sized step, in one call
// (see quasar/quant/fused_step.py, which decides when it is used).
//
// Why: at 135M parameters a step of 1..9 tokens spends more time in ~50 small ATen ops per
// layer (norms, RoPE, a scaled-dot-product call per query, residuals, dispatch) than in
// its int8 GEMMs. This op runs the layer's glue as plain loops between the same small-M
// VNNI GEMMs Int8Linear uses (int8_gemm.h), so a step costs little more than the bytes of
// its weights.
//
// Layer (Llama family, T <= kMaxRows rows: chains or token trees in one or more cache
// slots, float32 activations):
//   h = rmsnorm(x) * w_in; q, k, v = W8A8(h) (one quantization, one parallel GEMM for
//   all rows); optional per-head q/k rmsnorm (Qwen3); RoPE; each row's k, v written to its
//   slot past the slot's committed length; attention of each row over its slot's committed
//   keys and then its path (for a chain: keys [0, start + i]); x += W8A8_o(attn);
//   h = rmsnorm(x) * w_post; x += W8A8_down(silu(W8A8_gate(h)) * W8A8_up(h)).
// The cache is float32, or bfloat16 on an AVX512-BF16 CPU (attend_group_bf16: bf16
// products, float32 softmax and sums; ARCHITECTURE.md, "The KV cache in bfloat16").
// A linear with act_bits 15 (by default the down projection) quantizes its input to 15
// bits and runs two int8 products over the same weight chunk (small_m_gemm_split).
// Every row is computed on its own, in a fixed order, whatever T is: a token's result is
// bitwise the same whether it is verified alone or with drafts (row invariance), which is
// what keeps greedy speculative output identical to greedy autoregressive output.
// Not bitwise equal to the PyTorch path (different summation orders, a polynomial exp),
// only close: tests compare logits within a tolerance.
//
// Needs AVX512 (VNNI for the GEMMs); the Python side only calls it when
// int8_small_m_supported() is true. The AVX512 functions carry a target attribute, so the
// library itself is built without -march flags.

#include "int8_gemm.h"
#include "step_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define QUASAR_LAYER_KERNEL 1
#include <immintrin.h>
#define QUASAR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define QUASAR_BF16 __attribute__((target("avx512f,avx512bw,avx512vnni,avx512bf16")))
#endif

namespace {

// Rows of a verifier step (a chain or a token tree: the pending token and its draft nodes);
// longer prefills use the PyTorch path. fused_step.MAX_ROWS is the same number.
constexpr int64_t kMaxRows = 128;
// Most query vectors one attention call takes (step_kernels.h). Each call streams (and for
// a bf16 cache transposes) its kv head's keys once: 32 made a 5.3k-token prefill 1.2x faster
// than 16; 64 was no better.
using quasar::step::kMaxGroupQueries;
using quasar::step::KeyMap;
using quasar::step::key_row;
// Keys per attention block of a bfloat16-cache step: a long context's keys are split into
// blocks at fixed key indices, each block one work item for every query of its kv head,
// and the blocks' partial results are joined per query (combine_blocks). Why: splitting a
// kv head's queries between threads made each thread stream and transpose all its keys (at
// 5.3k keys a one-token step spent 15 ms in attention on 2 threads, 17 ms on one).
// Contexts up to one block are computed exactly as before.
constexpr int64_t kBlockKeys = 512;

#ifdef QUASAR_LAYER_KERNEL

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

// Rotary embedding of one head vector in place (rotate_half convention: the first and
// second halves are the pairs).
inline void rope(float* v, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = v[j], b = v[j + half];
    v[j] = a * cos[j] - b * sin[j];
    v[j + half] = b * cos[j + half] + a * sin[j + half];
  }
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

// Attention of several query vectors that share one kv head (the heads of a GQA group and
// the rows of a step): out_i = softmax(q_i . K[0..n_i) * scale) V over query i's logical keys
// (see KeyMap; Paths = false: every query's keys are rows 0..n_i), K and V [S, 16C] rows.
// Keys are visited 16 at a time and each chunk of K (then V) is used by every query while
// it sits in L1, so a kv head's cache is streamed once per call instead of once per query.
// Each query's arithmetic (its scores, exp-sum and the two accumulation chains of its
// output) is the same whatever the other queries are: grouping never changes a bit.
// Scratch: `scores` nq * stride floats (stride >= max n), `acc` nq * 32C floats.
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
  // scores = q . k * scale, 16 keys at a time
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
  // softmax numerators in place; 1 / their sum per query
  alignas(64) float inv[kMaxGroupQueries];
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
  // out = sum_j e_j v_j: even keys into one accumulator, odd keys into another (two
  // independent FMA chains), kept in `acc` between 16-key chunks of V.
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
  for (int64_t i = 0; i < nq; ++i) {
    const float* ai = acc + i * 2 * d;
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(outs[i] + 16 * c, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(ai + 16 * c),
                                                                     _mm512_loadu_ps(ai + d + 16 * c)),
                                                       _mm512_set1_ps(inv[i])));
  }
}

using AttendFn = quasar::step::AttendF32Fn;

template <bool Paths>
AttendFn attend_for(int64_t d) {
  switch (d) {
    case 16: return attend_group<1, Paths>;
    case 32: return attend_group<2, Paths>;
    case 48: return attend_group<3, Paths>;
    case 64: return attend_group<4, Paths>;
    case 80: return attend_group<5, Paths>;
    case 96: return attend_group<6, Paths>;
    case 128: return attend_group<8, Paths>;
    case 256: return attend_group<16, Paths>;
    default: return nullptr;
  }
}

// ------------------------------------------------ attention over a bfloat16 KV cache
// The same computation as attend_group over keys and values stored as bfloat16, with the
// products in bfloat16 (vdpbf16ps: pairs of bf16 products added into float32 lanes, twice
// the multiply rate of float32 FMAs, half the bytes): q and the softmax numerators are
// rounded to bf16 (round to nearest even), sums and the softmax stay float32.
// - Scores: each 16-key chunk is transposed once per call into kt[p] = the bf16 pair p of
//   the 16 keys (one dword per key), so a query's 16 scores are 8C vdpbf16ps with its
//   pairs broadcast: no horizontal sums.
// - Output: each chunk's values are interleaved once per call into bf16 pairs of
//   consecutive keys (unpack lo/hi: the lanes hold a fixed permutation of the dims, undone
//   at the end), so a pair of keys is C vdpbf16ps with (p_j, p_j+1) broadcast.
// A query's arithmetic depends only on its own q, keys and values (a chunk's pairs, the
// pair split into even/odd accumulators and the chunk count are fixed by absolute key
// index), so grouping never changes a bit, as for attend_group. Key rows a query does not
// have are read as zeros or multiplied by a zero numerator.

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

// attend_group over a bf16 cache (k, v [S, 16C] bf16 rows). Scratch: `scores` nq * stride
// floats and `probs` nq * stride bf16 (stride a multiple of 16, >= max n), `acc` nq * 32C.
// Over a block of keys [lo, hi) (multiples of 16; query i's keys in it: [lo, min(n_i, hi))),
// a query whose keys all lie in the block gets its output in outs[i]; one with keys in
// several blocks (parts[i] not null) gets its block's partial result in parts[i]: the
// unnormalised output (16C floats), the block's score max and its exp-sum, which
// combine_blocks joins. A query with no keys in the block is skipped.
template <int C, bool Paths>
QUASAR_BF16 void attend_group_bf16(const float* const* qs, const int64_t* ns, const KeyMap& keys,
                                   float* const* outs, float* const* parts, int64_t nq, int64_t lo, int64_t hi,
                                   const uint16_t* k, const uint16_t* v, float scale, float* scores,
                                   uint16_t* probs, int64_t stride, float* acc) {
  static_assert(C % 2 == 0, "bf16 attention needs head_dim % 32 == 0");
  constexpr int64_t d = 16 * C, np = 8 * C;  // floats, bf16 pairs of a head vector
  // this block's end for each query, and the end of the block's keys over all of them
  int64_t ends[kMaxGroupQueries];
  int64_t n_max = lo, shared_until = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < nq; ++i) {
    ends[i] = std::min(ns[i], hi);
    n_max = std::max(n_max, ends[i]);
    if constexpr (Paths) shared_until = std::min(shared_until, keys.splits[i]);
  }
  ns = ends;
  alignas(64) uint16_t qb[kMaxGroupQueries * d];
  for (int64_t i = 0; i < nq; ++i) to_bf16(qs[i], d, qb + i * d);
  alignas(64) float vmax[kMaxGroupQueries * 16];
  for (int64_t i = 0; i < nq; ++i)
    _mm512_store_ps(vmax + 16 * i, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
  const uint16_t* rows[16];
  // rows[jj] = query i's key row j0 + jj (base: k or v), zeros from `cnt` on
  const auto query_rows = [&](const uint16_t* base, int64_t i, int64_t j0, int64_t cnt) {
    for (int64_t jj = 0; jj < 16; ++jj) rows[jj] = jj < cnt ? base + key_row<Paths>(keys, i, j0 + jj) * d : nullptr;
  };
  // A chunk is shared when every query's keys there are rows j0.. of the cache; then
  // rows[jj] = row j0 + jj for every row the step has (zeros past n_max).
  const auto shared = [&](int64_t j0) { return !Paths || j0 + 16 <= shared_until; };
  const auto shared_rows = [&](const uint16_t* base, int64_t j0) {
    for (int64_t jj = 0; jj < 16; ++jj) rows[jj] = j0 + jj < n_max ? base + (j0 + jj) * d : nullptr;
  };
  alignas(64) __m512i kt[np];
  for (int64_t j0 = lo; j0 < n_max; j0 += 16) {
    const bool one = shared(j0);
    if (one) {
      shared_rows(k, j0);
      load_kt<C>(rows, kt);
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t cnt = std::min<int64_t>(16, ns[i] - j0);
      if (cnt <= 0) continue;
      if (!one) {
        query_rows(k, i, j0, cnt);
        load_kt<C>(rows, kt);
      }
      const uint32_t* qp = reinterpret_cast<const uint32_t*>(qb + i * d);
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t p = 0; p < np; p += 4) {
        a0 = dp_bf16(a0, kt[p], qp[p]);
        a1 = dp_bf16(a1, kt[p + 1], qp[p + 1]);
        a2 = dp_bf16(a2, kt[p + 2], qp[p + 2]);
        a3 = dp_bf16(a3, kt[p + 3], qp[p + 3]);
      }
      const __mmask16 m = tail_mask(cnt);
      const __m512 sc = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                      _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + i * stride + (j0 - lo), m, sc);  // from the block's first key
      _mm512_store_ps(vmax + 16 * i, _mm512_mask_max_ps(_mm512_load_ps(vmax + 16 * i), m,
                                                        _mm512_load_ps(vmax + 16 * i), sc));
    }
  }
  // softmax numerators (float32 for the sum, bf16 for the products; zeros past n to the
  // end of the last chunk), 1 / their sum per query
  alignas(64) float inv[kMaxGroupQueries], mx[kMaxGroupQueries], sum[kMaxGroupQueries];
  for (int64_t i = 0; i < nq; ++i) {
    if (ns[i] <= lo) continue;
    const float* s = scores + i * stride;
    uint16_t* pb = probs + i * stride;
    mx[i] = _mm512_reduce_max_ps(_mm512_load_ps(vmax + 16 * i));
    const __m512 vmx = _mm512_set1_ps(mx[i]);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < ns[i] - lo; j += 16) {
      const __mmask16 m = tail_mask(ns[i] - lo - j);
      const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), (__m256i)_mm512_cvtneps_pbh(e));
      vsum = _mm512_add_ps(vsum, e);
    }
    sum[i] = _mm512_reduce_add_ps(vsum);
    inv[i] = 1.0f / sum[i];
  }
  // out = sum_j p_j v_j, key pairs alternately into two accumulators (independent chains)
  std::fill_n(acc, nq * 2 * d, 0.0f);
  alignas(64) __m512i vt[8 * C];
  for (int64_t j0 = lo; j0 < n_max; j0 += 16) {
    const bool one = shared(j0);
    if (one) {
      shared_rows(v, j0);
      load_vt<C>(rows, vt);
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t cnt = std::min<int64_t>(16, ns[i] - j0);
      if (cnt <= 0) continue;
      if (!one) {
        query_rows(v, i, j0, cnt);
        load_vt<C>(rows, vt);
      }
      float* ai = acc + i * 2 * d;
      __m512 a0[C], a1[C];
      for (int c = 0; c < C; ++c) {
        a0[c] = _mm512_loadu_ps(ai + 16 * c);
        a1[c] = _mm512_loadu_ps(ai + d + 16 * c);
      }
      const uint32_t* pp = reinterpret_cast<const uint32_t*>(probs + i * stride + (j0 - lo));
      const int64_t pairs = (cnt + 1) / 2;
      int64_t jp = 0;
      for (; jp + 2 <= pairs; jp += 2)
        for (int c = 0; c < C; ++c) {
          a0[c] = dp_bf16(a0[c], vt[jp * C + c], pp[jp]);
          a1[c] = dp_bf16(a1[c], vt[(jp + 1) * C + c], pp[jp + 1]);
        }
      if (jp < pairs)
        for (int c = 0; c < C; ++c) a0[c] = dp_bf16(a0[c], vt[jp * C + c], pp[jp]);
      for (int c = 0; c < C; ++c) {
        _mm512_storeu_ps(ai + 16 * c, a0[c]);
        _mm512_storeu_ps(ai + d + 16 * c, a1[c]);
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (ns[i] <= lo) continue;
    const float* ai = acc + i * 2 * d;
    alignas(64) float lanes[16];
    for (int c = 0; c < C; ++c) {  // a partial result stays unnormalised
      _mm512_store_ps(lanes, _mm512_add_ps(_mm512_loadu_ps(ai + 16 * c), _mm512_loadu_ps(ai + d + 16 * c)));
      store_lanes(lanes, c, parts[i] ? 1.0f : inv[i], parts[i] ? parts[i] : outs[i]);
    }
    if (parts[i]) {
      parts[i][d] = mx[i];
      parts[i][d + 1] = sum[i];
    }
  }
}

// A query's output from its blocks' partial results (attend_group_bf16; nb blocks of d + 2
// floats at `parts`, in key order): with M the largest block max and w_b = exp(m_b - M),
// out = sum_b w_b o_b / sum_b w_b s_b, summed in block order. Depends only on the query's
// own blocks, whose bounds are fixed by key index: grouping still never changes a bit.
QUASAR_AVX512 void combine_blocks(const float* parts, int64_t nb, int64_t d, float* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < nb; ++b) m = std::max(m, parts[b * (d + 2) + d]);
  std::fill_n(out, d, 0.0f);
  float total = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const float* pb = parts + b * (d + 2);
    const __m512 w = exp512(_mm512_set1_ps(pb[d] - m));
    total += _mm512_cvtss_f32(w) * pb[d + 1];
    for (int64_t c = 0; c < d; c += 16)
      _mm512_storeu_ps(out + c, _mm512_fmadd_ps(w, _mm512_loadu_ps(pb + c), _mm512_loadu_ps(out + c)));
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_loadu_ps(out + c), inv));
}

using AttendBf16Fn = void (*)(const float* const*, const int64_t*, const KeyMap&, float* const*, float* const*,
                              int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, float, float*, uint16_t*,
                              int64_t, float*);

template <bool Paths>
AttendBf16Fn attend_bf16_for(int64_t d) {
  switch (d) {
    case 32: return attend_group_bf16<2, Paths>;
    case 64: return attend_group_bf16<4, Paths>;
    case 96: return attend_group_bf16<6, Paths>;
    case 128: return attend_group_bf16<8, Paths>;
    case 256: return attend_group_bf16<16, Paths>;
    default: return nullptr;
  }
}

// ------------------------------------------- prefill attention with AMX-BF16 tiles
// A prompt chunk (a chain of up to 128 rows in one slot) attends with tile multiplies
// (tdpbf16ps: 16 queries x 16 keys x 32 dims, or 16 queries x 32 keys x 16 dims, per
// instruction): same bf16 inputs (q, K, V, softmax numerators rounded to bf16; max, exp,
// sums and normalisation in float32) and the same arithmetic as the steps' tile kernel
// (attend_group_amx, below), but over all its keys at once, with operands built once per
// kv head for the whole chunk, not in 512-key blocks: past one block not bitwise a step.
// That is allowed for prompt chunks only: a prompt is always prefilled in the same chunks,
// so its cache is the same in every decode. Why: at 5k tokens attention was half of the
// prefill, at the vdpbf16ps compute limit.
// Tiles (one configuration, `rows` = the query block's rows): 0..4 and 7 [rows, 64 bytes],
// 5 and 6 [16, 64 bytes]. Scores: A = q (tiles 1..4, one per 32 dims), B = a K^T chunk,
// C = tile 0; for head_dim <= 64 two key chunks at a time (C = tiles 0 and 7), so one
// chunk's sums need not wait for the other's store. Output: A = softmax numerators of
// 32 keys (tile 4), B = V pairs (tiles 5, 6), C = tiles 0..3 (16 dims each).
#if defined(__linux__) && (__GNUC__ >= 11 || defined(__clang__))
#define QUASAR_AMX_ATTENTION 1
#define QUASAR_AMXBF16 __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vnni,avx512bf16")))

struct alignas(64) AttnTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

QUASAR_AMXBF16 void attn_tiles(int64_t rows) {
  AttnTileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = static_cast<uint8_t>(i < 5 || i == 7 ? rows : 16), cfg.colsb[i] = 64;
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");  // ldtilecfg reads the stores above
  _tile_loadconfig(&cfg);
}

// The softmax of the tile kernels, one query: its n unscaled scores s (a tile row) to bf16
// numerators exp(scale (s_j - max)) at pb, zeros from n to `end` (a multiple of 16); returns
// the scaled max and sets `sum` to the numerators' float32 sum. Scaling inside the exponent
// (one FMA into exp2) spares a pass that scaled and stored every score.
QUASAR_BF16 inline float softmax_numerators(const float* s, int64_t n, int64_t end, float scale, uint16_t* pb,
                                            float& sum) {
  __m512 vmx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    vmx = _mm512_mask_max_ps(vmx, m, vmx, _mm512_maskz_loadu_ps(m, s + j));
  }
  const float mx = _mm512_reduce_max_ps(vmx);
  const float scale2 = scale * 1.44269504088896341f;  // exp(x) = 2^(x log2 e)
  const __m512 sc = _mm512_set1_ps(scale2), off = _mm512_set1_ps(mx * scale2);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < end; j += 16) {
    __m512 e = _mm512_setzero_ps();
    if (j < n) {
      const __mmask16 m = tail_mask(n - j);
      e = _mm512_maskz_mov_ps(m, exp2_bf16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + j), sc, off)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), (__m256i)_mm512_cvtneps_pbh(e));
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
  return mx * scale;
}

// Accumulators 0..NC-1 += the numerators of one 32-key chunk (tile 4: `a`, rows `lda` bytes
// apart) x its V pair tiles (w: the chunk's vectors from column group g0 on).
template <int C, int NC>
QUASAR_AMXBF16 inline void pv_chunk(const uint16_t* a, int64_t lda, const __m512i* w) {
  constexpr int64_t kRow = C * 64;  // bytes from one key pair's row of a vt chunk to the next
  _tile_loadd(4, a, lda);
  _tile_loadd(5, w, kRow);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (NC > 1) {
    _tile_loadd(6, w + 1, kRow);
    _tile_dpbf16ps(1, 4, 6);
  }
  if constexpr (NC > 2) {
    _tile_loadd(5, w + 2, kRow);
    _tile_dpbf16ps(2, 4, 5);
  }
  if constexpr (NC > 3) {
    _tile_loadd(6, w + 3, kRow);
    _tile_dpbf16ps(3, 4, 6);
  }
}

template <int NC>
QUASAR_AMXBF16 inline void zero_accumulators() {
  _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
}

// Accumulators 0..NC-1 to [rows, 64] floats at `out` (tile c at column 16 c).
template <int NC>
QUASAR_AMXBF16 inline void store_accumulators(float* out) {
  _tile_stored(0, out, 256);
  if constexpr (NC > 1) _tile_stored(1, out + 16, 256);
  if constexpr (NC > 2) _tile_stored(2, out + 32, 256);
  if constexpr (NC > 3) _tile_stored(3, out + 48, 256);
}

// Output dims [16 g0, 16 (g0 + NC)) of a query block: probs [rows, 32 keys] tiles against
// V pair tiles (vt: per 32-key chunk, 16 rows of key pairs, C vectors of 64 bytes each);
// sums stored as [rows, 64] floats at `out` (vector c at column 16 c).
template <int C, int NC>
QUASAR_AMXBF16 inline void prefill_pv(const uint16_t* probs, int64_t stride, const __m512i* vt, int64_t g0,
                                      int64_t chunks, float* out) {
  zero_accumulators<NC>();
  for (int64_t ch = 0; ch < chunks; ++ch) pv_chunk<C, NC>(probs + ch * 32, stride * 2, vt + ch * 16 * C + g0);
  store_accumulators<NC>(out);
}

// Tile 0 = the query tiles (1 .. C/2, 32 dims each) x one 16-key chunk's K^T (kt: C/2 B
// tiles of 16 pair rows).
template <int C>
QUASAR_AMXBF16 inline void scores_tile(const __m512i* kt) {
  _tile_zero(0);
  _tile_loadd(5, kt, 64);
  _tile_dpbf16ps(0, 1, 5);
  if constexpr (C > 2) {
    _tile_loadd(6, kt + 16, 64);
    _tile_dpbf16ps(0, 2, 6);
  }
  if constexpr (C > 4) {
    _tile_loadd(5, kt + 32, 64);
    _tile_dpbf16ps(0, 3, 5);
  }
  if constexpr (C > 6) {
    _tile_loadd(6, kt + 48, 64);
    _tile_dpbf16ps(0, 4, 6);
  }
}

// Query tiles 1 .. C/2 from `nq` bf16 query rows of 16C dims.
template <int C>
QUASAR_AMXBF16 inline void load_queries(const uint16_t* qb) {
  constexpr int64_t ld = 32 * C;  // bytes per query row
  _tile_loadd(1, qb, ld);
  if constexpr (C > 2) _tile_loadd(2, qb + 32, ld);
  if constexpr (C > 4) _tile_loadd(3, qb + 64, ld);
  if constexpr (C > 6) _tile_loadd(4, qb + 96, ld);
}

// The tiles' operands from a kv head's cache rows (k, v [S, 16C] bf16): K^T of 16-key
// chunk h (8C vectors at kt + 8C h: load_kt's layout) and the V pairs of keys 16h..16h+15 (8
// pair rows of the 32-key chunk h / 2 at vt + 8C h: load_vt's), keys past n zeros (the cache
// past the step is uninitialised memory). Done once per kv head and chunk of a prefill step,
// shared by all its queries.
template <int C>
QUASAR_AMXBF16 void prefill_operands(const uint16_t* k, const uint16_t* v, int64_t n, int64_t h, __m512i* kt,
                                     __m512i* vt) {
  constexpr int64_t d = 16 * C;
  const uint16_t* rows[16];
  for (int64_t jj = 0; jj < 16; ++jj) rows[jj] = 16 * h + jj < n ? k + (16 * h + jj) * d : nullptr;
  load_kt<C>(rows, kt + h * 8 * C);
  for (int64_t jj = 0; jj < 16; ++jj) rows[jj] = 16 * h + jj < n ? v + (16 * h + jj) * d : nullptr;
  load_vt<C>(rows, vt + h * 8 * C);
}

// attend_group_bf16's result for the queries of a prompt chunk (every query's keys are
// rows 0..n_i of the slot: a chain), with tiles, from the kv head's prefill_operands (kt,
// vt: every 16-key chunk up to the queries' longest n rounded up to 32 keys). Scratch:
// `scores` / `probs` nq * stride (stride a multiple of 32, >= max n), `acc` 16 * 64 floats.
template <int C>
QUASAR_AMXBF16 void attend_prefill_amx(const float* const* qs, const int64_t* ns, float* const* outs, int64_t nq,
                                       const __m512i* kt, const __m512i* vt, float scale, float* scores,
                                       uint16_t* probs, int64_t stride, float* acc) {
  static_assert(C % 2 == 0 && C <= 8, "AMX prefill attention: head_dim 32, 64, 96 or 128");
  constexpr int64_t d = 16 * C, np = 8 * C;
  alignas(64) uint16_t qb[kMaxGroupQueries * d];
  for (int64_t i = 0; i < nq; ++i) to_bf16(qs[i], d, qb + i * d);
  for (int64_t q0 = 0; q0 < nq; q0 += 16) {
    const int64_t mb = std::min<int64_t>(16, nq - q0);
    int64_t n_block = 0;
    for (int64_t i = q0; i < q0 + mb; ++i) n_block = std::max(n_block, ns[i]);
    attn_tiles(mb);
    // scores of the block's queries, 16 keys at a time (unscaled; keys past a query's n are
    // computed and never read)
    load_queries<C>(qb + q0 * d);
    const int64_t chunks = (n_block + 15) / 16;
    int64_t ch = 0;
    if constexpr (C <= 4) {  // two chunks at a time: independent sums in tiles 0 and 7
      const int64_t ld = stride * 4;
      for (; ch + 2 <= chunks; ch += 2) {
        const __m512i* t = kt + ch * np;
        _tile_zero(0);
        _tile_zero(7);
        _tile_loadd(5, t, 64);
        _tile_loadd(6, t + np, 64);
        _tile_dpbf16ps(0, 1, 5);
        _tile_dpbf16ps(7, 1, 6);
        if constexpr (C > 2) {
          _tile_loadd(5, t + 16, 64);
          _tile_dpbf16ps(0, 2, 5);
          _tile_loadd(6, t + np + 16, 64);
          _tile_dpbf16ps(7, 2, 6);
        }
        _tile_stored(0, scores + q0 * stride + 16 * ch, ld);
        _tile_stored(7, scores + q0 * stride + 16 * (ch + 1), ld);
      }
    }
    for (; ch < chunks; ++ch) {
      scores_tile<C>(kt + ch * np);
      _tile_stored(0, scores + q0 * stride + 16 * ch, stride * 4);
    }
    // softmax numerators as bf16 (zeros from n_i to the block's last 32-key chunk), and
    // 1 / their float32 sum
    alignas(64) float inv[16];
    const int64_t end32 = (n_block + 31) / 32 * 32;
    for (int64_t r = 0; r < mb; ++r) {
      float sum;
      softmax_numerators(scores + (q0 + r) * stride, ns[q0 + r], end32, scale, probs + (q0 + r) * stride, sum);
      inv[r] = 1.0f / sum;
    }
    // out = numerators x V, 16 dims per accumulator tile (4 at a time), then the lanes'
    // dim permutation of load_vt undone and the sum normalised
    const uint16_t* pblock = probs + q0 * stride;
    for (int64_t g0 = 0; g0 < C; g0 += 4) {
      if (C - g0 >= 4)
        prefill_pv<C, 4>(pblock, stride, vt, g0, end32 / 32, acc);
      else
        prefill_pv<C, 2>(pblock, stride, vt, g0, end32 / 32, acc);
      for (int64_t r = 0; r < mb; ++r)
        for (int64_t c = g0; c < std::min<int64_t>(C, g0 + 4); ++c)
          store_lanes(acc + r * 64 + (c - g0) * 16, c, inv[r], outs[q0 + r]);
    }
  }
  _tile_release();
}

// ------------------------------------------ verifier-step attention with AMX-BF16 tiles
// attend_group_bf16's contract (one block of keys [lo, hi), outputs or block partials) with
// the products in tiles: scores 16 queries x 16 keys x 32 dims and outputs 16 queries x 32
// keys x 16 dims a tdpbf16ps, where the vector kernel spends a vdpbf16ps per query per 32
// products. On an AMX CPU every verifier step takes it (one row or many, chains, trees and
// batches), so row invariance holds among steps: each score and each output sum of a
// query is computed from its own q row, its own keys (tiles' rows and columns never mix)
// and its own numerators, in chunks fixed by key index. Where queries share keys (their
// slot's committed cache, any chain) the chunk's operands are built once for all; a tree
// row's keys past the shared part get operands of their own, multiplied with that query's
// row alone (its scores read from its row of the tile, its numerators in an otherwise zero
// tile, so the other rows' sums are unchanged). Not bitwise the vector kernel (another
// summation order): the verifier of an AMX CPU is its own. `ops`: scratch for one block's
// operands, 2 * kBlockKeys / 16 * 8C vectors, 64-byte aligned.
template <int C, bool Paths>
QUASAR_AMXBF16 void attend_group_amx(const float* const* qs, const int64_t* ns, const KeyMap& keys,
                                     float* const* outs, float* const* parts, int64_t nq, int64_t lo, int64_t hi,
                                     const uint16_t* k, const uint16_t* v, float scale, float* scores,
                                     uint16_t* probs, int64_t stride, float* acc, __m512i* ops) {
  static_assert(C % 2 == 0 && C <= 8, "AMX attention: head_dim 32, 64, 96 or 128");
  constexpr int64_t d = 16 * C, np = 8 * C;
  int64_t ends[kMaxGroupQueries];
  int64_t n_max = lo, shared_until = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < nq; ++i) {
    ends[i] = std::min(ns[i], hi);
    n_max = std::max(n_max, ends[i]);
    if constexpr (Paths) shared_until = std::min(shared_until, keys.splits[i]);
  }
  const auto shared = [&](int64_t j0, int64_t len) { return !Paths || j0 + len <= shared_until; };
  // the shared chunks' operands, 16 keys a unit (prefill_operands' layout), to the end of
  // the last 32-key chunk (zeros past the step's keys)
  __m512i* const kt = ops;
  __m512i* const vt = ops + kBlockKeys / 16 * np;
  const uint16_t* rows[16];
  for (int64_t j0 = lo; j0 < lo + (n_max - lo + 31) / 32 * 32; j0 += 16) {
    if (!shared(j0, 16)) break;
    for (int64_t jj = 0; jj < 16; ++jj) rows[jj] = j0 + jj < n_max ? k + (j0 + jj) * d : nullptr;
    load_kt<C>(rows, kt + (j0 - lo) / 16 * np);
    for (int64_t jj = 0; jj < 16; ++jj) rows[jj] = j0 + jj < n_max ? v + (j0 + jj) * d : nullptr;
    load_vt<C>(rows, vt + (j0 - lo) / 16 * np);
  }
  // query i's own rows of keys [j0, j0 + 16) (base k or v; zeros from its end on)
  const auto own_rows = [&](const uint16_t* base, int64_t i, int64_t j0) {
    for (int64_t jj = 0; jj < 16; ++jj)
      rows[jj] = j0 + jj < ends[i] ? base + key_row<Paths>(keys, i, j0 + jj) * d : nullptr;
  };
  alignas(64) uint16_t qb[kMaxGroupQueries * d];
  for (int64_t i = 0; i < nq; ++i) to_bf16(qs[i], d, qb + i * d);
  alignas(64) __m512i own[16 * C];     // one query's operands of a 16-key (K^T) or 32-key (V) chunk
  alignas(64) float own_scores[16 * 16];
  alignas(64) uint16_t own_probs[16 * 32];
  alignas(64) float mx[kMaxGroupQueries], sum[kMaxGroupQueries];
  for (int64_t q0 = 0; q0 < nq; q0 += 16) {
    const int64_t mb = std::min<int64_t>(16, nq - q0);
    int64_t end = lo;  // of this block of queries' keys
    for (int64_t i = q0; i < q0 + mb; ++i) end = std::max(end, ends[i]);
    if (end == lo) continue;
    attn_tiles(mb);
    load_queries<C>(qb + q0 * d);
    // unscaled scores
    for (int64_t j0 = lo; j0 < end; j0 += 16) {
      if (shared(j0, 16)) {
        scores_tile<C>(kt + (j0 - lo) / 16 * np);
        _tile_stored(0, scores + q0 * stride + (j0 - lo), stride * 4);
        continue;
      }
      for (int64_t r = 0; r < mb; ++r) {
        const int64_t i = q0 + r;
        if (ends[i] <= j0) continue;
        own_rows(k, i, j0);
        load_kt<C>(rows, own);
        scores_tile<C>(own);
        _tile_stored(0, own_scores, 64);
        std::copy_n(own_scores + 16 * r, 16, scores + i * stride + (j0 - lo));
      }
    }
    // softmax numerators as bf16 (zeros from a query's end to the last 32-key chunk) and
    // their float32 sum
    const int64_t end32 = (end - lo + 31) / 32 * 32;
    for (int64_t i = q0; i < q0 + mb; ++i)
      if (ends[i] > lo)
        mx[i] = softmax_numerators(scores + i * stride, ends[i] - lo, end32, scale, probs + i * stride, sum[i]);
    // outputs, 16 dims per accumulator tile (4 at a time)
    for (int64_t g0 = 0; g0 < C; g0 += 4) {
      // the chunks shared by the queries (a prefix), then per query the chunks past its
      // shared keys: each query's rows of the accumulators still take its chunks in key
      // order, as in a one-query step where all of them are shared
      const int64_t chunks = end32 / 32;
      int64_t first_own = 0;
      while (first_own < chunks && shared(lo + 32 * first_own, 32)) ++first_own;
      if (C - g0 >= 4) {
        zero_accumulators<4>();
        for (int64_t c = 0; c < first_own; ++c)
          pv_chunk<C, 4>(probs + q0 * stride + 32 * c, stride * 2, vt + 2 * c * np + g0);
      } else {
        zero_accumulators<2>();
        for (int64_t c = 0; c < first_own; ++c)
          pv_chunk<C, 2>(probs + q0 * stride + 32 * c, stride * 2, vt + 2 * c * np + g0);
      }
      for (int64_t c = first_own; c < chunks; ++c) {
        const int64_t j0 = lo + 32 * c;
        for (int64_t r = 0; r < mb; ++r) {
          const int64_t i = q0 + r;
          if (ends[i] <= j0) continue;
          own_rows(v, i, j0);
          load_vt<C>(rows, own);
          own_rows(v, i, j0 + 16);
          load_vt<C>(rows, own + np);
          std::fill_n(own_probs, 32 * mb, uint16_t{0});
          std::copy_n(probs + i * stride + 32 * c, 32, own_probs + 32 * r);
          if (C - g0 >= 4)
            pv_chunk<C, 4>(own_probs, 64, own + g0);
          else
            pv_chunk<C, 2>(own_probs, 64, own + g0);
        }
      }
      if (C - g0 >= 4)
        store_accumulators<4>(acc);
      else
        store_accumulators<2>(acc);
      for (int64_t r = 0; r < mb; ++r) {
        const int64_t i = q0 + r;
        if (ends[i] <= lo) continue;
        const float w = parts[i] ? 1.0f : 1.0f / sum[i];  // a partial result stays unnormalised
        for (int64_t c = g0; c < std::min<int64_t>(C, g0 + 4); ++c)
          store_lanes(acc + r * 64 + (c - g0) * 16, c, w, parts[i] ? parts[i] : outs[i]);
      }
    }
    for (int64_t i = q0; i < q0 + mb; ++i)
      if (ends[i] > lo && parts[i]) {
        parts[i][d] = mx[i];
        parts[i][d + 1] = sum[i];
      }
  }
  _tile_release();
}

using AttendAmxFn = void (*)(const float* const*, const int64_t*, const KeyMap&, float* const*, float* const*,
                             int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, float, float*, uint16_t*,
                             int64_t, float*, __m512i*);

template <bool Paths>
AttendAmxFn attend_amx_for(int64_t d) {
  switch (d) {
    case 32: return attend_group_amx<2, Paths>;
    case 64: return attend_group_amx<4, Paths>;
    case 96: return attend_group_amx<6, Paths>;
    case 128: return attend_group_amx<8, Paths>;
    default: return nullptr;
  }
}

using AttendPrefillFn = void (*)(const float* const*, const int64_t*, float* const*, int64_t, const __m512i*,
                                 const __m512i*, float, float*, uint16_t*, int64_t, float*);
using PrefillOperandsFn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, __m512i*, __m512i*);

std::pair<AttendPrefillFn, PrefillOperandsFn> attend_prefill_for(int64_t d) {
  switch (d) {
    case 32: return {attend_prefill_amx<2>, prefill_operands<2>};
    case 64: return {attend_prefill_amx<4>, prefill_operands<4>};
    case 96: return {attend_prefill_amx<6>, prefill_operands<6>};
    case 128: return {attend_prefill_amx<8>, prefill_operands<8>};
    default: return {nullptr, nullptr};
  }
}

bool amx_bf16_supported() {
  static const bool ok = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16");
  return ok && quasar::amx_enabled();
}
#endif

// A bf16 KV cache: on the AVX512 paths of a CPU with AVX512-BF16.
bool bf16_supported() {
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok && quasar::path_at_least(quasar::KernelPath::kAvx512Vnni);
}

// act[r, c] = silu(gu[r, c]) * gu[r, inter + c]: gate and up side by side in gu.
QUASAR_AVX512 void silu_mul(const float* gu, int64_t rows, int64_t inter, float* act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* o = act + r * inter;
    for (int64_t c = 0; c < inter; c += 16) {
      const __mmask16 m = tail_mask(inter - c);
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

AttendFn attend_f32_avx512(int64_t d, bool paths) { return paths ? attend_for<true>(d) : attend_for<false>(d); }

#else  // not x86: the portable path alone, and no bf16 cache
bool bf16_supported() { return false; }
using AttendBf16Fn = void (*)(const float* const*, const int64_t*, const KeyMap&, float* const*, float* const*,
                              int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, float, float*, uint16_t*,
                              int64_t, float*);
template <bool Paths>
AttendBf16Fn attend_bf16_for(int64_t) { return nullptr; }
inline void to_bf16(const float*, int64_t, uint16_t*) {}
inline void combine_blocks(const float*, int64_t, int64_t, float*) {}
#endif  // QUASAR_LAYER_KERNEL

// The float kernels of the active kernel path (step_kernels.h).
const quasar::step::FloatKernels& float_kernels() {
  using quasar::KernelPath;
  if (quasar::path_at_least(KernelPath::kAvx512Vnni)) return quasar::step::float_kernels_avx512();
  if (quasar::path_at_least(KernelPath::kAvx2)) return quasar::step::float_kernels_avx2();
  return quasar::step::float_kernels_portable();
}

const float* float_data(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
              "w8a8_decoder_layers: ", what, " must be a contiguous float32 tensor of ", numel,
              " elements");
  return t.data_ptr<float>();
}

// One Int8Linear's buffers as a GEMM segment writing columns [col, col + N).
quasar::Int8Segment segment(const at::Tensor& w, const at::Tensor& tiles, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, const at::Tensor& comp,
                            int64_t in_features, int64_t col) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() &&
                  w.size(1) == in_features,
              "w8a8_decoder_layers: weight must be a contiguous int8 [N, ", in_features, "]");
  const int64_t n = w.size(0);
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == n,
              "w8a8_decoder_layers: comp must be int32 [N]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) b = float_data(*bias, n, "bias");
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.is_contiguous() &&
                  tiles.numel() == quasar::tiled_bytes(n, in_features),
              "w8a8_decoder_layers: tiles must be the weight packed by int8_pack_tiles");
  return {tiles.data_ptr<int8_t>(), n, comp.data_ptr<int32_t>(), float_data(scale, n, "weight_scale"),
          b, col};
}

// The linears of one layer as GEMM segments, checked against the head layout.
struct LayerGemms {
  quasar::Int8Segment qkv[3], o, gate_up[2], down;
  int64_t inter;
  int64_t bits_qkv, bits_o, bits_gate_up, bits_down;  // activation bits (8 or 15)
};

LayerGemms layer_gemms(at::TensorList weights, at::TensorList tiles, at::TensorList scales,
                       const c10::List<std::optional<at::Tensor>>& biases, at::TensorList comps,
                       at::IntArrayRef act_bits, int64_t base, int64_t H, int64_t nq, int64_t nkv) {
  const auto w = [&](int64_t i) { return weights[base + i]; };
  const auto seg = [&](int64_t i, int64_t in_features, int64_t col) {
    return segment(weights[base + i], tiles[base + i], scales[base + i], biases.get(base + i), comps[base + i],
                   in_features, col);
  };
  const int64_t inter = w(4).size(0);
  TORCH_CHECK(w(0).size(0) == nq && w(1).size(0) == nkv && w(2).size(0) == nkv && w(3).size(0) == H &&
                  w(5).size(0) == inter && w(6).size(0) == H,
              "w8a8_decoder_layers: linear shapes do not match the heads");
  const auto bits = [&](int64_t i) { return act_bits[base + i]; };
  for (int64_t i = 0; i < 7; ++i)
    TORCH_CHECK(bits(i) == 8 || bits(i) == 15, "w8a8_decoder_layers: act_bits must be 8 or 15");
  TORCH_CHECK(bits(0) == bits(1) && bits(1) == bits(2) && bits(4) == bits(5),
              "w8a8_decoder_layers: q, k, v (and gate, up) share their input, so their act_bits must match");
  return {{seg(0, H, 0), seg(1, H, nq), seg(2, H, nq + nkv)},
          seg(3, nq, 0),
          {seg(4, H, 0), seg(5, H, inter)},
          seg(6, inter, 0),
          inter,
          bits(0),
          bits(3),
          bits(4),
          bits(6)};
}

}  // namespace

namespace quasar {
namespace step {
// The AVX512 float kernels: the functions above (16-float vectors, FMAs).
const FloatKernels& float_kernels_avx512() {
#ifdef QUASAR_LAYER_KERNEL
  static const FloatKernels kernels = {rms_norm, silu_mul, add_into, attend_f32_avx512};
  return kernels;
#else
  return float_kernels_portable();
#endif
}
}  // namespace step
}  // namespace quasar

// x [1, T, H] float32 -> the hidden states after all L layers [1, T, H], for the rows of a
// verifier step over one or more cache slots (quasar/models/rows.py). k_cache / v_cache are
// [L, slots, KVH, S, D] float32 or bfloat16. Row t belongs to slot slots[t], whose committed length is
// starts[t]; the rows of a slot are contiguous and form a tree: parents[t] is row t's parent
// row (an index into the whole step; -1 for the slot's first row, its pending token; a chain
// has parents[t] = t - 1). Row t's K/V go to its slot at starts[t] + (t - the slot's first
// row), and it attends to its slot's committed cache [0, starts[t]) and then to its path (the
// rows from the root down to itself): the keys a one-token step on its path would see, so
// neither the other rows of its slot nor other slots change a bit of its result.
// Per layer l, in order: norms[4l .. 4l+3] = input_layernorm, post_attention_layernorm,
// q_norm, k_norm (the last two None without qk-norm); weights / tiles / scales / biases /
// comps / act_bits[7l .. 7l+6] = the Int8Linears q, k, v, o, gate, up, down (tiles = the
// weight packed by int8_pack_tiles, which the GEMMs read; comp = 128 * rowsum(weight), int32
// [N]; act_bits 8, or 15 for split 15-bit activations as in Int8Linear).
at::Tensor w8a8_decoder_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& k_cache, at::Tensor& v_cache, at::IntArrayRef slots,
                               at::IntArrayRef starts, at::IntArrayRef parents,
                               const c10::List<std::optional<at::Tensor>>& norms, double eps,
                               at::TensorList weights, at::TensorList tiles, at::TensorList scales,
                               const c10::List<std::optional<at::Tensor>>& biases,
                               at::TensorList comps, at::IntArrayRef act_bits, int64_t n_heads,
                               int64_t n_kv_heads, bool prefill) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "w8a8_decoder_layers: x must be contiguous float32 [1, T, H]");
  const int64_t T = x.size(1), H = x.size(2);
  TORCH_CHECK(T >= 1 && T <= kMaxRows, "w8a8_decoder_layers: 1..", kMaxRows, " rows, got ", T);
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && (bf16 || k_cache.scalar_type() == at::kFloat) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.size(2) == n_kv_heads,
              "w8a8_decoder_layers: caches must be contiguous float32 or bfloat16 [L, slots, KVH, S, D]");
  TORCH_CHECK(!bf16 || bf16_supported(), "w8a8_decoder_layers: a bfloat16 cache needs an AVX512-BF16 CPU");
  TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
              "w8a8_decoder_layers: n_heads must be a multiple of n_kv_heads");
  const int64_t L = k_cache.size(0), n_slots = k_cache.size(1), D = k_cache.size(4), S = k_cache.size(3);
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 4 * L && static_cast<int64_t>(weights.size()) == 7 * L &&
                  static_cast<int64_t>(tiles.size()) == 7 * L &&
                  static_cast<int64_t>(scales.size()) == 7 * L && static_cast<int64_t>(biases.size()) == 7 * L &&
                  static_cast<int64_t>(comps.size()) == 7 * L && static_cast<int64_t>(act_bits.size()) == 7 * L,
              "w8a8_decoder_layers: 4 norms and 7 linears per cache layer");
  TORCH_CHECK(static_cast<int64_t>(parents.size()) == T && static_cast<int64_t>(slots.size()) == T &&
                  static_cast<int64_t>(starts.size()) == T && parents[0] == -1,
              "w8a8_decoder_layers: one slot, start and parent per row, parent -1 for the first");
  // Per row: its cache row (where its K/V go), and its logical keys (KeyMap): n_keys[t] of
  // them, rows [0, split[t]) of its slot's cache and then tails[t], the cache rows of the
  // path from the first one off the slot's chain. `groups`: each slot's rows [first, end).
  std::vector<int64_t> n_keys(T), split(T), cache_row(T), tail_rows(T * T), path;
  std::vector<const int64_t*> tails(T);
  std::vector<std::pair<int64_t, int64_t>> groups;
  std::vector<bool> seen(n_slots, false);
  bool is_chain = true;
  int64_t max_keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < n_slots, "w8a8_decoder_layers: slot ", slot, " is not in the cache");
    if (parents[t] == -1) {
      TORCH_CHECK(!seen[slot], "w8a8_decoder_layers: the rows of slot ", slot, " must be contiguous, one root");
      seen[slot] = true;
      groups.emplace_back(t, t + 1);
    } else {
      const int64_t p = parents[t];
      TORCH_CHECK(p >= groups.back().first && p < t && slots[p] == slot && starts[p] == starts[t],
                  "w8a8_decoder_layers: parents[", t, "] must be an earlier row of the same slot");
      groups.back().second = t + 1;
    }
    const int64_t first = groups.back().first;
    cache_row[t] = starts[t] + t - first;
    TORCH_CHECK(starts[t] >= 0 && cache_row[t] < S, "w8a8_decoder_layers: rows past the cache");
    path.clear();
    for (int64_t r = t; r != -1; r = parents[r]) path.push_back(r);
    std::reverse(path.begin(), path.end());
    int64_t m = 0;
    while (m < static_cast<int64_t>(path.size()) && path[m] == first + m) ++m;
    is_chain = is_chain && m == static_cast<int64_t>(path.size());
    n_keys[t] = starts[t] + static_cast<int64_t>(path.size());
    split[t] = starts[t] + m;
    for (size_t i = m; i < path.size(); ++i) tail_rows[t * T + (i - m)] = cache_row[path[i]];
    tails[t] = tail_rows.data() + t * T;
    max_keys = std::max(max_keys, n_keys[t]);
  }
  // The active kernel path's float kernels; a batch of chains keeps the plain attention
  // kernel (no key lookups at all).
  const quasar::step::FloatKernels& fk = float_kernels();
  const auto rms_norm = fk.rms_norm;
  const auto silu_mul = fk.silu_mul;
  const auto add_into = fk.add_into;
  const AttendFn attend = fk.attend(D, !is_chain);
  const AttendBf16Fn attend_bf16 = is_chain ? attend_bf16_for<false>(D) : attend_bf16_for<true>(D);
  // An AMX-BF16 CPU's steps attend with tiles (attend_group_amx), all of them.
#ifdef QUASAR_AMX_ATTENTION
  const AttendAmxFn attend_amx = bf16 && amx_bf16_supported()
                                     ? (is_chain ? attend_amx_for<false>(D) : attend_amx_for<true>(D))
                                     : nullptr;
#endif
  TORCH_CHECK(attend != nullptr, "w8a8_decoder_layers: head_dim must be 16, 32, 48, 64, 80, 96, 128 or 256");
  TORCH_CHECK(!bf16 || attend_bf16 != nullptr,
              "w8a8_decoder_layers: a bfloat16 cache needs head_dim 32, 64, 96, 128 or 256");
  const int64_t stride = (max_keys + 31) / 32 * 32;  // of the score rows (32-key tiles in prefill)
  // A prompt chunk on an AMX-BF16 CPU attends with tiles (attend_prefill_amx: allowed for
  // prefill only, see there).
#ifdef QUASAR_AMX_ATTENTION
  const auto [attend_prefill, prefill_operands_fn] = prefill && bf16 && is_chain && groups.size() == 1 &&
                                                             amx_bf16_supported()
                                                         ? attend_prefill_for(D)
                                                         : std::pair<AttendPrefillFn, PrefillOperandsFn>{};
  // Its operands, per kv head: K^T per 16 keys (D / 2 rows of 64 bytes) and V pairs per 32
  // keys (D rows), for every key of the step (stride covers them in whole 32-key chunks);
  // 64-byte aligned by hand.
  const int64_t kt_rows = stride / 16 * D / 2, vt_rows = stride / 32 * D, halves = stride / 16;
  std::vector<uint8_t> operands_raw(attend_prefill ? 64 * (n_kv_heads * (kt_rows + vt_rows) + 1) : 0);
  __m512i* const operands =
      reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(operands_raw.data()) + 63) & ~uintptr_t{63});
  const bool prefill_tiles = attend_prefill != nullptr;
#else
  const bool prefill_tiles = false;
#endif
  const float* cs = float_data(cos, T * D, "cos");
  const float* sn = float_data(sin, T * D, "sin");
  const float feps = static_cast<float>(eps);
  const int64_t nq = n_heads * D, nkv = n_kv_heads * D, nqkv = nq + 2 * nkv;
  const int64_t group = n_heads / n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Attention work items: the query vectors (rows x heads) of one slot's kv head over one
  // block of its keys (a bf16 cache's steps; otherwise all keys are one block), the queries
  // cut into pieces of at most kMaxGroupQueries, and further while there are fewer blocks
  // than two per thread; each item streams its block of the kv head's cache once. How
  // queries are grouped never changes their results.
  const bool blocked = bf16 && !prefill_tiles;
  const auto n_blocks = [&](int64_t n) { return blocked ? (n + kBlockKeys - 1) / kBlockKeys : int64_t{1}; };
  struct Item { int64_t first, slot, kv, q0, q1, block; };
  std::vector<Item> items;
  std::vector<int64_t> group_blocks;
  int64_t units = 0;
  for (const auto& [first, end] : groups) {
    group_blocks.push_back(n_blocks(*std::max_element(n_keys.begin() + first, n_keys.begin() + end)));
    units += n_kv_heads * group_blocks.back();
  }
  const int64_t min_parts = (2 * at::get_num_threads() + units - 1) / units;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto [first, end] = groups[g];
    const int64_t per_kv = group * (end - first);
    const int64_t parts = std::min(per_kv, std::max((per_kv + kMaxGroupQueries - 1) / kMaxGroupQueries, min_parts));
    for (int64_t kv = 0; kv < n_kv_heads; ++kv)
      for (int64_t b = 0; b < group_blocks[g]; ++b)
        for (int64_t part = 0; part < parts; ++part)
          items.push_back({first, slots[first], kv, part * per_kv / parts, (part + 1) * per_kv / parts, b});
  }
  // The blocks' partial results (d + 2 floats each, combine_blocks) of queries with more
  // than one block: [row, head, block].
  const int64_t most_blocks = n_blocks(max_keys), part_size = D + 2;
  std::vector<float> partials(most_blocks > 1 ? T * n_heads * most_blocks * part_size : 0);

  // Per layer: its norm weights and its four GEMMs (q, k, v together; gate and up together),
  // all checked here, before the parallel region (nothing in it may throw).
  struct LayerPlan {
    const float *w_in, *w_post, *w_qn, *w_kn;
    int64_t inter, bits_qkv, bits_o, bits_gate_up, bits_down;
  };
  std::vector<LayerPlan> plan;
  std::vector<LayerGemms> segs;
  int64_t inter_max = 0;
  for (int64_t l = 0; l < L; ++l) {
    segs.push_back(layer_gemms(weights, tiles, scales, biases, comps, act_bits, 7 * l, H, nq, nkv));
    const LayerGemms& g = segs.back();
    inter_max = std::max(inter_max, g.inter);
    const std::optional<at::Tensor> qn = norms.get(4 * l + 2), kn = norms.get(4 * l + 3);
    TORCH_CHECK(norms.get(4 * l).has_value() && norms.get(4 * l + 1).has_value(),
                "w8a8_decoder_layers: missing layer norm");
    plan.push_back({float_data(*norms.get(4 * l), H, "input_layernorm"),
                    float_data(*norms.get(4 * l + 1), H, "post_attention_layernorm"),
                    qn.has_value() && qn->defined() ? float_data(*qn, D, "q_norm") : nullptr,
                    kn.has_value() && kn->defined() ? float_data(*kn, D, "k_norm") : nullptr, g.inter, g.bits_qkv,
                    g.bits_o, g.bits_gate_up, g.bits_down});
  }
  at::Tensor out = x.clone();  // the residual stream, updated in place layer by layer
  float* xs = out.data_ptr<float>();
  std::vector<float> h(T * H), proj(T * std::max(nqkv, H)), attn(T * nq), gu(T * 2 * inter_max),
      act(T * inter_max), sx(T);
  // Quantized activations of the GEMM at hand (15 bits: hi in q, lo in q_lo), rows of
  // padded_k(K) bytes; phases are separated by barriers, so one buffer serves every GEMM.
  const int64_t k4_max = quasar::padded_k(std::max({H, nq, inter_max}));
  std::vector<uint8_t> q(T * k4_max), q_lo(T * k4_max);
  std::vector<quasar::SmallMGemm> gemms;  // 4 per layer: qkv, o, gate_up, down
  for (int64_t l = 0; l < L; ++l) {
    const LayerGemms& g = segs[l];
    const auto gemm = [&](int64_t k, const quasar::Int8Segment* sg, int64_t n_sg, float* y, int64_t ys, int64_t bits) {
      gemms.emplace_back(q.data(), bits == 15 ? q_lo.data() : nullptr, T, k, sg, n_sg, sx.data(), y, ys);
    };
    gemm(H, g.qkv, 3, proj.data(), nqkv, g.bits_qkv);
    gemm(nq, &g.o, 1, proj.data(), H, g.bits_o);
    gemm(H, g.gate_up, 2, gu.data(), 2 * g.inter, g.bits_gate_up);
    gemm(g.inter, &g.down, 1, proj.data(), H, g.bits_down);
  }
  // Attention items are taken dynamically (their cost varies with each slot's length): one
  // counter per layer, so no reset is needed between layers.
  std::unique_ptr<std::atomic<int64_t>[]> next_item(new std::atomic<int64_t>[L]);
  for (int64_t l = 0; l < L; ++l) next_item[l] = 0;
  const int64_t n_items = static_cast<int64_t>(items.size());
  float* const k_f32 = bf16 ? nullptr : k_cache.data_ptr<float>();
  float* const v_f32 = bf16 ? nullptr : v_cache.data_ptr<float>();
  uint16_t* const k_b16 = bf16 ? reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* const v_b16 = bf16 ? reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>()) : nullptr;

  // The whole step is one parallel region: each layer is a sequence of phases separated by
  // barriers, so the glue between GEMMs (norms, quantization, RoPE, SiLU, residuals) is
  // spread over the threads by rows instead of running on one while the others wait, and
  // the ~150 fork/joins of a region per GEMM and attention call are gone. Row phases give
  // each thread the same rows throughout (so a row's residual add and the next norm need no
  // barrier); GEMM phases split the output vectors; every row and every output column is
  // computed alone, so how the work is split never changes a bit.
  const int n_threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(n_threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = T * tid / nt, r1 = T * (tid + 1) / nt, nr = r1 - r0;  // this thread's rows
    const auto quantize = [&](const float* src, int64_t k, int64_t bits) {  // rows [r0, r1) of src [T, k]
      if (nr == 0) return;
      const int64_t k4 = quasar::padded_k(k);
      if (bits == 15)
        quasar::quantize_rows_split_u8(src + r0 * k, nr, k, q.data() + r0 * k4, q_lo.data() + r0 * k4, sx.data() + r0);
      else
        quasar::quantize_rows_u8(src + r0 * k, nr, k, q.data() + r0 * k4, sx.data() + r0);
    };
    const auto run_gemm = [&](const quasar::SmallMGemm& g) {
      const int64_t v = g.vectors();
      g.run(v * tid / nt, v * (tid + 1) / nt);
    };
    std::vector<float> scores(kMaxGroupQueries * stride), acc(kMaxGroupQueries * 2 * D);
    std::vector<uint16_t> probs(bf16 ? kMaxGroupQueries * stride : 0);
#ifdef QUASAR_AMX_ATTENTION
    // attend_group_amx's operands of one block, 64-byte aligned by hand
    std::vector<uint8_t> amx_raw(attend_amx ? 64 * (2 * kBlockKeys / 16 * D / 2 + 1) : 0);
    __m512i* const amx_ops =
        reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(amx_raw.data()) + 63) & ~uintptr_t{63});
#endif

    for (int64_t l = 0; l < L; ++l) {
      const LayerPlan& p = plan[l];
      const quasar::SmallMGemm* lg = gemms.data() + 4 * l;
      // attention block: norm and quantize this thread's rows, then q, k, v
      if (nr) rms_norm(xs + r0 * H, nr, H, p.w_in, feps, h.data() + r0 * H);
      quantize(h.data(), H, p.bits_qkv);
#pragma omp barrier
      run_gemm(lg[0]);
#pragma omp barrier
      // qk-norm, RoPE and the K/V of this thread's rows into this layer's cache (float32 or
      // bf16; slot s's kv head h at ((s * KVH + h) * S) * D)
      const int64_t layer_at = l * n_slots * n_kv_heads * S * D;
      for (int64_t t = r0; t < r1; ++t) {
        float* row = proj.data() + t * nqkv;
        if (p.w_qn) rms_norm(row, n_heads, D, p.w_qn, feps, row);
        if (p.w_kn) rms_norm(row + nq, n_kv_heads, D, p.w_kn, feps, row + nq);
        for (int64_t hd = 0; hd < n_heads + n_kv_heads; ++hd) rope(row + hd * D, cs + t * D, sn + t * D, D);
        for (int64_t kv = 0; kv < n_kv_heads; ++kv) {
          const int64_t at_row = layer_at + ((slots[t] * n_kv_heads + kv) * S + cache_row[t]) * D;
          if (bf16) {
            to_bf16(row + nq + kv * D, D, k_b16 + at_row);
            to_bf16(row + nq + nkv + kv * D, D, v_b16 + at_row);
          } else {
            std::copy_n(row + nq + kv * D, D, k_f32 + at_row);
            std::copy_n(row + nq + nkv + kv * D, D, v_f32 + at_row);
          }
        }
      }
#pragma omp barrier
#ifdef QUASAR_AMX_ATTENTION
      if (attend_prefill) {  // the tiles' operands of every kv head, 16 keys a unit
        const int64_t units = n_kv_heads * halves, first = groups[0].first;
        for (int64_t u = units * tid / nt; u < units * (tid + 1) / nt; ++u) {
          const int64_t kv = u / halves, head = layer_at + (slots[first] * n_kv_heads + kv) * S * D;
          __m512i* kt = operands + kv * (kt_rows + vt_rows);
          prefill_operands_fn(k_b16 + head, v_b16 + head, max_keys, u % halves, kt, kt + kt_rows);
        }
#pragma omp barrier
      }
#endif
      for (int64_t i = next_item[l]++; i < n_items; i = next_item[l]++) {
        const Item& it = items[i];
        const float* qp[kMaxGroupQueries];
        float *op[kMaxGroupQueries], *pp[kMaxGroupQueries];
        int64_t ns[kMaxGroupQueries], sp[kMaxGroupQueries];
        const int64_t* tl[kMaxGroupQueries];
        for (int64_t qi = it.q0; qi < it.q1; ++qi) {
          const int64_t t = it.first + qi / group, hd = it.kv * group + qi % group;
          qp[qi - it.q0] = proj.data() + t * nqkv + hd * D;
          op[qi - it.q0] = attn.data() + t * nq + hd * D;
          pp[qi - it.q0] = n_blocks(n_keys[t]) > 1
                               ? partials.data() + ((t * n_heads + hd) * most_blocks + it.block) * part_size
                               : nullptr;
          ns[qi - it.q0] = n_keys[t];
          sp[qi - it.q0] = split[t];
          tl[qi - it.q0] = tails[t];
        }
        const int64_t head = layer_at + (it.slot * n_kv_heads + it.kv) * S * D;
#ifdef QUASAR_AMX_ATTENTION
        if (attend_prefill) {
          const __m512i* kt = operands + it.kv * (kt_rows + vt_rows);
          attend_prefill(qp, ns, op, it.q1 - it.q0, kt, kt + kt_rows, scale, scores.data(), probs.data(), stride,
                         acc.data());
          continue;
        }
        if (attend_amx) {
          attend_amx(qp, ns, KeyMap{sp, tl}, op, pp, it.q1 - it.q0, it.block * kBlockKeys, (it.block + 1) * kBlockKeys,
                     k_b16 + head, v_b16 + head, scale, scores.data(), probs.data(), stride, acc.data(), amx_ops);
          continue;
        }
#endif
        if (bf16)
          attend_bf16(qp, ns, KeyMap{sp, tl}, op, pp, it.q1 - it.q0, it.block * kBlockKeys,
                      (it.block + 1) * kBlockKeys, k_b16 + head, v_b16 + head, scale, scores.data(),
                      probs.data(), stride, acc.data());
        else
          attend(qp, ns, KeyMap{sp, tl}, op, it.q1 - it.q0, k_f32 + head, v_f32 + head, scale, scores.data(),
                 stride, acc.data());
      }
#pragma omp barrier
      if (most_blocks > 1)  // this thread's rows: join the blocks of queries that have several
        for (int64_t t = r0; t < r1; ++t) {
          const int64_t nb = n_blocks(n_keys[t]);
          if (nb > 1)
            for (int64_t hd = 0; hd < n_heads; ++hd)
              combine_blocks(partials.data() + (t * n_heads + hd) * most_blocks * part_size, nb, D,
                             attn.data() + t * nq + hd * D);
        }
      quantize(attn.data(), nq, p.bits_o);
#pragma omp barrier
      run_gemm(lg[1]);
#pragma omp barrier
      // MLP block: residual, norm and quantize this thread's rows, then gate and up
      if (nr) {
        add_into(xs + r0 * H, proj.data() + r0 * H, nr * H);
        rms_norm(xs + r0 * H, nr, H, p.w_post, feps, h.data() + r0 * H);
      }
      quantize(h.data(), H, p.bits_gate_up);
#pragma omp barrier
      run_gemm(lg[2]);
#pragma omp barrier
      if (nr) silu_mul(gu.data() + r0 * 2 * p.inter, nr, p.inter, act.data() + r0 * p.inter);
      quantize(act.data(), p.inter, p.bits_down);
#pragma omp barrier
      run_gemm(lg[3]);
#pragma omp barrier
      if (nr) add_into(xs + r0 * H, proj.data() + r0 * H, nr * H);  // the next layer reads the same rows
    }
  }
  return out;
}

// Whether w8a8_decoder_layers takes a bfloat16 KV cache here (an AVX512-BF16 CPU on an
// AVX512 kernel path).
bool w8a8_bf16_supported() { return bf16_supported(); }

// Whether attention over a bfloat16 cache (prompt chunks and verifier steps) uses AMX-BF16
// tiles here.
bool w8a8_amx_attention_supported() {
#if defined(QUASAR_LAYER_KERNEL) && defined(QUASAR_AMX_ATTENTION)
  return bf16_supported() && amx_bf16_supported();
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(quasar_quant, m) {
  m.def("w8a8_bf16_supported() -> bool", &w8a8_bf16_supported);
  m.def("w8a8_amx_attention_supported() -> bool", &w8a8_amx_attention_supported);
  m.def(
      "w8a8_decoder_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "int[] slots, int[] starts, int[] parents, Tensor?[] norms, float eps, Tensor[] weights, Tensor[] tiles, Tensor[] scales, Tensor?[] biases, "
      "Tensor[] comps, int[] act_bits, int n_heads, int n_kv_heads, bool prefill=False) -> Tensor");
  m.impl("w8a8_decoder_layers", c10::DispatchKey::CPU, TORCH_FN(w8a8_decoder_layers));
}
