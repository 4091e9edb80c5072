"""The tree drafter: many guesses at once, verified in one step as a token tree.

It merges two sources of next-token candidates for the context below any node (the
history followed by the node's path):
- n-gram matches: for every n in [n_min, n_max], every earlier occurrence of the context's
  last n tokens and the token that followed it (`NgramFollowers`);
- token recycling (Token Recycling, Luo et al. 2024): for each token, the verifier's own
  top-k next tokens the last time it verified that token (`RecyclingTable`). It costs no
  extra forward: the decode loop hands over the top-k of every row it verified, accepted
  or not, which fills in where no n-gram matches and extends branches past the text's
  repeats. The table also keeps them under the token with the one before it: where that
  pair was verified before, its list speaks for this context more than the token's alone.

The score of a node is the product of its edges' probabilities along its path: the chance
that greedy verification accepts the whole path. An edge's probability is measured, not a
prior: `EDGE_PROB` holds the acceptance rate of candidates by their evidence (the longest
n-gram that proposes the token and whether that n-gram was followed by it at least half the
time; its rank among the recycled verifier candidates, the pair's where it has them),
counted over the W8A8 default model's greedy tree decoding of held-out prompts
(`scripts/tools/tree_edge_stats.py`), and each sequence calibrates it on its own verified
nodes (`PRIOR_WEIGHT`). The tree is grown best first: the `budget` likeliest nodes, where
equal scores go to the more recent n-gram evidence. Scores never grow down a path, so every
chosen node's parent is chosen too, and the nodes come out parents first (a `DraftTree`,
with each node's score as `probs`, so the decode loop can keep only the nodes that pay for
their rows). Siblings are distinct tokens (shared prefixes merged), as multi-candidate
sampling requires.

Updates cost O(n_max) per history token and O(top_k) per verified row; proposing costs
O(budget * (n_max + candidates per node) * log) and never depends on the history length.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

from quasar.defaults import DEFAULT_DRAFT_BUDGET, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_RECYCLE_TOP_K, MAX_DRAFT
from quasar.errors import QuasarError
from quasar.speculative.drafters import Drafter, DraftTree, NgramDrafter

# P(the verifier's greedy next token is a candidate | the candidate's parent was accepted),
# by the candidate's evidence: [longest n-gram proposing it (0: none)][that n-gram's
# occurrences were followed by it at least half the time][column]. Columns 0-3 where the
# context's last two tokens were never verified as a pair: the candidate's rank among the
# token's recycled verifier candidates (0, 1, 2 or more, not among them); columns 4-7 where
# they were: its rank in the pair's list (0, 1, 2 or more, not in it). Measured over the
# 8.2k verified nodes of the W8A8 default model's greedy tree decoding (24-node proposals,
# rows free) of 102 held-out prompts of the five bench tasks (not the bench's own):
# `python scripts/tools/tree_edge_stats.py --n 25`. Cells under 30 nodes keep the rank
# column's earlier rate (a pair column: its row's rank column), raised where needed so that
# a better rank never scores lower. What it says: the verifier's own rank-0 candidate is a
# fair bet alone and a good one when the pair agrees; a 3-gram that usually continues so is
# the best evidence there is.
EDGE_PROB = {
    0: {True: (0.168, 0.09, 0.025, 0.0, 0.322, 0.09, 0.025, 0.0),
        False: (0.168, 0.09, 0.025, 0.0, 0.322, 0.09, 0.025, 0.0)},
    1: {True: (0.422, 0.235, 0.089, 0.347, 0.674, 0.226, 0.089, 0.347),
        False: (0.253, 0.229, 0.081, 0.029, 0.495, 0.220, 0.081, 0.029)},
    2: {True: (0.74, 0.35, 0.20, 0.518, 0.585, 0.450, 0.450, 0.183),
        False: (0.25, 0.17, 0.037, 0.018, 0.25, 0.17, 0.037, 0.018)},
    3: {True: (0.923, 0.763, 0.763, 0.775, 0.849, 0.562, 0.494, 0.509),
        False: (0.40, 0.36, 0.15, 0.17, 0.300, 0.36, 0.15, 0.17)},
}
PAIR_COLUMNS = 4  # the columns from here on are the pair's
# The most token pairs a recycling table keeps: each costs up to ~500 bytes (its key and a
# list of DEFAULT_RECYCLE_TOP_K ids), so ~30 MB; a 128-token decode teaches ~1k.
MAX_PAIRS = 1 << 16


Cell = tuple[int, bool, int]  # a cell of EDGE_PROB: (n, majority, column)


def evidence_cell(n: int, count: int, total: int, rank: int | None, pair_rank: int | None = None,
                  pair_known: bool = False) -> Cell:
    """The EDGE_PROB cell of a candidate: the longest n-gram proposing it has length `n` (0:
    none; more than 3 counts as 3) and was followed by it `count` of `total` times; `rank` is
    its place among the token's recycled candidates, `pair_rank` among the pair's (None: not
    among them); `pair_known`: the context's last two tokens have a recycled list."""
    if pair_known:
        column = PAIR_COLUMNS + (3 if pair_rank is None else min(pair_rank, 2))
    else:
        column = 3 if rank is None else min(rank, 2)
    return min(n, 3), n > 0 and 2 * count >= total, column


# How many observations the measured EDGE_PROB counts for against what the sequence at hand
# shows. A text's own repeats are accepted more or less often than the held-out average (a
# summary copying long spans of its source accepts nearly all its 3-gram matches), so each
# sequence calibrates the table on its own verified nodes: a cell's probability is
# (PRIOR_WEIGHT * measured + accepted) / (PRIOR_WEIGHT + tested).
PRIOR_WEIGHT = 16


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

    def matches(self, context: Sequence[int]) -> Iterator[tuple[int, int, dict[int, list[int]]]]:
        """(n, total, {token: [count, latest position]}) for each n, shortest first, whose
        last-n-token n-gram of `context` occurred in the history with a token after it: the
        table's own entries, to read, not to change."""
        for n, table in self._table.items():
            if len(context) >= n and (entry := table.get(tuple(context[len(context) - n:]))) is not None:
                yield n, entry[0], entry[1]


class RecyclingTable:
    """token -> the verifier's top-k next tokens the last time a step verified that token
    (the shallowest row when a step has it more than once: nearest the real context), and
    (previous token, token) -> the same for the token after that previous one.

    One table may serve many sequences of a verifier, one after another or in one batch, as
    Token Recycling keeps its adjacency matrix across queries: a sequence's first steps then
    draft from what earlier ones taught it instead of from nothing (`TreeDrafter(recycled=)`)."""

    def __init__(self, table: dict[int, list[int]] | None = None,
                 pairs: dict[tuple[int, int], list[int]] | None = None, max_pairs: int = MAX_PAIRS) -> None:
        self.table: dict[int, list[int]] = dict(table or {})
        # oldest written first: past max_pairs the oldest go (the token table is bounded by
        # the vocabulary, the pairs only by what a long-running server verifies)
        self.pairs: dict[tuple[int, int], list[int]] = dict(pairs or {})
        self.max_pairs = max_pairs

    def copy(self) -> "RecyclingTable":
        # the lists are replaced, never changed in place
        return RecyclingTable(self.table, self.pairs, self.max_pairs)

    def restore(self, snapshot: "RecyclingTable") -> None:
        """Make this table what `snapshot` (a `copy`) holds; drafters sharing it see the change."""
        self.table, self.pairs = dict(snapshot.table), dict(snapshot.pairs)

    def __len__(self) -> int:
        return len(self.table)

    def observe(self, tokens: Sequence[int], top_ids: Sequence[Sequence[int]],
                previous: Sequence[int | None] | None = None) -> None:
        """Record each row's top ids under its token and, where `previous` names the token
        before it (None: unknown), under the pair."""
        for row in reversed(range(len(tokens))):  # rows are parents first: the shallowest wins
            ids = [int(i) for i in top_ids[row]]
            self.table[int(tokens[row])] = ids
            if previous is not None and previous[row] is not None:
                key = (int(previous[row]), int(tokens[row]))
                self.pairs.pop(key, None)  # written now: the newest
                self.pairs[key] = ids
                if len(self.pairs) > self.max_pairs:
                    del self.pairs[next(iter(self.pairs))]

    def get(self, token: int) -> list[int]:
        return self.table.get(token, [])

    def get_pair(self, previous: int, token: int) -> list[int] | None:
        """The pair's list, None where the pair was never verified."""
        return self.pairs.get((previous, token))


class TreeDrafter(Drafter):
    """Proposes a `DraftTree` of at most `budget` nodes from n-gram matches and recycled
    verifier candidates (see the module docstring). `recycled`: a table shared with other
    sequences of the same verifier, kept across `reset` (None: the drafter's own, emptied)."""

    name = "tree"
    observe_top_k = DEFAULT_RECYCLE_TOP_K

    def __init__(self, budget: int = DEFAULT_DRAFT_BUDGET, n_min: int = DEFAULT_NGRAM_MIN,
                 n_max: int = DEFAULT_NGRAM_MAX, recycled: RecyclingTable | None = None) -> None:
        self.check_options(budget, n_min, n_max)
        self.budget, self.n_min, self.n_max = budget, n_min, n_max
        self.shared_recycled = recycled
        self.reset([])

    @staticmethod
    def check_options(budget: int = DEFAULT_DRAFT_BUDGET, n_min: int = DEFAULT_NGRAM_MIN,
                      n_max: int = DEFAULT_NGRAM_MAX) -> None:
        """Raise QuasarError for options the constructor would refuse."""
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_DRAFT:
            raise QuasarError(f"draft_budget must be an integer in [1, {MAX_DRAFT}], got {budget!r}",
                              param="draft_budget")
        NgramDrafter.check_options(n_min, n_max)

    def reset(self, prompt_ids: list[int]) -> None:
        self.ngrams = NgramFollowers(self.n_min, self.n_max)
        self.recycled = self.shared_recycled if self.shared_recycled is not None else RecyclingTable()
        self.ngrams.extend(prompt_ids)
        self.outcomes: dict[Cell, list[int]] = {}  # cell -> [accepted, tested] in this sequence
        self.proposed_cells: list[Cell] = []  # the cell of each node of the last proposed tree
        self._probs: dict[Cell, float] = {}  # cell_prob's answers until the outcomes change

    def extend(self, new_ids: list[int]) -> None:
        self.ngrams.extend(new_ids)

    def observe(self, tokens: list[int], top_ids: list[list[int]], parents: list[int] | None = None) -> None:
        """The verified rows of a step (its pending token, the history's last, then the draft
        nodes; `parents` as row indices, -1 for the pending token) and their top ids."""
        previous = None
        if parents is not None:
            before = self.ngrams.history[-2] if len(self.ngrams.history) >= 2 else None
            previous = [before if p < 0 else tokens[p] for p in parents]
        self.recycled.observe(tokens, top_ids, previous)
        if parents is not None and len(tokens) - 1 <= len(self.proposed_cells):
            self._count_outcomes(tokens, top_ids, parents)

    def _count_outcomes(self, tokens: list[int], top_ids: list[list[int]], parents: list[int]) -> None:
        """Each verified node below the greedy path (row 0 and the nodes that match its
        argmax chain) was tested: accepted when it is its parent row's argmax."""
        on_path = {0}
        self._probs.clear()
        for row in range(1, len(tokens)):
            parent = parents[row]
            if parent not in on_path:
                continue
            tally = self.outcomes.setdefault(self.proposed_cells[row - 1], [0, 0])
            tally[1] += 1
            if top_ids[parent] and tokens[row] == top_ids[parent][0]:
                tally[0] += 1
                on_path.add(row)

    def cell_prob(self, cell: Cell) -> float:
        """EDGE_PROB of `cell`, calibrated on this sequence's verified nodes (PRIOR_WEIGHT)."""
        if (prob := self._probs.get(cell)) is not None:
            return prob
        n, majority, column = cell
        prob = EDGE_PROB[n][majority][column]
        if (tally := self.outcomes.get(cell)) is not None:
            prob = (PRIOR_WEIGHT * prob + tally[0]) / (PRIOR_WEIGHT + tally[1])
        self._probs[cell] = prob
        return prob

    def candidates(self, path: Sequence[int]) -> tuple[dict[int, list], bool]:
        """The evidence for each candidate token after history + `path`: [n, count, total,
        position, rank, pair rank]: the longest n-gram proposing it (0: none) was followed by
        it `count` of `total` times, latest at `position` (-1: none); its rank among the last
        token's recycled candidates and among those of the last two (None: not among them);
        and whether the last two tokens have a recycled list."""
        context = self.ngrams.history[-self.n_max:] + list(path)
        evidence: dict[int, list] = {}
        for n, total, seen in self.ngrams.matches(context):  # shortest first: the longest n wins
            for token, (count, pos) in seen.items():
                evidence[token] = [n, count, total, pos, None, None]
        for rank, token in enumerate(self.recycled.get(context[-1]) if context else []):
            evidence.setdefault(token, [0, 0, 0, -1, None, None])[4] = rank
        pair = self.recycled.get_pair(context[-2], context[-1]) if len(context) >= 2 else None
        for rank, token in enumerate(pair or []):
            evidence.setdefault(token, [0, 0, 0, -1, None, None])[5] = rank
        return evidence, pair is not None

    def edge_scores(self, path: Sequence[int]) -> list[tuple[float, int, int, Cell]]:
        """Candidates for the token after history + `path`: (probability, recency, token,
        evidence cell), best first; recency is the latest position of the longest n-gram
        evidence (-1 for recycling only)."""
        scored = []
        evidence, pair_known = self.candidates(path)
        for token, (n, count, total, pos, rank, pair_rank) in evidence.items():
            cell = evidence_cell(n, count, total, rank, pair_rank, pair_known)
            scored.append((self.cell_prob(cell), pos, token, cell))
        scored.sort(reverse=True)
        return scored

    def propose_tree(self, budget: int) -> DraftTree:
        budget = min(budget, self.budget)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        paths: list[list[int]] = []
        cells: list[Cell] = []
        heap: list[tuple] = []  # (-score, -recency, order, parent, token, cell)

        def push_children(node: int, score: float, path: list[int]) -> None:
            # at most the nodes still to choose can be children of one node
            for s, recency, token, cell in self.edge_scores(path)[:budget - len(tokens)]:
                heapq.heappush(heap, (-score * s, -recency, len(heap), node, token, cell))

        push_children(-1, 1.0, [])
        while heap and len(tokens) < budget:
            neg_score, _, _, parent, token, cell = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg_score)
            cells.append(cell)
            paths.append((paths[parent] if parent >= 0 else []) + [token])
            if len(tokens) < budget:
                push_children(node, -neg_score, paths[node])
        self.proposed_cells = cells
        return DraftTree(tokens, parents, probs)

    def propose(self, k: int) -> list[int]:
        """The chain of each node's best candidate, k long (or until there is none)."""
        path: list[int] = []
        while len(path) < k and (candidates := self.edge_scores(path)):
            path.append(candidates[0][2])
        return path

