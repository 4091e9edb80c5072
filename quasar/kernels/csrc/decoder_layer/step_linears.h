// The linears of the fused decoder step (decoder_layer.cpp): each is an Int8Linear
// (int8_gemm.h: per-channel int8 weights in tiles, per-row uint8 activations, or 15-bit ones
// split in two) or a W4A8Linear (w4a8_gemm.h: affine 4-bit groups, int8 activations per row
// and group), in any mix. The linears reading one input (q, k, v; o; gate, up; down) are a
// StepGemm: the input is quantized once per form its linears need (per row for the int8
// ones, per row and group for the 4-bit ones), then the int8 ones run as one SmallMGemm over
// their segments and the 4-bit ones over their 16-lane vectors, each split evenly over the
// threads of the step's parallel region. Every linear gives bitwise what its module computes
// from the same input (Int8Linear's small-M GEMM; W4A8Linear's op, through the same
// w4_vector_rows), each row alone.
#pragma once

#include "gemm_w8a8/int8_gemm.h"
#include "gemm_w4a8/w4a8_gemm.h"

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace quasar {

// One W4A8Linear: its weight packed by w4_pack (w4_pack_q4k, w4_pack_q6k) for (n, K, form), an optional float32 bias
// [n]; its outputs go to columns [y_col, y_col + n).
struct W4Matrix {
  const uint8_t* packed;
  int64_t n;
  const float* bias;
  int64_t y_col;
  int64_t form;
};

// The linears reading one input of K features, by kind (at most 3: q, k and v).
constexpr int64_t kMaxInputLinears = 3;
struct InputLinears {
  int64_t k = 0;
  Int8Segment i8[kMaxInputLinears];
  int64_t n_i8 = 0, act_bits = 8;  // the int8 ones' activation bits (8 or 15)
  W4Matrix w4[kMaxInputLinears];
  int64_t n_w4 = 0, group = 0;  // the 4-bit ones' activation group size (each has its own form)
};

// A SwiGLU MLP's linears by input (a dense layer's, an expert's, a shared expert's); inter =
// its intermediate size, 0 for none (a sparse layer without a shared expert).
struct MlpLinears {
  InputLinears gate_up, down;
  int64_t inter = 0;
};

// A layer's linears by input: attention's, and its dense MLP (or a sparse layer's shared expert).
struct LayerLinears {
  InputLinears qkv, o;
  MlpLinears mlp;
};

// The op's lists of linear buffers (w8a8_decoder_layers): an Int8Linear has weight, tiles,
// scale and comp (w4 None), a W4A8Linear w4 (the packed weight) and w4_groups > 0 (the others
// None); both may have a bias.
struct LinearLists {
  const c10::List<std::optional<at::Tensor>>& weights;
  const c10::List<std::optional<at::Tensor>>& tiles;
  const c10::List<std::optional<at::Tensor>>& scales;
  const c10::List<std::optional<at::Tensor>>& biases;
  const c10::List<std::optional<at::Tensor>>& comps;
  at::IntArrayRef act_bits;
  const c10::List<std::optional<at::Tensor>>& w4;
  at::IntArrayRef w4_groups;
};

// The linears q, k, v, o at lists[base .. base + 3] and, with `mlp`, gate, up, down at
// [base + 4 .. base + 6], checked against the head layout (H, nq = heads x D, nkv = kv heads
// x D); throws.
LayerLinears layer_linears(const LinearLists& lists, int64_t base, int64_t H, int64_t nq, int64_t nkv, bool mlp);

// The SwiGLU MLP gate, up, down at lists[base .. base + 2] of hidden size H; throws.
MlpLinears mlp_linears(const LinearLists& lists, int64_t base, int64_t H);

// Quantized activations of the GEMM at hand, for M rows of up to k_max features; phases are
// separated by barriers, so one set serves every StepGemm of a step.
struct StepActs {
  StepActs(int64_t M, int64_t k_max);
  std::vector<uint8_t> q, q_lo;  // int8: rows of padded_k(K) bytes (15 bits: hi in q, lo in q_lo)
  std::vector<float> sx;         // int8: the rows' scales
  std::vector<int8_t> w4q;       // 4-bit: rows of K bytes
  std::vector<float> w4sx, w4xs;  // 4-bit: per row and group, rows of K / group
  std::vector<int32_t> w4xh;       // 4-bit: per row and half group, rows of 2 K / group
};

// The linears of one input over M rows, writing y [M, y_stride], on kernel path `path`; the
// rows' activations are rows [row0, row0 + M) of `acts`. The constructor checks (and may
// throw only when no W4A8 kernel is left, see w4_active_kernel); quantize and run never
// throw, so they run inside the OpenMP region. `in` and `acts` must outlive it.
class StepGemm {
 public:
  StepGemm(const InputLinears& in, StepActs& acts, int64_t M, float* y, int64_t y_stride, KernelPath path,
           int64_t row0 = 0);
  // Quantize rows [r0, r1) of x [M, K] in the forms the linears need.
  void quantize(const float* x, int64_t r0, int64_t r1) const;
  // Columns [c0, c1) of row r of x, for linears that are all 4-bit (columns_split()) and c0,
  // c1 multiples of group(): each group of a row is quantized alone, so any split of a row's
  // groups gives the bits quantize() gives.
  bool columns_split() const { return !in_->n_i8 && in_->n_w4; }
  int64_t group() const { return in_->group; }
  void quantize_columns(const float* x, int64_t r, int64_t c0, int64_t c1) const;
  // Thread tid of nt: its share of the int8 vectors and of the 4-bit ones.
  void run(int tid, int nt) const;
  // Its output vectors (16 columns of one linear each), the int8 ones first, and vectors
  // [v0, v1) of them: for callers that split several StepGemms over their threads at once.
  int64_t vectors() const { return i8_vectors() + w4_first_[in_->n_w4]; }
  void run_vectors(int64_t v0, int64_t v1) const;

 private:
  int64_t i8_vectors() const { return i8_ ? i8_->vectors() : 0; }
  void run_w4(int64_t v0, int64_t v1) const;

  const InputLinears* in_;
  StepActs* acts_;
  int64_t M_;
  float* y_;
  int64_t y_stride_;
  KernelPath path_;
  int64_t row0_;
  std::optional<SmallMGemm> i8_;
  W4RowsFn w4_kernel_ = nullptr;
  int64_t w4_rows_ = 1;
  int64_t w4_first_[kMaxInputLinears + 1] = {};  // matrix m's first vector
};

}  // namespace quasar
