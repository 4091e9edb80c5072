"""Cache entries and checkpoints carry manifests, and nothing silently wrong comes out of them.

A flipped byte in any file of a W8A8 cache entry is found when the entry loads: it is
rebuilt with a one-line warning, and greedy decoding gives the text it gave before. In a
user's checkpoint the same flip is a one-line error naming the file; a checkpoint without a
manifest (older, or another tool's) still loads. ``quasar cache verify`` reports each entry.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quasar.api import LLM
from quasar.cache.manifest import MANIFEST, read_manifest, verify
from quasar.errors import QuasarError
from quasar.models.loader import load_model
from quasar.models.tokenizer import Tokenizer
from quasar.quant.options import QuantOptions
from quasar.quant.quantize import quantize_to_dir

REPO = Path(__file__).resolve().parents[2]
FAST = QuantOptions(samples=2, seq_len=48, alpha=0.5)
PROMPT = "abcabcd" * 3


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _greedy(model_dir: Path) -> list[int]:
    llm = LLM(str(model_dir), quant=FAST, max_context=64, drafter="ngram")
    return llm.generate(PROMPT, raw=True, max_new_tokens=12).token_ids


def _entry(model_dir: Path) -> Path:
    import torch

    from quasar.engine.w8a8_verifier import cache_path

    return cache_path(model_dir, torch.float32, FAST.cache_key(None))


def _flip_and_decode(model: Path, names: list[str], capsys) -> None:
    """Greedy decoding after a flip in each file of `names` (one at a time) gives the text it
    gave before, the entry rebuilt under the same key with one warning that names the file."""
    before = _greedy(model)
    entry = _entry(model)
    capsys.readouterr()
    for name in names:
        _flip(entry / name)
        assert _greedy(model) == before, name
        warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
        assert len(warnings) == 1 and f"rebuilding the W8A8 cache entry {entry}" in warnings[0], (name, warnings)
        assert name in warnings[0]  # the damaged file is named
        assert verify(entry, required=True)  # whole again
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(f".{entry.name}")]  # nothing left aside


def test_a_flipped_byte_in_a_w8a8_shard_is_found_and_rebuilt(tiny_char_model, capsys):
    """The issue's case: a flip inside a weight shard changed the text, with no warning."""
    model = tiny_char_model("qwen2", seed=3)
    _greedy(model)
    _flip_and_decode(model, [sorted(_entry(model).glob("*.safetensors"))[1].name], capsys)


@pytest.mark.slow
def test_a_flipped_byte_in_any_file_of_a_w8a8_entry_is_found_and_rebuilt(tiny_char_model, capsys):
    model = tiny_char_model("qwen2", seed=4)
    _greedy(model)
    files = sorted(read_manifest(_entry(model))["files"]) + [MANIFEST]
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} < set(files) and len(files) >= 8
    _flip_and_decode(model, files, capsys)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from conftest import make_tiny_model

    src = make_tiny_model(tmp_path_factory.mktemp("src") / "m", "llama")
    out = tmp_path_factory.mktemp("ckpt") / "ckpt"
    quantize_to_dir(src, Tokenizer(src), out, calib_text="abcdefghijklm" * 40, options=FAST, progress=False)
    return out


def test_a_flipped_byte_in_a_checkpoint_is_a_one_line_error_naming_the_file(checkpoint, tmp_path):
    names = sorted(read_manifest(checkpoint)["files"])
    assert any(n.endswith(".safetensors") for n in names) and "tokenizer.json" in names
    for name in names:
        broken = tmp_path / f"broken-{name}"
        shutil.copytree(checkpoint, broken)
        _flip(broken / name)
        with pytest.raises(QuasarError) as e:
            load_model(str(broken)).model
        assert str(broken / name) in str(e.value) and "damaged" in str(e.value) and "\n" not in str(e.value)
    # the command line: one line, the file named, no traceback
    run = subprocess.run([sys.executable, "-m", "quasar", "generate", "--model", str(broken), "--raw",
                          "--prompt", "ab", "--max-new-tokens", "2"], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"error: {broken / names[-1]}: damaged (its content does not match its {MANIFEST})"], run.stderr
    # a checkpoint from before manifests (or another tool's export) loads, unchecked
    old = tmp_path / "old"
    shutil.copytree(checkpoint, old)
    (old / MANIFEST).unlink()
    assert load_model(str(old)).model is not None


def test_cache_verify_reports_each_entry_and_fails_on_a_damaged_one(checkpoint, tmp_path):
    cache = tmp_path / "cache"
    good, bad, old = (cache / "w8a8" / n for n in ("good-1", "bad-2", "old-3"))
    for d in (good, bad, old):
        shutil.copytree(checkpoint, d)
    shard = sorted(bad.glob("*.safetensors"))[1]
    _flip(shard)
    (old / MANIFEST).unlink()
    cmd = [sys.executable, "-m", "quasar", "cache", "verify"]
    env = {**__import__("os").environ, "QUASAR_CACHE": str(cache)}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    lines = run.stdout.splitlines()
    assert run.returncode == 1 and len(lines) == 3, run.stdout + run.stderr
    assert lines[0].startswith(f"DAMAGED    {bad}: {shard}: damaged")
    assert lines[1].startswith(f"ok         {good} (") and lines[2].startswith(f"DAMAGED    {old}: ")
    user = subprocess.run(cmd + [str(checkpoint)], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert user.returncode == 0 and user.stdout.startswith(f"ok         {checkpoint} ("), user.stdout
    fixed = subprocess.run(cmd + ["--delete"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert fixed.returncode == 1 and sorted(p.name for p in (cache / "w8a8").iterdir()) == ["good-1"]
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert again.returncode == 0 and again.stdout.startswith(f"ok         {good} ("), again.stdout
