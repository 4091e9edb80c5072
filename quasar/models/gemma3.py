"""Gemma 3's decoder block, on the Llama family's attention, KV cache and verifier steps.

What differs from quasar.models.llama, with Hugging Face's module names kept
(`model.layers.N.pre_feedforward_layernorm`, ...), so safetensors load as they are:
- RMSNorm scales by ``1 + w`` (the stored weight is zero for the identity), in float32;
- each sub-block is normed before and after: ``x + post_norm(attn(input_norm(x)))``, then
  ``x + post_ff_norm(mlp(pre_ff_norm(x)))`` (Hugging Face's ``post_attention_layernorm`` is
  the attention's output norm here, not the MLP's input norm as in Llama);
- q/k RMSNorm, scores scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers (each query sees its last ``sliding_window`` keys) with their own RoPE
  base, interleaved with global layers (``layer_types``); the model passes both RoPE tables
  stacked and each layer takes its own (``Attention.rope_table``);
- GeGLU with tanh GELU; embeddings scaled by sqrt(hidden); an optional final logit softcap.
The KV cache keeps every position for every layer; a sliding layer reads only its window.
The W8A8 and W4A8 verifiers are this tree with its `nn.Linear`s swapped, as for Llama.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.models.config import ModelConfig
from quasar.models.llama import MLP, Attention, KVCache, Prefill, RMSNorm, Transformer
from quasar.models.rows import Rows

# config.json's hidden_activation -> F.gelu's `approximate`
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + w)``, computed in float32 and rounded once (Gemma's own order)."""

    unit_offset = 1.0  # what the weight is added to: smoothing folds (quasar.quant.smooth) keep it

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)


def embedding_scale(table: Tensor) -> Tensor:
    """sqrt(hidden) for an embedding table [vocab, hidden], rounded to float32, then to its dtype."""
    return torch.tensor(table.shape[1] ** 0.5, dtype=torch.float32, device=table.device).to(table.dtype)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(hidden)."""

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * embedding_scale(self.weight)


class GeGLU(MLP):
    """``down(gelu(gate(x)) * up(x))``: the Llama MLP with GELU for SiLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cfg.hidden_act not in GELU_APPROXIMATIONS:
            raise QuasarError(f"unsupported Gemma activation {cfg.hidden_act!r} "
                              f"(supported: {', '.join(GELU_APPROXIMATIONS)})")
        self.approximate = GELU_APPROXIMATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


def is_sliding(cfg: ModelConfig, index: int) -> bool:
    """Whether source layer `index` attends over a sliding window."""
    return bool(cfg.layer_types) and cfg.layer_types[index] == "sliding_attention" and bool(cfg.sliding_window)


def gemma3_attention(cfg: ModelConfig, index: int) -> Attention:
    """Layer `index`'s attention: Gemma's q/k norms, query scale, and window and RoPE table
    when it slides."""
    attn = Attention(cfg)
    attn.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
    attn.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
    attn.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    if is_sliding(cfg, index):
        attn.window, attn.rope_table = cfg.sliding_window, 1
    return attn


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = gemma3_attention(cfg, index)
        self.mlp = GeGLU(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, at: Rows | Prefill) -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, at))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Body(nn.Module):
    """The `model.` prefix of Hugging Face names: scaled embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        ids = cfg.layer_ids or range(cfg.num_layers)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in ids)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3Transformer(Transformer):
    body_class = Gemma3Body

    def _logits(self, x: Tensor, which: str) -> Tensor | None:
        logits = super()._logits(x, which)
        cap = self.config.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
