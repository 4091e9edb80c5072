// The W4A8 kernel on 512-bit x86 vectors: AVX512-VNNI (the amx kernel path runs it too: a
// W4A8 step is one pass over streamed weights, where tile multiplies would gain nothing).
// Layout and contract: w4a8_gemm.h; the shared scheme (nibbles unpacked in registers, exact
// group sums, the reference's epilogue order, R rows a pass): x86_avx2.cpp.
#include "gemm_w4a8/w4a8_gemm.h"

#include <array>
#include <utility>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include "gemm_w4a8/x86_common.h"

namespace quasar {
namespace {

using namespace w4x86;  // x86_common.h: prefetches, loads, kernel table index

// ------------------------------------------------------------------ AVX512-VNNI
// A Q4_K superblock's codes unpacked (kW4Q4KCodeBytes, w4a8_gemm.h) from its header `h`: the
// low nibbles of the even and the odd groups' bytes, with the high bits moved to bits 4-5.
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i q4k_code_bytes(__m512i nibble,
                                                                                       __m512i high) {
  return _mm512_or_si512(_mm512_and_si512(nibble, _mm512_set1_epi8(0x0F)),
                         _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
}
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void q4k_codes_avx512(const uint8_t* h,
                                                                                      uint8_t* out) {
  const __m512i even = _mm512_loadu_si512(h + kW4Q4KLowBytesAt), odd = _mm512_loadu_si512(h + kW4Q4KLowBytesAt + 64),
                hb = _mm512_loadu_si512(h + kW4Q4KHighBytesAt);
  _mm512_storeu_si512(out, q4k_code_bytes(even, _mm512_slli_epi16(hb, 4)));
  _mm512_storeu_si512(out + 64, q4k_code_bytes(_mm512_srli_epi16(even, 4), _mm512_slli_epi16(hb, 2)));
  _mm512_storeu_si512(out + 128, q4k_code_bytes(odd, hb));
  _mm512_storeu_si512(out + 192, q4k_code_bytes(_mm512_srli_epi16(odd, 4), _mm512_srli_epi16(hb, 2)));
}

// acc + vpdpbusd(w, the 4 bytes at x in every lane), the bytes read by the instruction's own
// broadcast operand (GCC does not fold _mm512_set1_epi32 into vpdpbusd: it would issue a
// vpbroadcastd before each product).
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i dpbusd_x4(__m512i acc, __m512i w,
                                                                                     const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// One zmm per step: 16 lanes x 4 columns per vpdpbusd. The steps of a group are unrolled
// (STEPS = group / 8 is a template argument), which lets GCC keep every accumulator in a
// register; with a run-time step count it copied them around the loop and spilled. Up to 8
// rows, row r's low and high nibbles go into two int32 accumulators, added before the
// epilogue (integer sums, so the same bits): one chain would put two dependent vpdpbusd on
// it every step, and a pass of a few rows waited on those chains. From 9 rows there are
// chains enough, and one accumulator a row leaves the registers for the rows. Registers:
// 2R (R <= 8) or R int32 accumulators + R float ones + 6 others; past R = 13 GCC keeps some
// float ones in L1, which costs less than a second pass.
// SB: the Q4_K form (group 32, parameters in each superblock's header; w4a8_gemm.h).
template <int R, int STEPS, bool SB = false>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_avx512(const uint8_t* vec, int64_t K,
                                                                         const W4Acts& a, float* out, int64_t ahead) {
  constexpr int64_t group = 8 * STEPS, form = SB ? kW4Q4K : group;
  constexpr bool kTwoChains = R <= 8;
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t groups = K / group;
  alignas(64) uint8_t codes[SB ? kW4Q4KCodeBytes : 1];  // the superblock's, unpacked
  __m512 d = _mm512_setzero_ps(), m = d;                   // and its d and m
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w4_group_nibbles(vec, g, form);
    if (SB && g % kW4SuperGroups == 0) {
      const uint8_t* h = p - kW4SuperHeaderBytes;
      if (ahead) prefetch_lines(h, kW4SuperHeaderBytes, ahead);
      q4k_codes_avx512(h, codes);
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32)));
    }
    __m512i sl[R], sh[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) sl[r] = sh[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int st = 0; st < STEPS; ++st) {
      const uint8_t* c = p + 64 * st;
      if (ahead) prefetch(c + ahead);
      const __m512i w = _mm512_loadu_si512(c);
      const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.q + r * a.ldq + g * group + 8 * st;
        sl[r] = dpbusd_x4(sl[r], lo, x);
        __m512i& h = kTwoChains ? sh[r] : sl[r];
        h = dpbusd_x4(h, hi, x + 4);
      }
    }
    __m512 sc, of;
    if constexpr (SB) {  // d * c and m * o, exact in float32
      const uint8_t* cg = codes + w4_q4k_code_offset(g);
      const __m512i c = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(cg)));
      const __m512i o = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(cg + 64)));
      sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(c));
      of = _mm512_mul_ps(m, _mm512_cvtepi32_ps(o));
    } else {
      const uint8_t* so = p + 8 * group;
      if (ahead) prefetch(so + ahead);
      sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so)));
      of = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so + 32)));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_set1_ps(a.sx[r * a.ldg + g]), xs = _mm512_set1_ps(a.xs[r * a.ldg + g]);
      const __m512i s = kTwoChains ? _mm512_add_epi32(sl[r], sh[r]) : sl[r];
      const __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), sx), sc);
      acc[r] = _mm512_add_ps(_mm512_add_ps(acc[r], t), _mm512_mul_ps(xs, of));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kW4Lanes, acc[r]);
}

// The Q6_K form (w4a8_gemm.h): a step's 6-bit columns are its nibbles with the two high bits
// of its 64-byte high block (shifted by 4 for the second step of a pair) or'ed in above them;
// steps 0-1 sum into S_a, 2-3 into S_b, and the epilogue makes T in int32.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_avx512_q6k(const uint8_t* vec, int64_t K,
                                                                             const W4Acts& a, float* out,
                                                                             int64_t ahead) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const int64_t groups = K / 32;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w4_group_nibbles(vec, g, kW4Q6K);
    const uint8_t* h = w4_superblock(vec, g / kW4SuperGroups, kW4Q6K);
    if (ahead && g % kW4SuperGroups == 0) prefetch_lines(h, kW4Q6KHeaderBytes, ahead);
    __m512i sa[R], sb[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) sa[r] = sb[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int st = 0; st < 4; ++st) {
      const uint8_t* c = p + 64 * st;
      if (ahead) prefetch(c + ahead);
      if (ahead && st % 2 == 0) prefetch(p + 256 + 32 * st + ahead);
      const __m512i w = _mm512_loadu_si512(c);
      __m512i hb = _mm512_loadu_si512(p + 256 + 64 * (st / 2));
      if (st % 2) hb = _mm512_srli_epi16(hb, 4);
      const __m512i lo = _mm512_or_si512(_mm512_and_si512(w, low), _mm512_and_si512(_mm512_slli_epi16(hb, 4), top));
      const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), low),
                                         _mm512_and_si512(_mm512_slli_epi16(hb, 2), top));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.q + r * a.ldq + g * 32 + 8 * st;
        __m512i& s = st < 2 ? sa[r] : sb[r];
        s = dpbusd_x4(s, lo, x);
        s = dpbusd_x4(s, hi, x + 4);
      }
    }
    const int8_t* sub = reinterpret_cast<const int8_t*>(w4_q6k_scales(vec, g));
    const __m512i ua = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)));
    const __m512i ub = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kW4Lanes)));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int32_t* xh = a.xh + r * 2 * a.ldg + 2 * g;
      const __m512i ta = _mm512_mullo_epi32(ua, _mm512_sub_epi32(sa[r], _mm512_set1_epi32(32 * xh[0])));
      const __m512i tb = _mm512_mullo_epi32(ub, _mm512_sub_epi32(sb[r], _mm512_set1_epi32(32 * xh[1])));
      const __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(ta, tb));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(t, _mm512_set1_ps(a.sx[r * a.ldg + g])), d));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kW4Lanes, acc[r]);
}

}  // namespace

// kernels for R = 1 .. kW4MaxRows rows at one number of steps a group
template <int STEPS, bool SB, int... R>
constexpr std::array<StepsFn, sizeof...(R)> avx512_rows(std::integer_sequence<int, R...>) {
  return {rows_avx512<R + 1, STEPS, SB>...};
}
template <int... R>
constexpr std::array<StepsFn, sizeof...(R)> avx512_q6k_rows(std::integer_sequence<int, R...>) {
  return {rows_avx512_q6k<R + 1>...};
}

void w4_rows_avx512_vnni(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                         int64_t ahead) {
  using Rows = std::make_integer_sequence<int, kW4MaxRows>;
  static constexpr std::array<StepsFn, kW4MaxRows> kFns[kFormCount] = {
      avx512_rows<4, false>(Rows{}), avx512_rows<8, false>(Rows{}), avx512_rows<16, false>(Rows{}),
      avx512_rows<4, true>(Rows{}), avx512_q6k_rows(Rows{})};
  kFns[form_index(form)][rows - 1](vec, K, a, out, ahead);
}

}  // namespace quasar

#else  // not x86: this path never runs (cpu_runs is false), but the library links

namespace quasar {
void w4_rows_avx512_vnni(const uint8_t*, int64_t, int64_t, const W4Acts&, int64_t, float*, bool) { __builtin_trap(); }
}  // namespace quasar

#endif
