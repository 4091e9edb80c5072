"""Faults leave nothing behind, and the cache is found by content: real `quasar` processes.

- a `quasar quantize` killed with SIGKILL mid-way leaves a temporary that the rerun removes;
- two processes needing the same W8A8 entry on an empty cache build it once, and agree;
- a cache copied to another path (and a model file moved and renamed) is reused, not rebuilt;
- a full disk (a small tmpfs) is a one-line error with nothing half-written, or, for a W8A8
  entry that does not fit, a one-line warning and decoding from memory.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_tiny_model
from quasar.cache.manifest import verify
from quasar.paths import cache_root

REPO = Path(__file__).resolve().parents[2]
GENERATE = ["generate", "--raw", "--prompt", "abcabcabd", "--max-new-tokens", "8", "--threads", "1",
            "--drafter", "ngram"]
BUILD_LINE = "quantizing the model to W8A8 layer by layer"


def _cache(path: Path) -> Path:
    """An empty Quasar cache that shares the compiled kernels (building them takes minutes)."""
    path.mkdir(parents=True)
    (path / "torch_ext").symlink_to(cache_root().resolve() / "torch_ext", target_is_directory=True)
    return path


def _quasar(args: list[str], cache: Path, **kw):
    env = {**os.environ, "QUASAR_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "quasar", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env, **kw)


def _run(args: list[str], cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    p = _quasar(args, cache)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if re.search(r"\.tmp-|\.lock$", p.name))


@pytest.fixture(scope="module")
def char_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("faults") / "m", "qwen2", seed=7)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A 2-layer random model with the default model's tokenizer, as a GGUF file."""
    import importlib.util

    from quasar.data.packages import default_model_path

    modules = {}
    for name in ("make_random_model", "random_model_gguf"):
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "tools" / f"{name}.py")
        modules[name] = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    mrm, rmg = modules["make_random_model"], modules["random_model_gguf"]
    cfg = dict(mrm.CONFIGS["qwen3-8b"], num_hidden_layers=2, hidden_size=64, intermediate_size=96,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152)
    folder = tmp_path_factory.mktemp("gguf")
    src = mrm.write_random_model(folder / "m", cfg, "bf16", seed=1, tokenizer=default_model_path())
    rmg.write_gguf(src, folder / "tiny.gguf", default_model_path())
    return folder / "tiny.gguf"


@pytest.mark.slow
def test_sigkill_mid_quantize_then_rerun_leaves_no_temporaries(char_model, tmp_path):
    cache, out = _cache(tmp_path / "cache"), tmp_path / "outs" / "ckpt"
    out.parent.mkdir()
    args = ["quantize", "--model", str(char_model), "--out", str(out), "--no-progress", "--samples", "4"]
    p = _quasar(args, cache)
    deadline = time.monotonic() + 240
    while not list(out.parent.glob(".ckpt.tmp-*/model-00001-*")) and p.poll() is None:  # a shard written
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    (temp,) = out.parent.glob(".ckpt.tmp-*")
    assert temp.name.startswith(f".ckpt.tmp-{p.pid}-") and not out.exists()
    rerun = _run(args, cache)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(q.name for q in out.parent.iterdir()) == ["ckpt"] and verify(out, required=True)


@pytest.mark.slow
def test_two_processes_on_an_empty_cache_build_once_and_agree(char_model, tmp_path):
    cache = _cache(tmp_path / "cache")
    procs = [_quasar([GENERATE[0], "--model", str(char_model), *GENERATE[1:]], cache) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert sum(err.count(BUILD_LINE) for _, err in results) == 1, [err for _, err in results]
    assert results[0][0] == results[1][0] and results[0][0].strip()
    (entry,) = (cache / "w8a8").iterdir()
    assert verify(entry, required=True) and _leftovers(cache) == []


@pytest.mark.slow
def test_a_copied_cache_and_a_moved_model_are_reused(tiny_gguf, tmp_path):
    first_cache = _cache(tmp_path / "a")
    first = _run([GENERATE[0], "--model", str(tiny_gguf), *GENERATE[1:]], first_cache)
    assert first.returncode == 0 and BUILD_LINE in first.stderr, first.stderr
    copy = tmp_path / "b"
    shutil.copytree(first_cache, copy, symlinks=True, copy_function=shutil.copy)  # new paths, new times
    moved = tmp_path / "elsewhere" / "renamed.gguf"
    moved.parent.mkdir()
    shutil.copy(tiny_gguf, moved)
    entries = {p: p.stat().st_ino for kind in ("gguf", "w8a8") for p in (copy / kind).iterdir()}
    assert len(entries) == 2 and all(verify(p, required=True) for p in entries)
    again = _run([GENERATE[0], "--model", str(moved), *GENERATE[1:]], copy)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert BUILD_LINE not in again.stderr and "warning" not in again.stderr, again.stderr
    after = {p: p.stat().st_ino for kind in ("gguf", "w8a8") for p in (copy / kind).iterdir()}
    assert after == entries  # the same entries, not rebuilt (a rebuild is a new folder)


@pytest.fixture
def small_disk(tmp_path):
    """Mount a tmpfs of the given size (we run as root in CI); skipped where that is not allowed."""
    mounted = []

    def mount(size: str) -> Path:
        path = tmp_path / f"disk-{len(mounted)}"
        path.mkdir()
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if run.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {run.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_leaves_nothing(small_disk, tiny_gguf, tmp_path):
    cache = small_disk("8m")  # the default model's float conversion needs about 560 MB
    run = _run(["generate", "--prompt", "hi", "--max-new-tokens", "4"], cache)
    assert run.returncode == 2 and _files(cache) == [], run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert re.fullmatch(rf"error: no space left on the device for {re.escape(str(cache))}/gguf/\S+: "
                        r"it needs about \d+ MB, [\d.]+ MB free", line), line
    out = small_disk("2m") / "ckpt"  # the checkpoint is about 19 MB
    run = _run(["quantize", "--model", str(tiny_gguf), "--out", str(out), "--no-progress"], _cache(tmp_path / "c"))
    (line,) = run.stderr.strip().splitlines()
    assert run.returncode == 2 and re.fullmatch(rf"error: no space left on the device for {re.escape(str(out))}: "
                                                r"it needs about [\d.]+ MB, [\d.]+ MB free", line), run.stderr
    assert _files(out.parent) == []


@pytest.mark.slow
def test_a_w8a8_entry_that_does_not_fit_warns_once_and_decodes_from_memory(small_disk, tiny_gguf):
    cache = small_disk("40m")  # the float conversion fits (about 29 MB), its W8A8 copy (about 19 MB) does not
    (cache / "torch_ext").symlink_to(cache_root().resolve() / "torch_ext", target_is_directory=True)
    run = _run([GENERATE[0], "--model", str(tiny_gguf), *GENERATE[1:]], cache)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    warnings = [line for line in run.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "could not cache the W8A8 model (no space left on the device for" in warnings[0]
    assert not (cache / "w8a8").exists() or list((cache / "w8a8").iterdir()) == []
    assert _leftovers(cache) == []
