"""One verifier step as a list of rows: chain drafts, token trees and batches alike.

Row r is a token placed in cache slot `slots[r]` below row `parents[r]` of the same step,
or at the top of its slot's committed cache when the parent is -1 (a root: the slot's
pending token). From that and the slots' committed lengths follow, per row:
- `depth` (a root 0) and `position` = committed length + depth, for RoPE;
- `cache_index` = committed length + the row's index among its slot's rows: where the
  step writes its K/V (a scratch area past the committed length);
- `path`: the cache indices of its ancestors from the root down to itself.

A row attends to its slot's committed cache, then to `path`, in that order ("logical"
keys): exactly what decoding its path one token at a time would attend to, so its result
can be bitwise that of the one-token step (ARCHITECTURE.md, "Row invariance"). After
acceptance `KVCache.commit` moves the accepted path to consecutive positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from quasar.errors import QuasarError


@dataclass(frozen=True)
class Rows:
    tokens: list[int]
    slots: list[int]
    parents: list[int]  # parent row index within the step, -1 for a root
    depth: list[int]
    positions: list[int]
    cache_index: list[int]
    paths: list[list[int]]
    starts: dict[int, int]  # slot -> its committed length when the step began

    @classmethod
    def build(cls, tokens: Sequence[int], slots: Sequence[int], parents: Sequence[int],
              lengths: Sequence[int]) -> "Rows":
        """Derive the row metadata; the rows of a slot must be contiguous, start with its one
        root and list parents before children."""
        n = len(tokens)
        if not (len(slots) == len(parents) == n) or n == 0:
            raise ValueError(f"rows need as many slots and parents as tokens (got {n}, {len(slots)}, {len(parents)})")
        starts: dict[int, int] = {}
        depth, cache_index, paths = [0] * n, [0] * n, [[] for _ in range(n)]
        first = 0  # index of the current slot's first row
        for r in range(n):
            slot, parent = int(slots[r]), int(parents[r])
            if r == 0 or slot != slots[r - 1]:
                if slot in starts:
                    raise ValueError(f"the rows of slot {slot} are not contiguous")
                if not 0 <= slot < len(lengths):
                    raise ValueError(f"slot {slot} is not in the cache ({len(lengths)} slots)")
                if parent != -1:
                    raise ValueError(f"the first row of slot {slot} must be its root (parent -1)")
                starts[slot], first = int(lengths[slot]), r
            elif not first <= parent < r:
                raise ValueError(f"row {r}: parent {parent} is not an earlier row of slot {slot}")
            cache_index[r] = starts[slot] + r - first
            if parent == -1:
                paths[r] = [cache_index[r]]
            else:
                depth[r] = depth[parent] + 1
                paths[r] = paths[parent] + [cache_index[r]]
        positions = [starts[s] + d for s, d in zip(slots, depth)]
        return cls([int(t) for t in tokens], [int(s) for s in slots], [int(p) for p in parents], depth, positions,
                   cache_index, paths, starts)

    @classmethod
    def chain(cls, tokens: Sequence[int], slot: int, lengths: Sequence[int]) -> "Rows":
        """A chain in one slot: each row below the previous one (a prefill or a chain draft)."""
        return cls.build(tokens, [slot] * len(tokens), list(range(-1, len(tokens) - 1)), lengths)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """One slot whose rows each sit below the previous one."""
        return len(self.starts) == 1 and all(p == r - 1 for r, p in enumerate(self.parents))

    def check_fits(self, max_seq_len: int) -> None:
        """A QuasarError when a row would be written past the end of the context."""
        end = max(self.cache_index) + 1
        if end > max_seq_len:
            raise QuasarError(f"context is full: {end} tokens exceed the {max_seq_len}-token context")
