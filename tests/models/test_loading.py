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
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()], "half-written cache entry left behind"


# --------------------------------------------------------------------------- memory-mapped safetensors


def _logits(model, ids):
    model.setup_cache(64)
    model.cache.length = 0
    return model(torch.tensor([ids]), logits="all")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mmap_loading_matches_the_copying_loader(tiny_char_model, arch):
    """The mapped weights give bitwise the logits of weights copied by the reference reader,
    and they view one map of the file instead of owning memory."""
    from safetensors.torch import load_file

    from quasar.models.config import ModelConfig
    from quasar.models.hf import build_model, load_hf_dir, read_config

    d = tiny_char_model(arch)
    mapped = load_hf_dir(d)
    copied = build_model(ModelConfig.from_hf(read_config(d)), load_file(str(d / "model.safetensors")), str(d))
    ids = [3, 5, 7, 4, 9, 11, 3, 5]
    assert torch.equal(_logits(mapped, ids), _logits(copied, ids))
    storages = {p.untyped_storage().data_ptr() for p in mapped.parameters()}
    assert len(storages) == 1, "weights should all view the one mapping of model.safetensors"


def _write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


def test_misaligned_tensor_is_copied(tmp_path):
    """The format allows a tensor at an offset its dtype does not divide; it is copied out."""
    from safetensors.torch import load_file

    from quasar.models.safetensors_mmap import mmap_safetensors

    f = tmp_path / "odd.safetensors"
    values = torch.tensor([1.5, -2.25, 3.0])
    _write_raw_safetensors(f, {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                               "b": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]}},
                           b"\x07" + values.numpy().tobytes())
    got, ref = mmap_safetensors(f), load_file(str(f))
    assert torch.equal(got["b"], values) and torch.equal(got["b"], ref["b"]) and got["a"].tolist() == [7]
    assert got["b"].untyped_storage().data_ptr() != got["a"].untyped_storage().data_ptr()


@pytest.mark.parametrize("damage", ["empty", "huge_header", "not_json", "shape_mismatch", "gap", "trailing"])
def test_damaged_safetensors_headers(tmp_path, damage):
    from quasar.models.safetensors_mmap import mmap_safetensors

    f = tmp_path / "bad.safetensors"
    ok = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    data = bytes(8)
    if damage == "empty":
        f.write_bytes(b"")
    elif damage == "huge_header":
        f.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    elif damage == "not_json":
        f.write_bytes((4).to_bytes(8, "little") + b"{no}")
    elif damage == "shape_mismatch":
        _write_raw_safetensors(f, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, data)
    elif damage == "gap":
        _write_raw_safetensors(f, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    else:
        _write_raw_safetensors(f, ok, data + b"extra")
    with pytest.raises(QuasarError, match="corrupt or truncated safetensors") as e:
        mmap_safetensors(f)
    assert "\n" not in str(e.value)


def _to_bf16(d: Path) -> Path:
    from safetensors.torch import load_file, save_file

    f = d / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return d


def test_bf16_source_stays_bf16_and_dtype_still_converts(tiny_char_model, capsys):
    from quasar.cli import main

    d = _to_bf16(tiny_char_model("qwen2"))
    assert load_model(d).dtype == torch.bfloat16  # "auto": as stored, never upcast whole
    bf16 = load_model(d, "bf16").model
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert len({p.untyped_storage().data_ptr() for p in bf16.parameters()}) == 1  # mapped, not converted
    fp32 = load_model(d, "fp32").model
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    for (name, a), b in zip(bf16.state_dict().items(), fp32.state_dict().values()):
        assert torch.equal(a.float(), b), name
    assert main(["generate", "--model", str(d), "--dtype", "bf16", "--verifier", "fp", "--drafter", "ngram",
                 "--raw", "--prompt", "abcabc", "--max-new-tokens", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4


# --------------------------------------------------------------------------- lazy float model


def _float_linears(model) -> list[str]:
    return [name for name, m in model.model.layers.named_modules() if type(m) is torch.nn.Linear]


def test_the_default_verifier_is_the_files_own_precision(tiny_char_model):
    """A GGUF with 4-bit tensors (the default model, Q4_1) decodes with the faithful W4A8
    verifier unless told otherwise, a float model with W8A8; a conversion made before the
    file's kind was recorded in it reads the file's header instead."""
    from quasar.api import LLM
    from quasar.models import loader

    assert load_model("default").default_verifier == "w4a8"
    assert LLM("default").verifier == "w4a8" and LLM("default", verifier="w8a8").verifier == "w8a8"
    assert load_model(tiny_char_model()).default_verifier == "w8a8"
    assert loader._stores_int4("default", {}) is True  # no record: the header says Q4_1
    assert loader._stores_int4("default", {"quasar_gguf": {"int4_tensors": False}}) is False  # the record rules
    assert loader._stores_int4(tiny_char_model(), {}) is False  # a directory is no GGUF file


def test_llm_loads_float_weights_only_for_float_verifiers(tiny_char_model):
    from quasar.api import LLM

    llm = LLM(str(tiny_char_model("llama")), verifier="fp", max_context=32)
    assert llm.loaded.float_loaded is False and not llm.loaded.quantized
    assert llm.config.num_layers == 2 and llm.max_context == 32
    llm.generate("abc", raw=True, max_new_tokens=2)
    assert llm.loaded.float_loaded is True


def test_w8a8_checkpoint_decodes_without_float_weights(tiny_char_model, tmp_path):
    """Quasar (ngram + w8a8) from a W8A8 checkpoint: no float decoder weight is ever loaded."""
    from quasar.api import LLM
    from quasar.cli import main

    out = tmp_path / "w8a8"
    assert main(["quantize", "--model", str(tiny_char_model("llama")), "--out", str(out), "--samples", "2",
                 "--seq-len", "32", "--no-progress"]) == 0
    llm = LLM(str(out), drafter="ngram", verifier="w8a8", max_context=48)
    assert llm.loaded.quantized
    quasar = llm.generate("abcabcabc", raw=True, max_new_tokens=12)
    plain = llm.generate("abcabcabc", raw=True, max_new_tokens=12, drafter="none")
    assert quasar.token_ids == plain.token_ids
    assert llm.loaded.float_loaded is False
    held = [llm.loaded.model, *(llm.verifier_model(v) for v in llm.resident_verifiers)]
    assert all(not _float_linears(m) for m in held), [_float_linears(m) for m in held]
    for verifier in ("fp", "pruned:0.5"):  # not the int8 model under a float name
        with pytest.raises(QuasarError, match="W8A8 checkpoint with no float weights") as err:
            llm.generate("abc", raw=True, max_new_tokens=2, verifier=verifier)
        assert err.value.param == "verifier"


def test_w8a8_verifier_of_a_float_model_never_loads_float_weights(tiny_char_model):
    """Quasar mode on a float model directory, quantizing once and then from the W8A8 cache."""
    from quasar.api import LLM
    from quasar.quant.options import QuantOptions

    d = str(tiny_char_model("llama"))
    for _ in range(2):
        llm = LLM(d, drafter="ngram", verifier="w8a8", max_context=48, quant=QuantOptions(samples=2, seq_len=32))
        llm.generate("abcabc", raw=True, max_new_tokens=4)
        assert llm.loaded.float_loaded is False
        assert not _float_linears(llm.verifier_model("w8a8"))


# --------------------------------------------------------------------------- streamed GGUF conversion

_MEASURE_CONVERSION = """
import json, sys
import gguf, tokenizers, transformers  # noqa: F401  (their import is not the conversion's cost)
from quasar.models import gguf as gguf_mod
from quasar.models.loader import resolve_model_dir
from quasar.resources import peak_rss_gb

seen = {"start": peak_rss_gb()}
write = gguf_mod._write_weights
def measured(*args):
    seen["before_weights"] = peak_rss_gb()
    write(*args)
gguf_mod._write_weights = measured
seen["dir"] = str(resolve_model_dir(sys.argv[1]))
seen["peak"] = peak_rss_gb()
print(json.dumps(seen))
"""


def test_gguf_converts_once_streamed_into_cache(tmp_path, monkeypatch):
    """Converting the default GGUF in a subprocess: its resident peak grows by far less than
    the float32 model (the old converter held all of it); the shards hold exactly the
    whole-tensor dequantization; later loads read the cache; an entry of the old
    single-file layout loads the same."""
    import os
    import subprocess
    import sys

    import gguf
    from safetensors.torch import save_file

    from quasar.data.packages import default_model_path
    from quasar.models.hf import load_hf_dir, read_safetensors, weight_files

    cache = tmp_path / "cache"
    monkeypatch.setenv("QUASAR_CACHE", str(cache))
    src = tmp_path / "m.gguf"
    shutil.copy(default_model_path(), src)
    run = subprocess.run([sys.executable, "-c", _MEASURE_CONVERSION, str(src)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "QUASAR_CACHE": str(cache)}, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout)
    out = Path(seen["dir"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    fp32_gb = index["metadata"]["total_size"] / 1e9
    shards = sorted(set(index["weight_map"].values()))
    n_layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert len(shards) == n_layers + 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / "model.safetensors").exists() and (out / "tokenizer.json").is_file()
    assert not list(out.parent.glob(".*tmp-*")), "temporary conversion directory left behind"
    assert seen["peak"] - seen["before_weights"] < fp32_gb / 2, (seen, fp32_gb)
    assert seen["peak"] - seen["start"] < fp32_gb, (seen, fp32_gb)

    # the same tensors as dequantizing each one whole (what the converter did before)
    tensors = read_safetensors(weight_files(out))
    reader = gguf.GGUFReader(str(src))
    for t in reader.tensors:
        name = gguf_mod._hf_name(t, src)
        ref = gguf.dequantize(t.data, t.tensor_type).astype("float32").reshape([int(d) for d in reversed(t.shape)])
        if t.name.split(".")[-2] in ("attn_q", "attn_k"):
            cfg = json.loads((out / "config.json").read_text())
            heads = cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"]
            ref = gguf_mod._unpermute(ref, heads)
        assert torch.equal(tensors[name], torch.from_numpy(ref.copy())), name
    assert len(tensors) == len(reader.tensors)

    assert json.loads((out / "config.json").read_text())["quasar_gguf"] == {"int4_tensors": True}  # Q4_1

    calls = []
    monkeypatch.setattr(gguf_mod, "_convert", lambda *a: calls.append(a))
    assert resolve_model_dir(src) == out and calls == []  # a second load reads the cache

    old = tmp_path / "old-layout"
    shutil.copytree(out, old, ignore=shutil.ignore_patterns("model*.safetensors*", "quasar-manifest.json"))  # older
    save_file(tensors, str(old / "model.safetensors"))
    a, b = load_hf_dir(out).state_dict(), load_hf_dir(old).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
