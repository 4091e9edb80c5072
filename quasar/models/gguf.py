"""Convert a GGUF file once into a float Hugging Face directory in the Quasar cache.

The `gguf` package reads and dequantizes the tensors; transformers builds the tokenizer and
chat template from the file's metadata. The result (config.json, float32 safetensors
sharded one decoder layer per file with their index, tokenizer files, the manifest) is
written to a temporary directory and renamed into place (quasar.fileio.atomic_dir: locked,
its size checked against the free space first), keyed by the file's content, so later loads
skip all of this, wherever the file or the cache is. A damaged entry is converted again. Shards are dequantized and written one at a time, so converting a large
model needs memory for one layer, not for the whole float32 model; a mixture-of-experts
layer's stacked experts (one 3-D tensor each for gate, up and down) are split into one
tensor per expert and written a chunk of experts per shard. Entries written before
sharding (one model.safetensors) hold the same tensors and still load.

Families: Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3 / Phi-4 (``phi3``: the fused
``attn_qkv`` and ``ffn_up`` (gate rows then up rows) are written under Hugging Face's fused
names and split at load, quasar.models.layouts; LongRoPE's factors, stored as tensors, go into
the config) and the mixtures of experts Qwen2-MoE (with its shared expert), Qwen3-MoE and
Mixtral (``llama`` with experts). The routers renormalize the chosen experts' weights as
llama.cpp does: Qwen3-MoE and Mixtral yes, Qwen2-MoE no.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QuantType
from gguf import GGUFReader, dequantize
from safetensors.torch import save_file

from quasar.cache.entries import entry_path, lookup
from quasar.cache.keys import file_key
from quasar.errors import QuasarError
from quasar.fileio import atomic_dir
from quasar.models.config import MODEL_TYPES, ModelConfig
from quasar.models.gguf_groups import int4_groups, is_int4_type, q4k_codes, q6k_blocks
from quasar.models.hf_files import check_manifest
from quasar.models.layouts import split_tensor
from quasar.paths import cache_dir

# GGUF architecture -> Hugging Face model_type (a `llama` file with experts is Mixtral)
GGUF_ARCHES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
               "phi3": "phi3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Families whose Q and K rows llama.cpp's converter permutes (``_unpermute`` undoes it)
PERMUTED_QK = ("llama", "mistral", "mixtral")
# Whether the router renormalizes the chosen experts' weights: what llama.cpp's graphs do
NORM_TOPK = {"qwen2_moe": False, "qwen3_moe": True, "mixtral": True}

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
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v rows fused
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A layer's experts stacked in one tensor (numpy shape [experts, out, in]), and llama.cpp's
# older files' one tensor per expert (blk.N.ffn_gate.E.weight)
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
SPLIT_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Gemma 3 norms each sub-block's input and output: its `ffn_norm` is the MLP's input norm, and
# Hugging Face's post_attention_layernorm the attention's output norm (`post_attention_norm`).
# Phi-3's `ffn_up` holds the gate's rows then the up projection's, as Hugging Face's gate_up_proj.
ARCH_LAYER_NAMES = {"gemma3": {"ffn_norm": "pre_feedforward_layernorm",
                               "post_attention_norm": "post_attention_layernorm",
                               "post_ffw_norm": "post_feedforward_layernorm"},
                    "phi3": {"ffn_up": "mlp.gate_up_proj"}}
# Global tensors rebuilt from the config instead: llama3's scaling factors, Phi-3's LongRoPE factors
CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
DEQUANT_CHUNK_VALUES = 1 << 22  # values dequantized per call (16 MB of float32)
EXPERT_SHARD_VALUES = 1 << 26  # the most expert weights a shard holds (256 MB of float32), but one expert
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


def _model_type(reader, path: Path) -> str:
    """The Hugging Face model_type of the file: its architecture's, Mixtral for a `llama`
    file with experts; an unsupported architecture is a one-line error listing the supported."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHES:
        raise QuasarError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(GGUF_ARCHES)} "
                          "(and Mixtral, a llama file with experts)")
    if arch == "llama" and int(_field(reader, "llama.expert_count") or 0) > 0:
        return "mixtral"
    return GGUF_ARCHES[arch]


def _config(reader, path: Path, has_output: bool) -> dict:
    arch = _field(reader, "general.architecture")
    model_type = _model_type(reader, path)

    def get(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise QuasarError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    cfg = {
        "architectures": [MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0 if model_type in NORM_TOPK else None)),
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
    if arch == "phi3":
        cfg.update(_phi3_config(reader, cfg, path))
    if model_type in NORM_TOPK:
        cfg.update(_moe_config(reader, cfg, path))
    return cfg


def _rows_of(reader, pattern: str) -> int | None:
    """Rows (Hugging Face's out features) of the first tensor named blk.N.`pattern`, or None."""
    t = next((t for t in reader.tensors if t.name.split(".")[2:3] == [pattern]), None)
    return None if t is None else int(t.shape[1])


def _moe_config(reader, cfg: dict, path: Path) -> dict:
    """A mixture of experts' keys, as transformers names them for the family. The experts'
    widths are read from their tensors; the layers with a router are the sparse ones."""
    arch, kind = _field(reader, "general.architecture"), cfg["model_type"]
    experts, used = _field(reader, f"{arch}.expert_count"), _field(reader, f"{arch}.expert_used_count")
    width = _rows_of(reader, "ffn_gate_exps") or _rows_of(reader, "ffn_gate")
    if not experts or not used or width is None:
        raise QuasarError(f"{path}: a mixture-of-experts GGUF needs {arch}.expert_count, {arch}.expert_used_count "
                          "and expert tensors")
    sparse = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.split(".")[2:3] == ["ffn_gate_inp"]}
    dense = [i for i in range(cfg["num_hidden_layers"]) if i not in sparse]
    if kind == "mixtral":
        if dense:
            raise QuasarError(f"{path}: Mixtral GGUF layers {dense} have no router; every layer must be sparse")
        return {"num_local_experts": int(experts), "num_experts_per_tok": int(used), "intermediate_size": width}
    out = {"num_experts": int(experts), "num_experts_per_tok": int(used), "moe_intermediate_size": width,
           "norm_topk_prob": NORM_TOPK[kind], "decoder_sparse_step": 1, "mlp_only_layers": dense,
           "intermediate_size": cfg["intermediate_size"] or width}
    shared = _rows_of(reader, "ffn_gate_shexp")
    if shared:
        out["shared_expert_intermediate_size"] = shared
    return out


def _tensor_values(reader, name: str) -> list[float] | None:
    t = next((t for t in reader.tensors if t.name == name), None)
    return None if t is None else [float(v) for v in dequantize(t.data, t.tensor_type).reshape(-1)]


def _phi3_config(reader, cfg: dict, path: Path) -> dict:
    """Phi-3's keys: the rotated share of each head (Phi-4-mini rotates 3/4), the sliding
    window (0: none), and LongRoPE, whose factors the file stores as tensors. Separate q, k and
    v tensors (no fused ``attn_qkv``) are refused: the loader's row split expects the fused one."""
    if any(t.name.split(".")[2:3] == ["attn_q"] for t in reader.tensors):
        raise QuasarError(f"{path}: a Phi-3 GGUF with separate attn_q/attn_k/attn_v tensors is not supported "
                          "(llama.cpp's converter writes the fused attn_qkv)")
    out: dict = {}
    rotated = _field(reader, "phi3.rope.dimension_count")
    if rotated and int(rotated) != cfg["head_dim"]:
        out["partial_rotary_factor"] = int(rotated) / cfg["head_dim"]
    window = _field(reader, "phi3.attention.sliding_window")
    out["sliding_window"] = int(window) if window else None
    long, short = _tensor_values(reader, "rope_factors_long.weight"), _tensor_values(reader, "rope_factors_short.weight")
    attn = _field(reader, "phi3.rope.scaling.attn_factor")
    if long is None or short is None or (set(long + short) == {1.0} and attn in (None, 1.0)):
        return out
    original = int(_field(reader, "phi3.rope.scaling.original_context_length") or cfg["max_position_embeddings"])
    scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
               "original_max_position_embeddings": original}
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    out.update(rope_scaling=scaling, original_max_position_embeddings=original)
    return out


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
    Llama-family name, right for every arch's linear layers but Phi-3's fused MLP); None for
    one that is rebuilt from the config. A stack of experts has one name per expert:
    ``_hf_parts``."""
    parts = t.name.split(".")
    if parts[0] == "blk":
        if len(parts) == 5 and parts[2] in SPLIT_EXPERT_NAMES and parts[3].isdigit():
            return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{SPLIT_EXPERT_NAMES[parts[2]]}.{parts[4]}"
        base = ARCH_LAYER_NAMES.get(arch, {}).get(parts[2]) or LAYER_NAMES.get(parts[2])
        if base is None or len(parts) != 4:
            raise QuasarError(f"{path}: unexpected tensor {t.name}")
        return f"model.layers.{parts[1]}.{base}.{parts[3]}"
    if parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if parts[0] in CONFIG_TENSORS:
        return None
    raise QuasarError(f"{path}: unexpected tensor {t.name}")


def _hf_parts(t, path: Path, arch: str | None = None) -> list[tuple[str, int | None]]:
    """(Hugging Face name, expert index or None) of each tensor GGUF tensor `t` becomes: one
    per expert for a stack of experts (its experts are GGUF's last dimension), else its one
    name (none for a tensor rebuilt from the config)."""
    parts = t.name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in EXPERT_NAMES:
        prefix = f"model.layers.{parts[1]}.mlp.experts"
        return [(f"{prefix}.{e}.{EXPERT_NAMES[parts[2]]}.{parts[3]}", e) for e in range(int(t.shape[-1]))]
    name = _hf_name(t, path, arch)
    return [] if name is None else [(name, None)]


def _shard_groups(reader, path: Path) -> list[list[tuple[str, object, int | None]]]:
    """(HF name, GGUF tensor, expert index or None) triples grouped into shards: one per
    decoder layer, one per other tensor (embeddings, final norm, lm_head), in file order, and
    a stack of experts in shards of at most EXPERT_SHARD_VALUES weights. A shard is what the
    conversion holds in float32 at once."""
    groups: dict[str, list[tuple[str, object, int | None]]] = {}
    arch = _field(reader, "general.architecture")
    for t in reader.tensors:
        per_shard = max(1, EXPERT_SHARD_VALUES // (int(t.shape[0]) * int(t.shape[1]))) if len(t.shape) == 3 else 1
        for name, expert in _hf_parts(t, path, arch):
            if expert is not None:
                unit = f"{t.name}/{expert // per_shard}"
            else:
                unit = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
            groups.setdefault(unit, []).append((name, t, expert))
    return list(groups.values())


def _dequantized(t, cfg: dict, path: Path, expert: int | None = None) -> torch.Tensor:
    """GGUF tensor `t` (its expert `expert` of a stack) as float32 in Hugging Face layout.

    Matrices are dequantized a block of rows at a time into the result: the dequantizer's
    temporaries are a few times the size of what it is given, which for a large embedding
    table would be gigabytes."""
    shape = [int(d) for d in reversed(t.shape)]
    data = t.data
    if expert is not None:
        shape, data = shape[1:], data[expert]
    try:
        if len(shape) == 2 and data.ndim == 2:
            w = np.empty(shape, dtype=np.float32)
            step = max(1, DEQUANT_CHUNK_VALUES // shape[1])
            for r in range(0, shape[0], step):
                w[r:r + step] = dequantize(data[r:r + step], t.tensor_type)
        else:
            w = dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)
    except Exception as e:
        raise QuasarError(f"{path}: cannot read tensor {t.name} ({type(e).__name__}: {e})") from None
    parts = t.name.split(".")
    if (cfg["model_type"] in PERMUTED_QK and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k")
            and parts[3] == "weight"):
        heads = cfg["num_attention_heads"] if parts[2] == "attn_q" else cfg["num_key_value_heads"]
        w = _unpermute(w, heads)
    if cfg["model_type"] == "gemma3_text" and t.name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp stores Gemma's norms as 1 + w; Hugging Face's hold w
    if parts[0] == "blk" and parts[2] == "ffn_gate_inp_shexp":
        w = w.reshape(1, -1)  # the shared expert's one gate logit: [1, hidden], however the file shapes it
    return torch.from_numpy(np.ascontiguousarray(w))


def _write_weights(reader, cfg: dict, path: Path, out: Path) -> None:
    """Sharded float32 safetensors plus their index, dequantizing one shard at a time, so the
    conversion never holds more than one layer (or one embedding matrix, or one chunk of a
    layer's experts) in float."""
    groups = _shard_groups(reader, path)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _dequantized(t, cfg, path, expert) for name, t, expert in group}
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


def int4_group_readers(path: Path, cfg: ModelConfig) -> dict[str, Callable[[], tuple]]:
    """{Llama-layout weight name: a function giving (q uint8 [out, in], scale, offset float32
    [out, in / 32], q4k) torch tensors, q4k a Q4_K matrix's stored parameters (c, o, d, m:
    gguf_groups.q4k_codes) or None} for every 4-bit matrix of GGUF file `path` (quasar.models.
    gguf_groups), each in the rows of the float model the conversion gives (`cfg` its
    ModelConfig): llama.cpp's Q/K permutation undone, a stack of experts one matrix per expert,
    Phi-3's fused q/k/v and gate/up split by rows as the loader splits them (quasar.models.
    layouts). Where the loader also scales rows (LongRoPE's attention factor on Phi-3's q and
    k), the groups' scales and offsets carry the factor, which the W4A8 layer's float16 group
    parameters (a Q4_K matrix's superblock factors) then round: close to the float weight, not
    bit for bit. Each is unpacked only
    when asked for, so a build holds one at a time."""
    return _matrix_readers(path, cfg, is_int4_type, _read_groups)


def q6k_readers(path: Path, cfg: ModelConfig) -> dict[str, Callable[[], tuple]]:
    """The same for every Q6_K matrix: functions giving (q uint8 [out, in] in [0, 63], int8
    scales [out, in / 16], float16 d [out, in / 256]) (gguf_groups.q6k_blocks); a row gain is
    folded into d, rounded to float16."""
    return _matrix_readers(path, cfg, lambda kind: kind == QuantType.Q6_K, _read_q6k)


def _matrix_readers(path: Path, cfg: ModelConfig, accept: Callable,
                    read: Callable) -> dict[str, Callable[[], tuple]]:
    """{Llama-layout name: functools.partial(read, t, cfg, expert, take, gain)} for every
    matrix of `path` whose type `accept`s."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    out: dict[str, Callable[[], tuple]] = {}
    for t in reader.tensors:
        if len(t.shape) < 2 or not accept(t.tensor_type):
            continue
        rows = int(t.shape[1])
        for name, expert in _hf_parts(t, path, arch):
            for target, take, gain in _row_maps(cfg, name, rows):
                out[target] = functools.partial(read, t, cfg, expert, take, gain)
    return out


def _row_maps(cfg: ModelConfig, name: str, rows: int) -> list[tuple[str, torch.Tensor | None, torch.Tensor | None]]:
    """(target, the stored rows it takes, their gains) of each Llama-layout tensor the loader
    makes from stored tensor `name` of `rows` rows (None, None: all rows as they are), found
    by running its row transforms on row numbers and on ones."""
    splits = split_tensor(cfg, name)
    if not splits:
        return [(name, None, None)]
    numbers = torch.arange(1, rows + 1, dtype=torch.float64)[:, None]
    out = []
    for target, make in splits:
        gain = make(torch.ones(rows, 1, dtype=torch.float64))
        take = (make(numbers) / gain).round().long()[:, 0] - 1
        out.append((target, take, None if bool((gain == 1).all()) else gain.float()))
    return out


def _float_rows(t, cfg: ModelConfig, take: torch.Tensor | None, arrays: list) -> list[torch.Tensor]:
    """Arrays of a stored matrix's rows (its blocks' parts) in the rows of the float model:
    llama.cpp's Q/K permutation undone, then the rows a split takes."""
    role = t.name.split(".")[2:3]
    if cfg.model_type in PERMUTED_QK and role in (["attn_q"], ["attn_k"]):
        heads = cfg.num_heads if role == ["attn_q"] else cfg.num_kv_heads
        arrays = [_unpermute(a, heads) for a in arrays]
    arrays = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    if take is not None:
        arrays = [a[take] for a in arrays]
    return [a.contiguous() for a in arrays]


def _matrix(t, expert: int | None) -> tuple[np.ndarray, tuple[int, int]]:
    """A stored matrix's blocks (one expert's of a stack) and its Hugging Face shape [rows, cols]."""
    return (t.data if expert is None else t.data[expert]), tuple(int(d) for d in reversed(t.shape))[-2:]


def _read_q6k(t, cfg: ModelConfig, expert: int | None, take: torch.Tensor | None,
              gain: torch.Tensor | None) -> tuple:
    q, scales, d = _float_rows(t, cfg, take, list(q6k_blocks(*_matrix(t, expert))))
    if gain is not None:
        d = (d.float() * gain).half()
    return q, scales, d


def _read_groups(t, cfg: ModelConfig, expert: int | None, take: torch.Tensor | None,
                 gain: torch.Tensor | None) -> tuple:
    data, shape = _matrix(t, expert)
    arrays = list(int4_groups(data, t.tensor_type, shape))
    q4k = t.tensor_type == QuantType.Q4_K  # its own two-level parameters too
    if q4k:
        arrays += q4k_codes(data, shape)
    q, scale, offset, *codes = _float_rows(t, cfg, take, arrays)
    if gain is not None:  # in the Q4_K form the superblock factors carry it, rounded to float16
        scale, offset = scale * gain, offset * gain
        if q4k:
            codes[2:] = [(f.float() * gain).half() for f in codes[2:]]
    return q, scale, offset, (tuple(codes) if q4k else None)
