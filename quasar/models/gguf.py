"""Convert a GGUF file once into a float Hugging Face directory in the Quasar cache.

The `gguf` package reads and dequantizes the tensors; transformers builds the tokenizer and
chat template from the file's metadata. The result (config.json, float32 safetensors
sharded one decoder layer per file with their index, tokenizer files, the manifest) is
written to a temporary directory and renamed into place (quasar.fileio.atomic_dir: locked,
its size checked against the free space first), keyed by the file's content, so later loads
skip all of this, wherever the file or the cache is. A damaged entry is converted again. Shards are dequantized and written one at a time, so converting a large
model needs memory for one layer, not for the whole float32 model. Entries written before
sharding (one model.safetensors) hold the same tensors and still load.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, dequantize
from safetensors.torch import save_file

from quasar.cache.entries import entry_path, lookup
from quasar.cache.keys import file_key
from quasar.errors import QuasarError
from quasar.fileio import atomic_dir
from quasar.models.gguf_groups import is_int4_type
from quasar.models.hf_files import check_manifest
from quasar.paths import cache_dir

# GGUF architecture -> Hugging Face model_type
GGUF_ARCHES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms each sub-block's input and output: its `ffn_norm` is the MLP's input norm, and
# Hugging Face's post_attention_layernorm the attention's output norm (`post_attention_norm`).
ARCH_LAYER_NAMES = {"gemma3": {"ffn_norm": "pre_feedforward_layernorm",
                               "post_attention_norm": "post_attention_layernorm",
                               "post_ffw_norm": "post_feedforward_layernorm"}}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
DEQUANT_CHUNK_VALUES = 1 << 22  # values dequantized per call (16 MB of float32)
# Part of the key: raise it when the conversion's output changes, so older entries are not used.
CONVERSION = 2
TOKENIZER_BYTES = 4 << 20  # the least room for the tokenizer files in a conversion's size estimate


def cache_dir_for(path: Path) -> Path:
    """The conversion's cache folder, keyed by the file's content (its size and a sampled hash,
    quasar.cache.keys) and CONVERSION; not by its path, name or modification time."""
    key = json.dumps({"gguf": file_key(path), "conversion": CONVERSION})
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return entry_path(cache_dir("gguf"), path.stem, digest)


def gguf_to_hf_dir(path: Path, weights: bool = False) -> Path:
    """Return the cached float HF directory for `path`, converting on first use. The entry is
    checked against its manifest (the config and tokenizer; the weights too with `weights`);
    a damaged one is converted again, with a one-line warning."""
    target = cache_dir_for(path)
    if lookup(target, lambda d: check_manifest(d, weights), "GGUF conversion") is None:
        reader = _reader(path)
        atomic_dir(target, lambda tmp: _convert(reader, path, tmp), exist_ok=True, need_bytes=_float_bytes(reader))
    return target


def _float_bytes(reader) -> int:
    """About what the conversion writes: every tensor in float32, and the tokenizer."""
    return sum(4 * int(np.prod([int(d) for d in t.shape])) for t in reader.tensors) + TOKENIZER_BYTES


def _reader(path: Path):
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on damaged files
        raise QuasarError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _config(reader, path: Path, has_output: bool) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHES:
        raise QuasarError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(GGUF_ARCHES)}")

    def get(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise QuasarError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}[arch]],
        "model_type": GGUF_ARCHES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
    }
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        value = _field(reader, key)
        if value is not None:
            cfg[hf] = int(value)
    if arch == "gemma3":  # GELU, named by its own key
        del cfg["hidden_act"]
        cfg.update(_gemma3_config(reader, cfg, int(get("attention.sliding_window"))))
    return cfg


def _gemma3_config(reader, cfg: dict, window: int) -> dict:
    """Gemma 3's keys that llama.cpp fixes rather than stores: every sixth layer global, the
    rest sliding over `window`; the sliding layers' RoPE base 10000; the query scale
    1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 62-layer 27B. The global layers'
    RoPE scaling and end-of-turn token are read where the file has them."""
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    out = {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": window,
           "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)],
           "rope_local_base_freq": 10000.0,
           "query_pre_attn_scalar": hidden // heads if layers == 62 else cfg["head_dim"]}
    eot = _field(reader, "tokenizer.ggml.eot_token_id")  # <end_of_turn> ends a chat turn, where the file says so
    if eot is not None and "eos_token_id" in cfg and int(eot) != cfg["eos_token_id"]:
        out["eos_token_id"] = [cfg["eos_token_id"], int(eot)]
    kind, factor = _field(reader, "gemma3.rope.scaling.type"), _field(reader, "gemma3.rope.scaling.factor")
    if kind == "linear" and factor:
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif kind not in (None, "none"):
        raise QuasarError(f"unsupported Gemma 3 RoPE scaling {kind!r} in the GGUF metadata (supported: linear)")
    return out


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves the two rotary halves)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _hf_name(t, path: Path, arch: str | None = None) -> str | None:
    """The Hugging Face name of GGUF tensor `t` of a file of architecture `arch` (None: a
    Llama-family name, right for every arch's linear layers); None for one that is rebuilt
    from the config."""
    parts = t.name.split(".")
    if parts[0] == "blk":
        base = ARCH_LAYER_NAMES.get(arch, {}).get(parts[2]) or LAYER_NAMES.get(parts[2])
        if base is None:
            raise QuasarError(f"{path}: unexpected tensor {t.name}")
        return f"model.layers.{parts[1]}.{base}.{parts[3]}"
    if parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if parts[0] == "rope_freqs":  # llama3 scaling factors; rebuilt from config instead
        return None
    raise QuasarError(f"{path}: unexpected tensor {t.name}")


def _shard_groups(reader, path: Path) -> list[list[tuple[str, object]]]:
    """(HF name, GGUF tensor) pairs grouped into shards: one per decoder layer, one per
    other tensor (embeddings, final norm, lm_head), in file order. A shard is what the
    conversion holds in float32 at once."""
    groups: dict[str, list[tuple[str, object]]] = {}
    arch = _field(reader, "general.architecture")
    for t in reader.tensors:
        name = _hf_name(t, path, arch)
        if name is not None:
            unit = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
            groups.setdefault(unit, []).append((name, t))
    return list(groups.values())


def _dequantized(t, cfg: dict, path: Path) -> torch.Tensor:
    """GGUF tensor `t` as float32 in Hugging Face layout.

    Matrices are dequantized a block of rows at a time into the result: the dequantizer's
    temporaries are a few times the size of what it is given, which for a large embedding
    table would be gigabytes."""
    shape = [int(d) for d in reversed(t.shape)]
    try:
        if len(shape) == 2 and t.data.ndim == 2:
            w = np.empty(shape, dtype=np.float32)
            step = max(1, DEQUANT_CHUNK_VALUES // shape[1])
            for r in range(0, shape[0], step):
                w[r:r + step] = dequantize(t.data[r:r + step], t.tensor_type)
        else:
            w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    except Exception as e:
        raise QuasarError(f"{path}: cannot read tensor {t.name} ({type(e).__name__}: {e})") from None
    parts = t.name.split(".")
    if (cfg["model_type"] in ("llama", "mistral") and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k")
            and parts[3] == "weight"):
        heads = cfg["num_attention_heads"] if parts[2] == "attn_q" else cfg["num_key_value_heads"]
        w = _unpermute(w, heads)
    if cfg["model_type"] == "gemma3_text" and t.name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp stores Gemma's norms as 1 + w; Hugging Face's hold w
    return torch.from_numpy(np.ascontiguousarray(w))


def _write_weights(reader, cfg: dict, path: Path, out: Path) -> None:
    """Sharded float32 safetensors plus their index, dequantizing one shard at a time, so the
    conversion never holds more than one layer (or one embedding matrix) in float."""
    groups = _shard_groups(reader, path)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _dequantized(t, cfg, path) for name, t in group}
        save_file(tensors, str(out / shard), metadata={"format": "pt", "source": str(path)})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import; only a conversion needs it

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise QuasarError(f"{path}: cannot build a tokenizer from the GGUF metadata ({type(e).__name__}: {e})") from None
    tok.save_pretrained(str(out))


def _convert(reader, path: Path, out: Path) -> None:
    names = {t.name for t in reader.tensors}
    cfg = _config(reader, path, has_output="output.weight" in names)
    # recorded so that choosing the default verifier never parses the file's header again
    cfg["quasar_gguf"] = {"int4_tensors": any(is_int4_type(t.tensor_type) for t in reader.tensors)}
    _save_tokenizer(path, out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_weights(reader, cfg, path, out)
