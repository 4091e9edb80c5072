// The sparse (mixture-of-experts) MLP of the fused decoder step (decoder_layer.cpp), as
// quasar/models/moe.py's SparseMoE computes it:
//   logits = router . h (float32, one dot product per row and expert); p = softmax(logits);
//   the top_k experts by p (ties: the lowest id first), their weights renormalized over the
//   k when norm_topk; out = sum over the chosen experts, ascending by id, of weight x
//   down(silu(gate(h)) * up(h)); plus a shared expert's MLP scaled by sigmoid(shared_gate . h);
//   x += out.
// Each expert the step's rows reach runs once over all its rows (gathered, in row order):
// its gate / up and down linears are StepGemms (step_linears.h) over those rows, and the
// GEMMs of all the step's experts are one phase whose output vectors are split evenly over
// the threads, so each expert's weights are read once. A row's result depends on its own
// input alone: its router dot products and softmax are computed per row, the GEMMs give each
// row the bits of a one-row GEMM, and its experts' outputs are added in ascending id order;
// so a token's result is bitwise the same whatever other rows share its step.
#pragma once

#include "decoder_layer/step_linears.h"
#include "step/step_kernels.h"

#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace quasar {

// The experts of a model's sparse layers, checked once (the w8a8_expert_plan op) and kept
// between steps, so a step's argument lists carry no expert: per sparse layer, in layer
// order, each expert's linears and whether any is 4-bit, and the tensors they point into.
struct ExpertPlan : torch::CustomClassHolder {
  std::vector<std::vector<MlpLinears>> layers;
  std::vector<bool> w4;
  std::vector<at::Tensor> tensors;
};

// One sparse layer: the router float32 [n_experts, H], top_k experts a row (renormalized
// over the k with norm_topk), each expert's linears (n_experts of them, in an ExpertPlan),
// and an optional shared expert (null: none) scaled by sigmoid(shared_gate . h)
// (shared_gate float32 [H]).
struct SparseLayer {
  const float* router = nullptr;
  int64_t n_experts = 0, top_k = 0;
  bool norm_topk = false;
  const MlpLinears* experts = nullptr;
  const MlpLinears* shared = nullptr;
  const float* shared_gate = nullptr;
};

// The sparse MLPs of one step of T rows of H features: its buffers and the per-layer plan of
// the experts the rows reach. counts (null: none) is int32 [L, counts_stride]: run() writes
// each sparse layer's rows per expert there (what SparseMoE.last_experts reports).
class SparseStep {
 public:
  SparseStep(const std::vector<SparseLayer>& layers, int64_t T, int64_t H, KernelPath path,
             const step::FloatKernels& fk, int32_t* counts, int64_t counts_stride);
  // Layer l's sparse MLP, called by every thread of the step's parallel region (it has
  // barriers; its first waits for every row of h): h = the rows' normed inputs [T, H];
  // thread tid of nt adds the output of its rows [r0, r1) into x [T, H].
  void run(int64_t l, const float* h, float* x, int tid, int nt, int64_t r0, int64_t r1);

 private:
  // An expert this layer's rows reach: its gathered rows [first, first + rows).
  struct Active {
    const MlpLinears* mlp;
    int64_t first, rows;
  };
  void router_logits(const SparseLayer& s, const float* h, int tid, int nt);
  void route(int64_t l, const SparseLayer& s);
  void choose(const SparseLayer& s, int64_t t, int64_t* chosen, float* weights);
  void plan_gemms();
  void gather(const float* h, int tid, int nt);
  void activate(int tid, int nt);
  void run_gemms(const std::vector<StepGemm>& gemms, int tid, int nt) const;
  void combine(const SparseLayer& s, float* x, int64_t r0, int64_t r1);

  const std::vector<SparseLayer>& layers_;
  int64_t T_, H_, K_max_, inter_max_, rows_max_;
  KernelPath path_;
  const step::FloatKernels& fk_;
  int32_t* counts_;
  int64_t counts_stride_;
  // this layer's routing: logits [T, n_experts + 1] (the shared gate's last); per row and
  // choice (ascending expert id), its gathered row and weight [T, K_max]; per expert, its
  // rows; the active experts in id order (the shared one last); per gathered row, its row
  std::vector<float> logits_, weight_, sigmoid_;
  std::vector<int64_t> slot_, expert_rows_, source_;
  std::vector<Active> active_;
  // route's scratch: one row's probabilities, which experts it took, its choices
  std::vector<float> probs_, chosen_weights_;
  std::vector<uint8_t> taken_;
  std::vector<int64_t> chosen_;
  // the experts' GEMMs (gate and up; down) over their gathered rows, and their buffers
  std::vector<StepGemm> gate_up_, down_;
  StepActs acts_;
  std::vector<float> in_, gu_, act_, y_, out_;
};

}  // namespace quasar
