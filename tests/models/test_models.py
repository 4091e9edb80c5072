"""Our decoder against transformers on tiny random models of every supported architecture."""

import pytest
import torch

from quasar.models.hf import load_hf_dir
from tests.conftest import ARCHES

TOL = 1e-4


def _reference_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("arch", ARCHES)
def test_logits_match_transformers(arch, tiny_char_model):
    model_dir = tiny_char_model(arch)
    torch.manual_seed(1)
    ids = torch.randint(0, 16, (1, 24))
    ref = _reference_logits(model_dir, ids)
    model = load_hf_dir(model_dir)
    model.setup_cache(64)

    prefill = model(ids[:, :10])
    assert (prefill - ref[:, :10]).abs().max() <= TOL
    for pos in range(10, 14):  # one token at a time over the cache
        step = model(ids[:, pos:pos + 1])
        assert (step - ref[:, pos:pos + 1]).abs().max() <= TOL
    multi = model(ids[:, 14:20])  # a verifier-style multi-token step over the cache
    assert (multi - ref[:, 14:20]).abs().max() <= TOL

    model.cache.length = 16  # roll back four positions, then decode them again
    again = model(ids[:, 16:24])
    assert (again - ref[:, 16:24]).abs().max() <= TOL


def test_tied_and_untied_embeddings(tiny_char_model):
    tied = load_hf_dir(tiny_char_model("llama", tie_word_embeddings=True))
    untied = load_hf_dir(tiny_char_model("llama", seed=1, tie_word_embeddings=False))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_last_and_no_logits(tiny_char_model):
    model = load_hf_dir(tiny_char_model("qwen3"))
    ids = torch.randint(0, 16, (1, 8))
    model.setup_cache(32)
    full = model(ids)
    model.cache.length = 0
    last = model(ids, logits="last")
    assert torch.allclose(last, full[:, -1:], atol=1e-5)
    model.cache.length = 0
    assert model(ids, logits="none") is None and model.cache.length == 8


def test_context_overflow_is_a_clear_error(tiny_char_model):
    from quasar.errors import QuasarError

    model = load_hf_dir(tiny_char_model("llama"))
    model.setup_cache(8)
    with pytest.raises(QuasarError, match="context is full"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_stream_decoder_deltas_join_to_the_full_text(default_model_dir):
    """Token by token, the deltas add up to decoding all ids at once; a character split
    over several byte-level tokens is held back until complete, never shown as U+FFFD."""
    from quasar.models.tokenizer import StreamDecoder, Tokenizer

    tok = Tokenizer(default_model_dir)
    text = "Hello wörld — 数学 😀🚀 tabs\tand  spaces\n def f(x):\n    return x ** 2  # ünïcödé ✓"
    ids = tok.encode(text) * 3
    dec = StreamDecoder(tok)
    deltas = [dec.push([i]) for i in ids]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # the emoji / CJK bytes span tokens
    # several ids per push (a verifier step's accepted drafts) give the same text
    dec = StreamDecoder(tok)
    assert "".join(dec.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) == tok.decode(ids)
