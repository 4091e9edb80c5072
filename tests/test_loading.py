"""Loading: GGUF conversion and its cache, the default model against transformers, bad files."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from quasar.errors import QuasarError
from quasar.models import gguf as gguf_mod
from quasar.models.loader import load_model, resolve_model_dir

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Here is a list of fruits: apple, banana,",
]


def test_gguf_converts_once_into_cache(tmp_path, monkeypatch):
    from quasar.data.packages import default_model_path

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    shutil.copy(default_model_path(), gguf)
    first = resolve_model_dir(gguf)
    assert (first / "config.json").is_file() and (first / "model.safetensors.index.json").is_file()
    assert (first / "tokenizer.json").is_file()
    assert not list(first.parent.glob(".tmp-*")), "temporary conversion directory left behind"

    calls = []
    monkeypatch.setattr(gguf_mod, "_convert", lambda *a: calls.append(a))
    assert resolve_model_dir(gguf) == first and calls == []  # second load reads the cache


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_model_dir):
    """Our greedy continuation of the real default model equals transformers' on the same GGUF."""
    from transformers import AutoModelForCausalLM

    from quasar.data.packages import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    model.setup_cache(256)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        model.cache.length = 0
        logits = model(torch.tensor([ids]), logits="last")
        ours = []
        for _ in range(32):
            ours.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[ours[-1]]]))
        assert ours == expected, prompt


def test_missing_path():
    with pytest.raises(QuasarError, match="model not found"):
        load_model("/nonexistent/model")


def test_unsupported_architecture(tiny_char_model):
    d = tiny_char_model("llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuasarError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_model(d)


def test_truncated_safetensors(tiny_char_model):
    d = tiny_char_model("llama")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(QuasarError, match="corrupt or truncated safetensors"):
        load_model(d)


def test_pickle_weights_are_refused(tiny_char_model):
    d = tiny_char_model("llama")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(QuasarError, match="safetensors only"):
        load_model(d)


def test_truncated_gguf(tmp_path, monkeypatch):
    from quasar.data.packages import default_model_path

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(Path(default_model_path()).read_bytes()[:1_000_000])
    with pytest.raises(QuasarError, match="corrupt or truncated GGUF"):
        load_model(bad)
    assert not list((tmp_path / "cache" / "gguf").iterdir()), "half-written cache entry left behind"
