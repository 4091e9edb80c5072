// Attention over a bfloat16 KV cache, with AVX512-BF16 vectors (attention/x86_avx512_bf16.cpp) or
// AMX-BF16 tiles (amx/attention.cpp): the kernels the fused step (decoder_layer/decoder_layer.cpp) calls
// on the AVX512 paths where the CPU has them. Null / false everywhere else.
#pragma once

#include <cstdint>
#include <utility>

#include "common/cpu_features.h"
#include "step/step_kernels.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#if defined(__linux__) && (__GNUC__ >= 11 || defined(__clang__))
#define QUASAR_AMX_ATTENTION 1
#endif
#endif

namespace quasar {
namespace step {

// Keys per attention block of a bfloat16-cache step: a long context's keys are split into
// blocks at fixed key indices, each block one work item for every query of its kv head,
// and the blocks' partial results are joined per query (combine_blocks). Why: splitting a
// kv head's queries between threads made each thread stream and transpose all its keys, so
// a one-token step over a long context gained almost nothing from a second thread.
// Contexts up to one block are computed exactly as before.
constexpr int64_t kBlockKeys = 512;

// Where a key block [lo, hi) ends for each query of an attention call: ends[i] = min(ns[i],
// hi). Returns the furthest end (at least lo) and sets `shared_until` to where the queries'
// common keys end (their slot's committed cache; unbounded for chains, Paths = false).
template <bool Paths>
inline int64_t block_ends(const int64_t* ns, const KeyMap& keys, int64_t nq, int64_t lo, int64_t hi, int64_t* ends,
                          int64_t& shared_until) {
  int64_t n_max = lo;
  shared_until = INT64_MAX;
  for (int64_t i = 0; i < nq; ++i) {
    ends[i] = ns[i] < hi ? ns[i] : hi;
    n_max = ends[i] > n_max ? ends[i] : n_max;
    if constexpr (Paths) shared_until = keys.splits[i] < shared_until ? keys.splits[i] : shared_until;
  }
  return n_max;
}

// Whether the fused step takes a bfloat16 KV cache with these kernels on kernel path `path`:
// AVX512-BF16 on an AVX512 path.
bool bf16_supported(KernelPath path);

// n floats (a multiple of 16) as bfloat16, round to nearest even (bf16_supported() only).
void store_bf16(const float* x, int64_t n, uint16_t* out);

// attend over a bf16 cache for one block of keys [lo, hi) (see attention/x86_avx512_bf16.cpp); null
// for a head_dim it has no kernel for (or off x86).
using AttendBf16Fn = void (*)(const float* const* qs, const int64_t* ns, const KeyMap& keys, float* const* outs,
                              float* const* parts, int64_t nq, int64_t lo, int64_t hi, const uint16_t* k,
                              const uint16_t* v, float scale, float* scores, uint16_t* probs, int64_t stride,
                              float* acc);
AttendBf16Fn attend_bf16(int64_t d, bool paths);

// A query's output from its blocks' partial results (nb blocks of d + 2 floats at `parts`).
void combine_blocks(const float* parts, int64_t nb, int64_t d, float* out);

// Whether verifier steps and prompt chunks attend with AMX-BF16 tiles on kernel path `path`.
bool amx_bf16_supported(KernelPath path);

#ifdef QUASAR_AMX_ATTENTION
// The AMX-BF16 step kernel (attend_bf16's contract; `ops`: scratch for one block's operands)
// and the prompt-chunk kernel with the operands it shares per kv head (amx/attention.cpp).
using AttendAmxFn = void (*)(const float* const*, const int64_t*, const KeyMap&, float* const*, float* const*,
                             int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, float, float*, uint16_t*,
                             int64_t, float*, __m512i*);
AttendAmxFn attend_amx(int64_t d, bool paths);

using AttendPrefillFn = void (*)(const float* const*, const int64_t*, float* const*, int64_t, const __m512i*,
                                 const __m512i*, float, float*, uint16_t*, int64_t, float*);
using PrefillOperandsFn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, __m512i*, __m512i*);
std::pair<AttendPrefillFn, PrefillOperandsFn> attend_prefill(int64_t d);
#endif

}  // namespace step
}  // namespace quasar
