// The small-M GEMM's weight layout (pack_tiles, int8_gemm.h) and the page release that lets
// a memory-mapped weight leave memory once its tiles are packed.
#include "gemm_w8a8/int8_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace quasar {

// madvise MADV_PAGEOUT on the pages wholly inside [p, p + bytes). Pages stay valid: clean
// file pages are read again if touched, anonymous ones are swapped or kept, so no data is lost.
bool release_span(const void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_PAGEOUT)
  if (bytes <= 0) return false;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (begin + page - 1) / page * page, hi = (begin + bytes) / page * page;
  return hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_PAGEOUT) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

// With release_source the tiles are packed a chunk of kReleaseChunk source bytes at a time,
// and after each chunk the source bytes before its end go back to the OS in spans that end on
// a kReleaseAlign boundary: the page cache may hold a mapped file in large folios (up to
// 2 MiB), and MADV_PAGEOUT skips a folio its span does not cover whole (measured: per-tile
// spans of 512 KiB released nothing).
constexpr int64_t kReleaseChunk = int64_t{16} << 20;
constexpr uintptr_t kReleaseAlign = uintptr_t{2} << 20;

void pack_tiles(const int8_t* w, int64_t n, int64_t k, int8_t* out, bool release_source) {
  const int64_t k4 = padded_k(k), n_tiles = (n + kTile - 1) / kTile;
  const int64_t chunk = release_source ? std::max<int64_t>(1, kReleaseChunk / std::max<int64_t>(1, kTile * k)) : n_tiles;
  std::atomic<bool> has_min{false};  // some weight is -128 (the footer's flag)
  uintptr_t released = reinterpret_cast<uintptr_t>(w);
  for (int64_t c0 = 0; c0 < n_tiles; c0 += chunk) {
    const int64_t c1 = std::min(n_tiles, c0 + chunk);
    at::parallel_for(c0, c1, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = t * kTile, rows = std::min(kTile, n - r0), nv = (rows + 15) / 16;
        int8_t* o = out + r0 * k4;
        std::memset(o, 0, nv * 16 * k4);
        for (int64_t i = 0; i < rows; ++i) {  // row r0 + i is lane i % 16 of vector i / 16
          const int8_t* src = w + (r0 + i) * k;
          int8_t* dst = o + (i / 16) * 64 + (i % 16) * 4;
          for (int64_t c = 0; c < k; ++c) dst[(c / 4) * nv * 64 + c % 4] = src[c];
        }
        const int8_t *first = w + r0 * k, *last = first + rows * k;  // the tile's rows, still in cache
        if (std::find(first, last, int8_t{-128}) != last) has_min.store(true, std::memory_order_relaxed);
      }
    });
    if (release_source) {
      const uintptr_t done = reinterpret_cast<uintptr_t>(w + std::min(n, c1 * kTile) * k);
      const uintptr_t end = c1 == n_tiles ? done : done / kReleaseAlign * kReleaseAlign;
      if (end > released) release_span(reinterpret_cast<const void*>(released), static_cast<int64_t>(end - released));
      released = std::max(released, end);
    }
  }
  int8_t* footer = out + tiled_bytes(n, k) - kTileFooter;
  std::memset(footer, 0, kTileFooter);
  footer[0] = !has_min.load();
}

}  // namespace quasar
