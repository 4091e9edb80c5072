"""SmoothQuant-style channel smoothing, folded offline and exact in float.

A *group* is a producer whose output feeds one or more linear consumers. For a per-channel
scale ``s`` on that shared tensor, dividing the producer's output channel ``j`` by ``s_j``
and multiplying the consumers' input column ``j`` by ``s_j`` leaves the float function
unchanged, while moving quantization difficulty from activations (outlier channels) to
weights: ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``.

The groups of the Llama family are data (``LAYER_GROUPS``/``FINAL_GROUPS``):
- ``norm``: an RMSNorm weight feeds the consumers (``input_layernorm -> q,k,v``,
  ``post_attention_layernorm -> gate,up``, ``model.norm -> lm_head``);
- ``linear``: a linear layer's output feeds the consumer elementwise-linearly
  (``up -> down``: the MLP output is linear in ``up``); its rows and bias are divided;
- ``heads``: ``v -> o`` through attention, which mixes tokens but not channels. With GQA
  one kv head's value channel ``d`` reaches the ``o`` input column ``(h, d)`` of every
  query head ``h`` sharing that kv head, so one scale per v channel, shared by all of
  those o columns (statistics are reduced over them).
Qwen3's q/k RMSNorm sits on the q/k *outputs*; input-side smoothing is unaffected.

``alpha="auto"`` searches, per group, the alpha (or no smoothing at all) that minimises
the relative output error of the fake-quantized consumers (int8 per-token activations,
int8 per-channel weights, exactly the kernels' rounding) on calibration activation rows.

Rotation (``rotations``, ``rotate_layer``, ``rotate_rows``) is the other exact fold used
before smoothing: an orthogonal rotation of the residual stream (norm weights folded into
their readers) and of the value heads, which spreads outlier channels over all channels
(on SmolLM2-135M it lowers the KL against the float model markedly). The sequential
quantizer applies both one decoder layer at a time; it never holds a whole float model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.quant.calibrate import CalibrationStats
from quasar.runtime.w8a8_numerics import quantize_activation, quantize_weight


@dataclass(frozen=True)
class Group:
    name: str
    producer: str  # relative to the layer ("model.layers.N.") for LAYER_GROUPS, absolute otherwise
    consumers: tuple[str, ...]
    kind: str  # "norm" | "linear" | "heads"
    switch: str | None = None  # None: always; "o_down": --smooth-o-down; "lm_head": int8 lm_head only


LAYER_GROUPS: tuple[Group, ...] = (
    Group("attn_in", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "norm"),
    Group("mlp_in", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "norm"),
    Group("attn_out", "self_attn.v_proj", ("self_attn.o_proj",), "heads", "o_down"),
    Group("mlp_out", "mlp.up_proj", ("mlp.down_proj",), "linear", "o_down"),
)
# A mixture-of-experts layer (quasar.models.moe) smooths its attention groups only. Its
# experts' groups are listed for GPTQ (which linears share an input, "{e}" is the expert)
# but never smoothed: the norm before the block also feeds the float router and every expert,
# each on its own tokens, so no one scale folded into it suits them all; and an expert's
# up -> down scale would be searched on the few, uneven rows the calibration routes to it.
MOE_ATTN_GROUPS: tuple[Group, ...] = tuple(g for g in LAYER_GROUPS if g.producer.startswith(("input_", "self_attn")))
EXPERT_GROUPS: tuple[Group, ...] = (
    Group("expert_in", "post_attention_layernorm", ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"), "norm",
          "expert"),
    Group("expert_out", "mlp.experts.{e}.up_proj", ("mlp.experts.{e}.down_proj",), "linear", "expert"),
)
SHARED_EXPERT_GROUPS: tuple[Group, ...] = (
    Group("shared_in", "post_attention_layernorm", ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
          "norm", "expert"),
    Group("shared_out", "mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",), "linear", "expert"),
)
# Gemma 3 norms each sub-block's output as well (quasar.models.gemma3): its MLP reads
# pre_feedforward_layernorm, and its post_attention_layernorm feeds the residual, no linear.
# Its norms scale by 1 + w: the fold keeps that offset (``fold``).
GEMMA3_LAYER_GROUPS: tuple[Group, ...] = (
    LAYER_GROUPS[0],
    Group("mlp_in", "pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "norm"),
    *LAYER_GROUPS[2:],
)
FINAL_GROUPS: tuple[Group, ...] = (
    Group("head_in", "model.norm", ("lm_head",), "norm", "lm_head"),
)

AUTO_GRID: tuple[float | None, ...] = (None, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
_EPS = 1e-5
_WIDE = 8192  # consumers with more output rows than this (lm_head) are searched on a subset
_SEARCH_ROWS_LARGE = 128  # activation rows replayed for them
_ROW_CHUNK = 8192  # rows widened (rotated, scanned) at a time: a vocabulary-sized matrix never is whole


@dataclass
class BoundGroup:
    """A group resolved against one model: absolute names and the modules themselves."""

    key: str  # e.g. "layers.3.attn_in"
    group: Group
    producer_name: str
    producer: nn.Module
    consumer_names: tuple[str, ...]
    consumers: tuple[nn.Linear, ...]
    rep: int = 1  # query heads per kv head ("heads" groups)
    head_dim: int = 0

    @property
    def sample_name(self) -> str:
        return self.consumer_names[0]


def _enabled(smooth_o_down: bool, lm_head: bool) -> set:
    return {None, *(["o_down"] if smooth_o_down else []), *(["lm_head"] if lm_head else [])}


def _bind(key: str, g: Group, modules: dict[str, nn.Module], prefix: str, cfg) -> BoundGroup:
    names = tuple(prefix + c for c in g.consumers)
    missing = [n for n in (prefix + g.producer, *names) if n not in modules]
    if missing:
        raise QuasarError(f"smoothing: model has no module {missing[0]!r}")
    consumers = tuple(modules[n] for n in names)
    if not all(isinstance(c, nn.Linear) for c in consumers):
        raise QuasarError(f"smoothing {key}: consumers must be float nn.Linear (already quantized?)")
    return BoundGroup(key, g, prefix + g.producer, modules[prefix + g.producer], names, consumers,
                      rep=cfg.num_heads // cfg.num_kv_heads, head_dim=cfg.head_dim)


def _layer_templates(layer: nn.Module, cfg, index: int) -> list[Group]:
    """The groups of decoder layer ``index``, a mixture-of-experts layer's expanded per expert."""
    if cfg.sandwich_norms:
        return list(GEMMA3_LAYER_GROUPS)
    if not cfg.is_moe_layer(index):
        return list(LAYER_GROUPS)
    out = list(MOE_ATTN_GROUPS)
    for e in range(cfg.num_experts):
        out += [Group(f"{g.name}{e}", g.producer.format(e=e), tuple(c.format(e=e) for c in g.consumers), g.kind,
                      g.switch) for g in EXPERT_GROUPS]
    return out + (list(SHARED_EXPERT_GROUPS) if cfg.shared_expert_intermediate_size else [])


def layer_groups(layer: nn.Module, cfg, index: int, smooth_o_down: bool = True,
                 experts: bool = False) -> list[BoundGroup]:
    """The groups of decoder layer ``index`` (names as in the whole model: ``model.layers.N.``);
    ``experts``: with a mixture-of-experts layer's expert groups (for input_owners, never smoothed)."""
    prefix = f"model.layers.{index}."
    modules = {prefix + n: m for n, m in layer.named_modules() if n}
    enabled = _enabled(smooth_o_down, False) | ({"expert"} if experts else set())
    return [_bind(f"layers.{index}.{g.name}", g, modules, prefix, cfg)
            for g in _layer_templates(layer, cfg, index) if g.switch in enabled]


def head_groups(norm: nn.Module, lm_head: nn.Module, cfg) -> list[BoundGroup]:
    """``model.norm -> lm_head`` (only smoothed when lm_head is int8)."""
    modules = {"model.norm": norm, "lm_head": lm_head}
    return [_bind(g.name, g, modules, "", cfg) for g in FINAL_GROUPS]


def sample_names(groups: Sequence[BoundGroup]) -> list[str]:
    """Linear layers whose input rows the alpha search needs."""
    return [g.sample_name for g in groups]


def input_owners(groups: Sequence[BoundGroup]) -> dict[str, str]:
    """Every consumer of ``groups`` -> the first linear reading the same input (q for q, k, v);
    pass all groups (``smooth_o_down`` on) to cover every linear."""
    return {c: bg.sample_name for bg in groups for c in bg.consumer_names}


def _consumer_wmax(bg: BoundGroup) -> Tensor:
    """max |W[:, j]| over all consumers, per input column (float32)."""
    return torch.stack([_column_absmax(c.weight.detach()) for c in bg.consumers]).amax(dim=0)


def _column_absmax(w: Tensor) -> Tensor:
    """max |w[:, j]| per column in float32, a chunk of rows at a time (no copy of an lm_head)."""
    return torch.stack([w[i:i + _ROW_CHUNK].float().abs().amax(dim=0)
                        for i in range(0, w.shape[0], _ROW_CHUNK)]).amax(dim=0)


def _per_kv(t: Tensor, bg: BoundGroup) -> Tensor:
    """o-input statistic [n_heads * d] -> per v channel [n_kv * d], max over sharing heads."""
    return t.view(-1, bg.rep, bg.head_dim).amax(dim=1).reshape(-1)


def _to_consumer(s: Tensor, bg: BoundGroup) -> Tensor:
    """Per v channel [n_kv * d] -> per o input column [n_heads * d] (kv head g feeds g*rep..)."""
    return s.view(-1, 1, bg.head_dim).expand(-1, bg.rep, -1).reshape(-1)


def group_scales(bg: BoundGroup, act_max: Tensor, alpha: float | None,
                 wmax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(producer-side scale, consumer-side scale), float32; all ones when alpha is None.

    ``wmax`` (the consumers' per-column max |W|) may be passed in when already computed.
    """
    act = act_max.float().clamp_min(_EPS)
    wmax = (_consumer_wmax(bg) if wmax is None else wmax).clamp_min(_EPS)
    if bg.group.kind == "heads":
        act, wmax = _per_kv(act, bg), _per_kv(wmax, bg)
    if alpha is None:
        s = torch.ones_like(act)
    else:
        if not 0.0 <= alpha <= 1.0:
            raise QuasarError(f"alpha must be in [0, 1], got {alpha}")
        s = act.pow(alpha) / wmax.pow(1.0 - alpha)
        s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    return s, (_to_consumer(s, bg) if bg.group.kind == "heads" else s)


@torch.no_grad()
def fold(bg: BoundGroup, s_prod: Tensor, s_cons: Tensor) -> None:
    """Divide the producer's output channels by s, multiply the consumers' inputs by s."""
    p = bg.producer
    if bg.group.kind == "norm" and getattr(p, "unit_offset", 0.0):  # a norm scaling by offset + w (Gemma's 1 + w)
        off = p.unit_offset
        p.weight.data = ((p.weight.data.float() + off) / s_prod - off).to(p.weight.dtype)
    elif bg.group.kind == "norm":
        p.weight.data = (p.weight.data.float() / s_prod).to(p.weight.dtype)
    else:
        if not isinstance(p, nn.Linear):
            raise QuasarError(f"smoothing {bg.key}: producer must be a float nn.Linear")
        p.weight.data = (p.weight.data.float() / s_prod[:, None]).to(p.weight.dtype)
        if p.bias is not None:
            p.bias.data = (p.bias.data.float() / s_prod).to(p.bias.dtype)
    for c in bg.consumers:
        if c.weight.dtype == torch.float32:  # in place: the same product, without a second lm_head
            c.weight.data.mul_(s_cons[None, :])
        else:
            c.weight.data = (c.weight.data.float() * s_cons[None, :]).to(c.weight.dtype)


def _fake_quant_rows(t: Tensor, weight: bool) -> Tensor:
    q, scale = quantize_weight(t) if weight else quantize_activation(t)
    return q.float() * scale


def quant_error(x: Tensor, s_cons: Tensor, weights: Sequence[Tensor], refs: Sequence[Tensor]) -> float:
    """Sum over consumers of ||Q(x/s) Q(W s)^T - x W^T||^2 / ||x W^T||^2 (float32 weights)."""
    qx = _fake_quant_rows(x / s_cons, weight=False)
    err = 0.0
    for w, ref in zip(weights, refs):
        qw = _fake_quant_rows(w * s_cons[None, :], weight=True)
        err += float((qx @ qw.t() - ref).pow(2).sum() / ref.pow(2).sum().clamp_min(1e-30))
    return err


@torch.no_grad()
def search_alpha(bg: BoundGroup, act_max: Tensor, x: Tensor,
                 grid: Sequence[float | None] = AUTO_GRID) -> tuple[float | None, dict]:
    """The grid value with the lowest quantized output error on rows ``x`` (None = unsmoothed).

    For very wide consumers (lm_head) the error is estimated on an even subset of output
    rows and of ``x``: per-row weight quantization makes rows independent, so a subset
    is an unbiased sample, and it keeps the search cheap.
    """
    x = x.float()
    weights = [c.weight.detach().float() for c in bg.consumers]
    if sum(w.shape[0] for w in weights) > _WIDE:
        x = x[:: -(-x.shape[0] // _SEARCH_ROWS_LARGE)]
        weights = [w[:: -(-w.shape[0] // _WIDE)] for w in weights]
    refs = [x @ w.t() for w in weights]
    wmax = _consumer_wmax(bg)
    errors = {}
    for a in grid:
        _, s_cons = group_scales(bg, act_max, a, wmax)
        errors[a] = quant_error(x, s_cons, weights, refs)
    best = min(errors, key=errors.get)
    return best, errors


def smooth_groups(groups: Sequence[BoundGroup], stats: CalibrationStats, alpha: float | str,
                  grid: Sequence[float | None] = AUTO_GRID,
                  scales_out: dict[str, Tensor] | None = None) -> dict[str, float | None]:
    """Fold smoothing scales into the groups' modules in place; returns the alpha used per group.

    ``alpha`` is a float in [0, 1] for every group, or "auto" for the per-group search
    (needs ``stats.samples`` for each group's first consumer). ``scales_out`` receives
    the consumer-side scale of each smoothed group, keyed by its first consumer (the
    smoothed input is ``x / s``).
    """
    if alpha != "auto" and not isinstance(alpha, (int, float)):
        raise QuasarError(f"alpha must be a number in [0, 1] or 'auto', got {alpha!r}")
    chosen: dict[str, float | None] = {}
    for bg in groups:
        act = stats.act_max.get(bg.sample_name)
        if act is None:
            raise QuasarError(f"smoothing {bg.key}: no calibration statistics for {bg.sample_name}")
        if alpha == "auto":
            x = stats.samples.get(bg.sample_name)
            if x is None:
                raise QuasarError(f"smoothing {bg.key}: no calibration samples for {bg.sample_name}")
            a, _ = search_alpha(bg, act, x, grid)
        else:
            a = float(alpha)
        s_prod, s_cons = group_scales(bg, act, a)
        if a is not None:
            fold(bg, s_prod, s_cons)
            if scales_out is not None:
                scales_out[bg.sample_name] = s_cons
        chosen[bg.key] = a
    return chosen


# --------------------------------------------------------------------------- rotation


def rotation_matrix(n: int, seed: int = 0) -> Tensor:
    """A fixed random orthogonal [n, n] matrix (float64): a randomized Hadamard matrix
    when n is a power of two, else the Q of a Gaussian matrix's QR (signs fixed)."""
    gen = torch.Generator().manual_seed(seed)
    if n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
        return signs[:, None] * h / n ** 0.5
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def _set(p: nn.Parameter | Tensor, value: Tensor) -> None:
    p.data = value.to(p.dtype).contiguous()


def rotate_rows(w: Tensor, q: Tensor, gain: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """(w * gain) @ q in float32, chunk by chunk, in ``dtype`` (default w's): what a reader
    of the rotated stream (a linear after a norm with weight ``gain``, or the embedding
    table) holds. float32 keeps the fold exact to ~1e-6 relative, at half float64's cost.
    A stored bfloat16 table rotated into float32 is widened a chunk at a time, never whole."""
    out = torch.empty(w.shape, dtype=dtype or w.dtype)
    q = q.float()
    g = None if gain is None else gain.detach().float()[None, :]
    for i in range(0, w.shape[0], _ROW_CHUNK):
        chunk = w[i:i + _ROW_CHUNK].float()
        out[i:i + _ROW_CHUNK] = (chunk if g is None else chunk * g) @ q
    return out


def _read(linears, norm, q: Tensor) -> None:
    for lin in linears:
        _set(lin.weight, rotate_rows(lin.weight.detach(), q, norm.weight))
    _set(norm.weight, torch.ones_like(norm.weight))


def _write(lin: nn.Linear, q: Tensor) -> None:
    q = q.float()
    _set(lin.weight, q.t() @ lin.weight.float())
    if lin.bias is not None:
        _set(lin.bias, lin.bias.float() @ q)


@torch.no_grad()
def rotate_layer(layer: nn.Module, cfg, q: Tensor, r: Tensor | None) -> None:
    """Fold the residual rotation ``q`` (and the value-head rotation ``r``) into one float
    decoder layer in place: its norms into q, k, v and gate, up; o and down write rotated."""
    attn, mlp = layer.self_attn, layer.mlp
    # a mixture-of-experts block: its router and every expert read the stream, every expert writes it
    readers, writers = (mlp.readers(), mlp.writers()) if hasattr(mlp, "experts") else \
        ((mlp.gate_proj, mlp.up_proj), (mlp.down_proj,))
    if not all(isinstance(m, nn.Linear) for m in (attn.q_proj, *writers)):
        raise QuasarError("rotation expects a float model (rotate before quantizing)")
    _read((attn.q_proj, attn.k_proj, attn.v_proj), layer.input_layernorm, q)
    _read(readers, layer.post_attention_layernorm, q)
    _write(attn.o_proj, q)
    for w in writers:
        _write(w, q)
    if r is not None:
        d = cfg.head_dim
        wv = attn.v_proj.weight.double().view(cfg.num_kv_heads, d, -1)
        _set(attn.v_proj.weight, torch.einsum("de,gdh->geh", r, wv).reshape(cfg.num_kv_heads * d, -1))
        if attn.v_proj.bias is not None:
            _set(attn.v_proj.bias, (attn.v_proj.bias.double().view(-1, d) @ r).reshape(-1))
        wo = attn.o_proj.weight.double().view(-1, cfg.num_heads, d)
        _set(attn.o_proj.weight, (wo @ r).reshape(-1, cfg.num_heads * d))


def rotation_folds(cfg) -> bool:
    """Whether the residual rotation folds exactly into the model: not where a norm sits on a
    sub-block's output before the residual add (Gemma 3), whose per-channel weight does not
    commute with a rotation of the stream and has no linear after it to absorb one."""
    return not cfg.sandwich_norms


def rotations(cfg, seed: int = 0, heads: bool = True) -> tuple[Tensor, Tensor | None]:
    """(residual rotation [hidden, hidden], value-head rotation [head_dim, head_dim] or None)."""
    if not rotation_folds(cfg):
        raise QuasarError(f"the residual rotation does not fold into a {cfg.model_type} model (norms on its "
                          "sub-blocks' outputs); quantize it without rotation")
    return rotation_matrix(cfg.hidden_size, seed), rotation_matrix(cfg.head_dim, seed + 1) if heads else None
