// The small-M int8 GEMM written once: the portable path's tile sums, and the driver every
// path shares (the work split, the per-path choice of tile sums, comp and the epilogue).
//
// Small M (the verifier's k + 1 tokens, a prefill chunk): decoding is memory-bound and the
// weight need only be read once, so the GEMM runs on the weight repacked once, at load, into
// tiles of 64 rows (pack.cpp: pack_tiles): a tile is one sequential stream, and each row
// passes over it while it is in L2. Integer sums are exact on every path (the wrapped sum
// minus comp is the true value, which fits in int32 for K <= MAX_IN_FEATURES), so the int32s,
// and with the unchanged epilogue the outputs, are bitwise those of Int8Linear's PyTorch path.
// The tile sums per path: portable (here), AVX2 / AVX-VNNI (x86_avx2.cpp), AVX512-VNNI
// (x86_avx512.cpp), AMX (../amx/gemm.cpp).
//
// Portable tile sums: one weight tile of pack_tiles' layout, vectors [v0, v0 + nv), every row
// of x (the quantizers' x + 128 bytes, read back as signed q), exact int32 sums of q * w into
// acc [M, kTile] (columns relative to v0; no comp to take off). A 64-byte group is 16 outputs
// x 4 columns: the inner loop is exactly a 4-way int8 dot product per output lane, which is
// where an ARMv8.2 `sdot` (16 lanes of 4 products per instruction) slots in.
#include "gemm_w8a8/kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace quasar {

void tile_rows_portable(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0,
                        int64_t nv, int32_t* acc) {
  const int64_t k4 = padded_k(K), groups = (K + 3) / 4, group_bytes = stride * 64;
  for (int64_t r = 0; r < M; ++r) {
    const uint8_t* xr = x + r * k4;
    int32_t* a = acc + r * kTile;
    for (int64_t c = 0; c < 16 * nv; ++c) a[c] = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t q0 = int32_t{xr[4 * g]} - 128, q1 = int32_t{xr[4 * g + 1]} - 128;
      const int32_t q2 = int32_t{xr[4 * g + 2]} - 128, q3 = int32_t{xr[4 * g + 3]} - 128;
      const int8_t* p = t + g * group_bytes + v0 * 64;
      for (int64_t c = 0; c < 16 * nv; ++c) {
        const int8_t* w = p + 4 * c;  // output c's four weights of this group
        a[c] += q0 * w[0] + q1 * w[1] + q2 * w[2] + q3 * w[3];
      }
    }
  }
}

// ---------------------------------------------------------------- settings and path checks
Int8Settings& int8_settings() {
  static Int8Settings settings;
  return settings;
}

bool vnni_supported(KernelPath path) {
#ifdef QUASAR_VNNI_KERNEL
  return path_at_least(path, KernelPath::kAvx512Vnni);
#else
  (void)path;
  return false;
#endif
}

bool amx_supported(KernelPath path) {
#ifdef QUASAR_AMX_KERNEL
  return path == KernelPath::kAmx;
#else
  (void)path;
  return false;
#endif
}

bool amx_enabled(KernelPath path) {
  return amx_supported(path) && int8_settings().amx_min_rows.load(std::memory_order_relaxed) > 0;
}

bool prefetch_whole_stream() { return int8_settings().stream_prefetch.load(std::memory_order_relaxed) != 0; }

// ---------------------------------------------------------------- quantizers
void quantize_rows_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* q, float* sx, KernelPath path) {
  if (vnni_supported(path)) return quantize_u8_avx512(x, m_len, k_len, q, sx);
  quantize_rows<uint8_t, 128>(x, m_len, k_len, q, sx, padded_k(k_len));
}

void quantize_rows_split_u8(const float* x, int64_t m_len, int64_t k_len, uint8_t* hi, uint8_t* lo, float* sx,
                            KernelPath path) {
  if (vnni_supported(path)) return quantize_split_avx512(x, m_len, k_len, hi, lo, sx);
  quantize_split(x, m_len, k_len, hi, lo, sx);
}

// ---------------------------------------------------------------- the driver
namespace {

// finish_chunk compiled for AVX512 (the AVX512 paths, x86_avx512.cpp) and for the baseline
// ISA (the others); elementwise IEEE operations, so both give the same bits.
// finish_chunk compiled for AVX512 (the AVX512 paths) and for the baseline ISA (the others);
// elementwise IEEE operations, so both give the same bits.
template <bool kSplit>
void finish_chunk_baseline(int32_t* acc, int32_t* acc_lo, int64_t* wide, int64_t M, int64_t n_len,
                           const Int8Segment& g, int64_t n0, const float* sx, float* y, int64_t y_stride,
                           bool offset) {
  finish_chunk<kSplit>(acc, acc_lo, wide, M, n_len, g, n0, sx, y, y_stride, offset);
}

template <bool kSplit>
FinishFn finish_for(KernelPath path) {
  if (path >= KernelPath::kAvx512Vnni) return finish_chunk_avx512(kSplit);
  return finish_chunk_baseline<kSplit>;
}

// The bytes the thread reads after the tile that ends at vector `v_next` of its range [.., v1),
// for passes computing on bytes already in cache to bring into L2 (AVX2 and AVX-VNNI: their
// rows cost arithmetic the stream would otherwise wait for; see x86_avx2.cpp): from the start
// of the tile holding v_next (in its own segment: the next weight may be another array) up to
// one tile, at most kAheadMaxBytes, and never past the range's part of that segment (the
// other thread's bytes). One tile ahead lets the rows after the first pass over a whole tile
// in L2; it made multi-row steps on forced AVX2 faster than without, and a fixed 64 KiB or
// 1 MiB ahead was slower than one tile.
constexpr int64_t kAheadMaxBytes = 256 << 10;

StreamAhead stream_ahead(const SmallMGemm& g, const int64_t* vector_first, int64_t s, int64_t v_next,
                                 int64_t v1) {
  constexpr int64_t kTileVectors = kTile / 16;
  if (v_next >= v1) return {};
  while (v_next >= vector_first[s + 1]) ++s;
  const int64_t k4 = padded_k(g.K), seg_vectors = vector_first[s + 1] - vector_first[s];
  const int64_t first = (v_next - vector_first[s]) / kTileVectors * kTileVectors;  // its tile's first vector
  const int64_t last = std::min(v1, vector_first[s + 1]) - vector_first[s];         // one past the range's last
  const int64_t end = std::min((last + kTileVectors - 1) / kTileVectors * kTileVectors, seg_vectors);
  const int64_t bytes = std::min({(end - first) * 16 * k4, kTile * k4, kAheadMaxBytes});
  return {g.segs[s].tiles + first * 16 * k4, bytes, false};
}

// The outputs of vectors [v0, v1) of a small-M GEMM (a vector is 16 output columns of one
// weight tile; vector_first[s] is segment s's first): each tile's sums for all M rows, then
// comp and the epilogue (elementwise, so how vectors are spread over threads never changes
// a bit). A tile is taken whole where it can be; the range's ends may cut one, so two
// threads share it (a GEMM of 9 tiles, as the default model's o and down projections, is
// split 4.5 / 4.5, not 5 / 4). Rows past the first pass's 6 (VNNI) are further passes over
// the tile while it is in L2, not another read from memory, so up to kTiledMaxRows rows (a
// prefill chunk of the fused decoder op) read the weights once; with AMX, 16 rows are one
// tdpbusd. kSplit: 15-bit activations, q = 128 * hi + lo, given as two uint8 arrays
// (hi + 128, lo + 128); both products are exact int32s, combined in int64.
// `path` picks the tile sums (AMX, AVX512-VNNI, AVX-VNNI, AVX2 or portable: the same
// int32s once comp is off, so the path never changes a bit of the outputs).
template <bool kSplit>
void gemm_vectors(const SmallMGemm& g, const int64_t* vector_first, KernelPath path, int64_t v0,
                  int64_t v1) {
  constexpr int64_t kChunk = kTile, kTileVectors = kChunk / 16;
  const int64_t M = g.M, K = g.K, k4 = padded_k(K);
  // Per-thread scratch, kept between calls (a step makes hundreds).
  thread_local std::vector<int32_t> acc_buf, acc_lo_buf;
  thread_local std::vector<int64_t> wide_buf;
  acc_buf.resize(M * kChunk);
  if (kSplit) acc_lo_buf.resize(M * kChunk), wide_buf.resize(M * kChunk);
  int32_t *acc = acc_buf.data(), *acc_lo = acc_lo_buf.data();
  int64_t* wide = wide_buf.data();
  // The tile configuration is per thread, and other code (oneDNN) may change it between
  // calls: set it here, release the tiles at the end.
  int64_t configured = 0;
  // symmetric: the segment's weights are in [-127, 127] (tiles_symmetric; the AVX2 kernel's shorter form)
  const auto sums = [&](const uint8_t* xr, const int8_t* tile, int64_t stride, int64_t va, int64_t nv, int32_t* a,
                        bool symmetric, const StreamAhead& next) {
    switch (path) {
      case KernelPath::kAmx: return tile_rows_amx(xr, M, K, tile, stride, va, nv, a, configured);
      case KernelPath::kAvx512Vnni: return tile_rows_avx512(xr, M, K, tile, stride, va, nv, a);
      case KernelPath::kAvxVnni: return tile_rows_avx_vnni(xr, M, K, tile, stride, va, nv, a, next);
      case KernelPath::kAvx2: return tile_rows_avx2(xr, M, K, tile, stride, va, nv, a, symmetric, next);
      case KernelPath::kPortable: return tile_rows_portable(xr, M, K, tile, stride, va, nv, a);
    }
  };
  const bool offset = path >= KernelPath::kAvxVnni;  // u8 x s8 sums: comp to take off
  const FinishFn finish = finish_for<kSplit>(path);
  int64_t s = 0;
  for (int64_t v = v0; v < v1;) {
    while (v >= vector_first[s + 1]) ++s;
    const Int8Segment& seg = g.segs[s];
    const int64_t in_seg = v - vector_first[s], n0 = in_seg / kTileVectors * kChunk;
    const int64_t n_len = std::min(seg.n - n0, kChunk), stride = (n_len + 15) / 16;  // the tile's vectors
    const int64_t va = in_seg % kTileVectors, vb = std::min(stride, va + (v1 - v));  // [va, vb) of them
    const int8_t* tile = seg.tiles + n0 * k4;
    const bool symmetric = tiles_symmetric(seg.tiles, seg.n, K);
    StreamAhead next = stream_ahead(g, vector_first, s, v + (vb - va), v1);
    next.prefetch_stream = prefetch_stream_at((v - std::max(v0, vector_first[s])) * 16 * k4);
    if (kSplit) {  // the low half's passes all find the tile in cache: they fetch ahead
      StreamAhead stream{};
      stream.prefetch_stream = next.prefetch_stream;
      sums(g.xu, tile, stride, va, vb - va, acc, symmetric, stream);
      next.tile_cached = true;
      sums(g.xlo, tile, stride, va, vb - va, acc_lo, symmetric, next);
    } else {
      sums(g.xu, tile, stride, va, vb - va, acc, symmetric, next);
    }
    finish(acc, acc_lo, wide, M, std::min(n_len, 16 * vb) - 16 * va, seg, n0 + 16 * va, g.sx, g.y, g.y_stride,
           offset);
    v += vb - va;
  }
  if (configured) amx_release();
}

}  // namespace

SmallMGemm::SmallMGemm(const uint8_t* xu_, const uint8_t* xlo_, int64_t M_, int64_t K_, const Int8Segment* segs_,
                       int64_t n_segs_, const float* sx_, float* y_, int64_t y_stride_, KernelPath path_)
    : xu(xu_), xlo(xlo_), M(M_), K(K_), segs(segs_), n_segs(n_segs_), sx(sx_), y(y_), y_stride(y_stride_) {
  TORCH_CHECK(M >= 1 && M <= kTiledMaxRows, "int8 small-M GEMM called with M = ", M);
  TORCH_CHECK(n_segs >= 1 && n_segs <= kMaxSegments, "int8 small-M GEMM: 1..", kMaxSegments, " segments");
  vector_first[0] = 0;
  for (int64_t s = 0; s < n_segs; ++s) {
    TORCH_CHECK(segs[s].tiles != nullptr, "int8 small-M GEMM: the weight must be packed in tiles");
    vector_first[s + 1] = vector_first[s] + (segs[s].n + 15) / 16;
  }
  const int64_t amx_min = int8_settings().amx_min_rows.load(std::memory_order_relaxed);
  path = path_;
  if (path == KernelPath::kAmx && !(amx_min > 0 && M >= amx_min)) path = KernelPath::kAvx512Vnni;
}

void SmallMGemm::run(int64_t v0, int64_t v1) const {
  if (xlo)
    gemm_vectors<true>(*this, vector_first, path, v0, v1);
  else
    gemm_vectors<false>(*this, vector_first, path, v0, v1);
}

// All vectors over the intra-op threads; a task reads at least ~64 KiB of weights (less does
// not pay for waking a thread).
void SmallMGemm::run_parallel() const {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (16 * K));
  at::parallel_for(0, vectors(), grain, [&](int64_t v0, int64_t v1) { run(v0, v1); });
}

void small_m_gemm(const uint8_t* xu, int64_t M, int64_t K, const Int8Segment* segs, int64_t n_segs,
                  const float* sx, float* y, int64_t y_stride, KernelPath path) {
  small_m_gemm_split(xu, nullptr, M, K, segs, n_segs, sx, y, y_stride, path);
}

// Any M, kTiledMaxRows rows a call (each row is computed alone, so the chunking changes no bit).
void small_m_gemm_split(const uint8_t* xhi, const uint8_t* xlo, int64_t M, int64_t K, const Int8Segment* segs,
                        int64_t n_segs, const float* sx, float* y, int64_t y_stride, KernelPath path) {
  const int64_t k4 = padded_k(K);
  for (int64_t r0 = 0; r0 < M; r0 += kTiledMaxRows)
    SmallMGemm(xhi + r0 * k4, xlo ? xlo + r0 * k4 : nullptr, std::min(kTiledMaxRows, M - r0), K, segs, n_segs,
               sx + r0, y + r0 * y_stride, y_stride, path)
        .run_parallel();
}

}  // namespace quasar
