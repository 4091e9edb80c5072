"""Families whose checkpoints name or pack their tensors otherwise, mapped at load onto the
Llama layout the decoder uses (`self_attn.{q,k,v}_proj`, `mlp.{gate,up,down}_proj`,
`mlp.experts.N.{gate,up,down}_proj`).

- Phi-3 / Phi-4: the fused `qkv_proj` is split by rows into q, k and v, `gate_up_proj` into
  gate (first half) and up. With partial rotary, each q and k head's rows are permuted so the
  rotated pairs sit at (i, i + head_dim / 2) and the passed-through dimensions elsewhere
  (their RoPE frequency is 0, see llama.rope_inv_freq); q . k is unchanged. LongRoPE's
  attention factor, which scales cos and sin, scales the rotated q and k rows instead.
- Mixtral: `block_sparse_moe.gate` is the router `mlp.gate`; expert `w1, w3, w2` are
  `gate_proj, up_proj, down_proj`.

A directory already in the Llama layout (Quasar's own checkpoints of these families) loads
as it is: the mapping applies only where the source names exist. `layout_tensors` maps a
whole state dict; `read_tensor` reads one target tensor from a streaming source.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import torch
from torch import Tensor

from quasar.models.config import ModelConfig
from quasar.models.tensors import TensorSource

Transform = Callable[[Tensor], Tensor]

_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _rotary_rows(cfg: ModelConfig) -> Tensor:
    """Source row of each row of a q/k head in the Llama RoPE layout (partial rotary)."""
    d = cfg.head_dim
    r = int(d * cfg.partial_rotary_factor)
    half, passed = r // 2, (d - r) // 2
    return torch.cat([torch.arange(half), torch.arange(r, r + passed),
                      torch.arange(half, r), torch.arange(r + passed, d)])


def _rope_attention_factor(cfg: ModelConfig) -> float:
    """LongRoPE's cos/sin scale (transformers' default for it when the config gives none)."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or float(scaling.get("max_position_embeddings") or original) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _qk_heads(cfg: ModelConfig, heads: int) -> Transform:
    """Permute (and scale) the rows of a q or k weight/bias of `heads` heads for the Llama RoPE layout."""
    order, scale = _rotary_rows(cfg), _rope_attention_factor(cfg)
    rotated = int(cfg.head_dim * cfg.partial_rotary_factor)
    gain = torch.ones(cfg.head_dim)
    gain[:rotated // 2] = scale
    gain[cfg.head_dim // 2:cfg.head_dim // 2 + rotated // 2] = scale

    def apply(t: Tensor) -> Tensor:
        if rotated == cfg.head_dim and scale == 1.0:
            return t
        per_head = t.reshape(heads, cfg.head_dim, *t.shape[1:])[:, order]
        if scale != 1.0:
            per_head = per_head * gain.view(1, -1, *([1] * (t.dim() - 1))).to(t.dtype)
        return per_head.reshape(t.shape)
    return apply


def _phi3(cfg: ModelConfig, prefix: str, part: str, suffix: str) -> list[tuple[str, Transform]]:
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if part == "self_attn.qkv_proj":
        q_rows, k_rows = _qk_heads(cfg, cfg.num_heads), _qk_heads(cfg, cfg.num_kv_heads)
        return [(f"{prefix}self_attn.q_proj.{suffix}", lambda t: q_rows(t[:q])),
                (f"{prefix}self_attn.k_proj.{suffix}", lambda t: k_rows(t[q:q + kv])),
                (f"{prefix}self_attn.v_proj.{suffix}", lambda t: t[q + kv:])]
    if part == "mlp.gate_up_proj":
        return [(f"{prefix}mlp.gate_proj.{suffix}", lambda t: t[:inter]),
                (f"{prefix}mlp.up_proj.{suffix}", lambda t: t[inter:])]
    return []


def _mixtral(prefix: str, part: str, suffix: str) -> list[tuple[str, Transform]]:
    if part == "block_sparse_moe.gate":
        return [(f"{prefix}mlp.gate.{suffix}", lambda t: t)]
    m = re.fullmatch(r"block_sparse_moe\.experts\.(\d+)\.(w[123])", part)
    if m:
        return [(f"{prefix}mlp.experts.{m[1]}.{_MIXTRAL_EXPERT[m[2]]}.{suffix}", lambda t: t)]
    return []


def split_tensor(cfg: ModelConfig, name: str) -> list[tuple[str, Transform]]:
    """The Llama-layout tensors a checkpoint tensor `name` becomes, each with how to make it
    from the stored tensor; [] when `name` is already in the Llama layout."""
    m = re.fullmatch(r"(model\.layers\.\d+\.)(.+)\.(weight|bias)", name)
    if m is None:
        return []
    if cfg.model_type == "phi3":
        return _phi3(cfg, m[1], m[2], m[3])
    if cfg.model_type == "mixtral":
        return _mixtral(m[1], m[2], m[3])
    return []


def layout_tensors(cfg: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`tensors` (a checkpoint's, by name) in the Llama layout: the same dict when nothing maps."""
    if cfg.model_type not in ("phi3", "mixtral"):
        return tensors
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        parts = split_tensor(cfg, name)
        if not parts:
            out[name] = t
        for target, make in parts:
            out[target] = make(t)
    return out


def _source_name(cfg: ModelConfig, target: str) -> str | None:
    """The checkpoint tensor a Llama-layout `target` is made from (None: no mapping)."""
    if cfg.model_type == "phi3":
        name = re.sub(r"self_attn\.[qkv]_proj\.", "self_attn.qkv_proj.", target)
        return re.sub(r"mlp\.(gate|up)_proj\.", "mlp.gate_up_proj.", name)
    if cfg.model_type == "mixtral":
        for w, ours in _MIXTRAL_EXPERT.items():
            target = re.sub(rf"mlp\.experts\.(\d+)\.{ours}\.", rf"block_sparse_moe.experts.\1.{w}.", target)
        return target.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    return None


def read_tensor(source: TensorSource, cfg: ModelConfig, target: str) -> Tensor:
    """Tensor `target` (Llama layout) of `source`, made from the checkpoint's own layout when
    it is stored that way."""
    if target in source:
        return source.get(target)
    stored = _source_name(cfg, target)
    if stored is None or stored == target or stored not in source:
        return source.get(target)  # a clear error naming what is missing
    for name, make in split_tensor(cfg, stored):
        if name == target:
            return make(source.get(stored)).clone()
    return source.get(target)
