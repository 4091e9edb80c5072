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

Each row is computed alone in a fixed order, so a token's logits are bitwise the same
whether it is verified alone, with drafts or beside other sequences (greedy speculative ==
greedy autoregressive stays exact, in a batch too). The layer is not bitwise the PyTorch
path (summation order, a polynomial exp): its logits are close, which tests check.
Prefills longer than the step limit take the PyTorch path; both write the same KV cache
layout.

It applies when every decoder linear is an ``Int8Linear`` on the ``cpu`` backend or a
``W4A8Linear`` of whole groups (any mix: the W4A8 verifier keeps the tensors its GGUF file
holds wider as Int8Linear), the linears sharing an input (q, k, v; gate, up) agree on their
activations (the Int8Linears' act_bits, the W4A8Linears' group size), the model is float32
on the CPU, its cache float32 or bfloat16 (``kv_cache_dtype``: bf16 on an AVX512-BF16 CPU,
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

_LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


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

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, cache, rows, prefill: bool = False) -> Tensor | None:
        # prefill: the rows are a prompt chunk (always computed the same way for a prompt),
        # which may attend with AMX tiles instead of the row-invariant kernel.
        # The op runs up to MAX_ROWS rows: chains or trees, in one or more cache slots.
        if len(rows) > MAX_ROWS:
            return None
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] != 1:
            return None
        if self._plan is None or not self._unchanged():
            if not self._build():
                return None
        if cache.k.dtype != torch.float32 and not (cache.k.dtype == torch.bfloat16 and self._bf16):
            return None
        cfg, p = self.model.config, self._plan
        costs = self.model.step_costs
        if costs is not None and costs.prefetch_whole is not None:  # this model's measured way
            ext.prefetch_whole_stream(costs.prefetch_whole)
        starts = [rows.starts[s] for s in rows.slots]
        return self._op(x.contiguous(), cos, sin, cache.k, cache.v, rows.slots, starts, rows.parents, p.norms,
                        cfg.rms_norm_eps, p.weights, p.tiles, p.scales, p.biases, p.comps, p.act_bits, p.w4,
                        p.w4_groups, cfg.num_heads, cfg.num_kv_heads, prefill)

    def _unchanged(self) -> bool:
        """Every watched object is still in place: ~1,500 identity checks at 30 layers, run
        with map() so a step spends microseconds on them, not a millisecond."""
        dicts, keys, objects = self._watch
        return all(map(operator.is_, map(dict.get, dicts, keys), objects))

    def _build(self) -> bool:
        """(Re)build the per-layer argument lists; False when the fused layer cannot run."""
        self._plan, self._watch = None, ((), (), ())
        if any(isinstance(layer.mlp, SparseMoE) for layer in self.model.model.layers):
            return False  # the op runs dense MLPs only: experts run the modules
        if self.model.config.sandwich_norms:
            return False  # the op runs the Llama block only: Gemma 3 runs the modules
        self._op = ext.decoder_layer_op()
        if self._op is None:
            return False
        self._bf16 = _bf16_attention(self.model)
        if self.model.config.head_dim not in _HEAD_DIMS:
            return False
        layers = self.model.model.layers
        plan = _Plan()
        # Anything swapped later (a module, a tensor, a repack) invalidates the plan.
        watch = [(self.model.model._modules, "layers", layers)]
        for idx, layer in enumerate(layers):
            watch += [(layers._modules, str(idx), layer), (layer._modules, "self_attn", layer.self_attn),
                      (layer._modules, "mlp", layer.mlp)]
            watch += [(getattr(layer, block)._modules, name, getattr(getattr(layer, block), name))
                      for block, name in _LINEARS]
            linears = [getattr(getattr(layer, block), name) for block, name in _LINEARS]
            # q, k, v (and gate, up) share their input: one quantization per form they need
            for shared in (linears[:3], linears[4:6]):
                if len({m.act_bits for m in shared if isinstance(m, Int8Linear)}) > 1 or \
                        len({m.group for m in shared if isinstance(m, W4A8Linear)}) > 1:
                    return False
            attn = layer.self_attn
            layer_norms = [layer.input_layernorm, layer.post_attention_layernorm]
            layer_norms += [attn.q_norm, attn.k_norm] if attn.qk_norm else []
            if not all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in layer_norms):
                return False
            for m in linears:
                if isinstance(m, Int8Linear):
                    found = _int8_args(m, plan, watch)
                elif isinstance(m, W4A8Linear):
                    found = _w4a8_args(m, plan, watch)
                else:
                    found = False
                if not found:
                    return False
            for n in layer_norms:
                watch.append((n._parameters, "weight", n.weight))
            watch += [(layer._modules, "input_layernorm", layer.input_layernorm),
                      (layer._modules, "post_attention_layernorm", layer.post_attention_layernorm)]
            if attn.qk_norm:
                watch += [(attn._modules, "q_norm", attn.q_norm), (attn._modules, "k_norm", attn.k_norm)]
            plan.norms += [n.weight for n in layer_norms] + [None] * (4 - len(layer_norms))
        self._plan, self._watch = plan, tuple(zip(*watch))
        return True


class _Plan:
    """The op's per-layer argument lists: 4 norms and 7 linears a layer (decoder_layer.cpp)."""

    def __init__(self) -> None:
        self.norms: list = []
        self.weights: list = []  # Int8Linear: weight, tiles, scale, comp, act_bits; W4A8Linear: None, 8
        self.tiles: list = []
        self.scales: list = []
        self.comps: list = []
        self.act_bits: list[int] = []
        self.biases: list = []
        self.w4: list = []  # W4A8Linear: the weight in the op's layout (ext.pack_w4); Int8Linear: None
        self.w4_groups: list[int] = []  # W4A8Linear: its group size; Int8Linear: 0


def _int8_args(m: Int8Linear, plan: _Plan, watch: list) -> bool:
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


def _w4a8_args(m: W4A8Linear, plan: _Plan, watch: list) -> bool:
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
    plan.w4_groups.append(m.group)
    watch += [(m._buffers, name, m._buffers[name]) for name in ("qweight", "scales", "offsets", "bias")]
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
    model.pass_rows = step_cost.prior_pass_rows()
    model.key_cost = step_cost.key_cost(model)
