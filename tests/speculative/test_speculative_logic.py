"""Pure-logic tests for speculative decoding: drafters, sampling, acceptance (no model)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from quasar.errors import QuasarError
from quasar.speculative.acceptance import AdaptiveDraftLength, accept_greedy, accept_sampling, accept_sampling_tree
from quasar.speculative.drafters import DraftTree, NgramDrafter, NoDrafter
from quasar.speculative.logprobs import token_logprobs
from quasar.speculative.registry import make_drafter
from quasar.speculative.options import SamplingOptions
from quasar.speculative.sampling import make_generator, probs_from_logits, sample


# ---------------------------------------------------------------- drafters


def ngram(history, **opts):
    d = NgramDrafter(**opts)
    d.reset(history)
    return d


def reference_propose(history, k, n_min, n_max):
    """Brute force: scan the whole history for the longest suffix seen before, copy forward."""
    length = len(history)
    for n in range(n_max, n_min - 1, -1):
        if length < n:
            continue
        suffix = history[length - n:]
        # `end` = position right after an occurrence; end <= length - 1 excludes the suffix itself
        ends = [e for e in range(n, length) if history[e - n:e] == suffix]
        if ends:
            start = max(ends)  # the most recent occurrence
            seq = list(history)
            for j in range(k):
                seq.append(seq[start + j])
            return seq[length:]
    return []


def test_longest_match_wins():
    # suffix "1 2 3": the 3-gram occurred followed by 7; "3" alone last followed by 9
    h = [1, 2, 3, 7, 8, 3, 9, 5, 1, 2, 3]
    assert ngram(h, n_min=1, n_max=3).propose(2) == [7, 8]
    # limited to unigrams, the most recent earlier "3" wins
    assert ngram(h, n_min=1, n_max=1).propose(2) == [9, 5]


def test_n_min_respected():
    h = [4, 5, 6, 9, 6]  # only a 1-gram ("6") matches
    assert ngram(h, n_min=1, n_max=3).propose(3) == [9, 6, 9]
    assert ngram(h, n_min=2, n_max=3).propose(3) == []


def test_n_max_respected():
    h = [1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3]
    # n=3 match "1 2 3" -> 4; with n_max=2 the most recent "2 3" -> 5
    assert ngram(h, n_max=3).propose(1) == [4]
    assert ngram(h, n_max=2).propose(1) == [5]


def test_most_recent_occurrence_wins():
    h = [1, 10, 1, 11, 1, 12, 1]
    assert ngram(h, n_max=1).propose(1) == [12]


def test_no_self_match():
    # the only occurrence of the suffix is the suffix itself
    assert ngram([1, 2, 3], n_min=1, n_max=3).propose(4) == []
    assert ngram([5], n_min=1, n_max=1).propose(2) == []


def test_repetition_copies_through_suffix():
    assert ngram([7, 7, 7, 7]).propose(5) == [7] * 5
    assert ngram([1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]


def test_proposals_capped_at_k():
    h = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    d = ngram(h)
    assert d.propose(3) == [3, 4, 5]
    assert d.propose(0) == []
    assert len(d.propose(20)) == 20


def test_empty_and_short_history():
    d = NgramDrafter()
    assert d.propose(5) == []
    d.reset([])
    assert d.propose(5) == []
    d.extend([3])
    assert d.propose(5) == []
    d.extend([3])
    assert d.propose(2) == [3, 3]


def test_reset_forgets():
    d = ngram([1, 2, 1])
    assert d.propose(1) == [2]
    d.reset([1])
    assert d.propose(1) == []


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 4)])
def test_incremental_matches_rebuild_and_reference(n_min, n_max):
    for seed in range(40):
        rng = random.Random(seed)
        vocab = rng.choice([2, 3, 5])
        stream = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        cut = rng.randrange(0, len(stream) + 1)
        inc = ngram(stream[:cut], n_min=n_min, n_max=n_max)
        pos = cut
        while True:
            h = stream[:pos]
            k = rng.randrange(0, 7)
            expected = reference_propose(h, k, n_min, n_max)
            assert inc.propose(k) == expected, (seed, h, k)
            assert ngram(h, n_min=n_min, n_max=n_max).propose(k) == expected
            if pos == len(stream):
                break
            step = rng.randrange(1, 4)
            inc.extend(stream[pos:pos + step])
            pos = min(len(stream), pos + step)


def test_no_drafter_and_factory():
    assert NoDrafter().propose(5) == []
    assert isinstance(make_drafter("none"), NoDrafter)
    d = make_drafter("ngram", n_min=2, n_max=4)
    assert isinstance(d, NgramDrafter) and (d.n_min, d.n_max) == (2, 4)
    assert d.name == "ngram" and make_drafter("none").name == "none"
    with pytest.raises(QuasarError, match="known drafters: auto, ngram, none, tree"):
        make_drafter("eagle")
    with pytest.raises(QuasarError):
        make_drafter("ngram", n_min=3, n_max=2)
    with pytest.raises(QuasarError):
        make_drafter("ngram", n_min=0)
    with pytest.raises(QuasarError):
        make_drafter("ngram", prefer="random")
    with pytest.raises(QuasarError):
        make_drafter("ngram", window=3)


# ---------------------------------------------------------------- greedy acceptance


def logits_with_argmax(ids, vocab=10):
    rows = torch.randn(len(ids), vocab, generator=torch.Generator().manual_seed(0))
    for r, i in enumerate(ids):
        rows[r, i] = 10.0
    return rows


def test_greedy_all_accepted_gives_bonus():
    assert accept_greedy([3, 4, 5], logits_with_argmax([3, 4, 5, 6])) == [3, 4, 5, 6]


def test_greedy_first_mismatch():
    assert accept_greedy([3, 9, 5], logits_with_argmax([3, 4, 5, 6])) == [3, 4]
    assert accept_greedy([1, 4, 5], logits_with_argmax([3, 4, 5, 6])) == [3]


def test_greedy_empty_draft():
    assert accept_greedy([], logits_with_argmax([7])) == [7]


def test_greedy_ties_take_lowest_id():
    assert accept_greedy([2], torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])) == [1]


def test_rows_must_match_draft():
    with pytest.raises(ValueError):
        accept_greedy([1, 2], logits_with_argmax([1, 2]))
    with pytest.raises(ValueError):
        accept_sampling([1], torch.full((1, 4), 0.25), torch.Generator().manual_seed(0))


def test_sampling_with_greedy_probs_equals_greedy():
    params = SamplingOptions()
    g = torch.Generator().manual_seed(0)
    for seed in range(30):
        logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
        draft = torch.randint(0, 6, (3,), generator=g).tolist()
        draft[0] = int(logits[0].argmax())
        probs = probs_from_logits(logits, params)
        assert accept_sampling(draft, probs, g) == accept_greedy(draft, logits)


# ---------------------------------------------------------------- sampling exactness


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square with integer df (closed forms; avoids needing scipy)."""
    if x <= 0:
        return 1.0
    h = x / 2.0
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= h / i
            total += term
        return math.exp(-h) * total
    total = math.erfc(math.sqrt(h))
    term = math.sqrt(h) / math.gamma(1.5)
    for i in range(1, (df + 1) // 2):
        total += math.exp(-h) * term
        term *= h / (i + 0.5)
    return total


def test_chi2_sf_known_values():
    # reference values of the chi-square upper tail
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(5.991464547107979, 2) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(11.070497693516351, 5) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(49.80184956820188, 35) == pytest.approx(0.05, rel=1e-9)


def chi2_stat(counts: Counter, expected_probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells expecting < 5 are pooled.

    An outcome the target gives probability 0 makes the statistic infinite (a sure fail).
    """
    if any(expected_probs.get(c, 0.0) == 0.0 for c in counts):
        return math.inf, 1
    stat, cells, pool_obs, pool_exp = 0.0, 0, 0, 0.0
    for cell, p in expected_probs.items():
        exp, obs = p * n, counts.get(cell, 0)
        if exp < 5:
            pool_obs, pool_exp = pool_obs + obs, pool_exp + exp
            continue
        stat += (obs - exp) ** 2 / exp
        cells += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        cells += 1
    return stat, cells - 1


def chi2_pvalue(counts: Counter, expected_probs: dict, n: int) -> float:
    stat, df = chi2_stat(counts, expected_probs, n)
    return 0.0 if math.isinf(stat) else chi2_sf(stat, df)


def combined_pvalue(results) -> float:
    """One test over independent cases: statistics and degrees of freedom add up."""
    stats = [chi2_stat(c, e, n) for c, e, n in results]
    stat, df = sum(s for s, _ in stats), sum(d for _, d in stats)
    return 0.0 if math.isinf(stat) else chi2_sf(stat, df)


def random_rows(rng: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Target distributions with a spread of masses, some zeros (top-k) included."""
    logits = torch.randn(rows, vocab, generator=rng) * 1.5
    return probs_from_logits(logits, SamplingOptions(temperature=1.0, top_k=vocab - 1))


V = 6


def first_token_counts(accept, n_samples, seed):
    """Many independent steps with fresh targets per case; returns (counts, expected) per case."""
    rng = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(4):
        probs = random_rows(rng, 4, V)
        # drafts: likely token, unlikely/zero-probability token, random
        likely = int(probs[0].argmax())
        zero = int((probs[0] == 0).nonzero()[0])
        rand = torch.randint(0, V, (3,), generator=rng).tolist()
        cases += [(probs, [likely, 1, 2]), (probs, [zero, 0, 1]), (probs, rand)]
    gen = torch.Generator().manual_seed(seed + 1)
    results = []
    per_case = n_samples // len(cases)
    for probs, draft in cases:
        counts = Counter(accept(draft, probs, gen)[0] for _ in range(per_case))
        results.append((counts, {t: float(probs[0, t]) for t in range(V)}, per_case))
    return results


def test_first_token_matches_target():
    assert combined_pvalue(first_token_counts(accept_sampling, 24_000, seed=1)) > 1e-3


class ToyModel:
    """A 'verifier' whose next-token distribution depends on the last two tokens."""

    def __init__(self, seed: int):
        rng = torch.Generator().manual_seed(seed)
        self.table = random_rows(rng, V * V, V)
        self.draft_table = torch.randint(0, V, (V * V, 4), generator=rng)

    def dist(self, context: list[int]) -> torch.Tensor:
        return self.table[context[-2] * V + context[-1]]

    def draft(self, context: list[int]) -> list[int]:
        # mostly the argmax chain (so multi-token acceptance happens), sometimes junk
        key = context[-2] * V + context[-1]
        if key % 3 == 0:
            return self.draft_table[key].tolist()
        out, ctx = [], list(context)
        for _ in range(3):
            out.append(int(self.dist(ctx).argmax()))
            ctx.append(out[-1])
        return out


def generate_two(model: ToyModel, accept, gen, context):
    """Run speculative steps until two tokens exist; the first two are the sample."""
    out: list[int] = []
    while len(out) < 2:
        ctx = context + out
        draft = model.draft(ctx)
        rows = torch.stack([model.dist(ctx + draft[:j]) for j in range(len(draft) + 1)])
        out += accept(draft, rows, gen)
    return tuple(out[:2])


def two_token_pvalue(accept, n, seed):
    model = ToyModel(seed)
    context = [1, 2]
    p0 = model.dist(context)
    expected = {
        (a, b): float(p0[a] * model.dist(context + [a])[b]) for a in range(V) for b in range(V)
    }
    gen = torch.Generator().manual_seed(seed + 100)
    counts = Counter(generate_two(model, accept, gen, context) for _ in range(n))
    return chi2_pvalue(counts, expected, n)


def test_first_two_tokens_match_target():
    assert two_token_pvalue(accept_sampling, 16_000, seed=3) > 1e-3


def always_accept(draft, probs, gen):
    return list(draft) + [sample(probs[len(draft)], gen)]


def resample_from_p_on_rejection(draft, probs, gen):
    """Wrong: on rejection draws from p itself instead of p with the draft removed."""
    out = []
    for i, d in enumerate(draft):
        if float(torch.rand((), generator=gen)) < float(probs[i, d]):
            out.append(d)
            continue
        out.append(sample(probs[i], gen))
        return out
    return out + [sample(probs[len(draft)], gen)]


@pytest.mark.parametrize("wrong_rule", [always_accept, resample_from_p_on_rejection])
def test_negative_controls_are_detected(wrong_rule):
    assert combined_pvalue(first_token_counts(wrong_rule, 6_000, seed=1)) < 1e-6


def test_negative_control_two_tokens():
    assert two_token_pvalue(always_accept, 4_000, seed=3) < 1e-6


def toy_tree(model: ToyModel, context: list[int]) -> DraftTree:
    """Three candidates below the pending token (the argmax, the draft table's guess, the
    least likely token), two below the argmax, one below that: the branches sampling
    must try in turn."""
    p = model.dist(context)
    key = context[-2] * V + context[-1]
    first = [int(p.argmax()), int(model.draft_table[key, 0]), int(p.argmin())]
    first = list(dict.fromkeys(first))
    below = model.dist(context + [first[0]])
    second = list(dict.fromkeys([int(below.argmax()), int(model.draft_table[key, 1])]))
    third = int(model.dist(context + [first[0], second[0]]).argmax())
    tokens = first + second + [third]
    parents = [-1] * len(first) + [0] * len(second) + [len(first)]
    return DraftTree(tokens, parents)


def generate_two_tree(model: ToyModel, accept, gen, context):
    out: list[int] = []
    while len(out) < 2:
        ctx = context + out
        tree = toy_tree(model, ctx)
        paths: list[list[int]] = []
        for tok, parent in zip(tree.tokens, tree.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [tok])
        rows = torch.stack([model.dist(ctx)] + [model.dist(ctx + path) for path in paths])
        out += accept(tree, rows, gen)[1]
    return tuple(out[:2])


def two_token_tree_pvalue(accept, n, seed):
    model = ToyModel(seed)
    context = [1, 2]
    p0 = model.dist(context)
    expected = {(a, b): float(p0[a] * model.dist(context + [a])[b]) for a in range(V) for b in range(V)}
    gen = torch.Generator().manual_seed(seed + 200)
    counts = Counter(generate_two_tree(model, accept, gen, context) for _ in range(n))
    return chi2_pvalue(counts, expected, n)


def residual_from_p_tree(tree, probs, gen):
    """Wrong: after every candidate is rejected, draws from p itself, not from what is left."""
    path, node = [], -1
    while True:
        p = probs[node + 1].double()
        left = p.clone()
        for c in tree.children(node):
            if float(torch.rand((), generator=gen, dtype=torch.float64)) * float(left.sum()) < float(left[tree.tokens[c]]):
                break
            left[tree.tokens[c]] = 0
        else:
            return path, [tree.tokens[i] for i in path] + [sample(p, gen)]
        path.append(c)
        node = c


def test_tree_sampling_first_two_tokens_match_target():
    """Multi-candidate sampling over trees (siblings, depth 3) keeps the verifier's joint
    distribution of the first two tokens; a plausible wrong rule is rejected."""
    assert two_token_tree_pvalue(accept_sampling_tree, 16_000, seed=3) > 1e-3
    assert two_token_tree_pvalue(residual_from_p_tree, 8_000, seed=3) < 1e-6


def test_sampling_certain_and_impossible_drafts():
    gen = torch.Generator().manual_seed(0)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert all(accept_sampling([1], certain, gen) == [1, 2] for _ in range(200))
    impossible = torch.tensor([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    assert all(accept_sampling([1], impossible, gen)[0] in (0, 2) for _ in range(200))
    assert accept_sampling([], torch.tensor([[0.0, 0.0, 1.0]]), gen) == [2]


def test_sample_matches_distribution_and_skips_zeros():
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    counts = Counter(sample(p, gen) for _ in range(6000))
    assert counts[1] == counts[4] == 0
    assert chi2_pvalue(counts, {i: float(p[i]) for i in range(5)}, 6000) > 1e-3
    assert sample(torch.tensor([0.0, 2.0, 0.0]), gen) == 1  # unnormalised is fine


def test_seeded_generator_is_reproducible():
    p = torch.softmax(torch.arange(8.0), dim=0)
    runs = []
    for _ in range(2):
        gen = make_generator(SamplingOptions(temperature=1.0, seed=42))
        runs.append([sample(p, gen) for _ in range(20)])
    assert runs[0] == runs[1]


# ---------------------------------------------------------------- probs_from_logits


def test_greedy_probs_one_hot():
    p = probs_from_logits(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), SamplingOptions())
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_scaling():
    logits = torch.tensor([0.0, 1.0, 2.0])
    for t in (0.5, 1.0, 2.0):
        expected = torch.softmax(logits / t, dim=0)
        assert torch.allclose(probs_from_logits(logits, SamplingOptions(temperature=t)), expected)
    p64 = probs_from_logits(logits.double(), SamplingOptions(temperature=1.0))
    assert p64.dtype == torch.float32


def test_top_k_keeps_exactly_k_with_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, 3.0, 0.0]])
    p = probs_from_logits(logits, SamplingOptions(temperature=1.0, top_k=3))
    kept = (p[0] > 0).nonzero().flatten().tolist()
    assert kept == [1, 2, 3]  # tie among 2,3,4 broken towards the lower ids
    assert torch.allclose(p[0, kept], torch.softmax(logits[0, kept], dim=0))
    full = probs_from_logits(logits, SamplingOptions(temperature=1.0, top_k=100))
    assert (full > 0).all()


def test_top_p_keeps_smallest_set():
    probs = torch.tensor([0.05, 0.5, 0.25, 0.15, 0.05])
    logits = probs.log()
    for top_p, kept in [(0.3, [1]), (0.5, [1]), (0.6, [1, 2]), (0.75, [1, 2]), (0.8, [1, 2, 3]),
                        (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3, 4])]:
        p = probs_from_logits(logits, SamplingOptions(temperature=1.0, top_p=top_p))
        assert (p > 0).nonzero().flatten().tolist() == kept, top_p
        assert torch.allclose(p[kept], probs[kept] / probs[kept].sum())


def test_top_k_then_top_p_batched():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    p = probs_from_logits(logits, SamplingOptions(temperature=1.0, top_k=3, top_p=0.7))
    # after top-k the rows renormalise to 4/9, 3/9, 2/9: top-p 0.7 needs two tokens
    assert (p > 0).tolist() == [[True, True, False, False], [False, False, True, True]]
    assert torch.allclose(p.sum(-1), torch.ones(2))


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}, {"top_k": -1}, {"top_k": 2.5}, {"seed": "x"},
])
def test_invalid_params_raise(kwargs):
    with pytest.raises(QuasarError):
        SamplingOptions(**kwargs)


def test_params_defaults():
    p = SamplingOptions()
    assert p.greedy and not SamplingOptions(temperature=0.7).greedy


# ---------------------------------------------------------------- adaptive draft length


def test_adaptive_grows_and_shrinks():
    ad = AdaptiveDraftLength(k_min=1, k_max=8, start=5)
    assert ad.next_k() == 5 and ad.rate is None
    for _ in range(10):
        ad.update(ad.next_k(), ad.next_k())
    assert ad.next_k() == 8
    for _ in range(15):  # the estimate forgets per judged token: ~1/(1-decay) tokens of memory
        ad.update(ad.next_k(), 0)
    assert ad.next_k() == 1
    ad.update(0, 0)  # nothing proposed: no evidence, no change
    assert ad.next_k() == 1


def test_adaptive_middle_rate_and_validation():
    ad = AdaptiveDraftLength(k_min=1, k_max=8, start=5, token_cost=0.1)
    for _ in range(30):
        ad.update(4, 1)  # one accepted, then a rejection: rate about 1/2
    # the latest outcome (a rejection) weighs most: d / (1 + d) in the steady state
    assert ad.rate == pytest.approx(ad.decay / (1 + ad.decay))
    assert 1 < ad.next_k() < 8
    with pytest.raises(QuasarError):
        AdaptiveDraftLength(k_min=3, k_max=2, start=3)
    with pytest.raises(ValueError):
        ad.update(2, 3)


# ---------------------------------------------------------------- logprobs


def test_token_logprobs_rank_ties_by_token_id():
    """Each row scores its token; alternatives are the best `top_n`, equal values by id (so a
    greedy token, the first argmax, always ranks first), whatever order topk finds them in."""
    rows = torch.zeros(3, 50)
    rows[0, [9, 4, 30]] = 5.0  # a three-way tie at the top
    rows[1, 7] = 3.0
    out = token_logprobs(rows, [4, 7, 0], top_n=2)
    logp = torch.log_softmax(rows, dim=-1)
    assert [e.token_id for e in out] == [4, 7, 0]
    assert [e.logprob for e in out] == [logp[0, 4].item(), logp[1, 7].item(), logp[2, 0].item()]
    assert [t for t, _ in out[0].top] == [4, 9] and out[0].top[0][1] == out[0].logprob
    assert [t for t, _ in out[1].top] == [7, 0]
    assert [t for t, _ in out[2].top] == [0, 1]  # a flat row: the lowest ids
    assert [e.top for e in token_logprobs(rows, [4, 7, 0], top_n=0)] == [[], [], []]
    assert token_logprobs(rows[:0], [], top_n=5) == []


def test_auto_drafter_resolves_to_tree_only_where_rows_are_cheap():
    from quasar.speculative.registry import resolve_drafter

    assert resolve_drafter("auto", True) == "tree" and resolve_drafter("auto", False) == "ngram"
    for name in ("none", "ngram", "tree"):  # a named drafter is itself, whatever the hardware
        assert resolve_drafter(name, True) == resolve_drafter(name, False) == name
    with pytest.raises(QuasarError, match="unknown drafter 'eagle'"):
        resolve_drafter("eagle", True)
