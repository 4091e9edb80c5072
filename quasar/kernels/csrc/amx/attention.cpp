// Attention over a bfloat16 KV cache with AMX-BF16 tiles (attention.h): every verifier
// step on an AMX CPU, and prompt chunks.
#include "attention/attention.h"
#include "common/cpu_features.h"
#include "common/head_dim.h"
#include "gemm_w8a8/int8_gemm.h"
#include "common/simd_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace quasar {
namespace step {

#if defined(QUASAR_SIMD512) && defined(QUASAR_AMX_ATTENTION)
namespace {

using namespace quasar::avx512;

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
// One attend_group_amx call's block of keys: each query's end in it, where the keys the
// queries share end, the shared chunks' operands (kt, vt: prefill_operands' layout, 16 keys
// a unit) and the key rows of the chunk at hand.
template <int C, bool Paths>
struct AmxBlock {
  static constexpr int64_t d = 16 * C, np = 8 * C;
  const KeyMap& keys;
  const int64_t* ends;
  int64_t lo, n_max, shared_until;
  const uint16_t *k, *v;
  __m512i *kt, *vt;
  const uint16_t* rows[16];
  bool shared(int64_t j0, int64_t len) const { return !Paths || j0 + len <= shared_until; }
  // query i's own rows of keys [j0, j0 + 16) (base k or v; zeros from its end on)
  void own_rows(const uint16_t* base, int64_t i, int64_t j0) {
    for (int64_t jj = 0; jj < 16; ++jj)
      rows[jj] = j0 + jj < ends[i] ? base + key_row<Paths>(keys, i, j0 + jj) * d : nullptr;
  }
};

// attend_group_amx's phases.
// The shared chunks' operands, to the end of the last 32-key chunk (zeros past the step's keys).
template <int C, bool Paths>
QUASAR_AMXBF16 inline void amx_shared_operands(AmxBlock<C, Paths>& b) {
  constexpr int64_t d = 16 * C, np = 8 * C;
  for (int64_t j0 = b.lo; j0 < b.lo + (b.n_max - b.lo + 31) / 32 * 32; j0 += 16) {
    if (!b.shared(j0, 16)) break;
    for (int64_t jj = 0; jj < 16; ++jj) b.rows[jj] = j0 + jj < b.n_max ? b.k + (j0 + jj) * d : nullptr;
    load_kt<C>(b.rows, b.kt + (j0 - b.lo) / 16 * np);
    for (int64_t jj = 0; jj < 16; ++jj) b.rows[jj] = j0 + jj < b.n_max ? b.v + (j0 + jj) * d : nullptr;
    load_vt<C>(b.rows, b.vt + (j0 - b.lo) / 16 * np);
  }
}

// Unscaled scores of queries [q0, q0 + mb) (loaded in the tiles) over keys [lo, end).
template <int C, bool Paths>
QUASAR_AMXBF16 inline void amx_scores(AmxBlock<C, Paths>& b, int64_t q0, int64_t mb, int64_t end, float* scores,
                                      int64_t stride) {
  constexpr int64_t np = 8 * C;
  alignas(64) __m512i own[16 * C];  // one query's operands of a 16-key chunk (K^T)
  alignas(64) float own_scores[16 * 16];
  for (int64_t j0 = b.lo; j0 < end; j0 += 16) {
    if (b.shared(j0, 16)) {
      scores_tile<C>(b.kt + (j0 - b.lo) / 16 * np);
      _tile_stored(0, scores + q0 * stride + (j0 - b.lo), stride * 4);
      continue;
    }
    for (int64_t r = 0; r < mb; ++r) {
      const int64_t i = q0 + r;
      if (b.ends[i] <= j0) continue;
      b.own_rows(b.k, i, j0);
      load_kt<C>(b.rows, own);
      scores_tile<C>(own);
      _tile_stored(0, own_scores, 64);
      std::copy_n(own_scores + 16 * r, 16, scores + i * stride + (j0 - b.lo));
    }
  }
}

// Outputs of queries [q0, q0 + mb) from their numerators (probs, to end32 keys past lo),
// 16 dims per accumulator tile (4 at a time): the chunks shared by the queries (a prefix),
// then per query the chunks past its shared keys: each query's rows of the accumulators
// still take its chunks in key order, as in a one-query step where all of them are shared.
template <int C, bool Paths>
QUASAR_AMXBF16 inline void amx_outputs(AmxBlock<C, Paths>& b, int64_t q0, int64_t mb, int64_t end32,
                                       const uint16_t* probs, int64_t stride, float* acc, const float* sum,
                                       float* const* outs, float* const* parts) {
  constexpr int64_t np = 8 * C;
  alignas(64) __m512i own[16 * C];  // one query's operands of a 32-key chunk (V)
  alignas(64) uint16_t own_probs[16 * 32];
  const int64_t chunks = end32 / 32;
  int64_t first_own = 0;
  while (first_own < chunks && b.shared(b.lo + 32 * first_own, 32)) ++first_own;
  for (int64_t g0 = 0; g0 < C; g0 += 4) {
    const bool four = C - g0 >= 4;
    if (four)
      zero_accumulators<4>();
    else
      zero_accumulators<2>();
    for (int64_t c = 0; c < first_own; ++c)
      if (four)
        pv_chunk<C, 4>(probs + q0 * stride + 32 * c, stride * 2, b.vt + 2 * c * np + g0);
      else
        pv_chunk<C, 2>(probs + q0 * stride + 32 * c, stride * 2, b.vt + 2 * c * np + g0);
    for (int64_t c = first_own; c < chunks; ++c) {
      const int64_t j0 = b.lo + 32 * c;
      for (int64_t r = 0; r < mb; ++r) {
        const int64_t i = q0 + r;
        if (b.ends[i] <= j0) continue;
        b.own_rows(b.v, i, j0);
        load_vt<C>(b.rows, own);
        b.own_rows(b.v, i, j0 + 16);
        load_vt<C>(b.rows, own + np);
        std::fill_n(own_probs, 32 * mb, uint16_t{0});
        std::copy_n(probs + i * stride + 32 * c, 32, own_probs + 32 * r);
        if (four)
          pv_chunk<C, 4>(own_probs, 64, own + g0);
        else
          pv_chunk<C, 2>(own_probs, 64, own + g0);
      }
    }
    if (four)
      store_accumulators<4>(acc);
    else
      store_accumulators<2>(acc);
    for (int64_t r = 0; r < mb; ++r) {
      const int64_t i = q0 + r;
      if (b.ends[i] <= b.lo) continue;
      const float w = parts[i] ? 1.0f : 1.0f / sum[i];  // a partial result stays unnormalised
      for (int64_t c = g0; c < std::min<int64_t>(C, g0 + 4); ++c)
        store_lanes(acc + r * 64 + (c - g0) * 16, c, w, parts[i] ? parts[i] : outs[i]);
    }
  }
}

template <int C, bool Paths>
QUASAR_AMXBF16 void attend_group_amx(const float* const* qs, const int64_t* ns, const KeyMap& keys,
                                     float* const* outs, float* const* parts, int64_t nq, int64_t lo, int64_t hi,
                                     const uint16_t* k, const uint16_t* v, float scale, float* scores,
                                     uint16_t* probs, int64_t stride, float* acc, __m512i* ops) {
  static_assert(C % 2 == 0 && C <= 8, "AMX attention: head_dim 32, 64, 96 or 128");
  constexpr int64_t d = 16 * C, np = 8 * C;
  int64_t ends[kMaxGroupQueries], shared_until;
  const int64_t n_max = block_ends<Paths>(ns, keys, nq, lo, hi, ends, shared_until);
  AmxBlock<C, Paths> b{keys, ends, lo, n_max, shared_until, k, v, ops, ops + kBlockKeys / 16 * np, {}};
  amx_shared_operands(b);
  alignas(64) uint16_t qb[kMaxGroupQueries * d];
  for (int64_t i = 0; i < nq; ++i) to_bf16(qs[i], d, qb + i * d);
  alignas(64) float mx[kMaxGroupQueries], sum[kMaxGroupQueries];
  for (int64_t q0 = 0; q0 < nq; q0 += 16) {
    const int64_t mb = std::min<int64_t>(16, nq - q0);
    int64_t end = lo;  // of this block of queries' keys
    for (int64_t i = q0; i < q0 + mb; ++i) end = std::max(end, ends[i]);
    if (end == lo) continue;
    attn_tiles(mb);
    load_queries<C>(qb + q0 * d);
    amx_scores(b, q0, mb, end, scores, stride);
    // softmax numerators as bf16 (zeros from a query's end to the last 32-key chunk) and
    // their float32 sum
    const int64_t end32 = (end - lo + 31) / 32 * 32;
    for (int64_t i = q0; i < q0 + mb; ++i)
      if (ends[i] > lo)
        mx[i] = softmax_numerators(scores + i * stride, ends[i] - lo, end32, scale, probs + i * stride, sum[i]);
    amx_outputs(b, q0, mb, end32, probs, stride, acc, sum, outs, parts);
    for (int64_t i = q0; i < q0 + mb; ++i)
      if (ends[i] > lo && parts[i]) {
        parts[i][d] = mx[i];
        parts[i][d + 1] = sum[i];
      }
  }
  _tile_release();
}

template <bool Paths>
struct AmxAttention {
  template <int D>
  struct Kernel {
    static AttendAmxFn get() {
      if constexpr (D % 32 == 0 && D <= 128) return attend_group_amx<D / 16, Paths>;
      return nullptr;
    }
  };
};

template <int D>
struct AmxPrefill {
  static std::pair<AttendPrefillFn, PrefillOperandsFn> get() {
    if constexpr (D % 32 == 0 && D <= 128) return {attend_prefill_amx<D / 16>, prefill_operands<D / 16>};
    return {nullptr, nullptr};
  }
};

bool amx_bf16_supported_here(KernelPath path) {
  static const bool ok = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16");
  return ok && amx_enabled(path);
}

}  // namespace

bool amx_bf16_supported(KernelPath path) { return amx_bf16_supported_here(path); }
AttendAmxFn attend_amx(int64_t d, bool paths) {
  return paths ? for_head_dim<AmxAttention<true>::Kernel>(d) : for_head_dim<AmxAttention<false>::Kernel>(d);
}
std::pair<AttendPrefillFn, PrefillOperandsFn> attend_prefill(int64_t d) { return for_head_dim<AmxPrefill>(d); }

#else  // no AMX tiles here

bool amx_bf16_supported(KernelPath) { return false; }

#endif

}  // namespace step
}  // namespace quasar
