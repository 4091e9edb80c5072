"""The tree drafter: many guesses at once, verified in one step as a token tree.

It merges two sources of next-token candidates for the context below any node (the
history followed by the node's path):
- n-gram matches: for every n in [n_min, n_max], every earlier occurrence of the context's
  last n tokens and the token that followed it (`NgramFollowers`);
- token recycling (Token Recycling, Luo et al. 2024): for each token, the verifier's own
  top-k next tokens the last time it verified that token (`RecyclingTable`). It costs no
  extra forward: the decode loop hands over the top-k of every row it verified, accepted
  or not, which fills in where no n-gram matches and extends branches past the text's
  repeats.

The score of a node is the product of its edges' scores along its path, an estimate of
the chance that the verifier accepts the whole path; an edge's score is the best of its
sources' (not measured, a simple prior; see `edge_scores`):
- an n-gram of length n whose occurrences were followed by the token c times out of C:
  n / (n + 1.5) * c / C (longer matches and more consistent followers score higher);
- the verifier's rank-r recycled candidate (r from 0): 0.3 / (r + 1).
The tree is grown best first: the `budget` likeliest nodes, where equal scores go to the
more recent n-gram evidence. Scores never grow down a path, so every chosen node's parent
is chosen too, and the nodes come out parents first (a `DraftTree`). Siblings are
distinct tokens (shared prefixes merged), as multi-candidate sampling requires.

Updates cost O(n_max) per history token and O(top_k) per verified row; proposing costs
O(budget * (n_max + candidates per node) * log) and never depends on the history length.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from quasar.defaults import DEFAULT_DRAFT_BUDGET, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_RECYCLE_TOP_K
from quasar.errors import QuasarError
from quasar.speculative.drafters import Drafter, DraftTree, NgramDrafter

MAX_DRAFT_BUDGET = 64  # as many draft tokens as DecodeOptions.num_draft allows


def match_score(n: int, count: int, total: int) -> float:
    """Prior chance that the token that followed an n-gram `count` of `total` times follows
    it again (see the module docstring)."""
    return n / (n + 1.5) * count / total


def recycle_score(rank: int) -> float:
    """Prior chance that the verifier's rank-`rank` next token of a token is next again."""
    return 0.3 / (rank + 1)


class NgramFollowers:
    """For every n in [n_min, n_max] and every n-gram of the history: the tokens that followed
    its occurrences, each with how often and the position of its latest occurrence. An
    n-gram is recorded once a token follows it, so the context never matches itself."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.history: list[int] = []
        # _table[n][ngram] = [total count, {next token: [count, position of its latest occurrence]}]
        self._table: dict[int, dict[tuple[int, ...], list]] = {n: {} for n in range(n_min, n_max + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        hist = self.history
        for tok in tokens:
            tok, pos = int(tok), len(hist)
            for n, table in self._table.items():
                if pos < n:
                    continue
                entry = table.setdefault(tuple(hist[pos - n:pos]), [0, {}])
                entry[0] += 1
                seen = entry[1].setdefault(tok, [0, pos])
                seen[0] += 1
                seen[1] = pos
            hist.append(tok)

    def followers(self, context: Sequence[int]) -> dict[int, tuple[int, dict[int, tuple[int, int]]]]:
        """n -> (total, {token: (count, latest position)}) for each n whose last-n-token
        n-gram of `context` occurred in the history with a token after it."""
        out = {}
        for n, table in self._table.items():
            if len(context) >= n and (entry := table.get(tuple(context[len(context) - n:]))) is not None:
                out[n] = (entry[0], {t: (c, p) for t, (c, p) in entry[1].items()})
        return out


class RecyclingTable:
    """token -> the verifier's top-k next tokens the last time a step verified that token
    (the shallowest row when a step has it more than once: nearest the real context)."""

    def __init__(self) -> None:
        self.table: dict[int, list[int]] = {}

    def observe(self, tokens: Sequence[int], top_ids: Sequence[Sequence[int]]) -> None:
        for tok, ids in reversed(list(zip(tokens, top_ids))):  # rows are parents first
            self.table[int(tok)] = [int(i) for i in ids]

    def get(self, token: int) -> list[int]:
        return self.table.get(token, [])


class TreeDrafter(Drafter):
    """Proposes a `DraftTree` of at most `budget` nodes from n-gram matches and recycled
    verifier candidates (see the module docstring)."""

    name = "tree"
    observe_top_k = DEFAULT_RECYCLE_TOP_K

    def __init__(self, budget: int = DEFAULT_DRAFT_BUDGET, n_min: int = DEFAULT_NGRAM_MIN,
                 n_max: int = DEFAULT_NGRAM_MAX) -> None:
        self.check_options(budget, n_min, n_max)
        self.budget, self.n_min, self.n_max = budget, n_min, n_max
        self.reset([])

    @staticmethod
    def check_options(budget: int = DEFAULT_DRAFT_BUDGET, n_min: int = DEFAULT_NGRAM_MIN,
                      n_max: int = DEFAULT_NGRAM_MAX) -> None:
        """Raise QuasarError for options the constructor would refuse."""
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_DRAFT_BUDGET:
            raise QuasarError(f"draft_budget must be an integer in [1, {MAX_DRAFT_BUDGET}], got {budget!r}",
                              param="draft_budget")
        NgramDrafter.check_options(n_min, n_max)

    def reset(self, prompt_ids: list[int]) -> None:
        self.ngrams = NgramFollowers(self.n_min, self.n_max)
        self.recycled = RecyclingTable()
        self.ngrams.extend(prompt_ids)

    def extend(self, new_ids: list[int]) -> None:
        self.ngrams.extend(new_ids)

    def observe(self, tokens: list[int], top_ids: list[list[int]]) -> None:
        self.recycled.observe(tokens, top_ids)

    def edge_scores(self, path: Sequence[int]) -> list[tuple[float, int, int]]:
        """Candidates for the token after history + `path`: (score, recency, token), best
        first; recency is the latest n-gram evidence's position (-1 for recycling only)."""
        context = self.ngrams.history[-self.n_max:] + list(path)
        best: dict[int, tuple[float, int]] = {}

        def offer(token: int, score: float, recency: int) -> None:
            if (score, recency) > best.get(token, (0.0, -2)):
                best[token] = (score, recency)

        for n, (total, seen) in self.ngrams.followers(context).items():
            for token, (count, pos) in seen.items():
                offer(token, match_score(n, count, total), pos)
        if context:
            for rank, token in enumerate(self.recycled.get(context[-1])):
                offer(token, recycle_score(rank), -1)
        return sorted(((s, r, t) for t, (s, r) in best.items()), reverse=True)

    def propose_tree(self, budget: int) -> DraftTree:
        budget = min(budget, self.budget)
        tokens: list[int] = []
        parents: list[int] = []
        paths: list[list[int]] = []
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, -recency, order, parent, token)

        def push_children(node: int, score: float, path: list[int]) -> None:
            # at most the nodes still to choose can be children of one node
            for s, recency, token in self.edge_scores(path)[:budget - len(tokens)]:
                heapq.heappush(heap, (-score * s, -recency, len(heap), node, token))

        push_children(-1, 1.0, [])
        while heap and len(tokens) < budget:
            neg_score, _, _, parent, token = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            paths.append((paths[parent] if parent >= 0 else []) + [token])
            push_children(node, -neg_score, paths[node])
        return DraftTree(tokens, parents)

    def propose(self, k: int) -> list[int]:
        """The chain of each node's best candidate, k long (or until there is none)."""
        path: list[int] = []
        while len(path) < k and (candidates := self.edge_scores(path)):
            path.append(candidates[0][2])
        return path

