"""Tiny random Phi-3 and mixture-of-experts models saved as Hugging Face directories (the
families transformers builds from a config alone; see conftest.make_tiny_model for the rest)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import write_char_tokenizer

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
               eos_token_id=None, pad_token_id=0, tie_word_embeddings=False, max_position_embeddings=512)


def family_config(family: str, vocab: int, **overrides):
    """A small transformers config of `family`: phi3 (optionally with partial rotary and
    LongRoPE through overrides), qwen3_moe (norm_topk_prob, a dense layer), mixtral, qwen2_moe
    (a shared expert)."""
    from transformers import MixtralConfig, Phi3Config, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(_COMMON, vocab_size=vocab, **overrides)
    if family == "phi3":
        return Phi3Config(**{"intermediate_size": 128, **common})
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**{"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
                                 "num_experts_per_tok": 2, "head_dim": 32, "norm_topk_prob": True,
                                 "mlp_only_layers": [1], **common})
    if family == "mixtral":
        return MixtralConfig(**{"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, **common})
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**{"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 6,
                                 "num_experts_per_tok": 2, "shared_expert_intermediate_size": 48, **common})
    raise ValueError(family)


def make_family_model(out: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random `family` model with the 16-token character tokenizer to `out`."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = write_char_tokenizer(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, vocab, **overrides)).eval()
    with torch.no_grad():  # larger weights than the init give peaked, less tie-prone logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    return out


def assert_speculative_matches_ar(llm, verifier: str, trees: bool = True) -> None:
    """Greedy n-gram drafts (k = 1 and 4) and, with `trees`, tree drafts give `verifier`'s
    greedy autoregressive tokens on repetitive and plain prompts, with drafts accepted."""
    accepted = 0
    for prompt in ("abcabcabcabc", "hello hello hello", "aaaaaaa", "kjihgfedcba"):
        ar = llm.generate(prompt, raw=True, max_new_tokens=30, drafter="none", verifier=verifier)
        for k in (1, 4):
            spec = llm.generate(prompt, raw=True, max_new_tokens=30, drafter="ngram", num_draft=k, verifier=verifier)
            assert spec.token_ids == ar.token_ids, (prompt, k)
            accepted += spec.stats["accepted"]
        if trees:
            tree = llm.generate(prompt, raw=True, max_new_tokens=30, drafter="tree", draft_budget=16,
                                verifier=verifier)
            assert tree.token_ids == ar.token_ids, prompt
    assert accepted > 0
