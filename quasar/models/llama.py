"""One lean decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3).

Module names follow Hugging Face (`model.layers.N.self_attn.q_proj`, ...) so safetensors
load as they are and exports keep the names other tools expect. The W8A8 verifier is this
same tree with its `nn.Linear`s swapped for int8 ones.

The KV cache is static and pre-allocated, with one slot per sequence. `cache.lengths[s]`
is how many positions of slot s are committed. Two ways to run the model:
- `model(input_ids, slot=s)`: a chain at the slot's length that advances it (prefill);
- `model.step(rows)`: a verifier step over `Rows` (chain drafts, token trees, several
  slots at once) that writes the rows' K/V past the committed lengths and leaves them;
  `cache.commit(slot, kept)` then keeps the accepted path. Rejecting drafts is just not
  committing them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quasar.defaults import DEFAULT_ROW_COST
from quasar.errors import QuasarError
from quasar.models.config import ModelConfig
from quasar.models.mlp import MLP
from quasar.models.moe import SparseMoE
from quasar.models.rows import Rows

# Steps of up to this many tokens (decode and verifier steps, not long prefills) compute
# attention one query at a time; see Attention.forward.
ROW_INVARIANT_MAX_T = 16


@dataclass(frozen=True)
class Prefill:
    """A long chain in one slot, attended with a causal mask in one call (prefill only:
    faster, but not row-invariant)."""

    slot: int
    start: int
    mask: Tensor  # [T, start + T] bool: query i sees keys 0..start + i


class KVCache(nn.Module):
    """k, v [layers, slots, kv heads, max_seq_len, head_dim]; `lengths[s]` positions of slot s
    are committed. Positions past a slot's length are scratch (a step's rows, rejected drafts)."""

    def __init__(self, n_layers: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype, device=None,
                 n_slots: int = 1):
        super().__init__()
        shape = (n_layers, n_slots, n_kv_heads, max_seq_len, head_dim)
        # Uninitialised: only written positions are ever read, and untouched pages (slots
        # and lengths not in use) cost no memory.
        self.register_buffer("k", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.max_seq_len = max_seq_len
        self.n_slots = n_slots
        self.lengths = [0] * n_slots

    @property
    def length(self) -> int:
        """Committed length of slot 0 (batch-1 code)."""
        return self.lengths[0]

    @length.setter
    def length(self, value: int) -> None:
        self.lengths[0] = value

    def update(self, layer: int, slot: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [1, kvh, T, d] at [start, start+T) of `slot`; return its keys/values up to
        there, in k's dtype (a bf16 cache stores them rounded)."""
        end = start + k.shape[2]
        self.k[layer, slot:slot + 1, :, start:end] = k
        self.v[layer, slot:slot + 1, :, start:end] = v
        return self.k[layer, slot:slot + 1, :, :end].to(k.dtype), self.v[layer, slot:slot + 1, :, :end].to(k.dtype)

    def write_rows(self, layer: int, rows: Rows, k: Tensor, v: Tensor) -> None:
        """Store each row's k, v [R, kvh, d] at its (slot, cache_index)."""
        slots = torch.tensor(rows.slots, device=k.device)
        index = torch.tensor(rows.cache_index, device=k.device)
        self.k[layer, slots, :, index] = k.to(self.k.dtype)
        self.v[layer, slots, :, index] = v.to(self.v.dtype)

    def row_keys(self, layer: int, rows: Rows, r: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Row r's logical keys and values [1, kvh, n, d] in `dtype`: its slot's committed
        cache, then its path."""
        slot, start, path = rows.slots[r], rows.starts[rows.slots[r]], rows.paths[r]
        k, v = self.k[layer, slot:slot + 1], self.v[layer, slot:slot + 1]
        end = start + len(path)
        if path[-1] == end - 1:  # a chain: the path directly follows the committed cache
            return k[:, :, :end].to(dtype), v[:, :, :end].to(dtype)
        index = torch.tensor(path, device=k.device)
        return (torch.cat([k[:, :, :start], k[:, :, index]], dim=2).to(dtype),
                torch.cat([v[:, :, :start], v[:, :, index]], dim=2).to(dtype))

    def commit(self, slot: int, kept: list[int], rows: Rows) -> None:
        """Keep the rows `kept` of the last step (root first, then the accepted path) as the
        slot's next positions: move their K/V to consecutive positions, advance the length."""
        start = rows.starts[slot]
        for i, r in enumerate(kept):
            if rows.slots[r] != slot or rows.depth[r] != i:
                raise ValueError(f"row {r} is not at depth {i} of slot {slot}'s accepted path")
            src, dst = rows.cache_index[r], start + i
            if src != dst:  # src >= dst and later sources lie further on: moving in order is safe
                self.k[:, slot, :, dst] = self.k[:, slot, :, src]
                self.v[:, slot, :, dst] = self.v[:, slot, :, src]
        self.lengths[slot] = start + len(kept)


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


def rope_inv_freq(cfg: ModelConfig, context: int | None = None) -> Tensor:
    """RoPE's inverse frequencies [head_dim / 2]. With partial rotary, the rotated dimensions'
    frequencies then zeros (cos 1, sin 0: the loader moves the passed-through dimensions
    there, quasar.models.layouts). `context`: the positions the cache holds (LongRoPE's
    factors depend on it; default the model's maximum)."""
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "longrope":
        # Phi-3: the long factors once the context exceeds the pretraining length, else the short
        # ones (what transformers uses for a sequence of that length; its attention factor is
        # folded into the q and k weights at load)
        long = (context or cfg.max_position_embeddings) > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        inv_freq = 1.0 / (factors * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    elif kind == "linear":
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
    inv_freq = F.pad(inv_freq, (0, cfg.head_dim // 2 - inv_freq.shape[0]))
    if cfg.rope_local_theta is not None:  # Gemma 3: [full-attention table, sliding-window table]
        local = 1.0 / (cfg.rope_local_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        inv_freq = torch.stack([inv_freq, local])
    return inv_freq


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """RoPE's cos and sin [T, head_dim] at `positions` ([tables, T, head_dim] for stacked
    `inv_freq` [tables, head_dim / 2]: one per attention kind, see `Attention.rope_table`)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.unsqueeze(-2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


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
        # Gemma 3 (quasar.models.gemma3) sets these: the softmax scale (None: 1/sqrt(head_dim)),
        # a sliding window (each query sees its last `window` keys), and which RoPE table of
        # stacked cos/sin this layer takes.
        self.scale: float | None = None
        self.window: int | None = None
        self.rope_table = 0

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, at: Rows | Prefill) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cos.dim() == 3:  # one table per attention kind
            cos, sin = cos[self.rope_table], sin[self.rope_table]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        gqa = self.n_heads != self.n_kv_heads
        if isinstance(at, Rows):
            # A verifier step: each row attends alone to its logical keys, exactly the
            # one-token decode computation of its path, so a token's result never depends on
            # the other rows of the step (W8A8 would turn float-rounding differences into int8
            # rounding flips).
            cache.write_rows(layer, at, k[0].transpose(0, 1), v[0].transpose(0, 1))
            y = torch.cat([F.scaled_dot_product_attention(q[:, :, r:r + 1], *self._window(
                *cache.row_keys(layer, at, r, q.dtype)), enable_gqa=gqa, scale=self.scale) for r in range(t)], dim=2)
        else:
            k, v = cache.update(layer, at.slot, at.start, k, v)
            mask = at.mask if self.window is None else window_mask(at.mask, at.start, self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def _window(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """A row's logical keys and values [1, kvh, n, d], the last `window` of them when it slides."""
        return (k, v) if self.window is None else (k[:, :, -self.window:], v[:, :, -self.window:])


def window_mask(mask: Tensor, start: int, window: int) -> Tensor:
    """A causal prefill mask [T, start + T] (queries at start..start + T - 1) that also hides
    keys `window` or more positions behind their query."""
    queries = torch.arange(start, start + mask.shape[0], device=mask.device)
    keys = torch.arange(mask.shape[1], device=mask.device)
    return mask & (keys[None, :] > queries[:, None] - window)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, at: Rows | Prefill) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, at)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """The `model.` prefix of Hugging Face names: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    body_class = Body  # a family with other layers (quasar.models.gemma3) brings its own

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.body_class(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.cache: KVCache | None = None
        # dtype of the KV cache; None: the model's float dtype. W8A8 models on an AVX512-BF16
        # CPU keep it in bfloat16 (quasar.runtime.fused_step.install).
        self.kv_dtype: torch.dtype | None = None
        # Optional fast path for verifier steps: a callable (x, cos, sin, cache, rows) -> the
        # hidden states after all layers, or None to run the modules. Installed by
        # quasar.runtime.fused_step on W8A8 models.
        self.step_kernel = None
        # Optional fast argmax / top-k of logits rows: (logits [R, V] float32, k) ->
        # (argmax [R], top-k ids [R, k]) with torch.argmax's choice; see row_argmax_topk.
        self.select_kernel = None
        # Extra time of one more row in a verifier step, as a fraction of a one-row step, and
        # the rows a step takes before one more costs a further pass over the weights (None:
        # no such step): what tree drafts are sized by (the fused W8A8 step sets its own).
        self.row_cost = DEFAULT_ROW_COST
        self.pass_rows: int | None = None
        # Once measured, what rows 2, 3, ... each add to a step (the same fraction; the last
        # holds past its end): steps that hide a few rows under the weight stream price them
        # apart from the dearer ones after (None: row_cost each).
        self.row_prices: tuple[float, ...] | None = None
        # The measured step times behind them, once measured on this CPU (quasar.runtime.step_cost),
        # and what re-reads the prices from the decoder's own steps (quasar.runtime.learned_prices).
        self.step_costs = None
        self.learned_prices = None
        # A one-row step's extra time per cached key, as a fraction of its time without
        # context (the fused step: the K/V bytes of a key over the weight bytes; 0: unknown).
        self.key_cost = 0.0

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def setup_cache(self, max_seq_len: int | None = None, n_slots: int = 1) -> KVCache:
        """(Re)allocate the static KV cache with `n_slots` sequences; every length starts at 0."""
        cfg = self.config
        max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        dtype = self.kv_dtype or self.model.norm.weight.dtype
        if (self.cache is None or self.cache.max_seq_len != max_seq_len or self.cache.n_slots != n_slots
                or self.cache.k.dtype != dtype):
            self.cache = KVCache(len(self.model.layers), cfg.num_kv_heads, max_seq_len, cfg.head_dim,
                                 dtype, self.model.norm.weight.device, n_slots)
        self.cache.lengths = [0] * n_slots
        if (cfg.rope_scaling or {}).get("rope_type") == "longrope":  # its factors follow the context
            self.inv_freq = rope_inv_freq(cfg, max_seq_len).to(self.inv_freq.device)
        return self.cache

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def _logits(self, x: Tensor, which: str) -> Tensor | None:
        if which == "none":
            return None
        if which == "last":
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float()

    def _run_rows(self, rows: Rows, modules: bool = True, prefill: bool = False) -> Tensor | None:
        """Hidden states [1, R, H] after all layers for a step's rows (K/V written, lengths
        kept). `modules=False`: only through the step kernel, None when it does not apply.
        `prefill`: the rows are a prompt chunk, which the step kernel may compute with
        other (not row-invariant) kernels: a prompt is always prefilled in the same chunks."""
        cache = self.cache or self.setup_cache()
        rows.check_fits(cache.max_seq_len)
        dev = self.model.norm.weight.device
        x = self.model.embed_tokens(torch.tensor([rows.tokens], device=dev))
        cos, sin = self._rope(torch.tensor(rows.positions, device=dev), x.dtype)
        y = None
        if self.step_kernel is not None:
            y = self.step_kernel(x, cos, sin, cache, rows, prefill=True) if prefill else \
                self.step_kernel(x, cos, sin, cache, rows)
        if y is not None or not modules:
            return y
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, rows)
        return x

    def row_argmax_topk(self, logits: Tensor, k: int = 0) -> tuple[list[int], list[list[int]] | None]:
        """Per row of `logits` [R, V]: the greedy token (torch.argmax's choice: ties and NaN
        alike) and, for k > 0, the ids of the k largest logits, best first (None for k = 0).
        One pass of the select kernel when installed (torch's argmax and topk over a tree or
        batched step's rows against a large vocabulary are a visible share of a step), else
        torch."""
        if self.select_kernel is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" \
                and k <= min(64, logits.shape[-1]):
            best, top = self.select_kernel(logits, k)
            return best.tolist(), (top.tolist() if k else None)
        return logits.argmax(dim=-1).tolist(), (logits.topk(k, dim=-1).indices.tolist() if k else None)

    @torch.inference_mode()
    def step(self, rows: Rows, logits: str = "all") -> Tensor | None:
        """A verifier step over `rows` (see quasar.models.rows): float32 logits [R, vocab].

        Each row's K/V are written past its slot's committed length; the lengths do not
        change until `cache.commit` keeps the accepted rows.
        """
        out = self._logits(self._run_rows(rows), logits)
        return None if out is None else out[0]

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, logits: str = "all", slot: int = 0) -> Tensor | None:
        """Run `input_ids` [1, T] as a chain at the end of `slot` and commit it.

        Covers prefill and one-token decoding alike. Returns float32 logits [1, T, vocab]
        (`logits="all"`), [1, 1, vocab] for the last position (`"last"`), or None (`"none"`:
        a prefill that only fills the cache skips lm_head). Chains of up to
        ROW_INVARIANT_MAX_T tokens are run as a step (row-invariant); longer ones by the step
        kernel when it takes them (W8A8: up to fused_step.MAX_ROWS), else as one causal prefill.
        """
        cache = self.cache or self.setup_cache()
        t = input_ids.shape[1]
        start = cache.lengths[slot]
        if start + t > cache.max_seq_len:
            raise QuasarError(f"context is full: {start + t} tokens exceed the {cache.max_seq_len}-token context")
        x = None
        if t <= ROW_INVARIANT_MAX_T:
            x = self._run_rows(Rows.chain(input_ids[0].tolist(), slot, cache.lengths))
        elif t <= getattr(self.step_kernel, "max_rows", 0):
            # A prefill chunk the fused step takes, as one chain: one call per layer instead of
            # the modules' causal prefill's many ATen ops, so faster.
            x = self._run_rows(Rows.chain(input_ids[0].tolist(), slot, cache.lengths), modules=False, prefill=True)
        if x is None:
            x = self.model.embed_tokens(input_ids)
            positions = torch.arange(start, start + t, device=x.device)
            cos, sin = self._rope(positions, x.dtype)
            key_pos = torch.arange(start + t, device=x.device)  # query i sees keys 0..start + i
            at = Prefill(slot, start, key_pos[None, :] <= positions[:, None])
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, cache, i, at)
        cache.lengths[slot] = start + t
        return self._logits(x, logits)
