"""Continuous batching (quasar.speculative.batch): sequences decoded together in one W8A8
verifier step get exactly the tokens each gets alone, greedy and seeded sampling alike,
whoever joins or leaves the batch and whichever slot they land in; through
`LLM.generate_batch` and through the server with the real `openai` client.

A tiny random Qwen3-shaped model (the real SmolLM2 tokenizer), quantized to W8A8 with a
small calibration: the fused C++ step runs every batch in one call.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from conftest import swapped, tiny_w8a8_llm
from quasar.speculative.batch import PREFILL_CHUNK, BatchDecoder
from quasar.speculative.drafters import DraftTree
from quasar.speculative.generate import Chunk, Result, Sequence

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):", "The capital of France is", "1, 2, 3, 4, 5,",
           "Dear Sir, I write to you about the", "import numpy as np\nx = np.", "Once upon a time"]
SAMPLING = dict(temperature=0.9, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, default_model_dir):
    with tiny_w8a8_llm(tmp_path_factory.mktemp("batch") / "tiny", default_model_dir, seed=1, max_batch=4) as llm:
        yield llm


@pytest.fixture
def step_slots(llm):
    """Record, per verifier call of the W8A8 model, how many slots it covered and whether it ran fused."""
    model = llm.verifier_model("w8a8")
    step, kernel, calls = model.step, model.step_kernel, []

    def spy_step(rows, *a, **kw):
        calls.append([len(rows.starts), None])
        return step(rows, *a, **kw)

    def spy_kernel(*args, **kwargs):
        y = kernel(*args, **kwargs)
        if calls:
            calls[-1][1] = y is not None
        return y

    spy_kernel.max_rows = kernel.max_rows
    model.step, model.step_kernel = spy_step, spy_kernel
    yield calls
    model.step, model.step_kernel = step, kernel


def long_prompt(llm) -> str:
    text = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. "
    while len(llm.encode(text)) < PREFILL_CHUNK + 40:  # two prefill chunks
        text += text
    return text


@pytest.mark.parametrize("options", [dict(temperature=0), dict(SAMPLING), dict(temperature=0, drafter="tree"),
                                     dict(SAMPLING, drafter="tree")], ids=["greedy", "seeded", "tree", "tree-seeded"])
def test_generate_batch_equals_each_prompt_alone(llm, step_slots, options):
    prompts = PROMPTS + [long_prompt(llm)]  # 7 prompts, 4 slots: slots are reused
    batch = llm.generate_batch(prompts, max_new_tokens=24, **options)
    assert max(n for n, _ in step_slots) > 1, "no step decoded several sequences"
    assert all(fused for _, fused in step_slots), "a batched step did not run fused"
    alone = [llm.generate(p, max_new_tokens=24, **options) for p in prompts]
    for b, a in zip(batch, alone):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
    if options["temperature"] == 0:  # and speculative greedy is autoregressive greedy, in a batch too
        ar = llm.generate_batch(prompts, max_new_tokens=24, drafter="none")
        assert [r.token_ids for r in ar] == [r.token_ids for r in batch]


def run_alone(llm, prompt: str, **options) -> list[int]:
    return llm.generate(prompt, max_new_tokens=20, **options).token_ids


def drive(batch: BatchDecoder, plans: dict, outputs: dict, until=None) -> None:
    """Step until `until()` holds (or every sequence ended), collecting each key's tokens."""
    while batch.n_running and not (until and until()):
        for key, item in batch.step():
            assert not isinstance(item, Exception), item
            if isinstance(item, Chunk):
                outputs.setdefault(key, []).extend(item.token_ids)
            elif isinstance(item, Result):
                assert outputs.get(key, []) == item.token_ids
                plans[key] = "done"


def test_join_cancel_and_slot_reuse_change_no_tokens(llm):
    greedy, seeded = llm.check_options(max_new_tokens=20), llm.check_options(max_new_tokens=20, **SAMPLING)
    ids = {name: llm.encode(p) for name, p in zip("abcde", PROMPTS)}
    with llm.lock:
        batch = llm.batch_decoder("w8a8", slots=[1, 2, 3])
        batch.max_rows = 6  # greedy sequences get no drafts beside two others; seeded ones keep theirs
        plans, outputs = {}, {}
        batch.add("a", ids["a"], llm.new_drafter(greedy), greedy.options)
        batch.add("b", ids["b"], llm.new_drafter(seeded), seeded.options)
        batch.add("c", ids["c"], llm.new_drafter(greedy), greedy.options)
        drive(batch, plans, outputs, until=lambda: len(outputs.get("a", [])) >= 4)
        batch.remove("c")  # cancelled mid-batch: its slot goes to "d", which joins mid-batch
        slot_c = batch.free[-1]
        batch.add("d", ids["d"], llm.new_drafter(seeded), seeded.options)
        assert batch.entries["d"].slot == slot_c
        drive(batch, plans, outputs, until=lambda: "b" in plans)
        batch.add("e", ids["e"], llm.new_drafter(greedy), greedy.options)  # into the slot "b" left
        drive(batch, plans, outputs)
        assert sorted(batch.free) == [1, 2, 3]
    assert outputs["a"] == run_alone(llm, PROMPTS[0])
    assert outputs["b"] == run_alone(llm, PROMPTS[1], **SAMPLING)
    assert outputs["d"] == run_alone(llm, PROMPTS[3], **SAMPLING)
    assert outputs["e"] == run_alone(llm, PROMPTS[4])


def test_the_decoder_learns_its_verifiers_row_prices_from_its_steps(llm):
    """Each verifier step's time reaches the model's row-price learner (quasar.runtime.
    learned_prices); prices it reads again reach the model and every sequence decoding, and
    greedy output stays autoregressive greedy's whatever the prices."""
    from quasar.runtime import step_cost
    from quasar.runtime.learned_prices import REPRICE_EVERY, WINDOW, LearnedRowPrices

    model = llm.verifier_model("w8a8")
    costs = step_cost.current(model)
    assert model.learned_prices.probed == costs.row_prices
    learner = LearnedRowPrices(costs.row_prices, step_cost.MIN_ROW_PRICE)
    # a window of slow steps, each second row adding half a one-row step: a few of the
    # decoder's own (far shorter) steps move neither median
    for _ in range(WINDOW // 2 - REPRICE_EVERY):
        learner.steps.extend([(1, 1.0, 1.0), (2, 1.5, 1.0)])
    greedy = llm.check_options(max_new_tokens=20, drafter="tree")
    plans, outputs = {}, {}
    with llm.lock, swapped(model, "learned_prices", learner), swapped(model, "row_prices", costs.row_prices):
        batch = llm.batch_decoder("w8a8", slots=[1, 2])
        for key, prompt in zip("ab", PROMPTS):
            batch.add(key, llm.encode(prompt), llm.new_drafter(greedy), greedy.options)
        drive(batch, plans, outputs, until=lambda: model.row_prices != costs.row_prices)
        assert model.row_prices == learner.prices and learner.prices[0] == pytest.approx(0.5)
        assert batch.entries and all(e.seq.row_prices == learner.prices for e in batch.entries.values())
        drive(batch, plans, outputs)
    assert all(units >= 1.0 and 1 <= rows for rows, _, units in learner.steps)
    for key, prompt in zip("ab", PROMPTS):
        assert outputs[key] == run_alone(llm, prompt, drafter="none")


def test_a_shared_prompt_is_prefilled_once(llm, monkeypatch):
    """Sequences with the same prompt (`n` choices) copy the first one's cache instead of
    prefilling again, and decode exactly as if each had been prefilled."""
    import quasar.speculative.batch as batch_mod

    calls = []
    real = batch_mod.prefill
    monkeypatch.setattr(batch_mod, "prefill", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    prompt = long_prompt(llm)
    plan = llm.check_options(max_new_tokens=12, **SAMPLING)
    ids = llm.encode(prompt)
    with llm.lock:
        batch = llm.batch_decoder("w8a8", slots=[0, 1, 2])
        for i in range(3):
            sampling = dataclasses.replace(plan.options.sampling, seed=7 + i)
            batch.add(i, ids, llm.new_drafter(plan), dataclasses.replace(plan.options, sampling=sampling))
        outputs, plans = {}, {}
        drive(batch, plans, outputs)
    assert len(set(calls)) == 1, calls  # one slot was prefilled (in chunks), the others copied it
    for i in range(3):
        assert outputs[i] == llm.generate(prompt, max_new_tokens=12, **{**SAMPLING, "seed": 7 + i}).token_ids


def test_concurrent_openai_requests_equal_their_sequential_outputs(llm, step_slots):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from quasar.server.app import BackgroundServer, create_app

    requests = [dict(prompt=p, max_tokens=16, temperature=0) for p in PROMPTS[:4]] + \
               [dict(prompt=p, max_tokens=16, temperature=0.9, seed=30 + i) for i, p in enumerate(PROMPTS[:4])]
    with BackgroundServer(create_app(llm, max_queue=16, model_name="tiny")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(req):
            return client.completions.create(model="tiny", **req).choices[0].text

        with ThreadPoolExecutor(9) as pool:
            concurrent = pool.map(ask, requests)
            # the Python API on the same LLM meanwhile: it waits for the engine's slots
            direct = pool.submit(llm.generate, PROMPTS[5], max_new_tokens=16, raw=True).result().token_ids
            concurrent = list(concurrent)
        batched = max(n for n, _ in step_slots)
        sequential = [ask(req) for req in requests]
    assert batched > 1, "the server never decoded two requests in one step"
    assert concurrent == sequential
    assert direct == llm.generate(PROMPTS[5], max_new_tokens=16, raw=True).token_ids


class _Seq:
    """What BatchDecoder._share_rows reads of a Sequence: its draft chain's probs, sampling, cuts."""

    def __init__(self, probs, seeded=False):
        self.tree = DraftTree(list(range(len(probs))), list(range(-1, len(probs) - 1)), probs)
        self.gen = object() if seeded else None
        self.opts = SimpleNamespace(sampling=SimpleNamespace(seed=1 if seeded else None))

    draft_probs, cut_draft, _rows, pending = Sequence.draft_probs, Sequence.cut_draft, Sequence._rows, 0


def _active(third: float) -> list:
    """A step's sequences, each with its rows: four drafts, two, one (prob `third`), and seeded sampling's two."""
    seqs = [_Seq([0.9, 0.8, 0.7, 0.1]), _Seq([0.3, 0.05]), _Seq([third]), _Seq([0.99, 0.9], seeded=True)]
    return [(SimpleNamespace(seq=s, slot=i), [s.pending, *s.tree.tokens], [-1, *range(len(s.tree))])
            for i, s in enumerate(seqs)]


def _batch(max_rows: int, row_prices: tuple[float, ...]) -> BatchDecoder:
    batch = object.__new__(BatchDecoder)
    batch.cache = SimpleNamespace(lengths=[10, 20, 30, 40])
    batch.model = SimpleNamespace(row_prices=row_prices, row_cost=0.5, key_cost=0.0)  # row_cost: never read
    batch.max_rows = max_rows
    return batch


def test_spare_rows_go_to_the_likeliest_drafts_batch_wide():
    """_share_rows keeps the batch at max_rows by giving the spare rows (beyond each
    sequence's pending token and seeded sampling's fixed drafts) to the likeliest drafts
    over all sequences: each sequence keeps a prefix of its drafts, likeliest first."""
    out = _batch(8, (0.0,))._share_rows(_active(0.6))  # free rows: max_rows decides
    # 8 rows - 3 (the seeded sequence's pending token and both drafts) - 3 pending tokens = 2
    # spare: the 0.9 and 0.8 of the first sequence
    assert [len(toks) - 1 for _, toks, _ in out] == [2, 0, 0, 2]
    assert sum(len(toks) for _, toks, _ in out) == 8
    active = _active(0.6)  # room for every draft: nothing is cut
    assert [len(toks) for _, toks, _ in _batch(16, (0.0,))._share_rows(active)] == [len(t) for _, t, _ in active]


def test_a_batch_keeps_only_the_draft_rows_worth_their_price():
    """Beside the other sequences' rows a sequence's drafts are a step's later rows: where the
    first 6 rows are nearly free and each later one costs 0.3 of a one-row step, only drafts
    likelier than the step's tokens per cost stay, batch-wide; seeded sampling keeps its
    drafts whatever they cost."""
    out = _batch(16, (0.01,) * 5 + (0.3,))._share_rows(_active(0.95))
    # 6 rows are the 4 pending tokens and the seeded drafts: 5.89 tokens expected at cost 1.05,
    # so a row at 0.3 would need a draft likelier than 1.68
    assert [len(toks) - 1 for _, toks, _ in out] == [0, 0, 0, 2]
    out = _batch(16, (0.01,) * 7 + (0.3,))._share_rows(_active(0.95))  # two cheap rows more: the 0.95 and 0.9
    assert [len(toks) - 1 for _, toks, _ in out] == [1, 0, 1, 2]
