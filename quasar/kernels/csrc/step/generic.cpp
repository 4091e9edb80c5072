// The fused step's float kernels in plain C++ (the portable path, any CPU): vec8.inc
// over an 8-float array type whose every operation is the IEEE operation the AVX2 set's
// intrinsic performs on each lane, so both give bitwise the same results.
#include "common/head_dim.h"
#include "step/step_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace quasar {
namespace step {
namespace portable {

#define QUASAR_V inline __attribute__((always_inline))
#define QUASAR_LANES for (int i = 0; i < 8; ++i)

struct V {
  float l[8];
  static QUASAR_V V zero() { return set1(0.0f); }
  static QUASAR_V V set1(float f) {
    V r;
    QUASAR_LANES r.l[i] = f;
    return r;
  }
  static QUASAR_V V load(const float* p) {
    V r;
    std::memcpy(r.l, p, sizeof r.l);
    return r;
  }
  static QUASAR_V void store(float* p, V a) { std::memcpy(p, a.l, sizeof a.l); }
  static QUASAR_V V load_b16(const uint16_t* p) {
    V r;
    QUASAR_LANES {
      const uint32_t bits = uint32_t{p[i]} << 16;
      std::memcpy(&r.l[i], &bits, sizeof bits);
    }
    return r;
  }
  static QUASAR_V V load_first(const float* p, int64_t n, float fill) {
    V r;
    QUASAR_LANES r.l[i] = i < n ? p[i] : fill;
    return r;
  }
  static QUASAR_V void store_first(float* p, int64_t n, V a) {
    QUASAR_LANES if (i < n) p[i] = a.l[i];
  }
  static QUASAR_V V keep_first(V a, int64_t n) {
    QUASAR_LANES if (i >= n) a.l[i] = 0.0f;
    return a;
  }
  static QUASAR_V V round_even(V a) {
    constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23: no fraction bits left
    QUASAR_LANES a.l[i] = (a.l[i] + kMagic) - kMagic;
    return a;
  }
  static QUASAR_V V pow2(V n) {
    QUASAR_LANES {
      const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.l[i]) + 127) << 23;
      std::memcpy(&n.l[i], &bits, sizeof bits);
    }
    return n;
  }
  // The AVX2 set's order: lanes i + (i + 4), then (0, 1) + (2, 3), then 0 + 1.
  static QUASAR_V float reduce_add(V a) {
    const float s0 = a.l[0] + a.l[4], s1 = a.l[1] + a.l[5], s2 = a.l[2] + a.l[6], s3 = a.l[3] + a.l[7];
    return (s0 + s2) + (s1 + s3);
  }
  static QUASAR_V float reduce_max(V a) {
    const auto mx = [](float x, float y) { return x > y ? x : y; };  // maxps
    const float s0 = mx(a.l[0], a.l[4]), s1 = mx(a.l[1], a.l[5]), s2 = mx(a.l[2], a.l[6]), s3 = mx(a.l[3], a.l[7]);
    return mx(mx(s0, s2), mx(s1, s3));
  }
};
QUASAR_V V add(V a, V b) {
  QUASAR_LANES a.l[i] = a.l[i] + b.l[i];
  return a;
}
QUASAR_V V sub(V a, V b) {
  QUASAR_LANES a.l[i] = a.l[i] - b.l[i];
  return a;
}
QUASAR_V V mul(V a, V b) {
  QUASAR_LANES a.l[i] = a.l[i] * b.l[i];
  return a;
}
QUASAR_V V div(V a, V b) {
  QUASAR_LANES a.l[i] = a.l[i] / b.l[i];
  return a;
}
QUASAR_V V max(V a, V b) {  // maxps: the second operand unless the first is larger
  QUASAR_LANES a.l[i] = a.l[i] > b.l[i] ? a.l[i] : b.l[i];
  return a;
}
QUASAR_V V min(V a, V b) {  // minps: the second operand unless the first is smaller
  QUASAR_LANES a.l[i] = a.l[i] < b.l[i] ? a.l[i] : b.l[i];
  return a;
}
#undef QUASAR_LANES
#undef QUASAR_V

#include "step/vec8.inc"

}  // namespace portable

const FloatKernels& float_kernels_portable() { return portable::kKernels; }

}  // namespace step
}  // namespace quasar
