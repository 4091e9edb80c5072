"""The decode loop on tiny models: speculative == autoregressive, stops, streaming, sampling."""

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats as sps

from quasar.api import LLM
from quasar.errors import QuasarError
from quasar.speculative.generate import Result

REPETITIVE = [
    "abcabcabcabcabc", "aaaaaaaaaa", "abababab", "hello hello hello", "defgdefgdefgdefg",
    "mmm lll mmm lll", "the cat the cat the", "a", "kjihgfedcba", "abcdefgabcdefgab",
]


@pytest.fixture(scope="module")
def char_llm(tmp_path_factory):
    from tests.conftest import make_tiny_model

    d = make_tiny_model(tmp_path_factory.mktemp("m") / "char", "llama", None, seed=3)
    return LLM(str(d), drafter="ngram", verifier="fp", max_context=256)


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory, default_model_dir):
    from tests.conftest import make_tiny_model

    d = make_tiny_model(tmp_path_factory.mktemp("m") / "chat", "qwen2", default_model_dir, seed=5)
    return LLM(str(d), drafter="ngram", verifier="fp", max_context=512)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("verifier", ["fp", "w8a8", "w4a8", "pruned:0.5"])
def test_greedy_speculative_equals_autoregressive(char_llm, verifier, adaptive):
    accepted_any = False
    for prompt in REPETITIVE:
        for k in (1, 3, 5):
            ar = char_llm.generate(prompt, raw=True, max_new_tokens=40, drafter="none", verifier=verifier)
            spec = char_llm.generate(prompt, raw=True, max_new_tokens=40, drafter="ngram", num_draft=k,
                                     verifier=verifier, adaptive=adaptive)
            assert spec.token_ids == ar.token_ids, (prompt, k)
            assert spec.text == ar.text
            accepted_any |= spec.stats["accepted"] > 0
    assert accepted_any, "no draft was ever accepted: the test did not exercise speculation"


@pytest.mark.parametrize("verifier", ["fp", "w8a8", "w4a8"])
def test_greedy_tree_equals_autoregressive(char_llm, verifier):
    """Tree drafts (n-gram matches and recycled candidates, branching) change nothing in
    greedy output, whatever the budget."""
    accepted_any = False
    for prompt in REPETITIVE:
        ar = char_llm.generate(prompt, raw=True, max_new_tokens=40, drafter="none", verifier=verifier)
        for budget in (1, 5, 16, 40):
            tree = char_llm.generate(prompt, raw=True, max_new_tokens=40, drafter="tree", draft_budget=budget,
                                     verifier=verifier)
            assert tree.token_ids == ar.token_ids, (prompt, budget)
            accepted_any |= tree.stats["accepted"] > 0
    assert accepted_any, "no draft was ever accepted: the test did not exercise speculation"


def test_trees_keep_only_the_nodes_worth_their_rows(char_llm):
    """The verifier's row cost decides how much of each proposed tree is verified: free rows
    take the whole budget, rows dearer than any node's chance take none; greedy output is
    the same either way."""
    model = char_llm.verifier_model("fp")
    before = model.row_cost
    runs = {}
    try:
        for cost in (0.0, before, 100.0):
            model.row_cost = cost
            runs[cost] = char_llm.generate(REPETITIVE[0], raw=True, max_new_tokens=30, drafter="tree",
                                           draft_budget=16, verifier="fp")
    finally:
        model.row_cost = before
    assert runs[0.0].token_ids == runs[before].token_ids == runs[100.0].token_ids
    assert runs[100.0].stats["drafted"] == 0
    assert runs[0.0].stats["drafted"] > runs[before].stats["drafted"] > 0
    assert runs[0.0].stats["drafted"] / runs[0.0].stats["steps"] > 8  # most of the budget


def test_measured_row_prices_size_the_trees_row_by_row(char_llm, monkeypatch):
    """Where the second draft row is free and the next one dear (a step that hides a few rows
    under its weight stream), trees stop at that row; greedy output is unchanged."""
    model = char_llm.verifier_model("fp")
    step, rows_seen = model.step, []
    monkeypatch.setattr(model, "step", lambda rows: rows_seen.append(len(rows.tokens)) or step(rows))
    plain = char_llm.generate(REPETITIVE[0], raw=True, max_new_tokens=30, drafter="none", verifier="fp")
    for free in (1, 2):
        rows_seen.clear()
        monkeypatch.setattr(model, "row_cost", 100.0)  # the flat price: never read once prices are set
        monkeypatch.setattr(model, "row_prices", (0.0,) * free + (100.0,))
        run = char_llm.generate(REPETITIVE[0], raw=True, max_new_tokens=30, drafter="tree", draft_budget=16,
                                verifier="fp")
        assert run.token_ids == plain.token_ids
        assert max(rows_seen) == 1 + free and rows_seen.count(1 + free) > len(rows_seen) // 2, rows_seen


def test_tree_options_are_checked(char_llm):
    with pytest.raises(QuasarError, match="draft_budget") as e:
        char_llm.check_options(drafter="tree", draft_budget=0)
    assert e.value.param == "draft_budget"
    plan = char_llm.check_options(drafter="tree", draft_budget=7, adaptive=True)
    assert plan.draft.drafter_kwargs()["budget"] == 7 and plan.draft.step_nodes == 7 and not plan.draft.adaptive_chain


def test_adaptive_draft_length_is_also_exact(char_llm):
    for prompt in REPETITIVE[:5]:
        ar = char_llm.generate(prompt, raw=True, max_new_tokens=40, drafter="none")
        spec = char_llm.generate(prompt, raw=True, max_new_tokens=40, adaptive=True)
        assert spec.token_ids == ar.token_ids


def test_stop_string_inside_a_draft_is_never_passed(char_llm):
    # Find a greedy continuation long enough, then stop on a string from its middle.
    ref = char_llm.generate("abcabcabc", raw=True, max_new_tokens=40, drafter="none")
    stop = ref.text[10:12]
    cut = ref.text.find(stop)
    for drafter in ("none", "ngram"):
        chunks = list(char_llm.stream("abcabcabc", raw=True, max_new_tokens=40, stop=[stop], drafter=drafter))
        result = chunks[-1]
        assert isinstance(result, Result)
        assert result.text == ref.text[:cut] and result.finish_reason == "stop"
        assert "".join(c.text for c in chunks[:-1]) == result.text  # the stream showed exactly this
        assert len(result.token_ids) <= cut + len(stop)  # no token past the one completing the stop


def test_max_new_tokens_exact(char_llm):
    for n in (1, 2, 7):
        r = char_llm.generate("abababab", raw=True, max_new_tokens=n)
        assert len(r.token_ids) == n and r.finish_reason == "length"
        assert r.stats["new_tokens"] == n


def test_eos_ends_generation_and_is_not_output(char_llm, monkeypatch):
    ref = char_llm.generate("abcabc", raw=True, max_new_tokens=12, drafter="none")
    eos = ref.token_ids[5]
    monkeypatch.setattr(char_llm.tokenizer, "eos_ids", {eos})
    for drafter in ("none", "ngram"):
        r = char_llm.generate("abcabc", raw=True, max_new_tokens=12, drafter=drafter)
        assert r.finish_reason == "stop" and r.token_ids == ref.token_ids[:ref.token_ids.index(eos)]


def test_context_end_stops_generation(char_llm):
    small = LLM(str(char_llm.loaded.model_dir), drafter="ngram", verifier="fp", max_context=24)
    r = small.generate("abcabcabcabc", raw=True, max_new_tokens=100)
    assert r.finish_reason == "length" and 12 + len(r.token_ids) <= 24


def test_prompt_longer_than_context(char_llm):
    with pytest.raises(QuasarError, match="context holds"):
        char_llm.generate("a" * 300, raw=True)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(max_new_tokens=0)])
def test_invalid_sampling_values(char_llm, bad):
    with pytest.raises(QuasarError):
        char_llm.generate("abc", raw=True, **bad)


def test_streaming_multibyte_text(chat_llm):
    """Streamed pieces concatenate to the final text and never contain a broken character."""
    r = chat_llm.generate("Écris « bonjour » 🌍 en 日本語", max_new_tokens=60, temperature=1.0, seed=0)
    chunks = list(chat_llm.stream("Écris « bonjour » 🌍 en 日本語", max_new_tokens=60, temperature=1.0, seed=0))
    streamed = "".join(c.text for c in chunks[:-1])
    assert streamed == chunks[-1].text == r.text
    assert "\ufffd" not in streamed or "\ufffd" in chat_llm.tokenizer.decode(r.token_ids)


def _stream(llm, prompt, **options) -> tuple[list, Result]:
    items = list(llm.stream(prompt, raw=True, **options))
    return items[:-1], items[-1]


def test_logprobs_come_from_the_rows_that_emitted_the_tokens(char_llm):
    """With drafts accepted, each token's logprobs are those of its own row: the same as
    decoding it alone (autoregressive), the greedy token ranks first, and chunks add up to
    the result. Without the option nothing is computed."""
    accepted = 0
    for prompt in REPETITIVE[:4]:
        chunks, spec = _stream(char_llm, prompt, max_new_tokens=30, drafter="ngram", logprobs=3)
        _, ar = _stream(char_llm, prompt, max_new_tokens=30, drafter="none", logprobs=3)
        accepted += spec.stats.accepted
        assert [e.token_id for e in spec.logprobs] == spec.token_ids == ar.token_ids
        assert [e for c in chunks for e in c.logprobs] == spec.logprobs
        for s, a in zip(spec.logprobs, ar.logprobs):
            assert s.logprob == pytest.approx(a.logprob, abs=1e-5)
            assert [t for t, _ in s.top] == [t for t, _ in a.top] and len(s.top) == 3
            assert s.top[0] == (s.token_id, s.logprob)
            assert all(x >= y for (_, x), (_, y) in zip(s.top, s.top[1:])) and s.logprob <= 0
    assert accepted > 0, "no draft was accepted: the test did not exercise speculation"
    chunks, plain = _stream(char_llm, "abcabc", max_new_tokens=8)
    assert plain.logprobs is None and all(c.logprobs is None for c in chunks)
    _, none_top = _stream(char_llm, "abcabc", max_new_tokens=8, logprobs=0)
    assert len(none_top.logprobs) == 8 and all(e.top == [] for e in none_top.logprobs)
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(QuasarError, match="logprobs"):
            char_llm.check_options(logprobs=bad)


def test_chat_template_and_eos(chat_llm):
    ids = chat_llm.encode("hi")
    assert chat_llm.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system")
    r = chat_llm.generate([{"role": "user", "content": "hi"}], max_new_tokens=8)
    assert r.stats["prompt_tokens"] == len(ids)


def _empirical(llm, prompt, n, position, drafter, seed0, verifier="fp"):
    counts = Counter()
    for s in range(n):
        r = llm.generate(prompt, raw=True, max_new_tokens=position + 1, temperature=1.3, seed=seed0 + s,
                         drafter=drafter, num_draft=4, draft_budget=6, verifier=verifier)
        if len(r.token_ids) > position:
            counts[r.token_ids[position]] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("drafter, verifier", [("ngram", "fp"), ("tree", "fp"), ("ngram", "w4a8")])
def test_speculative_sampling_matches_plain_sampling(char_llm, drafter, verifier):
    """Chi-square: the first token follows the verifier's distribution exactly, and the third
    token's distribution under speculative sampling (chains or trees) equals plain sampling's."""
    prompt = "abcabcabcab"
    ids = char_llm.encode(prompt, raw=True)
    model = char_llm.verifier_model(verifier)
    model.cache.length = 0
    probs = torch.softmax(model(torch.tensor([ids]), logits="last")[0, -1] / 1.3, -1).double().numpy()

    n = 800
    first = _empirical(char_llm, prompt, n, 0, drafter, 10_000, verifier)
    support = [t for t in range(len(probs)) if probs[t] * n >= 5]
    obs = np.array([first[t] for t in support] + [n - sum(first[t] for t in support)])
    exp = np.array([probs[t] * n for t in support] + [n - sum(probs[t] * n for t in support)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()  # scipy wants equal totals to the last bit
    assert sps.chisquare(obs, exp).pvalue > 1e-3

    spec = _empirical(char_llm, prompt, n, 2, drafter, 20_000, verifier)
    plain = _empirical(char_llm, prompt, n, 2, "none", 30_000, verifier)
    tokens = sorted(t for t in set(spec) | set(plain) if spec[t] + plain[t] >= 10)
    table = np.array([[spec[t] for t in tokens], [plain[t] for t in tokens]])
    assert sps.chi2_contingency(table).pvalue > 1e-3

    # the test has power: a visibly different distribution (plain sampling at T=0.6) fails it
    cold = Counter()
    for s in range(n):
        r = char_llm.generate(prompt, raw=True, max_new_tokens=3, temperature=0.6, seed=40_000 + s, drafter="none",
                              verifier=verifier)
        cold[r.token_ids[2]] += 1
    tokens = sorted(t for t in set(spec) | set(cold) if spec[t] + cold[t] >= 10)
    table = np.array([[spec[t] for t in tokens], [cold[t] for t in tokens]])
    assert sps.chi2_contingency(table).pvalue < 1e-3


DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List the planets of the solar system in order, one per line.",
    "Explain in three sentences why the sky is blue.",
    "Summarize: The city council approved the new budget on Tuesday. It adds two bus lines, "
    "repairs the old bridge and hires ten more librarians. The vote was seven to two.",
    "What is 17 times 23? Show the steps.",
]


@pytest.mark.slow
def test_greedy_tree_equals_autoregressive_on_the_default_model():
    """The default model's W8A8 verifier (the fused step where the CPU has it): tree drafts
    change no token of greedy output."""
    llm = LLM("default", verifier="w8a8")
    accepted = 0
    for prompt in DEFAULT_PROMPTS:
        ar = llm.generate(prompt, max_new_tokens=64, drafter="none")
        tree = llm.generate(prompt, max_new_tokens=64, drafter="tree")
        assert tree.token_ids == ar.token_ids, prompt
        accepted += tree.stats["accepted"]
    assert accepted > 0


def test_cli_generate_with_the_tree_drafter(char_llm, capsys):
    import json

    from quasar.cli import main

    args = ["generate", "--model", str(char_llm.loaded.model_dir), "--raw", "--prompt", "abcabcab", "--verifier", "fp",
            "--max-new-tokens", "12", "--json", "--drafter", "tree"]
    assert main([*args, "--draft-budget", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafter"] == "tree"
    assert out["token_ids"] == char_llm.generate("abcabcab", raw=True, max_new_tokens=12, drafter="none").token_ids
    assert main([*args, "--draft-budget", "0"]) == 2
    assert "draft_budget must be an integer in [1, 64], got 0" in capsys.readouterr().err


def test_auto_drafter_follows_the_measured_step_costs(char_llm):
    """`auto` (the default) decodes with tree drafts only where the quantized verifier's
    fused step (W8A8 or W4A8), timed on this CPU for this model, takes 16 rows at little
    more than one row's cost or one row takes 10 ms or more (quasar.runtime.step_cost), measured again for another kernel
    path; every result names the drafter and the kernel path that actually ran."""
    from quasar.kernels import ext
    from quasar.runtime import step_cost

    model = char_llm.verifier_model("w8a8")
    costs = model.step_costs
    assert costs is not None and costs.kernel_path == ext.kernel_path()
    assert (model.row_cost, model.pass_rows) == (costs.row_cost, costs.pass_rows)
    # rows priced by the probe until the decoder's own steps price them (quasar.runtime.learned_prices)
    assert model.learned_prices.probed == costs.row_prices and model.row_prices == model.learned_prices.prices
    expected = "tree" if costs.prefers_trees else "ngram"
    assert char_llm.resolve_drafter("auto", "w8a8") == expected
    assert char_llm.resolve_drafter("auto", "fp") == "ngram"  # the float verifier: the chain
    assert char_llm.resolve_drafter(None, "w8a8") == "ngram"  # this LLM's own default
    w4_costs = step_cost.current(char_llm.verifier_model("w4a8"))  # W4A8 by its own step's costs
    assert w4_costs is not None and w4_costs.kernel_path == ext.kernel_path()
    assert char_llm.resolve_drafter("auto", "w4a8") == ("tree" if w4_costs.prefers_trees else "ngram")
    try:
        with ext.forced_kernel_path("portable"):
            char_llm.resolve_drafter("auto", "w8a8")
            assert model.step_costs.kernel_path == "portable"
    finally:
        step_cost.install_measured(model)
    out = char_llm.generate("abcabcab", raw=True, max_new_tokens=8, drafter="auto", verifier="w8a8")
    assert out.drafter == expected and out.kernel_path == ext.kernel_path()
    assert out.as_dict()["kernel_path"] == ext.kernel_path()
    assert char_llm.generate("abcabcab", raw=True, max_new_tokens=4, verifier="fp").kernel_path == "pytorch"
    assert out.token_ids == char_llm.generate("abcabcab", raw=True, max_new_tokens=8, drafter="none",
                                              verifier="w8a8").token_ids
    assert char_llm.check_options(drafter="auto", verifier="fp").drafter == "ngram"
    # unresolved, "auto" is checked as both drafters it may become, before anything is built
    assert char_llm.check_options(drafter="auto", verifier="w8a8", resolve=False).drafter == "auto"
    with pytest.raises(QuasarError, match="draft_budget"):
        char_llm.check_options(drafter="auto", verifier="w8a8", draft_budget=0, resolve=False)
    with pytest.raises(QuasarError, match="unknown drafter"):
        LLM(str(char_llm.loaded.model_dir), drafter="autoo")


def test_tree_drafts_share_the_verifiers_recycling_table_except_seeded_sampling(char_llm):
    """Greedy and unseeded tree drafts of one verifier share a recycling table across requests
    (a request drafts from what earlier ones taught), which never changes greedy output;
    seeded sampling keeps a private table, so its output does not depend on earlier requests."""
    table = char_llm.recycling_table("fp")
    greedy = char_llm.check_options(drafter="tree", verifier="fp")
    assert char_llm.new_drafter(greedy).recycled is table
    assert char_llm.new_drafter(char_llm.check_options(drafter="tree", verifier="fp", temperature=0.8)).recycled is table
    seeded = char_llm.check_options(drafter="tree", verifier="fp", temperature=0.8, seed=4)
    assert char_llm.new_drafter(seeded).recycled is not table
    assert char_llm.recycling_table("w8a8") is not table  # each verifier has its own

    table.table.clear()  # what earlier tests taught it
    sample = dict(raw=True, max_new_tokens=24, drafter="tree", verifier="fp", temperature=0.9, seed=4)
    first = char_llm.generate("abcabcab", **sample).token_ids
    assert len(table) == 0  # seeded sampling taught its private table, not the shared one
    for prompt in REPETITIVE:  # greedy requests teach the shared table
        tree = char_llm.generate(prompt, raw=True, max_new_tokens=20, drafter="tree", verifier="fp")
        assert tree.token_ids == char_llm.generate(prompt, raw=True, max_new_tokens=20, drafter="none",
                                                   verifier="fp").token_ids
    assert len(table) > 0
    assert char_llm.generate("abcabcab", **sample).token_ids == first
