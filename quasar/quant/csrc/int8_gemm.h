// Shared between int8_linear.cpp (which defines these) and decoder_layer.cpp.
#pragma once

#include <cstdint>

namespace quasar {

// One weight matrix of a small-M GEMM: w [n, K] int8, comp = 128 * rowsum(w) int32 [n],
// ws float [n], optional bias [n]; its outputs go to columns [y_col, y_col + n).
struct Int8Segment {
  const int8_t* w;
  int64_t n;
  const int32_t* comp;
  const float* ws;
  const float* bias;
  int64_t y_col;
};

// True when this CPU runs the AVX512-VNNI small-M kernel.
bool cpu_has_vnni();

// Per-row dynamic int8 quantization of x [M, K] as uint8 (q + 128), scales into sx [M];
// the same bits as quantize_activation in quasar/quant/int8.py.
void quantize_rows_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx);

// y[m, seg.y_col + n] = ((float(xu[m] . w[n] - comp[n]) * ws[n]) * sx[m]) + bias[n] for
// every segment and 1 <= M <= 16 rows (VNNI CPUs only); bitwise Int8Linear's result.
void small_m_gemm(const uint8_t* xu, int64_t M, int64_t K, const Int8Segment* segs, int64_t n_segs,
                  const float* sx, float* y, int64_t y_stride);

// 15-bit activations (|q| <= 16383, scale amax / 16383, as quantize_activation(x, 15)) split
// as q = 128 * hi + lo: hi + 128 and lo + 128 as uint8 [M, K] each.
void quantize_rows_split_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo, float* sx);

// small_m_gemm for split 15-bit activations: the int32 products of hi and lo (each exact)
// combined as 128 * hi + lo in int64, then the same epilogue; bitwise Int8Linear's result
// with act_bits = 15.
void small_m_gemm_split(const uint8_t* xhi, const uint8_t* xlo, int64_t M, int64_t K, const Int8Segment* segs,
                        int64_t n_segs, const float* sx, float* y, int64_t y_stride);

}  // namespace quasar
