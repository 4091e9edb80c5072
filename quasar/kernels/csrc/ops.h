// Every op of the library, as bindings.cpp registers it (schemas there); defined beside the
// kernels they run. Arguments and results are documented at the definitions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace quasar {
struct ExpertPlan;  // decoder_layer/sparse_mlp.h
}

// common/library_ops.cpp: the kernel path and the library's threads
std::string kernel_path_op(const std::string& cap);
bool cpu_runs_path(const std::string& name);
int64_t parallel_threads();

// gemm_w8a8/linear_op.cpp: the W8A8 linear and the int8 GEMM's settings
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& comp, bool u8_single,
                       bool u8_multi, const std::optional<at::Tensor>& tiles, int64_t act_bits,
                       const std::string& path);
at::Tensor int8_pack_tiles(const at::Tensor& weight, bool release_source);
bool release_pages(const at::Tensor& t);
int64_t int8_small_m_max(int64_t max_m);
bool int8_small_m_supported();
int64_t int8_amx_min_rows(int64_t min_rows);
int64_t int8_stream_prefetch(int64_t mode);
bool int8_amx_supported();
bool int8_onednn_exact(int64_t value);

// gemm_w4a8/linear_op.cpp: the W4A8 linear
at::Tensor w4_pack(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& offsets, int64_t group);
at::Tensor w4_pack_q4k(const at::Tensor& q, const at::Tensor& scale_codes, const at::Tensor& offset_codes,
                       const at::Tensor& super_scales, const at::Tensor& super_offsets);
at::Tensor w4_pack_q6k(const at::Tensor& q, const at::Tensor& sub_scales, const at::Tensor& super_scales);
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t K, int64_t group,
                       const std::optional<at::Tensor>& bias, const std::string& path);
std::string w4a8_kernel_path(const std::string& disable);
int64_t w4_prefetch_distance(int64_t bytes);

// decoder_layer/decoder_layer.cpp: the fused decoder step
at::Tensor w8a8_decoder_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                               at::Tensor& v_cache, at::IntArrayRef slots, at::IntArrayRef starts,
                               at::IntArrayRef parents, const c10::List<std::optional<at::Tensor>>& norms, double eps,
                               const c10::List<std::optional<at::Tensor>>& weights,
                               const c10::List<std::optional<at::Tensor>>& tiles,
                               const c10::List<std::optional<at::Tensor>>& scales,
                               const c10::List<std::optional<at::Tensor>>& biases,
                               const c10::List<std::optional<at::Tensor>>& comps, at::IntArrayRef act_bits,
                               const c10::List<std::optional<at::Tensor>>& w4, at::IntArrayRef w4_groups,
                               const c10::List<std::optional<at::Tensor>>& routers,
                               const c10::List<std::optional<at::Tensor>>& shared_gates, at::IntArrayRef top_k,
                               at::IntArrayRef norm_topk, const c10::intrusive_ptr<quasar::ExpertPlan>& experts,
                               const std::optional<at::Tensor>& expert_counts,
                               int64_t n_heads, int64_t n_kv_heads, bool prefill, const std::string& path,
                               const std::optional<at::Tensor>& cos_local, const std::optional<at::Tensor>& sin_local,
                               at::IntArrayRef local_layers, int64_t window, double attn_scale, int64_t gelu);
bool w8a8_bf16_supported(const std::string& path);
// decoder_layer/sparse_mlp.cpp: a model's experts, checked once for the fused step
c10::intrusive_ptr<quasar::ExpertPlan> w8a8_expert_plan(
    const c10::List<std::optional<at::Tensor>>& weights, const c10::List<std::optional<at::Tensor>>& tiles,
    const c10::List<std::optional<at::Tensor>>& scales, const c10::List<std::optional<at::Tensor>>& biases,
    const c10::List<std::optional<at::Tensor>>& comps, at::IntArrayRef act_bits,
    const c10::List<std::optional<at::Tensor>>& w4, at::IntArrayRef w4_groups, at::IntArrayRef experts,
    int64_t hidden);
bool w8a8_amx_attention_supported(const std::string& path);

// head/: a step's logits
std::tuple<at::Tensor, at::Tensor> row_argmax_topk(const at::Tensor& logits, int64_t k, const std::string& path);
void refine_head_rows(at::Tensor logits, const at::Tensor& qx, const at::Tensor& sx, const at::Tensor& weight,
                      const at::Tensor& weight_scale, int64_t top_k, const std::string& path);
void refine_exact_rows(at::Tensor logits, const at::Tensor& x, const at::Tensor& weight, int64_t top_k,
                       const std::string& path);
