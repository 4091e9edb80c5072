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
//   h = rmsnorm(x) * w_post; x += W_down(silu(W_gate(h)) * W_up(h)), or in a mixture-of-
//   experts layer x += its sparse MLP of h (sparse_mlp.h: router, each expert the rows
//   reach once over them, an optional shared expert).
// Gemma 3's block (BlockArgs): six norms a layer, the attention's and the MLP's outputs
// normed before each residual add; a GELU-tanh GeGLU; its own attention scale; the sliding
// layers' RoPE table and window (window_rows).
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
// kernels of the active path from step_kernels.h (AVX512: step/x86_avx512.cpp; AVX2 and plain
// C++: step/vec8.inc), attention over a bfloat16 cache from attention/attention.h. The op is
// one DecoderStep: its constructor checks the arguments and plans the work (rows and their
// keys, the kernels, the attention items, each layer's linears), run() is one parallel region
// of named phases per layer (attention block, then MLP block).

#include "attention/attention.h"
#include "decoder_layer/sparse_mlp.h"
#include "decoder_layer/step_linears.h"
#include "step/step_kernels.h"
#include "ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
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
using quasar::step::kBlockKeys;
using AttendFn = quasar::step::AttendF32Fn;
using quasar::step::AttendBf16Fn;
using TensorList = c10::List<std::optional<at::Tensor>>;

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

using quasar::KernelPath;

// The float kernels of kernel path `path` (step_kernels.h).
const quasar::step::FloatKernels& float_kernels(KernelPath path) {
  if (quasar::path_at_least(path, KernelPath::kAvx512Vnni)) return quasar::step::float_kernels_avx512();
  if (quasar::path_at_least(path, KernelPath::kAvx2)) return quasar::step::float_kernels_avx2();
  return quasar::step::float_kernels_portable();
}

// The kernel path an op named `op` runs: `name`, or the process default for "" (throws for
// an unknown name or a path this CPU does not run).
KernelPath op_kernel_path(const std::string& name, const char* op) {
  KernelPath path;
  TORCH_CHECK(quasar::resolve_kernel_path(name.c_str(), &path), op, ": unknown kernel path '", name,
              "' or one this CPU does not run");
  return path;
}

const float* float_data(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
              "w8a8_decoder_layers: ", what, " must be a contiguous float32 tensor of ", numel,
              " elements");
  return t.data_ptr<float>();
}

// 64-byte aligned __m512i storage inside `raw` (resized to hold `vectors` of them).
#ifdef QUASAR_AMX_ATTENTION
__m512i* aligned_vectors(std::vector<uint8_t>& raw, int64_t vectors) {
  raw.resize(vectors > 0 ? 64 * (vectors + 1) : 0);
  return reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63});
}
#endif

// The shapes and list lengths of the op's arguments (see w8a8_decoder_layers); throws.
void check_step_args(const at::Tensor& x, const at::Tensor& k_cache, const at::Tensor& v_cache, at::IntArrayRef slots,
                     at::IntArrayRef starts, at::IntArrayRef parents, int64_t n_norms, int64_t n_sparse_args,
                     int64_t n_heads, int64_t n_kv_heads, KernelPath path) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "w8a8_decoder_layers: x must be contiguous float32 [1, T, H]");
  const int64_t T = x.size(1);
  TORCH_CHECK(T >= 1 && T <= kMaxRows, "w8a8_decoder_layers: 1..", kMaxRows, " rows, got ", T);
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && (bf16 || k_cache.scalar_type() == at::kFloat) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.size(2) == n_kv_heads,
              "w8a8_decoder_layers: caches must be contiguous float32 or bfloat16 [L, slots, KVH, S, D]");
  // A bfloat16 cache is attended with AVX512-BF16 products (attention.h) on the AVX512
  // paths, and widened to float32 by the 8-float kernels (attend_b16) below them.
  TORCH_CHECK(!bf16 || float_kernels(path).attend_b16 != nullptr || quasar::step::bf16_supported(path),
              "w8a8_decoder_layers: a bfloat16 cache needs an AVX512-BF16 CPU on an AVX512 kernel path");
  TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
              "w8a8_decoder_layers: n_heads must be a multiple of n_kv_heads");
  const int64_t L = k_cache.size(0);
  TORCH_CHECK(n_norms == 4 * L || n_norms == 6 * L, "w8a8_decoder_layers: 4 (Gemma 3: 6) norms per cache layer");
  TORCH_CHECK(n_sparse_args == L, "w8a8_decoder_layers: a router, shared gate, top_k and norm_topk per cache layer");
  TORCH_CHECK(static_cast<int64_t>(parents.size()) == T && static_cast<int64_t>(slots.size()) == T &&
                  static_cast<int64_t>(starts.size()) == T && parents[0] == -1,
              "w8a8_decoder_layers: one slot, start and parent per row, parent -1 for the first");
}

// Per row: its cache row (where its K/V go), and its logical keys (KeyMap): n_keys[t] of
// them, rows [0, split[t]) of its slot's cache and then tails[t], the cache rows of the
// path from the first one off the slot's chain. `groups`: each slot's rows [first, end).
struct StepRows {
  std::vector<int64_t> n_keys, split, cache_row, tail_rows;
  std::vector<const int64_t*> tails;  // into tail_rows
  std::vector<std::pair<int64_t, int64_t>> groups;
  bool is_chain = true;
  int64_t max_keys = 0;
};

// Checks each row's slot and parent (the rows of a slot contiguous, a tree under its first
// row) and maps its keys.
StepRows plan_rows(at::IntArrayRef slots, at::IntArrayRef starts, at::IntArrayRef parents, int64_t n_slots,
                   int64_t S) {
  const int64_t T = static_cast<int64_t>(parents.size());
  StepRows r;
  r.n_keys.resize(T), r.split.resize(T), r.cache_row.resize(T), r.tail_rows.resize(T * T), r.tails.resize(T);
  std::vector<int64_t> path;
  std::vector<bool> seen(n_slots, false);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < n_slots, "w8a8_decoder_layers: slot ", slot, " is not in the cache");
    if (parents[t] == -1) {
      TORCH_CHECK(!seen[slot], "w8a8_decoder_layers: the rows of slot ", slot, " must be contiguous, one root");
      seen[slot] = true;
      r.groups.emplace_back(t, t + 1);
    } else {
      const int64_t p = parents[t];
      TORCH_CHECK(p >= r.groups.back().first && p < t && slots[p] == slot && starts[p] == starts[t],
                  "w8a8_decoder_layers: parents[", t, "] must be an earlier row of the same slot");
      r.groups.back().second = t + 1;
    }
    const int64_t first = r.groups.back().first;
    r.cache_row[t] = starts[t] + t - first;
    TORCH_CHECK(starts[t] >= 0 && r.cache_row[t] < S, "w8a8_decoder_layers: rows past the cache");
    path.clear();
    for (int64_t i = t; i != -1; i = parents[i]) path.push_back(i);
    std::reverse(path.begin(), path.end());
    int64_t m = 0;
    while (m < static_cast<int64_t>(path.size()) && path[m] == first + m) ++m;
    r.is_chain = r.is_chain && m == static_cast<int64_t>(path.size());
    r.n_keys[t] = starts[t] + static_cast<int64_t>(path.size());
    r.split[t] = starts[t] + m;
    for (size_t i = m; i < path.size(); ++i) r.tail_rows[t * T + (i - m)] = r.cache_row[path[i]];
    r.tails[t] = r.tail_rows.data() + t * T;
    r.max_keys = std::max(r.max_keys, r.n_keys[t]);
  }
  return r;
}

// The rows of a sliding-window layer: a row with more than `window` keys attends to its last
// `window` only, listed as its tail (split 0), so the kernels walk them as logical keys
// 0..window-1 like any path: the same arithmetic in every step that holds the row.
// Rows within the window keep their keys (and point into `rows`, which must outlive this).
std::optional<StepRows> window_rows(const StepRows& rows, int64_t window) {
  if (window <= 0 || rows.max_keys <= window) return std::nullopt;
  const int64_t T = static_cast<int64_t>(rows.n_keys.size());
  std::optional<StepRows> w(std::in_place, rows);
  w->tail_rows.assign(T * window, 0);
  w->max_keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = rows.n_keys[t];
    if (n > window) {
      int64_t* list = w->tail_rows.data() + t * window;
      for (int64_t j = 0; j < window; ++j) {
        const int64_t key = n - window + j;
        list[j] = key < rows.split[t] ? key : rows.tails[t][key - rows.split[t]];
      }
      w->n_keys[t] = window, w->split[t] = 0, w->tails[t] = list;
      w->is_chain = false;
    }
    w->max_keys = std::max(w->max_keys, w->n_keys[t]);
  }
  return w;
}

// The attention kernels of a step: one of attend (float32 cache), attend_b16 (a bfloat16
// cache widened to float32, below the AVX512 paths) or attend_bf16 (AVX512-BF16), and on an
// AMX-BF16 CPU the tile kernels: attend_amx for every step over a bf16 cache, attend_prefill
// (with the operands it shares per kv head) for a prompt chunk (allowed for prefill only).
// A batch of chains keeps the plain kernels (no key lookups at all).
struct AttentionKernels {
  AttendFn attend = nullptr;
  quasar::step::AttendB16Fn attend_b16 = nullptr;
  AttendBf16Fn attend_bf16 = nullptr;
#ifdef QUASAR_AMX_ATTENTION
  quasar::step::AttendAmxFn attend_amx = nullptr;
  quasar::step::AttendPrefillFn attend_prefill = nullptr;
  quasar::step::PrefillOperandsFn prefill_operands = nullptr;
#endif
  bool prefill_tiles = false;  // attend_prefill is set
};

AttentionKernels attention_kernels(const quasar::step::FloatKernels& fk, bool bf16, int64_t D, const StepRows& rows,
                                   bool prefill, KernelPath path) {
  AttentionKernels k;
  const bool widened_bf16 = bf16 && fk.attend_b16 != nullptr, paths = !rows.is_chain;
  k.attend = fk.attend(D, paths);
  k.attend_b16 = widened_bf16 ? fk.attend_b16(D, paths) : nullptr;
  k.attend_bf16 = bf16 && !widened_bf16 ? quasar::step::attend_bf16(D, paths) : nullptr;
#ifdef QUASAR_AMX_ATTENTION
  if (k.attend_bf16 && quasar::step::amx_bf16_supported(path)) k.attend_amx = quasar::step::attend_amx(D, paths);
#endif
  TORCH_CHECK(k.attend != nullptr, "w8a8_decoder_layers: head_dim must be 16, 32, 48, 64, 80, 96, 128 or 256");
  TORCH_CHECK(!bf16 || k.attend_bf16 != nullptr || k.attend_b16 != nullptr,
              "w8a8_decoder_layers: a bfloat16 cache needs head_dim 32, 64, 96, 128 or 256");
#ifdef QUASAR_AMX_ATTENTION
  if (prefill && k.attend_bf16 && rows.is_chain && rows.groups.size() == 1 && quasar::step::amx_bf16_supported(path))
    std::tie(k.attend_prefill, k.prefill_operands) = quasar::step::attend_prefill(D);
  k.prefill_tiles = k.attend_prefill != nullptr;
#else
  (void)prefill, (void)path;
#endif
  return k;
}

// Attention work items: the query vectors (rows x heads) of one slot's kv head over one
// block of its keys (a bf16 cache's steps; otherwise all keys are one block), the queries
// cut into pieces of at most kMaxGroupQueries, and further while there are fewer blocks
// than two per thread; each item streams its block of the kv head's cache once. How
// queries are grouped never changes their results.
struct Item {
  int64_t first, slot, kv, q0, q1, block;
};

// A layer's norm weights (q_norm and k_norm null without qk-norm; the output norms null
// outside Gemma 3), its RoPE table (the sliding layers' second one) and MLP width.
struct LayerPlan {
  const float *w_in, *w_post, *w_qn, *w_kn, *w_attn_out, *w_mlp_out;
  bool local_rope;
  int64_t inter;
};

// The op's Gemma 3 arguments (w8a8_decoder_layers); all empty or zero for the Llama block.
struct BlockArgs {
  const std::optional<at::Tensor>& cos_local;
  const std::optional<at::Tensor>& sin_local;
  at::IntArrayRef local_layers;
  double attn_scale;
  int64_t gelu;
};

// act = gelu_tanh(gate) * up per row of gu (gate then up, inter each) for the columns [c0, c1),
// a plain loop on every kernel path.
void gelu_tanh_mul(const float* gu, int64_t rows, int64_t inter, int64_t c0, int64_t c1, float* act) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    for (int64_t i = c0; i < c1; ++i)
      act[r * inter + i] = 0.5f * g[i] * (1.0f + std::tanh(c * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * g[inter + i];
  }
}

// This thread's rows of the step's row phases, [r0, r1).
struct ThreadRows {
  int tid, nt;
  int64_t r0, r1, nr;
};

// A thread's attention scratch (and attend_group_amx's operands of one block, aligned).
struct AttentionScratch {
  std::vector<float> scores, acc;
  std::vector<uint16_t> probs;
#ifdef QUASAR_AMX_ATTENTION
  std::vector<uint8_t> amx_raw;
  __m512i* amx_ops = nullptr;
#endif
};

// The op's mixture-of-experts arguments, per layer (w8a8_decoder_layers).
struct SparseArgs {
  const TensorList& routers;
  const TensorList& shared_gates;
  at::IntArrayRef top_k, norm_topk;
  const quasar::ExpertPlan& experts;
  const std::optional<at::Tensor>& counts;
};

// One call of the op: its constructor checks the arguments and plans the work; run()
// computes all layers in one parallel region.
class DecoderStep {
 public:
  DecoderStep(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
              at::Tensor& v_cache, at::IntArrayRef slots, at::IntArrayRef starts, at::IntArrayRef parents,
              double eps, int64_t n_heads, int64_t n_kv_heads, bool prefill, int64_t window, KernelPath path);
  // Per layer: its norms and its linears (step_linears.h), a sparse layer's router and
  // experts too, all checked here, before the parallel region (nothing in it may throw);
  // then the buffers they write.
  void plan_layers(const TensorList& norms, const quasar::LinearLists& lists, const SparseArgs& moe,
                   const BlockArgs& block);
  at::Tensor run();

 private:
  int64_t n_blocks(int64_t n) const { return blocked_ ? (n + kBlockKeys - 1) / kBlockKeys : int64_t{1}; }
  void plan_attention();
  void plan_block(const BlockArgs& block);
  bool plan_sparse(int64_t l, int64_t sparse_index, const SparseArgs& moe);
  void plan_buffers(int64_t inter_max, const SparseArgs& moe);
  void attention_block(int64_t l, const ThreadRows& tr, AttentionScratch& sc);
  void rope_and_store(int64_t l, const ThreadRows& tr);
  void prefill_operands(int64_t l, const ThreadRows& tr);
  std::vector<Item> plan_items(const StepRows& rows) const;
  void attend_item(const Item& it, int64_t layer_at, const StepRows& rows, const AttentionKernels& kern,
                   AttentionScratch& sc);
  void combine_row_blocks(const ThreadRows& tr, const StepRows& rows);
  void mlp_block(int64_t l, const ThreadRows& tr);

  // the step's shape and inputs
  const at::Tensor& x_;
  at::IntArrayRef slots_;
  int64_t T_, H_, L_, n_slots_, S_, D_, n_heads_, n_kv_heads_, nq_, nkv_, nqkv_, group_;
  const float *cs_, *sn_, *cs_local_ = nullptr, *sn_local_ = nullptr;
  float feps_, scale_;
  bool gelu_ = false;
  bool bf16_;
  float *k_f32_, *v_f32_;
  uint16_t *k_b16_, *v_b16_;
  // the kernel path, its kernels and the rows
  KernelPath path_;
  const quasar::step::FloatKernels& fk_;
  StepRows rows_;
  AttentionKernels kern_;
  // attention: the items, score-row stride, the blocks' partial results (d + 2 floats each,
  // combine_blocks) of queries with more than one block: [row, head, block]
  bool blocked_;
  int64_t stride_, most_blocks_, part_size_;
  std::vector<Item> items_;
  // the sliding-window layers' rows, kernels and items, when some row has more keys than
  // the window (Gemma 3; window_rows)
  std::optional<StepRows> local_rows_;
  std::optional<AttentionKernels> local_kern_;
  std::vector<Item> local_items_;
  std::vector<float> partials_;
  // Attention items are taken dynamically (their cost varies with each slot's length): one
  // counter per layer, so no reset is needed between layers.
  std::unique_ptr<std::atomic<int64_t>[]> next_item_;
#ifdef QUASAR_AMX_ATTENTION
  // attend_prefill's operands, per kv head: K^T per 16 keys (D / 2 rows of 64 bytes) and V
  // pairs per 32 keys (D rows), for every key of the step (stride covers them in whole
  // 32-key chunks)
  int64_t kt_rows_ = 0, vt_rows_ = 0, halves_ = 0;
  std::vector<uint8_t> operands_raw_;
  __m512i* operands_ = nullptr;
#endif
  // the layers: plans, linears (the GEMMs point into them), 4 GEMMs each (qkv, o, gate_up,
  // down) and the activations between them
  std::vector<LayerPlan> plan_;
  std::vector<quasar::LayerLinears> linears_;
  std::vector<quasar::StepGemm> gemms_;
  // the sparse layers' routers and experts (n_experts 0 for a dense layer) and their step
  std::vector<quasar::SparseLayer> sparse_;
  std::optional<quasar::SparseStep> sparse_step_;
  std::optional<quasar::StepActs> acts_;
  std::vector<float> h_, proj_, attn_, gu_, act_;
  at::Tensor out_;  // the residual stream, updated in place layer by layer
  float* xs_ = nullptr;
};

DecoderStep::DecoderStep(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, at::IntArrayRef slots, at::IntArrayRef starts, at::IntArrayRef parents,
                         double eps, int64_t n_heads, int64_t n_kv_heads, bool prefill, int64_t window,
                         KernelPath path)
    : x_(x),
      slots_(slots),
      T_(x.size(1)),
      H_(x.size(2)),
      L_(k_cache.size(0)),
      n_slots_(k_cache.size(1)),
      S_(k_cache.size(3)),
      D_(k_cache.size(4)),
      n_heads_(n_heads),
      n_kv_heads_(n_kv_heads),
      nq_(n_heads * D_),
      nkv_(n_kv_heads * D_),
      nqkv_(nq_ + 2 * nkv_),
      group_(n_heads / n_kv_heads),
      feps_(static_cast<float>(eps)),
      scale_(1.0f / std::sqrt(static_cast<float>(D_))),
      bf16_(k_cache.scalar_type() == at::kBFloat16),
      path_(path),
      fk_(float_kernels(path)),
      rows_(plan_rows(slots, starts, parents, n_slots_, S_)),
      kern_(attention_kernels(fk_, bf16_, D_, rows_, prefill, path)) {
  stride_ = (rows_.max_keys + 31) / 32 * 32;  // of the score rows (32-key tiles in prefill)
  local_rows_ = window_rows(rows_, window);
  if (local_rows_) {  // the prefill tiles take whole prefixes of keys: not a window's
    if (kern_.prefill_tiles) kern_ = attention_kernels(fk_, bf16_, D_, rows_, false, path);
    local_kern_ = attention_kernels(fk_, bf16_, D_, *local_rows_, false, path);
  }
  cs_ = float_data(cos, T_ * D_, "cos");
  sn_ = float_data(sin, T_ * D_, "sin");
  k_f32_ = bf16_ ? nullptr : k_cache.data_ptr<float>();
  v_f32_ = bf16_ ? nullptr : v_cache.data_ptr<float>();
  k_b16_ = bf16_ ? reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>()) : nullptr;
  v_b16_ = bf16_ ? reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>()) : nullptr;
  plan_attention();
}

void DecoderStep::plan_attention() {
#ifdef QUASAR_AMX_ATTENTION
  kt_rows_ = stride_ / 16 * D_ / 2, vt_rows_ = stride_ / 32 * D_, halves_ = stride_ / 16;
  operands_ = aligned_vectors(operands_raw_, kern_.prefill_tiles ? n_kv_heads_ * (kt_rows_ + vt_rows_) : 0);
#endif
  blocked_ = kern_.attend_bf16 && !kern_.prefill_tiles;
  items_ = plan_items(rows_);
  if (local_rows_) local_items_ = plan_items(*local_rows_);
  most_blocks_ = n_blocks(rows_.max_keys), part_size_ = D_ + 2;
  partials_.resize(most_blocks_ > 1 ? T_ * n_heads_ * most_blocks_ * part_size_ : 0);
  next_item_.reset(new std::atomic<int64_t>[L_]);
  for (int64_t l = 0; l < L_; ++l) next_item_[l] = 0;
}

// The attention items of a step's rows (see Item).
std::vector<Item> DecoderStep::plan_items(const StepRows& rows) const {
  std::vector<Item> items;
  std::vector<int64_t> group_blocks;
  int64_t units = 0;
  for (const auto& [first, end] : rows.groups) {
    group_blocks.push_back(n_blocks(*std::max_element(rows.n_keys.begin() + first, rows.n_keys.begin() + end)));
    units += n_kv_heads_ * group_blocks.back();
  }
  const int64_t min_parts = (2 * at::get_num_threads() + units - 1) / units;
  for (size_t g = 0; g < rows.groups.size(); ++g) {
    const auto [first, end] = rows.groups[g];
    const int64_t per_kv = group_ * (end - first);
    const int64_t parts = std::min(per_kv, std::max((per_kv + kMaxGroupQueries - 1) / kMaxGroupQueries, min_parts));
    for (int64_t kv = 0; kv < n_kv_heads_; ++kv)
      for (int64_t b = 0; b < group_blocks[g]; ++b)
        for (int64_t part = 0; part < parts; ++part)
          items.push_back({first, slots_[first], kv, part * per_kv / parts, (part + 1) * per_kv / parts, b});
  }
  return items;
}

void DecoderStep::plan_layers(const TensorList& norms, const quasar::LinearLists& lists, const SparseArgs& moe,
                              const BlockArgs& block) {
  TORCH_CHECK(static_cast<int64_t>(lists.weights.size()) == 7 * L_, "w8a8_decoder_layers: 7 linears per layer");
  const int64_t per = static_cast<int64_t>(norms.size()) / L_;  // 4, or Gemma 3's 6
  plan_block(block);
  linears_.reserve(L_);  // the GEMMs and the shared experts below point into it
  sparse_.resize(L_);
  int64_t inter_max = 0, n_sparse = 0;
  for (int64_t l = 0; l < L_; ++l) {
    const bool sparse = plan_sparse(l, n_sparse, moe);
    n_sparse += sparse;
    linears_.push_back(quasar::layer_linears(lists, 7 * l, H_, nq_, nkv_, !sparse || sparse_[l].shared_gate));
    if (sparse_[l].shared_gate) sparse_[l].shared = &linears_.back().mlp;
    const int64_t inter = linears_.back().mlp.inter;
    inter_max = std::max(inter_max, inter);
    const auto norm = [&](int64_t i, int64_t n, const char* what) -> const float* {
      const std::optional<at::Tensor> w = i < per ? norms.get(per * l + i) : std::nullopt;
      return w.has_value() && w->defined() ? float_data(*w, n, what) : nullptr;
    };
    const float *w_in = norm(0, H_, "input norm"), *w_post = norm(1, H_, "MLP input norm");
    const float *w_attn_out = norm(4, H_, "attention output norm"), *w_mlp_out = norm(5, H_, "MLP output norm");
    TORCH_CHECK(w_in && w_post && (per == 4 || (w_attn_out && w_mlp_out)), "w8a8_decoder_layers: missing layer norm");
    const bool local = !block.local_layers.empty() && block.local_layers[l] != 0;
    TORCH_CHECK(!local || cs_local_, "w8a8_decoder_layers: a sliding layer needs the local RoPE table");
    plan_.push_back({w_in, w_post, norm(2, D_, "q_norm"), norm(3, D_, "k_norm"), w_attn_out, w_mlp_out, local, inter});
  }
  TORCH_CHECK(n_sparse == static_cast<int64_t>(moe.experts.layers.size()),
              "w8a8_decoder_layers: the expert plan has ", moe.experts.layers.size(), " sparse layers, the model ",
              n_sparse);
  plan_buffers(inter_max, moe);
}

// Gemma 3's scale, activation and local RoPE table (block.cos_local [T, D]).
void DecoderStep::plan_block(const BlockArgs& block) {
  if (block.attn_scale > 0) scale_ = static_cast<float>(block.attn_scale);
  gelu_ = block.gelu != 0;
  TORCH_CHECK(block.local_layers.empty() || static_cast<int64_t>(block.local_layers.size()) == L_,
              "w8a8_decoder_layers: local_layers needs one flag per layer");
  if (block.cos_local.has_value() && block.cos_local->defined()) {
    TORCH_CHECK(block.sin_local.has_value() && block.sin_local->defined(),
                "w8a8_decoder_layers: cos_local without sin_local");
    cs_local_ = float_data(*block.cos_local, T_ * D_, "cos_local");
    sn_local_ = float_data(*block.sin_local, T_ * D_, "sin_local");
  }
}

// Layer l's router, shared gate and experts (the expert plan's sparse layer `sparse_index`)
// into sparse_[l]; false for a dense layer (no router).
bool DecoderStep::plan_sparse(int64_t l, int64_t sparse_index, const SparseArgs& moe) {
  const std::optional<at::Tensor> router = moe.routers.get(l), gate = moe.shared_gates.get(l);
  if (!router.has_value() || !router->defined()) return false;
  quasar::SparseLayer& s = sparse_[l];
  TORCH_CHECK(router->dim() == 2 && router->size(1) == H_, "w8a8_decoder_layers: a router must be [experts, H]");
  s.n_experts = router->size(0);
  s.router = float_data(*router, s.n_experts * H_, "a router");
  s.top_k = moe.top_k[l], s.norm_topk = moe.norm_topk[l] != 0;
  TORCH_CHECK(s.top_k >= 1 && s.top_k <= s.n_experts, "w8a8_decoder_layers: top_k must be 1..experts");
  if (gate.has_value() && gate->defined()) s.shared_gate = float_data(*gate, H_, "a shared expert's gate");
  const auto& layers = moe.experts.layers;
  TORCH_CHECK(sparse_index < static_cast<int64_t>(layers.size()) &&
                  static_cast<int64_t>(layers[sparse_index].size()) == s.n_experts,
              "w8a8_decoder_layers: the expert plan does not have the router's experts");
  s.experts = layers[sparse_index].data();
  int64_t w4_rows = 0;
  TORCH_CHECK(!moe.experts.w4[sparse_index] || quasar::w4_active_kernel(path_, &w4_rows) != nullptr,
              "w8a8_decoder_layers: every W4A8 kernel path is disabled (the self-check failed)");
  for (int64_t e = 0; e < s.n_experts; ++e)
    TORCH_CHECK(s.experts[e].gate_up.k == H_, "w8a8_decoder_layers: an expert's hidden size is not the model's");
  return true;
}

// The buffers the layers write, their GEMMs, and the sparse layers' step.
void DecoderStep::plan_buffers(int64_t inter_max, const SparseArgs& moe) {
  out_ = x_.clone();
  xs_ = out_.data_ptr<float>();
  h_.resize(T_ * H_), proj_.resize(T_ * std::max(nqkv_, H_)), attn_.resize(T_ * nq_);
  gu_.resize(T_ * 2 * inter_max), act_.resize(T_ * inter_max);
  // The quantized activations of the GEMM at hand: phases are separated by barriers, so one
  // set serves every GEMM.
  acts_.emplace(T_, std::max({H_, nq_, inter_max}));
  gemms_.reserve(4 * L_);
  for (int64_t l = 0; l < L_; ++l) {
    const quasar::LayerLinears& g = linears_[l];
    gemms_.emplace_back(g.qkv, *acts_, T_, proj_.data(), nqkv_, path_);
    gemms_.emplace_back(g.o, *acts_, T_, proj_.data(), H_, path_);
    gemms_.emplace_back(g.mlp.gate_up, *acts_, T_, gu_.data(), 2 * g.mlp.inter, path_);
    gemms_.emplace_back(g.mlp.down, *acts_, T_, proj_.data(), H_, path_);
  }
  if (std::none_of(sparse_.begin(), sparse_.end(), [](const quasar::SparseLayer& s) { return s.n_experts > 0; }))
    return;
  int32_t* counts = nullptr;
  int64_t stride = 0;
  if (moe.counts.has_value() && moe.counts->defined()) {
    const at::Tensor& c = *moe.counts;
    for (const quasar::SparseLayer& s : sparse_) stride = std::max(stride, s.n_experts);
    TORCH_CHECK(c.scalar_type() == at::kInt && c.is_contiguous() && c.dim() == 2 && c.size(0) == L_ &&
                    c.size(1) >= stride,
                "w8a8_decoder_layers: expert_counts must be a contiguous int32 [L, experts]");
    counts = c.data_ptr<int32_t>(), stride = c.size(1);
  }
  sparse_step_.emplace(sparse_, T_, H_, path_, fk_, counts, stride);
}

// The whole step is one parallel region: each layer is a sequence of phases separated by
// barriers, so the glue between GEMMs (norms, quantization, RoPE, SiLU, residuals) is
// spread over the threads by rows instead of running on one while the others wait, and
// the ~150 fork/joins of a region per GEMM and attention call are gone. Row phases give
// each thread the same rows throughout (so a row's residual add and the next norm need no
// barrier); GEMM phases split the output vectors; every row and every output column is
// computed alone, so how the work is split never changes a bit.
at::Tensor DecoderStep::run() {
  const int n_threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(n_threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const ThreadRows tr{tid, nt, T_ * tid / nt, T_ * (tid + 1) / nt, T_ * (tid + 1) / nt - T_ * tid / nt};
    AttentionScratch sc;
    sc.scores.resize(kMaxGroupQueries * stride_), sc.acc.resize(kMaxGroupQueries * 2 * D_);
    sc.probs.resize(bf16_ ? kMaxGroupQueries * stride_ : 0);
#ifdef QUASAR_AMX_ATTENTION
    sc.amx_ops = aligned_vectors(sc.amx_raw, kern_.attend_amx ? 2 * kBlockKeys / 16 * D_ / 2 : 0);
#endif
    for (int64_t l = 0; l < L_; ++l) {
      attention_block(l, tr, sc);
      mlp_block(l, tr);
    }
  }
  return out_;
}

// Norm and quantize this thread's rows, then q, k, v; qk-norm, RoPE and the K/V rows into
// the cache; attention; then the o projection.
void DecoderStep::attention_block(int64_t l, const ThreadRows& tr, AttentionScratch& sc) {
  const LayerPlan& p = plan_[l];
  const quasar::StepGemm* lg = gemms_.data() + 4 * l;
  if (tr.nr) fk_.rms_norm(xs_ + tr.r0 * H_, tr.nr, H_, p.w_in, feps_, h_.data() + tr.r0 * H_);
  lg[0].quantize(h_.data(), tr.r0, tr.r1);
#pragma omp barrier
  lg[0].run(tr.tid, tr.nt);
#pragma omp barrier
  rope_and_store(l, tr);
#pragma omp barrier
  const int64_t layer_at = l * n_slots_ * n_kv_heads_ * S_ * D_;
  if (kern_.prefill_tiles) {
    prefill_operands(l, tr);
#pragma omp barrier
  }
  const bool window = p.local_rope && local_rows_;  // a sliding layer past its window
  const StepRows& rows = window ? *local_rows_ : rows_;
  const AttentionKernels& kern = window ? *local_kern_ : kern_;
  const std::vector<Item>& items = window ? local_items_ : items_;
  const int64_t n_items = static_cast<int64_t>(items.size());
  for (int64_t i = next_item_[l]++; i < n_items; i = next_item_[l]++) attend_item(items[i], layer_at, rows, kern, sc);
#pragma omp barrier
  if (most_blocks_ > 1) combine_row_blocks(tr, rows);
  lg[1].quantize(attn_.data(), tr.r0, tr.r1);
#pragma omp barrier
  lg[1].run(tr.tid, tr.nt);
#pragma omp barrier
}

// qk-norm, RoPE and the K/V of this thread's rows into layer l's cache (float32 or bf16;
// slot s's kv head h at ((s * KVH + h) * S) * D).
void DecoderStep::rope_and_store(int64_t l, const ThreadRows& tr) {
  const LayerPlan& p = plan_[l];
  const int64_t layer_at = l * n_slots_ * n_kv_heads_ * S_ * D_;
  for (int64_t t = tr.r0; t < tr.r1; ++t) {
    float* row = proj_.data() + t * nqkv_;
    if (p.w_qn) fk_.rms_norm(row, n_heads_, D_, p.w_qn, feps_, row);
    if (p.w_kn) fk_.rms_norm(row + nq_, n_kv_heads_, D_, p.w_kn, feps_, row + nq_);
    const float *cs = p.local_rope ? cs_local_ : cs_, *sn = p.local_rope ? sn_local_ : sn_;
    for (int64_t hd = 0; hd < n_heads_ + n_kv_heads_; ++hd) rope(row + hd * D_, cs + t * D_, sn + t * D_, D_);
    for (int64_t kv = 0; kv < n_kv_heads_; ++kv) {
      const int64_t at_row = layer_at + ((slots_[t] * n_kv_heads_ + kv) * S_ + rows_.cache_row[t]) * D_;
      if (bf16_) {
        const auto store = kern_.attend_b16 ? fk_.store_b16 : quasar::step::store_bf16;
        store(row + nq_ + kv * D_, D_, k_b16_ + at_row);
        store(row + nq_ + nkv_ + kv * D_, D_, v_b16_ + at_row);
      } else {
        std::copy_n(row + nq_ + kv * D_, D_, k_f32_ + at_row);
        std::copy_n(row + nq_ + nkv_ + kv * D_, D_, v_f32_ + at_row);
      }
    }
  }
}

// attend_prefill's operands of every kv head, 16 keys a unit, split over the threads.
void DecoderStep::prefill_operands(int64_t l, const ThreadRows& tr) {
#ifdef QUASAR_AMX_ATTENTION
  const int64_t layer_at = l * n_slots_ * n_kv_heads_ * S_ * D_;
  const int64_t units = n_kv_heads_ * halves_, first = rows_.groups[0].first;
  for (int64_t u = units * tr.tid / tr.nt; u < units * (tr.tid + 1) / tr.nt; ++u) {
    const int64_t kv = u / halves_, head = layer_at + (slots_[first] * n_kv_heads_ + kv) * S_ * D_;
    __m512i* kt = operands_ + kv * (kt_rows_ + vt_rows_);
    kern_.prefill_operands(k_b16_ + head, v_b16_ + head, rows_.max_keys, u % halves_, kt, kt + kt_rows_);
  }
#else
  (void)l, (void)tr;
#endif
}

// One attention item: its queries' vectors, outputs and keys, then the kernel of the step.
void DecoderStep::attend_item(const Item& it, int64_t layer_at, const StepRows& rows, const AttentionKernels& kern,
                              AttentionScratch& sc) {
  const float* qp[kMaxGroupQueries];
  float *op[kMaxGroupQueries], *pp[kMaxGroupQueries];
  int64_t ns[kMaxGroupQueries], sp[kMaxGroupQueries];
  const int64_t* tl[kMaxGroupQueries];
  for (int64_t qi = it.q0; qi < it.q1; ++qi) {
    const int64_t t = it.first + qi / group_, hd = it.kv * group_ + qi % group_;
    qp[qi - it.q0] = proj_.data() + t * nqkv_ + hd * D_;
    op[qi - it.q0] = attn_.data() + t * nq_ + hd * D_;
    pp[qi - it.q0] = n_blocks(rows.n_keys[t]) > 1
                         ? partials_.data() + ((t * n_heads_ + hd) * most_blocks_ + it.block) * part_size_
                         : nullptr;
    ns[qi - it.q0] = rows.n_keys[t];
    sp[qi - it.q0] = rows.split[t];
    tl[qi - it.q0] = rows.tails[t];
  }
  const int64_t head = layer_at + (it.slot * n_kv_heads_ + it.kv) * S_ * D_, nq = it.q1 - it.q0;
  const int64_t lo = it.block * kBlockKeys, hi = (it.block + 1) * kBlockKeys;
  const KeyMap keys{sp, tl};
#ifdef QUASAR_AMX_ATTENTION
  if (kern.attend_prefill) {
    const __m512i* kt = operands_ + it.kv * (kt_rows_ + vt_rows_);
    kern.attend_prefill(qp, ns, op, nq, kt, kt + kt_rows_, scale_, sc.scores.data(), sc.probs.data(), stride_,
                         sc.acc.data());
    return;
  }
  if (kern.attend_amx) {
    kern.attend_amx(qp, ns, keys, op, pp, nq, lo, hi, k_b16_ + head, v_b16_ + head, scale_, sc.scores.data(),
                     sc.probs.data(), stride_, sc.acc.data(), sc.amx_ops);
    return;
  }
#endif
  if (kern.attend_b16)
    kern.attend_b16(qp, ns, keys, op, nq, k_b16_ + head, v_b16_ + head, scale_, sc.scores.data(), stride_,
                     sc.acc.data());
  else if (bf16_)
    kern.attend_bf16(qp, ns, keys, op, pp, nq, lo, hi, k_b16_ + head, v_b16_ + head, scale_, sc.scores.data(),
                      sc.probs.data(), stride_, sc.acc.data());
  else
    kern.attend(qp, ns, keys, op, nq, k_f32_ + head, v_f32_ + head, scale_, sc.scores.data(), stride_,
                 sc.acc.data());
}

// This thread's rows: join the blocks of queries that have several.
void DecoderStep::combine_row_blocks(const ThreadRows& tr, const StepRows& rows) {
  for (int64_t t = tr.r0; t < tr.r1; ++t) {
    const int64_t nb = n_blocks(rows.n_keys[t]);
    if (nb > 1)
      for (int64_t hd = 0; hd < n_heads_; ++hd)
        quasar::step::combine_blocks(partials_.data() + (t * n_heads_ + hd) * most_blocks_ * part_size_, nb, D_,
                                     attn_.data() + t * nq_ + hd * D_);
  }
}

// Residual, norm and quantize this thread's rows, then gate and up; SiLU, then down; the
// residual again (the next layer reads the same rows).
void DecoderStep::mlp_block(int64_t l, const ThreadRows& tr) {
  const LayerPlan& p = plan_[l];
  const quasar::StepGemm* lg = gemms_.data() + 4 * l;
  float* out = proj_.data() + tr.r0 * H_;  // this thread's rows of o's (then down's) output
  if (tr.nr) {
    if (p.w_attn_out) fk_.rms_norm(out, tr.nr, H_, p.w_attn_out, feps_, out);
    fk_.add_into(xs_ + tr.r0 * H_, out, tr.nr * H_);
    fk_.rms_norm(xs_ + tr.r0 * H_, tr.nr, H_, p.w_post, feps_, h_.data() + tr.r0 * H_);
  }
  if (sparse_[l].n_experts) {
    sparse_step_->run(l, h_.data(), xs_, tr.tid, tr.nt, tr.r0, tr.r1);
    return;
  }
  lg[2].quantize(h_.data(), tr.r0, tr.r1);
#pragma omp barrier
  lg[2].run(tr.tid, tr.nt);
#pragma omp barrier
  const auto act_fn = gelu_ ? gelu_tanh_mul : fk_.silu_mul;
  if (T_ < tr.nt && lg[3].columns_split()) {  // fewer rows than threads: split each row's groups
    const int64_t groups = p.inter / lg[3].group();
    const int64_t c0 = groups * tr.tid / tr.nt * lg[3].group(), c1 = groups * (tr.tid + 1) / tr.nt * lg[3].group();
    for (int64_t t = 0; t < T_; ++t) {
      act_fn(gu_.data() + t * 2 * p.inter, 1, p.inter, c0, c1, act_.data() + t * p.inter);
      lg[3].quantize_columns(act_.data(), t, c0, c1);
    }
  } else {
    if (tr.nr) act_fn(gu_.data() + tr.r0 * 2 * p.inter, tr.nr, p.inter, 0, p.inter, act_.data() + tr.r0 * p.inter);
    lg[3].quantize(act_.data(), tr.r0, tr.r1);
  }
#pragma omp barrier
  lg[3].run(tr.tid, tr.nt);
#pragma omp barrier
  if (tr.nr && p.w_mlp_out) fk_.rms_norm(out, tr.nr, H_, p.w_mlp_out, feps_, out);
  if (tr.nr) fk_.add_into(xs_ + tr.r0 * H_, out, tr.nr * H_);
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
// comps / act_bits / w4 / w4_groups[7l .. 7l+6] = the linears q, k, v, o, gate, up, down (a
// sparse layer's gate, up, down are its shared expert's, None without one): an Int8Linear has w4_groups 0 and weight,
// tiles (the weight packed by int8_pack_tiles, which the GEMMs read), scale, comp (128 *
// rowsum(weight), int32 [N]) and act_bits (8, or 15 for split 15-bit activations as in
// Int8Linear); a W4A8Linear has w4_groups = its group size, w4 = its weight packed by
// w4_pack, and None for the int8 ones; either may have a bias. Per layer l, a sparse layer
// (quasar/models/moe.py, decoder_layer/sparse_mlp.h) has routers[l] = its router float32
// [experts, H], shared_gates[l] its shared expert's gate float32 [1, H] (or None), top_k[l]
// experts a row, renormalized when norm_topk[l] != 0; a dense layer has None, None, 0, 0.
// experts: the sparse layers' experts, in layer order (w8a8_expert_plan; empty without any).
// expert_counts (None: not wanted) int32 [L, >= experts] gets each sparse layer's rows per
// expert. path: the kernel path ("" for the process default; cpu_features.h).
// Gemma 3: norms has 6 a layer (input, MLP input, q, k, attention output, MLP output, each
// already 1 + w); a layer with local_layers[l] != 0 slides: RoPE from cos_local / sin_local,
// each row attending to its last `window` keys (window > 0); attn_scale > 0 replaces
// 1 / sqrt(D); gelu != 0 uses GELU-tanh for SiLU.
at::Tensor w8a8_decoder_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& k_cache, at::Tensor& v_cache, at::IntArrayRef slots,
                               at::IntArrayRef starts, at::IntArrayRef parents, const TensorList& norms, double eps,
                               const TensorList& weights, const TensorList& tiles, const TensorList& scales,
                               const TensorList& biases, const TensorList& comps, at::IntArrayRef act_bits,
                               const TensorList& w4, at::IntArrayRef w4_groups, const TensorList& routers,
                               const TensorList& shared_gates, at::IntArrayRef top_k, at::IntArrayRef norm_topk,
                               const c10::intrusive_ptr<quasar::ExpertPlan>& experts,
                               const std::optional<at::Tensor>& expert_counts, int64_t n_heads, int64_t n_kv_heads,
                               bool prefill, const std::string& path,
                               const std::optional<at::Tensor>& cos_local, const std::optional<at::Tensor>& sin_local,
                               at::IntArrayRef local_layers, int64_t window, double attn_scale, int64_t gelu) {
  const KernelPath kernel_path = op_kernel_path(path, "w8a8_decoder_layers");
  const int64_t n_linears = static_cast<int64_t>(weights.size()), n_layers = static_cast<int64_t>(routers.size());
  TORCH_CHECK(static_cast<int64_t>(tiles.size()) == n_linears && static_cast<int64_t>(scales.size()) == n_linears &&
                  static_cast<int64_t>(biases.size()) == n_linears &&
                  static_cast<int64_t>(comps.size()) == n_linears &&
                  static_cast<int64_t>(act_bits.size()) == n_linears &&
                  static_cast<int64_t>(w4.size()) == n_linears &&
                  static_cast<int64_t>(w4_groups.size()) == n_linears,
              "w8a8_decoder_layers: the linears' lists must have the same length");
  const bool same_layers = static_cast<int64_t>(shared_gates.size()) == n_layers &&
                           static_cast<int64_t>(top_k.size()) == n_layers &&
                           static_cast<int64_t>(norm_topk.size()) == n_layers;
  check_step_args(x, k_cache, v_cache, slots, starts, parents, static_cast<int64_t>(norms.size()),
                  same_layers ? n_layers : -1, n_heads, n_kv_heads, kernel_path);
  DecoderStep step(x, cos, sin, k_cache, v_cache, slots, starts, parents, eps, n_heads, n_kv_heads, prefill, window,
                   kernel_path);
  step.plan_layers(norms, {weights, tiles, scales, biases, comps, act_bits, w4, w4_groups},
                   {routers, shared_gates, top_k, norm_topk, *experts, expert_counts},
                   {cos_local, sin_local, local_layers, attn_scale, gelu});
  return step.run();
}

// Whether w8a8_decoder_layers takes a bfloat16 KV cache on kernel path `path` ("": the
// default): AVX512-BF16 on the AVX512 paths, widened to float32 by the 8-float kernels below
// them.
bool w8a8_bf16_supported(const std::string& path) {
  const KernelPath p = op_kernel_path(path, "w8a8_bf16_supported");
  return float_kernels(p).attend_b16 != nullptr || quasar::step::bf16_supported(p);
}

// Whether attention over a bfloat16 cache (prompt chunks and verifier steps) uses AMX-BF16
// tiles on kernel path `path` ("": the default).
bool w8a8_amx_attention_supported(const std::string& path) {
  const KernelPath p = op_kernel_path(path, "w8a8_amx_attention_supported");
  return quasar::step::bf16_supported(p) && quasar::step::amx_bf16_supported(p);
}
