"""W4A8 checkpoints and the W4A8 cache (quasar.quant.w4a8_checkpoint, w4a8_verifier's cache):
what is written loads back as the same model, bit for bit, and decodes the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from quasar.errors import QuasarError
from quasar.models.loader import load_model
from quasar.kernels import ext
from quasar.runtime.exact_head import DEFAULT_TOP_K, ExactTopHead
from quasar.quant.w4a8_checkpoint import EXACT_HEAD
from quasar.runtime.w4a8 import W4A8Linear

IDS = [1, 504, 3136, 282, 253, 1767, 30, 378, 2143, 314, 4704, 28]


def _logits(model, ids=IDS) -> torch.Tensor:
    model.cache = None
    model.setup_cache(64)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), logits="all")[0].clone()
    model.cache = None
    return out


@pytest.fixture(scope="module")
def built():
    """The default model's W4A8 verifier built in memory, and its loaded float model."""
    from quasar.engine.w4a8_verifier import build_w4a8

    loaded = load_model("default")
    return loaded, build_w4a8(loaded)


@pytest.fixture(scope="module")
def checkpoint(built, tmp_path_factory):
    from quasar.quant.w4a8_checkpoint import save_w4a8_checkpoint

    loaded, model = built
    return save_w4a8_checkpoint(model, tmp_path_factory.mktemp("w4") / "ckpt", loaded.model_dir, {"source": "default"})


def test_checkpoint_loads_back_bit_for_bit(built, checkpoint) -> None:
    _, model = built
    config = json.loads((checkpoint / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "quasar-w4a8" and qc["group_size"] == 32 and qc["lm_head"] == EXACT_HEAD
    assert qc["head_top_k"] == DEFAULT_TOP_K and qc["head_tied"] is True
    assert config["tie_word_embeddings"] is False  # the int8 head is its own tensor
    loaded = load_model(str(checkpoint))
    assert loaded.quantized and loaded.quant_kind == "w4a8"
    back = loaded.model
    assert back.quant_kind == "w4a8" and isinstance(back.lm_head, ExactTopHead)
    for n, t in model.lm_head.approx.state_dict().items():
        assert torch.equal(back.lm_head.approx.state_dict()[n], t), n
    assert back.lm_head.approx.act_bits == 15 and "lm_head.exact.weight" not in back.state_dict()
    # the exact rows are the embedding table, stored once
    assert back.lm_head.exact.weight is back.model.embed_tokens.weight
    assert torch.equal(back.lm_head.exact.weight, model.lm_head.exact.weight)
    layers = {n: m for n, m in back.named_modules() if isinstance(m, W4A8Linear)}
    assert len(layers) == sum(isinstance(m, W4A8Linear) for m in model.modules()) > 0
    one = next(iter(layers))
    for part in ("qweight", "scales", "offsets"):
        want = getattr(model.get_submodule(one), part)
        got = getattr(layers[one], part)
        assert got.dtype == want.dtype and torch.equal(got, want), part
    assert torch.equal(_logits(back), _logits(model))


def test_the_streamed_checkpoint_is_the_in_memory_one(built, checkpoint, tmp_path) -> None:
    """write_w4a8_checkpoint (what `quasar quantize --bits 4` and the cache write, a part at
    a time) holds bitwise the tensors and the config of the model build_w4a8 makes in memory."""
    from quasar.models.hf import read_safetensors, weight_files
    from quasar.engine.w4a8_verifier import write_w4a8_checkpoint

    loaded, _ = built
    streamed = write_w4a8_checkpoint(loaded, tmp_path / "streamed", {"source": "default"})
    assert streamed == json.loads((checkpoint / "config.json").read_text())
    assert len(weight_files(tmp_path / "streamed")) == loaded.config.num_layers + 2  # a shard per part
    got, want = (read_safetensors(weight_files(d)) for d in (tmp_path / "streamed", checkpoint))
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_llm_decodes_a_w4a8_checkpoint_with_its_own_verifier(checkpoint) -> None:
    from quasar import LLM

    llm = LLM(str(checkpoint))
    assert llm.verifier == "w4a8"  # the default follows what the checkpoint is
    ref = LLM("default", verifier="w4a8")
    kw = dict(max_new_tokens=24, raw=True)
    out = llm.generate("def fib(n):", **kw)
    assert out.token_ids == ref.generate("def fib(n):", **kw).token_ids
    # the result names the path its 4-bit kernels ran (never "pytorch" where the op is built)
    assert out.kernel_path == ext.w4a8_kernel_path() and (ext.w4a8_linear_op() is None or out.kernel_path != "pytorch")
    with pytest.raises(QuasarError, match="is a W4A8 checkpoint; decode it with --verifier w4a8"):
        LLM(str(checkpoint), verifier="w8a8").generate("x", max_new_tokens=2)
    with pytest.raises(QuasarError, match="W4A8 checkpoint with no float weights"):
        LLM(str(checkpoint), verifier="fp").generate("x", max_new_tokens=2)


def test_the_cache_is_written_once_and_loaded_after(monkeypatch, tmp_path) -> None:
    from quasar.engine import w4a8_verifier as wv

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    loaded = load_model("default")
    first = wv.w4a8_verifier(loaded)
    entry = wv.cache_path(loaded)
    assert (entry / "config.json").is_file()

    def no_build(*_, **__):
        raise AssertionError("built again instead of loaded from the cache")

    monkeypatch.setattr(wv, "build_w4a8", no_build)
    monkeypatch.setattr(wv, "write_w4a8_checkpoint", no_build)
    again = wv.w4a8_verifier(loaded)
    assert torch.equal(_logits(again), _logits(first))
    # a damaged entry is rebuilt, with a warning, not an error
    (entry / "config.json").write_text("{")
    monkeypatch.undo()
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    rebuilt = wv.w4a8_verifier(loaded)
    assert torch.equal(_logits(rebuilt), _logits(first))


def test_bad_checkpoints_are_clear_errors(checkpoint, tmp_path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    (bad / "quasar-manifest.json").unlink()  # edited by hand: its manifest would (rightly) refuse it first
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["group_size"] = 48
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuasarError, match="group_size 48 is not one of 32, 64, 128"):
        load_model(str(bad)).model
    config["quantization_config"].update(group_size=32, version=99)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuasarError, match="format version 99 is not supported"):
        load_model(str(bad)).model


def test_quantize_bits_4_writes_one_and_refuses_calibration_flags(tmp_path) -> None:
    out = tmp_path / "w4"
    cmd = [sys.executable, "-m", "quasar", "quantize", "--model", "default", "--bits", "4", "--no-progress"]
    bad = subprocess.run([*cmd, "--out", str(out), "--alpha", "0.5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--alpha do not apply to --bits 4" in bad.stderr
    assert "Traceback" not in bad.stderr and not out.exists()
    done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "W4A8, group 32" in done.stderr
    assert load_model(str(out)).quant_kind == "w4a8"
