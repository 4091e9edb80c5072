// All decoder layers of a W8A8 or W4A8 model for a verifier-sized step, in one call
// (see quasar/runtime/fused_step.py, which decides when it is used).
//
// Why: at 135M parameters a step of 1..9 tokens spends more time in ~50 small ATen ops per
// layer (norms, RoPE, a scaled-dot-product call per query, residuals, dispatch) than in
// its int8 GEMMs. This op runs the layer's glue as plain loops between the same small-M
// VNNI GEMMs Int8Linear uses (int8_gemm.h) and the W4A8 kernels W4A8Linear uses
// (w4a8_gemm.h), so a step costs little more than the bytes of its weights.
//
// Layer (Llama family, T <= kMaxRows rows: chains or token trees in one or more cache
// slots, float32 activations):
//   h = rmsnorm(x) * w_in; q, k, v = W(h) (one quantization per form, one parallel GEMM
//   phase for all rows); optional per-head q/k rmsnorm (Qwen3); RoPE; each row's k, v
//   written to its slot past the slot's committed length; attention of each row over its
//   slot's committed keys and then its path (for a chain: keys [0, start + i]);
//   x += W_o(attn);
//   h = rmsnorm(x) * w_post; x += W_down(silu(W_gate(h)) * W_up(h)).
// The cache is float32, or bfloat16: with AVX512-BF16 attend_group_bf16 takes bf16
// products, float32 softmax and sums (ARCHITECTURE.md, "The KV cache in bfloat16"); below
// the AVX512 paths the 8-float kernels widen the stored bf16 to float32.
// Each linear is an Int8Linear or a W4A8Linear, in any mix (step_linears.h: an input is
// quantized once per form its linears need). An Int8Linear with act_bits 15 (by default the
// down projection) quantizes its input to 15 bits and runs two int8 products over the same
// weight chunk (small_m_gemm_split).
// Every row is computed on its own, in a fixed order, whatever T is: a token's result is
// bitwise the same whether it is verified alone or with drafts (row invariance), which is
// what keeps greedy speculative output identical to greedy autoregressive output.
// Not bitwise equal to the PyTorch path (different summation orders, a polynomial exp),
// only close: tests compare logits within a tolerance.
//
// Runs on every kernel path (cpu_features.h): this file is the step's orchestration, written
// once (phases, barriers, the work split); the GEMMs come from step_linears.h, the float
// kernels of the active path from step/step_kernels.h (AVX512: step/x86_avx512.cpp; AVX2 and
// plain C++: step/vec8.inc), attention over a bfloat16 cache from attention/attention.h.

#include "attention/attention.h"
#include "step/step_kernels.h"
#include "decoder_layer/step_linears.h"
#include "ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

// Rows of a verifier step (a chain or a token tree: the pending token and its draft nodes);
// longer prefills use the PyTorch path. fused_step.MAX_ROWS is the same number.
constexpr int64_t kMaxRows = 128;
// Most query vectors one attention call takes (step_kernels.h). Each call streams (and for
// a bf16 cache transposes) its kv head's keys once, so more queries a call share that
// stream; 32 made long prefills faster than 16, and 64 was no better.
using quasar::step::kMaxGroupQueries;
using quasar::step::KeyMap;
using quasar::step::key_row;
using quasar::step::kBlockKeys;
using AttendFn = quasar::step::AttendF32Fn;
using quasar::step::AttendBf16Fn;

// Rotary embedding of one head vector in place (rotate_half convention: the first and
// second halves are the pairs).
inline void rope(float* v, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = v[j], b = v[j + half];
    v[j] = a * cos[j] - b * sin[j];
    v[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

// The float kernels of the active kernel path (step_kernels.h).
const quasar::step::FloatKernels& float_kernels() {
  using quasar::KernelPath;
  if (quasar::path_at_least(KernelPath::kAvx512Vnni)) return quasar::step::float_kernels_avx512();
  if (quasar::path_at_least(KernelPath::kAvx2)) return quasar::step::float_kernels_avx2();
  return quasar::step::float_kernels_portable();
}

const float* float_data(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
              "w8a8_decoder_layers: ", what, " must be a contiguous float32 tensor of ", numel,
              " elements");
  return t.data_ptr<float>();
}

}  // namespace


// x [1, T, H] float32 -> the hidden states after all L layers [1, T, H], for the rows of a
// verifier step over one or more cache slots (quasar/models/rows.py). k_cache / v_cache are
// [L, slots, KVH, S, D] float32 or bfloat16. Row t belongs to slot slots[t], whose committed length is
// starts[t]; the rows of a slot are contiguous and form a tree: parents[t] is row t's parent
// row (an index into the whole step; -1 for the slot's first row, its pending token; a chain
// has parents[t] = t - 1). Row t's K/V go to its slot at starts[t] + (t - the slot's first
// row), and it attends to its slot's committed cache [0, starts[t]) and then to its path (the
// rows from the root down to itself): the keys a one-token step on its path would see, so
// neither the other rows of its slot nor other slots change a bit of its result.
// Per layer l, in order: norms[4l .. 4l+3] = input_layernorm, post_attention_layernorm,
// q_norm, k_norm (the last two None without qk-norm); weights / tiles / scales / biases /
// comps / act_bits / w4 / w4_groups[7l .. 7l+6] = the linears q, k, v, o, gate, up, down:
// an Int8Linear has w4_groups 0 and weight, tiles (the weight packed by int8_pack_tiles,
// which the GEMMs read), scale, comp (128 * rowsum(weight), int32 [N]) and act_bits (8, or
// 15 for split 15-bit activations as in Int8Linear); a W4A8Linear has w4_groups = its group
// size, w4 = its weight packed by w4_pack, and None for the int8 ones; either may have a
// bias.
at::Tensor w8a8_decoder_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& k_cache, at::Tensor& v_cache, at::IntArrayRef slots,
                               at::IntArrayRef starts, at::IntArrayRef parents,
                               const c10::List<std::optional<at::Tensor>>& norms, double eps,
                               const c10::List<std::optional<at::Tensor>>& weights,
                               const c10::List<std::optional<at::Tensor>>& tiles,
                               const c10::List<std::optional<at::Tensor>>& scales,
                               const c10::List<std::optional<at::Tensor>>& biases,
                               const c10::List<std::optional<at::Tensor>>& comps, at::IntArrayRef act_bits,
                               const c10::List<std::optional<at::Tensor>>& w4, at::IntArrayRef w4_groups,
                               int64_t n_heads, int64_t n_kv_heads, bool prefill) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "w8a8_decoder_layers: x must be contiguous float32 [1, T, H]");
  const int64_t T = x.size(1), H = x.size(2);
  TORCH_CHECK(T >= 1 && T <= kMaxRows, "w8a8_decoder_layers: 1..", kMaxRows, " rows, got ", T);
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && (bf16 || k_cache.scalar_type() == at::kFloat) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.size(2) == n_kv_heads,
              "w8a8_decoder_layers: caches must be contiguous float32 or bfloat16 [L, slots, KVH, S, D]");
  // The active kernel path's float kernels. A bfloat16 cache is attended with AVX512-BF16
  // products (attention.h) on the AVX512 paths, and widened to float32 by the 8-float
  // kernels (fk.attend_b16) below them.
  const quasar::step::FloatKernels& fk = float_kernels();
  const bool widened_bf16 = bf16 && fk.attend_b16 != nullptr;
  TORCH_CHECK(!bf16 || widened_bf16 || quasar::step::bf16_supported(),
              "w8a8_decoder_layers: a bfloat16 cache needs an AVX512-BF16 CPU on an AVX512 kernel path");
  TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
              "w8a8_decoder_layers: n_heads must be a multiple of n_kv_heads");
  const int64_t L = k_cache.size(0), n_slots = k_cache.size(1), D = k_cache.size(4), S = k_cache.size(3);
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 4 * L && static_cast<int64_t>(weights.size()) == 7 * L &&
                  static_cast<int64_t>(tiles.size()) == 7 * L &&
                  static_cast<int64_t>(scales.size()) == 7 * L && static_cast<int64_t>(biases.size()) == 7 * L &&
                  static_cast<int64_t>(comps.size()) == 7 * L && static_cast<int64_t>(act_bits.size()) == 7 * L &&
                  static_cast<int64_t>(w4.size()) == 7 * L && static_cast<int64_t>(w4_groups.size()) == 7 * L,
              "w8a8_decoder_layers: 4 norms and 7 linears per cache layer");
  TORCH_CHECK(static_cast<int64_t>(parents.size()) == T && static_cast<int64_t>(slots.size()) == T &&
                  static_cast<int64_t>(starts.size()) == T && parents[0] == -1,
              "w8a8_decoder_layers: one slot, start and parent per row, parent -1 for the first");
  // Per row: its cache row (where its K/V go), and its logical keys (KeyMap): n_keys[t] of
  // them, rows [0, split[t]) of its slot's cache and then tails[t], the cache rows of the
  // path from the first one off the slot's chain. `groups`: each slot's rows [first, end).
  std::vector<int64_t> n_keys(T), split(T), cache_row(T), tail_rows(T * T), path;
  std::vector<const int64_t*> tails(T);
  std::vector<std::pair<int64_t, int64_t>> groups;
  std::vector<bool> seen(n_slots, false);
  bool is_chain = true;
  int64_t max_keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < n_slots, "w8a8_decoder_layers: slot ", slot, " is not in the cache");
    if (parents[t] == -1) {
      TORCH_CHECK(!seen[slot], "w8a8_decoder_layers: the rows of slot ", slot, " must be contiguous, one root");
      seen[slot] = true;
      groups.emplace_back(t, t + 1);
    } else {
      const int64_t p = parents[t];
      TORCH_CHECK(p >= groups.back().first && p < t && slots[p] == slot && starts[p] == starts[t],
                  "w8a8_decoder_layers: parents[", t, "] must be an earlier row of the same slot");
      groups.back().second = t + 1;
    }
    const int64_t first = groups.back().first;
    cache_row[t] = starts[t] + t - first;
    TORCH_CHECK(starts[t] >= 0 && cache_row[t] < S, "w8a8_decoder_layers: rows past the cache");
    path.clear();
    for (int64_t r = t; r != -1; r = parents[r]) path.push_back(r);
    std::reverse(path.begin(), path.end());
    int64_t m = 0;
    while (m < static_cast<int64_t>(path.size()) && path[m] == first + m) ++m;
    is_chain = is_chain && m == static_cast<int64_t>(path.size());
    n_keys[t] = starts[t] + static_cast<int64_t>(path.size());
    split[t] = starts[t] + m;
    for (size_t i = m; i < path.size(); ++i) tail_rows[t * T + (i - m)] = cache_row[path[i]];
    tails[t] = tail_rows.data() + t * T;
    max_keys = std::max(max_keys, n_keys[t]);
  }
  // A batch of chains keeps the plain attention kernel (no key lookups at all).
  const auto rms_norm = fk.rms_norm;
  const auto silu_mul = fk.silu_mul;
  const auto add_into = fk.add_into;
  const AttendFn attend = fk.attend(D, !is_chain);
  const quasar::step::AttendB16Fn attend_b16 = widened_bf16 ? fk.attend_b16(D, !is_chain) : nullptr;
  const AttendBf16Fn attend_bf16 = bf16 && !widened_bf16 ? quasar::step::attend_bf16(D, !is_chain) : nullptr;
  // An AMX-BF16 CPU's steps attend with tiles (attend_group_amx), all of them.
#ifdef QUASAR_AMX_ATTENTION
  const quasar::step::AttendAmxFn attend_amx =
      attend_bf16 && quasar::step::amx_bf16_supported() ? quasar::step::attend_amx(D, !is_chain) : nullptr;
#endif
  TORCH_CHECK(attend != nullptr, "w8a8_decoder_layers: head_dim must be 16, 32, 48, 64, 80, 96, 128 or 256");
  TORCH_CHECK(!bf16 || attend_bf16 != nullptr || attend_b16 != nullptr,
              "w8a8_decoder_layers: a bfloat16 cache needs head_dim 32, 64, 96, 128 or 256");
  const int64_t stride = (max_keys + 31) / 32 * 32;  // of the score rows (32-key tiles in prefill)
  // A prompt chunk on an AMX-BF16 CPU attends with tiles (attend_prefill_amx: allowed for
  // prefill only, see there).
#ifdef QUASAR_AMX_ATTENTION
  const auto [attend_prefill, prefill_operands_fn] =
      prefill && attend_bf16 && is_chain && groups.size() == 1 && quasar::step::amx_bf16_supported()
          ? quasar::step::attend_prefill(D)
          : std::pair<quasar::step::AttendPrefillFn, quasar::step::PrefillOperandsFn>{};
  // Its operands, per kv head: K^T per 16 keys (D / 2 rows of 64 bytes) and V pairs per 32
  // keys (D rows), for every key of the step (stride covers them in whole 32-key chunks);
  // 64-byte aligned by hand.
  const int64_t kt_rows = stride / 16 * D / 2, vt_rows = stride / 32 * D, halves = stride / 16;
  std::vector<uint8_t> operands_raw(attend_prefill ? 64 * (n_kv_heads * (kt_rows + vt_rows) + 1) : 0);
  __m512i* const operands =
      reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(operands_raw.data()) + 63) & ~uintptr_t{63});
  const bool prefill_tiles = attend_prefill != nullptr;
#else
  const bool prefill_tiles = false;
#endif
  const float* cs = float_data(cos, T * D, "cos");
  const float* sn = float_data(sin, T * D, "sin");
  const float feps = static_cast<float>(eps);
  const int64_t nq = n_heads * D, nkv = n_kv_heads * D, nqkv = nq + 2 * nkv;
  const int64_t group = n_heads / n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Attention work items: the query vectors (rows x heads) of one slot's kv head over one
  // block of its keys (a bf16 cache's steps; otherwise all keys are one block), the queries
  // cut into pieces of at most kMaxGroupQueries, and further while there are fewer blocks
  // than two per thread; each item streams its block of the kv head's cache once. How
  // queries are grouped never changes their results.
  const bool blocked = attend_bf16 && !prefill_tiles;
  const auto n_blocks = [&](int64_t n) { return blocked ? (n + kBlockKeys - 1) / kBlockKeys : int64_t{1}; };
  struct Item { int64_t first, slot, kv, q0, q1, block; };
  std::vector<Item> items;
  std::vector<int64_t> group_blocks;
  int64_t units = 0;
  for (const auto& [first, end] : groups) {
    group_blocks.push_back(n_blocks(*std::max_element(n_keys.begin() + first, n_keys.begin() + end)));
    units += n_kv_heads * group_blocks.back();
  }
  const int64_t min_parts = (2 * at::get_num_threads() + units - 1) / units;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto [first, end] = groups[g];
    const int64_t per_kv = group * (end - first);
    const int64_t parts = std::min(per_kv, std::max((per_kv + kMaxGroupQueries - 1) / kMaxGroupQueries, min_parts));
    for (int64_t kv = 0; kv < n_kv_heads; ++kv)
      for (int64_t b = 0; b < group_blocks[g]; ++b)
        for (int64_t part = 0; part < parts; ++part)
          items.push_back({first, slots[first], kv, part * per_kv / parts, (part + 1) * per_kv / parts, b});
  }
  // The blocks' partial results (d + 2 floats each, combine_blocks) of queries with more
  // than one block: [row, head, block].
  const int64_t most_blocks = n_blocks(max_keys), part_size = D + 2;
  std::vector<float> partials(most_blocks > 1 ? T * n_heads * most_blocks * part_size : 0);

  // Per layer: its norm weights and its linears by input (step_linears.h: Int8Linears and
  // W4A8Linears in any mix), all checked here, before the parallel region (nothing in it may
  // throw).
  struct LayerPlan {
    const float *w_in, *w_post, *w_qn, *w_kn;
    int64_t inter;
  };
  std::vector<LayerPlan> plan;
  std::vector<quasar::LayerLinears> linears;
  linears.reserve(L);  // the GEMMs below point into it
  int64_t inter_max = 0;
  for (int64_t l = 0; l < L; ++l) {
    linears.push_back(quasar::layer_linears(weights, tiles, scales, biases, comps, act_bits, w4, w4_groups, l, H, nq,
                                            nkv));
    const int64_t inter = linears.back().inter;
    inter_max = std::max(inter_max, inter);
    const std::optional<at::Tensor> qn = norms.get(4 * l + 2), kn = norms.get(4 * l + 3);
    TORCH_CHECK(norms.get(4 * l).has_value() && norms.get(4 * l + 1).has_value(),
                "w8a8_decoder_layers: missing layer norm");
    plan.push_back({float_data(*norms.get(4 * l), H, "input_layernorm"),
                    float_data(*norms.get(4 * l + 1), H, "post_attention_layernorm"),
                    qn.has_value() && qn->defined() ? float_data(*qn, D, "q_norm") : nullptr,
                    kn.has_value() && kn->defined() ? float_data(*kn, D, "k_norm") : nullptr, inter});
  }
  at::Tensor out = x.clone();  // the residual stream, updated in place layer by layer
  float* xs = out.data_ptr<float>();
  std::vector<float> h(T * H), proj(T * std::max(nqkv, H)), attn(T * nq), gu(T * 2 * inter_max),
      act(T * inter_max);
  // The quantized activations of the GEMM at hand: phases are separated by barriers, so one
  // set serves every GEMM.
  quasar::StepActs acts(T, std::max({H, nq, inter_max}));
  std::vector<quasar::StepGemm> gemms;  // 4 per layer: qkv, o, gate_up, down
  gemms.reserve(4 * L);
  for (int64_t l = 0; l < L; ++l) {
    const quasar::LayerLinears& g = linears[l];
    gemms.emplace_back(g.qkv, acts, T, proj.data(), nqkv);
    gemms.emplace_back(g.o, acts, T, proj.data(), H);
    gemms.emplace_back(g.gate_up, acts, T, gu.data(), 2 * g.inter);
    gemms.emplace_back(g.down, acts, T, proj.data(), H);
  }
  // Attention items are taken dynamically (their cost varies with each slot's length): one
  // counter per layer, so no reset is needed between layers.
  std::unique_ptr<std::atomic<int64_t>[]> next_item(new std::atomic<int64_t>[L]);
  for (int64_t l = 0; l < L; ++l) next_item[l] = 0;
  const int64_t n_items = static_cast<int64_t>(items.size());
  float* const k_f32 = bf16 ? nullptr : k_cache.data_ptr<float>();
  float* const v_f32 = bf16 ? nullptr : v_cache.data_ptr<float>();
  uint16_t* const k_b16 = bf16 ? reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* const v_b16 = bf16 ? reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>()) : nullptr;

  // The whole step is one parallel region: each layer is a sequence of phases separated by
  // barriers, so the glue between GEMMs (norms, quantization, RoPE, SiLU, residuals) is
  // spread over the threads by rows instead of running on one while the others wait, and
  // the ~150 fork/joins of a region per GEMM and attention call are gone. Row phases give
  // each thread the same rows throughout (so a row's residual add and the next norm need no
  // barrier); GEMM phases split the output vectors; every row and every output column is
  // computed alone, so how the work is split never changes a bit.
  const int n_threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(n_threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = T * tid / nt, r1 = T * (tid + 1) / nt, nr = r1 - r0;  // this thread's rows
    // the GEMMs' phases: quantize this thread's rows (before a barrier), then its share of the outputs
    const auto quantize = [&](const quasar::StepGemm& g, const float* src) { g.quantize(src, r0, r1); };
    const auto run_gemm = [&](const quasar::StepGemm& g) { g.run(tid, nt); };
    std::vector<float> scores(kMaxGroupQueries * stride), acc(kMaxGroupQueries * 2 * D);
    std::vector<uint16_t> probs(bf16 ? kMaxGroupQueries * stride : 0);
#ifdef QUASAR_AMX_ATTENTION
    // attend_group_amx's operands of one block, 64-byte aligned by hand
    std::vector<uint8_t> amx_raw(attend_amx ? 64 * (2 * kBlockKeys / 16 * D / 2 + 1) : 0);
    __m512i* const amx_ops =
        reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(amx_raw.data()) + 63) & ~uintptr_t{63});
#endif

    for (int64_t l = 0; l < L; ++l) {
      const LayerPlan& p = plan[l];
      const quasar::StepGemm* lg = gemms.data() + 4 * l;
      // attention block: norm and quantize this thread's rows, then q, k, v
      if (nr) rms_norm(xs + r0 * H, nr, H, p.w_in, feps, h.data() + r0 * H);
      quantize(lg[0], h.data());
#pragma omp barrier
      run_gemm(lg[0]);
#pragma omp barrier
      // qk-norm, RoPE and the K/V of this thread's rows into this layer's cache (float32 or
      // bf16; slot s's kv head h at ((s * KVH + h) * S) * D)
      const int64_t layer_at = l * n_slots * n_kv_heads * S * D;
      for (int64_t t = r0; t < r1; ++t) {
        float* row = proj.data() + t * nqkv;
        if (p.w_qn) rms_norm(row, n_heads, D, p.w_qn, feps, row);
        if (p.w_kn) rms_norm(row + nq, n_kv_heads, D, p.w_kn, feps, row + nq);
        for (int64_t hd = 0; hd < n_heads + n_kv_heads; ++hd) rope(row + hd * D, cs + t * D, sn + t * D, D);
        for (int64_t kv = 0; kv < n_kv_heads; ++kv) {
          const int64_t at_row = layer_at + ((slots[t] * n_kv_heads + kv) * S + cache_row[t]) * D;
          if (bf16) {
            const auto store = widened_bf16 ? fk.store_b16 : quasar::step::store_bf16;
            store(row + nq + kv * D, D, k_b16 + at_row);
            store(row + nq + nkv + kv * D, D, v_b16 + at_row);
          } else {
            std::copy_n(row + nq + kv * D, D, k_f32 + at_row);
            std::copy_n(row + nq + nkv + kv * D, D, v_f32 + at_row);
          }
        }
      }
#pragma omp barrier
#ifdef QUASAR_AMX_ATTENTION
      if (attend_prefill) {  // the tiles' operands of every kv head, 16 keys a unit
        const int64_t units = n_kv_heads * halves, first = groups[0].first;
        for (int64_t u = units * tid / nt; u < units * (tid + 1) / nt; ++u) {
          const int64_t kv = u / halves, head = layer_at + (slots[first] * n_kv_heads + kv) * S * D;
          __m512i* kt = operands + kv * (kt_rows + vt_rows);
          prefill_operands_fn(k_b16 + head, v_b16 + head, max_keys, u % halves, kt, kt + kt_rows);
        }
#pragma omp barrier
      }
#endif
      for (int64_t i = next_item[l]++; i < n_items; i = next_item[l]++) {
        const Item& it = items[i];
        const float* qp[kMaxGroupQueries];
        float *op[kMaxGroupQueries], *pp[kMaxGroupQueries];
        int64_t ns[kMaxGroupQueries], sp[kMaxGroupQueries];
        const int64_t* tl[kMaxGroupQueries];
        for (int64_t qi = it.q0; qi < it.q1; ++qi) {
          const int64_t t = it.first + qi / group, hd = it.kv * group + qi % group;
          qp[qi - it.q0] = proj.data() + t * nqkv + hd * D;
          op[qi - it.q0] = attn.data() + t * nq + hd * D;
          pp[qi - it.q0] = n_blocks(n_keys[t]) > 1
                               ? partials.data() + ((t * n_heads + hd) * most_blocks + it.block) * part_size
                               : nullptr;
          ns[qi - it.q0] = n_keys[t];
          sp[qi - it.q0] = split[t];
          tl[qi - it.q0] = tails[t];
        }
        const int64_t head = layer_at + (it.slot * n_kv_heads + it.kv) * S * D;
#ifdef QUASAR_AMX_ATTENTION
        if (attend_prefill) {
          const __m512i* kt = operands + it.kv * (kt_rows + vt_rows);
          attend_prefill(qp, ns, op, it.q1 - it.q0, kt, kt + kt_rows, scale, scores.data(), probs.data(), stride,
                         acc.data());
          continue;
        }
        if (attend_amx) {
          attend_amx(qp, ns, KeyMap{sp, tl}, op, pp, it.q1 - it.q0, it.block * kBlockKeys, (it.block + 1) * kBlockKeys,
                     k_b16 + head, v_b16 + head, scale, scores.data(), probs.data(), stride, acc.data(), amx_ops);
          continue;
        }
#endif
        if (attend_b16)
          attend_b16(qp, ns, KeyMap{sp, tl}, op, it.q1 - it.q0, k_b16 + head, v_b16 + head, scale, scores.data(),
                     stride, acc.data());
        else if (bf16)
          attend_bf16(qp, ns, KeyMap{sp, tl}, op, pp, it.q1 - it.q0, it.block * kBlockKeys,
                      (it.block + 1) * kBlockKeys, k_b16 + head, v_b16 + head, scale, scores.data(),
                      probs.data(), stride, acc.data());
        else
          attend(qp, ns, KeyMap{sp, tl}, op, it.q1 - it.q0, k_f32 + head, v_f32 + head, scale, scores.data(),
                 stride, acc.data());
      }
#pragma omp barrier
      if (most_blocks > 1)  // this thread's rows: join the blocks of queries that have several
        for (int64_t t = r0; t < r1; ++t) {
          const int64_t nb = n_blocks(n_keys[t]);
          if (nb > 1)
            for (int64_t hd = 0; hd < n_heads; ++hd)
              quasar::step::combine_blocks(partials.data() + (t * n_heads + hd) * most_blocks * part_size, nb, D,
                             attn.data() + t * nq + hd * D);
        }
      quantize(lg[1], attn.data());
#pragma omp barrier
      run_gemm(lg[1]);
#pragma omp barrier
      // MLP block: residual, norm and quantize this thread's rows, then gate and up
      if (nr) {
        add_into(xs + r0 * H, proj.data() + r0 * H, nr * H);
        rms_norm(xs + r0 * H, nr, H, p.w_post, feps, h.data() + r0 * H);
      }
      quantize(lg[2], h.data());
#pragma omp barrier
      run_gemm(lg[2]);
#pragma omp barrier
      if (nr) silu_mul(gu.data() + r0 * 2 * p.inter, nr, p.inter, act.data() + r0 * p.inter);
      quantize(lg[3], act.data());
#pragma omp barrier
      run_gemm(lg[3]);
#pragma omp barrier
      if (nr) add_into(xs + r0 * H, proj.data() + r0 * H, nr * H);  // the next layer reads the same rows
    }
  }
  return out;
}

// Whether w8a8_decoder_layers takes a bfloat16 KV cache here: AVX512-BF16 on the AVX512
// paths, widened to float32 by the 8-float kernels below them.
bool w8a8_bf16_supported() { return float_kernels().attend_b16 != nullptr || quasar::step::bf16_supported(); }

// Whether attention over a bfloat16 cache (prompt chunks and verifier steps) uses AMX-BF16
// tiles here.
bool w8a8_amx_attention_supported() {
  return quasar::step::bf16_supported() && quasar::step::amx_bf16_supported();
}
