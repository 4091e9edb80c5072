"""Sequential (layer-by-layer) quantization: the checkpoint streams to disk shard by shard,
matches the in-memory build, is as faithful as calibrating the whole float model at once,
stays within a memory bound of about one layer plus the int8 model, and never leaves a
half-written checkpoint behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from quasar.errors import QuasarError
from quasar.models.hf import load_hf_dir
from quasar.models.loader import load_model
from quasar.quant import sequential
from quasar.runtime.w8a8 import Int8Linear
from quasar.quant.options import QuantOptions
from quasar.quant.quantize import build_w8a8, quantize_to_dir

CALIB = ("The committee met on Tuesday to review the annual budget and the new transit plan.\n"
         "def mean(xs):\n    return sum(xs) / len(xs)\n") * 20
FAST = dict(calib_text=CALIB, samples=2, seq_len=48, progress=False)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, default_model_dir):
    # qkv bias and tied embeddings: the parts the sequential pipeline has to untie and carry
    return load_model(make_tiny_model(tmp_path_factory.mktemp("seq") / "qwen2", "qwen2", default_model_dir,
                                      tie_word_embeddings=True))


def _logits(model, ids):
    model.setup_cache(128)
    return model(torch.tensor([ids]))[0]


def test_checkpoint_is_sharded_and_equals_the_in_memory_build(qwen2, tmp_path):
    out = tmp_path / "ckpt"
    config = quantize_to_dir(qwen2.model_dir, qwen2.tokenizer, out, **FAST)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == qwen2.model.config.num_layers + 2 and all((out / s).is_file() for s in shards)
    assert index["weight_map"]["model.layers.1.mlp.down_proj.weight"] != index["weight_map"]["lm_head.weight"]
    assert (out / "tokenizer.json").is_file() and not list(out.parent.glob(".ckpt.tmp-*"))
    assert config["quantization_config"]["quasar"]["pipeline"] == "sequential"
    assert config["tie_word_embeddings"] is False  # rotation and the int8 lm_head untie it
    from_disk = load_hf_dir(out)
    in_memory = build_w8a8(qwen2.model, qwen2.tokenizer, **FAST)
    ids = qwen2.tokenizer.encode("The budget review was held on Tuesday.")
    assert torch.equal(_logits(from_disk, ids), _logits(in_memory, ids))
    assert isinstance(from_disk.lm_head, Int8Linear) and from_disk.model.layers[0].self_attn.q_proj.bias is not None


def test_source_model_is_untouched_and_float_head_stays_tied(qwen2):
    before = {k: v.clone() for k, v in qwen2.model.state_dict().items()}
    q = build_w8a8(qwen2.model, qwen2.tokenizer, lm_head="float", rotate=False, **FAST)
    assert all(torch.equal(before[k], v) for k, v in qwen2.model.state_dict().items())
    assert q.config.tie_word_embeddings and q.lm_head.weight is q.model.embed_tokens.weight


def test_later_layers_calibrate_on_quantized_inputs(qwen2, monkeypatch):
    """propagate="quantized" feeds layer i + 1 the quantized layer i's outputs; "float" the
    float layer's: the same first layer, different statistics after it."""
    seen: dict[str, list] = {"quantized": [], "float": []}
    run = sequential._Windows.run

    def spy(self, layer, collector=None):
        out = run(self, layer, collector)
        if collector is not None:
            seen[mode].append([x.clone() for x in self.hidden])
        return out

    monkeypatch.setattr(sequential._Windows, "run", spy)
    for mode in seen:
        build_w8a8(qwen2.model, qwen2.tokenizer, propagate=mode, **FAST)
    (q0, q1), (f0, f1) = seen["quantized"], seen["float"]
    assert all(torch.equal(a, b) for a, b in zip(q0, f0))  # layer 0 sees the embeddings either way
    assert not all(torch.equal(a, b) for a, b in zip(q1, f1))
    with pytest.raises(QuasarError, match="propagate"):
        build_w8a8(qwen2.model, qwen2.tokenizer, propagate="sideways", **FAST)


@pytest.mark.slow
def test_sequential_is_as_faithful_as_the_whole_model_reference(monkeypatch):
    """On the default model with the default calibration: calibrating each layer on the
    quantized prefix's outputs keeps top-1 agreement and KL against the float model at least
    as good as the whole-model calibration (float inputs everywhere), on 6,000 held-out
    tokens neither calibrated on (measured 97.0% / 0.00312 against 96.7% / 0.00316; with a
    quarter of the calibration tokens the quantized inputs lost 0.8 points of top-1).
    Scored with a float32 KV cache: the comparison is of the weights' quantization, and the
    bf16 cache's rounding moves both KLs by a few percent either way (seq 0.00314, whole
    0.00301 with it). The CPU moves them too: with MKL's and Quasar's AVX2 kernels
    (QUASAR_ISA=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2) seq 96.63% / 0.003233 against whole
    96.75% / 0.003137, 3% apart the other way; the margins cover both."""
    from quasar.data.calibration import calibration_texts
    from quasar.eval.fidelity import compare_logits, model_logits
    from quasar.runtime import fused_step

    monkeypatch.setenv(fused_step.ENV_KV_DTYPE, "fp32")

    loaded = load_model("default")
    held_out = "\n".join(calibration_texts(part="heldout").values())
    ids = loaded.tokenizer.encode(held_out)[:6000]
    models = {mode: build_w8a8(loaded.model, loaded.tokenizer, propagate=mode, progress=False)
              for mode in ("quantized", "float")}
    with ExitStack() as stack:  # one pass of the float model scores both
        open_ = {mode: stack.enter_context(model_logits(q, 512)) for mode, q in models.items()}
        scores = compare_logits(stack.enter_context(model_logits(loaded.model, 512)), open_, ids, window=512)
    seq, ref = scores["quantized"], scores["float"]
    assert seq["top1_agreement"] >= ref["top1_agreement"] - 0.002, scores
    assert seq["kl_mean"] <= ref["kl_mean"] * 1.05, scores


def test_interrupted_quantization_leaves_nothing(qwen2, tmp_path, monkeypatch):
    calls = []
    real = sequential.float_layer

    def fail_on_second_layer(source, cfg, index):
        calls.append(index)
        if index == 1:
            raise KeyboardInterrupt
        return real(source, cfg, index)

    monkeypatch.setattr(sequential, "float_layer", fail_on_second_layer)
    with pytest.raises(KeyboardInterrupt):
        quantize_to_dir(qwen2.model_dir, qwen2.tokenizer, tmp_path / "ckpt", **FAST)
    assert calls == [0, 1] and list(tmp_path.iterdir()) == []


def test_truncated_source_shard_is_a_clear_error(tmp_path, default_model_dir):
    from quasar.models.tokenizer import Tokenizer

    src = make_tiny_model(tmp_path / "src", "llama", default_model_dir)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(QuasarError, match="corrupt or truncated"):
        quantize_to_dir(src, Tokenizer(src), tmp_path / "ckpt", **FAST)
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt.tmp-*"))


def test_truncated_checkpoint_shard_is_rebuilt_by_the_verifier_cache(qwen2, tmp_path, monkeypatch):
    from quasar.engine.w8a8_verifier import w8a8_verifier

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    opts = QuantOptions(samples=2, seq_len=48)
    ids = qwen2.tokenizer.encode("The budget review was held on Tuesday.")
    ref = _logits(w8a8_verifier(qwen2, opts, progress=False), ids)
    entry = next((tmp_path / "cache" / "w8a8").iterdir())
    shard = sorted(entry.glob("model-*.safetensors"))[3]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(QuasarError, match="corrupt or truncated"):
        load_hf_dir(entry)
    again = w8a8_verifier(qwen2, opts, progress=False)  # warns, rebuilds the entry, decodes the same
    assert torch.equal(_logits(again, ids), ref)


_MEASURE = textwrap.dedent("""
    import json, sys
    import torch
    from quasar.models.loader import resolve_model_dir
    from quasar.models.tokenizer import Tokenizer
    from quasar.quant.quantize import quantize_to_dir
    from quasar.resources import peak_rss_gb  # this process's own peak (VmHWM), as quantize reports it

    torch.set_num_threads(1)
    src, out = sys.argv[1], sys.argv[2]
    tok = Tokenizer(resolve_model_dir(src))
    before = peak_rss_gb()
    quantize_to_dir(src, tok, out, calib_text="abcdefghijklm" * 200, samples=2, seq_len=64, progress=False)
    print(json.dumps({"before_gb": before, "peak_gb": peak_rss_gb()}))
""")


def _quantize_peak_growth(src: Path, out: Path) -> int:
    """Bytes by which `quasar quantize`'s peak RSS exceeds the process's before it starts.

    glibc's malloc serves a freed size from its heap from then on (its mmap threshold rises
    to the largest block freed, up to 32 MiB), and a fragmented heap keeps pages that Python
    has freed: with these small models' 1-4 MiB tensors that crept 1-2.5 MB a layer, by
    timing (23-62 MB from 8 to 32 layers, unrelated to what quantizing holds). Real models'
    weights are larger than 32 MiB, so each is mapped and unmapped alone; a fixed threshold
    treats these tensors the same way."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out / "model.safetensors.index.json").is_file()
    return round((rss["peak_gb"] - rss["before_gb"]) * 1e9)


def test_quantizing_peak_does_not_grow_with_depth(tmp_path):
    """Layers of 17 MB (float32): 8 of them or 32 (a 537 MB float model), the peak is the
    same (0.1 MB apart here), within 20 MB. Holding the float model, or even the int8 one,
    would add 400 or 100 MB; the fixed part (torch's and the BLAS's buffers, one layer's
    calibration and GPTQ) is the same for both."""
    hidden, inter = 512, 2048
    layer_bytes = 4 * (4 * hidden * hidden + 3 * hidden * inter)
    grown = {}
    for layers in (8, 32):
        src = make_tiny_model(tmp_path / f"src{layers}", "llama", None, hidden_size=hidden, intermediate_size=inter,
                              num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4)
        grown[layers] = _quantize_peak_growth(src, tmp_path / f"ckpt{layers}")
    assert grown[32] - grown[8] < 0.05 * 24 * layer_bytes, (grown, layer_bytes)


def test_a_vocabulary_sized_head_is_never_held_thrice(tmp_path):
    """Rotation and GPTQ of a large untied lm_head (and of the embeddings) hold one float32
    copy of it and blocks, not the two or three copies that made the 8B shapes peak at 8.9 GB:
    an initialized nn.Linear beside the read weight, the rotated copy beside the widened one,
    and GPTQ's concatenated copy beside the rotated one."""
    hidden, vocab = 512, 262144
    src = make_tiny_model(tmp_path / "src", "llama", None, hidden_size=hidden, intermediate_size=512,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)
    head_bytes = 4 * vocab * hidden  # 537 MB in float32, as stored
    grown = _quantize_peak_growth(src, tmp_path / "ckpt")
    # the widened (memory-mapped) source rows and the rotated copy: 2x; before, 3x and more
    assert grown < 2.5 * head_bytes, (grown / 1e6, head_bytes / 1e6)
