// The small-M GEMM's tile sums on 256-bit x86 paths: AVX2 (+FMA) and AVX-VNNI.
//
// Same layout and contract as the AVX512-VNNI kernel (x86_avx512.cpp, tile_rows_avx512): one
// weight tile of pack_tiles' layout, vectors [v0, v0 + nv) of it, every row of x; a 64-byte
// group (16 rows x 4 columns) is two ymm loads of 8 rows each, and the sums land in
// acc [M, kTile] (columns relative to v0) with no horizontal reduction left.
//
// AVX2 has no u8 x s8 dot product into int32 lanes. vpmaddubsw (u8 x s8 pairs into int16,
// saturating) and vpmaddwd (int16 pairs into int32) make one, exact when no int16 pair
// sum can exceed 32,767. The activations are the quantizers' x + 128 bytes turned back into
// signed q in [-127, 127] (8-bit rows, and both halves of a 15-bit split: see
// quantize_split). Two forms, both exact:
// - symmetric weights (all in [-127, 127], as Quasar quantizes them; tiles_symmetric): |q|
//   as the u8 operand, w with q's sign moved onto it by vpsignb as the s8 one. |q| is one
//   vpabsb per broadcast, shared by every weight, so a weight vector costs four
//   instructions; a pair is at most 2 * 127 * 127 = 32,258.
// - any int8 weights: |w| (<= 128) as the u8 operand and q with w's sign as the s8 one (q is
//   never -128, so vpsignb cannot overflow); a pair is at most 2 * 128 * 127 = 32,512, and
//   each weight vector costs a vpabsb more.
// These are exact sums of q * w, not of (q + 128) * w: no comp to take off.
// AVX-VNNI's 256-bit vpdpbusd multiplies the u8 bytes directly, as the AVX512 kernel does
// (comp still to take off).
#include "gemm_w8a8/int8_gemm.h"

#include <algorithm>
#include <cstring>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>

namespace quasar {
namespace {

// How far ahead of its loads the streaming pass asks for weights, into L2. A 64-byte line
// costs this kernel ~10 instructions (the AVX512 kernel's: two), so the out-of-order window
// holds few lines in flight and the hardware prefetcher alone leaves a one-row step well
// above its streaming floor; 4 KiB ahead brings it closer (2 and 8 KiB were no better).
// Not into L1 (_MM_HINT_T0): its few fill buffers, not the distance, are the limit there.
// Not every CPU gains: on some the hardware prefetcher streams long runs faster alone, so
// one-row passes may prefetch only each stream's first 64 KiB (StreamAhead::prefetch_stream;
// the step-cost probe picks per CPU and model).
constexpr int64_t kPrefetchBytes = 4096;

// Several rows: the tile a block of kBlockGroups groups (16 KiB of a full tile, in L1) at a
// time, every row's passes over a block before the next block, while the lines
// kBlockAheadBytes further on are prefetched a few a group, spread over all of the block's
// passes, so memory keeps streaming at its pace while the cores multiply. It replaced a first
// row streaming the whole tile and the other rows passing over it in L2, which fetched the
// next tile meanwhile: there the stream waited whenever the arithmetic ran, and multi-row
// steps cost more on both AVX-VNNI and AVX2 (the same bits either way). 64 groups and 16 KiB
// ahead sit in a flat range: 32-128 groups and 16-64 KiB ahead were within noise.
constexpr int64_t kBlockGroups = 64;
constexpr int64_t kBlockAheadBytes = 16 << 10;

// The stream's next lines, asked for at `rate` lines (in 1/65536ths) per group of the passes
// that compute on bytes already in cache, spread evenly over them; the state carries over
// from pass to pass. Its lines are `left` from p, then `then_left` from then_p (the thread's
// next tile, which need not follow this one in memory).
struct Ahead {
  const char* p = nullptr;
  int64_t left = 0, rate = 0, due = 0;
  const char* then_p = nullptr;
  int64_t then_left = 0;
};

inline void ahead_line(Ahead& a) {
  for (a.due += a.rate; a.due >= 65536; a.due -= 65536) {
    if (a.left == 0) {
      if (a.then_left == 0) return;
      a.p = a.then_p, a.left = a.then_left, a.then_left = 0;
    }
    _mm_prefetch(a.p, _MM_HINT_T1);
    a.p += 64, --a.left;
  }
}

// A pass's R x NV x 2 sums at its start: from zero on a tile's first group (g0 == 0), else
// the earlier blocks' in acc; and back into acc at its end.
template <int R, int NV>
__attribute__((target("avx2"), always_inline)) inline void load_sums(__m256i (&a)[R][NV][2], const int32_t* acc,
                                                                     int64_t g0) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      for (int h = 0; h < 2; ++h)
        a[r][v][h] = g0 > 0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * kTile + v * 16 + h * 8))
                            : _mm256_setzero_si256();
}

template <int R, int NV>
__attribute__((target("avx2"), always_inline)) inline void store_sums(const __m256i (&a)[R][NV][2], int32_t* acc) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kTile + v * 16 + h * 8), a[r][v][h]);
}

inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// R rows x NV vectors of one tile; 2 * R * NV accumulators + 2 R broadcasts + 3 temporaries
// fit AVX2's 16 ymm registers for (R, NV) in (1, 1..4), (2, 1..2).
template <int R, int NV, bool kSymmetric>
__attribute__((target("avx2,fma"))) void pass_avx2(const uint8_t* x, int64_t ldx, int64_t g0, int64_t g1,
                                                   const int8_t* t, int64_t group_bytes, int32_t* acc, Ahead* ahead) {
  __m256i a[R][NV][2];
  load_sums<R, NV>(a, acc, g0);
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  Ahead ah = ahead ? *ahead : Ahead{};
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* p = t + g * group_bytes;
    if (!ahead)  // a streaming pass that prefetches: see kPrefetchBytes
      for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + v * 64), _MM_HINT_T1);
    else
      ahead_line(ah);
    __m256i xb[R], xabs[R];
    for (int r = 0; r < R; ++r) {
      xb[r] = _mm256_xor_si256(_mm256_set1_epi32(load_u32(x + r * ldx + 4 * g)), flip);
      if (kSymmetric) xabs[r] = _mm256_abs_epi8(xb[r]);
    }
    for (int v = 0; v < NV; ++v)
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + v * 64 + h * 32));
        if (kSymmetric) {
          for (int r = 0; r < R; ++r)
            a[r][v][h] = _mm256_add_epi32(
                a[r][v][h], _mm256_madd_epi16(_mm256_maddubs_epi16(xabs[r], _mm256_sign_epi8(w, xb[r])), ones));
        } else {
          const __m256i wabs = _mm256_abs_epi8(w);
          for (int r = 0; r < R; ++r)
            a[r][v][h] = _mm256_add_epi32(
                a[r][v][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xb[r], w)), ones));
        }
      }
  }
  if (ahead) *ahead = ah;
  store_sums<R, NV>(a, acc);
}

#if __GNUC__ >= 11 || defined(__clang__)
#define QUASAR_AVX_VNNI_KERNEL 1
template <int R, int NV>
__attribute__((target("avx2,avxvnni"))) void pass_avx_vnni(const uint8_t* x, int64_t ldx, int64_t g0, int64_t g1,
                                                           const int8_t* t, int64_t group_bytes, int32_t* acc,
                                                           Ahead* ahead) {
  __m256i a[R][NV][2];
  load_sums<R, NV>(a, acc, g0);
  Ahead ah = ahead ? *ahead : Ahead{};
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* p = t + g * group_bytes;
    if (!ahead)  // a streaming pass that prefetches: see kPrefetchBytes
      for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + v * 64), _MM_HINT_T1);
    else
      ahead_line(ah);
    __m256i xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_epi32(load_u32(x + r * ldx + 4 * g));
    for (int v = 0; v < NV; ++v)
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + v * 64 + h * 32));
        for (int r = 0; r < R; ++r) a[r][v][h] = _mm256_dpbusd_avx_epi32(a[r][v][h], xb[r], w);
      }
  }
  if (ahead) *ahead = ah;
  store_sums<R, NV>(a, acc);
}
#endif

// (x, ldx, g0, g1, t, group_bytes, acc, ahead): the sums of the groups [g0, g1) of a tile.
using PassFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, int64_t, int32_t*, Ahead*);

// What a block's passes prefetch: the bytes kBlockAheadBytes past the block [from, to) (byte
// offsets in a tile of tile_bytes at t), continued into the thread's next tile past this one's
// end (next; nothing past its range's end), spread over `passes` passes of `groups` groups.
Ahead block_ahead(const int8_t* t, int64_t tile_bytes, int64_t from, int64_t to, const StreamAhead& next,
                  int64_t passes, int64_t groups) {
  Ahead a{};
  const int64_t lo = from + kBlockAheadBytes, hi = to + kBlockAheadBytes;
  const char* base = reinterpret_cast<const char*>(t);
  if (lo < tile_bytes) a.p = base + lo, a.left = (std::min(hi, tile_bytes) - lo) / 64;
  if (hi > tile_bytes && next.bytes > 0) {
    const int64_t nlo = std::max(lo, tile_bytes) - tile_bytes, nhi = std::min(hi - tile_bytes, next.bytes);
    if (nhi > nlo) {
      (a.left > 0 ? a.then_p : a.p) = reinterpret_cast<const char*>(next.p) + nlo;
      (a.left > 0 ? a.then_left : a.left) = (nhi - nlo) / 64;
    }
  }
  a.rate = ((a.left + a.then_left) << 16) / (passes * groups) + 1;
  return a;
}

// One weight tile's sums for M rows. One row: one pass over all the tile's vectors, read from
// memory as one stream (as the AVX512 kernel reads it). Several rows: block by block (see
// kBlockGroups), two rows at a time over pairs of vectors, where a weight load serves both
// rows. When the tile is in cache already (the low half of 15-bit activations: tile_cached),
// the first row's pass over the whole tile and then the others' bring the thread's next tile
// into L2 meanwhile (see StreamAhead).
template <PassFn (*Pick)(int, int, bool)>
void tile_rows_256(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0, int64_t nv,
                   int32_t* acc, bool symmetric, const StreamAhead& next) {
  const int64_t k4 = padded_k(K), group_bytes = stride * 64, groups = (K + 3) / 4;
  if (M > 1 && !next.tile_cached) {
    const int64_t passes = (nv + 1) / 2 * ((M + 1) / 2), tile_bytes = group_bytes * (k4 / 4);
    for (int64_t g0 = 0; g0 < groups; g0 += kBlockGroups) {
      const int64_t g1 = std::min(groups, g0 + kBlockGroups);
      Ahead ahead = block_ahead(t, tile_bytes, g0 * group_bytes, g1 * group_bytes, next, passes, g1 - g0);
      for (int64_t vc = 0; vc < nv; vc += 2) {
        const int nvc = static_cast<int>(nv - vc < 2 ? nv - vc : 2);
        for (int64_t r0 = 0; r0 < M; r0 += 2)
          Pick(M - r0 < 2 ? 1 : 2, nvc, symmetric)(x + r0 * k4, k4, g0, g1, t + (v0 + vc) * 64, group_bytes,
                                                   acc + r0 * kTile + vc * 16, &ahead);
      }
    }
    return;
  }
  const int64_t cached_passes = (next.tile_cached ? 1 : 0) + (nv + 1) / 2 * (M / 2);
  Ahead ahead{};
  if (cached_passes > 0 && next.bytes >= 64) {
    const int64_t lines = next.bytes / 64;
    ahead.p = reinterpret_cast<const char*>(next.p);
    ahead.left = lines;
    ahead.rate = std::min<int64_t>(4 << 16, (lines << 16) / (cached_passes * groups) + 1);
  }
  Ahead none{};  // a streaming pass left to the hardware prefetcher
  Pick(1, static_cast<int>(nv), symmetric)(x, k4, 0, groups, t + v0 * 64, group_bytes, acc,
                                           next.tile_cached ? &ahead : next.prefetch_stream ? nullptr : &none);
  for (int64_t vc = 0; vc < nv; vc += 2) {
    const int nvc = static_cast<int>(nv - vc < 2 ? nv - vc : 2);
    for (int64_t r0 = 1; r0 < M; r0 += 2) {
      const int rows = M - r0 < 2 ? 1 : 2;
      Pick(rows, nvc, symmetric)(x + r0 * k4, k4, 0, groups, t + (v0 + vc) * 64, group_bytes,
                                 acc + r0 * kTile + vc * 16, &ahead);
    }
  }
}

template <bool kSymmetric>
PassFn pick_avx2_form(int rows, int nv) {
  static constexpr PassFn kOne[4] = {pass_avx2<1, 1, kSymmetric>, pass_avx2<1, 2, kSymmetric>,
                                     pass_avx2<1, 3, kSymmetric>, pass_avx2<1, 4, kSymmetric>};
  static constexpr PassFn kTwo[2] = {pass_avx2<2, 1, kSymmetric>, pass_avx2<2, 2, kSymmetric>};
  return rows == 1 ? kOne[nv - 1] : kTwo[nv - 1];
}

PassFn pick_avx2(int rows, int nv, bool symmetric) {
  return symmetric ? pick_avx2_form<true>(rows, nv) : pick_avx2_form<false>(rows, nv);
}

#ifdef QUASAR_AVX_VNNI_KERNEL
PassFn pick_avx_vnni(int rows, int nv, bool) {  // u8 x s8 products: any int8 weight
  static constexpr PassFn kOne[4] = {pass_avx_vnni<1, 1>, pass_avx_vnni<1, 2>, pass_avx_vnni<1, 3>,
                                     pass_avx_vnni<1, 4>};
  static constexpr PassFn kTwo[2] = {pass_avx_vnni<2, 1>, pass_avx_vnni<2, 2>};
  return rows == 1 ? kOne[nv - 1] : kTwo[nv - 1];
}
#endif

}  // namespace

void tile_rows_avx2(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0, int64_t nv,
                    int32_t* acc, bool symmetric, const StreamAhead& next) {
  tile_rows_256<pick_avx2>(x, M, K, t, stride, v0, nv, acc, symmetric, next);
}

void tile_rows_avx_vnni(const uint8_t* x, int64_t M, int64_t K, const int8_t* t, int64_t stride, int64_t v0,
                        int64_t nv, int32_t* acc, const StreamAhead& next) {
#ifdef QUASAR_AVX_VNNI_KERNEL
  tile_rows_256<pick_avx_vnni>(x, M, K, t, stride, v0, nv, acc, false, next);
#else
  (void)x, (void)M, (void)K, (void)t, (void)stride, (void)v0, (void)nv, (void)acc, (void)next;
  __builtin_trap();  // cpu_runs(kAvxVnni) is false where this is not compiled in
#endif
}

}  // namespace quasar

#else  // not x86: these paths never run (cpu_runs is false), but the library links

namespace quasar {
void tile_rows_avx2(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int64_t, int64_t, int32_t*, bool,
                    const StreamAhead&) {
  __builtin_trap();
}
void tile_rows_avx_vnni(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int64_t, int64_t, int32_t*,
                        const StreamAhead&) {
  __builtin_trap();
}
}  // namespace quasar

#endif
