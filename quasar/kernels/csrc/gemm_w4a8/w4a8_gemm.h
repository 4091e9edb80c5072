// The W4A8 GEMM (issue #34): affine 4-bit weights in groups along K, int8 activations per
// row and group, exact int32 group sums, the float32 epilogue of quasar/runtime/w4a8_numerics.py
// in its order. generic.cpp holds the activation quantizer, the portable kernel and the
// driver; x86_avx2.cpp the AVX2 and AVX-VNNI kernels, x86_avx512.cpp the AVX512-VNNI one;
// linear_op.cpp the packing and the ops.
//
// Packed layout (w4_pack), chosen so that one pass streams one sequential run of bytes:
// output rows in vectors of kW4Lanes = 16 (rows past N are padding: nibbles, scales and
// offsets 0), vector v is w4_vector_bytes(K, group) bytes at v * w4_vector_bytes(K, group);
// inside it, group g (columns [g * group, (g + 1) * group)) is w4_group_bytes(group) bytes:
//   group / 8 steps of 64 bytes, step s covering columns k0 = g * group + 8 s .. k0 + 7:
//     byte 4 i + j (lane i < 16, j < 4) = q[16 v + i][k0 + j] | q[16 v + i][k0 + 4 + j] << 4
//   then the 16 lanes' scales (float16, 32 bytes), then their offsets (float16, 32 bytes).
// Half-precision scales and offsets: a group of 32 costs 4 + 1 bits a weight instead of 4 + 2
// with float32 (the step streams 11% fewer bytes at 1.5B); GGUF's Q4_0 and Q4_1 store theirs
// as float16, so those stay exact, and every kernel widens them exactly to float32.
// So a step's 64 bytes masked with 0x0F are 16 lanes x the 4 columns k0..k0+3 (a vpdpbusd
// u8 operand, four bytes per int32 lane), shifted right by 4 and masked the columns
// k0+4..k0+7; its two 32-byte halves are lanes 0..7 and 8..15 (two ymm operands), and the
// scales and offsets a group's epilogue needs follow its nibbles. Every block is a multiple
// of 64 bytes, so vectors and groups start on cache lines of a 64-byte aligned buffer.
//
// A weight's form: its group size (32, 64 or 128: the float16 parameters above), or kW4Q4K:
// groups of 32 whose parameters are a GGUF Q4_K superblock's, exactly: per 256 columns and
// lane a float16 d and m, per group and lane 6-bit codes c and o, scale = d * c and offset =
// m * o (products exact in float32; m is Q4_K's -dmin). Its vector is superblocks of
// kW4SuperBytes: a 256-byte header and the 8 groups' nibbles as above (256 bytes each, no
// parameters after them): 4.5 bits a weight, as the file, with its own scales. The header:
//   bytes 0..31 the 16 lanes' d, 32..63 their m (float16);
//   64..191 the codes' low 4 bits: for groups 0, 2, 4, 6 then 1, 3, 5, 7, 16 bytes each,
//     byte i = (c & 15) | (o & 15) << 4 of lane i;
//   192..255 their high 2 bits: for each pair of groups 2p, 2p + 1, 16 bytes, byte i =
//     c_2p >> 4 | (o_2p >> 4) << 2 | (c_2p+1 >> 4) << 4 | (o_2p+1 >> 4) << 6 of lane i.
// So three 64-byte loads and a few masks and shifts give a superblock's codes as bytes
// (w4_q4k_lane_codes, one at a time).
//
// kW4Q6K, a GGUF Q6_K tensor as the file stores it: q in [0, 63], w = d * s * (q - 32) with a
// float16 d per 256 columns and lane and an int8 s per 16 columns. A vector is superblocks of
// kW4Q6KBytes: a 288-byte header (16 d, then for each of its 8 groups of 32 columns the 16
// lanes' s of columns 0..15, then of 16..31) and 8 groups of 384 bytes: the low 4 bits as the
// nibbles above (256 bytes), then the high 2 bits (128 bytes): byte 4 i + j of its 64-byte
// block h holds, for lane i, bits 0-1 and 2-3 the columns of nibble byte 4 i + j of step 2 h
// (low, high nibble), bits 4-5 and 6-7 those of step 2 h + 1. 6.5625 bits a weight, as Q6_K.
// Its group sums: S_a, S_b (columns 0..15, 16..31), X_a, X_b the activations' (W4Acts::xh),
// T = s_a * (S_a - 32 X_a) + s_b * (S_b - 32 X_b), exact in int32, and the epilogue
//   acc = acc + (float(T) * sx) * d
// (float(T) rounds to nearest even past 2^24, on every path alike).
#pragma once

#include <cstdint>

#include "common/cpu_features.h"

namespace quasar {

constexpr int64_t kW4Lanes = 16;
// Bytes of one group of one vector: the nibbles (16 lanes x group / 2), 16 scales, 16 offsets.
constexpr int64_t w4_group_bytes(int64_t group) { return 8 * group + 2 * 2 * kW4Lanes; }

// The superblock forms (see above): flags on their group size, 32.
constexpr int64_t kW4Q4KFlag = 1 << 8, kW4Q6KFlag = 1 << 9;
constexpr int64_t kW4Q4K = 32 | kW4Q4KFlag, kW4Q6K = 32 | kW4Q6KFlag;
constexpr int64_t kW4SuperGroups = 8;
constexpr int64_t kW4SuperHeaderBytes = 2 * 2 * kW4Lanes + kW4SuperGroups * 3 * kW4Lanes / 2;  // 256
constexpr int64_t kW4SuperBytes = kW4SuperHeaderBytes + kW4SuperGroups * 8 * 32;              // 2304
constexpr int64_t kW4Q6KHeaderBytes = 2 * kW4Lanes + kW4SuperGroups * 2 * kW4Lanes;        // 288
constexpr int64_t kW4Q6KGroupBytes = 8 * 32 + 4 * 32;                                      // 384
constexpr int64_t kW4Q6KBytes = kW4Q6KHeaderBytes + kW4SuperGroups * kW4Q6KGroupBytes;      // 3360
constexpr int64_t w4_group_size(int64_t form) { return form & (kW4Q4KFlag - 1); }
constexpr bool w4_is_q6k(int64_t form) { return form == kW4Q6K; }
constexpr bool w4_superblocks(int64_t form) { return form == kW4Q4K || form == kW4Q6K; }
// Whether `form` is one the kernels take.
constexpr bool w4_form_valid(int64_t form) {
  return form == 32 || form == 64 || form == 128 || form == kW4Q4K || form == kW4Q6K;
}
// The K a vector of `form` must divide into whole groups (and superblocks).
constexpr int64_t w4_k_multiple(int64_t form) {
  return w4_superblocks(form) ? kW4SuperGroups * w4_group_size(form) : w4_group_size(form);
}
// A vector's superblock s (the superblock forms).
inline const uint8_t* w4_superblock(const uint8_t* vec, int64_t s, int64_t form) {
  return vec + s * (w4_is_q6k(form) ? kW4Q6KBytes : kW4SuperBytes);
}
// The Q6_K form's group g: its 32 sub-block scales in its superblock's header, the 16 lanes' s
// of columns 0..15 then of 16..31 (after d).
inline const uint8_t* w4_q6k_scales(const uint8_t* vec, int64_t g) {
  return w4_superblock(vec, g / kW4SuperGroups, kW4Q6K) + 2 * kW4Lanes + g % kW4SuperGroups * 2 * kW4Lanes;
}

// The Q4_K form's header: where its codes' low nibbles (the even groups' 64 bytes, then the odd
// groups') and their high bit pairs (64 bytes) start.
constexpr int64_t kW4Q4KLowBytesAt = 2 * 2 * kW4Lanes, kW4Q4KHighBytesAt = kW4Q4KLowBytesAt + 2 * 64;
// Group g's codes at lane i, from its superblock's header `h` (the layout above).
inline void w4_q4k_lane_codes(const uint8_t* h, int64_t g, int64_t i, uint8_t* c, uint8_t* o) {
  const int64_t at = g % kW4SuperGroups / 2 * kW4Lanes + i;
  const uint8_t low = h[kW4Q4KLowBytesAt + g % 2 * 64 + at], high = h[kW4Q4KHighBytesAt + at] >> (4 * (g % 2));
  *c = static_cast<uint8_t>((low & 15) | (high & 3) << 4);
  *o = static_cast<uint8_t>((low >> 4) | (high >> 2 & 3) << 4);
}
// A superblock's codes as the SIMD kernels unpack them (q4k_codes_avx512, q4k_codes_avx2), in
// kW4Q4KCodeBytes: c of groups 0, 2, 4, 6 (16 lanes each), their o, then c of groups 1, 3, 5, 7,
// their o. Group g's 16 c start at w4_q4k_code_offset(g), its 16 o 64 bytes after.
constexpr int64_t kW4Q4KCodeBytes = 4 * 64;
inline int64_t w4_q4k_code_offset(int64_t g) { return g % 2 * 128 + g % kW4SuperGroups / 2 * 16; }

inline const uint8_t* w4_group_nibbles(const uint8_t* vec, int64_t g, int64_t form) {
  if (w4_is_q6k(form))
    return w4_superblock(vec, g / kW4SuperGroups, form) + kW4Q6KHeaderBytes + g % kW4SuperGroups * kW4Q6KGroupBytes;
  if (w4_superblocks(form))
    return w4_superblock(vec, g / kW4SuperGroups, form) + kW4SuperHeaderBytes + g % kW4SuperGroups * 8 * 32;
  return vec + g * w4_group_bytes(form);
}

inline int64_t w4_vector_bytes(int64_t k, int64_t form) {
  if (w4_superblocks(form)) return k / (kW4SuperGroups * 32) * (w4_is_q6k(form) ? kW4Q6KBytes : kW4SuperBytes);
  return k / form * w4_group_bytes(form);
}
inline int64_t w4_packed_bytes(int64_t n, int64_t k, int64_t form) {
  return (n + kW4Lanes - 1) / kW4Lanes * w4_vector_bytes(k, form);
}

// The quantized activations of M rows: q int8 [M, ldq] (ldq >= K), and per row and group
// sx (the scale) and xs = float(X) * sx (X = the group's sum of q), both float [M, ldg], and
// xh: the sums of q over each half group, int32 [M, 2 ldg] (the Q6_K form's X_a, X_b).
struct W4Acts {
  const int8_t* q;
  int64_t ldq;
  const float* sx;
  const float* xs;
  int64_t ldg;
  const int32_t* xh;
};

// One vector's outputs for `rows` rows of a (1 <= rows <= w4_max_rows(path)), bias not yet
// added: out[r * 16 + i] = the epilogue's acc for row r, lane i (all 16 lanes; padding lanes
// are 0). `vec` is the vector's packed bytes. Every kernel makes the same exact int32 sums
// and the same float32 operations in the same order, so all give the same bits.
// ahead: the pass asks for each of its lines that many bytes ahead in software (0: never, the
// hardware prefetcher alone streams them; see prefetch_whole_stream in int8_gemm.h).
using W4RowsFn = void (*)(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                          int64_t ahead);

constexpr int64_t kW4MaxRows = 16;  // the most rows any kernel takes per pass over a vector
constexpr int64_t kAvx2Rows = 2;  // 6 R int accumulators + 2 R float ones + 7 others: spills past 2
constexpr int64_t kAvxVnniRows = 4;  // 4 R accumulators + 6 others of 16 ymm
void w4_rows_portable(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                      int64_t ahead);
void w4_rows_avx2(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                  int64_t ahead);
void w4_rows_avx_vnni(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                      int64_t ahead);
void w4_rows_avx512_vnni(const uint8_t* vec, int64_t K, int64_t form, const W4Acts& a, int64_t rows, float* out,
                         int64_t ahead);
// Rows per pass of each path's kernel (the driver cuts M into passes of at most this many).
int64_t w4_max_rows(KernelPath path);

// Group g's 16 scales and offsets as float32 (exact: a float16, or a float16 times a code);
// not for the Q6_K form.
void w4_group_params(const uint8_t* vec, int64_t g, int64_t form, float* scale, float* offset);

// The activations' side of the contract (generic.cpp): x [M, K] float32 (K a multiple of
// group) -> q int8 [M, K], sx and xs float [M, K / group], xh int32 [M, 2 K / group], one
// row at a time; `path` (one the CPU runs) picks the loop: the portable one, or from AVX2 up
// w4_quantize_groups_avx2 (x86_avx2.cpp), the same bits.
void w4_quantize_groups(const float* x, int64_t M, int64_t K, int64_t group, int8_t* q, float* sx, float* xs,
                        int32_t* xh, KernelPath path);
void w4_quantize_groups_avx2(const float* x, int64_t M, int64_t K, int64_t group, int8_t* q, float* sx, float* xs,
                             int32_t* xh);

// The path whose W4A8 kernel serves kernel path p (amx: the AVX512-VNNI kernel; a path the
// self-check disabled: the next lower one the CPU runs); -1 if none. w4_kernel: that path's
// kernel; w4_disable_path: the self-check's verdict against a path's kernel.
int w4_path_for(KernelPath p);
W4RowsFn w4_kernel(KernelPath p);
void w4_disable_path(KernelPath p);

// The kernel a W4A8 linear runs on kernel path `path` (amx served by avx512-vnni; a path the
// self-check disabled by the next lower one) and its rows per pass; nullptr when every path
// is disabled.
W4RowsFn w4_active_kernel(KernelPath path, int64_t* max_rows);

// One vector's outputs for all M rows of a (passes of max_rows rows): y[r * y_stride + i] =
// the kernel's acc + bias[i] (bias null: acc) for the lanes i < `lanes` that are real outputs;
// `bias` and `y` point at the vector's first output. The op and the fused decoder step both
// finish vectors here, so they give the same bits.
// prefetch: whether a one-row step's pass prefetches; the first pass of a step of more rows
// always does, later passes (the vector in cache) never; w4_prefetch_bytes ahead.
void w4_vector_rows(W4RowsFn kernel, int64_t max_rows, const uint8_t* vec, int64_t K, int64_t form,
                    const W4Acts& a, int64_t M, int64_t lanes, const float* bias, float* y, int64_t y_stride,
                    bool prefetch);

// How far ahead the kernels' passes prefetch, in bytes (a multiple of 64): the best distance
// depends on the CPU, so quasar.runtime.step_cost measures it per model and kernel path and
// sets it (the w4_prefetch_distance op). Speed only: never a bit of the results.
constexpr int64_t kW4PrefetchDefault = 32 << 10, kW4PrefetchMin = 1 << 10, kW4PrefetchMax = 1 << 20;
int64_t w4_prefetch_bytes();
int64_t w4_set_prefetch_bytes(int64_t bytes);  // returns the previous distance

}  // namespace quasar
