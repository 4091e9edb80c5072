"""Phi-3 and mixture-of-experts GGUF files (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral as a `llama` file with experts), written as llama.cpp's converter lays them out
(tests.gguf_writer): converted, they give transformers' logits on the Hugging Face model they
came from and llama.cpp's on the same file; a 4-bit file's groups, experts and fused tensors included, become the W4A8
verifier's layers as the file stores them; speculative decoding of one stays exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, dequantize

from quasar.api import LLM
from quasar.engine.w4a8_verifier import w4a8_verifier
from quasar.errors import QuasarError
from quasar.models import gguf as gguf_mod
from quasar.models.config import ModelConfig
from quasar.models.hf import load_hf_dir, read_config
from quasar.models.loader import load_model
from quasar.models.moe import Router, SparseMoE
from quasar.runtime.q6k_linear import Q6KLinear
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w8a8 import Int8Linear
from tests.family_models import assert_speculative_matches_ar, make_family_model
from fused_checks import record_fused_steps
from quasar.kernels import ext
from tests.gguf_writer import write_family_gguf
from tests.models.test_models import TOL, _reference_logits
from tests.models.test_phi3 import LONGROPE

FAMILIES = {"qwen3_moe": {}, "qwen2_moe": {}, "mixtral": {}, "phi3": LONGROPE}
# what each family's config must carry over from the Hugging Face model
KEPT = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "moe_layers",
        "shared_expert_intermediate_size", "qkv_bias", "qk_norm", "head_dim", "partial_rotary_factor",
        "num_kv_heads", "intermediate_size", "tie_word_embeddings")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(Hugging Face directory, GGUF file) of `family` in `qtype` (None: float32), made once."""
    made: dict = {}
    root = tmp_path_factory.mktemp("gguf-families")

    def get(family: str, qtype=None) -> tuple[Path, Path]:
        if family not in made:
            made[family] = make_family_model(root / family, family, seed=3, **FAMILIES[family])
        name = f"{family}-{qtype.name if qtype else 'F32'}.gguf"
        if not (root / name).exists():
            write_family_gguf(made[family], root / name, qtype)
        return made[family], root / name
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(files, family):
    """The float GGUF converted gives the Hugging Face model's config and transformers' logits
    (Phi-3 with partial rotary and LongRoPE: its short factors within the pretraining length,
    its long ones past it)."""
    model_dir, path = files(family)
    loaded = load_model(str(path))
    ours, theirs = loaded.config, ModelConfig.from_hf(read_config(model_dir))
    assert ours.model_type == theirs.model_type
    assert {k: getattr(ours, k) for k in KEPT} == {k: getattr(theirs, k) for k in KEPT}
    torch.manual_seed(1)
    ids = torch.randint(3, 16, (1, 40))
    for context, n in ((32, 24), (128, 40)) if family == "phi3" else ((64, 40),):
        model = load_hf_dir(loaded.model_dir)
        model.setup_cache(context)
        got = torch.cat([model(ids[:, :10]), model(ids[:, 10:n])], dim=1)
        assert float((got - _reference_logits(model_dir, ids[:, :n])).abs().max()) <= TOL, context
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert sparse == {"qwen3_moe": [True, False], "phi3": [False, False]}.get(family, [True, True])


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "phi3"])
def test_logits_match_llamacpp(files, family):
    """llama.cpp runs the same file to the same logits (float32 KV cache): its routing (the
    chosen experts' weights renormalized for Mixtral, not for Qwen2-MoE), the shared expert's
    sigmoid gate, Phi-3's fused tensors and LongRoPE's long factors and attention factor are
    the conversion's. (llama.cpp's qwen3moe has no dense layer, which the tiny Qwen3-MoE has.)"""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional")
    _, path = files(family)
    loaded = load_model(str(path))
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 16, 24)]
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, n_threads=1, logits_all=True, type_k=0, type_v=0,
                          verbose=False)  # type 0: a float32 KV cache
    llm.eval(ids)
    ref = torch.from_numpy(np.array(llm.scores[:len(ids)]))
    model = load_hf_dir(loaded.model_dir)
    model.setup_cache(llm.n_ctx())  # llama.cpp rounds its context up (256): Phi-3's long factors
    assert float((model(torch.tensor([ids]))[0] - ref).abs().max()) <= 1e-5


def test_experts_are_written_a_chunk_at_a_time(files, monkeypatch, tmp_path):
    """A layer's stacked experts go to shards of at most EXPERT_SHARD_VALUES weights (here
    two experts' worth), so a large mixture of experts converts in little memory."""
    monkeypatch.setattr(gguf_mod, "EXPERT_SHARD_VALUES", 2 * 32 * 64)
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    _, path = files("qwen3_moe")
    out = gguf_mod.gguf_to_hf_dir(path)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    gate_shards = [weight_map[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(8)]
    assert [gate_shards.count(s) for s in dict.fromkeys(gate_shards)] == [2, 2, 2, 2]
    assert weight_map["model.layers.0.mlp.gate.weight"] not in gate_shards


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "phi3"])
def test_w4a8_takes_the_files_groups(files, family):
    """A Q4_0 file's experts, shared expert, Mixtral's permuted Q/K and Phi-3's fused q/k/v and
    gate/up become W4A8 layers whose weights are the file's (what the conversion dequantizes),
    bit for bit, except Phi-3's q and k under LongRoPE, whose groups carry its attention factor
    (a float16 rounding of scale and offset); a matrix that is not whole 4-bit blocks (kept
    float32 in the file) stays int8; the router stays float."""
    _, path = files(family, GGMLQuantizationType.Q4_0)
    loaded = load_model(str(path))
    model = w4a8_verifier(loaded)
    four = {n: m for n, m in model.model.named_modules() if isinstance(m, W4A8Linear)}
    wide = {n for n, m in model.model.named_modules() if isinstance(m, Int8Linear)}
    assert len(four) == {"qwen2_moe": 48, "mixtral": 24, "phi3": 14}[family]
    assert wide == {"qwen2_moe": {f"layers.{i}.mlp.shared_expert.down_proj" for i in range(2)},
                    "mixtral": {f"layers.{i}.mlp.experts.{e}.down_proj" for i in range(2) for e in range(4)},
                    "phi3": set()}[family]
    for name, layer in four.items():
        want = loaded.model.model.get_submodule(name).weight.detach().float()
        if family == "phi3" and name.endswith(("q_proj", "k_proj")):
            assert torch.allclose(layer.dequantized_weight(), want, rtol=0, atol=2e-3 * float(want.abs().max()))
        else:
            assert torch.equal(layer.dequantized_weight(), want), name
    if family != "phi3":
        assert all(isinstance(m.mlp.gate, Router) for m in model.model.layers)
        stack = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_up_exps.weight")
        for e in range(int(stack.shape[-1])):  # the file's own expert, not the conversion's
            want = torch.from_numpy(dequantize(stack.data[e], stack.tensor_type).astype(np.float32))
            assert torch.equal(four[f"layers.1.mlp.experts.{e}.up_proj"].dequantized_weight(), want.reshape(-1, 64))


Q4K_SHAPES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=16, num_key_value_heads=8)


@pytest.mark.parametrize("family", ["mixtral", "phi3"])
def test_a_q4_k_m_file_streams_its_own_blocks(tmp_path, monkeypatch, family):
    """A Q4_K file with some tensors in Q6_K, as Q4_K_M keeps them, at widths of whole
    superblocks: each Q4_K matrix becomes a W4A8 layer in the Q4_K form (the file's codes and
    float16 factors, 4.5 bits a weight), each Q6_K one (layer 0's value and down
    projections, experts included) a Q6KLinear of its 6-bit blocks, and the head's logits come
    from its Q6_K blocks; their weights are the file's bit for bit (Mixtral's permuted Q/K
    included), but Phi-3's q and k, whose LongRoPE factor rounds into their factors. The
    cache's checkpoint holds the same tensors. Through the fused step, greedy drafting equals
    greedy decoding."""
    overrides = dict(FAMILIES[family], **Q4K_SHAPES)
    if family == "mixtral":
        overrides["num_local_experts"] = 2
    model_dir = make_family_model(tmp_path / family, family, seed=5, **overrides)
    path = write_family_gguf(model_dir, tmp_path / f"{family}-Q4_K.gguf", GGMLQuantizationType.Q4_K)
    loaded = load_model(str(path))
    model = w4a8_verifier(loaded, cache=False)
    four = {n: m for n, m in model.model.named_modules() if isinstance(m, W4A8Linear)}
    six = {n for n, m in four.items() if isinstance(m, Q6KLinear)}
    assert len(four) == {"mixtral": 2 * (4 + 2 * 3), "phi3": 2 * 7}[family]
    downs = {f"layers.0.mlp.experts.{e}.down_proj" for e in range(2)} if family == "mixtral" else \
        {"layers.0.mlp.down_proj"}
    assert six == ({"layers.0.self_attn.v_proj"} if family == "mixtral" else set()) | downs
    assert isinstance(model.lm_head.approx, Q6KLinear)
    assert torch.equal(model.lm_head.approx.dequantized_weight(), loaded.model.lm_head.weight.float())
    for name, layer in four.items():
        if name in six:
            assert layer.form == 32 | 512 and layer.step_bytes() * 8 == layer.out_features * layer.in_features * 6.5625
        else:
            assert layer.q4k and layer.form == 32 | 256 and layer.super_scales.shape[1] == layer.in_features // 256
        want = loaded.model.model.get_submodule(name).weight.detach().float()
        if family == "phi3" and name.endswith(("q_proj", "k_proj")):
            assert torch.allclose(layer.dequantized_weight(), want, rtol=0, atol=2e-3 * float(want.abs().max()))
        else:
            assert torch.equal(layer.dequantized_weight(), want), name
    cached = w4a8_verifier(loaded)  # written to the cache as a checkpoint and loaded back
    for name, layer in four.items():
        back = cached.model.get_submodule(name)
        assert type(back) is type(layer) and back.form == layer.form, name
        assert all(torch.equal(t, back.state_dict()[n]) for n, t in layer.state_dict().items()), name
    assert isinstance(cached.lm_head.approx, Q6KLinear)
    fused = record_fused_steps(monkeypatch)
    assert_speculative_matches_ar(LLM(str(path), drafter="ngram", max_context=128), "w4a8", trees=False)
    if ext.decoder_layer_op() is not None and ext.w4a8_linear_op() is not None:
        assert fused and all(fused), "the fused step did not run"


def test_greedy_speculative_equals_autoregressive(files):
    """The 4-bit Qwen3-MoE file decodes with its W4A8 verifier by default; n-gram and tree
    drafts give its greedy tokens, as they do the float model's."""
    _, path = files("qwen3_moe", GGMLQuantizationType.Q4_0)
    assert load_model(str(path)).default_verifier == "w4a8"
    llm = LLM(str(path), drafter="ngram", max_context=128)
    for verifier in ("w4a8", "fp"):
        assert_speculative_matches_ar(llm, verifier)


def test_unsupported_architecture_is_one_line(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(QuasarError) as e:
        load_model(str(path))
    message = str(e.value)
    assert "\n" not in message and "unsupported architecture 'falcon'" in message
    assert all(arch in message for arch in ("llama", "phi3", "qwen2moe", "qwen3moe", "Mixtral"))
