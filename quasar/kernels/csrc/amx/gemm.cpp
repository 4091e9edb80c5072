// The small-M int8 GEMM's AMX path (the amx kernel path, steps of at least amx_min_rows
// rows): the u8 x s8 -> int32 sums of the AVX512-VNNI kernel from AMX-INT8 tile multiplies,
// over the same weight tiles (pack_tiles' layout), comp taken off afterwards as there.
#include "gemm_w8a8/kernels.h"

#include <algorithm>

#ifdef QUASAR_AMX_KERNEL
#include <immintrin.h>

#define QUASAR_AMX __attribute__((target("amx-tile,amx-int8,avx512f")))

namespace quasar {
namespace {

// The tile configuration (palette 1), for one block of rows A (up to 16) or two, A and B:
// tiles 0 and 1 accumulate int32 [rows A, 16], tiles 2 and 3 [rows B, 16]; tile 4 holds
// activations [rows A, 64 bytes], tile 5 [rows B, 64 bytes]; tiles 6 and 7 weights
// [16 groups of 4 columns, 16 outputs]. One block of rows uses tiles 0..3 for its four
// vectors of outputs (rows B = rows A) and 4 and 5 for alternate column blocks.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

QUASAR_AMX void amx_configure(int64_t rows_a, int64_t rows_b) {
  TileConfig cfg;
  for (int i : {0, 1, 4}) cfg.rows[i] = static_cast<uint8_t>(rows_a);
  for (int i : {2, 3, 5}) cfg.rows[i] = static_cast<uint8_t>(rows_b);
  for (int i = 6; i < 8; ++i) cfg.rows[i] = 16;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64;
  // The compiler must not drop the stores above: ldtilecfg reads them behind its back.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

constexpr int64_t kAhead = 2;  // column blocks a pass prefetches ahead

// One block of 64 columns: activations into tile A (4 or 5: the intrinsics take register
// numbers as literals, hence a macro), then each vector's weights alternately into tiles 6
// and 7 and tdpbusd into accumulator v. Weights kAhead blocks on are prefetched meanwhile
// (a tile is one stream of blocks of 16 * NV * 64 bytes; past its end lies the next tile,
// which this thread most likely does next).
#define QUASAR_AMX_BLOCK(A, xb, w)                                                                      \
  do {                                                                                                  \
    const int8_t* next_ = (w) + kAhead * block;                                                         \
    _Pragma("GCC unroll 16") for (int g_ = 0; g_ < 16; ++g_)                                            \
        _Pragma("GCC unroll 4") for (int v_ = 0; v_ < NV; ++v_)                                         \
            _mm_prefetch(reinterpret_cast<const char*>(next_ + g_ * stride + v_ * 64), _MM_HINT_T0);   \
    _tile_loadd(A, (xb), ldx);                                                                          \
    _tile_loadd(6, (w), stride);                                                                        \
    _tile_dpbusd(0, A, 6);                                                                              \
    if constexpr (NV > 1) {                                                                             \
      _tile_loadd(7, (w) + 64, stride);                                                                \
      _tile_dpbusd(1, A, 7);                                                                            \
    }                                                                                                   \
    if constexpr (NV > 2) {                                                                             \
      _tile_loadd(6, (w) + 128, stride);                                                               \
      _tile_dpbusd(2, A, 6);                                                                            \
    }                                                                                                   \
    if constexpr (NV > 3) {                                                                             \
      _tile_loadd(7, (w) + 192, stride);                                                               \
      _tile_dpbusd(3, A, 7);                                                                            \
    }                                                                                                   \
  } while (0)

// tile_pass's sums with AMX for up to 16 rows (the configured row count): the tile's NV
// vectors of 16 weight rows against the activations, 64 columns (16 groups of 4) per
// tdpbusd. In pack_tiles' layout the 16 groups of vector v from group 16 b on are 16
// stripes of 64 bytes, `stride` = nv * 64 bytes apart: exactly a weight tile of tdpbusd (row
// r = the 4 bytes of column 4 r..4 r + 3 for each of 16 outputs); t points at the first of
// the NV vectors taken (NV < nv: a tile shared by two threads). K4 is a multiple of 64
// (padded_k), the padding zero.
template <int NV>
QUASAR_AMX void amx_pass(const uint8_t* x, int64_t ldx, int64_t k4, const int8_t* t, int64_t stride, int32_t* acc) {
  const int64_t block = 16 * stride;  // weight bytes of one block of 64 columns
  _tile_zero(0);
  if constexpr (NV > 1) _tile_zero(1);
  if constexpr (NV > 2) _tile_zero(2);
  if constexpr (NV > 3) _tile_zero(3);
  const int64_t blocks = k4 / 64;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    QUASAR_AMX_BLOCK(4, x + b * 64, t + b * block);
    QUASAR_AMX_BLOCK(5, x + (b + 1) * 64, t + (b + 1) * block);
  }
  if (b < blocks) QUASAR_AMX_BLOCK(4, x + b * 64, t + b * block);
  constexpr int64_t kAccStride = kTile * sizeof(int32_t);
  _tile_stored(0, acc, kAccStride);
  if constexpr (NV > 1) _tile_stored(1, acc + 16, kAccStride);
  if constexpr (NV > 2) _tile_stored(2, acc + 32, kAccStride);
  if constexpr (NV > 3) _tile_stored(3, acc + 48, kAccStride);
}

// Two blocks of rows at once (16, then up to 16 more at x + 16 ldx): each weight tile load
// serves both, so 17..32 rows read the weights from L1/L2 as often as 16 do (a second
// one-block pass cost almost as much as the first). Vectors go in pairs: tiles 0/1 and 2/3
// accumulate vectors v, v + 1 of the two blocks.
template <int NV>
QUASAR_AMX void amx_pass2(const uint8_t* x, int64_t ldx, int64_t k4, const int8_t* t, int64_t stride, int32_t* acc) {
  const int64_t block = 16 * stride;
  constexpr int64_t kAccStride = kTile * sizeof(int32_t);
  const int64_t blocks = k4 / 64;
  const uint8_t* xb = x + 16 * ldx;
  int32_t* acc_b = acc + 16 * kTile;
  for (int v = 0; v < NV; v += 2) {
    const bool pair = v + 1 < NV;
    _tile_zero(0);
    _tile_zero(2);
    if (pair) {
      _tile_zero(1);
      _tile_zero(3);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* w = t + b * block + v * 64;
      const int8_t* next = w + kAhead * block;
#pragma GCC unroll 16
      for (int g = 0; g < 16; ++g) {
        _mm_prefetch(reinterpret_cast<const char*>(next + g * stride), _MM_HINT_T0);
        if (pair) _mm_prefetch(reinterpret_cast<const char*>(next + g * stride + 64), _MM_HINT_T0);
      }
      _tile_loadd(4, x + b * 64, ldx);
      _tile_loadd(5, xb + b * 64, ldx);
      _tile_loadd(6, w, stride);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(2, 5, 6);
      if (pair) {
        _tile_loadd(7, w + 64, stride);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(3, 5, 7);
      }
    }
    _tile_stored(0, acc + v * 16, kAccStride);
    _tile_stored(2, acc_b + v * 16, kAccStride);
    if (pair) {
      _tile_stored(1, acc + (v + 1) * 16, kAccStride);
      _tile_stored(3, acc_b + (v + 1) * 16, kAccStride);
    }
  }
}

// tile_rows with AMX: pairs of 16-row blocks (amx_pass2), a last block alone (amx_pass).
QUASAR_AMX void rows_amx(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0,
                         int64_t nv, int32_t* acc, int64_t& configured) {
  const int64_t k4 = padded_k(K);
  using AmxFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int32_t*);
  static constexpr AmxFn kOne[4] = {amx_pass<1>, amx_pass<2>, amx_pass<3>, amx_pass<4>};
  static constexpr AmxFn kTwo[4] = {amx_pass2<1>, amx_pass2<2>, amx_pass2<3>, amx_pass2<4>};
  for (int64_t r0 = 0; r0 < M; r0 += 32) {
    const int64_t left = M - r0;
    const int64_t rows_a = std::min<int64_t>(16, left), rows_b = left > 16 ? std::min<int64_t>(16, left - 16) : rows_a;
    if (64 * rows_a + rows_b != configured) {
      amx_configure(rows_a, rows_b);
      configured = 64 * rows_a + rows_b;
    }
    (left > 16 ? kTwo : kOne)[nv - 1](x + r0 * k4, k4, k4, t + v0 * 64, stride * 64, acc + r0 * kTile);
  }
}

QUASAR_AMX void release_tiles() { _tile_release(); }

}  // namespace

void tile_rows_amx(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0, int64_t nv,
                   int32_t* acc, int64_t& configured) {
  rows_amx(x, M, K, t, stride, v0, nv, acc, configured);
}

void amx_release() { release_tiles(); }

}  // namespace quasar

#else  // no AMX compiler support: the amx path never runs (cpu_runs is false), but the library links

namespace quasar {
void tile_rows_amx(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int64_t, int64_t, int32_t*, int64_t&) {
  __builtin_trap();
}
void amx_release() {}
}  // namespace quasar

#endif
