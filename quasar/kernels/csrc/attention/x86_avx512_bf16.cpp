// Attention over a bfloat16 KV cache with AVX512-BF16 vectors (attention.h), for the
// fused step's verifier steps on AVX512 CPUs without AMX-BF16 (and their long contexts'
// key blocks).
#include "attention/attention.h"
#include "common/cpu_features.h"
#include "common/head_dim.h"
#include "common/simd_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace quasar {
namespace step {

#ifdef QUASAR_SIMD512
namespace {

using namespace quasar::avx512;

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

// The key rows of one 16-key chunk for attend_group_bf16: the step's (shared by every query)
// or one query's (its path).
template <int C, bool Paths>
struct Bf16Chunk {
  static constexpr int64_t d = 16 * C;
  const KeyMap& keys;
  int64_t n_max, shared_until;
  const uint16_t* rows[16];
  // A chunk is shared when every query's keys there are rows j0.. of the cache; then
  // rows[jj] = row j0 + jj for every row the step has (zeros past n_max).
  bool shared(int64_t j0) const { return !Paths || j0 + 16 <= shared_until; }
  void shared_rows(const uint16_t* base, int64_t j0) {
    for (int64_t jj = 0; jj < 16; ++jj) rows[jj] = j0 + jj < n_max ? base + (j0 + jj) * d : nullptr;
  }
  // rows[jj] = query i's key row j0 + jj (base: k or v), zeros from `cnt` on
  void query_rows(const uint16_t* base, int64_t i, int64_t j0, int64_t cnt) {
    for (int64_t jj = 0; jj < 16; ++jj) rows[jj] = jj < cnt ? base + key_row<Paths>(keys, i, j0 + jj) * d : nullptr;
  }
};

// attend_group_bf16's phases (forced inline: one function as before).
// Scores = q . k * scale over the block's keys, stored from its first key; vmax: each
// query's running lane max.
template <int C, bool Paths>
QUASAR_BF16_INLINE void bf16_scores(Bf16Chunk<C, Paths>& chunk, const uint16_t* qb, const int64_t* ns, int64_t nq,
                                    int64_t lo, const uint16_t* k, float scale, float* scores, int64_t stride,
                                    float* vmax) {
  constexpr int64_t d = 16 * C, np = 8 * C;  // floats, bf16 pairs of a head vector
  alignas(64) __m512i kt[np];
  for (int64_t j0 = lo; j0 < chunk.n_max; j0 += 16) {
    const bool one = chunk.shared(j0);
    if (one) {
      chunk.shared_rows(k, j0);
      load_kt<C>(chunk.rows, kt);
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t cnt = std::min<int64_t>(16, ns[i] - j0);
      if (cnt <= 0) continue;
      if (!one) {
        chunk.query_rows(k, i, j0, cnt);
        load_kt<C>(chunk.rows, kt);
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
}

// Softmax numerators (float32 for the sum, bf16 for the products; zeros past n to the end
// of the last chunk): each query's max, sum and 1 / sum.
QUASAR_BF16_INLINE void bf16_softmax(const int64_t* ns, int64_t nq, int64_t lo, const float* scores,
                                     uint16_t* probs, int64_t stride, const float* vmax, float* mx, float* sum,
                                     float* inv) {
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
}

// out = sum_j p_j v_j, key pairs alternately into two accumulators (independent chains),
// kept in `acc` between 16-key chunks of V.
template <int C, bool Paths>
QUASAR_BF16_INLINE void bf16_values(Bf16Chunk<C, Paths>& chunk, const int64_t* ns, int64_t nq, int64_t lo,
                                    const uint16_t* v, const uint16_t* probs, int64_t stride, float* acc) {
  constexpr int64_t d = 16 * C;
  std::fill_n(acc, nq * 2 * d, 0.0f);
  alignas(64) __m512i vt[8 * C];
  for (int64_t j0 = lo; j0 < chunk.n_max; j0 += 16) {
    const bool one = chunk.shared(j0);
    if (one) {
      chunk.shared_rows(v, j0);
      load_vt<C>(chunk.rows, vt);
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t cnt = std::min<int64_t>(16, ns[i] - j0);
      if (cnt <= 0) continue;
      if (!one) {
        chunk.query_rows(v, i, j0, cnt);
        load_vt<C>(chunk.rows, vt);
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
  constexpr int64_t d = 16 * C;
  // this block's end for each query, and the end of the block's keys over all of them
  int64_t ends[kMaxGroupQueries], shared_until;
  const int64_t n_max = block_ends<Paths>(ns, keys, nq, lo, hi, ends, shared_until);
  ns = ends;
  alignas(64) uint16_t qb[kMaxGroupQueries * d];
  for (int64_t i = 0; i < nq; ++i) to_bf16(qs[i], d, qb + i * d);
  alignas(64) float vmax[kMaxGroupQueries * 16];
  for (int64_t i = 0; i < nq; ++i)
    _mm512_store_ps(vmax + 16 * i, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
  Bf16Chunk<C, Paths> chunk{keys, n_max, shared_until, {}};
  bf16_scores<C, Paths>(chunk, qb, ns, nq, lo, k, scale, scores, stride, vmax);
  alignas(64) float inv[kMaxGroupQueries], mx[kMaxGroupQueries], sum[kMaxGroupQueries];
  bf16_softmax(ns, nq, lo, scores, probs, stride, vmax, mx, sum, inv);
  bf16_values<C, Paths>(chunk, ns, nq, lo, v, probs, stride, acc);
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
QUASAR_AVX512 void combine_blocks_avx512(const float* parts, int64_t nb, int64_t d, float* out) {
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


template <bool Paths>
struct Bf16Attention {
  template <int D>
  struct Kernel {
    static AttendBf16Fn get() {
      if constexpr (D % 32 == 0) return attend_group_bf16<D / 16, Paths>;
      return nullptr;  // the kernel works on pairs of 16-dim halves
    }
  };
};

// A bf16 KV cache: on the AVX512 paths of a CPU with AVX512-BF16.
bool bf16_supported_here(KernelPath path) {
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok && path_at_least(path, KernelPath::kAvx512Vnni);
}

}  // namespace

bool bf16_supported(KernelPath path) { return bf16_supported_here(path); }
void store_bf16(const float* x, int64_t n, uint16_t* out) { to_bf16(x, n, out); }
AttendBf16Fn attend_bf16(int64_t d, bool paths) {
  return paths ? for_head_dim<Bf16Attention<true>::Kernel>(d) : for_head_dim<Bf16Attention<false>::Kernel>(d);
}
void combine_blocks(const float* parts, int64_t nb, int64_t d, float* out) { combine_blocks_avx512(parts, nb, d, out); }

#else  // not x86: no bf16 cache

bool bf16_supported(KernelPath) { return false; }
void store_bf16(const float*, int64_t, uint16_t*) {}
AttendBf16Fn attend_bf16(int64_t, bool) { return nullptr; }
void combine_blocks(const float*, int64_t, int64_t, float*) {}

#endif

}  // namespace step
}  // namespace quasar
