"""The tree drafter against brute-force oracles: its n-gram followers, its recycling table and
the trees it grows (the `budget` likeliest nodes under its documented scores)."""

from __future__ import annotations

import random

import pytest

from quasar.errors import QuasarError
from quasar.speculative.registry import make_drafter
from quasar.speculative.drafters import DraftTree
from quasar.speculative.generate import ROW_KEY_SHARE, row_cost_at
from quasar.speculative.tree_drafter import EDGE_PROB, PRIOR_WEIGHT, TreeDrafter, evidence_cell


def brute_followers(history, context, n_min, n_max):
    """n -> (total, {token: (count, latest position)}) by scanning the whole history."""
    out = {}
    for n in range(n_min, n_max + 1):
        if len(context) < n:
            continue
        seen = {}
        for i in range(n, len(history)):
            if history[i - n:i] == context[len(context) - n:]:
                seen[history[i]] = (seen.get(history[i], (0, 0))[0] + 1, i)
        if seen:
            out[n] = (sum(c for c, _ in seen.values()), seen)
    return out


def brute_recycled(steps, token):
    """The top ids of the first row holding `token` in the latest step that holds it."""
    for tokens, top_ids, _ in reversed(steps):
        if token in tokens:
            return top_ids[tokens.index(token)]
    return []


def brute_pair(steps, before, token):
    """The top ids of the first row holding `token` after `before` (its parent's token, or
    the history's second to last for the pending token) in the latest step that has that
    pair; None if none has."""
    for tokens, top_ids, previous in reversed(steps):
        for row, tok in enumerate(tokens):
            if previous is not None and previous[row] == before and tok == token:
                return top_ids[row]
    return None


def measured_prob(n, count, total, rank, pair_rank=None, pair_known=False):
    """EDGE_PROB at the evidence cell of a candidate (arguments as for `evidence_cell`)."""
    n, majority, column = evidence_cell(n, count, total, rank, pair_rank, pair_known)
    return EDGE_PROB[n][majority][column]


def brute_edges(history, steps, path, n_min, n_max):
    """token -> edge probability below history + path, straight from the module's
    definitions: the longest n-gram proposing the token, and its recycled rank."""
    context = history + path
    longest = {}
    for n, (total, seen) in sorted(brute_followers(history, context, n_min, n_max).items()):
        for token, (count, _) in seen.items():
            longest[token] = (n, count, total)
    ranks = {token: rank for rank, token in enumerate(brute_recycled(steps, context[-1]))}
    pair = brute_pair(steps, context[-2], context[-1]) if len(context) >= 2 else None
    pair_ranks = {token: rank for rank, token in enumerate(pair or [])}
    return {token: measured_prob(*longest.get(token, (0, 0, 0)), ranks.get(token), pair_ranks.get(token),
                                 pair is not None)
            for token in longest.keys() | ranks.keys() | pair_ranks.keys()}


def random_run(rng, vocab, n_steps, trees=False):
    """A drafter fed random history chunks and random verifier top-k observations: of rows
    without parents, or (`trees`) of random trees below the history's last token."""
    drafter = TreeDrafter(budget=12)
    history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
    drafter.reset(history)
    steps = []
    for _ in range(n_steps):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
        top = [rng.sample(range(vocab), 3) for _ in tokens]
        if trees:
            tokens[0] = history[-1]
            parents = [-1] + [rng.randrange(row) for row in range(1, len(tokens))]
            previous = [(history[-2] if len(history) >= 2 else None) if p < 0 else tokens[p] for p in parents]
            drafter.observe(tokens, top, parents)
        else:
            previous = None
            drafter.observe(tokens, top)
        steps.append((tokens, top, previous))
        chunk = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        drafter.extend(chunk)
        history += chunk
    return drafter, history, steps


@pytest.mark.parametrize("seed", range(6))
def test_followers_and_recycling_equal_the_oracles(seed):
    rng = random.Random(seed)
    drafter, history, steps = random_run(rng, vocab=4 + seed % 3, n_steps=15, trees=seed % 2 == 1)
    assert drafter.ngrams.history == history
    for _ in range(30):
        path = [rng.randrange(6) for _ in range(rng.randrange(0, 4))]
        context = history + path
        matches = list(drafter.ngrams.matches(context))
        assert [n for n, _, _ in matches] == sorted(n for n, _, _ in matches)  # shortest first
        assert {n: (total, {t: tuple(v) for t, v in seen.items()}) for n, total, seen in matches} \
            == brute_followers(history, context, 1, 3)
    for token in range(8):
        assert drafter.recycled.get(token) == brute_recycled(steps, token)
        for before in range(8):
            assert drafter.recycled.get_pair(before, token) == brute_pair(steps, before, token)
    assert bool(drafter.recycled.pairs) == (seed % 2 == 1)  # rows without parents teach no pairs


@pytest.mark.parametrize("seed", range(6))
def test_tree_is_the_budget_likeliest_nodes(seed):
    """Every node is a candidate of its parent's context, siblings are distinct, parents come
    first, and the node scores are the `budget` best of the whole candidate trie."""
    rng = random.Random(100 + seed)
    drafter, history, steps = random_run(rng, vocab=5, n_steps=10, trees=seed % 2 == 1)
    budget = rng.choice([1, 4, 12])
    tree = drafter.propose_tree(budget)
    assert 1 <= len(tree) <= budget
    paths, scores = [], []
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        assert -1 <= parent < i
        above = paths[parent] if parent >= 0 else []
        scores.append((scores[parent] if parent >= 0 else 1.0) * brute_edges(history, steps, above, 1, 3)[token])
        paths.append(above + [token])
        siblings = [tree.tokens[c] for c in tree.children(parent)]
        assert len(set(siblings)) == len(siblings)
    # the whole trie down to the weakest chosen score (scores only shrink down a path)
    floor = min(scores) * (1 - 1e-9)
    every, frontier = [], [([], 1.0)]
    while frontier:
        path, score = frontier.pop()
        for token, s in brute_edges(history, steps, path, 1, 3).items():
            if score * s >= floor:
                every.append(score * s)
                frontier.append((path + [token], score * s))
        assert len(every) < 100_000
    best = sorted(every, reverse=True)
    assert sorted(scores, reverse=True) == pytest.approx(best[:len(tree)], rel=1e-12)
    assert tree.probs == pytest.approx(scores, rel=1e-12)  # each node's path probability
    assert all(a >= b for a, b in zip(tree.probs, tree.probs[1:]))  # best first
    if len(tree) < budget:  # it stopped early only for want of candidates
        assert len(best) == len(tree)


def test_ranking_by_length_then_count_then_recency():
    d = TreeDrafter(budget=2)
    d.reset([1, 2, 1, 3, 1])  # 2 and 3 each followed 1 once: the more recent (3) first
    assert d.propose_tree(2).tokens == [3, 2]
    d.reset([1, 2, 1, 2, 1, 3, 1])  # 2 twice, 3 once (more recently): the count wins
    assert d.propose_tree(2).tokens[0] == 2
    d.reset([5, 1, 2, 6, 1, 3, 5, 1])  # "5 1" -> 2 (a 2-gram) beats "1" -> 3 (a 1-gram)
    assert d.propose_tree(1).tokens == [2]


def test_repeats_extend_through_the_path_and_recycling_fills_in():
    d = TreeDrafter(budget=4)
    d.reset([7, 7, 7])  # the n-grams of the path itself keep matching: a chain of 7s
    assert d.propose_tree(4).tokens == [7, 7, 7, 7] and d.propose(3) == [7, 7, 7]
    d.reset([1, 2, 3])  # nothing repeats: no draft until the verifier has spoken
    assert len(d.propose_tree(4)) == 0 and d.propose(3) == []
    d.observe([3, 9], [[9, 4], [5, 6]])
    tree = d.propose_tree(4)
    # 3's first recycled candidate, then 3's second one and what the verifier said follows 9
    # (below 9: the product), the likelier first (on a tie, the one pushed first: 3's)
    first, second = EDGE_PROB[0][False][:2]
    assert tree.tokens[0] == 9 and tree.parents[0] == -1 and tree.probs[0] == first
    below_9, next_of_3 = (1, 2) if first * first > second else (2, 1)
    assert tree.tokens[below_9] == 5 and tree.parents[below_9] == 0
    assert tree.tokens[next_of_3] == 4 and tree.parents[next_of_3] == -1
    assert tree.probs[below_9] == pytest.approx(first * first) and tree.probs[next_of_3] == second


def test_options_and_factory():
    assert make_drafter("tree", budget=8).budget == 8
    for bad in (0, 65, True, 2.5):
        with pytest.raises(QuasarError, match="draft_budget"):
            make_drafter("tree", budget=bad)
    with pytest.raises(QuasarError, match="n_min"):
        make_drafter("tree", n_min=3, n_max=2)
    assert TreeDrafter(budget=3).propose_tree(10).tokens == []  # empty history
    d = TreeDrafter(budget=3)
    d.reset([4, 4, 4, 4])
    assert len(d.propose_tree(10)) == 3  # the drafter's own budget caps the step's


def test_edge_probabilities_are_the_measured_table():
    assert evidence_cell(3, 5, 6, 0) == (3, True, 0)  # a 3-gram that mostly continues so
    assert evidence_cell(4, 1, 3, None) == (3, False, 3)  # longer n-grams count as 3
    assert evidence_cell(0, 0, 0, 7) == (0, False, 2)  # recycled only, rank 2 or more
    for n in EDGE_PROB:
        for row in EDGE_PROB[n].values():
            assert all(0.0 <= p < 1.0 for p in row)
            assert list(row[:3]) == sorted(row[:3], reverse=True)  # a better rank never hurts


def test_worth_keeping_pays_for_each_row():
    """The kept prefix maximises (1 + sum of probs) / (1 + the prices of its rows)."""
    tree = DraftTree([1, 2, 3, 4], [-1, 0, -1, 2], [0.9, 0.5, 0.1, 0.01])
    assert tree.worth_keeping([0.0]) == 4  # free rows: everything
    assert tree.worth_keeping([0.0], max_nodes=2) == 2  # but no more than one pass of the weights takes
    assert tree.worth_keeping([0.03]) == 3  # 0.01 does not pay for a row at 3%
    assert tree.worth_keeping([0.05]) == 2  # nor 0.1 at 5%
    assert tree.worth_keeping([0.3]) == 2
    assert tree.worth_keeping([10.0]) == 0
    assert DraftTree.chain([5, 6, 7]).worth_keeping([10.0]) == 3  # no probs: all
    for cost in (0.0, 0.03, 0.07, 0.2):
        m = tree.worth_keeping([cost])
        value = [(1 + sum(tree.probs[:k])) / (1 + cost * k) for k in range(5)]
        assert value[m] == max(value)
    assert tree.limit(2).probs == [0.9, 0.5]


def test_worth_keeping_prices_each_row_on_its_own():
    """A step that hides a few rows under its weight stream and pays for each after: the
    free rows take nodes a flat price would drop, the dear ones stop the tree."""
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], [0.6, 0.3, 0.15, 0.08, 0.04])
    knee = [0.005, 0.005, 0.3, 0.3]
    assert tree.worth_keeping(knee) == 2
    assert tree.worth_keeping([0.08]) == 3  # one slope under the dear rows' price: the third node too
    assert tree.worth_keeping([0.005, 0.005, 0.005, 0.3]) == 3
    assert tree.worth_keeping([0.15]) == 2  # one slope over the free rows' price: the third node dropped
    assert tree.worth_keeping([0.005, 0.005, 0.005, 0.005, 0.005]) == 5
    for prices in (knee, [0.0, 0.2, 0.05, 0.5], [0.1, 0.1, 0.1, 0.01, 0.01]):
        m = tree.worth_keeping(prices)
        value = [(1 + sum(tree.probs[:k])) / (1 + sum(prices[min(i, len(prices) - 1)] for i in range(k)))
                 for k in range(6)]
        assert value[m] == max(value), prices


def test_a_sequence_calibrates_the_table_on_its_own_verified_nodes():
    """Nodes below the greedy path count as tested, accepted when they are their parent row's
    argmax; a cell's probability moves from EDGE_PROB toward what this sequence shows."""
    d = TreeDrafter(budget=3)
    d.reset([1, 2, 3, 9, 1, 2, 3])  # "1 2 3" -> 9: a 3-gram that always continued so
    tree = d.propose_tree(3)
    cell = (3, True, 3)  # 3-gram, majority, not recycled
    assert tree.tokens == [9, 1, 2] and tree.parents == [-1, 0, 1]  # the repeat, as a chain
    assert d.proposed_cells == [cell] * 3 and tree.probs[0] == EDGE_PROB[3][True][3]
    rows, parents = [3, *tree.tokens], [-1, *(p + 1 for p in tree.parents)]
    d.observe(rows, [[9], [0], [0], [0]], parents)  # the verifier took 9, then not 1
    assert d.outcomes == {cell: [1, 2]}  # node 0 accepted, node 1 rejected, node 2 not tested
    assert d.cell_prob(cell) == pytest.approx((PRIOR_WEIGHT * EDGE_PROB[3][True][3] + 1) / (PRIOR_WEIGHT + 2))
    # The step taught pairs: 9 is the recycled first choice after "2 3" (the pair's column 4);
    # "3 9" and "9 1" have lists (of 0) without the chain's next tokens (column 7), which makes
    # 0, the pair "3 9"'s own first choice, likelier below 9 than 2 below 1.
    tree = d.propose_tree(3)
    assert tree.tokens == [9, 1, 0] and tree.parents == [-1, 0, 0]
    assert d.proposed_cells == [(3, True, 4), (3, True, 7), (0, False, 4)]
    d.observe([3, *tree.tokens], [[9], [1], [7], [7]], [-1, 0, 1, 1])  # 9, then 1 (not 0)
    assert d.outcomes == {cell: [1, 2], (3, True, 4): [1, 1], (3, True, 7): [1, 1], (0, False, 4): [0, 1]}
    d2 = TreeDrafter(budget=3)
    d2.reset([1, 2, 3, 9, 1, 2, 3])
    d2.propose_tree(3)
    d2.observe(rows, [[5] for _ in rows], parents)  # rejected at the root: nothing below is tested
    assert d2.outcomes == {cell: [0, 1]}
    assert d2.cell_prob(cell) < EDGE_PROB[3][True][3]  # 0 of 1
    assert d.cell_prob((3, True, 7)) > EDGE_PROB[3][True][7]  # 1 of 1
    d2.observe(rows, [[5] for _ in rows])  # rows without parents (not a proposal): recycling only
    assert d2.outcomes == {cell: [0, 1]}
    d2.reset([1])  # a new sequence starts from the table again
    assert d2.outcomes == {} and d2.cell_prob(cell) == EDGE_PROB[3][True][3]


def test_rows_grow_dearer_with_the_context():
    assert row_cost_at(0.03, 1e-4, 0) == 0.03
    costs = [row_cost_at(0.03, 1e-4, n) for n in (0, 1000, 5000, 50000, 10 ** 9)]
    assert costs == sorted(costs) and costs[-1] == pytest.approx(ROW_KEY_SHARE, rel=1e-3)
    assert row_cost_at(0.03, 0.0, 10 ** 6) == 0.03  # no key cost known: the flat row cost


def test_a_shared_recycling_table_outlives_reset_and_a_private_one_does_not():
    from quasar.speculative.tree_drafter import RecyclingTable

    shared = RecyclingTable()
    a, b, own = TreeDrafter(budget=4, recycled=shared), TreeDrafter(budget=4, recycled=shared), TreeDrafter(budget=4)
    for d in (a, own):
        d.reset([1, 2, 3])
        d.observe([3, 9], [[9, 4], [5, 6]])
    b.reset([7, 8, 3])  # another sequence: it drafts 3's recycled candidates from a's step
    assert b.recycled is shared and b.propose_tree(1).tokens == [9]
    a.reset([3])
    assert a.recycled.get(3) == [9, 4]  # reset keeps a shared table ...
    own.reset([3])
    assert own.recycled.get(3) == [] and len(own.recycled) == 0  # ... and empties a private one
    snapshot = shared.copy()
    b.observe([3], [[1, 2]])
    assert shared.get(3) == [1, 2] and snapshot.get(3) == [9, 4]  # a copy does not follow the table
    shared.restore(snapshot)
    assert a.recycled.get(3) == b.recycled.get(3) == [9, 4]  # restored for every drafter sharing it


def test_a_step_teaches_each_row_under_its_token_and_the_pair_it_ends():
    """The pending token's row follows the history's second to last token; a node's follows
    its parent's token. A pair's list then outranks the token's alone in the proposal."""
    d = TreeDrafter(budget=4)
    d.reset([5, 6, 7])
    d.observe([7, 8, 9], [[1, 2], [3], [4]], [-1, 0, 0])  # two children of the pending token
    assert d.recycled.pairs == {(6, 7): [1, 2], (7, 8): [3], (7, 9): [4]}
    assert d.recycled.get(7) == [1, 2] and d.recycled.get_pair(5, 7) is None
    d.extend([8])  # history ... 6 7 8
    d.observe([8], [[11]], [-1])  # under "7 8" and 8 alone
    assert d.recycled.get_pair(7, 8) == [11] and d.recycled.get(8) == [11]
    d.recycled.observe([8], [[12]], [3])  # 8 after 3 elsewhere: the token's list moves on
    assert d.recycled.get(8) == [12]
    tree = d.propose_tree(1)
    assert tree.tokens == [11] and d.proposed_cells == [(0, False, 4)]  # the pair "7 8" decides


def test_the_pair_table_keeps_the_newest_pairs_up_to_its_cap():
    from quasar.speculative.tree_drafter import RecyclingTable

    table = RecyclingTable(max_pairs=3)
    table.observe([1, 2, 3], [[0], [0], [0]], [9, 1, 2])  # deepest row first: (2,3) (1,2) (9,1)
    table.observe([2], [[5]], [1])  # (1,2) again: now the newest
    table.observe([4], [[6]], [3])  # (3,4): the oldest, (2,3), goes
    assert list(table.pairs) == [(9, 1), (1, 2), (3, 4)] and table.get_pair(1, 2) == [5]
    copy = table.copy()
    copy.observe([7], [[1]], [4])
    assert len(copy.pairs) == 3 and (9, 1) not in copy.pairs and (9, 1) in table.pairs
