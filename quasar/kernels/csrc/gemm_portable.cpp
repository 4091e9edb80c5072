// The small-M GEMM's tile sums in plain C++: the portable path, for any CPU.
//
// Same layout and contract as the SIMD kernels (int8_linear.cpp, gemm_avx2.cpp): one
// weight tile of pack_tiles' layout, vectors [v0, v0 + nv), every row of x (the quantizers'
// x + 128 bytes, read back as signed q), exact int32 sums of q * w into acc [M, kTile]
// (columns relative to v0; no comp to take off). A 64-byte group is 16 outputs x 4
// columns: the inner loop is exactly a 4-way int8 dot product per output lane, which is
// where an ARMv8.2 `sdot` (16 lanes of 4 products per instruction) slots in.
#include "int8_gemm.h"

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

}  // namespace quasar
