// The int8 GEMM's internals, shared by its files (generic.cpp, x86_avx512.cpp, linear_op.cpp
// and ../amx/gemm.cpp): which x86 kernels this compiler builds, the quantizers and the epilogue
// written once, the tile sums of the paths int8_gemm.h does not declare, and the process-wide
// settings the int8 ops read.
#pragma once

#include "common/activation_quant.h"
#include "gemm_w8a8/int8_gemm.h"

#include <atomic>
#include <cstdint>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define QUASAR_VNNI_KERNEL 1
#if defined(__linux__) && defined(__x86_64__) && (__GNUC__ >= 11 || defined(__clang__))
#define QUASAR_AMX_KERNEL 1
#endif
#endif

namespace quasar {

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
  const int64_t ldq = padded_k(k_len);
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

// One chunk's outputs from its sums acc [M, kTile] (and acc_lo for 15-bit activations,
// combined as 128 * hi + lo in int64 into wide): comp taken off where the sums are of the
// u8 activations (`offset`: the VNNI, AMX and AVX-VNNI kernels), then the epilogue, into
// columns [g.y_col + n0, + n_len) of y.
template <bool kSplit>
QUASAR_INLINE void finish_chunk(int32_t* acc, int32_t* acc_lo, int64_t* wide, int64_t M, int64_t n_len,
                                const Int8Segment& g, int64_t n0, const float* sx, float* y,
                                int64_t y_stride, bool offset) {
  constexpr int64_t kChunk = kTile;
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

// finish_chunk compiled for one ISA (kSplit: 15-bit activations).
using FinishFn = void (*)(int32_t*, int32_t*, int64_t*, int64_t, int64_t, const Int8Segment&, int64_t, const float*,
                          float*, int64_t, bool);

// ---------------------------------------------------------------- settings
constexpr int64_t kSmallMaxRows = 16;  // rows int8_linear sends to small_m_gemm by default
// Rows small_m_gemm takes: every row passes over a weight tile while it is in L2, so many
// rows (a prefill chunk) read the weights from memory once, not once per 16 rows. With AMX
// int8_linear sends it all of these by default: faster than oneDNN over the whole range.
constexpr int64_t kTiledMaxRows = 128;
// AMX (the AMX-INT8 tile instructions): the same u8 x s8 -> int32 sums from tile matrix
// multiplies, 16 rows x 16 outputs x 64 weights in one tdpbusd, at about ten times VNNI's
// products a cycle per core, so a step's extra rows (drafts, batched sequences, prefill
// chunks) cost little more than its first. Used for M >= Int8Settings::amx_min_rows.
constexpr int64_t kAmxMinRows = 2;

// The process-wide settings of the int8 ops (linear_op.cpp reads and sets them for Python).
struct Int8Settings {
  // Largest M int8_linear sends to small_m_gemm (0 disables it; -1: the default, see
  // small_m_limit in linear_op.cpp); settable for benchmarks and tests.
  std::atomic<int64_t> small_m_max{-1};
  // The smallest M the small-M GEMM computes with AMX where the CPU has it (0: never).
  std::atomic<int64_t> amx_min_rows{kAmxMinRows};
  // prefetch_whole_stream (int8_gemm.h): 1, the default, or 0. Which is faster depends on the
  // CPU: int8_stream_prefetch sets it from a measurement (step_cost.py). In the int8 kernels
  // steps of more rows always prefetch: their streaming pass alternates with passes that
  // fetch ahead in software, which the hardware prefetcher does not follow.
  std::atomic<int64_t> stream_prefetch{1};
  // Whether oneDNN's int8 GEMM is exact here (kernels.py checks it once per process).
  std::atomic<bool> onednn_exact{true};
};
Int8Settings& int8_settings();

// The AVX512-VNNI kernel and the AVX512-compiled quantizers run on the avx512-vnni and amx
// paths (where the compiler builds them).
bool vnni_supported(KernelPath path);
// The AMX kernel runs on the amx path (the CPU has AMX-INT8 and Linux lets this process use
// the tile data state: cpu_runs, cpu_features.cpp).
bool amx_supported(KernelPath path);

// ---------------------------------------------------------------- per-path kernels
// The AVX512 path (x86_avx512.cpp): tile_rows' contract (int8_gemm.h) with 512-bit
// vpdpbusd, u8 x s8 (comp still to take off); the quantizers and finish_chunk compiled for
// AVX512 (elementwise IEEE operations: the same bits as the baseline ones).
void tile_rows_avx512(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0,
                      int64_t nv, int32_t* acc);
void quantize_u8_avx512(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx);
void quantize_split_avx512(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo, float* sx);
FinishFn finish_chunk_avx512(bool split);

// The AMX path (../amx/gemm.cpp): the same sums with tile multiplies. `configured` is the
// (rows A, rows B) the calling thread's tiles are set up for, packed as 64 * A + B (0: not
// yet); it is updated there. amx_release hands the tiles back at the end of a thread's run.
void tile_rows_amx(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0, int64_t nv,
                   int32_t* acc, int64_t& configured);
void amx_release();

}  // namespace quasar
