"""The prompt cache (quasar.speculative.prompt_cache) and the batch's prefill order.

A later prompt that starts with a finished sequence's tokens gets their K/V from the cache:
bit for bit what prefilling it writes, so its output is the output it gets without the cache.
On the fused W8A8 step (rows computed one by one) the whole shared prefix is reused, the
earlier reply included; on a float verifier (and without the fused step) only whole
prefill chunks of the prompt.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_w8a8_llm
from quasar.kernels import ext
from quasar.speculative.batch import PREFILL_CHUNK, PREFILL_PATIENCE, BatchDecoder, decode, prefill
from quasar.speculative.generate import Chunk, Result
from quasar.speculative.prompt_cache import PromptCache, regime

TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. "


@pytest.fixture(scope="module")
def llm(tmp_path_factory, default_model_dir):
    with tiny_w8a8_llm(tmp_path_factory.mktemp("pcache") / "tiny", default_model_dir, seed=3, max_batch=3) as llm:
        yield llm


def ids_of(llm, n_tokens: int, tail: str = "") -> list[int]:
    text = TEXT
    while len(llm.encode(text, raw=True)) < n_tokens:
        text += TEXT
    return llm.encode(text, raw=True)[:n_tokens] + (llm.encode(tail, raw=True) if tail else [])


def run(llm, batch: BatchDecoder, requests: dict, plan) -> dict:
    """Decode {key: prompt ids} to the end in `batch`; {key: (token ids, Result)}."""
    out = {}
    for key, ids in requests.items():
        batch.add(key, ids, llm.new_drafter(plan), plan.options)
    while batch.n_running:
        for key, item in batch.step():
            assert not isinstance(item, Exception), item
            if isinstance(item, Result):
                out[key] = (item.token_ids, item)
    return out


def decoder(llm, verifier: str, slots: list[int], cache: PromptCache | None) -> BatchDecoder:
    return BatchDecoder(llm.verifier_model(verifier), llm.tokenizer, slots=slots, prompt_cache=cache)


def plain(llm, ids: list[int], **options) -> list[int]:
    """The tokens of a decode of `ids` without any prompt cache (LLM.generate has one)."""
    plan = llm.check_options(**options)
    with llm.lock:
        items = decode(llm.verifier_model(plan.verifier), llm.tokenizer, ids, llm.new_drafter(plan), plan.options)
        return [item for item in items if isinstance(item, Result)][0].token_ids


def fresh_kv(model, slot: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V a plain prefill of `ids` writes into `slot`."""
    model.cache.lengths[slot] = 0
    prefill(model, slot, ids)
    n = len(ids)
    return model.cache.k[:, slot, :, :n].clone(), model.cache.v[:, slot, :, :n].clone()


@pytest.mark.parametrize("verifier", ["w8a8", "fp"])
def test_a_later_prompt_reuses_the_kept_prefix_bit_for_bit(llm, verifier):
    """Turn two of a chat (turn one, its reply, a follow-up) starts from turn one's K/V: the
    reply included where rows are computed one by one (W8A8's fused step), only the prompt's
    whole prefill chunks on the float verifier; its K/V and tokens equal a fresh prefill's."""
    plan = llm.check_options(max_new_tokens=24, temperature=0, verifier=verifier)
    model = llm.verifier_model(verifier)
    cache = PromptCache(64 << 20)
    first = ids_of(llm, PREFILL_CHUNK + 40)
    with llm.lock:
        exact, _ = regime(model)
        if verifier == "fp":
            assert not exact  # float GEMMs round by row count
        else:  # rows computed alone wherever the fused step runs without AMX prefill tiles
            assert exact or ext.decoder_layer_op() is None or ext.amx_attention_supported()
        reply, _ = run(llm, decoder(llm, verifier, [0], cache), {"one": first}, plan)["one"]
        second = first + reply + llm.encode(" And then what happened to the fox?", raw=True)
        batch = decoder(llm, verifier, [1], cache)
        seq = batch.add("two", second, llm.new_drafter(plan), plan.options)
        if exact:  # all but the reply's last token (never run through the verifier)
            assert len(first) + len(reply) - 1 <= seq.stats.cached_tokens < len(second)
        else:
            assert seq.stats.cached_tokens == len(first) // PREFILL_CHUNK * PREFILL_CHUNK > 0
        while not batch.entries["two"].prefilled:
            batch._prefill([])
        n = len(second) - 1
        k, v = model.cache.k[:, 1, :, :n].clone(), model.cache.v[:, 1, :, :n].clone()
        k0, v0 = fresh_kv(model, 2, second[:-1])
        assert torch.equal(k, k0) and torch.equal(v, v0)
        tokens = []
        while batch.n_running:
            for _, item in batch.step():
                assert not isinstance(item, Exception), item
                if isinstance(item, Chunk):
                    tokens += item.token_ids
    assert tokens == plain(llm, second, max_new_tokens=24, temperature=0, verifier=verifier)


def test_the_server_batches_reuse_the_cache_and_count_it(llm):
    """LLM.generate_batch (the server's decoders) reuse kept prompts and report them in the
    stats; the tokens are those of a plain decode, greedy and seeded alike."""
    first = ids_of(llm, PREFILL_CHUNK + 30)
    second = first + llm.encode(" Tell me more.", raw=True)
    exact, _ = regime(llm.verifier_model("w8a8"))
    for options in (dict(temperature=0), dict(temperature=0.8, seed=3)):
        one = llm.engine.decode_batch(llm.check_options(max_new_tokens=12, **options), [first])[0]
        two = llm.engine.decode_batch(llm.check_options(max_new_tokens=12, **options), [second])[0]
        assert two.stats.cached_tokens >= len(first) - 1 if exact else two.stats.cached_tokens == PREFILL_CHUNK
        assert two.token_ids == plain(llm, second, max_new_tokens=12, **options)
        assert one.token_ids == plain(llm, first, max_new_tokens=12, **options)


def test_generate_reuses_the_previous_turn(llm):
    """LLM.generate (a Python chat loop) keeps each finished turn: the next turn, the reply
    included, starts from it and reports it, with the tokens of a decode without the cache."""
    first = ids_of(llm, PREFILL_CHUNK + 20, " Go on:")
    exact, _ = regime(llm.verifier_model("w8a8"))
    one = llm.generate(prompt_ids=first, max_new_tokens=16, temperature=0)
    second = first + one.token_ids + llm.encode(" And then?", raw=True)
    two = llm.generate(prompt_ids=second, max_new_tokens=16, temperature=0)
    if exact:  # all but the reply's last token (never run through the verifier)
        assert len(first) + len(one.token_ids) - 1 <= two.stats["cached_tokens"] < len(second)
    else:
        assert two.stats["cached_tokens"] == PREFILL_CHUNK
    assert two.token_ids == plain(llm, second, max_new_tokens=16, temperature=0)


def test_a_record_serves_only_the_cache_layout_it_was_made_in(llm):
    """The regime names the cache's dtype and length: K/V kept from one cache are not copied
    into a cache of another length (a long-context rotary embedding's K depend on it)."""
    model = llm.verifier_model("w8a8")
    ids = ids_of(llm, PREFILL_CHUNK + 8)
    cache = PromptCache(64 << 20)
    with llm.lock:
        saved = model.cache
        try:
            model.setup_cache(384, 1)
            fresh_kv(model, 0, ids)
            cache.save(model.cache, 0, ids, PREFILL_CHUNK, regime(model))
            assert cache.load(model.cache, 0, ids, regime(model), PREFILL_CHUNK) >= PREFILL_CHUNK
            model.setup_cache(448, 1)
            assert cache.load(model.cache, 0, ids, regime(model), PREFILL_CHUNK) == 0
        finally:
            model.cache = saved


def test_the_cache_keeps_within_its_bytes_least_recently_used_first(llm):
    model = llm.verifier_model("w8a8")
    rule = (True, "a test's exact regime")  # whatever this CPU's is: records keep every token
    with llm.lock:
        a, b, c = ids_of(llm, 40, " alpha"), ids_of(llm, 10, " beta gamma"), [7] * 30
        per_token = 2 * model.cache.k[:, 0, :, :1].numel() * model.cache.k.element_size()
        cache = PromptCache(per_token * (len(a) + len(c) + 2))
        for slot, ids in enumerate((a, b)):
            fresh_kv(model, slot, ids)
            cache.save(model.cache, slot, ids, 0, rule)
        assert [k.tokens for k in cache.kept.values()] == [a, b]
        assert cache.load(model.cache, 2, a[:20] + [5, 6], rule, PREFILL_CHUNK) == 20  # a is now the most recent
        fresh_kv(model, 0, c)
        cache.save(model.cache, 0, c, 0, rule)  # over budget: b, the least recently used, goes
        assert [k.tokens for k in cache.kept.values()] == [a, c]
        assert cache.nbytes <= cache.max_bytes
        fresh_kv(model, 1, a + [9, 9])
        cache.save(model.cache, 1, a + [9, 9], 0, rule)  # extends a: a goes
        assert [k.tokens for k in cache.kept.values()] == [c, a + [9, 9]]
        cache.save(model.cache, 1, a, 0, rule)  # a prefix of one kept: nothing new
        assert len(cache.kept) == 2
        assert cache.load(model.cache, 2, a, (True, "another build"), PREFILL_CHUNK) == 0  # another regime
        assert cache.load(model.cache, 2, c, (False, "chunks"), PREFILL_CHUNK) == 0
        with pytest.raises(ValueError):
            PromptCache(-1)


def test_the_prompt_with_fewest_tokens_left_prefills_first_within_the_budget(llm):
    """A short prompt that arrives behind a long one gets its first token first; a step does
    not start a chunk past its budget; a prompt passed over PREFILL_PATIENCE times goes first."""
    plan = llm.check_options(max_new_tokens=40, temperature=0)
    long_ids, short_ids = ids_of(llm, 3 * PREFILL_CHUNK + 5), ids_of(llm, 30, " short")
    with llm.lock:
        batch = decoder(llm, "w8a8", [0, 1, 2], None)
        batch.add("long", long_ids, llm.new_drafter(plan), plan.options)
        batch.add("short", short_ids, llm.new_drafter(plan), plan.options)
        first = batch.step()
        assert [key for key, item in first if isinstance(item, Chunk)] == ["short"]
        assert batch.entries["long"].filled == 0 and batch.entries["long"].passed == 1
        batch.step()  # the long prompt's first chunk
        assert batch.entries["long"].filled == PREFILL_CHUNK
        later = ids_of(llm, 20, " later")
        batch.add("later", later, llm.new_drafter(plan), plan.options)
        batch.entries["long"].passed = PREFILL_PATIENCE  # it has waited long enough
        batch.step()
        assert batch.entries["long"].filled == 2 * PREFILL_CHUNK and batch.entries["later"].filled == 0
        while batch.n_running:
            batch.step()
