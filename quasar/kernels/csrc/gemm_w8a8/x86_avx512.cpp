// The small-M int8 GEMM's AVX512-VNNI path (the avx512-vnni kernel path; the amx one below
// its AMX row minimum): vpdpbusd (u8 x s8, four pairs summed into each int32 lane) on the
// weight tiles of pack_tiles' layout: each 64-byte load holds the next four weights of 16
// rows, so a vpdpbusd with four broadcast activation bytes (x + 128 as uint8) adds into 16
// output sums at once, a tile is one sequential stream, and no horizontal sums are left at
// the end; 128 * rowsum(W) ("comp") is taken off afterwards (finish_chunk). Only these
// functions are compiled for AVX512 (target attributes: no global -march).
#include "gemm_w8a8/kernels.h"

#include <algorithm>
#include <cstring>

#ifdef QUASAR_VNNI_KERNEL
#include <immintrin.h>

#define QUASAR_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define QUASAR_VNNI_WIDE __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

namespace quasar {
namespace {

inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// acc[r * kTile + 16 v + i] = sum_k x[r * ldx + k] * w[16 v + i][k] for r < R and the NV
// vectors of one tile (kTile rows; see pack_tiles), wrapping int32; x's rows are K4
// bytes (padded_k(K); the weights are zero there, so the padding bytes can be
// anything). Each group of 4 columns is NV 64-byte loads in a row, one broadcast of 4
// activation bytes per row and R * NV vpdpbusd; the R * NV accumulators stay in registers
// (R * NV <= 24, plus NV weights and a broadcast: at most 29 of the 32 zmm registers) and
// are final when the loop ends, so there is no horizontal reduction. (Keep the loop this
// plain: a separate tail step made GCC spill the accumulators.)
template <int R, int NV>
QUASAR_VNNI void tile_pass(const uint8_t* x, int64_t ldx, int64_t K, const int8_t* t, int64_t group_bytes,
                           int32_t* acc) {
  __m512i a[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_setzero_si512();
  const int64_t groups = (K + 3) / 4;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* p = t + g * group_bytes;
    __m512i w[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(p + v * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(load_u32(x + r * ldx + 4 * g));
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbusd_epi32(a[r][v], xb, w[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_storeu_si512(acc + r * kTile + v * 16, a[r][v]);
}

constexpr int kMaxPassRows = 6;  // R of one tile_pass: 6 * 4 accumulators
using PassFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int32_t*);

template <int NV>
constexpr PassFn kPasses[kMaxPassRows] = {tile_pass<1, NV>, tile_pass<2, NV>, tile_pass<3, NV>,
                                           tile_pass<4, NV>, tile_pass<5, NV>, tile_pass<6, NV>};

// The quantizers and the per-chunk epilogue compiled for AVX512 (see QUASAR_INLINE).
QUASAR_VNNI_WIDE void quantize_u8_wide(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx) {
  quantize_rows<uint8_t, 128>(x, m_len, k_len, q, sx, padded_k(k_len));
}

QUASAR_VNNI_WIDE void quantize_split_wide(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo,
                                          float* sx) {
  quantize_split(x, m_len, k_len, hi, lo, sx);
}

template <bool kSplit>
QUASAR_VNNI_WIDE void finish_chunk_wide(int32_t* acc, int32_t* acc_lo, int64_t* wide, int64_t M, int64_t n_len,
                                        const Int8Segment& g, int64_t n0, const float* sx, float* y, int64_t y_stride,
                                        bool offset) {
  finish_chunk<kSplit>(acc, acc_lo, wide, M, n_len, g, n0, sx, y, y_stride, offset);
}

}  // namespace

// All M rows against one tile of nv vectors, in passes of 6 rows and then the rest: the
// first pass reads the tile from memory (at 6 rows its arithmetic hides under the
// stream), later ones from L2, where their arithmetic is all they cost; so the first pass
// takes as many rows as it can (7 rows as 6 + 1, not 4 + 3).
// Vectors [v0, v0 + nv) of a tile of `stride` vectors (v0 > 0 or nv < stride: a tile shared
// by two threads).
void tile_rows_avx512(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0,
                      int64_t nv, int32_t* acc) {
  const int64_t k4 = padded_k(K);
  static constexpr const PassFn* kByNv[4] = {kPasses<1>, kPasses<2>, kPasses<3>, kPasses<4>};
  const PassFn* passes = kByNv[nv - 1];
  for (int64_t r0 = 0; r0 < M; r0 += kMaxPassRows) {
    const int64_t rows = std::min<int64_t>(kMaxPassRows, M - r0);
    passes[rows - 1](x + r0 * k4, k4, K, t + v0 * 64, stride * 64, acc + r0 * kTile);
  }
}

void quantize_u8_avx512(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx) {
  quantize_u8_wide(x, m_len, k_len, q, sx);
}

void quantize_split_avx512(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo, float* sx) {
  quantize_split_wide(x, m_len, k_len, hi, lo, sx);
}

FinishFn finish_chunk_avx512(bool split) { return split ? finish_chunk_wide<true> : finish_chunk_wide<false>; }

}  // namespace quasar

#else  // not x86: this path never runs (cpu_runs is false), but the library links

namespace quasar {
void tile_rows_avx512(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int64_t, int64_t, int32_t*) {
  __builtin_trap();
}
void quantize_u8_avx512(const float*, int64_t, int64_t, uint8_t*, float*) { __builtin_trap(); }
void quantize_split_avx512(const float*, int64_t, int64_t, uint8_t*, uint8_t*, float*) { __builtin_trap(); }
FinishFn finish_chunk_avx512(bool) { __builtin_trap(); }
}  // namespace quasar

#endif
