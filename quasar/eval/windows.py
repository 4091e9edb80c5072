"""Sliding windows for scoring a long text with a model of limited context.

Perplexity (``eval.tasks``) and fidelity (``eval.fidelity``) score text the same way: every
token but the first is scored exactly once; windows advance by ``stride`` (at most
``window - 1``, so the first scored token of a window has context), and each scored token
sees at least ``window - stride`` tokens before it within its window (except in the first).
"""

from __future__ import annotations


def default_stride(window: int) -> int:
    """Half a window: every scored token sees at least half a window of context."""
    return max(1, window // 2)


def sliding_windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index) per window over ``n`` tokens; token i is predicted
    from position i - 1, so index 0 is never scored."""
    if n < 2:
        return []
    step = max(1, min(stride, window - 1))
    end = min(window, n)
    out = [(0, end, 1)]
    while end < n:
        prev_end, end = end, min(end + step, n)
        out.append((max(0, end - window), end, prev_end))
    return out
