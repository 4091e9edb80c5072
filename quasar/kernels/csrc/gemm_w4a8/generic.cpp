// The W4A8 GEMM written once: activation quantization, the portable kernel, the choice of a
// kernel path's kernel and the driver that runs it over the output vectors (the ops are in
// linear_op.cpp; the x86 kernels in x86_avx2.cpp and x86_avx512.cpp). The numbers
// are quasar/runtime/w4a8_numerics.py's (reference_linear_w4a8), bit for bit, on every path:
//   activations per row and group: sx = max(amax, float(127 * 1e-12)) / 127,
//     q = round_half_even(x / sx) (a true division), X = sum of q, xs = float(X) * sx
//   S = exact int32 sum of q_w * q_x per group
//   acc = 0; acc = (acc + (float(S) * sx) * scale) + xs * offset for each group in order;
//   y = acc + bias
// Each row is computed alone (its sums are exact and its float operations never involve
// another row), so a row's output does not depend on M. Layout and kernels: w4a8_gemm.h.
#include "common/activation_quant.h"
#include "gemm_w4a8/w4a8_gemm.h"
#include "gemm_w8a8/int8_gemm.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace quasar {

void w4_group_params(const uint8_t* vec, int64_t g, int64_t form, float* scale, float* offset) {
  uint16_t sc[kW4Lanes], of[kW4Lanes];
  if (!w4_superblocks(form)) {
    const uint8_t* p = vec + g * w4_group_bytes(form) + 8 * form;
    std::memcpy(sc, p, sizeof sc);
    std::memcpy(of, p + sizeof sc, sizeof of);
    for (int64_t i = 0; i < kW4Lanes; ++i) {  // c10's exact half -> float: vcvtph2ps's value
      scale[i] = c10::detail::fp16_ieee_to_fp32_value(sc[i]);
      offset[i] = c10::detail::fp16_ieee_to_fp32_value(of[i]);
    }
    return;
  }
  const uint8_t* h = w4_superblock(vec, g / kW4SuperGroups, form);
  std::memcpy(sc, h, sizeof sc);
  std::memcpy(of, h + sizeof sc, sizeof of);
  for (int64_t i = 0; i < kW4Lanes; ++i) {  // exact: 11 significant bits times at most 6
    uint8_t c, o;
    w4_q4k_lane_codes(h, g, i, &c, &o);
    scale[i] = c10::detail::fp16_ieee_to_fp32_value(sc[i]) * static_cast<float>(c);
    offset[i] = c10::detail::fp16_ieee_to_fp32_value(of[i]) * static_cast<float>(o);
  }
}

namespace {

// The Q6_K form (w4a8_gemm.h): per group the half sums S_a, S_b of 6-bit weights, T, and
// acc = acc + (float(T) * sx) * d.
void q6k_rows_portable(const uint8_t* vec, int64_t K, const W4Acts& a, int64_t rows, float* out) {
  const int64_t groups = K / 32;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kW4Lanes] = {};
    const int8_t* xr = a.q + r * a.ldq;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w4_group_nibbles(vec, g, kW4Q6K);
      const uint8_t* h = w4_superblock(vec, g / kW4SuperGroups, kW4Q6K);
      const int8_t* sub = reinterpret_cast<const int8_t*>(w4_q6k_scales(vec, g));
      int32_t s[2][kW4Lanes] = {};
      for (int64_t st = 0; st < 4; ++st) {
        const uint8_t* c = p + 64 * st;
        const uint8_t* hb = p + 256 + 64 * (st / 2);
        const int shift = 4 * (st % 2);
        const int8_t* x = xr + g * 32 + 8 * st;
        for (int64_t i = 0; i < kW4Lanes; ++i)
          for (int j = 0; j < 4; ++j) {
            const int32_t b = c[4 * i + j], hi = hb[4 * i + j] >> shift;
            const int32_t lo6 = (b & 15) | (hi & 3) << 4, hi6 = (b >> 4) | (hi >> 2 & 3) << 4;
            s[st / 2][i] += lo6 * int32_t{x[j]} + hi6 * int32_t{x[4 + j]};
          }
      }
      uint16_t d[kW4Lanes];
      std::memcpy(d, h, sizeof d);
      const float sx = a.sx[r * a.ldg + g];
      const int32_t xa = a.xh[r * 2 * a.ldg + 2 * g], xb = a.xh[r * 2 * a.ldg + 2 * g + 1];
      for (int64_t i = 0; i < kW4Lanes; ++i) {
        const int32_t t = sub[i] * (s[0][i] - 32 * xa) + sub[kW4Lanes + i] * (s[1][i] - 32 * xb);
        acc[i] = acc[i] + (static_cast<float>(t) * sx) * c10::detail::fp16_ieee_to_fp32_value(d[i]);
      }
    }
    std::memcpy(out + r * kW4Lanes, acc, sizeof acc);
  }
}

}  // namespace

// Plain C++, the same sums and order as the SIMD kernels. Per step the inner loop is a 4-way
// u8 x s8 dot product for each of 16 lanes, once for the low nibbles and once for the high:
// where a NEON `udot`/`usdot` over the unpacked nibbles (vandq / vshrq) would slot in.
void w4_rows_portable(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                      int64_t /*ahead: no prefetch here*/) {
  if (w4_is_q6k(form)) return q6k_rows_portable(vec, K, a, rows, out);
  const int64_t group = w4_group_size(form), groups = K / group, steps = group / 8;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kW4Lanes] = {};
    const int8_t* xr = a.q + r * a.ldq;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w4_group_nibbles(vec, g, form);
      int32_t s[kW4Lanes] = {};
      for (int64_t st = 0; st < steps; ++st) {
        const uint8_t* c = p + 64 * st;
        const int8_t* x = xr + g * group + 8 * st;
        for (int64_t i = 0; i < kW4Lanes; ++i) {
          int32_t sum = 0;
          for (int j = 0; j < 4; ++j) {
            const int32_t b = c[4 * i + j];
            sum += (b & 15) * int32_t{x[j]} + (b >> 4) * int32_t{x[4 + j]};
          }
          s[i] += sum;
        }
      }
      float sc[kW4Lanes], of[kW4Lanes];
      w4_group_params(vec, g, form, sc, of);
      const float sx = a.sx[r * a.ldg + g], xs = a.xs[r * a.ldg + g];
      for (int64_t i = 0; i < kW4Lanes; ++i) acc[i] = (acc[i] + (static_cast<float>(s[i]) * sx) * sc[i]) + xs * of[i];
    }
    std::memcpy(out + r * kW4Lanes, acc, sizeof acc);
  }
}

// ------------------------------------------------------------------ kernel choice
namespace {

// Paths whose W4A8 kernel the self-check found wrong (bit p: KernelPath p); the op then runs
// the highest path below the active one that the CPU runs and is not disabled.
std::atomic<int> g_w4_disabled{0};

bool w4_path_usable(KernelPath p) {
  return cpu_runs(p) && !(g_w4_disabled.load(std::memory_order_relaxed) & (1 << static_cast<int>(p)));
}

}  // namespace

int w4_path_for(KernelPath p) {
  if (p == KernelPath::kAmx) p = KernelPath::kAvx512Vnni;
  for (int i = static_cast<int>(p); i >= 0; --i)
    if (w4_path_usable(static_cast<KernelPath>(i))) return i;
  return -1;
}

W4RowsFn w4_kernel(KernelPath p) {
  switch (p) {
    case KernelPath::kAmx:
    case KernelPath::kAvx512Vnni: return w4_rows_avx512_vnni;
    case KernelPath::kAvxVnni: return w4_rows_avx_vnni;
    case KernelPath::kAvx2: return w4_rows_avx2;
    case KernelPath::kPortable: return w4_rows_portable;
  }
  return w4_rows_portable;
}

namespace {
std::atomic<int64_t> g_prefetch_bytes{kW4PrefetchDefault};
}  // namespace

int64_t w4_prefetch_bytes() { return g_prefetch_bytes.load(std::memory_order_relaxed); }

int64_t w4_set_prefetch_bytes(int64_t bytes) { return g_prefetch_bytes.exchange(bytes); }

int64_t w4_max_rows(KernelPath path) {
  switch (path) {
    case KernelPath::kAmx:
    case KernelPath::kAvx512Vnni: return kW4MaxRows;
    case KernelPath::kAvxVnni: return kAvxVnniRows;
    case KernelPath::kAvx2: return kAvx2Rows;
    case KernelPath::kPortable: return kW4MaxRows;
  }
  return 1;
}

void w4_disable_path(KernelPath p) { g_w4_disabled.fetch_or(1 << static_cast<int>(p)); }

// quantize_activation_groups for x [M, K] (K a multiple of group): q int8 [M, K], sx and xs
// [M, K / group]; each group quantized as the int8 linear quantizes a row (activation_quant.h).
// From the AVX2 path up, w4_quantize_groups_avx2 gives the same bits faster.
void w4_quantize_groups(const float* x, int64_t M, int64_t K, int64_t group, int8_t* q, float* sx, float* xs,
                        int32_t* xh, KernelPath path) {
  if (path_at_least(path, KernelPath::kAvx2)) return w4_quantize_groups_avx2(x, M, K, group, q, sx, xs, xh);
  const int64_t groups = K / group;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* r = x + m * K + g * group;
      const float s = row_scale(r, group, 127.0);
      int32_t half[2] = {};
      int8_t* o = q + m * K + g * group;
      for (int h = 0; h < 2; ++h) {  // a loop a half: each sums into one register
        int32_t sum = 0;
        for (int64_t k = h * group / 2; k < (h + 1) * group / 2; ++k) {
          const int32_t v = round_to_int(r[k] / s);
          o[k] = static_cast<int8_t>(v);
          sum += v;
        }
        half[h] = sum;
      }
      sx[m * groups + g] = s;
      xs[m * groups + g] = static_cast<float>(half[0] + half[1]) * s;
      xh[m * 2 * groups + 2 * g] = half[0];
      xh[m * 2 * groups + 2 * g + 1] = half[1];
    }
}

W4RowsFn w4_active_kernel(KernelPath path, int64_t* max_rows) {
  const int p = w4_path_for(path);
  if (p < 0) return nullptr;
  *max_rows = w4_max_rows(static_cast<KernelPath>(p));
  return w4_kernel(static_cast<KernelPath>(p));
}

void w4_vector_rows(W4RowsFn kernel, int64_t max_rows, const uint8_t* vec, int64_t K, int64_t form,
                    const W4Acts& a, int64_t M, int64_t lanes, const float* bias, float* y, int64_t y_stride,
                    bool prefetch) {
  float out[kW4MaxRows * kW4Lanes];
  for (int64_t r0 = 0; r0 < M; r0 += max_rows) {  // the first pass reads the vector, later ones hit cache
    const int64_t rows = std::min(max_rows, M - r0);
    const W4Acts acts{a.q + r0 * a.ldq, a.ldq, a.sx + r0 * a.ldg, a.xs + r0 * a.ldg, a.ldg, a.xh + r0 * 2 * a.ldg};
    kernel(vec, K, form, acts, rows, out, r0 == 0 && (prefetch || M > 1) ? w4_prefetch_bytes() : 0);
    for (int64_t r = 0; r < rows; ++r) {
      float* yr = y + (r0 + r) * y_stride;
      const float* o = out + r * kW4Lanes;
      if (bias)
        for (int64_t i = 0; i < lanes; ++i) yr[i] = o[i] + bias[i];
      else
        std::memcpy(yr, o, lanes * sizeof(float));
    }
  }
}

}  // namespace quasar
