"""What a run cost: this process's resident-memory high-water mark.

`quasar quantize` and `quasar bench` report it beside the time taken, and tests bound it in
subprocesses; all of them read it here.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_gb() -> float:
    """The most resident memory this process has held so far, in GB (10^9 bytes).

    On Linux this is /proc/self/status's VmHWM, the peak of this program's own address space:
    ``ru_maxrss`` also counts the parent's peak at the fork that started it, so a command
    run from a large process (a test runner) would report that process's memory."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9  # bytes on macOS, KiB on Linux
