// The greedy token and the k likeliest tokens of each logits row of a verifier step, in one
// pass over the row (see quasar/models/llama.py, Transformer.row_argmax_topk).
//
// Why: a tree or batched step verifies many rows against a ~50-150k vocabulary; torch's
// argmax and topk make a pass each over every row and cost a visible share of such a step.
//
// argmax is torch.argmax's: the first index of the largest value (-0.0 and 0.0 are equal),
// and a row holding a NaN gives its first NaN, so greedy decoding picks exactly the same
// token either way. top-k (for token recycling, a heuristic) is by value, descending, equal
// values in index order, NaNs never chosen; k <= 64.

#include "common/cpu_features.h"
#include "head/row_topk.h"
#include "ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

using quasar::kMaxTopK;
using quasar::TopK;

// The first index of the row's maximum (torch.argmax's rule, NaN included).
int64_t argmax_scalar(const float* r, int64_t n) {
  int64_t best = 0;
  float v = r[0];
  if (v != v) return 0;
  for (int64_t i = 1; i < n; ++i) {
    if (r[i] != r[i]) return i;
    if (r[i] > v) v = r[i], best = i;
  }
  return best;
}

#ifdef QUASAR_ROW_AVX512
__attribute__((target("avx512f"))) int64_t argmax_avx512(const float* r, int64_t n) {
  // Pass 1: the maximum, and whether any NaN is present; pass 2: its first index.
  const int64_t n16 = n / 16 * 16;
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n16; i += 16) {
    const __m512 v = _mm512_loadu_ps(r + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  float best = _mm512_reduce_max_ps(m);
  for (int64_t i = n16; i < n; ++i) {
    if (r[i] != r[i]) nan = 1;
    best = std::max(best, r[i]);
  }
  if (nan) return argmax_scalar(r, n);
  const __m512 b = _mm512_set1_ps(best);
  for (int64_t i = 0; i < n16; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), b, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
  for (int64_t i = n16; i < n; ++i)
    if (r[i] == best) return i;
  return 0;  // unreachable: best is one of the values
}
#endif

}  // namespace

// logits [R, V] float32 -> (argmax [R] int64, top-k ids [R, k] int64, best first; [R, 0] for
// k = 0). Rows are independent; they are spread over the intra-op threads.
std::tuple<at::Tensor, at::Tensor> row_argmax_topk(const at::Tensor& logits, int64_t k, const std::string& path) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "row_argmax_topk: logits must be a float32 CPU tensor [rows, vocab]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1, "row_argmax_topk: the rows are empty");
  TORCH_CHECK(k >= 0 && k <= std::min(V, kMaxTopK), "row_argmax_topk: k must be in [0, min(vocab, 64)], got ", k);
  const at::Tensor x = logits.contiguous();
  at::Tensor best = at::empty({R}, x.options().dtype(at::kLong));
  at::Tensor top = at::empty({R, k}, x.options().dtype(at::kLong));
  const float* xs = x.data_ptr<float>();
  int64_t* bs = best.data_ptr<int64_t>();
  int64_t* ts = top.data_ptr<int64_t>();
  quasar::KernelPath kernel_path;
  TORCH_CHECK(quasar::resolve_kernel_path(path.c_str(), &kernel_path), "row_argmax_topk: unknown kernel path '",
              path, "' or one this CPU does not run");
  const bool wide = quasar::row_avx512_active(kernel_path);
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xs + r * V;
#ifdef QUASAR_ROW_AVX512
      bs[r] = wide ? argmax_avx512(row, V) : argmax_scalar(row, V);
#else
      bs[r] = argmax_scalar(row, V);
#endif
      if (k == 0) continue;
      TopK t;
      t.k = k;
      quasar::topk_scan(row, V, t, wide);
      for (int64_t j = 0; j < k; ++j) ts[r * k + j] = j < t.size ? t.idx[j] : bs[r];  // all-NaN rows
    }
  });
  return {best, top};
}
