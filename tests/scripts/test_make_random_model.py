"""scripts/tools/make_random_model.py: checkpoints transformers loads with no missing or extra
tensors, exact real shapes, finite logits, seed-determinism independent of sharding."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import write_char_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "make_random_model.py"
_spec = importlib.util.spec_from_file_location("make_random_model", SCRIPT)
mrm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mrm)

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=48)
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def tiny_config(name: str) -> dict:
    cfg = dict(mrm.CONFIGS[name], **TINY)
    if "head_dim" in cfg:
        cfg["head_dim"] = 32  # qwen3's head_dim is free of hidden / heads
    if "num_experts" in cfg:
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return cfg


@pytest.fixture
def char_tokenizer(tmp_path) -> Path:
    out = tmp_path / "tok"
    out.mkdir()
    write_char_tokenizer(out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(model_dir / shard))
    assert set(tensors) == set(index["weight_map"])
    return tensors


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen3-8b", "olmoe-1b-7b"])
def test_tiny_model_loads_in_transformers(tmp_path, char_tokenizer, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = mrm.write_random_model(tmp_path / "m", tiny_config(name), "bf16", seed=1,
                                 tokenizer=char_tokenizer, max_shard_bytes=40_000)
    shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 2
    assert not list(tmp_path.glob(".m.tmp-*"))

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == mrm.CONFIGS[name]["architectures"][0]
    tensors = read_tensors(out)
    state = model.state_dict()
    for key, t in tensors.items():
        assert t.dtype == torch.bfloat16
        if key in state:  # transformers fuses a layer's experts into one tensor per projection
            assert torch.equal(state[key], t.float()), key
    norms = [t for k, t in tensors.items() if "norm" in k]
    assert norms and all(bool((t == 1).all()) for t in norms)
    linear = next(t for k, t in tensors.items() if k.startswith("model.layers.1.mlp.") and "up_proj" in k).float()
    assert abs(linear.std().item() - mrm.INIT_STD) < 0.002 and abs(linear.mean().item()) < 0.002

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "abc"}], return_tensors="pt",
                                  return_dict=True)["input_ids"]
    assert ids.shape[1] > 3
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_seed_decides_the_weights_not_the_sharding(tmp_path):
    cfg = tiny_config("qwen3-8b")
    a = read_tensors(mrm.write_random_model(tmp_path / "a", cfg, seed=3, max_shard_bytes=40_000))
    b = read_tensors(mrm.write_random_model(tmp_path / "b", cfg, seed=3, max_shard_bytes=1 << 30))
    c = read_tensors(mrm.write_random_model(tmp_path / "c", cfg, seed=4))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_chat_template_moves_into_tokenizer_config(tmp_path, char_tokenizer):
    out = mrm.write_random_model(tmp_path / "m", tiny_config("qwen2.5-0.5b"), tokenizer=char_tokenizer)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert not (out / "chat_template.jinja").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] is None  # the char tokenizer has no EOS


def test_failures_leave_nothing_behind(tmp_path, char_tokenizer):
    cfg = dict(tiny_config("qwen2.5-0.5b"), vocab_size=8)  # fewer ids than the tokenizer has
    with pytest.raises(ValueError, match="more than vocab_size"):
        mrm.write_random_model(tmp_path / "m", cfg, tokenizer=char_tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
    (tmp_path / "m").mkdir()
    with pytest.raises(FileExistsError):
        mrm.write_random_model(tmp_path / "m", tiny_config("qwen2.5-0.5b"))


@pytest.mark.parametrize("name,params", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304),
                                         ("qwen2.5-3b", 3_085_938_688), ("qwen3-8b", 8_190_735_360)])
def test_real_configs_match_transformers_shapes(name, params):
    """Every tensor of the real configs, against transformers' own module tree (on the meta
    device: no memory), and the published parameter counts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = mrm.CONFIGS[name]
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        expected.pop("lm_head.weight")
    specs = {n: shape for n, shape, _ in mrm.tensor_specs(cfg)}
    assert specs == expected
    assert sum(math.prod(s) for s in specs.values()) == params


@pytest.mark.parametrize("name,params", [("qwen3-30b-a3b", 30_532_122_624), ("olmoe-1b-7b", 7_335_385_088)])
def test_moe_configs_have_the_real_parameter_count(name, params):
    """Qwen3-30B-A3B's published count; OLMoE-1B-7B's layers and experts with Qwen3's
    vocabulary (its own embeddings hold 50,304 rows, these 151,936)."""
    specs = mrm.tensor_specs(mrm.CONFIGS[name])
    assert sum(math.prod(shape) for _, shape, _ in specs) == params
    cfg = mrm.CONFIGS[name]
    experts = [n for n, _, _ in specs if ".mlp.experts." in n]
    assert len(experts) == 3 * cfg["num_experts"] * cfg["num_hidden_layers"]
