// Fused W8A8 linear for the `cpu` int8 backend (see quasar/runtime/w8a8.py and ext.py).
//
// One call does what Int8Linear's pure-PyTorch path does in ~10 small ATen ops:
// dynamic per-token int8 quantization of x, the exact int8 x int8 -> int32 GEMM via
// at::_int_mm, and the epilogue ((float(acc) * s_w) * s_x) + bias. Every step is the
// same IEEE operation in the same order as the PyTorch path, so results are bitwise equal:
//   s_x = max(amax|x_row|, float(127 * 1e-12)) / 127      (NaN propagates, like torch.amax)
//   q   = round_half_even(x / s_x)                         (NaN -> 0, like .to(torch.int8))
// Build with -ffp-contract=off: a fused multiply-add in the epilogue would round differently.
// Rows are processed independently, so a token's output never depends on the batch.
//
// Small M (the verifier's k + 1 tokens, M <= 16): oneDNN's _int_mm costs several times its M = 1
// GEMV there, although decoding is memory-bound and the weight need only be read once.
// small_m_gemm does the GEMM by hand with AVX512-VNNI (vpdpbusd: u8 x s8, four pairs
// summed into each int32 lane) on the weight repacked once, at load, into tiles of 64 rows
// (pack_tiles): each 64-byte load holds the next four weights of 16 rows, so a vpdpbusd with
// four broadcast activation bytes (x + 128 as uint8) adds into 16 output sums at once, a
// tile is one sequential stream (the row-major layout's 8 interleaved row streams reach far
// less of the memory bandwidth), and no horizontal sums are left at the end. Then
// 128 * rowsum(W) ("comp") is subtracted. Integer sums are exact (vpdpbusd wraps,
// never saturates, and the wrapped sum minus comp is the true value, which fits in int32
// for K <= MAX_IN_FEATURES), so the int32s, and with the unchanged epilogue the outputs,
// are bitwise those of the oneDNN path. Only that function is compiled for AVX512 (target
// attribute: no global -march); it runs on the avx512-vnni and amx kernel paths
// (cpu_features.h). The lower paths make the same sums over the same tiles with AVX-VNNI,
// AVX2 or plain C++ (gemm_avx2.cpp, gemm_portable.cpp), and there the kernel takes every M:
// oneDNN without VNNI is not exact.

#include "int8_gemm.h"
#include "activation_quant.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define QUASAR_VNNI_KERNEL 1
#include <immintrin.h>
#define QUASAR_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define QUASAR_VNNI_WIDE __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#if defined(__linux__) && defined(__x86_64__) && (__GNUC__ >= 11 || defined(__clang__))
#define QUASAR_AMX_KERNEL 1
#define QUASAR_AMX __attribute__((target("amx-tile,amx-int8,avx512f")))
#endif
#endif

namespace {

using quasar::round_to_int;
using quasar::row_scale;

// Rows of ldq >= k_len outputs; the ones past k_len are set to the offset (q = 0).
template <typename Q, int32_t kOffset>
QUASAR_INLINE void quantize_rows(const float* x, int64_t m_len, int64_t k_len, Q* q, float* sx, int64_t ldq) {
  for (int64_t m = 0; m < m_len; ++m) {
    const float* r = x + m * k_len;
    const float s = row_scale(r, k_len, 127.0);
    sx[m] = s;
    Q* o = q + m * ldq;
    for (int64_t k = 0; k < k_len; ++k) o[k] = static_cast<Q>(round_to_int(r[k] / s) + kOffset);
    for (int64_t k = k_len; k < ldq; ++k) o[k] = static_cast<Q>(kOffset);
  }
}

// y = ((float(acc - comp) * ws) * sx) + bias, one row at a time, each operation rounded
// separately (no contraction), exactly as scale_output's torch.mul / mul_ / add_.
template <typename Acc, bool kComp, bool kBias>
QUASAR_INLINE void epilogue_rows(const Acc* acc, int64_t acc_stride, const int32_t* comp, const float* ws,
                   const float* sx, const float* bias, int64_t m_len, int64_t n_len, float* y,
                   int64_t y_stride) {
  for (int64_t m = 0; m < m_len; ++m) {
    const Acc* a = acc + m * acc_stride;
    const float s = sx[m];
    float* o = y + m * y_stride;
    for (int64_t n = 0; n < n_len; ++n) {
      float v = static_cast<float>(kComp ? a[n] - comp[n] : a[n]) * ws[n];
      v = v * s;
      if (kBias) v = v + bias[n];
      o[n] = v;
    }
  }
}

// Acc: int32, or int64 for the combined halves of 15-bit activations (then no comp).
template <typename Acc>
QUASAR_INLINE void epilogue(const Acc* acc, int64_t acc_stride, const int32_t* comp, const float* ws,
              const float* sx, const float* bias, int64_t m_len, int64_t n_len, float* y,
              int64_t y_stride) {
  if (comp && bias)
    epilogue_rows<Acc, true, true>(acc, acc_stride, comp, ws, sx, bias, m_len, n_len, y, y_stride);
  else if (comp)
    epilogue_rows<Acc, true, false>(acc, acc_stride, comp, ws, sx, bias, m_len, n_len, y, y_stride);
  else if (bias)
    epilogue_rows<Acc, false, true>(acc, acc_stride, comp, ws, sx, bias, m_len, n_len, y, y_stride);
  else
    epilogue_rows<Acc, false, false>(acc, acc_stride, comp, ws, sx, bias, m_len, n_len, y, y_stride);
}

// 15-bit activations split as 128 * hi + lo (quantize_rows_split_u8 in int8_gemm.h).
QUASAR_INLINE void quantize_split(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo, float* sx) {
  const int64_t ldq = quasar::padded_k(k_len);
  for (int64_t m = 0; m < m_len; ++m) {
    const float* r = x + m * k_len;
    const float s = row_scale(r, k_len, 16383.0);
    sx[m] = s;
    for (int64_t k = 0; k < k_len; ++k) {
      const int32_t q = round_to_int(r[k] / s);  // |q| <= 16383
      hi[m * ldq + k] = static_cast<uint8_t>(q / 128 + 128);  // truncated: |q / 128| <= 127
      lo[m * ldq + k] = static_cast<uint8_t>(q % 128 + 128);  // same sign as q, |.| <= 127
    }
    for (int64_t k = k_len; k < ldq; ++k) hi[m * ldq + k] = lo[m * ldq + k] = 128;
  }
}

// ---------------------------------------------------------------- small-M VNNI GEMM
constexpr int64_t kSmallMaxRows = 16;  // rows int8_linear sends to small_m_gemm by default
// Rows small_m_gemm takes: every row passes over a weight tile while it is in L2, so many
// rows (a prefill chunk) read the weights from memory once, not once per 16 rows. With AMX
// int8_linear sends it all of these by default: faster than oneDNN over the whole range.
constexpr int64_t kTiledMaxRows = 128;
// Largest M sent to small_m_gemm (0 disables it; -1: the default, see small_m_limit);
// settable for benchmarks and tests.
std::atomic<int64_t> g_small_m_max{-1};

// The AVX512-VNNI kernel and the AVX512-compiled quantizers run on the avx512-vnni and amx
// paths (cpu_features.h: the CPU has them and no lower path is forced).
bool vnni_supported() {
#ifdef QUASAR_VNNI_KERNEL
  return quasar::path_at_least(quasar::KernelPath::kAvx512Vnni);
#else
  return false;
#endif
}

// AMX (the AMX-INT8 tile instructions): the same u8 x s8 -> int32 sums from tile matrix
// multiplies, 16 rows x 16 outputs x 64 weights in one tdpbusd, at about 1,000 products a
// cycle per core against VNNI's ~100, so a step's extra rows (drafts, batched sequences,
// prefill chunks) cost little more than its first. Used for M >= g_amx_min_rows.
constexpr int64_t kAmxMinRows = 2;
std::atomic<int64_t> g_amx_min_rows{kAmxMinRows};

// The CPU has the instructions, Linux lets this process use the tile data state (asked once,
// cpu_features.cpp) and the path is not forced lower.
bool amx_supported() {
#ifdef QUASAR_AMX_KERNEL
  return quasar::kernel_path() == quasar::KernelPath::kAmx;
#else
  return false;
#endif
}

// Whether oneDNN's int8 GEMM may serve the rows the small-M kernel does not take: only on
// the AVX512 paths, and only while oneDNN is exact here (kernels.py passes its check on
// through ext.onednn_exact). Without VNNI oneDNN makes its u8 x s8 products with vpmaddubsw,
// whose int16 pairs saturate: its sums are wrong, so every lower path computes all rows
// itself, kTiledMaxRows at a time.
std::atomic<bool> g_onednn_exact{true};
bool onednn_allowed() { return vnni_supported() && g_onednn_exact.load(std::memory_order_relaxed); }

// The largest M int8_linear sends to the small-M kernel: as set, or by default all it takes
// when AMX computes them, kSmallMaxRows on AVX512-VNNI alone (oneDNN is faster for more
// rows there), and every M on the lower paths (in chunks of kTiledMaxRows).
int64_t small_m_limit() {
  const int64_t v = g_small_m_max.load(std::memory_order_relaxed);
  if (v >= 0) return v;
  if (!onednn_allowed()) return std::numeric_limits<int64_t>::max();
  return amx_supported() && g_amx_min_rows.load(std::memory_order_relaxed) > 0 ? kTiledMaxRows : kSmallMaxRows;
}

#ifdef QUASAR_VNNI_KERNEL
inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// acc[r * kTile + 16 v + i] = sum_k x[r * ldx + k] * w[16 v + i][k] for r < R and the NV
// vectors of one tile (quasar::kTile rows; see pack_tiles), wrapping int32; x's rows are K4
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
    for (int v = 0; v < NV; ++v) _mm512_storeu_si512(acc + r * quasar::kTile + v * 16, a[r][v]);
}

constexpr int kMaxPassRows = 6;  // R of one tile_pass: 6 * 4 accumulators
using PassFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int32_t*);

template <int NV>
constexpr PassFn kPasses[kMaxPassRows] = {tile_pass<1, NV>, tile_pass<2, NV>, tile_pass<3, NV>,
                                           tile_pass<4, NV>, tile_pass<5, NV>, tile_pass<6, NV>};

// All M rows against one tile of nv vectors, in passes of 6 rows and then the rest: the
// first pass reads the tile from memory (at 6 rows its arithmetic hides under the
// stream), later ones from L2, where their arithmetic is all they cost; so the first pass
// takes as many rows as it can (7 rows as 6 + 1, not 4 + 3).
// Vectors [v0, v0 + nv) of a tile of `stride` vectors (v0 > 0 or nv < stride: a tile shared
// by two threads).
void tile_rows(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0, int64_t nv,
               int32_t* acc) {
  const int64_t k4 = quasar::padded_k(K);
  static constexpr const PassFn* kByNv[4] = {kPasses<1>, kPasses<2>, kPasses<3>, kPasses<4>};
  const PassFn* passes = kByNv[nv - 1];
  for (int64_t r0 = 0; r0 < M; r0 += kMaxPassRows) {
    const int64_t rows = std::min<int64_t>(kMaxPassRows, M - r0);
    passes[rows - 1](x + r0 * k4, k4, K, t + v0 * 64, stride * 64, acc + r0 * quasar::kTile);
  }
}
#endif

#ifdef QUASAR_VNNI_KERNEL
// The quantizers and the per-chunk epilogue compiled for AVX512 (see QUASAR_INLINE).
QUASAR_VNNI_WIDE void quantize_u8_avx512(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx) {
  quantize_rows<uint8_t, 128>(x, m_len, k_len, q, sx, quasar::padded_k(k_len));
}

QUASAR_VNNI_WIDE void quantize_split_avx512(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo,
                                            float* sx) {
  quantize_split(x, m_len, k_len, hi, lo, sx);
}

#endif

// One chunk's outputs from its sums acc [M, kTile] (and acc_lo for 15-bit activations,
// combined as 128 * hi + lo in int64 into wide): comp taken off where the sums are of the
// u8 activations (`offset`: the VNNI, AMX and AVX-VNNI kernels), then the epilogue, into
// columns [g.y_col + n0, + n_len) of y.
template <bool kSplit>
QUASAR_INLINE void finish_chunk(int32_t* acc, int32_t* acc_lo, int64_t* wide, int64_t M, int64_t n_len,
                                const quasar::Int8Segment& g, int64_t n0, const float* sx, float* y,
                                int64_t y_stride, bool offset) {
  constexpr int64_t kChunk = quasar::kTile;
  const auto take_comp = [&](int32_t* a) {  // modular: exact once comp is taken off
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < n_len; ++j)
        a[m * kChunk + j] = static_cast<int32_t>(static_cast<uint32_t>(a[m * kChunk + j]) -
                                                 static_cast<uint32_t>(g.comp[n0 + j]));
  };
  if (offset) take_comp(acc);
  const float* bias = g.bias ? g.bias + n0 : nullptr;
  if constexpr (kSplit) {  // 128 * hi + lo in int64, then the same epilogue as scale_output's
    if (offset) take_comp(acc_lo);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < n_len; ++j)
        wide[m * kChunk + j] = int64_t{acc[m * kChunk + j]} * 128 + acc_lo[m * kChunk + j];
    epilogue(wide, kChunk, nullptr, g.ws + n0, sx, bias, M, n_len, y + g.y_col + n0, y_stride);
  } else {
    epilogue(acc, kChunk, nullptr, g.ws + n0, sx, bias, M, n_len, y + g.y_col + n0, y_stride);
  }
}

using FinishFn = void (*)(int32_t*, int32_t*, int64_t*, int64_t, int64_t, const quasar::Int8Segment&, int64_t,
                          const float*, float*, int64_t, bool);

// finish_chunk compiled for AVX512 (the AVX512 paths) and for the baseline ISA (the others);
// elementwise IEEE operations, so both give the same bits.
template <bool kSplit>
void finish_chunk_baseline(int32_t* acc, int32_t* acc_lo, int64_t* wide, int64_t M, int64_t n_len,
                           const quasar::Int8Segment& g, int64_t n0, const float* sx, float* y, int64_t y_stride,
                           bool offset) {
  finish_chunk<kSplit>(acc, acc_lo, wide, M, n_len, g, n0, sx, y, y_stride, offset);
}

#ifdef QUASAR_VNNI_KERNEL
template <bool kSplit>
QUASAR_VNNI_WIDE void finish_chunk_avx512(int32_t* acc, int32_t* acc_lo, int64_t* wide, int64_t M, int64_t n_len,
                                          const quasar::Int8Segment& g, int64_t n0, const float* sx, float* y,
                                          int64_t y_stride, bool offset) {
  finish_chunk<kSplit>(acc, acc_lo, wide, M, n_len, g, n0, sx, y, y_stride, offset);
}
#endif

template <bool kSplit>
FinishFn finish_for(quasar::KernelPath path) {
#ifdef QUASAR_VNNI_KERNEL
  if (path >= quasar::KernelPath::kAvx512Vnni) return finish_chunk_avx512<kSplit>;
#endif
  (void)path;
  return finish_chunk_baseline<kSplit>;
}

#ifdef QUASAR_AMX_KERNEL
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
  constexpr int64_t kAccStride = quasar::kTile * sizeof(int32_t);
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
  constexpr int64_t kAccStride = quasar::kTile * sizeof(int32_t);
  const int64_t blocks = k4 / 64;
  const uint8_t* xb = x + 16 * ldx;
  int32_t* acc_b = acc + 16 * quasar::kTile;
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
// `configured` is the (rows A, rows B) the calling thread's tiles are set up for, packed as
// 64 * A + B (0: not yet); it is updated here.
QUASAR_AMX void amx_tile_rows(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0,
                              int64_t nv, int32_t* acc, int64_t& configured) {
  const int64_t k4 = quasar::padded_k(K);
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
    (left > 16 ? kTwo : kOne)[nv - 1](x + r0 * k4, k4, k4, t + v0 * 64, stride * 64, acc + r0 * quasar::kTile);
  }
}

QUASAR_AMX void amx_release() { _tile_release(); }
#endif

}  // namespace

namespace quasar {

bool amx_enabled() { return amx_supported() && g_amx_min_rows.load(std::memory_order_relaxed) > 0; }

void quantize_rows_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx) {
#ifdef QUASAR_VNNI_KERNEL
  if (vnni_supported()) return quantize_u8_avx512(x, m_len, k_len, q, sx);
#endif
  quantize_rows<uint8_t, 128>(x, m_len, k_len, q, sx, padded_k(k_len));
}

}  // namespace quasar

namespace {

// quasar::prefetch_whole_stream (int8_gemm.h): 1, the default, or 0. Which is faster depends on
// the CPU: int8_stream_prefetch sets it from a measurement (step_cost.py). In the int8 kernels
// steps of more rows always prefetch: their streaming pass alternates with passes that fetch
// ahead in software, which the hardware prefetcher does not follow.
std::atomic<int64_t> g_stream_prefetch{1};

// The bytes the thread reads after the tile that ends at vector `v_next` of its range [.., v1),
// for passes computing on bytes already in cache to bring into L2 (AVX2 and AVX-VNNI: their
// rows cost arithmetic the stream would otherwise wait for; see gemm_avx2.cpp): from the start
// of the tile holding v_next (in its own segment: the next weight may be another array) up to
// one tile, at most kAheadMaxBytes, and never past the range's part of that segment (the
// other thread's bytes). One tile ahead lets the rows after the first pass over a whole tile
// in L2; it made multi-row steps on forced AVX2 faster than without, and a fixed 64 KiB or
// 1 MiB ahead was slower than one tile.
constexpr int64_t kAheadMaxBytes = 256 << 10;

quasar::StreamAhead stream_ahead(const quasar::SmallMGemm& g, const int64_t* vector_first, int64_t s, int64_t v_next,
                                 int64_t v1) {
  constexpr int64_t kTileVectors = quasar::kTile / 16;
  if (v_next >= v1) return {};
  while (v_next >= vector_first[s + 1]) ++s;
  const int64_t k4 = quasar::padded_k(g.K), seg_vectors = vector_first[s + 1] - vector_first[s];
  const int64_t first = (v_next - vector_first[s]) / kTileVectors * kTileVectors;  // its tile's first vector
  const int64_t last = std::min(v1, vector_first[s + 1]) - vector_first[s];         // one past the range's last
  const int64_t end = std::min((last + kTileVectors - 1) / kTileVectors * kTileVectors, seg_vectors);
  const int64_t bytes = std::min({(end - first) * 16 * k4, quasar::kTile * k4, kAheadMaxBytes});
  return {g.segs[s].tiles + first * 16 * k4, bytes, false};
}

// The outputs of vectors [v0, v1) of a small-M GEMM (a vector is 16 output columns of one
// weight tile; vector_first[s] is segment s's first): each tile's sums for all M rows, then
// comp and the epilogue (elementwise, so how vectors are spread over threads never changes
// a bit). A tile is taken whole where it can be; the range's ends may cut one, so two
// threads share it (a GEMM of 9 tiles, as the default model's o and down projections, is
// split 4.5 / 4.5, not 5 / 4). Rows past the first pass's 6 (VNNI) are further passes over
// the tile while it is in L2, not another read from memory, so up to kTiledMaxRows rows (a
// prefill chunk of the fused decoder op) read the weights once; with AMX, 16 rows are one
// tdpbusd. kSplit: 15-bit activations, q = 128 * hi + lo, given as two uint8 arrays
// (hi + 128, lo + 128); both products are exact int32s, combined in int64.
// `path` picks the tile sums (AMX, AVX512-VNNI, AVX-VNNI, AVX2 or portable: the same
// int32s once comp is off, so the path never changes a bit of the outputs).
template <bool kSplit>
void gemm_vectors(const quasar::SmallMGemm& g, const int64_t* vector_first, quasar::KernelPath path, int64_t v0,
                  int64_t v1) {
  using quasar::KernelPath;
  constexpr int64_t kChunk = quasar::kTile, kTileVectors = kChunk / 16;
  const int64_t M = g.M, K = g.K, k4 = quasar::padded_k(K);
  // Per-thread scratch, kept between calls (a step makes hundreds).
  thread_local std::vector<int32_t> acc_buf, acc_lo_buf;
  thread_local std::vector<int64_t> wide_buf;
  acc_buf.resize(M * kChunk);
  if (kSplit) acc_lo_buf.resize(M * kChunk), wide_buf.resize(M * kChunk);
  int32_t *acc = acc_buf.data(), *acc_lo = acc_lo_buf.data();
  int64_t* wide = wide_buf.data();
  // The tile configuration is per thread, and other code (oneDNN) may change it between
  // calls: set it here, release the tiles at the end.
  int64_t configured = 0;
  // symmetric: the segment's weights are in [-127, 127] (tiles_symmetric; the AVX2 kernel's shorter form)
  const auto sums = [&](const uint8_t* xr, const int8_t* tile, int64_t stride, int64_t va, int64_t nv, int32_t* a,
                        bool symmetric, const quasar::StreamAhead& next) {
    switch (path) {
      case KernelPath::kAmx:
#ifdef QUASAR_AMX_KERNEL
        return amx_tile_rows(xr, M, K, tile, stride, va, nv, a, configured);
#endif
      case KernelPath::kAvx512Vnni:
#ifdef QUASAR_VNNI_KERNEL
        return tile_rows(xr, M, K, tile, stride, va, nv, a);
#endif
      case KernelPath::kAvxVnni: return quasar::tile_rows_avx_vnni(xr, M, K, tile, stride, va, nv, a, next);
      case KernelPath::kAvx2: return quasar::tile_rows_avx2(xr, M, K, tile, stride, va, nv, a, symmetric, next);
      case KernelPath::kPortable: return quasar::tile_rows_portable(xr, M, K, tile, stride, va, nv, a);
    }
  };
  const bool offset = path >= KernelPath::kAvxVnni;  // u8 x s8 sums: comp to take off
  const FinishFn finish = finish_for<kSplit>(path);
  int64_t s = 0;
  for (int64_t v = v0; v < v1;) {
    while (v >= vector_first[s + 1]) ++s;
    const quasar::Int8Segment& seg = g.segs[s];
    const int64_t in_seg = v - vector_first[s], n0 = in_seg / kTileVectors * kChunk;
    const int64_t n_len = std::min(seg.n - n0, kChunk), stride = (n_len + 15) / 16;  // the tile's vectors
    const int64_t va = in_seg % kTileVectors, vb = std::min(stride, va + (v1 - v));  // [va, vb) of them
    const int8_t* tile = seg.tiles + n0 * k4;
    const bool symmetric = quasar::tiles_symmetric(seg.tiles, seg.n, K);
    quasar::StreamAhead next = stream_ahead(g, vector_first, s, v + (vb - va), v1);
    next.prefetch_stream = quasar::prefetch_stream_at((v - std::max(v0, vector_first[s])) * 16 * k4);
    if (kSplit) {  // the low half's passes all find the tile in cache: they fetch ahead
      quasar::StreamAhead stream{};
      stream.prefetch_stream = next.prefetch_stream;
      sums(g.xu, tile, stride, va, vb - va, acc, symmetric, stream);
      next.tile_cached = true;
      sums(g.xlo, tile, stride, va, vb - va, acc_lo, symmetric, next);
    } else {
      sums(g.xu, tile, stride, va, vb - va, acc, symmetric, next);
    }
    finish(acc, acc_lo, wide, M, std::min(n_len, 16 * vb) - 16 * va, seg, n0 + 16 * va, g.sx, g.y, g.y_stride,
           offset);
    v += vb - va;
  }
#ifdef QUASAR_AMX_KERNEL
  if (configured) amx_release();
#endif
}

}  // namespace

namespace quasar {

// madvise MADV_PAGEOUT on the pages wholly inside [p, p + bytes). Pages stay valid: clean
// file pages are read again if touched, anonymous ones are swapped or kept, so no data is lost.
bool release_span(const void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_PAGEOUT)
  if (bytes <= 0) return false;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (begin + page - 1) / page * page, hi = (begin + bytes) / page * page;
  return hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_PAGEOUT) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

// With release_source the tiles are packed a chunk of kReleaseChunk source bytes at a time,
// and after each chunk the source bytes before its end go back to the OS in spans that end on
// a kReleaseAlign boundary: the page cache may hold a mapped file in large folios (up to
// 2 MiB), and MADV_PAGEOUT skips a folio its span does not cover whole (measured: per-tile
// spans of 512 KiB released nothing).
constexpr int64_t kReleaseChunk = int64_t{16} << 20;
constexpr uintptr_t kReleaseAlign = uintptr_t{2} << 20;

void pack_tiles(const int8_t* w, int64_t n, int64_t k, int8_t* out, bool release_source) {
  const int64_t k4 = padded_k(k), n_tiles = (n + kTile - 1) / kTile;
  const int64_t chunk = release_source ? std::max<int64_t>(1, kReleaseChunk / std::max<int64_t>(1, kTile * k)) : n_tiles;
  std::atomic<bool> has_min{false};  // some weight is -128 (the footer's flag)
  uintptr_t released = reinterpret_cast<uintptr_t>(w);
  for (int64_t c0 = 0; c0 < n_tiles; c0 += chunk) {
    const int64_t c1 = std::min(n_tiles, c0 + chunk);
    at::parallel_for(c0, c1, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = t * kTile, rows = std::min(kTile, n - r0), nv = (rows + 15) / 16;
        int8_t* o = out + r0 * k4;
        std::memset(o, 0, nv * 16 * k4);
        for (int64_t i = 0; i < rows; ++i) {  // row r0 + i is lane i % 16 of vector i / 16
          const int8_t* src = w + (r0 + i) * k;
          int8_t* dst = o + (i / 16) * 64 + (i % 16) * 4;
          for (int64_t c = 0; c < k; ++c) dst[(c / 4) * nv * 64 + c % 4] = src[c];
        }
        const int8_t *first = w + r0 * k, *last = first + rows * k;  // the tile's rows, still in cache
        if (std::find(first, last, int8_t{-128}) != last) has_min.store(true, std::memory_order_relaxed);
      }
    });
    if (release_source) {
      const uintptr_t done = reinterpret_cast<uintptr_t>(w + std::min(n, c1 * kTile) * k);
      const uintptr_t end = c1 == n_tiles ? done : done / kReleaseAlign * kReleaseAlign;
      if (end > released) release_span(reinterpret_cast<const void*>(released), static_cast<int64_t>(end - released));
      released = std::max(released, end);
    }
  }
  int8_t* footer = out + tiled_bytes(n, k) - kTileFooter;
  std::memset(footer, 0, kTileFooter);
  footer[0] = !has_min.load();
}

SmallMGemm::SmallMGemm(const uint8_t* xu_, const uint8_t* xlo_, int64_t M_, int64_t K_, const Int8Segment* segs_,
                       int64_t n_segs_, const float* sx_, float* y_, int64_t y_stride_)
    : xu(xu_), xlo(xlo_), M(M_), K(K_), segs(segs_), n_segs(n_segs_), sx(sx_), y(y_), y_stride(y_stride_) {
  TORCH_CHECK(M >= 1 && M <= kTiledMaxRows, "int8 small-M GEMM called with M = ", M);
  TORCH_CHECK(n_segs >= 1 && n_segs <= kMaxSegments, "int8 small-M GEMM: 1..", kMaxSegments, " segments");
  vector_first[0] = 0;
  for (int64_t s = 0; s < n_segs; ++s) {
    TORCH_CHECK(segs[s].tiles != nullptr, "int8 small-M GEMM: the weight must be packed in tiles");
    vector_first[s + 1] = vector_first[s] + (segs[s].n + 15) / 16;
  }
  const int64_t amx_min = g_amx_min_rows.load(std::memory_order_relaxed);
  path = quasar::kernel_path();
  if (path == KernelPath::kAmx && !(amx_min > 0 && M >= amx_min)) path = KernelPath::kAvx512Vnni;
}

void SmallMGemm::run(int64_t v0, int64_t v1) const {
  if (xlo)
    gemm_vectors<true>(*this, vector_first, path, v0, v1);
  else
    gemm_vectors<false>(*this, vector_first, path, v0, v1);
}

// All vectors over the intra-op threads; a task reads at least ~64 KiB of weights (less does
// not pay for waking a thread).
void SmallMGemm::run_parallel() const {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (16 * K));
  at::parallel_for(0, vectors(), grain, [&](int64_t v0, int64_t v1) { run(v0, v1); });
}

void small_m_gemm(const uint8_t* xu, int64_t M, int64_t K, const Int8Segment* segs, int64_t n_segs,
                  const float* sx, float* y, int64_t y_stride) {
  small_m_gemm_split(xu, nullptr, M, K, segs, n_segs, sx, y, y_stride);
}

// Any M, kTiledMaxRows rows a call (each row is computed alone, so the chunking changes no bit).
void small_m_gemm_split(const uint8_t* xhi, const uint8_t* xlo, int64_t M, int64_t K, const Int8Segment* segs,
                        int64_t n_segs, const float* sx, float* y, int64_t y_stride) {
  const int64_t k4 = padded_k(K);
  for (int64_t r0 = 0; r0 < M; r0 += kTiledMaxRows)
    SmallMGemm(xhi + r0 * k4, xlo ? xlo + r0 * k4 : nullptr, std::min(kTiledMaxRows, M - r0), K, segs, n_segs,
               sx + r0, y + r0 * y_stride, y_stride)
        .run_parallel();
}

void quantize_rows_split_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo, float* sx) {
#ifdef QUASAR_VNNI_KERNEL
  if (vnni_supported()) return quantize_split_avx512(x, m_len, k_len, hi, lo, sx);
#endif
  quantize_split(x, m_len, k_len, hi, lo, sx);
}

}  // namespace quasar

namespace {

at::Tensor as_float_vector(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "int8_linear: ", what, " must be on the CPU");
  TORCH_CHECK(t.numel() == n, "int8_linear: ", what, " must have ", n, " elements, got ",
              t.numel());
  return t.to(at::kFloat).contiguous();  // no-ops for the usual float32 buffers
}

}  // namespace

// x [..., K] float (any floating dtype; computed in float32 like the PyTorch path),
// weight [N, K] int8, weight_scale [N] or [N, 1], bias [N] or None, comp = 128 * rowsum(W)
// as int32 [N] or [1, N] (needed when a u8 variant is used). u8_single / u8_multi pick
// oneDNN's u8 x s8 GEMM ("u8x": x + 128 as uint8, minus comp) for M == 1 / M > 1, else
// s8 x s8 ("s8"). On an AVX512-VNNI CPU, M <= int8_small_m_max() (default 16) with a
// valid comp and tiles (the weight packed by int8_pack_tiles) takes the hand-written
// small_m_gemm instead, whatever the flags say.
// act_bits = 15: 15-bit activations split as 128 * hi + lo, two exact int8 GEMMs combined
// in int64 (small_m_gemm_split, or oneDNN's s8 x s8 twice), the same epilogue.
// Returns [..., N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& comp, bool u8_single, bool u8_multi,
                       const std::optional<at::Tensor>& tiles, int64_t act_bits) {
  TORCH_CHECK(act_bits == 8 || act_bits == 15, "int8_linear: act_bits must be 8 or 15, got ", act_bits);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(),
              "int8_linear: tensors must be on the CPU");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "int8_linear: x must be floating point");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "int8_linear: weight must be a 2-D int8 tensor");
  TORCH_CHECK(x.dim() >= 1, "int8_linear: x must have at least one dimension");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K > 0 && x.size(-1) == K, "int8_linear: x has ", x.size(-1), " features, weight ",
              K);

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const auto finish = [&]() {  // the result in x's dtype and shape
    if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
    return y.view(out_shape);
  };
  if (M > 0 && N > 0) {
    const at::Tensor ws = as_float_vector(weight_scale, N, "weight_scale");
    at::Tensor b;
    if (bias.has_value() && bias->defined()) b = as_float_vector(*bias, N, "bias");
    const bool use_u8 = M == 1 ? u8_single : u8_multi;
    at::Tensor cmp;
    if (use_u8) {
      TORCH_CHECK(comp.has_value() && comp->defined() && comp->scalar_type() == at::kInt &&
                      comp->numel() == N,
                  "int8_linear: the u8 variant needs comp = 128 * rowsum(weight) as int32 [N]");
      cmp = comp->contiguous();
    }
    std::vector<float> sx(M);
    // Small M (every M below the AVX512 paths): the hand-written kernel (same int32s, same
    // epilogue).
    const bool small_m = M <= small_m_limit() &&
                         comp.has_value() && comp->defined() && comp->scalar_type() == at::kInt &&
                         comp->numel() == N && tiles.has_value() && tiles->defined();
    at::Tensor c;
    quasar::Int8Segment seg{};
    if (small_m) {
      TORCH_CHECK(tiles->scalar_type() == at::kChar && tiles->is_contiguous() &&
                      tiles->numel() == quasar::tiled_bytes(N, K),
                  "int8_linear: tiles must be the weight packed by int8_pack_tiles");
      c = comp->contiguous();
      seg = {tiles->data_ptr<int8_t>(), N, c.data_ptr<int32_t>(), ws.data_ptr<float>(),
             b.defined() ? b.data_ptr<float>() : nullptr, 0};
    }
    // The rows the small-M kernel does not take: oneDNN where it is exact (AVX512 paths),
    // else float64, exact too (|sums| < 2**53); torch 2.13's CPU _int_mm is wrong for K == 1.
    const auto int_mm = [&](const at::Tensor& q) {  // q int8 or uint8 [M, K] -> int32 [M, N]
      if (K == 1 || !onednn_allowed()) return at::matmul(q.to(at::kDouble), weight.to(at::kDouble).t()).to(at::kInt);
      return at::_int_mm(q, weight.t());
    };
    if (act_bits == 15) {  // 15-bit activations as two int8 halves (see Int8Linear)
      at::Tensor hi = at::empty({M, quasar::padded_k(K)}, xf.options().dtype(at::kByte));
      at::Tensor lo = at::empty({M, quasar::padded_k(K)}, xf.options().dtype(at::kByte));
      quasar::quantize_rows_split_u8(xf.data_ptr<float>(), M, K, hi.data_ptr<uint8_t>(), lo.data_ptr<uint8_t>(),
                                     sx.data());
      if (small_m) {
        quasar::small_m_gemm_split(hi.data_ptr<uint8_t>(), lo.data_ptr<uint8_t>(), M, K, &seg, 1, sx.data(),
                                   y.data_ptr<float>(), N);
        return finish();
      }
      // s8 halves (both in [-127, 127]), each an exact int32 GEMM
      const auto gemm = [&](const at::Tensor& u) {
        return int_mm(u.narrow(1, 0, K).to(at::kShort).sub_(128).to(at::kChar).contiguous()).to(at::kLong);
      };
      const at::Tensor acc = gemm(hi).mul_(128).add_(gemm(lo)).contiguous();
      epilogue(acc.data_ptr<int64_t>(), N, nullptr, ws.data_ptr<float>(), sx.data(),
               b.defined() ? b.data_ptr<float>() : nullptr, M, N, y.data_ptr<float>(), N);
      return finish();
    }
    if (small_m) {
      at::Tensor q = at::empty({M, quasar::padded_k(K)}, xf.options().dtype(at::kByte));
      quasar::quantize_rows_u8(xf.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), sx.data());
      quasar::small_m_gemm(q.data_ptr<uint8_t>(), M, K, &seg, 1, sx.data(), y.data_ptr<float>(), N);
      return finish();
    }
    at::Tensor acc;
    if (use_u8) {
      at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kByte));
      quantize_rows<uint8_t, 128>(xf.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), sx.data(), K);
      acc = int_mm(q);
    } else {
      at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kChar));
      quantize_rows<int8_t, 0>(xf.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), sx.data(), K);
      acc = int_mm(q);
    }
    if (acc.stride(1) != 1) acc = acc.contiguous();
    epilogue(acc.data_ptr<int32_t>(), acc.stride(0), cmp.defined() ? cmp.data_ptr<int32_t>() : nullptr,
             ws.data_ptr<float>(), sx.data(), b.defined() ? b.data_ptr<float>() : nullptr, M, N,
             y.data_ptr<float>(), N);
  }
  return finish();
}

// The largest M that takes the small-M kernel (default 16, or kTiledMaxRows with AMX; at most
// kTiledMaxRows; 0 disables it); max_m < 0 only reads. Returns the previous value.
int64_t int8_small_m_max(int64_t max_m) {
  const int64_t before = small_m_limit();
  if (max_m >= 0) g_small_m_max.store(std::min(max_m, kTiledMaxRows));
  return before;
}

// The smallest M the small-M kernel computes with AMX on a CPU that has it (default
// kAmxMinRows; 0: never); min_rows < 0 only reads. Returns the previous value.
int64_t int8_amx_min_rows(int64_t min_rows) {
  if (min_rows < 0) return g_amx_min_rows.load();
  return g_amx_min_rows.exchange(min_rows);
}

namespace quasar {
bool prefetch_whole_stream() { return g_stream_prefetch.load(std::memory_order_relaxed) != 0; }
}  // namespace quasar

// Whether one-row passes prefetch their whole stream (1) or only each stream's start (0; see
// quasar::prefetch_whole_stream); mode < 0 only reads. Returns the previous value. Speed
// only: the sums are the same.
int64_t int8_stream_prefetch(int64_t mode) {
  if (mode < 0) return g_stream_prefetch.load();
  return g_stream_prefetch.exchange(mode != 0 ? 1 : 0);
}

// Whether oneDNN's int8 GEMMs are exact here (kernels.py checks it once per process); with a
// value (0 or 1), set it first. While false the small-M kernel takes every M.
bool int8_onednn_exact(int64_t value) {
  if (value >= 0) g_onednn_exact.store(value != 0);
  return g_onednn_exact.load();
}

// Whether this CPU runs the small-M kernel's AMX path (AMX-INT8, and Linux allows it).
bool int8_amx_supported() { return amx_supported(); }

// The weight [N, K] int8 in the small-M kernel's tile layout (quasar::pack_tiles). With
// release_source, the source is handed back to the OS as it is copied, 16 MiB at a time (see
// pack_tiles), so a memory-mapped weight is never resident twice, even while packing.
at::Tensor int8_pack_tiles(const at::Tensor& weight, bool release_source) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "int8_pack_tiles: weight must be a 2-D int8 CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor out = at::empty({quasar::tiled_bytes(n, k)}, w.options());
  if (out.numel() > 0) quasar::pack_tiles(w.data_ptr<int8_t>(), n, k, out.data_ptr<int8_t>(), release_source);
  return out;
}

// Hint the OS to reclaim the pages wholly inside t's bytes (release_span): for a weight read
// from a memory-mapped checkpoint whose kernel copy now lives elsewhere. Returns whether the
// hint was taken (false: nothing to do, or unsupported).
bool release_pages(const at::Tensor& t) {
  return t.device().is_cpu() && quasar::release_span(t.data_ptr(), static_cast<int64_t>(t.nbytes()));
}

// Whether the small-M kernel runs here: on every kernel path (the portable one included).
bool int8_small_m_supported() { return true; }

// The active kernel path's name (cpu_features.h); with a name, first cap the path there
// (the highest path at or below it that this CPU runs). Names: portable, avx2, avx-vnni,
// avx512-vnni, amx.
std::string kernel_path_op(const std::string& cap) {
  if (!cap.empty()) {
    int found = -1;
    for (int p = 0; p < quasar::kNumKernelPaths; ++p)
      if (cap == quasar::kernel_path_name(static_cast<quasar::KernelPath>(p))) found = p;
    TORCH_CHECK(found >= 0, "unknown kernel path '", cap, "'");
    quasar::set_kernel_path(static_cast<quasar::KernelPath>(found));
  }
  return quasar::kernel_path_name(quasar::kernel_path());
}

// Whether this CPU can run kernel path `name`.
bool cpu_runs_path(const std::string& name) {
  for (int p = 0; p < quasar::kNumKernelPaths; ++p)
    if (name == quasar::kernel_path_name(static_cast<quasar::KernelPath>(p)))
      return quasar::cpu_runs(static_cast<quasar::KernelPath>(p));
  TORCH_CHECK(false, "unknown kernel path '", name, "'");
}

// How many distinct threads one at::parallel_for of this library runs on. at::parallel_for
// is a header template: its OpenMP pragma is compiled here, so a build without -fopenmp
// silently runs every "parallel" loop of these ops on one thread; tests check this.
int64_t parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 4096, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() & 63));
  });
  return __builtin_popcountll(seen.load());
}

TORCH_LIBRARY(quasar_quant, m) {
  m.def(
      "int8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, Tensor? comp, "
      "bool u8_single, bool u8_multi, Tensor? tiles=None, int act_bits=8) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(int8_linear));
  m.def("int8_pack_tiles(Tensor weight, bool release_source=False) -> Tensor", &int8_pack_tiles);
  m.def("release_pages(Tensor t) -> bool", &release_pages);
  m.def("int8_small_m_max(int max_m=-1) -> int", &int8_small_m_max);
  m.def("int8_small_m_supported() -> bool", &int8_small_m_supported);
  m.def("int8_amx_min_rows(int min_rows=-1) -> int", &int8_amx_min_rows);
  m.def("int8_stream_prefetch(int mode=-1) -> int", &int8_stream_prefetch);
  m.def("int8_amx_supported() -> bool", &int8_amx_supported);
  m.def("parallel_threads() -> int", &parallel_threads);
  m.def("int8_onednn_exact(int value=-1) -> bool", &int8_onednn_exact);
  m.def("kernel_path(str cap=\"\") -> str", &kernel_path_op);
  m.def("cpu_runs_path(str name) -> bool", &cpu_runs_path);
}
