"""Write a tiny Hugging Face model of tests/family_models.py as a GGUF file laid out as
llama.cpp's converter (convert_hf_to_gguf.py) lays it out: its tensor names, Llama's Q/K row
permutation (Mixtral), a layer's experts stacked into one tensor per projection, Phi-3's fused
tensors kept fused and its LongRoPE factors as tensors, the router in float32. The tokenizer is
16 tokens (3 special, 12 characters and one merge, which llama.cpp requires) as a byte-level
BPE. Written independently of
quasar.models.gguf, so a test checks the reader against llama.cpp's conventions, not itself."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "phi3": "phi3"}
CHARS = "abcdefghijkl"  # tests.conftest.write_char_tokenizer's vocabulary size, "m" replaced by "ab"
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
         "mlp.gate_up_proj": "ffn_up", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# A Q4_K file keeps these in Q6_K here, as llama.cpp's Q4_K_M keeps some of them (layer 0's
# value and down projections, the output head).
Q4_K_M_WIDER = re.compile(r"^(blk\.0\.(attn_v|ffn_down(_exps)?)|output)\.weight$")
EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model_dir: Path, cfg: dict) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (numpy shape, as the converter writes it), experts stacked."""
    src = load_file(str(model_dir / "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, w in src.items():
        w = w.astype(np.float32)
        m = EXPERT.fullmatch(name)
        if m:
            experts.setdefault(f"blk.{m[1]}.ffn_{EXPERT_PROJ[m[3]]}_exps.weight", {})[int(m[2])] = w
            continue
        if name in GLOBAL:
            out[GLOBAL[name]] = w
            continue
        layer, part, suffix = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name).groups()
        if cfg["model_type"] == "mixtral" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _permute(w, cfg["num_attention_heads"] if part.endswith("q_proj") else cfg["num_key_value_heads"])
        out[f"blk.{layer}.{LAYER[part]}.{suffix}"] = w
    for name, by_index in experts.items():
        out[name] = np.stack([by_index[e] for e in range(len(by_index))])
    return out


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """`w` (rows of whole 256-weight superblocks) as Q4_K blocks of 144 bytes: float16 d and
    dmin, 6-bit scale and min codes of each 32 packed into 12 bytes, nibbles (the `gguf`
    package has no Q4_K quantizer). A plain min-max fit, not llama.cpp's search: the reader
    only needs valid blocks, whose dequantized values are what a test compares."""
    sub = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # w = d * sc * q - dmin * mn, mn >= 0
    scale = (sub.max(axis=2) - lo) / 15
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, mf, out=np.zeros_like(lo), where=mf > 0)), 0, 63).astype(np.uint8)
    step, low = df * sc, mf * mn
    q = np.clip(np.round(np.divide(sub + low[..., None], step[..., None], out=np.zeros_like(sub),
                                   where=step[..., None] > 0)), 0, 15).astype(np.uint8)
    packed = np.zeros((sub.shape[0], 12), dtype=np.uint8)  # gguf.quants.Q4_K.get_scale_min, inverted
    packed[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = mn[:, :4] | (mn[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4
    pairs = q.reshape(-1, 4, 2, 32)  # a 64-weight chunk: sub-block 2c in low nibbles, 2c + 1 in high
    nibbles = (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(-1, 128)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, nibbles], axis=1)
    return blocks.reshape(*w.shape[:-1], w.shape[-1] // 256 * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """`w` (rows of whole 256-weight superblocks) as Q6_K blocks of 210 bytes: low nibbles,
    high bit pairs, 16 int8 scales, float16 d (quasar.models.gguf_groups.q6k_blocks inverted;
    a plain fit, not llama.cpp's search)."""
    sub = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31
    d = (scale.max(axis=1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 128)  # two halves of 128 weights
    low = (q[:, :, :64] & 15) | (q[:, :, 64:] & 15) << 4
    high = q.reshape(-1, 2, 4, 32) >> 4
    high = high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6
    blocks = np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)],
                            axis=1)
    return blocks.reshape(*w.shape[:-1], w.shape[-1] // 256 * 210)


def _quantized(name: str, w: np.ndarray, qtype) -> tuple[np.ndarray, GGMLQuantizationType]:
    """`w` in `qtype` where llama.cpp would quantize it (a matrix of whole blocks; not a router or norm)."""
    if qtype == GGMLQuantizationType.Q4_K and Q4_K_M_WIDER.search(name) and w.shape[-1] % 256 == 0:
        return quantize_q6_k(w), GGMLQuantizationType.Q6_K
    block = 256 if qtype == GGMLQuantizationType.Q4_K else 32
    if qtype is None or w.ndim < 2 or "ffn_gate_inp" in name or w.shape[-1] % block:
        return w, GGMLQuantizationType.F32
    return (quantize_q4_k(w) if qtype == GGMLQuantizationType.Q4_K else quantize(w, qtype)), qtype


def _rope_keys(w: GGUFWriter, cfg: dict, tensors: dict) -> None:
    """Phi-3's RoPE metadata and LongRoPE factor tensors, as convert_hf_to_gguf's Phi3MiniModel writes them."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    w.add_rope_dimension_count(int(cfg.get("partial_rotary_factor", 1.0) * hidden) // heads)
    original = cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)


def _metadata(w: GGUFWriter, cfg: dict, tensors: dict) -> None:
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg["model_type"] == "mixtral":
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    if cfg["model_type"] == "phi3":
        _rope_keys(w, cfg, tensors)


def _tokenizer(w: GGUFWriter) -> None:
    tokens = ["<unk>", "<s>", "</s>", *CHARS, "ab"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL] * 3 + [TokenType.NORMAL] * (len(CHARS) + 1))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_family_gguf(model_dir: Path, out: Path, qtype=None) -> Path:
    """`model_dir` (tests.family_models.make_family_model) as GGUF file `out`; its matrices in
    `qtype` (e.g. GGMLQuantizationType.Q4_0) where their rows are whole blocks, else float32."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = gguf_tensors(model_dir, cfg)
    w = GGUFWriter(str(out), ARCH[cfg["model_type"]])
    _metadata(w, cfg, tensors)
    _tokenizer(w)
    for name, arr in tensors.items():
        data, kind = _quantized(name, arr, qtype)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
