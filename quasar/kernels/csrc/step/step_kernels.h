// The float kernels of a fused decoder step (decoder_layer/decoder_layer.cpp orchestrates
// them), per vector ISA: AVX512 (x86_avx512.cpp and the attention files), and 8-float vectors
// written once (vec8.inc) for AVX2 (x86_avx2.cpp) and plain C++ (generic.cpp).
//
// The contract every set keeps: each row (and each query of attention) is computed alone,
// in a fixed order that does not depend on the other rows, so a token's result is bitwise
// the same whatever step it is verified in. The 8-float sets use no fused multiply-add
// and the same reduction trees, so AVX2 and portable give bitwise the same logits; the
// AVX512 set has its own order (FMAs, 16 lanes): each path is its own verifier.
#pragma once

#include <cstdint>

namespace quasar {
namespace step {

// Most query vectors one attention call takes (the rest go to further calls).
constexpr int64_t kMaxGroupQueries = 32;

// Where query i's logical key j lives in the cache (rows.py: a row attends to its slot's
// committed cache, then to its path): row j below splits[i], row tails[i][j - splits[i]]
// from there. A chain's rows have no tail (splits = n); a tree row's tail is the part of its
// path that does not directly follow the committed cache. Only the address changes: the
// arithmetic over logical keys is the same, so a tree row's result is bitwise that of the
// one-token step on its path (whose keys are the same values, committed in path order).
struct KeyMap {
  const int64_t* splits;
  const int64_t* const* tails;
};

template <bool Paths>
inline int64_t key_row(const KeyMap& keys, int64_t i, int64_t j) {
  if constexpr (Paths) return j < keys.splits[i] ? j : keys.tails[i][j - keys.splits[i]];
  return j;
}

// Attention of nq query vectors that share one kv head over a float32 cache (K, V [S, d]
// rows): outs[i] = softmax(qs[i] . K * scale) V over query i's ns[i] logical keys (KeyMap).
// Scratch: `scores` nq * stride floats (stride >= max n), `acc` nq * 2d floats.
using AttendF32Fn = void (*)(const float* const* qs, const int64_t* ns, const KeyMap& keys, float* const* outs,
                             int64_t nq, const float* k, const float* v, float scale, float* scores, int64_t stride,
                             float* acc);

// The same attention over a bfloat16 cache (K, V stored as bf16, widened to float32 on load:
// the arithmetic is the float32 kernel's), for the sets without AVX512-BF16.
using AttendB16Fn = void (*)(const float* const* qs, const int64_t* ns, const KeyMap& keys, float* const* outs,
                             int64_t nq, const uint16_t* k, const uint16_t* v, float scale, float* scores,
                             int64_t stride, float* acc);

// One ISA's row kernels and its attention over a float32 cache.
struct FloatKernels {
  // out[r] = w * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) for `rows` rows of length n.
  void (*rms_norm)(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* out);
  // act[r, c] = silu(gu[r, c]) * gu[r, inter + c] for the columns c in [c0, c1): gate and up
  // side by side in gu. Each element alone, so any split of the columns gives the same bits.
  void (*silu_mul)(const float* gu, int64_t rows, int64_t inter, int64_t c0, int64_t c1, float* act);
  // x += y over n floats.
  void (*add_into)(float* x, const float* y, int64_t n);
  // The attention kernel for head_dim d over chains (paths = false) or tree rows; null
  // when d is not one of the supported head dims.
  AttendF32Fn (*attend)(int64_t d, bool paths);
  // Attention over a bfloat16 cache and the float -> bfloat16 store of its K/V rows (round
  // to nearest even); null in the AVX512 set, whose bf16 kernels are attention.h's.
  AttendB16Fn (*attend_b16)(int64_t d, bool paths);
  void (*store_b16)(const float* x, int64_t n, uint16_t* out);
};

const FloatKernels& float_kernels_avx512();
const FloatKernels& float_kernels_avx2();
const FloatKernels& float_kernels_portable();

}  // namespace step
}  // namespace quasar
