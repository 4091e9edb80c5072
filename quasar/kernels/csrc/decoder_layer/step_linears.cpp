// The linears of the fused decoder step: Int8Linear and W4A8Linear buffers checked into
// GEMM descriptions, and StepGemm, one input's linears over the step's threads
// (step_linears.h).
#include "decoder_layer/step_linears.h"

#include <algorithm>

namespace quasar {

namespace {

const float* float_vector(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, "w8a8_decoder_layers: ", what,
              " must be a contiguous float32 tensor of ", n, " elements");
  return t.data_ptr<float>();
}

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The input features of a W4A8 weight of n outputs from its packed size (the down projection's
// K is the intermediate size, which nothing else gives when gate and up are 4-bit too).
int64_t w4_in_features(const at::Tensor& packed, int64_t n, int64_t form) {
  const int64_t unit = w4_k_multiple(form), per_unit = w4_packed_bytes(n, unit, form);
  TORCH_CHECK(packed.numel() % per_unit == 0, "w8a8_decoder_layers: a W4A8 weight's packed size does not fit ", n,
              " outputs in form ", form);
  return packed.numel() / per_unit * unit;
}

// The intermediate size of an MLP whose down projection is at lists[i] (its input features).
int64_t down_in_features(const LinearLists& lists, int64_t i, int64_t H) {
  if (lists.w4_groups[i] > 0) {
    TORCH_CHECK(given(lists.w4.get(i)), "w8a8_decoder_layers: a W4A8 linear needs its packed weight");
    return w4_in_features(*lists.w4.get(i), H, lists.w4_groups[i]);
  }
  TORCH_CHECK(given(lists.weights.get(i)) && lists.weights.get(i)->dim() == 2,
              "w8a8_decoder_layers: an Int8Linear needs its 2-D int8 weight");
  return lists.weights.get(i)->size(1);
}

// A W4A8Linear at lists[i] (n outputs from k inputs) into `in`, writing columns [col, col + n).
void add_w4(const LinearLists& lists, InputLinears& in, int64_t i, int64_t n, int64_t k, int64_t col, const float* b) {
  const int64_t form = lists.w4_groups[i];  // w4a8_gemm.h
  TORCH_CHECK(w4_form_valid(form), "w8a8_decoder_layers: W4A8 form ", form);
  TORCH_CHECK(k % w4_k_multiple(form) == 0, "w8a8_decoder_layers: a W4A8 linear needs whole groups (", k,
              " inputs)");
  TORCH_CHECK(in.n_w4 == 0 || in.group == w4_group_size(form),
              "w8a8_decoder_layers: W4A8 linears of one input must share their group size");
  const std::optional<at::Tensor> p = lists.w4.get(i);
  TORCH_CHECK(given(p) && p->scalar_type() == at::kByte && p->is_contiguous() &&
                  p->numel() == w4_packed_bytes(n, k, form),
              "w8a8_decoder_layers: a W4A8 weight must be w4_pack's uint8 [", w4_packed_bytes(n, k, form), "] for ",
              n, " x ", k);
  in.group = w4_group_size(form);
  in.w4[in.n_w4++] = {p->data_ptr<uint8_t>(), n, b, col, form};
}

// An Int8Linear at lists[i] (n outputs from k inputs) into `in`, writing columns [col, col + n).
void add_i8(const LinearLists& lists, InputLinears& in, int64_t i, int64_t n, int64_t k, int64_t col, const float* b) {
  const int64_t bits = lists.act_bits[i];
  TORCH_CHECK(bits == 8 || bits == 15, "w8a8_decoder_layers: act_bits must be 8 or 15");
  TORCH_CHECK(in.n_i8 == 0 || in.act_bits == bits,
              "w8a8_decoder_layers: the Int8Linears of one input (q, k, v; gate, up) must share act_bits");
  const std::optional<at::Tensor> w = lists.weights.get(i), t = lists.tiles.get(i), s = lists.scales.get(i),
                                  c = lists.comps.get(i);
  TORCH_CHECK(given(w) && given(t) && given(s) && given(c), "w8a8_decoder_layers: an Int8Linear needs its weight, "
              "tiles, scale and comp");
  TORCH_CHECK(w->dim() == 2 && w->scalar_type() == at::kChar && w->is_contiguous() && w->size(0) == n &&
                  w->size(1) == k,
              "w8a8_decoder_layers: weight must be a contiguous int8 [", n, ", ", k, "] (the head layout)");
  TORCH_CHECK(c->scalar_type() == at::kInt && c->is_contiguous() && c->numel() == n,
              "w8a8_decoder_layers: comp must be int32 [N]");
  TORCH_CHECK(t->scalar_type() == at::kChar && t->is_contiguous() && t->numel() == tiled_bytes(n, k),
              "w8a8_decoder_layers: tiles must be the weight packed by int8_pack_tiles");
  in.act_bits = bits;
  in.i8[in.n_i8++] = {t->data_ptr<int8_t>(), n, c->data_ptr<int32_t>(), float_vector(*s, n, "weight_scale"), b, col};
}

// Linear i (n outputs from k inputs) into `in`, writing columns [col, col + n).
void add_linear(const LinearLists& lists, InputLinears& in, int64_t i, int64_t n, int64_t k, int64_t col) {
  in.k = k;
  const std::optional<at::Tensor> bias = lists.biases.get(i);
  const float* b = given(bias) ? float_vector(*bias, n, "bias") : nullptr;
  if (lists.w4_groups[i] > 0)
    add_w4(lists, in, i, n, k, col, b);
  else
    add_i8(lists, in, i, n, k, col, b);
}

}  // namespace

MlpLinears mlp_linears(const LinearLists& lists, int64_t base, int64_t H) {
  MlpLinears out;
  out.inter = down_in_features(lists, base + 2, H);
  add_linear(lists, out.gate_up, base, out.inter, H, 0);
  add_linear(lists, out.gate_up, base + 1, out.inter, H, out.inter);
  add_linear(lists, out.down, base + 2, H, out.inter, 0);
  return out;
}

LayerLinears layer_linears(const LinearLists& lists, int64_t base, int64_t H, int64_t nq, int64_t nkv, bool mlp) {
  LayerLinears out;
  add_linear(lists, out.qkv, base, nq, H, 0);
  add_linear(lists, out.qkv, base + 1, nkv, H, nq);
  add_linear(lists, out.qkv, base + 2, nkv, H, nq + nkv);
  add_linear(lists, out.o, base + 3, H, nq, 0);
  if (mlp) out.mlp = mlp_linears(lists, base + 4, H);
  return out;
}

StepActs::StepActs(int64_t M, int64_t k_max)
    : q(M * padded_k(k_max)), q_lo(M * padded_k(k_max)), sx(M), w4q(M * k_max), w4sx(M * (k_max / 32 + 1)),
      w4xs(M * (k_max / 32 + 1)), w4xh(2 * M * (k_max / 32 + 1)) {}

StepGemm::StepGemm(const InputLinears& in, StepActs& acts, int64_t M, float* y, int64_t y_stride, KernelPath path,
                   int64_t row0)
    : in_(&in), acts_(&acts), M_(M), y_(y), y_stride_(y_stride), path_(path), row0_(row0) {
  const int64_t k4 = padded_k(in.k);
  if (in.n_i8)
    i8_.emplace(acts.q.data() + row0 * k4, in.act_bits == 15 ? acts.q_lo.data() + row0 * k4 : nullptr, M, in.k,
                in.i8, in.n_i8, acts.sx.data() + row0, y, y_stride, path);
  if (in.n_w4) {
    w4_kernel_ = w4_active_kernel(path, &w4_rows_);
    TORCH_CHECK(w4_kernel_ != nullptr,
                "w8a8_decoder_layers: every W4A8 kernel path is disabled (the self-check failed)");
    for (int64_t m = 0; m < in.n_w4; ++m) w4_first_[m + 1] = w4_first_[m] + (in.w4[m].n + kW4Lanes - 1) / kW4Lanes;
  }
}

void StepGemm::quantize(const float* x, int64_t r0, int64_t r1) const {
  const int64_t nr = r1 - r0, K = in_->k, at = row0_ + r0;
  if (nr <= 0) return;
  if (in_->n_i8) {
    const int64_t k4 = padded_k(K);
    uint8_t* q = acts_->q.data() + at * k4;
    if (in_->act_bits == 15)
      quantize_rows_split_u8(x + r0 * K, nr, K, q, acts_->q_lo.data() + at * k4, acts_->sx.data() + at, path_);
    else
      quantize_rows_u8(x + r0 * K, nr, K, q, acts_->sx.data() + at, path_);
  }
  if (in_->n_w4) {
    const int64_t G = K / in_->group;
    w4_quantize_groups(x + r0 * K, nr, K, in_->group, acts_->w4q.data() + at * K, acts_->w4sx.data() + at * G,
                       acts_->w4xs.data() + at * G, acts_->w4xh.data() + at * 2 * G, path_);
  }
}

void StepGemm::quantize_columns(const float* x, int64_t r, int64_t c0, int64_t c1) const {
  const int64_t K = in_->k, G = K / in_->group, g0 = c0 / in_->group, at = row0_ + r;
  if (c1 <= c0) return;
  w4_quantize_groups(x + r * K + c0, 1, c1 - c0, in_->group, acts_->w4q.data() + at * K + c0,
                     acts_->w4sx.data() + at * G + g0, acts_->w4xs.data() + at * G + g0,
                     acts_->w4xh.data() + at * 2 * G + 2 * g0, path_);
}

void StepGemm::run(int tid, int nt) const {
  if (i8_) {
    const int64_t v = i8_->vectors();
    i8_->run(v * tid / nt, v * (tid + 1) / nt);
  }
  const int64_t total = w4_first_[in_->n_w4];
  run_w4(total * tid / nt, total * (tid + 1) / nt);
}

void StepGemm::run_vectors(int64_t v0, int64_t v1) const {
  const int64_t n8 = i8_vectors();
  if (v0 < n8) i8_->run(v0, std::min(v1, n8));
  if (v1 > n8) run_w4(std::max(v0, n8) - n8, v1 - n8);
}

// The 4-bit vectors [first, end) (numbered across the matrices).
void StepGemm::run_w4(int64_t first, int64_t end) const {
  if (!in_->n_w4 || first >= end) return;
  const int64_t K = in_->k, G = K / in_->group;
  const W4Acts acts{acts_->w4q.data() + row0_ * K, K, acts_->w4sx.data() + row0_ * G,
                    acts_->w4xs.data() + row0_ * G, G, acts_->w4xh.data() + row0_ * 2 * G};
  int64_t m = 0;
  for (int64_t v = first; v < end; ++v) {
    while (v >= w4_first_[m + 1]) ++m;
    const W4Matrix& w = in_->w4[m];
    const int64_t form = w.form, vb = w4_vector_bytes(K, form);
    const int64_t n0 = (v - w4_first_[m]) * kW4Lanes;
    const bool prefetch = prefetch_stream_at((v - std::max(first, w4_first_[m])) * vb);
    w4_vector_rows(w4_kernel_, w4_rows_, w.packed + (v - w4_first_[m]) * vb, K, form, acts, M_,
                   std::min(kW4Lanes, w.n - n0), w.bias ? w.bias + n0 : nullptr, y_ + w.y_col + n0, y_stride_,
                   prefetch);
  }
}

}  // namespace quasar
