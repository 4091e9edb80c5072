"""Shared fixtures: tiny randomly initialised models saved as real HF directories.

`tiny_model(arch)` writes a transformers model (safetensors + config.json) plus a
tokenizer: either the default model's real tokenizer and chat template (vocab 49152) or a
16-token character tokenizer for statistical tests that need a small vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

ARCHES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """A private Quasar cache per test session, so W8A8 entries of throw-away tiny models do
    not pile up in the user's cache; the costly shared parts (the converted default model,
    the compiled int8 extension) are linked in from the user's cache and reused."""
    from quasar.paths import cache_root

    user, tmp = cache_root(), tmp_path_factory.mktemp("quasar-cache")
    for sub in ("gguf", "torch_ext"):
        (user / sub).mkdir(parents=True, exist_ok=True)
        (tmp / sub).symlink_to(user / sub, target_is_directory=True)
    old = os.environ.get("QUASAR_CACHE")
    os.environ["QUASAR_CACHE"] = str(tmp)
    yield tmp
    if old is None:
        os.environ.pop("QUASAR_CACHE", None)
    else:
        os.environ["QUASAR_CACHE"] = old


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a float HF directory (in the user's Quasar cache)."""
    from quasar.models.loader import resolve_model_dir

    return resolve_model_dir("default")


def _hf_config(arch: str, vocab: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "llama":
        common.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return LlamaConfig(**common)
    if arch == "mistral":
        common["tie_word_embeddings"] = overrides.get("tie_word_embeddings", True)
        return MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=32, **common)
    raise ValueError(arch)


def write_char_tokenizer(out: Path, chars: str = "abcdefghijklm") -> int:
    """A word-level tokenizer over single characters; ids 0..2 are <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(out / "tokenizer.json"))
    # No EOS: a random model would emit it early and cut every test output short.
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return len(vocab)


def make_tiny_model(out: Path, arch: str = "llama", tokenizer_dir: Path | None = None, seed: int = 0,
                    **overrides) -> Path:
    """Save a tiny random `arch` model to `out`; real tokenizer if `tokenizer_dir` is given."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, out / name)
        vocab = 49152
    else:
        vocab = write_char_tokenizer(out)
        overrides.setdefault("eos_token_id", None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(arch, vocab, **overrides)).eval()
    with torch.no_grad():  # larger weights than the init give peaked, less tie-prone logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    return out


@pytest.fixture
def tiny_model(tmp_path, default_model_dir):
    """Factory: tiny_model(arch, **config overrides) -> directory with the real tokenizer."""
    def make(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        return make_tiny_model(tmp_path / f"{arch}-{seed}", arch, default_model_dir, seed, **overrides)
    return make


@pytest.fixture
def tiny_char_model(tmp_path):
    """Factory: a tiny model with a 16-token character vocabulary."""
    def make(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        return make_tiny_model(tmp_path / f"char-{arch}-{seed}", arch, None, seed, **overrides)
    return make


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama with the default model's tokenizer, one per test module (a module
    that needs another model defines its own `model_dir`)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny", "llama", default_model_dir, 0)


@pytest.fixture(scope="module")
def llm(model_dir):
    """An LLM over `model_dir`: n-gram drafts, the float verifier, one thread."""
    from quasar.api import LLM

    threads = torch.get_num_threads()
    yield LLM(str(model_dir), drafter="ngram", verifier="fp", max_context=512, threads=1)
    torch.set_num_threads(threads)


@contextlib.contextmanager
def tiny_w8a8_llm(out: Path, tokenizer_dir: Path, seed: int, max_batch: int):
    """A W8A8 LLM (2 threads, a small calibration) over a tiny random Qwen3-shaped model with
    `tokenizer_dir`'s tokenizer; torch's thread count is put back afterwards."""
    from quasar.api import LLM
    from quasar.quant.options import QuantOptions

    threads = torch.get_num_threads()
    model_dir = make_tiny_model(out, "qwen3", tokenizer_dir, seed)
    llm = LLM(str(model_dir), verifier="w8a8", max_context=1024, threads=2, max_batch=max_batch,
              quant=QuantOptions(samples=2, seq_len=48))
    llm.prepare()
    try:
        yield llm
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def swapped(obj, name: str, value):
    """`obj.name` set to `value` inside the block, then put back (a test's temporary change)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield old
    finally:
        setattr(obj, name, old)


def run_on_kernel_path(path: str, test_file: str, selection: str, cwd: Path) -> None:
    """Run the tests of `test_file` that `selection` (pytest -k) picks in a fresh process forced
    onto kernel path `path` (QUASAR_ISA), and require them to pass; skipped where this CPU cannot
    run `path` or where `path` is its own (the tests ran on it already)."""
    import subprocess
    import sys

    from quasar.kernels import ext

    if not ext.cpu_runs(path):
        pytest.skip(f"this CPU does not run the {path} kernel path")
    if ext.kernel_path() == path:
        pytest.skip(f"{path} is this CPU's own path: the tests above ran on it")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selection],
                         env={**os.environ, "QUASAR_ISA": path}, capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
