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

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename Q, int32_t kOffset>
void quantize_rows(const float* x, int64_t m_len, int64_t k_len, Q* q, float* sx) {
  // torch: amax.clamp_min_(127.0 * 1e-12).div_(127.0) with the double scalar cast to float.
  const float min_amax = static_cast<float>(127.0 * 1e-12);
  for (int64_t m = 0; m < m_len; ++m) {
    const float* r = x + m * k_len;
    const float amax = row_absmax(r, k_len);
    const float s = (amax == amax ? (amax < min_amax ? min_amax : amax) : amax) / 127.0f;
    sx[m] = s;
    Q* o = q + m * k_len;
    for (int64_t k = 0; k < k_len; ++k) o[k] = static_cast<Q>(round_to_int(r[k] / s) + kOffset);
  }
}

// y = ((float(acc - comp) * ws) * sx) + bias, one row at a time, each operation rounded
// separately (no contraction), exactly as scale_output's torch.mul / mul_ / add_.
template <bool kComp, bool kBias>
void epilogue_rows(const int32_t* acc, int64_t acc_stride, const int32_t* comp, const float* ws,
                   const float* sx, const float* bias, int64_t m_len, int64_t n_len, float* y) {
  for (int64_t m = 0; m < m_len; ++m) {
    const int32_t* a = acc + m * acc_stride;
    const float s = sx[m];
    float* o = y + m * n_len;
    for (int64_t n = 0; n < n_len; ++n) {
      float v = static_cast<float>(kComp ? a[n] - comp[n] : a[n]) * ws[n];
      v = v * s;
      if (kBias) v = v + bias[n];
      o[n] = v;
    }
  }
}

void epilogue(const int32_t* acc, int64_t acc_stride, const int32_t* comp, const float* ws,
              const float* sx, const float* bias, int64_t m_len, int64_t n_len, float* y) {
  if (comp && bias) epilogue_rows<true, true>(acc, acc_stride, comp, ws, sx, bias, m_len, n_len, y);
  else if (comp) epilogue_rows<true, false>(acc, acc_stride, comp, ws, sx, bias, m_len, n_len, y);
  else if (bias) epilogue_rows<false, true>(acc, acc_stride, comp, ws, sx, bias, m_len, n_len, y);
  else epilogue_rows<false, false>(acc, acc_stride, comp, ws, sx, bias, m_len, n_len, y);
}

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
// s8 x s8 ("s8"). Returns [..., N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& comp, bool u8_single, bool u8_multi) {
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
             y.data_ptr<float>());
  }
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

TORCH_LIBRARY(quasar_quant, m) {
  m.def(
      "int8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, Tensor? comp, "
      "bool u8_single, bool u8_multi) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(int8_linear));
}
