// The k largest values of a logits row in one pass (k <= 64): the per-row top-k of a step's
// logits (row_select.cpp) and the heads' thresholds (refine_rows.cpp).
#pragma once

#include <cstdint>
#include <limits>

#include "common/cpu_features.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define QUASAR_ROW_AVX512 1
#include <immintrin.h>
#endif

namespace quasar {

constexpr int64_t kMaxTopK = 64;

// The k largest (value, index) of a row, best first; ties in index order, NaNs skipped.
// A sorted list of k; 16 values at a time are compared with its smallest first, so most of
// the row costs one compare per 16.
struct TopK {
  int64_t k, size = 0;
  float val[kMaxTopK];
  int64_t idx[kMaxTopK];

  void offer(float v, int64_t i) {  // indices arrive in increasing order
    if (size == k && !(v > val[k - 1])) return;
    int64_t at = size < k ? size++ : k - 1;
    while (at > 0 && v > val[at - 1]) {
      val[at] = val[at - 1], idx[at] = idx[at - 1];
      --at;
    }
    val[at] = v, idx[at] = i;
  }
  float floor() const { return size == k ? val[k - 1] : -std::numeric_limits<float>::infinity(); }
};

// nans (optional): set to the number of NaNs in the row.
inline void topk_scalar(const float* r, int64_t n, TopK& t, int64_t* nans = nullptr) {
  int64_t skipped = 0;
  for (int64_t i = 0; i < n; ++i)
    if (r[i] == r[i])
      t.offer(r[i], i);
    else
      ++skipped;
  if (nans) *nans = skipped;
}

#ifdef QUASAR_ROW_AVX512
__attribute__((target("avx512f"))) inline void topk_avx512(const float* r, int64_t n, TopK& t,
                                                           int64_t* nans = nullptr) {
  const int64_t n16 = n / 16 * 16;
  int64_t skipped = 0;
  for (int64_t i = 0; i < n16; i += 16) {
    const __m512 v = _mm512_loadu_ps(r + i);
    if (nans) skipped += __builtin_popcount(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q));
    // A full list takes only values above its smallest; until then every non-NaN value.
    __mmask16 take = t.size == t.k ? _mm512_cmp_ps_mask(v, _mm512_set1_ps(t.floor()), _CMP_GT_OQ)
                                   : _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    while (take) {
      const int j = __builtin_ctz(take);
      take &= take - 1;
      t.offer(r[i + j], i + j);
    }
  }
  for (int64_t i = n16; i < n; ++i)
    if (r[i] == r[i])
      t.offer(r[i], i);
    else
      ++skipped;
  if (nans) *nans = skipped;
}
#endif

// Whether the AVX512 row scans (these, and row_select.cpp's argmax) run on kernel path `path`:
// on the AVX512 paths only (cpu_features.h), so a lower path runs the plain loops, which give
// the same answers.
inline bool row_avx512_active(KernelPath path) {
#ifdef QUASAR_ROW_AVX512
  return path_at_least(path, KernelPath::kAvx512Vnni);
#else
  (void)path;
  return false;
#endif
}

// The k largest of row r[0, n) into t (t.k set, t empty), by the AVX512 scan when `wide`;
// nans (optional): set to the number of NaNs in the row.
inline void topk_scan(const float* r, int64_t n, TopK& t, bool wide, int64_t* nans = nullptr) {
#ifdef QUASAR_ROW_AVX512
  if (wide) return topk_avx512(r, n, t, nans);
#endif
  (void)wide;
  topk_scalar(r, n, t, nans);
}

}  // namespace quasar
