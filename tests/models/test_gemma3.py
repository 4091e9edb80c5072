"""Gemma 3: the block against transformers on tiny random models (sliding and global layers,
their RoPE tables, sandwich norms), its verifiers' greedy speculative output, its config,
quantization folds and the real 270M from its packages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quasar.api import LLM
from quasar.errors import QuasarError
from quasar.models.config import ModelConfig
from quasar.models.hf import load_hf_dir
from tests.conftest import write_char_tokenizer

TOL = 1e-4  # as tests/models/test_models.py
WINDOW = 6  # short enough that every test sequence slides past it
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def make_tiny_gemma3(out: Path, seed: int = 0, **overrides) -> Path:
    """A random Gemma3ForCausalLM with the 16-token character tokenizer; its norm weights are
    random too, so that Gemma's 1 + w matters."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    out.mkdir(parents=True, exist_ok=True)
    vocab = write_char_tokenizer(out)
    fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                  bos_token_id=1, eos_token_id=None, pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08 if p.dim() == 2 else 0.3)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny")


def _reference_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        return hf(ids).logits


def _check_against_transformers(model_dir: Path) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, 16, (1, 24))
    ref = _reference_logits(model_dir, ids)
    model = load_hf_dir(model_dir)
    model.setup_cache(64)
    assert (model(ids[:, :10]) - ref[:, :10]).abs().max() <= TOL  # a causal prefill past the window
    for pos in range(10, 14):  # one token at a time over the cache
        assert (model(ids[:, pos:pos + 1]) - ref[:, pos:pos + 1]).abs().max() <= TOL
    assert (model(ids[:, 14:20]) - ref[:, 14:20]).abs().max() <= TOL  # a verifier-style step
    model.cache.length = 16  # roll back, then decode again
    assert (model(ids[:, 16:24]) - ref[:, 16:24]).abs().max() <= TOL
    model.cache.length = 0
    assert (model(ids) - ref).abs().max() <= TOL


def test_logits_match_transformers(gemma_dir):
    _check_against_transformers(gemma_dir)


def test_v4_config_keys_and_final_softcap_match_transformers(tmp_path):
    """transformers v4's keys (rope_theta, rope_local_base_freq, rope_scaling, the layer pattern
    as sliding_window_pattern) and a final logit softcap."""
    d = make_tiny_gemma3(tmp_path / "v4", seed=2, final_logit_softcapping=3.0)
    cfg = json.loads((d / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        cfg.pop(key)
    cfg.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=3)
    (d / "config.json").write_text(json.dumps(cfg))
    parsed = ModelConfig.from_hf(cfg)
    assert parsed.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert parsed.rope_scaling["factor"] == 2.0 and parsed.rope_local_theta == 1e4
    _check_against_transformers(d)


def test_config_round_trips_through_to_hf(gemma_dir):
    from transformers import Gemma3TextConfig

    cfg = ModelConfig.from_hf(json.loads((gemma_dir / "config.json").read_text()))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    theirs = Gemma3TextConfig(**cfg.to_hf())
    assert theirs.layer_types == LAYER_TYPES and theirs.sliding_window == WINDOW
    assert theirs.rope_parameters["sliding_attention"]["rope_theta"] == 1e4


def test_unsupported_gemma_variants_are_named():
    base = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 16, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(QuasarError, match="softcapping"):
        ModelConfig.from_hf({**base, "attn_logit_softcapping": 50.0})
    with pytest.raises(QuasarError, match="unsupported architecture 'Gemma3ForConditionalGeneration'.*Gemma3ForCausalLM"):
        ModelConfig.from_hf({**base, "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})


def test_smoothing_fold_keeps_gemmas_norm_offset(gemma_dir):
    """Folding a smoothing scale into a 1 + w norm leaves the layer's function unchanged."""
    from quasar.models.families import decoder_layer
    from quasar.models.llama import KVCache, Prefill, rope_cos_sin, rope_inv_freq
    from quasar.models.tensors import SafetensorsSource
    from quasar.quant.sequential import float_layer
    from quasar.quant.smooth import fold, group_scales, layer_groups

    cfg = ModelConfig.from_hf(json.loads((gemma_dir / "config.json").read_text()))
    layer = float_layer(SafetensorsSource(gemma_dir), cfg, 0)
    assert type(layer) is type(decoder_layer(cfg, 0))
    pos = torch.arange(12)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), pos, torch.float32)
    at, x = Prefill(0, 0, pos[None, :] <= pos[:, None]), torch.randn(1, 12, cfg.hidden_size)

    def run():
        return layer(x, cos, sin, KVCache(1, cfg.num_kv_heads, 12, cfg.head_dim, torch.float32), 0, at)

    before = run()
    groups = layer_groups(layer, cfg, 0)
    assert [g.producer_name.split(".", 3)[-1] for g in groups[:2]] == ["input_layernorm", "pre_feedforward_layernorm"]
    torch.manual_seed(0)
    for bg in groups:
        act = torch.rand(bg.consumers[0].in_features) * 4 + 0.1
        fold(bg, *group_scales(bg, act, 0.5))
    assert (run() - before).abs().max() <= 1e-4


def test_rotation_is_declined_for_gemma(gemma_dir):
    from quasar.quant.options import QuantOptions
    from quasar.quant.quantize import for_model
    from quasar.quant.smooth import rotations

    cfg = ModelConfig.from_hf(json.loads((gemma_dir / "config.json").read_text()))
    with pytest.raises(QuasarError, match="rotation does not fold"):
        rotations(cfg)
    assert for_model(QuantOptions(), cfg).rotate is False


@pytest.fixture(scope="module")
def gemma_llm(gemma_dir):
    from quasar.quant.options import QuantOptions

    # a short calibration (windows still longer than the sliding window): the tiny model's W8A8 in seconds
    return LLM(str(gemma_dir), drafter="ngram", verifier="fp", max_context=128,
               quant=QuantOptions(samples=4, seq_len=64))


REPETITIVE = ["abcabcabcabcabc", "aaaaaaaaaa", "defgdefgdefgdefg", "kjihgfedcba"]


@pytest.mark.parametrize("verifier", ["fp", "w8a8", "w4a8"])
def test_greedy_speculative_equals_autoregressive(gemma_llm, verifier):
    """Chains and trees of drafts, past the sliding window: the same tokens as plain decoding."""
    accepted = 0
    for prompt in REPETITIVE:
        ar = gemma_llm.generate(prompt, raw=True, max_new_tokens=40, drafter="none", verifier=verifier)
        for drafter, extra in (("ngram", {"num_draft": 4}), ("tree", {"draft_budget": 16})):
            spec = gemma_llm.generate(prompt, raw=True, max_new_tokens=40, drafter=drafter, verifier=verifier,
                                      **extra)
            assert spec.token_ids == ar.token_ids, (prompt, drafter, extra)
            accepted += spec.stats["accepted"]
    assert accepted > 0, "no draft was ever accepted: the test did not exercise speculation"


def test_quantized_verifiers_run_the_fused_step(gemma_llm):
    """Gemma's quantized verifiers run the fused C++ step (tests/runtime/test_fused_gemma3.py),
    over a float32 cache (Gemma keeps no bfloat16 cache)."""
    from quasar.runtime.w8a8 import Int8Linear

    model = gemma_llm.verifier_model("w8a8")
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    assert type(model).__name__ == "Gemma3Transformer"
    if model.step_kernel is not None:
        assert model.step_kernel._build()
    assert model.kv_dtype is None


# ------------------------------------------------------------------ the real 270M


def _gemma3_270m():
    from quasar.data.packages import gemma3_270m_path

    try:
        return gemma3_270m_path()
    except QuasarError as e:  # its packages are part of setup.sh; a bare install may lack them
        pytest.skip(str(e))


@pytest.mark.slow
def test_270m_is_joined_from_its_packages_and_checked():
    from quasar.data.chunked_model import sha256_of
    from quasar.data.packages import GEMMA3_270M

    path = _gemma3_270m()
    assert path.name == "gemma-3-270m-q4_k_m.gguf" and sha256_of(path) == GEMMA3_270M.sha256


@pytest.mark.slow
def test_270m_logits_match_transformers_on_its_dequantized_weights():
    """`--model gemma3-270m` (the GGUF's norms stored as 1 + w, its layer pattern and local
    RoPE base implied) against transformers' Gemma3ForCausalLM on the conversion's weights,
    over a prompt longer than its 512-token window."""
    from transformers import AutoModelForCausalLM

    from quasar.models.loader import load_model

    _gemma3_270m()
    loaded = load_model("gemma3-270m")
    assert loaded.config.model_type == "gemma3_text" and loaded.default_verifier == "w4a8"
    text = "The capital of France is Paris. The capital of Germany is Berlin. " * 60
    ids = torch.tensor([loaded.tokenizer.encode(text)[:600]])
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.weights_dir()), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
    model = loaded.model
    model.setup_cache(640)
    ours = model(ids[:, :590])
    steps = torch.cat([model(ids[:, p:p + 1]) for p in range(590, 600)], dim=1)
    assert (torch.cat([ours, steps], dim=1) - ref).abs().max() <= TOL


def test_chat_without_a_template_keeps_the_tokenizers_bos(tmp_path):
    """The plain chat fallback (the 270M's file has no template) starts with the BOS the
    tokenizer adds: Gemma degenerates without it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    from quasar.models.tokenizer import Tokenizer

    write_char_tokenizer(tmp_path)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer(tmp_path)
    assert ours.chat_template is None
    ids = ours.encode_chat([{"role": "user", "content": "abc"}])
    assert ids[0] == 1 and ids.count(1) == 1
