"""scripts/tools/random_model_gguf.py: a random model written as GGUF holds the same weights under
llama.cpp's names (read back by Quasar's own GGUF reader), the same config, norms in float32,
and llama.cpp itself loads and quantizes it when llama-cpp-python is installed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from quasar.data.packages import default_model_path
from quasar.models.hf import read_safetensors, weight_files

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


mrm = _load("make_random_model")
rmg = _load("random_model_gguf")


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> Path:
    """A tiny Qwen3-shaped random model with the default model's tokenizer (49,152 tokens)."""
    cfg = dict(mrm.CONFIGS["qwen3-8b"], num_hidden_layers=2, hidden_size=64, intermediate_size=96,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152)
    return mrm.write_random_model(tmp_path_factory.mktemp("rand") / "m", cfg, "bf16", seed=1,
                                  tokenizer=default_model_path(), max_shard_bytes=2_000_000)


def _stored(model_dir: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(weight_files(model_dir))


def test_gguf_round_trips_through_quasars_reader(tmp_path, random_model):
    from gguf import GGMLQuantizationType, GGUFReader

    from quasar.models.gguf import gguf_to_hf_dir

    path = tmp_path / "m.gguf"
    rmg.write_gguf(random_model, path, default_model_path())
    types = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    assert types["blk.1.ffn_down.weight"] == GGMLQuantizationType.BF16
    assert types["blk.0.attn_k_norm.weight"] == types["output_norm.weight"] == GGMLQuantizationType.F32
    assert "output.weight" in types  # qwen3-8b's lm_head is untied

    converted = gguf_to_hf_dir(path)
    src, back = _stored(random_model), _stored(converted)
    assert set(src) == set(back)
    for name, t in src.items():
        assert torch.equal(back[name].float(), t.float()), name
    a, b = (json.loads((d / "config.json").read_text()) for d in (random_model, converted))
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "tie_word_embeddings"):
        assert a[key] == b[key], key


def test_llamacpp_loads_and_quantizes_it(tmp_path, random_model):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (scripts/setup/install_llamacpp.sh)")
    import llama_cpp

    from quasar.bench.peers import llamacpp_quantize

    bf16, q8 = tmp_path / "m.gguf", tmp_path / "m.Q8_0.gguf"
    rmg.write_gguf(random_model, bf16, default_model_path())
    llamacpp_quantize(bf16, q8, "Q8_0", threads=1)
    assert q8.stat().st_size < bf16.stat().st_size
    llm = llama_cpp.Llama(str(q8), n_ctx=64, n_threads=1, verbose=False)
    assert llm.n_vocab() == 49152
    out = llm.create_completion("Hello", max_tokens=4, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1


def test_moe_experts_stack_and_llamacpp_runs_them(tmp_path):
    """A Qwen3-MoE random model: each layer's experts stacked into llama.cpp's ffn_*_exps
    tensors in expert order, the router in float32, and llama.cpp loads and decodes the file."""
    from gguf import GGMLQuantizationType, GGUFReader

    cfg = dict(mrm.CONFIGS["olmoe-1b-7b"], num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=4, head_dim=16, vocab_size=49152, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32)
    model = mrm.write_random_model(tmp_path / "moe", cfg, "bf16", seed=2, tokenizer=default_model_path())
    path = tmp_path / "moe.gguf"
    rmg.write_gguf(model, path, default_model_path())
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["qwen3moe.expert_count"].contents() == 4
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == GGMLQuantizationType.F32
    src = _stored(model)
    down = tensors["blk.1.ffn_down_exps.weight"]
    assert [int(d) for d in reversed(down.shape)] == [4, 64, 32]
    stacked = torch.from_numpy(down.data.copy().view("<u2").astype("int32")).to(torch.int16).view(torch.bfloat16)
    for e in range(4):
        assert torch.equal(stacked.reshape(4, 64, 32)[e], src[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]), e
    router = torch.from_numpy(tensors["blk.1.ffn_gate_inp.weight"].data.copy()).reshape(4, 64)
    assert torch.equal(router, src["model.layers.1.mlp.gate.weight"].float())

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (scripts/setup/install_llamacpp.sh)")
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)
    out = llm.create_completion("Hello", max_tokens=4, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1


def test_only_qwen_architectures(tmp_path, random_model):
    bad = tmp_path / "llama"
    bad.mkdir()
    cfg = json.loads((random_model / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    with pytest.raises(ValueError, match="only qwen2, qwen3"):
        rmg.write_gguf(bad, tmp_path / "x.gguf", default_model_path())


def test_a_gguf_kept_wider_than_4_bits_by_layout(tmp_path, random_model):
    """The W4A8 verifier of a GGUF whose layer tensors are all wider than 4 bits (BF16): in the
    small layout every decoder linear becomes 4-bit groups fitted to the stored weights
    (``fit_weight_w4_affine``) and the head is a RefinedHead; the faithful layout never refits
    the file's tensors: it is a float model to calibrate and GPTQ-round, whose value and down
    projections that llama.cpp's Q4_K_M keeps in 6 bits stay int8."""
    from quasar.models.loader import load_model
    from quasar.runtime.w8a8 import Int8Linear
    from quasar.runtime.refined_head import RefinedHead
    from quasar.runtime.w4a8 import W4A8Linear
    from quasar.quant.w4a8_layouts import SMALL, keeps_wider
    from quasar.runtime.w4a8_numerics import dequantize_w4, fit_weight_w4_affine
    from quasar.engine.w4a8_verifier import LAYER_LINEARS, groups_source, w4a8_verifier

    path = tmp_path / "m.gguf"
    rmg.write_gguf(random_model, path, default_model_path())
    loaded = load_model(str(path))
    assert groups_source(loaded, SMALL) == path and groups_source(loaded) is None
    model = w4a8_verifier(loaded, cache=False, layout=SMALL)
    assert isinstance(model.lm_head, RefinedHead) and model.quant_kind == "w4a8"
    for i, layer in enumerate(model.model.layers):
        for name in LAYER_LINEARS:
            got = layer.get_submodule(name)
            assert isinstance(got, W4A8Linear), (i, name)
            q, s, o = fit_weight_w4_affine(loaded.model.model.layers[i].get_submodule(name).weight, 32)
            assert torch.equal(got.dequantized_weight(), dequantize_w4(q, s, 32, o)), (i, name)
    faithful = w4a8_verifier(loaded, cache=False)
    for i, layer in enumerate(faithful.model.layers):
        for name in LAYER_LINEARS:
            wide = keeps_wider(name, i, len(faithful.model.layers))
            assert isinstance(layer.get_submodule(name), Int8Linear if wide else W4A8Linear), (i, name)
