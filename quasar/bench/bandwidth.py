"""Memory read bandwidth of this machine, measured in the same process as the benchmark.

Decoding at batch 1 is bound by reading the weights once per verifier step, so the floor
for one step is ``bytes of weights read ÷ read bandwidth``. We measure the bandwidth the
way a decoder would see it: torch, the same thread count, a plain streaming read (a sum)
over a float32 tensor much larger than the last-level cache (this CPU has a 300 MB L3,
hence 2 GiB by default), median of several passes after one untimed pass.
"""

from __future__ import annotations

import statistics
import time

import torch

from quasar.errors import QuasarError

DEFAULT_BYTES = 2 << 30  # 2 GiB: far beyond a 300 MB L3
DEFAULT_REPEATS = 7
METHOD = "torch.sum over a float32 tensor (one untimed pass, then the median of timed passes)"


def measure_read_bandwidth(size_bytes: int = DEFAULT_BYTES, repeats: int = DEFAULT_REPEATS,
                           threads: int | None = None) -> dict:
    """Read bandwidth in GB/s (10^9 bytes per second) with the samples it came from.

    ``threads`` fixes torch's CPU threads for the measurement (default: as they are now).
    """
    if size_bytes < 4 << 20:
        raise QuasarError(f"bandwidth buffer must be at least 4 MiB, got {size_bytes} bytes")
    if repeats < 1:
        raise QuasarError(f"bandwidth repeats must be >= 1, got {repeats}")
    if threads:
        torch.set_num_threads(threads)
    n = size_bytes // 4
    try:
        buf = torch.empty(n, dtype=torch.float32)
    except (RuntimeError, MemoryError):
        raise QuasarError(f"cannot allocate {size_bytes / 2**30:.1f} GiB to measure memory bandwidth; "
                          "lower it with --bandwidth-gb") from None
    try:
        buf.fill_(1.0)  # touch every page so the timed passes read memory, not page faults
        buf.sum()  # untimed pass
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            dt = time.perf_counter() - t0
            samples.append(n * 4 / dt / 1e9)
    finally:
        del buf
    return {
        "gb_per_s": round(statistics.median(samples), 3),
        "samples_gb_per_s": [round(s, 3) for s in samples],
        "bytes": n * 4,
        "threads": torch.get_num_threads(),
        "method": METHOD,
    }


def combine(measurements: list[dict]) -> dict:
    """One figure from several measurements in the run (start and end): the median of all
    samples, keeping each measurement so a change during the run stays visible."""
    samples = [s for m in measurements for s in m["samples_gb_per_s"]]
    return {
        "gb_per_s": round(statistics.median(samples), 3),
        "samples_gb_per_s": samples,
        "bytes": measurements[0]["bytes"],
        "threads": measurements[0]["threads"],
        "method": METHOD,
        "per_measurement_gb_per_s": [m["gb_per_s"] for m in measurements],
    }
