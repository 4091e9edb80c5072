"""Verifier steps of a W8A8 or W4A8 model in one C++ call for all decoder layers.

At small model sizes a verifier step of a few tokens spends more time in ~50 small ATen
ops per layer (norms, RoPE, one attention call per query for row invariance, residuals)
than in reading its int8 weights. ``csrc/decoder_layer/decoder_layer.cpp`` runs each
layer's glue as plain loops between the same GEMMs its linears use (``csrc/decoder_layer/step_linears.h``:
Int8Linear's int8 GEMM, W4A8Linear's 4-bit kernels, bitwise their results);
:class:`FusedW8A8Step` feeds it the layers' own buffers (the module tree is not copied or
forked) and the model calls it for every verifier step (``Transformer.step``, and chains of
up to ``ROW_INVARIANT_MAX_T`` tokens); it takes up to ``MAX_ROWS`` rows of chains or token
trees in one or more cache slots (each row attends to its slot's committed cache, then to
its path; a batch of sequences is one call) and returns None for longer steps, which run
the modules.

A mixture-of-experts layer (quasar.models.moe.SparseMoE, any mix with dense layers) runs in
the same call (``csrc/decoder_layer/sparse_mlp.h``): its float32 router per row, each expert
the step's rows reach once over all of them, a shared expert where the block has one; the op
reports the experts each layer ran, which become the blocks' ``last_experts`` as their forward
sets them (``step_cost.touched_bytes`` reads them). Gemma 3's block (quasar.models.gemma3)
runs in it too: its six norms (passed as 1 + w), GELU-tanh, query scale, and its sliding
layers' RoPE table and window (a row past the window attends to its last `window` keys).

Each row is computed alone in a fixed order, so a token's logits are bitwise the same
whether it is verified alone, with drafts or beside other sequences (greedy speculative ==
greedy autoregressive stays exact, in a batch too). The layer is not bitwise the PyTorch
path (summation order, a polynomial exp): its logits are close, which tests check.
Prefills longer than the step limit take the PyTorch path; both write the same KV cache
layout.

It applies when every decoder linear is an ``Int8Linear`` on the ``cpu`` backend or a
``W4A8Linear`` of whole groups (any mix: the W4A8 verifier keeps the tensors its GGUF file
holds wider as Int8Linear; experts too, their routers float32), the linears sharing an input
(q, k, v; each MLP's gate, up) agree on their activations (the Int8Linears' act_bits, the
W4A8Linears' group size), the model is float32 on the CPU, its cache float32 or bfloat16 (``kv_cache_dtype``: bf16 on an AVX512-BF16 CPU,
attended with bf16 products), and the C++ ops load (every kernel path: AMX, AVX512-VNNI,
AVX-VNNI, AVX2 or plain C++, see ``ext.kernel_path`` and, for 4-bit layers,
``ext.w4a8_kernel_path``; ``QUASAR_NO_EXT=1`` turns it off with the rest of the
extension); otherwise ``__call__`` returns None and the model runs its modules. The per-layer argument lists
are built once and rebuilt when a module's tensors are replaced (loading, ``.to()``) or
an Int8Linear is repacked (call ``Int8Linear.repack()`` after editing weights in place; a
W4A8Linear repacks when its buffers are replaced).
"""

from __future__ import annotations

import operator
import os
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.kernels import ext
from quasar.models.moe import SparseMoE
from quasar.runtime import step_cost
from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w4a8 import W4A8Linear

__all__ = ["FusedW8A8Step", "install"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)  # the attention kernel's specialisations
MAX_ROWS = 128  # rows the op takes in one call (decoder_layer.cpp's kMaxRows)


class FusedW8A8Step:
    """``step(x, cos, sin, cache, rows)`` -> the hidden states after all decoder layers,
    or None when the fused layer does not apply (then run the modules)."""

    max_rows = MAX_ROWS  # the model also sends it prefill chunks up to this length

    def __init__(self, model: nn.Module):
        self.model = model
        self._op: Any = None
        self._bf16 = False  # whether the op attends over a bf16 cache (checked in _build)
        self._plan: _Plan | None = None  # flat per-layer argument lists of the op
        # What to recheck before each step, as columns: (owner dicts, keys, objects)
        self._watch: tuple[tuple, tuple, tuple] = ((), (), ())
        self._builds = 0  # plans built so far: a new one may compute other bits

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, cache, rows, prefill: bool = False) -> Tensor | None:
        # prefill: the rows are a prompt chunk (always computed the same way for a prompt),
        # which may attend with AMX tiles instead of the row-invariant kernel.
        # The op runs up to MAX_ROWS rows: chains or trees, in one or more cache slots.
        if len(rows) > MAX_ROWS:
            return None
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] != 1 or not self._runs_on(cache):
            return None
        cfg, p = self.model.config, self._plan
        if self.model.step_costs is not None:  # this model's measured prefetch choices
            self.model.step_costs.install_prefetch()
        block = p.block
        if block and cos.dim() == 3:  # stacked: the global layers' table, then the sliding layers'
            block = dict(block, cos_local=cos[1], sin_local=sin[1])
            cos, sin = cos[0], sin[0]
        starts = [rows.starts[s] for s in rows.slots]
        y = self._op(x.contiguous(), cos, sin, cache.k, cache.v, rows.slots, starts, rows.parents, p.norms,
                     cfg.rms_norm_eps, *p.linears.lists(), p.routers, p.shared_gates, p.top_k, p.norm_topk,
                     p.experts, p.counts, cfg.num_heads, cfg.num_kv_heads, prefill, **block)
        if p.sparse:
            _report_experts(p)
            if not _experts_unchanged(p):  # an expert it ran was replaced: again with the current ones
                self._plan = None
                return self(x, cos, sin, cache, rows, prefill)
        return y

    def exact_rows_key(self, cache) -> tuple | None:
        """When the op computes every step and prefill chunk over `cache` row by row (then a
        position's K/V depend only on the tokens up to it, whether a prefill chunk, a draft
        row or a one-token step ran it): what its bits depend on besides the tokens (the
        kernel paths, the plan). None when it declines this model or cache, or may prefill
        with AMX tiles (not row by row)."""
        embed = self.model.model.embed_tokens.weight
        if embed.dtype != torch.float32 or embed.device.type != "cpu" or cache is None or not self._runs_on(cache):
            return None
        if cache.k.dtype == torch.bfloat16 and ext.amx_attention_supported():
            return None
        return ext.kernel_path(), ext.w4a8_kernel_path(), self._builds

    def _runs_on(self, cache) -> bool:
        """Whether the op's plan is built (again, if anything it holds was replaced) and it
        attends over `cache`'s dtype."""
        if self._plan is None or not self._unchanged():
            if not self._build():
                return False
        return cache.k.dtype == torch.float32 or (cache.k.dtype == torch.bfloat16 and self._bf16)

    def _unchanged(self) -> bool:
        """Every watched object is still in place: ~1,500 identity checks at 30 layers, run
        with map() so a step spends microseconds on them, not a millisecond. A sparse layer's
        experts are checked after a step, only those it ran (_experts_unchanged)."""
        dicts, keys, objects = self._watch
        return all(map(operator.is_, map(dict.get, dicts, keys), objects))

    def _build(self) -> bool:
        """(Re)build the per-layer argument lists; False when the fused layer cannot run."""
        self._plan, self._watch = None, ((), (), ())
        self._op = ext.decoder_layer_op()
        if self._op is None:
            return False
        self._bf16 = _bf16_attention(self.model)
        if self.model.config.head_dim not in _HEAD_DIMS:
            return False
        layers = self.model.model.layers
        plan = _Plan()
        if self.model.config.sandwich_norms and not _gemma_block(self.model, plan):
            return False
        # Anything swapped later (a module, a tensor, a repack) invalidates the plan.
        watch = [(self.model.model._modules, "layers", layers)]
        for idx, layer in enumerate(layers):
            watch.append((layers._modules, str(idx), layer))
            if not _layer_args(layer, plan, watch):
                return False
        if plan.sparse:
            plan.counts = torch.zeros(len(layers), max(len(b.experts) for _, b in plan.sparse), dtype=torch.int32)
        plan.experts = torch.ops.quasar_quant.w8a8_expert_plan(
            *plan.expert_linears.lists(), [len(b.experts) for _, b in plan.sparse], self.model.config.hidden_size)
        self._plan, self._watch = plan, tuple(zip(*watch))
        self._builds += 1
        return True


class _Linears:
    """The op's lists of linear buffers, one entry per linear (decoder_layer.cpp)."""

    def __init__(self) -> None:
        self.weights: list = []  # Int8Linear: weight, tiles, scale, comp, act_bits; W4A8Linear: None, 8
        self.tiles: list = []
        self.scales: list = []
        self.comps: list = []
        self.act_bits: list[int] = []
        self.biases: list = []
        self.w4: list = []  # W4A8Linear: the weight in the op's layout (ext.pack_w4); Int8Linear: None
        self.w4_groups: list[int] = []  # W4A8Linear: its form (group size, or Q4K_FORM); Int8Linear: 0

    def lists(self) -> tuple:
        """In the op's order."""
        return self.weights, self.tiles, self.scales, self.biases, self.comps, self.act_bits, self.w4, self.w4_groups


class _Plan:
    """The op's per-layer arguments (decoder_layer.cpp): 4 norms and 7 linears a layer (a
    sparse layer's shared expert's gate, up, down, or None); a sparse layer's router, shared
    gate, top-k and renormalization (None, None, 0, 0 for a dense layer); the sparse layers'
    experts, checked once into the op's ExpertPlan (sparse_mlp.h)."""

    def __init__(self) -> None:
        self.norms: list = []
        self.linears = _Linears()
        self.expert_linears = _Linears()  # gate, up, down of each expert, sparse layer after sparse layer
        self.experts: Any = None  # the op's ExpertPlan of expert_linears
        self.routers: list = []
        self.shared_gates: list = []
        self.top_k: list[int] = []
        self.norm_topk: list[int] = []
        self.sparse: list[tuple[int, SparseMoE]] = []  # (layer index, block)
        self.counts: Tensor | None = None  # int32 [layers, experts]: rows per expert of the last step
        # per sparse layer, per expert: (owner dicts, keys, objects) of what to recheck once a
        # step ran the expert (a step reads only the experts it reaches)
        self.expert_watch: list[list[tuple]] = []
        # Gemma 3's block (quasar.models.gemma3), the op's keyword arguments: which layers
        # slide (their RoPE table and window), the attention scale, GELU-tanh; empty otherwise
        self.block: dict = {}


def _gemma_block(model: nn.Module, plan: _Plan) -> bool:
    """Gemma 3's block settings into the plan; False where the op cannot run it (another
    GELU, per-layer scales, more than one window)."""
    layers = model.model.layers
    attns = [layer.self_attn for layer in layers]
    scales = {a.scale for a in attns}
    windows = {a.window for a in attns} - {None}
    if len(scales) != 1 or None in scales or len(windows) > 1 or \
            any(getattr(layer.mlp, "approximate", None) != "tanh" for layer in layers):
        return False
    plan.block = dict(local_layers=[int(a.rope_table == 1) for a in attns], window=windows.pop() if windows else 0,
                      attn_scale=float(scales.pop()), gelu=1)
    return True


def _layer_norms(layer: nn.Module, sandwich: bool) -> list[tuple[dict, str]]:
    """(owner's modules, name) of the norms the op takes, in its order: input, MLP input,
    (q, k); Gemma 3's (`sandwich`) also the attention's and the MLP's output norms."""
    attn, own = layer.self_attn, layer._modules
    if sandwich:
        return [(own, "input_layernorm"), (own, "pre_feedforward_layernorm"), (attn._modules, "q_norm"),
                (attn._modules, "k_norm"), (own, "post_attention_layernorm"), (own, "post_feedforward_layernorm")]
    qk = [(attn._modules, "q_norm"), (attn._modules, "k_norm")] if attn.qk_norm else []
    return [(own, "input_layernorm"), (own, "post_attention_layernorm"), *qk]


def _layer_args(layer: nn.Module, plan: _Plan, watch: list) -> bool:
    """Append one decoder layer's norms, linears and (sparse layer) router and experts to the
    plan (and what to watch; a sparse layer's experts to plan.expert_watch); False if the op
    cannot run it."""
    attn, mlp = layer.self_attn, layer.mlp
    sparse = isinstance(mlp, SparseMoE)
    watch += [(layer._modules, "self_attn", attn), (layer._modules, "mlp", mlp)]
    watch += [(attn._modules, name, getattr(attn, name)) for name in _ATTENTION]
    if not _shared_input_agrees([getattr(attn, name) for name in _ATTENTION[:3]]):  # q, k, v
        return False
    named_norms = _layer_norms(layer, bool(plan.block))
    layer_norms = [owner[name] for owner, name in named_norms]
    if not all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in layer_norms):
        return False
    if not all(_linear_args(getattr(attn, name), plan.linears, watch) for name in _ATTENTION):
        return False
    dense = (mlp.shared_expert if mlp.has_shared else None) if sparse else mlp  # a shared expert: 7 linears
    if not (_mlp_args(dense, plan.linears, watch) and _router_args(layer, plan, watch)):
        return False
    if sparse and not _experts_args(mlp, plan):
        return False
    for n in layer_norms:
        watch.append((n._parameters, "weight", n.weight))
    watch += [(owner, name, owner[name]) for owner, name in named_norms]
    plan.norms += [_norm_scale(n) for n in layer_norms] + [None] * (4 - len(layer_norms))
    return True


def _norm_scale(norm: nn.Module) -> Tensor:
    """What the norm multiplies by: its weight, or Gemma's unit_offset + w (a new tensor)."""
    offset = getattr(norm, "unit_offset", 0.0)
    return norm.weight.detach() + offset if offset else norm.weight


def _mlp_args(block: nn.Module | None, linears: _Linears, watch: list) -> bool:
    """Append an MLP's gate, up and down (None: three absent linears) to `linears`."""
    if block is None:
        return all(_linear_args(None, linears, watch) for _ in _MLP)
    watch += [(block._modules, name, getattr(block, name)) for name in _MLP]
    return _shared_input_agrees([block.gate_proj, block.up_proj]) and \
        all(_linear_args(getattr(block, name), linears, watch) for name in _MLP)


def _experts_args(mlp: SparseMoE, plan: _Plan) -> bool:
    """Append a sparse layer's experts to the plan, each with its own watch (checked after a
    step that ran it: plan.expert_watch)."""
    watches = []
    for e, expert in enumerate(mlp.experts):
        watch = [(mlp.experts._modules, str(e), expert)]
        if not _mlp_args(expert, plan.expert_linears, watch):
            return False
        watches.append(tuple(zip(*watch)))
    plan.expert_watch.append(watches)
    return True


def _shared_input_agrees(linears: list) -> bool:
    """Linears sharing an input agree on its quantization (one form per kind)."""
    return len({m.act_bits for m in linears if isinstance(m, Int8Linear)}) <= 1 and \
        len({m.group for m in linears if isinstance(m, W4A8Linear)}) <= 1


def _linear_args(m: nn.Module | None, plan: _Linears, watch: list) -> bool:
    """Append one linear (None: a sparse layer's absent shared expert) to `plan`."""
    if m is None:
        for role in (plan.weights, plan.tiles, plan.scales, plan.comps, plan.biases, plan.w4):
            role.append(None)
        plan.act_bits.append(8)
        plan.w4_groups.append(0)
        return True
    if isinstance(m, Int8Linear):
        return _int8_args(m, plan, watch)
    if isinstance(m, W4A8Linear):
        return _w4a8_args(m, plan, watch)
    return False


def _router_args(layer: nn.Module, plan: _Plan, watch: list) -> bool:
    """Append a layer's router, shared gate, top-k and renormalization (a dense layer's None,
    None, 0, 0); False when the op cannot run them (not float32 and contiguous)."""
    mlp = layer.mlp
    if not isinstance(mlp, SparseMoE):
        plan.routers.append(None), plan.shared_gates.append(None), plan.top_k.append(0), plan.norm_topk.append(0)
        return True
    routers = [mlp.gate] + ([mlp.shared_expert_gate] if mlp.has_shared else [])
    if not all(r.weight.dtype == torch.float32 and r.weight.is_contiguous() for r in routers):
        return False
    plan.routers.append(mlp.gate.weight)
    plan.shared_gates.append(mlp.shared_expert_gate.weight if mlp.has_shared else None)
    plan.top_k.append(mlp.top_k)
    plan.norm_topk.append(int(mlp.norm_topk_prob))
    plan.sparse.append((len(plan.routers) - 1, mlp))
    watch += [(r._parameters, "weight", r.weight) for r in routers]
    watch += [(mlp._modules, "gate", mlp.gate), (mlp._modules, "experts", mlp.experts)]
    watch += [(mlp.__dict__, "top_k", mlp.top_k), (mlp.__dict__, "norm_topk_prob", mlp.norm_topk_prob)]
    if mlp.has_shared:
        watch += [(mlp._modules, "shared_expert", mlp.shared_expert),
                  (mlp._modules, "shared_expert_gate", mlp.shared_expert_gate)]
    return True


def _experts_unchanged(plan: _Plan) -> bool:
    """Every expert the last step ran is still in place (what its watch names)."""
    touched = [watches[e] for (_, block), watches in zip(plan.sparse, plan.expert_watch) for e in block.last_experts]
    if not touched:
        return True
    dicts, keys, objects = (chain.from_iterable(column) for column in zip(*touched))
    return all(map(operator.is_, map(dict.get, dicts, keys), objects))


def _report_experts(plan: _Plan) -> None:
    """Each sparse block's ``last_experts`` from the op's counts, as its forward sets them."""
    touched: dict[int, list[int]] = {layer: [] for layer, _ in plan.sparse}
    for layer, expert in plan.counts.nonzero().tolist():
        touched[layer].append(expert)
    for layer, block in plan.sparse:
        block.last_experts = touched[layer]


def _int8_args(m: Int8Linear, plan: _Linears, watch: list) -> bool:
    """Append an Int8Linear's buffers to the plan (and what to watch); False if the op cannot run it."""
    if m.resolved_backend() != "cpu":
        return False
    packing = m.packing()
    w, s, b = m._buffers["weight"], m._buffers["weight_scale"], m._buffers["bias"]
    if not (w.is_contiguous() and s.dtype == torch.float32 and s.is_contiguous()):
        return False
    if b is not None and not (b.dtype == torch.float32 and b.is_contiguous()):
        return False
    if packing.packed.tiles is None:  # the op's GEMMs read the tile layout
        return False
    plan.weights.append(w)
    plan.tiles.append(packing.packed.tiles)
    plan.scales.append(s)
    plan.comps.append(packing.packed.comp)  # 128 * rowsum(W), made with the tiles
    plan.act_bits.append(m.act_bits)
    plan.biases.append(b)
    plan.w4.append(None)
    plan.w4_groups.append(0)
    watch += [(m._buffers, "weight", w), (m._buffers, "weight_scale", s), (m._buffers, "bias", b),
              (m.__dict__, "_packing", packing), (m.__dict__, "act_bits", m.act_bits)]
    return True


def _w4a8_args(m: W4A8Linear, plan: _Linears, watch: list) -> bool:
    """Append a W4A8Linear's packed weight to the plan (and what to watch); False if the op
    cannot run it (no W4A8 op, groups that do not divide its input)."""
    kernel = m.op_and_packing()  # None without the W4A8 op (or its self-check failed), or for ragged groups
    b = m._buffers["bias"]
    if kernel is None or (b is not None and not (b.dtype == torch.float32 and b.is_contiguous())):
        return False
    packing = m._kernel_packing
    for role in (plan.weights, plan.tiles, plan.scales, plan.comps):
        role.append(None)
    plan.act_bits.append(8)  # unused: the 4-bit kernels quantize per row and group
    plan.biases.append(b)
    plan.w4.append(packing[1])
    plan.w4_groups.append(m.form)
    watch += [(m._buffers, name, t) for name, t in m._buffers.items()]
    watch += [(m.__dict__, "_kernel_packing", packing), (m.__dict__, "group", m.group)]
    return True


ENV_KV_DTYPE = "QUASAR_KV_DTYPE"  # "fp32" keeps a float32 KV cache (for comparisons)


def _bf16_attention(model: nn.Module) -> bool:
    """Whether the op attends over a bf16 cache for this model here (AVX512-BF16, a head_dim
    that is a multiple of 32)."""
    cfg = model.config  # (a model the op declines keeps a float32 cache: the modules gain nothing from bf16)
    return ext.bf16_kv_supported() and cfg.head_dim in _HEAD_DIMS and cfg.head_dim % 32 == 0 and not cfg.sandwich_norms


def kv_cache_dtype(model: nn.Module) -> torch.dtype | None:
    """The KV cache dtype of a W8A8 model: bfloat16 where the fused step attends over it
    (half the bytes a long-context step reads, products at twice the float32 rate), else
    None (the model's float dtype). ``QUASAR_KV_DTYPE=fp32`` keeps float32."""
    choice = os.environ.get(ENV_KV_DTYPE, "").strip().lower()
    if choice not in ("", "bf16", "fp32"):
        raise QuasarError(f"{ENV_KV_DTYPE} must be bf16 or fp32, got {choice!r}")
    if choice == "fp32" or not _bf16_attention(model):
        return None
    return torch.bfloat16


def install(model: nn.Module) -> None:
    """Give a W8A8 or W4A8 ``Transformer`` the fused step (it checks applicability when called), its
    KV cache dtype, the one-pass argmax / top-k of its logits rows, and the prior row cost,
    pass rows and key cost of quasar.runtime.step_cost (LLM measures the row cost and pass rows)."""
    model.step_kernel = FusedW8A8Step(model)
    model.kv_dtype = kv_cache_dtype(model)
    model.select_kernel = ext.row_argmax_topk_op()
    model.row_cost = step_cost.prior_row_cost(model)
    model.row_prices = None  # priced by row_cost until measured
    model.learned_prices = None
    model.pass_rows = step_cost.prior_pass_rows()
    model.key_cost = step_cost.key_cost(model)
