// The refined head's last part (quasar/runtime/refined_head.py): in each row of a step's 4-bit
// logits, those at least the row's top_k-th largest become the int8 head's logits, in place.
//
// Why: in torch it takes several ops (topk, nonzero, a gather of int8 weight rows, their
// products) and a visible share of a step; here a row costs one scan for its threshold, one
// compare pass and top_k dot products, most of it waiting on the chosen tokens' scattered
// int8 weight rows.
//
// The contract is RefinedHead's torch path, bit for bit (tests/engine/test_w4a8_verifier.py):
// - kth = torch.topk's top_k-th largest value of the row, where a NaN ranks above every
//   number; so a row with top_k or more NaNs has a NaN kth and refines nothing;
// - every logit y >= kth (ties included; never a NaN) becomes (float(acc) * weight_scale[t])
//   * sx[row], two roundings in that order (the library has no FMA contraction), where acc is
//   the exact int32 dot product of token t's int8 weight row and the row's int8 activations.
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

}  // namespace

// logits [R, V] float32 (changed in place), qx [R, K] int8 and sx [R, 1] float32 (the rows'
// per-token int8 activations, numerics.quantize_activation), weight [V, K] int8 and
// weight_scale [V, 1] float32 (the int8 head), 1 <= top_k <= min(V, 64).
void refine_head_rows(at::Tensor logits, const at::Tensor& qx, const at::Tensor& sx, const at::Tensor& weight,
                      const at::Tensor& weight_scale, int64_t top_k, const std::string& path) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                  logits.is_contiguous(),
              "refine_head_rows: logits must be a contiguous float32 CPU tensor [rows, vocab]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(0) == V,
              "refine_head_rows: weight must be a contiguous int8 tensor [vocab, hidden]");
  const int64_t K = weight.size(1);
  TORCH_CHECK(qx.dim() == 2 && qx.scalar_type() == at::kChar && qx.is_contiguous() && qx.size(0) == R &&
                  qx.size(1) == K,
              "refine_head_rows: qx must be a contiguous int8 tensor [rows, hidden]");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.numel() == R,
              "refine_head_rows: sx must be a contiguous float32 tensor of one scale a row");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() && weight_scale.numel() == V,
              "refine_head_rows: weight_scale must be a contiguous float32 tensor of one scale a token");
  TORCH_CHECK(top_k >= 1 && top_k <= std::min(V, quasar::kMaxTopK),
              "refine_head_rows: top_k must be in [1, min(vocab, 64)], got ", top_k);
  float* ys = logits.data_ptr<float>();
  const int8_t* qs = qx.data_ptr<int8_t>();
  const float* sxs = sx.data_ptr<float>();
  const int8_t* ws = weight.data_ptr<int8_t>();
  const float* wss = weight_scale.data_ptr<float>();
  quasar::KernelPath kernel_path;
  TORCH_CHECK(quasar::resolve_kernel_path(path.c_str(), &kernel_path), "refine_head_rows: unknown kernel path '",
              path, "' or one this CPU does not run");
  const bool wide = quasar::row_avx512_active(kernel_path);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = ys + r * V;
      const float kth = kth_largest(row, V, top_k, wide);
      const int8_t* q = qs + r * K;
      // (software prefetch of the chosen tokens' weight rows, all at once: no faster)
      each_at_least(row, V, kth, wide, [&](int64_t t) {
        row[t] = (static_cast<float>(dot_i8(ws + t * K, q, K)) * wss[t]) * sxs[r];
      });
    }
  });
}
