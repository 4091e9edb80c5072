// The W4A8 ops: packing a weight (w4_pack), the linear (w4a8_linear) and the W4A8 kernel
// path with the self-check's verdicts (w4a8_kernel_path). The numbers: generic.cpp.
#include "gemm_w4a8/w4a8_gemm.h"
#include "gemm_w8a8/int8_gemm.h"
#include "ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

namespace {

using quasar::KernelPath;

int path_by_name(const std::string& name) {
  KernelPath p;
  TORCH_CHECK(quasar::parse_kernel_path(name.c_str(), &p), "unknown kernel path '", name, "'");
  return static_cast<int>(p);
}

void check_shape(int64_t N, int64_t K, int64_t form, const char* op) {
  TORCH_CHECK(quasar::w4_form_valid(form), op, ": the group size must be 32, 64 or 128 (or the Q4_K or Q6_K form, ",
              quasar::kW4Q4K, " or ", quasar::kW4Q6K, "), got ", form);
  const int64_t multiple = quasar::w4_k_multiple(form);
  TORCH_CHECK(K > 0 && K % multiple == 0, op, ": K (", K, ") must be a positive multiple of ",
              quasar::w4_superblocks(form) ? "the superblock" : "the group size", " (", multiple, ")");
  TORCH_CHECK(N >= 0, op, ": N must not be negative, got ", N);
}

// `shape` names the expected [N, cols] = [N, G] in the message.
at::Tensor group_params(const at::Tensor& t, int64_t N, int64_t G, const char* what, at::ScalarType type,
                        const char* shape) {
  // this type and nothing else: a wider tensor would be rounded here, out of the reference's sight.
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type, "w4_pack: ", what, " must be ",
              type == at::kHalf ? "a float16" : type == at::kChar ? "an int8" : "a uint8", " CPU tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == G, "w4_pack: ", what, " must be ", shape, " = [", N,
              ", ", G, "], got ", t.sizes());
  return t.contiguous();
}

at::Tensor check_q(const at::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && (q.scalar_type() == at::kChar || q.scalar_type() == at::kByte),
              "w4_pack: q must be a 2-D int8 or uint8 CPU tensor of values 0..15, got ", q.dim(), "-D ",
              q.scalar_type());
  return q.contiguous();
}

// Lane i's nibble bytes of group g (at `blk`, 64 * group / 8 bytes for 16 lanes) from row n
// of q [N, K]; returns the bits past 4 that any value had (nonzero: out of range).
uint8_t pack_lane_nibbles(const uint8_t* qs, int64_t K, int64_t n, int64_t g, int64_t group, int64_t i,
                          uint8_t* blk) {
  uint8_t bad = 0;
  for (int64_t st = 0; st < group / 8; ++st)
    for (int j = 0; j < 4; ++j) {
      const uint8_t* col = qs + n * K + g * group + 8 * st + j;
      bad |= col[0] | col[4];
      blk[64 * st + 4 * i + j] = static_cast<uint8_t>(col[0] | col[4] << 4);
    }
  return bad;
}

// Runs fn(v, i, n) for every real lane n = 16 v + i of an N-row weight, its vectors split over
// the threads; returns the OR of what fn returns (the bits past their width that a value had).
template <typename Fn>
uint8_t each_lane(int64_t N, Fn fn) {
  const int64_t L = quasar::kW4Lanes, vectors = (N + L - 1) / L;
  std::atomic<int> bad{0};
  at::parallel_for(0, vectors, 1, [&](int64_t v0, int64_t v1) {
    uint8_t b = 0;
    for (int64_t v = v0; v < v1; ++v)
      for (int64_t i = 0; i < L && v * L + i < N; ++i) b |= fn(v, i, v * L + i);
    bad.fetch_or(b, std::memory_order_relaxed);
  });
  return static_cast<uint8_t>(bad.load());
}

}  // namespace

// q [N, K] (int8 or uint8, values 0..15), scales and offsets [N, K / group] -> the packed
// uint8 [w4_packed_bytes(N, K, group)] of w4a8_gemm.h.
at::Tensor w4_pack(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& offsets, int64_t group) {
  const at::Tensor qc = check_q(q);
  const int64_t N = qc.size(0), K = qc.size(1);
  TORCH_CHECK(!quasar::w4_superblocks(group), "w4_pack: the Q4_K and Q6_K forms are packed by w4_pack_q4k and "
              "w4_pack_q6k");
  check_shape(N, K, group, "w4_pack");
  const int64_t G = K / group;
  const at::Tensor sc = group_params(scales, N, G, "scales", at::kHalf, "[N, K / group]"),
                   oc = group_params(offsets, N, G, "offsets", at::kHalf, "[N, K / group]");
  at::Tensor out = at::zeros({quasar::w4_packed_bytes(N, K, group)}, q.options().dtype(at::kByte));
  const uint8_t* qs = static_cast<const uint8_t*>(qc.data_ptr());  // int8 0..15 reads the same
  const uint16_t *s = static_cast<const uint16_t*>(sc.data_ptr()), *o = static_cast<const uint16_t*>(oc.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t vb = quasar::w4_vector_bytes(K, group), gb = quasar::w4_group_bytes(group), L = quasar::kW4Lanes;
  const uint8_t bad = each_lane(N, [&](int64_t v, int64_t i, int64_t n) {
    uint8_t wide = 0;
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* blk = dst + v * vb + g * gb;
      std::memcpy(blk + 8 * group + 2 * i, s + n * G + g, 2);
      std::memcpy(blk + 8 * group + 2 * L + 2 * i, o + n * G + g, 2);
      wide |= pack_lane_nibbles(qs, K, n, g, group, i, blk);
    }
    return wide;
  });
  TORCH_CHECK(!(bad & 0xF0), "w4_pack: q must hold 4-bit values 0..15 (found one outside)");
  return out;
}

// q [N, K] (values 0..15, K a multiple of 256), the 6-bit codes c and o uint8 [N, K / 32]
// (0..63, as a Q4_K file stores them), the superblock factors d and m float16 [N, K / 256] ->
// the packed uint8 of the Q4_K form (w4a8_gemm.h): scale = d * c, offset = m * o.
at::Tensor w4_pack_q4k(const at::Tensor& q, const at::Tensor& scale_codes, const at::Tensor& offset_codes,
                       const at::Tensor& super_scales, const at::Tensor& super_offsets) {
  const at::Tensor qc = check_q(q);
  const int64_t N = qc.size(0), K = qc.size(1), form = quasar::kW4Q4K, group = quasar::w4_group_size(form);
  check_shape(N, K, form, "w4_pack_q4k");
  const int64_t G = K / group, S = G / quasar::kW4SuperGroups;
  const at::Tensor c = group_params(scale_codes, N, G, "scale codes", at::kByte, "[N, K / 32]"),
                   o = group_params(offset_codes, N, G, "offset codes", at::kByte, "[N, K / 32]"),
                   d = group_params(super_scales, N, S, "superblock scales", at::kHalf, "[N, K / 256]"),
                   m = group_params(super_offsets, N, S, "superblock offsets", at::kHalf, "[N, K / 256]");
  TORCH_CHECK(!c.gt(63).any().item<bool>() && !o.gt(63).any().item<bool>(),
              "w4_pack_q4k: the scale and offset codes must be 6-bit values 0..63 (found one outside)");
  at::Tensor out = at::zeros({quasar::w4_packed_bytes(N, K, form)}, q.options().dtype(at::kByte));
  const uint8_t *qs = static_cast<const uint8_t*>(qc.data_ptr()), *cs = c.data_ptr<uint8_t>(),
                *os = o.data_ptr<uint8_t>();
  const uint16_t *ds = static_cast<const uint16_t*>(d.data_ptr()), *ms = static_cast<const uint16_t*>(m.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t vb = quasar::w4_vector_bytes(K, form), L = quasar::kW4Lanes;
  const uint8_t bad = each_lane(N, [&](int64_t v, int64_t i, int64_t n) {
    uint8_t wide = 0;
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* h = const_cast<uint8_t*>(quasar::w4_superblock(dst + v * vb, g / quasar::kW4SuperGroups, form));
      if (g % quasar::kW4SuperGroups == 0) {
        std::memcpy(h + 2 * i, ds + n * S + g / quasar::kW4SuperGroups, 2);
        std::memcpy(h + 2 * L + 2 * i, ms + n * S + g / quasar::kW4SuperGroups, 2);
      }
      const uint8_t cg = cs[n * G + g], og = os[n * G + g];  // as quasar::w4_q4k_lane_codes reads them
      const int64_t at = g % quasar::kW4SuperGroups / 2 * L + i;
      h[quasar::kW4Q4KLowBytesAt + g % 2 * 64 + at] = static_cast<uint8_t>((cg & 15) | (og & 15) << 4);
      h[quasar::kW4Q4KHighBytesAt + at] |= static_cast<uint8_t>(((cg >> 4) | (og >> 4) << 2) << (4 * (g % 2)));
      uint8_t* blk = const_cast<uint8_t*>(quasar::w4_group_nibbles(dst + v * vb, g, form));
      wide |= pack_lane_nibbles(qs, K, n, g, group, i, blk);
    }
    return wide;
  });
  TORCH_CHECK(!(bad & 0xF0), "w4_pack_q4k: q must hold 4-bit values 0..15 (found one outside)");
  return out;
}

// q [N, K] (values 0..63, K a multiple of 256), the int8 scales s [N, K / 16] and float16 d
// [N, K / 256] of a GGUF Q6_K tensor (w = d * s * (q - 32)) -> the packed uint8 of the Q6_K
// form (w4a8_gemm.h).
at::Tensor w4_pack_q6k(const at::Tensor& q, const at::Tensor& sub_scales, const at::Tensor& super_scales) {
  const at::Tensor qc = check_q(q);
  const int64_t N = qc.size(0), K = qc.size(1), form = quasar::kW4Q6K, L = quasar::kW4Lanes;
  check_shape(N, K, form, "w4_pack_q6k");
  const int64_t G = K / 32, S = G / quasar::kW4SuperGroups;
  const at::Tensor sc = group_params(sub_scales, N, 2 * G, "sub-block scales", at::kChar, "[N, K / 16]"),
                   d = group_params(super_scales, N, S, "superblock scales", at::kHalf, "[N, K / 256]");
  at::Tensor out = at::zeros({quasar::w4_packed_bytes(N, K, form)}, q.options().dtype(at::kByte));
  const uint8_t* qs = static_cast<const uint8_t*>(qc.data_ptr());
  const int8_t* ss = sc.data_ptr<int8_t>();
  const uint16_t* ds = static_cast<const uint16_t*>(d.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t vb = quasar::w4_vector_bytes(K, form);
  const uint8_t bad = each_lane(N, [&](int64_t v, int64_t i, int64_t n) {
    uint8_t wide = 0;
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* h = const_cast<uint8_t*>(quasar::w4_superblock(dst + v * vb, g / quasar::kW4SuperGroups, form));
      if (g % quasar::kW4SuperGroups == 0) std::memcpy(h + 2 * i, ds + n * S + g / quasar::kW4SuperGroups, 2);
      uint8_t* sub = const_cast<uint8_t*>(quasar::w4_q6k_scales(dst + v * vb, g));
      sub[i] = static_cast<uint8_t>(ss[n * 2 * G + 2 * g]);
      sub[L + i] = static_cast<uint8_t>(ss[n * 2 * G + 2 * g + 1]);
      uint8_t* p = const_cast<uint8_t*>(quasar::w4_group_nibbles(dst + v * vb, g, form));
      for (int64_t st = 0; st < 4; ++st)
        for (int j = 0; j < 4; ++j) {
          const uint8_t* col = qs + n * K + g * 32 + 8 * st + j;
          wide |= col[0] | col[4];
          p[64 * st + 4 * i + j] = static_cast<uint8_t>((col[0] & 15) | (col[4] & 15) << 4);
          p[256 + 64 * (st / 2) + 4 * i + j] |=
              static_cast<uint8_t>(((col[0] >> 4) | (col[4] >> 4) << 2) << (4 * (st % 2)));
        }
    }
    return wide;
  });
  TORCH_CHECK(!(bad & 0xC0), "w4_pack_q6k: q must hold 6-bit values 0..63 (found one outside)");
  return out;
}

// How far ahead the W4A8 kernels' passes prefetch (quasar::w4_prefetch_bytes): bytes < 0 only
// reads; else a multiple of 64 in [kW4PrefetchMin, kW4PrefetchMax] becomes the distance.
// Returns the previous one. Speed only: the results are the same.
int64_t w4_prefetch_distance(int64_t bytes) {
  if (bytes < 0) return quasar::w4_prefetch_bytes();
  TORCH_CHECK(bytes % 64 == 0 && bytes >= quasar::kW4PrefetchMin && bytes <= quasar::kW4PrefetchMax,
              "w4_prefetch_distance: the distance must be a multiple of 64 bytes in [", quasar::kW4PrefetchMin, ", ",
              quasar::kW4PrefetchMax, "], got ", bytes);
  return quasar::w4_set_prefetch_bytes(bytes);
}

// x [..., K] floating point, packed by w4_pack for (N, K, group), w4_pack_q4k or w4_pack_q6k
// (forms kW4Q4K, kW4Q6K; `group` is the form), bias [N] or None ->
// float32 [..., N]. path "": the active kernel path (less any the self-check disabled);
// else exactly that path's kernel (the self-check and tests; the CPU must run it).
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t K, int64_t group,
                       const std::optional<at::Tensor>& bias, const std::string& path) {
  check_shape(N, K, group, "w4a8_linear");
  TORCH_CHECK(x.device().is_cpu() && at::isFloatingType(x.scalar_type()) && x.dim() >= 1,
              "w4a8_linear: x must be a floating-point CPU tensor");
  TORCH_CHECK(x.size(-1) == K, "w4a8_linear: x has ", x.size(-1), " features, the weight K = ", K);
  const int64_t bytes = quasar::w4_packed_bytes(N, K, group);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 1 &&
                  packed.numel() == bytes && packed.is_contiguous(),
              "w4a8_linear: packed must be w4_pack's uint8 [", bytes, "] for N = ", N, ", K = ", K, ", group = ",
              group, ", got ", packed.scalar_type(), " ", packed.sizes());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->numel() == N, "w4a8_linear: bias must have N = ", N,
                " elements, got ", bias->numel());
    b = bias->to(at::kFloat).contiguous();
  }
  int p;
  if (path.empty()) {
    p = quasar::w4_path_for(quasar::kernel_path());
    TORCH_CHECK(p >= 0, "w4a8_linear: every W4A8 kernel path is disabled (the self-check failed)");
  } else {
    p = path_by_name(path);
    TORCH_CHECK(quasar::cpu_runs(static_cast<KernelPath>(p)), "w4a8_linear: this CPU does not run the ", path,
                " kernel path");
  }
  const quasar::W4RowsFn kernel = quasar::w4_kernel(static_cast<KernelPath>(p));
  const int64_t max_rows = quasar::w4_max_rows(static_cast<KernelPath>(p));

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), G = K / quasar::w4_group_size(group);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return y.view(out_shape);
  std::vector<int8_t> q(M * K);
  std::vector<float> sx(M * G), xs(M * G);
  std::vector<int32_t> xh(2 * M * G);
  const int64_t gs = quasar::w4_group_size(group);
  const float* xp = xf.data_ptr<float>();
  // rows apart on the threads (each row is quantized alone), >= 16K activations a task
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t{1} << 14) / K), [&](int64_t m0, int64_t m1) {
    quasar::w4_quantize_groups(xp + m0 * K, m1 - m0, K, gs, q.data() + m0 * K, sx.data() + m0 * G,
                               xs.data() + m0 * G, xh.data() + m0 * 2 * G, static_cast<KernelPath>(p));
  });
  const quasar::W4Acts acts{q.data(), K, sx.data(), xs.data(), G, xh.data()};

  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t vb = quasar::w4_vector_bytes(K, group), vectors = (N + quasar::kW4Lanes - 1) / quasar::kW4Lanes;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / vb);  // >= 64 KiB of weights a task
  at::parallel_for(0, vectors, grain, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t n0 = v * quasar::kW4Lanes;
      quasar::w4_vector_rows(kernel, max_rows, w + v * vb, K, group, acts, M, std::min(quasar::kW4Lanes, N - n0),
                             bp ? bp + n0 : nullptr, yp + n0, N, quasar::prefetch_stream_at((v - v0) * vb));
    }
  });
  return y.view(out_shape);
}

// The kernel path the W4A8 op runs now (the active one, amx served by the avx512-vnni kernel,
// less disabled ones; "" when every one is disabled). With a name, first disable that path's
// W4A8 kernel (the self-check's verdict; the int8 ops keep it).
std::string w4a8_kernel_path(const std::string& disable) {
  if (!disable.empty()) quasar::w4_disable_path(static_cast<KernelPath>(path_by_name(disable)));
  const int p = quasar::w4_path_for(quasar::kernel_path());
  return p < 0 ? std::string() : std::string(quasar::kernel_path_name(static_cast<KernelPath>(p)));
}
