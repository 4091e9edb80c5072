// The fused step's sparse MLP (sparse_mlp.h): routing, the experts' gathered GEMMs, and the
// weighted sum of their outputs per row.
#include "decoder_layer/sparse_mlp.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

namespace quasar {

namespace {

// a . b over n floats in a fixed order (16 running sums, then a fixed tree), the same on
// every kernel path.
float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  for (int64_t j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// Where thread tid of nt starts in n items split evenly.
inline int64_t share(int64_t n, int tid, int nt) { return n * tid / nt; }

}  // namespace

SparseStep::SparseStep(const std::vector<SparseLayer>& layers, int64_t T, int64_t H, KernelPath path,
                       const step::FloatKernels& fk, int32_t* counts, int64_t counts_stride)
    : layers_(layers),
      T_(T),
      H_(H),
      K_max_(0),
      inter_max_(0),
      rows_max_(0),
      path_(path),
      fk_(fk),
      counts_(counts),
      counts_stride_(counts_stride),
      acts_(0, 0) {
  int64_t experts_max = 0;
  bool shared = false;
  for (const SparseLayer& s : layers) {
    K_max_ = std::max(K_max_, s.top_k);
    experts_max = std::max(experts_max, s.n_experts);
    for (int64_t e = 0; e < s.n_experts; ++e) inter_max_ = std::max(inter_max_, s.experts[e].inter);
    if (s.shared) inter_max_ = std::max(inter_max_, s.shared->inter);
    shared = shared || s.shared != nullptr;
  }
  rows_max_ = T * K_max_ + (shared ? T : 0);
  logits_.resize(T * (experts_max + 1)), weight_.resize(T * K_max_), sigmoid_.resize(T);
  probs_.resize(experts_max), taken_.resize(experts_max), chosen_.resize(K_max_), chosen_weights_.resize(K_max_);
  slot_.resize(T * K_max_), expert_rows_.resize(experts_max), source_.resize(rows_max_);
  active_.reserve(experts_max + 1), gate_up_.reserve(experts_max + 1), down_.reserve(experts_max + 1);
  acts_ = StepActs(rows_max_, std::max(H, inter_max_));
  in_.resize(rows_max_ * H), gu_.resize(rows_max_ * 2 * inter_max_), act_.resize(rows_max_ * inter_max_);
  y_.resize(rows_max_ * H), out_.resize(T * H);
}

// Phases separated by barriers: router logits (split over rows x experts), routing (one
// thread), gathering and quantizing the experts' rows, gate and up of every expert, SiLU and
// the down projections' quantization, down of every expert, then each thread's rows' sums.
void SparseStep::run(int64_t l, const float* h, float* x, int tid, int nt, int64_t r0, int64_t r1) {
  const SparseLayer& s = layers_[l];
#pragma omp barrier
  router_logits(s, h, tid, nt);
#pragma omp barrier
  if (tid == 0) route(l, s);
#pragma omp barrier
  gather(h, tid, nt);
#pragma omp barrier
  run_gemms(gate_up_, tid, nt);
#pragma omp barrier
  activate(tid, nt);
#pragma omp barrier
  run_gemms(down_, tid, nt);
#pragma omp barrier
  combine(s, x, r0, r1);
}

// logits[t, e] = router[e] . h[t] (and the shared gate's at e = n_experts), split over the
// threads expert-major, so each router row is read once from memory.
void SparseStep::router_logits(const SparseLayer& s, const float* h, int tid, int nt) {
  const int64_t outputs = s.n_experts + (s.shared_gate ? 1 : 0), items = outputs * T_;
  for (int64_t i = share(items, tid, nt); i < share(items, tid + 1, nt); ++i) {
    const int64_t e = i / T_, t = i % T_;
    const float* w = e < s.n_experts ? s.router + e * H_ : s.shared_gate;
    logits_[t * (s.n_experts + 1) + e] = dot(w, h + t * H_, H_);
  }
}

// Row t's top_k experts by softmax probability (ties: the lowest id first), best first, and
// their weights (renormalized over the k with norm_topk), as SparseMoE.route.
void SparseStep::choose(const SparseLayer& s, int64_t t, int64_t* chosen, float* weights) {
  const int64_t E = s.n_experts, K = s.top_k;
  const float* z = logits_.data() + t * (E + 1);
  float top = z[0];
  for (int64_t e = 1; e < E; ++e) top = std::max(top, z[e]);
  float total = 0.0f;
  float* p = probs_.data();
  for (int64_t e = 0; e < E; ++e) total += (p[e] = std::exp(z[e] - top));
  for (int64_t e = 0; e < E; ++e) p[e] /= total, taken_[e] = 0;
  float sum = 0.0f;
  for (int64_t j = 0; j < K; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (!taken_[e] && (best < 0 || p[e] > p[best])) best = e;
    chosen[j] = best, weights[j] = p[best], taken_[best] = 1;
    sum += weights[j];
  }
  if (s.norm_topk)
    for (int64_t j = 0; j < K; ++j) weights[j] /= sum;
}

// One thread: each row's experts, the active experts and their gathered rows (ascending id,
// each expert's rows in row order; the shared expert last, over every row), and per row its
// choices in ascending id with their gathered rows.
void SparseStep::route(int64_t l, const SparseLayer& s) {
  const int64_t E = s.n_experts, K = s.top_k;
  std::fill(expert_rows_.begin(), expert_rows_.begin() + E, 0);
  int64_t* chosen = chosen_.data();
  float* weights = chosen_weights_.data();
  for (int64_t t = 0; t < T_; ++t) {
    choose(s, t, chosen, weights);
    // ascending expert id: the order a row's experts are added in
    for (int64_t j = 1; j < K; ++j)
      for (int64_t i = j; i > 0 && chosen[i - 1] > chosen[i]; --i)
        std::swap(chosen[i - 1], chosen[i]), std::swap(weights[i - 1], weights[i]);
    for (int64_t j = 0; j < K; ++j) {
      slot_[t * K_max_ + j] = chosen[j];
      weight_[t * K_max_ + j] = weights[j];
      ++expert_rows_[chosen[j]];
    }
    if (s.shared_gate) sigmoid_[t] = 1.0f / (1.0f + std::exp(-logits_[t * (E + 1) + E]));
  }
  if (counts_)
    for (int64_t e = 0; e < E; ++e) counts_[l * counts_stride_ + e] = static_cast<int32_t>(expert_rows_[e]);
  // expert_rows_ becomes each expert's next gathered row
  active_.clear();
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = expert_rows_[e];
    expert_rows_[e] = rows;
    if (n) active_.push_back({&s.experts[e], rows, n}), rows += n;
  }
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t g = expert_rows_[slot_[t * K_max_ + j]]++;
      slot_[t * K_max_ + j] = g, source_[g] = t;
    }
  if (s.shared) {
    active_.push_back({s.shared, rows, T_});
    for (int64_t t = 0; t < T_; ++t) source_[rows + t] = t;
  }
  plan_gemms();
}

// The active experts' StepGemms over their gathered rows (nothing here throws: the linears
// were checked when the step was planned).
void SparseStep::plan_gemms() {
  gate_up_.clear(), down_.clear();
  for (const Active& a : active_) {
    const int64_t inter = a.mlp->inter;
    gate_up_.emplace_back(a.mlp->gate_up, acts_, a.rows, gu_.data() + a.first * 2 * inter_max_, 2 * inter, path_,
                          a.first);
    down_.emplace_back(a.mlp->down, acts_, a.rows, y_.data() + a.first * H_, H_, path_, a.first);
  }
}

// This thread's share of the gathered rows: copied from h and quantized for gate and up.
void SparseStep::gather(const float* h, int tid, int nt) {
  const int64_t rows = active_.empty() ? 0 : active_.back().first + active_.back().rows;
  const int64_t g0 = share(rows, tid, nt), g1 = share(rows, tid + 1, nt);
  for (int64_t g = g0; g < g1; ++g) std::copy_n(h + source_[g] * H_, H_, in_.data() + g * H_);
  for (size_t i = 0; i < active_.size(); ++i) {
    const Active& a = active_[i];
    const int64_t lo = std::max(g0, a.first), hi = std::min(g1, a.first + a.rows);
    if (lo < hi) gate_up_[i].quantize(in_.data() + a.first * H_, lo - a.first, hi - a.first);
  }
}

// This thread's share of the gathered rows: silu(gate) * up, quantized for down.
void SparseStep::activate(int tid, int nt) {
  const int64_t rows = active_.empty() ? 0 : active_.back().first + active_.back().rows;
  const int64_t g0 = share(rows, tid, nt), g1 = share(rows, tid + 1, nt);
  for (size_t i = 0; i < active_.size(); ++i) {
    const Active& a = active_[i];
    const int64_t lo = std::max(g0, a.first), hi = std::min(g1, a.first + a.rows), inter = a.mlp->inter;
    if (lo >= hi) continue;
    float* act = act_.data() + a.first * inter_max_;  // the expert's rows, inter apart
    fk_.silu_mul(gu_.data() + a.first * 2 * inter_max_ + (lo - a.first) * 2 * inter, hi - lo, inter, 0, inter,
                 act + (lo - a.first) * inter);
    down_[i].quantize(act, lo - a.first, hi - a.first);
  }
}

// The output vectors of all `gemms` split evenly over the threads.
void SparseStep::run_gemms(const std::vector<StepGemm>& gemms, int tid, int nt) const {
  int64_t total = 0;
  for (const StepGemm& g : gemms) total += g.vectors();
  const int64_t v0 = share(total, tid, nt), v1 = share(total, tid + 1, nt);
  int64_t base = 0;
  for (const StepGemm& g : gemms) {
    const int64_t n = g.vectors();
    if (v0 < base + n && v1 > base) g.run_vectors(std::max(v0 - base, int64_t{0}), std::min(v1 - base, n));
    base += n;
  }
}

// Rows [r0, r1): out = the chosen experts' outputs times their weights, added in ascending
// expert id (then the shared expert's times its gate), as SparseMoE.forward; x += out.
void SparseStep::combine(const SparseLayer& s, float* x, int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) {
    float* out = out_.data() + t * H_;
    std::fill_n(out, H_, 0.0f);
    for (int64_t j = 0; j < s.top_k; ++j) {
      const float* y = y_.data() + slot_[t * K_max_ + j] * H_;
      const float w = weight_[t * K_max_ + j];
      for (int64_t i = 0; i < H_; ++i) out[i] += y[i] * w;
    }
    if (s.shared) {
      const float* y = y_.data() + (active_.back().first + t) * H_;
      const float g = sigmoid_[t];
      for (int64_t i = 0; i < H_; ++i) out[i] += g * y[i];
    }
    fk_.add_into(x + t * H_, out, H_);
  }
}

}  // namespace quasar

// The linears of every sparse layer's experts (weights / tiles / scales / biases / comps /
// act_bits / w4 / w4_groups as w8a8_decoder_layers takes them: gate, up, down of each expert,
// layer after layer; experts[i] = sparse layer i's experts) of hidden size `hidden`, checked
// into an ExpertPlan for w8a8_decoder_layers.
c10::intrusive_ptr<quasar::ExpertPlan> w8a8_expert_plan(
    const c10::List<std::optional<at::Tensor>>& weights, const c10::List<std::optional<at::Tensor>>& tiles,
    const c10::List<std::optional<at::Tensor>>& scales, const c10::List<std::optional<at::Tensor>>& biases,
    const c10::List<std::optional<at::Tensor>>& comps, at::IntArrayRef act_bits,
    const c10::List<std::optional<at::Tensor>>& w4, at::IntArrayRef w4_groups, at::IntArrayRef experts,
    int64_t hidden) {
  const int64_t n = static_cast<int64_t>(weights.size());
  TORCH_CHECK(static_cast<int64_t>(tiles.size()) == n && static_cast<int64_t>(scales.size()) == n &&
                  static_cast<int64_t>(biases.size()) == n && static_cast<int64_t>(comps.size()) == n &&
                  static_cast<int64_t>(act_bits.size()) == n && static_cast<int64_t>(w4.size()) == n &&
                  static_cast<int64_t>(w4_groups.size()) == n,
              "w8a8_expert_plan: the linears' lists must have the same length");
  const quasar::LinearLists lists{weights, tiles, scales, biases, comps, act_bits, w4, w4_groups};
  auto plan = c10::make_intrusive<quasar::ExpertPlan>();
  int64_t base = 0;
  for (const int64_t count : experts) {
    TORCH_CHECK(count >= 1 && base + 3 * count <= n, "w8a8_expert_plan: 3 linears per expert");
    std::vector<quasar::MlpLinears>& layer = plan->layers.emplace_back();
    bool w4_layer = false;
    for (int64_t e = 0; e < count; ++e, base += 3) {
      layer.push_back(quasar::mlp_linears(lists, base, hidden));
      w4_layer = w4_layer || layer.back().gate_up.n_w4 || layer.back().down.n_w4;
    }
    plan->w4.push_back(w4_layer);
  }
  TORCH_CHECK(base == n, "w8a8_expert_plan: 3 linears per expert, got ", n);
  for (const auto* list : {&weights, &tiles, &scales, &biases, &comps, &w4})
    for (int64_t i = 0; i < n; ++i)
      if (const std::optional<at::Tensor> t = list->get(i); t.has_value() && t->defined()) plan->tensors.push_back(*t);
  return plan;
}
