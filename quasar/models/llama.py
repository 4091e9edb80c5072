"""One lean decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3).

Module names follow Hugging Face (`model.layers.N.self_attn.q_proj`, ...) so safetensors
load as they are and exports keep the names other tools expect. The W8A8 verifier is this
same tree with its `nn.Linear`s swapped for int8 ones.

The KV cache is static and pre-allocated. `cache.length` is how many positions are valid;
a forward over T tokens writes positions [length, length+T) and advances it, so rolling
back rejected draft tokens is just setting `length` back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.models.config import ModelConfig

# Steps of up to this many tokens (decode and verifier steps, not long prefills) compute
# attention one query at a time; see Attention.forward.
ROW_INVARIANT_MAX_T = 16


class KVCache(nn.Module):
    def __init__(self, n_layers: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (n_layers, 1, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_seq_len = max_seq_len
        self.length = 0

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [1, kvh, T, d] at [start, start+T); return all valid keys/values."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
        # band in between interpolated smoothly.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, start: int,
                mask: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = cache.update(layer, start, k, v)
        gqa = self.n_heads != self.n_kv_heads
        if t <= ROW_INVARIANT_MAX_T:
            # A verifier step: give each query exactly the one-token decode computation, so
            # a token's result never depends on how many drafts are verified with it (W8A8
            # would turn float-rounding differences into int8 rounding flips).
            end = start + 1
            y = torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :end + i], v[:, :, :end + i],
                                                          enable_gqa=gqa) for i in range(t)], dim=2)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """The `model.` prefix of Hugging Face names: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.cache: KVCache | None = None
        # Optional fast path for steps of <= ROW_INVARIANT_MAX_T tokens: a callable
        # (x, cos, sin, cache, start) -> hidden states after all layers, or None to run the
        # modules. Installed by quasar.quant.fused_step on W8A8 models.
        self.step_kernel = None

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def setup_cache(self, max_seq_len: int | None = None) -> KVCache:
        """(Re)allocate the static KV cache; its length starts at 0."""
        cfg = self.config
        max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if self.cache is None or self.cache.max_seq_len != max_seq_len:
            dtype = self.model.norm.weight.dtype
            self.cache = KVCache(len(self.model.layers), cfg.num_kv_heads, max_seq_len, cfg.head_dim,
                                 dtype, self.model.norm.weight.device)
        self.cache.length = 0
        return self.cache

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, logits: str = "all") -> Tensor | None:
        """Run `input_ids` [1, T] at positions [cache.length, cache.length + T).

        Covers prefill, one-token decode and a multi-token verifier step alike. Returns
        float32 logits [1, T, vocab] (`logits="all"`), [1, 1, vocab] for the last position
        (`"last"`), or None (`"none"`: a prefill that only fills the cache skips lm_head).
        """
        cache = self.cache or self.setup_cache()
        t = input_ids.shape[1]
        start = cache.length
        if start + t > cache.max_seq_len:
            raise QuasarError(f"context is full: {start + t} tokens exceed the {cache.max_seq_len}-token context")
        x = self.model.embed_tokens(input_ids)
        pos = torch.arange(start, start + t, device=x.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = None
        if t > ROW_INVARIANT_MAX_T:  # query i sees keys 0..start+i
            key_pos = torch.arange(start + t, device=x.device)
            mask = key_pos[None, :] <= (start + torch.arange(t, device=x.device))[:, None]
        step = self.step_kernel if t <= ROW_INVARIANT_MAX_T else None
        y = step(x, cos, sin, cache, start) if step is not None else None
        if y is not None:
            x = y
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, cache, i, start, mask)
        cache.length = start + t
        if logits == "none":
            return None
        if logits == "last":
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float()
