"""Drafters: cheap guesses of the next tokens, to be verified by the model in one pass.

A drafter only sees tokens that were actually kept (prompt + emitted output), so it never
needs a rollback: the generate loop calls `extend` with what it emits, nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from quasar.defaults import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN
from quasar.errors import QuasarError


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens below the pending token: node i is `tokens[i]`, a child of node
    `parents[i]` (-1: of the pending token). Parents come before their children, so any
    prefix of the nodes is a tree too. A chain d1..dk has parents -1, 0, 1, ..., k - 2.
    `probs` (optional): each node's estimated chance that greedy verification accepts its
    whole path, non-increasing in node order (the decode loop keeps the prefix that pays
    for its rows: `worth_keeping`)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float] | None = None
    EMPTY: ClassVar["DraftTree"]

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def limit(self, n: int) -> "DraftTree":
        """The first n nodes (still a tree)."""
        if len(self) <= n:
            return self
        return DraftTree(self.tokens[:n], self.parents[:n], None if self.probs is None else self.probs[:n])

    def worth_keeping(self, row_prices: Sequence[float], max_nodes: int | None = None) -> int:
        """How many of the first nodes to verify: the count m <= max_nodes that maximises the
        expected tokens a step emits, 1 + the sum of the kept nodes' probs, per its cost, 1 +
        the prices of their rows (row_prices[i]: what node i's row adds, as a fraction of a
        one-row step; the last price holds past the end). All nodes when there are no probs."""
        if self.probs is None:
            return len(self)
        return worth_verifying(self.probs[:max_nodes], row_prices)

    def children(self, node: int) -> list[int]:
        """Nodes directly below `node` (-1: the pending token), in order."""
        return [i for i, p in enumerate(self.parents) if p == node]


def worth_verifying(probs: Sequence[float], row_prices: Sequence[float], gain: float = 1.0,
                    cost: float = 1.0) -> int:
    """How many of the drafts `probs` (chances of acceptance, likeliest first) to add to a step
    that emits `gain` tokens (expected) at `cost` already: the count m maximising (gain + the
    first m probs) / (cost + the first m of row_prices, the last price holding past the end)."""
    best_m, best = 0, gain / cost
    for m, p in enumerate(probs, start=1):
        gain += p
        cost += row_prices[min(m, len(row_prices)) - 1]
        if gain / cost > best + 1e-12:
            best_m, best = m, gain / cost
    return best_m


DraftTree.EMPTY = DraftTree([], [])


class Drafter(ABC):
    """Proposes up to k next tokens from the token history; never calls the model."""

    name: str = "drafter"
    # >0: the decode loop calls `observe` after every step with that many of the
    # verifier's top token ids per row (what token recycling learns from).
    observe_top_k: int = 0

    @staticmethod
    def check_options(**opts: Any) -> None:
        """Raise QuasarError for options the constructor would refuse (none by default)."""

    @abstractmethod
    def reset(self, prompt_ids: list[int]) -> None:
        """Forget everything and start a new history from the prompt."""

    @abstractmethod
    def extend(self, new_ids: list[int]) -> None:
        """Append tokens that were accepted or emitted (in order)."""

    @abstractmethod
    def propose(self, k: int) -> list[int]:
        """Return 0..k guessed next tokens; fewer (or none) when there is no good guess."""

    def propose_tree(self, budget: int) -> DraftTree:
        """At most `budget` draft nodes; a chain drafter proposes a chain."""
        return DraftTree.chain(self.propose(budget)[:budget])

    def observe(self, tokens: list[int], top_ids: list[list[int]], parents: list[int] | None = None) -> None:
        """The last step's row tokens and, per row, the verifier's `observe_top_k` most likely
        next tokens (the first: its argmax), and the rows' parents (-1 for the pending
        token's row, else a row index) when the rows are the drafter's last proposal (only
        called when `observe_top_k` > 0)."""


class NoDrafter(Drafter):
    """Proposes nothing, which turns speculative decoding into plain autoregression."""

    name = "none"

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def extend(self, new_ids: list[int]) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return []


class NgramDrafter(Drafter):
    """Prompt lookup: match the history's longest recent suffix and copy what followed it.

    For each n in [n_min, n_max] an index maps an n-gram to the position just after its
    most recent earlier occurrence (recent text predicts what comes next). An n-gram is
    indexed only once a token follows it, so the current suffix never matches itself and
    every match has at least one token to copy. Updating costs O(n_max) per token and
    `propose` costs O(n_max + k), independent of the history length.

    Copying runs forward from the match and may run into the suffix and into the proposal
    itself, i.e. a match at distance d extends the text as if it repeats with period d:
    "a a a a" proposes k more "a"s, which is what repetitive text tends to do.
    """

    name = "ngram"

    def __init__(self, n_min: int = DEFAULT_NGRAM_MIN, n_max: int = DEFAULT_NGRAM_MAX) -> None:
        self.check_options(n_min, n_max)
        self.n_min = n_min
        self.n_max = n_max
        self._history: list[int] = []
        # _index[n][ngram] = position in history of the token that followed that ngram
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self.reset([])

    @staticmethod
    def check_options(n_min: int = DEFAULT_NGRAM_MIN, n_max: int = DEFAULT_NGRAM_MAX) -> None:
        """Raise QuasarError for options the constructor would refuse."""
        if isinstance(n_min, bool) or isinstance(n_max, bool) or not isinstance(n_min, int) \
                or not isinstance(n_max, int) or n_min < 1:
            raise QuasarError(f"ngram drafter needs integers 1 <= n_min <= n_max, got {n_min}, {n_max}",
                              param="ngram_min")
        if n_max < n_min:
            raise QuasarError(f"ngram drafter needs n_min <= n_max, got n_min={n_min}, n_max={n_max}",
                              param="ngram_max")

    def reset(self, prompt_ids: list[int]) -> None:
        self._history = []
        self._index = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self.extend(prompt_ids)

    def extend(self, new_ids: list[int]) -> None:
        hist = self._history
        for tok in new_ids:
            pos = len(hist)  # `tok` goes here; index the n-grams it follows
            for n, table in self._index.items():
                if pos < n:
                    continue
                table[tuple(hist[pos - n:pos])] = pos
            hist.append(int(tok))

    def propose(self, k: int) -> list[int]:
        start = self._match()
        if start is None or k <= 0:
            return []
        seq = self._history
        length = len(seq)
        out: list[int] = []
        for j in range(k):
            src = start + j  # < length + j always, since start < length
            out.append(seq[src] if src < length else out[src - length])
        return out

    def _match(self) -> int | None:
        """Position right after the most recent earlier occurrence of the longest suffix."""
        hist = self._history
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(hist) < n:
                continue
            pos = self._index[n].get(tuple(hist[len(hist) - n:]))
            if pos is not None:
                return pos
        return None
