"""Phi-3 / Phi-4: fused projections split at load, partial rotary and LongRoPE, against
transformers; the W8A8 verifier runs it as a Llama-layout model (the fused step included)."""

import pytest
import torch

from quasar.api import LLM
from quasar.models.config import ModelConfig
from quasar.models.hf import load_hf_dir
from quasar.models.rows import Rows
from tests.family_models import assert_speculative_matches_ar, make_family_model
from tests.models.test_models import TOL, _reference_logits

# Phi-4-mini's shape of RoPE: 3/4 of each head rotated, LongRoPE past a pretraining length
LONGROPE = dict(partial_rotary_factor=0.75, max_position_embeddings=256, original_max_position_embeddings=32,
                rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5],
                              "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]})


def _check_parity(model_dir, context: int, n: int) -> float:
    torch.manual_seed(1)
    ids = torch.randint(0, 16, (1, n))
    ref = _reference_logits(model_dir, ids)
    model = load_hf_dir(model_dir)
    model.setup_cache(context)
    parts = [model(ids[:, :10])] + [model(ids[:, p:p + 1]) for p in range(10, 14)] + [model(ids[:, 14:])]
    diff = float((torch.cat(parts, dim=1) - ref).abs().max())
    assert diff <= TOL, diff
    return diff


@pytest.mark.parametrize("context,n", [(32, 24), (128, 48)])
def test_logits_match_transformers(tmp_path, context, n):
    """Default RoPE; then partial rotary with LongRoPE's short factors (a context within the
    pretraining length) and its long ones (past it: transformers switches on the length)."""
    _check_parity(make_family_model(tmp_path / "phi3", "phi3"), context, n)
    _check_parity(make_family_model(tmp_path / "phi3-longrope", "phi3", **LONGROPE), context, n)


def test_config_of_phi3():
    raw = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096,
           "sliding_window": 2047, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                                   "long_factor": [2.0] * 8}, "original_max_position_embeddings": 1024}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.model_type == "phi3" and cfg.max_position_embeddings == 2047  # capped at the window: exact
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_w8a8_phi3_takes_the_fused_step(tmp_path):
    from quasar.kernels import ext
    from quasar.quant.quantize import build_w8a8
    from quasar.models.loader import load_model

    loaded = load_model(make_family_model(tmp_path / "phi3-longrope", "phi3", **LONGROPE))
    q = build_w8a8(loaded.model, loaded.tokenizer, calib_text="abc def ghij klm " * 40, samples=2, seq_len=32,
                   progress=False)
    ids = [1, 4, 5, 6, 7, 8, 9, 4, 5]
    q.setup_cache(64)
    q(torch.tensor([ids[:5]]))
    rows = Rows.chain(ids[5:], 0, q.cache.lengths)
    fused = q._run_rows(rows, modules=False)
    if ext.decoder_layer_op() is None:
        assert fused is None
        pytest.skip("no C++ op here")
    assert fused is not None  # split and permuted, Phi-3 is the Llama layout the op runs
    step_kernel, q.step_kernel = q.step_kernel, None
    modules = q._run_rows(rows)
    q.step_kernel = step_kernel
    assert (fused - modules).abs().max() <= 1e-3 * modules.abs().max()


@pytest.mark.parametrize("verifier", ["fp", "w8a8", "w4a8"])
def test_greedy_speculative_equals_autoregressive(tmp_path, verifier):
    llm = LLM(str(make_family_model(tmp_path / "phi3", "phi3", seed=3, **LONGROPE)), drafter="ngram",
              verifier="fp", max_context=128)
    assert_speculative_matches_ar(llm, verifier, trees=False)
