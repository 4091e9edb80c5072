// The library's one op registration: every op's schema, under the quasar_quant namespace
// (quasar/kernels/ext.py calls them as torch.ops.quasar_quant.<name>). An op whose result or
// speed depends on the kernel path takes it last, `str path=""` ("": the process default,
// kernel_path; cpu_features.h), so a test or a benchmark can run any path the CPU has in one
// process.
#include "ops.h"
#include "decoder_layer/sparse_mlp.h"

#include <torch/library.h>

TORCH_LIBRARY(quasar_quant, m) {
  // the kernel path and the library's threads
  m.def("kernel_path(str cap=\"\") -> str", &kernel_path_op);
  m.def("cpu_runs_path(str name) -> bool", &cpu_runs_path);
  m.def("parallel_threads() -> int", &parallel_threads);

  // the W8A8 linear and the int8 GEMM's settings
  m.def(
      "int8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, Tensor? comp, "
      "bool u8_single, bool u8_multi, Tensor? tiles=None, int act_bits=8, str path=\"\") -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(int8_linear));
  m.def("int8_pack_tiles(Tensor weight, bool release_source=False) -> Tensor", &int8_pack_tiles);
  m.def("release_pages(Tensor t) -> bool", &release_pages);
  m.def("int8_small_m_max(int max_m=-1) -> int", &int8_small_m_max);
  m.def("int8_small_m_supported() -> bool", &int8_small_m_supported);
  m.def("int8_amx_min_rows(int min_rows=-1) -> int", &int8_amx_min_rows);
  m.def("int8_stream_prefetch(int mode=-1) -> int", &int8_stream_prefetch);
  m.def("int8_amx_supported() -> bool", &int8_amx_supported);
  m.def("int8_onednn_exact(int value=-1) -> bool", &int8_onednn_exact);

  // the W4A8 linear
  m.def("w4_pack(Tensor q, Tensor scales, Tensor offsets, int group) -> Tensor", &w4_pack);
  m.def("w4_pack_q4k(Tensor q, Tensor scale_codes, Tensor offset_codes, Tensor super_scales, Tensor super_offsets) -> "
        "Tensor",
        &w4_pack_q4k);
  m.def("w4_pack_q6k(Tensor q, Tensor sub_scales, Tensor super_scales) -> Tensor", &w4_pack_q6k);
  m.def("w4a8_linear(Tensor x, Tensor packed, int N, int K, int group, Tensor? bias=None, str path=\"\") -> Tensor");
  m.impl("w4a8_linear", c10::DispatchKey::CPU, TORCH_FN(w4a8_linear));
  m.def("w4a8_kernel_path(str disable=\"\") -> str", &w4a8_kernel_path);
  m.def("w4_prefetch_distance(int bytes=-1) -> int", &w4_prefetch_distance);

  // the fused decoder step
  m.class_<quasar::ExpertPlan>("ExpertPlan");
  m.def(
      "w8a8_expert_plan(Tensor?[] weights, Tensor?[] tiles, Tensor?[] scales, Tensor?[] biases, Tensor?[] comps, "
      "int[] act_bits, Tensor?[] w4, int[] w4_groups, int[] experts, int hidden) -> "
      "__torch__.torch.classes.quasar_quant.ExpertPlan",
      &w8a8_expert_plan);
  m.def("w8a8_bf16_supported(str path=\"\") -> bool", &w8a8_bf16_supported);
  m.def("w8a8_amx_attention_supported(str path=\"\") -> bool", &w8a8_amx_attention_supported);
  m.def(
      "w8a8_decoder_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "int[] slots, int[] starts, int[] parents, Tensor?[] norms, float eps, Tensor?[] weights, Tensor?[] tiles, "
      "Tensor?[] scales, Tensor?[] biases, Tensor?[] comps, int[] act_bits, Tensor?[] w4, int[] w4_groups, "
      "Tensor?[] routers, Tensor?[] shared_gates, int[] top_k, int[] norm_topk, "
      "__torch__.torch.classes.quasar_quant.ExpertPlan experts, Tensor(c!)? expert_counts, "
      "int n_heads, int n_kv_heads, bool prefill=False, str path=\"\", Tensor? cos_local=None, "
      "Tensor? sin_local=None, int[] local_layers=[], int window=0, float attn_scale=0., int gelu=0) -> Tensor");
  m.impl("w8a8_decoder_layers", c10::DispatchKey::CPU, TORCH_FN(w8a8_decoder_layers));

  // a step's logits
  m.def("row_argmax_topk(Tensor logits, int k, str path=\"\") -> (Tensor, Tensor)", &row_argmax_topk);
  m.def(
      "refine_head_rows(Tensor(a!) logits, Tensor qx, Tensor sx, Tensor weight, Tensor weight_scale, int top_k, "
      "str path=\"\") -> ()",
      &refine_head_rows);
  m.def("refine_exact_rows(Tensor(a!) logits, Tensor x, Tensor weight, int top_k, str path=\"\") -> ()",
        &refine_exact_rows);
}
