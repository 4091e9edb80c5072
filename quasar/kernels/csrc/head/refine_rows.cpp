// The exact and refined heads' last part (quasar/runtime/exact_head.py, refined_head.py): in
// each row of a step's approximate logits, those at least the row's top_k-th largest are
// recomputed from the head's finer weights, in place.
//
// Why: in torch it takes several ops (a top-k, a compare, nonzero, a gather of weight rows,
// their products) and a visible share of a step; here a row costs one scan for its threshold,
// one compare pass and top_k dot products, most of it waiting on the chosen tokens' scattered
// weight rows.
//
// Both share the threshold and the set, as the heads' torch paths define them:
// - kth = torch.topk's top_k-th largest value of the row, where a NaN ranks above every
//   number; so a row with top_k or more NaNs has a NaN kth and refines nothing;
// - every logit y >= kth (ties included; never a NaN) is recomputed.
// refine_head_rows (RefinedHead, bit for bit its torch path: tests/engine/test_w4a8_verifier.py)
// makes it (float(acc) * weight_scale[t]) * sx[row], two roundings in that order (the library
// has no FMA contraction), acc the exact int32 dot product of token t's int8 weight row and the
// row's int8 activations. refine_exact_rows (ExactTopHead) makes it the float32 products of
// token t's float row and the row's hidden state summed in float64 in one fixed order
// (dot_f64), rounded to float32: its torch path sums in torch's order, so the two agree to
// float64 rounding, not bit for bit; one process runs one of them.
// Rows are independent (a row gives the same bits alone or in a step of many).

#include "head/row_topk.h"
#include "ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

// Exact: both operands are in [-127, 127], so |acc| <= K * 127^2, far below 2^31 for any hidden
// size a model has.
int32_t dot_i8(const int8_t* a, const int8_t* b, int64_t n) {
  int32_t acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<int32_t>(a[i]) * static_cast<int32_t>(b[i]);
  return acc;
}

// The float32 products w[i] * x[i] summed in float64: element i into partial sum i % 8, in
// order, then the eight pairwise. One order on every path and for every row.
double dot_f64(const float* w, const float* x, int64_t n) {
  double s[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += static_cast<double>(w[i + j] * x[i + j]);
  for (int j = 0; i + j < n; ++j) s[j] += static_cast<double>(w[i + j] * x[i + j]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// torch.topk(row, k).values[-1]: the k-th largest of the numbers, NaNs counted first.
float kth_largest(const float* row, int64_t n, int64_t k, bool wide) {
  quasar::TopK t;
  t.k = k;
  int64_t nans = 0;
  quasar::topk_scan(row, n, t, wide, &nans);
  // t holds the k largest numbers, best first, and the row has n - nans >= k - nans of them
  return nans >= k ? std::numeric_limits<float>::quiet_NaN() : t.val[k - nans - 1];
}

#ifdef QUASAR_ROW_AVX512
// The AVX512 compare pass over the row's whole blocks of 16; returns where it stopped.
template <typename Refine>
__attribute__((target("avx512f"))) int64_t each_at_least_avx512(const float* row, int64_t n, float kth,
                                                                 Refine& refine) {
  const __m512 t = _mm512_set1_ps(kth);
  const int64_t n16 = n / 16 * 16;
  for (int64_t i = 0; i < n16; i += 16)
    for (__mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), t, _CMP_GE_OQ); m; m &= m - 1)
      refine(i + __builtin_ctz(m));
  return n16;
}
#endif

// Each logit of row[0, n) at least kth (never a NaN) through refine(index).
template <typename Refine>
void each_at_least(float* row, int64_t n, float kth, bool wide, Refine refine) {
  int64_t i = 0;
#ifdef QUASAR_ROW_AVX512
  if (wide) i = each_at_least_avx512(row, n, kth, refine);
#endif
  (void)wide;
  for (; i < n; ++i)
    if (row[i] >= kth) refine(i);
}

// The checks both ops share; returns whether the AVX512 row scans run.
bool check_refine(const char* op, const at::Tensor& logits, const at::Tensor& weight, int64_t top_k,
                  const std::string& path) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                  logits.is_contiguous(),
              op, ": logits must be a contiguous float32 CPU tensor [rows, vocab]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu() &&
                  weight.size(0) == logits.size(1),
              op, ": weight must be a contiguous CPU tensor [vocab, hidden]");
  TORCH_CHECK(top_k >= 1 && top_k <= std::min(logits.size(1), quasar::kMaxTopK), op,
              ": top_k must be in [1, min(vocab, 64)], got ", top_k);
  quasar::KernelPath kernel_path;
  TORCH_CHECK(quasar::resolve_kernel_path(path.c_str(), &kernel_path), op, ": unknown kernel path '", path,
              "' or one this CPU does not run");
  return quasar::row_avx512_active(kernel_path);
}

// Each row r of logits [R, V]: every logit at least its top_k-th largest becomes
// refine(r, token), the rows split over the threads.
template <typename Refine>
void refine_rows(at::Tensor& logits, int64_t top_k, bool wide, Refine refine) {
  const int64_t R = logits.size(0), V = logits.size(1);
  float* ys = logits.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = ys + r * V;
      // (software prefetch of the chosen tokens' weight rows, all at once: no faster)
      each_at_least(row, V, kth_largest(row, V, top_k, wide), wide, [&](int64_t t) { row[t] = refine(r, t); });
    }
  });
}

}  // namespace

// logits [R, V] float32 (changed in place), qx [R, K] int8 and sx [R, 1] float32 (the rows'
// per-token int8 activations, numerics.quantize_activation), weight [V, K] int8 and
// weight_scale [V, 1] float32 (the int8 head), 1 <= top_k <= min(V, 64).
void refine_head_rows(at::Tensor logits, const at::Tensor& qx, const at::Tensor& sx, const at::Tensor& weight,
                      const at::Tensor& weight_scale, int64_t top_k, const std::string& path) {
  const bool wide = check_refine("refine_head_rows", logits, weight, top_k, path);
  const int64_t R = logits.size(0), V = logits.size(1), K = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kChar, "refine_head_rows: weight must be int8");
  TORCH_CHECK(qx.dim() == 2 && qx.scalar_type() == at::kChar && qx.is_contiguous() && qx.size(0) == R &&
                  qx.size(1) == K,
              "refine_head_rows: qx must be a contiguous int8 tensor [rows, hidden]");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.numel() == R,
              "refine_head_rows: sx must be a contiguous float32 tensor of one scale a row");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() && weight_scale.numel() == V,
              "refine_head_rows: weight_scale must be a contiguous float32 tensor of one scale a token");
  const int8_t* qs = qx.data_ptr<int8_t>();
  const float* sxs = sx.data_ptr<float>();
  const int8_t* ws = weight.data_ptr<int8_t>();
  const float* wss = weight_scale.data_ptr<float>();
  refine_rows(logits, top_k, wide, [&](int64_t r, int64_t t) {
    return (static_cast<float>(dot_i8(ws + t * K, qs + r * K, K)) * wss[t]) * sxs[r];
  });
}

// logits [R, V] float32 (changed in place), x [R, K] float32 (the rows' hidden states), weight
// [V, K] float32 (the float head's rows), 1 <= top_k <= min(V, 64).
void refine_exact_rows(at::Tensor logits, const at::Tensor& x, const at::Tensor& weight, int64_t top_k,
                       const std::string& path) {
  const bool wide = check_refine("refine_exact_rows", logits, weight, top_k, path);
  const int64_t R = logits.size(0), K = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "refine_exact_rows: weight must be float32");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) == R && x.size(1) == K,
              "refine_exact_rows: x must be a contiguous float32 tensor [rows, hidden]");
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  refine_rows(logits, top_k, wide,
              [&](int64_t r, int64_t t) { return static_cast<float>(dot_f64(ws + t * K, xs + r * K, K)); });
}
