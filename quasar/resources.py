"""What a run cost: this process's resident-memory high-water mark.

`quasar quantize` and `quasar bench` report it beside the time taken, and tests bound it in
subprocesses; all of them read it here.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_gb() -> float:
    """The most resident memory this process has held so far, in GB (10^9 bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9  # bytes on macOS, KiB on Linux
