// The fused W8A8 linear op for the `cpu` int8 backend (see quasar/runtime/w8a8.py and ext.py),
// and the ops that set the int8 GEMM's process-wide settings.
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
// Small M (the verifier's k + 1 tokens, M <= 16 by default; every M below the AVX512 paths,
// where oneDNN without VNNI is not exact): the hand-written small-M GEMM (generic.cpp) on the
// weight packed in tiles (pack.cpp), with the same int32s and the same epilogue.


#include "gemm_w8a8/kernels.h"
#include "ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using quasar::epilogue;
using quasar::kSmallMaxRows;
using quasar::kTiledMaxRows;
using quasar::quantize_rows;

// Whether oneDNN's int8 GEMM may serve the rows the small-M kernel does not take: only on
// the AVX512 paths, and only while oneDNN is exact here (kernels.py passes its check on
// through ext.onednn_exact). Without VNNI oneDNN makes its u8 x s8 products with vpmaddubsw,
// whose int16 pairs saturate: its sums are wrong, so every lower path computes all rows
// itself, kTiledMaxRows at a time.
bool onednn_allowed(quasar::KernelPath path) {
  return quasar::vnni_supported(path) && quasar::int8_settings().onednn_exact.load(std::memory_order_relaxed);
}

// The largest M int8_linear sends to the small-M kernel: as set, or by default all it takes
// when AMX computes them, kSmallMaxRows on AVX512-VNNI alone (oneDNN is faster for more
// rows there), and every M on the lower paths (in chunks of kTiledMaxRows).
int64_t small_m_limit(quasar::KernelPath path) {
  const quasar::Int8Settings& s = quasar::int8_settings();
  const int64_t v = s.small_m_max.load(std::memory_order_relaxed);
  if (v >= 0) return v;
  if (!onednn_allowed(path)) return std::numeric_limits<int64_t>::max();
  return quasar::amx_enabled(path) ? kTiledMaxRows : kSmallMaxRows;
}

at::Tensor as_float_vector(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "int8_linear: ", what, " must be on the CPU");
  TORCH_CHECK(t.numel() == n, "int8_linear: ", what, " must have ", n, " elements, got ",
              t.numel());
  return t.to(at::kFloat).contiguous();  // no-ops for the usual float32 buffers
}

// The operands of one int8_linear call as its kernels take them (float32, contiguous), its
// kernel path, and which GEMM computes its rows: the small-M kernel (segment `seg` over the
// weight's tiles; every M below the AVX512 paths: same int32s, same epilogue) or oneDNN's u8
// or s8 one.
struct LinearOperands {
  at::Tensor ws, b, cmp, c;
  quasar::Int8Segment seg{};
  quasar::KernelPath path = quasar::KernelPath::kPortable;
  bool use_u8 = false, small_m = false;
  const float* bias() const { return b.defined() ? b.data_ptr<float>() : nullptr; }
};

LinearOperands linear_operands(const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& comp, const std::optional<at::Tensor>& tiles,
                               bool u8_single, bool u8_multi, int64_t M, int64_t N, int64_t K,
                               quasar::KernelPath path) {
  LinearOperands o;
  o.path = path;
  o.ws = as_float_vector(weight_scale, N, "weight_scale");
  if (bias.has_value() && bias->defined()) o.b = as_float_vector(*bias, N, "bias");
  o.use_u8 = M == 1 ? u8_single : u8_multi;
  if (o.use_u8) {
    TORCH_CHECK(comp.has_value() && comp->defined() && comp->scalar_type() == at::kInt && comp->numel() == N,
                "int8_linear: the u8 variant needs comp = 128 * rowsum(weight) as int32 [N]");
    o.cmp = comp->contiguous();
  }
  o.small_m = M <= small_m_limit(path) && comp.has_value() && comp->defined() && comp->scalar_type() == at::kInt &&
              comp->numel() == N && tiles.has_value() && tiles->defined();
  if (o.small_m) {
    TORCH_CHECK(tiles->scalar_type() == at::kChar && tiles->is_contiguous() &&
                    tiles->numel() == quasar::tiled_bytes(N, K),
                "int8_linear: tiles must be the weight packed by int8_pack_tiles");
    o.c = comp->contiguous();
    o.seg = {tiles->data_ptr<int8_t>(), N, o.c.data_ptr<int32_t>(), o.ws.data_ptr<float>(), o.bias(), 0};
  }
  return o;
}

// The rows the small-M kernel does not take: oneDNN where it is exact (AVX512 paths), else
// float64, exact too (|sums| < 2**53); torch 2.13's CPU _int_mm is wrong for K == 1.
// q int8 or uint8 [M, K] -> int32 [M, N].
at::Tensor exact_int_mm(const at::Tensor& q, const at::Tensor& weight, quasar::KernelPath path) {
  if (weight.size(1) == 1 || !onednn_allowed(path))
    return at::matmul(q.to(at::kDouble), weight.to(at::kDouble).t()).to(at::kInt);
  return at::_int_mm(q, weight.t());
}

// 15-bit activations as two int8 halves (see Int8Linear): y [M, N] from xf [M, K].
void linear_15bit(const at::Tensor& xf, const at::Tensor& weight, const LinearOperands& o, float* sx, float* y) {
  const int64_t M = xf.size(0), K = xf.size(1), N = weight.size(0);
  at::Tensor hi = at::empty({M, quasar::padded_k(K)}, xf.options().dtype(at::kByte));
  at::Tensor lo = at::empty({M, quasar::padded_k(K)}, xf.options().dtype(at::kByte));
  quasar::quantize_rows_split_u8(xf.data_ptr<float>(), M, K, hi.data_ptr<uint8_t>(), lo.data_ptr<uint8_t>(), sx,
                                 o.path);
  if (o.small_m) {
    quasar::small_m_gemm_split(hi.data_ptr<uint8_t>(), lo.data_ptr<uint8_t>(), M, K, &o.seg, 1, sx, y, N, o.path);
    return;
  }
  // s8 halves (both in [-127, 127]), each an exact int32 GEMM
  const auto gemm = [&](const at::Tensor& u) {
    return exact_int_mm(u.narrow(1, 0, K).to(at::kShort).sub_(128).to(at::kChar).contiguous(), weight, o.path)
        .to(at::kLong);
  };
  const at::Tensor acc = gemm(hi).mul_(128).add_(gemm(lo)).contiguous();
  epilogue(acc.data_ptr<int64_t>(), N, nullptr, o.ws.data_ptr<float>(), sx, o.bias(), M, N, y, N);
}

// 8-bit activations: y [M, N] from xf [M, K].
void linear_8bit(const at::Tensor& xf, const at::Tensor& weight, const LinearOperands& o, float* sx, float* y) {
  const int64_t M = xf.size(0), K = xf.size(1), N = weight.size(0);
  if (o.small_m) {
    at::Tensor q = at::empty({M, quasar::padded_k(K)}, xf.options().dtype(at::kByte));
    quasar::quantize_rows_u8(xf.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), sx, o.path);
    quasar::small_m_gemm(q.data_ptr<uint8_t>(), M, K, &o.seg, 1, sx, y, N, o.path);
    return;
  }
  at::Tensor acc;
  if (o.use_u8) {
    at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kByte));
    quantize_rows<uint8_t, 128>(xf.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), sx, K);
    acc = exact_int_mm(q, weight, o.path);
  } else {
    at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kChar));
    quantize_rows<int8_t, 0>(xf.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), sx, K);
    acc = exact_int_mm(q, weight, o.path);
  }
  if (acc.stride(1) != 1) acc = acc.contiguous();
  epilogue(acc.data_ptr<int32_t>(), acc.stride(0), o.cmp.defined() ? o.cmp.data_ptr<int32_t>() : nullptr,
           o.ws.data_ptr<float>(), sx, o.bias(), M, N, y, N);
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
// path: the kernel path ("" for the process default; cpu_features.h).
// Returns [..., N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& comp, bool u8_single, bool u8_multi,
                       const std::optional<at::Tensor>& tiles, int64_t act_bits, const std::string& path) {
  TORCH_CHECK(act_bits == 8 || act_bits == 15, "int8_linear: act_bits must be 8 or 15, got ", act_bits);
  quasar::KernelPath kernel_path;
  TORCH_CHECK(quasar::resolve_kernel_path(path.c_str(), &kernel_path), "int8_linear: unknown kernel path '", path,
              "' or one this CPU does not run");
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
    const LinearOperands o =
        linear_operands(weight_scale, bias, comp, tiles, u8_single, u8_multi, M, N, K, kernel_path);
    std::vector<float> sx(M);
    if (act_bits == 15)
      linear_15bit(xf, weight, o, sx.data(), y.data_ptr<float>());
    else
      linear_8bit(xf, weight, o, sx.data(), y.data_ptr<float>());
  }
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());  // the result in x's dtype and shape
  return y.view(out_shape);
}

// The largest M that takes the small-M kernel (default 16, or kTiledMaxRows with AMX; at most
// kTiledMaxRows; 0 disables it); max_m < 0 only reads. Returns the previous value.
int64_t int8_small_m_max(int64_t max_m) {
  const int64_t before = small_m_limit(quasar::kernel_path());
  if (max_m >= 0) quasar::int8_settings().small_m_max.store(std::min(max_m, kTiledMaxRows));
  return before;
}

// The smallest M the small-M kernel computes with AMX on a CPU that has it (default
// kAmxMinRows; 0: never); min_rows < 0 only reads. Returns the previous value.
int64_t int8_amx_min_rows(int64_t min_rows) {
  std::atomic<int64_t>& amx_min_rows = quasar::int8_settings().amx_min_rows;
  if (min_rows < 0) return amx_min_rows.load();
  return amx_min_rows.exchange(min_rows);
}

// Whether one-row passes prefetch their whole stream (1) or only each stream's start (0; see
// quasar::prefetch_whole_stream); mode < 0 only reads. Returns the previous value. Speed
// only: the sums are the same.
int64_t int8_stream_prefetch(int64_t mode) {
  std::atomic<int64_t>& stream_prefetch = quasar::int8_settings().stream_prefetch;
  if (mode < 0) return stream_prefetch.load();
  return stream_prefetch.exchange(mode != 0 ? 1 : 0);
}

// Whether oneDNN's int8 GEMMs are exact here (kernels.py checks it once per process); with a
// value (0 or 1), set it first. While false the small-M kernel takes every M.
bool int8_onednn_exact(int64_t value) {
  std::atomic<bool>& onednn_exact = quasar::int8_settings().onednn_exact;
  if (value >= 0) onednn_exact.store(value != 0);
  return onednn_exact.load();
}

// Whether this CPU runs the small-M kernel's AMX path (AMX-INT8, and Linux allows it).
bool int8_amx_supported() { return quasar::amx_supported(quasar::kernel_path()); }

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
