// The small-M int8 GEMM (this folder: generic.cpp, pack.cpp, the x86 paths beside them, AMX in
// ../amx/gemm.cpp), as the int8 linear op (linear_op.cpp) and the fused decoder step use it.
#pragma once

#include <cstdint>

#include "common/cpu_features.h"

namespace quasar {

// Rows of a weight matrix per tile of the small-M GEMM's layout (pack_tiles).
constexpr int64_t kTile = 64;

// K rounded up to a multiple of 64: the row length of packed weights and quantized
// activations (the padding zero weights): VNNI reads 4 columns at a time, an AMX tile 64.
inline int64_t padded_k(int64_t k) { return (k + 63) / 64 * 64; }

// Bytes of an int8 weight [n, K] packed in tiles (rows padded to 16, columns to 64), then
// a footer of kTileFooter bytes: its first is 1 when every weight is in [-127, 127], as
// Quasar's quantizers make them (a foreign checkpoint may hold -128), which lets the AVX2
// kernel take a shorter form (x86_avx2.cpp).
constexpr int64_t kTileFooter = 64;
inline int64_t tiled_bytes(int64_t n, int64_t k) { return (n + 15) / 16 * 16 * padded_k(k) + kTileFooter; }
inline bool tiles_symmetric(const int8_t* tiles, int64_t n, int64_t k) {
  return tiles[tiled_bytes(n, k) - kTileFooter] != 0;
}

// w [n, K] int8 (row-major) -> out [tiled_bytes(n, K)], the small-M GEMM's layout: rows in
// tiles of 64 (the last may hold fewer); within a tile, K in groups of 4 columns; group g of
// tile t is nv * 64 bytes, nv = the tile's vectors of 16 rows, byte [v][i][j] = w[64 t + 16 v
// + i][4 g + j], so one 64-byte load is 16 rows' next four weights (vpdpbusd's operand) and a
// tile is read as one sequential stream. Tile t starts at byte 64 t * K4 (K4 = padded_k(K));
// rows past n and columns past K are zero. The footer follows (tiled_bytes). release_source:
// the source goes to release_span as it is copied, a chunk at a time (pack.cpp).
void pack_tiles(const int8_t* w, int64_t n, int64_t k, int8_t* out, bool release_source = false);
// madvise(MADV_PAGEOUT) on the pages wholly inside [p, p + bytes): a memory-mapped file's
// clean pages leave memory and are read again if touched; nothing is lost. False if no hint.
bool release_span(const void* p, int64_t bytes);

// One weight matrix of a small-M GEMM: tiles = the int8 weight [n, K] in pack_tiles' layout,
// comp = 128 * rowsum(w) int32 [n], ws float [n], optional bias [n]; its outputs go to
// columns [y_col, y_col + n).
struct Int8Segment {
  const int8_t* tiles;
  int64_t n;
  const int32_t* comp;
  const float* ws;
  const float* bias;
  int64_t y_col;
};

// True when `path` is AMX (the CPU has AMX-INT8 and Linux lets this process use the tiles)
// and AMX is not turned off (int8_amx_min_rows(0), QUASAR_NO_AMX).
bool amx_enabled(KernelPath path);

// Whether one-row passes prefetch their whole weight stream in software (the default) or
// only each thread's first kStreamStartBytes of a weight, where the hardware prefetcher has
// not caught on yet, leaving the rest to it; int8_stream_prefetch sets it from a measurement
// (quasar/runtime/step_cost.py). Applies to the AVX2 / AVX-VNNI int8 kernels and to every W4A8
// kernel.
bool prefetch_whole_stream();
constexpr int64_t kStreamStartBytes = 64 << 10;

// Whether a one-row pass `offset` bytes into its thread's part of a weight prefetches in software.
inline bool prefetch_stream_at(int64_t offset) { return offset < kStreamStartBytes || prefetch_whole_stream(); }

// One weight tile's sums on the paths below AVX512 (x86_avx2.cpp, generic.cpp):
// vectors [v0, v0 + nv) of a tile of `stride` vectors at t (pack_tiles' layout) against
// the M rows of x (uint8 q + 128, rows of padded_k(K) bytes, |q| <= 127), into
// acc[r * kTile + c] for c < 16 nv. tile_rows_avx2 and tile_rows_portable give the exact
// sums of q * w; tile_rows_avx_vnni (u8 x s8 like the AVX512 kernel) those of (q + 128) * w,
// comp still to take off. symmetric: no weight of the tile is -128 (tiles_symmetric).
// next: the weight bytes the calling thread reads after this tile, which passes computing on
// bytes already in cache bring into L2 meanwhile, so the memory keeps streaming while the
// cores multiply (see stream_ahead): with several rows, the passes over the tile's last
// blocks reach into it (x86_avx2.cpp, kBlockGroups); when tile_cached (the low half of
// 15-bit activations), every pass over the tile. prefetch_stream: a one-row pass that reads
// the tile from memory asks for its lines ahead in software (else it leaves them to the
// hardware prefetcher; see prefetch_stream_at).
struct StreamAhead {
  const int8_t* p = nullptr;
  int64_t bytes = 0;
  bool tile_cached = false;
  bool prefetch_stream = true;
};
void tile_rows_avx2(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0, int64_t nv,
                    int32_t* acc, bool symmetric, const StreamAhead& next);
void tile_rows_avx_vnni(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0,
                        int64_t nv, int32_t* acc, const StreamAhead& next);
void tile_rows_portable(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0,
                        int64_t nv, int32_t* acc);

// Per-row dynamic int8 quantization of x [M, K] as uint8 (q + 128) into q [M, padded_k(K)]
// (the padding q = 0), scales into sx [M]; the same bits as quantize_activation in
// quasar/runtime/w8a8_numerics.py (on any path; `path` picks the compiled form).
void quantize_rows_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx, KernelPath path);

// y[m, seg.y_col + n] = ((float(xu[m] . w[n] - comp[n]) * ws[n]) * sx[m]) + bias[n] for
// every segment and any M rows of xu [M, padded_k(K)], on kernel path `path`; bitwise
// Int8Linear's result on every path.
void small_m_gemm(const uint8_t* xu, int64_t M, int64_t K, const Int8Segment* segs, int64_t n_segs,
                  const float* sx, float* y, int64_t y_stride, KernelPath path);

// 15-bit activations (|q| <= 16383, scale amax / 16383, as quantize_activation(x, 15)) split
// as q = 128 * hi + lo with hi = q / 128 and lo = q % 128 (C++'s truncating division:
// both in [-127, 127], which the AVX2 kernel needs): hi + 128 and lo + 128 as uint8
// [M, padded_k(K)] each. Any exact split gives the same int64 sums, hence the same bits.
void quantize_rows_split_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo, float* sx,
                            KernelPath path);

// A small-M GEMM cut into vectors (16 output columns of one weight tile each), for callers
// that spread them over their own threads (the fused decoder op runs a whole step in one
// parallel region): the constructor checks the arguments (and may throw); run(v0, v1)
// computes vectors [v0, v1) and never throws, so it may run inside an OpenMP region;
// run_parallel() does them all over the intra-op threads. xlo null: 8-bit activations xu;
// else 15-bit activations split in xu (hi) and xlo (see small_m_gemm_split).
constexpr int64_t kMaxSegments = 8;
struct SmallMGemm {
  SmallMGemm(const uint8_t* xu, const uint8_t* xlo, int64_t M, int64_t K, const Int8Segment* segs, int64_t n_segs,
             const float* sx, float* y, int64_t y_stride, KernelPath path);
  int64_t vectors() const { return vector_first[n_segs]; }
  void run(int64_t v0, int64_t v1) const;
  void run_parallel() const;

  const uint8_t *xu, *xlo;
  int64_t M, K;
  const Int8Segment* segs;
  int64_t n_segs;
  const float* sx;
  float* y;
  int64_t y_stride;
  int64_t vector_first[kMaxSegments + 1];  // segment s's first vector
  KernelPath path;  // how the sums are made (the given path; AVX512 for AMX below its row minimum)
};

// small_m_gemm for split 15-bit activations: the int32 products of hi and lo (each exact)
// combined as 128 * hi + lo in int64, then the same epilogue; bitwise Int8Linear's result
// with act_bits = 15.
void small_m_gemm_split(const uint8_t* xhi, const uint8_t* xlo, int64_t M, int64_t K, const Int8Segment* segs,
                        int64_t n_segs, const float* sx, float* y, int64_t y_stride, KernelPath path);

}  // namespace quasar
