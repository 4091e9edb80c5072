// The W4A8 kernels on 256-bit x86 vectors: AVX2 and AVX-VNNI (the 512-bit one is in
// x86_avx512.cpp). Layout and contract: w4a8_gemm.h.
//
// Per step (8 columns of 16 lanes, 64 bytes) the nibbles are unpacked in registers: w & 0x0F
// is columns k0..k0+3 of each lane, (w >> 4) & 0x0F columns k0+4..k0+7 (a 16-bit shift is
// fine: the mask drops the bits that cross bytes). Both are u8 operands as they are; the
// activations, broadcast 4 bytes at a time, are the s8 operands. The group's int32 sums S
// are exact on every path and the epilogue is the reference's order with separate roundings
// (mul, then add; the library is built with -ffp-contract=off and uses no FMA intrinsic):
//   acc = (acc + (float(S) * sx) * scale) + xs * offset
// Rows come R at a time (template R): a weight load and its unpacking serve all R rows, and
// only the first pass over a vector reads it from memory (the next ones find it in L1/L2).
// A pass that streams prefetches its lines `ahead` bytes ahead (w4_prefetch_bytes): these
// kernels spend several instructions per 64-byte line, a pass of many rows dozens, so the
// out-of-order window alone keeps few lines in flight. Steps of several rows always ask
// (w4_vector_rows): without it their extra rows cost a large share of a one-row step. Where
// the hardware prefetcher streams faster alone (on some CPUs) the caller passes ahead = 0 to
// one-row passes past each stream's start (prefetch_whole_stream).
#include "gemm_w4a8/w4a8_gemm.h"
#include "common/activation_quant.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include "gemm_w4a8/x86_common.h"

namespace quasar {
namespace {

using namespace w4x86;  // x86_common.h: prefetches, loads, kernel table index

// A Q4_K superblock's codes unpacked (kW4Q4KCodeBytes, w4a8_gemm.h) from its header `h`, 32
// bytes of each quarter at a time (as the 512-bit kernel's q4k_codes_avx512): the low nibbles
// of the even and the odd groups' bytes, with the high bits moved to bits 4-5.
__attribute__((target("avx2"), always_inline)) inline __m256i q4k_code_bytes(__m256i nibble, __m256i high) {
  return _mm256_or_si256(_mm256_and_si256(nibble, _mm256_set1_epi8(0x0F)),
                         _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}
__attribute__((target("avx2"), always_inline)) inline void q4k_codes_avx2(const uint8_t* h, uint8_t* out) {
  for (int64_t j = 0; j < 64; j += 32) {
    const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + kW4Q4KLowBytesAt + j)),
                  odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + kW4Q4KLowBytesAt + 64 + j)),
                  hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + kW4Q4KHighBytesAt + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), q4k_code_bytes(even, _mm256_slli_epi16(hb, 4)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 + j),
                        q4k_code_bytes(_mm256_srli_epi16(even, 4), _mm256_slli_epi16(hb, 2)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 + j), q4k_code_bytes(odd, hb));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 192 + j),
                        q4k_code_bytes(_mm256_srli_epi16(odd, 4), _mm256_srli_epi16(hb, 2)));
  }
}

// A group's epilogue on 256-bit vectors (both 256-bit kernels): its 16 scales and 16 offsets
// (float16 after its nibbles `p`, widened exactly by vcvtph2ps; SB, the Q4_K form: d * c and
// m * o, d and m from its superblock's header, `codes` its 16 c and, 64 bytes on, 16 o as
// q4k_codes_avx2 unpacked them; exact products), the exact sums s of R rows, into their
// accumulators.
template <int R, bool SB>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void group_epilogue_256(
    const uint8_t* vec, const uint8_t* p, const uint8_t* codes, int64_t group, const W4Acts& a, int64_t g,
    const __m256i (&s)[R][2], __m256 (&acc)[R][2], int64_t ahead) {
  const uint8_t* so = p + 8 * group;
  if (!SB && ahead) prefetch(so + ahead);
  for (int half = 0; half < 2; ++half) {
    __m256 sc, of;
    if constexpr (SB) {
      const uint8_t* h = w4_superblock(vec, g / kW4SuperGroups, kW4Q4K);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16 * half)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 32 + 16 * half)));
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * half)));
      const __m256i o =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 64 + 8 * half)));
      sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(c));
      of = _mm256_mul_ps(m, _mm256_cvtepi32_ps(o));
    } else {
      sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(so + 16 * half)));
      of = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(so + 32 + 16 * half)));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sx = _mm256_set1_ps(a.sx[r * a.ldg + g]), xs = _mm256_set1_ps(a.xs[r * a.ldg + g]);
      const __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[r][half]), sx), sc);
      acc[r][half] = _mm256_add_ps(_mm256_add_ps(acc[r][half], t), _mm256_mul_ps(xs, of));
    }
  }
}

// Each of R rows' activations of columns k..k+3 and k+4..k+7, four bytes broadcast to every lane.
template <int R>
__attribute__((target("avx2"), always_inline)) inline void broadcast_x(const W4Acts& a, int64_t k, __m256i (&xa)[R],
                                                                      __m256i (&xb)[R]) {
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.q + r * a.ldq + k;
    xa[r] = _mm256_set1_epi32(load_u32(x));
    xb[r] = _mm256_set1_epi32(load_u32(x + 4));
  }
}

// ------------------------------------------------------------------ the Q6_K form on 256 bits
// A step's 6-bit columns of lanes 8 half .. 8 half + 7 (w4a8_gemm.h): its nibbles with the two
// high bits of its pair's high block or'ed in above them.
struct Q6Columns {
  __m256i lo, hi;
};
__attribute__((target("avx2"), always_inline)) inline Q6Columns q6k_columns(const uint8_t* p, int st, int half) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * st + 32 * half));
  __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 + 64 * (st / 2) + 32 * half));
  if (st % 2) hb = _mm256_srli_epi16(hb, 4);
  return {_mm256_or_si256(_mm256_and_si256(w, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low),
                          _mm256_and_si256(_mm256_slli_epi16(hb, 2), top))};
}

// The Q6_K epilogue of group g for R rows: s[r][ab][half] are S_a, S_b of lanes 8 half ...
template <int R>
__attribute__((target("avx2,f16c"), always_inline)) inline void q6k_epilogue_256(
    const uint8_t* vec, const W4Acts& a, int64_t g, const __m256i (&s)[R][2][2], __m256 (&acc)[R][2]) {
  const uint8_t* h = w4_superblock(vec, g / kW4SuperGroups, kW4Q6K);
  const int8_t* sub = reinterpret_cast<const int8_t*>(w4_q6k_scales(vec, g));
  for (int half = 0; half < 2; ++half) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16 * half)));
    const __m256i ua = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 8 * half)));
    const __m256i ub =
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + kW4Lanes + 8 * half)));
    for (int r = 0; r < R; ++r) {
      const int32_t* xh = a.xh + r * 2 * a.ldg + 2 * g;
      const __m256i ta = _mm256_mullo_epi32(ua, _mm256_sub_epi32(s[r][0][half], _mm256_set1_epi32(32 * xh[0])));
      const __m256i tb = _mm256_mullo_epi32(ub, _mm256_sub_epi32(s[r][1][half], _mm256_set1_epi32(32 * xh[1])));
      const __m256 t = _mm256_cvtepi32_ps(_mm256_add_epi32(ta, tb));
      acc[r][half] =
          _mm256_add_ps(acc[r][half], _mm256_mul_ps(_mm256_mul_ps(t, _mm256_set1_ps(a.sx[r * a.ldg + g])), d));
    }
  }
}

// The prefetches of a Q6_K group's lines (its header's with the superblock's first group).
__attribute__((always_inline)) inline void q6k_prefetch(const uint8_t* vec, const uint8_t* p, int64_t g,
                                                       int64_t ahead) {
  if (g % kW4SuperGroups == 0)
    prefetch_lines(w4_superblock(vec, g / kW4SuperGroups, kW4Q6K), kW4Q6KHeaderBytes, ahead);
  prefetch_lines(p, kW4Q6KGroupBytes, ahead);
}

// AVX2: vpmaddubsw of 6-bit columns (at most 63) and activations (|q| <= 128) is at most
// 2 * 63 * 128 = 16,128 a pair; a step adds two (low and high columns), at most 32,256, so
// each step widens to int32 at once (vpmaddwd with ones) and nothing saturates.
template <int R>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2_q6k(const uint8_t* vec, int64_t K, const W4Acts& a,
                                                            float* out, int64_t ahead) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* p = w4_group_nibbles(vec, g, kW4Q6K);
    if (ahead) q6k_prefetch(vec, p, g, ahead);
    __m256i s[R][2][2];
    for (int r = 0; r < R; ++r) s[r][0][0] = s[r][0][1] = s[r][1][0] = s[r][1][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int st = 0; st < 4; ++st) {
      __m256i xa[R], xb[R];
      broadcast_x<R>(a, g * 32 + 8 * st, xa, xb);
      for (int half = 0; half < 2; ++half) {
        const Q6Columns c = q6k_columns(p, st, half);
        for (int r = 0; r < R; ++r) {
          const __m256i m = _mm256_add_epi16(_mm256_maddubs_epi16(c.lo, xa[r]), _mm256_maddubs_epi16(c.hi, xb[r]));
          s[r][st / 2][half] = _mm256_add_epi32(s[r][st / 2][half], _mm256_madd_epi16(m, ones));
        }
      }
    }
    q6k_epilogue_256<R>(vec, a, g, s, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kW4Lanes + 8 * h, acc[r][h]);
}

// ------------------------------------------------------------------ AVX2
// No u8 x s8 dot product into int32 lanes: vpmaddubsw (u8 x s8 pairs into saturating int16)
// and vpmaddwd with ones (int16 pairs into int32). Exact here, proof: a nibble is at most 15
// and |q_x| at most 128 (the quantizer gives |q_x| <= 127), so one vpmaddubsw pair is at most
// 2 * 15 * 128 = 3,840 in magnitude and never saturates; a step adds two such results (its
// low and high nibbles) into the int16 accumulator, and kStepsPerFlush = 4 steps add eight:
// at most 8 * 3,840 = 30,720 <= 32,767, so the int16 adds never wrap either. Then vpmaddwd
// with ones widens to int32 (exact) and the accumulator restarts; group / 8 steps is 4, 8 or
// 16, a multiple of 4, so flushes never straddle groups.
constexpr int64_t kStepsPerFlush = 4;

template <int R, int STEPS, bool SB = false>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const uint8_t* vec, int64_t K, const W4Acts& a, float* out,
                                                        int64_t ahead) {
  constexpr int64_t group = 8 * STEPS, form = SB ? kW4Q4K : group, steps = STEPS;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t groups = K / group;
  alignas(32) uint8_t codes[SB ? kW4Q4KCodeBytes : 1];  // the superblock's, unpacked
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w4_group_nibbles(vec, g, form);
    if (SB && g % kW4SuperGroups == 0) {
      if (ahead) prefetch_lines(p - kW4SuperHeaderBytes, kW4SuperHeaderBytes, ahead);
      q4k_codes_avx2(p - kW4SuperHeaderBytes, codes);
    }
    __m256i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t s0 = 0; s0 < steps; s0 += kStepsPerFlush) {
      __m256i h16[R][2];
      for (int r = 0; r < R; ++r) h16[r][0] = h16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int64_t st = s0; st < s0 + kStepsPerFlush; ++st) {
        const uint8_t* c = p + 64 * st;
        if (ahead) prefetch(c + ahead);
        __m256i xa[R], xb[R];
        broadcast_x<R>(a, g * group + 8 * st, xa, xb);
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * h));
          const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
          for (int r = 0; r < R; ++r)
            h16[r][h] = _mm256_add_epi16(h16[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa[r]),
                                                                      _mm256_maddubs_epi16(hi, xb[r])));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(h16[r][h], ones));
    }
    group_epilogue_256<R, SB>(vec, p, SB ? codes + w4_q4k_code_offset(g) : nullptr, group, a, g, s, acc, ahead);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kW4Lanes + 8 * h, acc[r][h]);
}

// ------------------------------------------------------------------ AVX-VNNI
#if __GNUC__ >= 11 || defined(__clang__)
#define QUASAR_W4_AVX_VNNI 1
// 256-bit vpdpbusd: u8 nibbles x s8 activations, four products summed into each int32 lane,
// exact (no +128 shift of the activations, so no compensation term).
template <int R, int STEPS, bool SB = false>
__attribute__((target("avx2,fma,f16c,avxvnni"))) void rows_avx_vnni(const uint8_t* vec, int64_t K, const W4Acts& a,
                                                                    float* out, int64_t ahead) {
  constexpr int64_t group = 8 * STEPS, form = SB ? kW4Q4K : group, steps = STEPS;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t groups = K / group;
  alignas(32) uint8_t codes[SB ? kW4Q4KCodeBytes : 1];  // the superblock's, unpacked
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w4_group_nibbles(vec, g, form);
    if (SB && g % kW4SuperGroups == 0) {
      if (ahead) prefetch_lines(p - kW4SuperHeaderBytes, kW4SuperHeaderBytes, ahead);
      q4k_codes_avx2(p - kW4SuperHeaderBytes, codes);
    }
    __m256i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int64_t st = 0; st < steps; ++st) {
      const uint8_t* c = p + 64 * st;
      if (ahead) prefetch(c + ahead);
      __m256i xa[R], xb[R];
      broadcast_x<R>(a, g * group + 8 * st, xa, xb);
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * h));
        const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int r = 0; r < R; ++r)
          s[r][h] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s[r][h], lo, xa[r]), hi, xb[r]);
      }
    }
    group_epilogue_256<R, SB>(vec, p, SB ? codes + w4_q4k_code_offset(g) : nullptr, group, a, g, s, acc, ahead);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kW4Lanes + 8 * h, acc[r][h]);
}
template <int R>
__attribute__((target("avx2,fma,f16c,avxvnni"))) void rows_avx_vnni_q6k(const uint8_t* vec, int64_t K,
                                                                        const W4Acts& a, float* out, int64_t ahead) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* p = w4_group_nibbles(vec, g, kW4Q6K);
    if (ahead) q6k_prefetch(vec, p, g, ahead);
    __m256i s[R][2][2];
    for (int r = 0; r < R; ++r) s[r][0][0] = s[r][0][1] = s[r][1][0] = s[r][1][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int st = 0; st < 4; ++st) {
      __m256i xa[R], xb[R];
      broadcast_x<R>(a, g * 32 + 8 * st, xa, xb);
      for (int half = 0; half < 2; ++half) {
        const Q6Columns c = q6k_columns(p, st, half);
        for (int r = 0; r < R; ++r)
          s[r][st / 2][half] =
              _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s[r][st / 2][half], c.lo, xa[r]), c.hi, xb[r]);
      }
    }
    q6k_epilogue_256<R>(vec, a, g, s, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kW4Lanes + 8 * h, acc[r][h]);
}
#endif

}  // namespace

void w4_rows_avx2(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                  int64_t ahead) {
  static constexpr StepsFn kFns[kFormCount][kAvx2Rows] = {{rows_avx2<1, 4>, rows_avx2<2, 4>},
                                                          {rows_avx2<1, 8>, rows_avx2<2, 8>},
                                                          {rows_avx2<1, 16>, rows_avx2<2, 16>},
                                                          {rows_avx2<1, 4, true>, rows_avx2<2, 4, true>},
                                                          {rows_avx2_q6k<1>, rows_avx2_q6k<2>}};
  kFns[form_index(form)][rows - 1](vec, K, a, out, ahead);
}

void w4_rows_avx_vnni(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                      int64_t ahead) {
#ifdef QUASAR_W4_AVX_VNNI
  static constexpr StepsFn kFns[kFormCount][kAvxVnniRows] = {
      {rows_avx_vnni<1, 4>, rows_avx_vnni<2, 4>, rows_avx_vnni<3, 4>, rows_avx_vnni<4, 4>},
      {rows_avx_vnni<1, 8>, rows_avx_vnni<2, 8>, rows_avx_vnni<3, 8>, rows_avx_vnni<4, 8>},
      {rows_avx_vnni<1, 16>, rows_avx_vnni<2, 16>, rows_avx_vnni<3, 16>, rows_avx_vnni<4, 16>},
      {rows_avx_vnni<1, 4, true>, rows_avx_vnni<2, 4, true>, rows_avx_vnni<3, 4, true>, rows_avx_vnni<4, 4, true>},
      {rows_avx_vnni_q6k<1>, rows_avx_vnni_q6k<2>, rows_avx_vnni_q6k<3>, rows_avx_vnni_q6k<4>}};
  kFns[form_index(form)][rows - 1](vec, K, a, out, ahead);
#else
  (void)vec, (void)K, (void)form, (void)a, (void)rows, (void)out, (void)ahead;
  __builtin_trap();  // cpu_runs(kAvxVnni) is false where this is not compiled in
#endif
}

namespace {
__attribute__((target("avx2"), always_inline)) inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
__attribute__((target("avx2"), always_inline)) inline uint32_t hmax_epu32(__m256i v) {
  __m128i s = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_max_epu32(s, _mm_shuffle_epi32(s, 0x4E));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_max_epu32(s, _mm_shuffle_epi32(s, 0xB1))));
}
}  // namespace

// w4_quantize_groups in 8-float registers (GCC leaves the portable loop's division scalar):
// the same amax (an integer max of the bit patterns), IEEE division and rounding, and exact
// integer sums; the int8s pack with saturation, which cannot bind (|q| <= 127). The AVX512
// paths run it too (a 16-float version was no faster).
__attribute__((target("avx2"))) void w4_quantize_groups_avx2(const float* x, int64_t M, int64_t K, int64_t group,
                                                             int8_t* q, float* sx, float* xs, int32_t* xh) {
  const int64_t groups = K / group, half = group / 2;
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256 magic = _mm256_set1_ps(12582912.0f);  // round_to_int's 1.5 * 2**23
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* r = x + m * K + g * group;
      __m256i bits = _mm256_setzero_si256();
      for (int64_t k = 0; k < group; k += 8)
        bits = _mm256_max_epu32(bits, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + k)),
                                                       abs_mask));
      const float s = amax_scale(bits_float(hmax_epu32(bits)), 127.0);
      const __m256 vs = _mm256_set1_ps(s);
      int8_t* o = q + m * K + g * group;
      int32_t sums[2];
      for (int h = 0; h < 2; ++h) {
        __m256i sum = _mm256_setzero_si256();
        for (int64_t k = h * half; k < (h + 1) * half; k += 8) {
          const __m256 v = _mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(r + k), vs), magic), magic);
          const __m256 ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);  // NaN -> 0, as round_to_int
          const __m256i n = _mm256_and_si256(_mm256_cvtps_epi32(v), _mm256_castps_si256(ordered));
          const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(o + k), _mm_packs_epi16(w, w));
          sum = _mm256_add_epi32(sum, n);
        }
        sums[h] = hsum_epi32(sum);
      }
      sx[m * groups + g] = s;
      xs[m * groups + g] = static_cast<float>(sums[0] + sums[1]) * s;
      xh[m * 2 * groups + 2 * g] = sums[0];
      xh[m * 2 * groups + 2 * g + 1] = sums[1];
    }
}

}  // namespace quasar

#else  // not x86: these paths never run (cpu_runs is false), but the library links

namespace quasar {
void w4_rows_avx2(const uint8_t*, int64_t, int64_t, const W4Acts&, int64_t, float*, bool) { __builtin_trap(); }
void w4_rows_avx_vnni(const uint8_t*, int64_t, int64_t, const W4Acts&, int64_t, float*, bool) { __builtin_trap(); }
void w4_quantize_groups_avx2(const float*, int64_t, int64_t, int64_t, int8_t*, float*, float*, int32_t*) {
  __builtin_trap();
}
}  // namespace quasar

#endif
