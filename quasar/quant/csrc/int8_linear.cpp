// Fused W8A8 linear for the `cpu` int8 backend (see quasar/quant/int8.py and ext.py).
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
// summed into each int32 lane): each 64-byte chunk of a weight row [N, K] is loaded once
// and multiplied with the same chunk of all M activation rows (x + 128 as uint8, in L1),
// then 128 * rowsum(W) ("comp") is subtracted. Integer sums are exact (vpdpbusd wraps,
// never saturates, and the wrapped sum minus comp is the true value, which fits in int32
// for K <= MAX_IN_FEATURES), so the int32s, and with the unchanged epilogue the outputs,
// are bitwise those of the oneDNN path. Only that function is compiled for AVX512 (target
// attribute: no global -march); it is picked at run time when the CPU has AVX512-VNNI.

#include "int8_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define QUASAR_VNNI_KERNEL 1
#include <immintrin.h>
#define QUASAR_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#endif

namespace {

inline uint32_t float_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline float bits_float(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// max |r[k]|: the bit patterns of non-negative floats order like the values, and NaN's
// sort above +inf, so an integer max (which vectorizes) is exact and propagates NaN.
float row_absmax(const float* r, int64_t k_len) {
  uint32_t m = 0;
  for (int64_t k = 0; k < k_len; ++k) {
    uint32_t b = float_bits(r[k]) & 0x7fffffffu;
    m = b > m ? b : m;
  }
  return bits_float(m);
}

// Round half to even for |v| < 2**22 in the default rounding mode (|x / s_x| <= 127 here):
// adding 1.5 * 2**23 leaves no fraction bits. Same result as std::nearbyint / torch.round,
// but it vectorizes on any SSE2 / NEON target.
inline int32_t round_to_int(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23
  float r = (v + kMagic) - kMagic;
  return r == r ? static_cast<int32_t>(r) : 0;  // NaN (inf / inf, NaN input) -> 0
}

// A row's activation scale, as quantize_activation computes it for |q| <= limit (127, or
// 16383 for 15 bits): amax.clamp_min_(limit * 1e-12).div_(limit), the double scalars cast
// to float; NaN propagates.
inline float row_scale(const float* r, int64_t k_len, double limit) {
  const float min_amax = static_cast<float>(limit * 1e-12);
  const float amax = row_absmax(r, k_len);
  return (amax == amax ? (amax < min_amax ? min_amax : amax) : amax) / static_cast<float>(limit);
}

template <typename Q, int32_t kOffset>
void quantize_rows(const float* x, int64_t m_len, int64_t k_len, Q* q, float* sx) {
  for (int64_t m = 0; m < m_len; ++m) {
    const float* r = x + m * k_len;
    const float s = row_scale(r, k_len, 127.0);
    sx[m] = s;
    Q* o = q + m * k_len;
    for (int64_t k = 0; k < k_len; ++k) o[k] = static_cast<Q>(round_to_int(r[k] / s) + kOffset);
  }
}

// y = ((float(acc - comp) * ws) * sx) + bias, one row at a time, each operation rounded
// separately (no contraction), exactly as scale_output's torch.mul / mul_ / add_.
template <typename Acc, bool kComp, bool kBias>
void epilogue_rows(const Acc* acc, int64_t acc_stride, const int32_t* comp, const float* ws,
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
void epilogue(const Acc* acc, int64_t acc_stride, const int32_t* comp, const float* ws,
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

// ---------------------------------------------------------------- small-M VNNI GEMM
constexpr int64_t kSmallMaxM = 8;  // rows one vnni_tile pass computes
constexpr int64_t kSmallMaxRows = 2 * kSmallMaxM;  // rows small_m_gemm takes (two passes)
// Largest M sent to small_m_gemm (0 disables it); settable for benchmarks and tests.
std::atomic<int64_t> g_small_m_max{kSmallMaxRows};

bool vnni_supported() {
#ifdef QUASAR_VNNI_KERNEL
  // libgcc also checks that the OS saves the AVX512 state (XCR0).
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

#ifdef QUASAR_VNNI_KERNEL
// How far ahead of the rows being read to prefetch weights, in bytes: rows are short
// (K bytes), so the hardware prefetcher never ramps up; ~8 KiB ahead covers DRAM latency
// at this kernel's rate (4-8 KiB ahead measured best on the development machine).
constexpr int64_t kPrefetchBytes = 8192;
// The 16 int32 lanes of each of a0..a3 summed: [sum a0, sum a1, sum a2, sum a3].
QUASAR_VNNI inline __m128i reduce4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  // per 128-bit lane: [a0, a1, a2, a3] partial sums
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// out[m * ldo + j] = sum_k xu[m * K + k] * w[j * K + k] for m < M, j < NB (wrapping int32).
// One loop with masked loads (lanes past K read as 0 and never fault) and the reduction
// through memory: GCC keeps the accumulators in registers only in this shape.
template <int M, int NB>
QUASAR_VNNI inline void vnni_tile(const uint8_t* xu, int64_t K, const int8_t* w, int32_t* out,
                                  int64_t ldo) {
  __m512i acc[M][NB];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~0ULL : ~0ULL >> (64 - (K - k));
    __m512i wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi8(mask, w + j * K + k);
    // The lines kPrefetchBytes further on (prefetches never fault past the end).
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + kPrefetchBytes), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mask, xu + m * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], xv, wv[j]);
    }
  }
  alignas(64) int32_t buf[M * NB * 16];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) _mm512_store_si512(buf + (m * NB + j) * 16, acc[m][j]);
  for (int m = 0; m < M; ++m) {
    const int32_t* b = buf + m * NB * 16;
    int j = 0;
    for (; j + 4 <= NB; j += 4)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + m * ldo + j),
                       reduce4(_mm512_load_si512(b + j * 16), _mm512_load_si512(b + j * 16 + 16),
                               _mm512_load_si512(b + j * 16 + 32),
                               _mm512_load_si512(b + j * 16 + 48)));
    for (; j < NB; ++j) out[m * ldo + j] = _mm512_reduce_add_epi32(_mm512_load_si512(b + j * 16));
  }
}

// Weight rows [n0, n1) against M activation rows: out[m * ldo + (n - n0)].
template <int M>
QUASAR_VNNI void vnni_rows(const uint8_t* xu, int64_t K, const int8_t* w, int64_t n0, int64_t n1,
                           int32_t* out, int64_t ldo) {
  // NB weight rows per tile: M * NB accumulators stay in the 32 zmm registers.
  constexpr int NB = M <= 3 ? 8 : M == 4 ? 6 : M <= 6 ? 4 : 3;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) vnni_tile<M, NB>(xu, K, w + n * K, out + (n - n0), ldo);
  for (; n < n1; ++n) vnni_tile<M, 1>(xu, K, w + n * K, out + (n - n0), ldo);
}

void vnni_dispatch(int64_t M, const uint8_t* xu, int64_t K, const int8_t* w, int64_t n0, int64_t n1,
                   int32_t* out, int64_t ldo) {
  switch (M) {
    case 1: return vnni_rows<1>(xu, K, w, n0, n1, out, ldo);
    case 2: return vnni_rows<2>(xu, K, w, n0, n1, out, ldo);
    case 3: return vnni_rows<3>(xu, K, w, n0, n1, out, ldo);
    case 4: return vnni_rows<4>(xu, K, w, n0, n1, out, ldo);
    case 5: return vnni_rows<5>(xu, K, w, n0, n1, out, ldo);
    case 6: return vnni_rows<6>(xu, K, w, n0, n1, out, ldo);
    case 7: return vnni_rows<7>(xu, K, w, n0, n1, out, ldo);
    case 8: return vnni_rows<8>(xu, K, w, n0, n1, out, ldo);
    default: TORCH_CHECK(false, "int8_linear: small-M kernel called with M = ", M);
  }
}
#endif

}  // namespace

namespace quasar {

bool cpu_has_vnni() { return vnni_supported(); }

void quantize_rows_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx) {
  quantize_rows<uint8_t, 128>(x, m_len, k_len, q, sx);
}

}  // namespace quasar

namespace {

// The small-M GEMM over all segments: output columns cut into chunks spread over the
// intra-op threads (one parallel region for q, k and v together); each chunk runs its
// own epilogue (elementwise, so the split never changes a bit). Rows past 8 are a second
// pass over the chunk's weights while they are still in cache, not a second read from
// memory. kSplit: the activations are 15-bit, q = 128 * hi + lo, given as two uint8
// arrays (hi + 128, lo + 128); both products are exact int32s, combined in int64.
template <bool kSplit>
void small_m_rows(const uint8_t* xu, const uint8_t* xlo, int64_t M, int64_t K, const quasar::Int8Segment* segs,
                  int64_t n_segs, const float* sx, float* y, int64_t y_stride) {
#ifdef QUASAR_VNNI_KERNEL
  TORCH_CHECK(M >= 1 && M <= kSmallMaxRows, "int8 small-M GEMM called with M = ", M);
  constexpr int64_t kChunk = 64;
  int64_t first[8 + 1] = {0};  // chunk index where segment s starts
  TORCH_CHECK(n_segs >= 1 && n_segs <= 8, "int8 small-M GEMM: 1..8 segments");
  for (int64_t s = 0; s < n_segs; ++s) first[s + 1] = first[s] + (segs[s].n + kChunk - 1) / kChunk;
  // A task reads at least ~64 KiB of weights: less does not pay for waking a thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kChunk * K));
  at::parallel_for(0, first[n_segs], grain, [&](int64_t c0, int64_t c1) {
    int32_t acc[kSmallMaxRows * kChunk];
    int32_t acc_lo[kSplit ? kSmallMaxRows * kChunk : 1];
    int64_t s = 0;
    for (int64_t c = c0; c < c1; ++c) {
      while (c >= first[s + 1]) ++s;
      const quasar::Int8Segment& g = segs[s];
      const int64_t n0 = (c - first[s]) * kChunk, n_len = std::min(g.n - n0, kChunk);
      for (int64_t r = 0; r < M; r += kSmallMaxM) {
        vnni_dispatch(std::min(kSmallMaxM, M - r), xu + r * K, K, g.w, n0, n0 + n_len, acc + r * kChunk,
                      kChunk);
        if (kSplit)
          vnni_dispatch(std::min(kSmallMaxM, M - r), xlo + r * K, K, g.w, n0, n0 + n_len,
                        acc_lo + r * kChunk, kChunk);
      }
      const auto take_comp = [&](int32_t* a) {  // modular: exact once comp is taken off
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = 0; j < n_len; ++j)
            a[m * kChunk + j] = static_cast<int32_t>(static_cast<uint32_t>(a[m * kChunk + j]) -
                                                     static_cast<uint32_t>(g.comp[n0 + j]));
      };
      take_comp(acc);
      if (kSplit) {  // 128 * hi + lo in int64, then the same epilogue as scale_output's
        take_comp(acc_lo);
        int64_t wide[kSmallMaxRows * kChunk];
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = 0; j < n_len; ++j)
            wide[m * kChunk + j] = int64_t{acc[m * kChunk + j]} * 128 + acc_lo[m * kChunk + j];
        epilogue(wide, kChunk, nullptr, g.ws + n0, sx, g.bias ? g.bias + n0 : nullptr, M, n_len,
                 y + g.y_col + n0, y_stride);
        continue;
      }
      epilogue(acc, kChunk, nullptr, g.ws + n0, sx, g.bias ? g.bias + n0 : nullptr, M, n_len,
               y + g.y_col + n0, y_stride);
    }
  });
#else
  TORCH_CHECK(false, "int8_linear: small-M kernel not compiled in");
#endif
}

}  // namespace

namespace quasar {

// y[m * y_stride + seg.y_col + n] = epilogue(xu [M, K] (uint8, q + 128) x seg.w [N, K]^T
// - comp) for every segment, 1 <= M <= 16 (see small_m_rows).
void small_m_gemm(const uint8_t* xu, int64_t M, int64_t K, const Int8Segment* segs, int64_t n_segs,
                  const float* sx, float* y, int64_t y_stride) {
  small_m_rows<false>(xu, nullptr, M, K, segs, n_segs, sx, y, y_stride);
}

void small_m_gemm_split(const uint8_t* xhi, const uint8_t* xlo, int64_t M, int64_t K, const Int8Segment* segs,
                        int64_t n_segs, const float* sx, float* y, int64_t y_stride) {
  small_m_rows<true>(xhi, xlo, M, K, segs, n_segs, sx, y, y_stride);
}

void quantize_rows_split_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo, float* sx) {
  for (int64_t m = 0; m < m_len; ++m) {
    const float* r = x + m * k_len;
    const float s = row_scale(r, k_len, 16383.0);
    sx[m] = s;
    for (int64_t k = 0; k < k_len; ++k) {
      const int32_t q = round_to_int(r[k] / s);  // |q| <= 16383
      hi[m * k_len + k] = static_cast<uint8_t>((q >> 7) + 128);  // floor(q / 128)
      lo[m * k_len + k] = static_cast<uint8_t>((q & 127) + 128);
    }
  }
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
// valid comp takes the hand-written small_m_gemm instead, whatever the flags say.
// act_bits = 15: 15-bit activations split as 128 * hi + lo, two exact int8 GEMMs combined
// in int64 (small_m_gemm_split, or oneDNN's s8 x s8 twice), the same epilogue.
// Returns [..., N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& comp, bool u8_single, bool u8_multi,
                       int64_t act_bits) {
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
    // Small M on an AVX512-VNNI CPU: the hand-written kernel (same int32s, same epilogue).
    const bool small_m = M <= g_small_m_max.load(std::memory_order_relaxed) && vnni_supported() &&
                         comp.has_value() && comp->defined() && comp->scalar_type() == at::kInt &&
                         comp->numel() == N;
    at::Tensor c, wc;
    quasar::Int8Segment seg{};
    if (small_m) {
      c = comp->contiguous();
      wc = weight.contiguous();
      seg = {wc.data_ptr<int8_t>(), N, c.data_ptr<int32_t>(), ws.data_ptr<float>(),
             b.defined() ? b.data_ptr<float>() : nullptr, 0};
    }
    if (act_bits == 15) {  // 15-bit activations as two int8 halves (see Int8Linear)
      at::Tensor hi = at::empty({M, K}, xf.options().dtype(at::kByte));
      at::Tensor lo = at::empty({M, K}, xf.options().dtype(at::kByte));
      quasar::quantize_rows_split_u8(xf.data_ptr<float>(), M, K, hi.data_ptr<uint8_t>(), lo.data_ptr<uint8_t>(),
                                     sx.data());
      if (small_m) {
        quasar::small_m_gemm_split(hi.data_ptr<uint8_t>(), lo.data_ptr<uint8_t>(), M, K, &seg, 1, sx.data(),
                                   y.data_ptr<float>(), N);
        return finish();
      }
      // s8 halves (hi in [-128, 127], lo in [0, 127]), each an exact int32 GEMM
      const auto gemm = [&](const at::Tensor& u) {
        const at::Tensor q = u.to(at::kShort).sub_(128).to(at::kChar);
        return K == 1 ? at::matmul(q.to(at::kLong), weight.to(at::kLong).t())
                      : at::_int_mm(q, weight.t()).to(at::kLong);
      };
      const at::Tensor acc = gemm(hi).mul_(128).add_(gemm(lo)).contiguous();
      epilogue(acc.data_ptr<int64_t>(), N, nullptr, ws.data_ptr<float>(), sx.data(),
               b.defined() ? b.data_ptr<float>() : nullptr, M, N, y.data_ptr<float>(), N);
      return finish();
    }
    if (small_m) {
      at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kByte));
      quantize_rows<uint8_t, 128>(xf.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), sx.data());
      quasar::small_m_gemm(q.data_ptr<uint8_t>(), M, K, &seg, 1, sx.data(), y.data_ptr<float>(), N);
      return finish();
    }
    at::Tensor acc;
    if (use_u8) {
      at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kByte));
      quantize_rows<uint8_t, 128>(xf.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), sx.data());
      // torch 2.13's CPU _int_mm is wrong for K == 1; the integer product is exact anyway.
      acc = K == 1 ? at::matmul(q.to(at::kLong), weight.to(at::kLong).t()).to(at::kInt)
                   : at::_int_mm(q, weight.t());
    } else {
      at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kChar));
      quantize_rows<int8_t, 0>(xf.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), sx.data());
      acc = K == 1 ? at::matmul(q.to(at::kLong), weight.to(at::kLong).t()).to(at::kInt)
                   : at::_int_mm(q, weight.t());
    }
    if (acc.stride(1) != 1) acc = acc.contiguous();
    epilogue(acc.data_ptr<int32_t>(), acc.stride(0), cmp.defined() ? cmp.data_ptr<int32_t>() : nullptr,
             ws.data_ptr<float>(), sx.data(), b.defined() ? b.data_ptr<float>() : nullptr, M, N,
             y.data_ptr<float>(), N);
  }
  return finish();
}

// The largest M that takes the small-M kernel (1..16; 0 disables it); max_m < 0 only reads.
// Returns the previous value.
int64_t int8_small_m_max(int64_t max_m) {
  if (max_m < 0) return g_small_m_max.load();
  return g_small_m_max.exchange(std::min(max_m, kSmallMaxRows));
}

// Whether this CPU runs the small-M kernel (AVX512-VNNI, and the kernel compiled in).
bool int8_small_m_supported() { return vnni_supported(); }

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
      "bool u8_single, bool u8_multi, int act_bits=8) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(int8_linear));
  m.def("int8_small_m_max(int max_m=-1) -> int", &int8_small_m_max);
  m.def("int8_small_m_supported() -> bool", &int8_small_m_supported);
  m.def("parallel_threads() -> int", &parallel_threads);
}
