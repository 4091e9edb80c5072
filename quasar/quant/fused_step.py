"""Verifier steps of a W8A8 model in one C++ call for all decoder layers.

At small model sizes a verifier step of a few tokens spends more time in ~50 small ATen
ops per layer (norms, RoPE, one attention call per query for row invariance, residuals)
than in reading its int8 weights. ``csrc/decoder_layer.cpp`` runs each
layer's glue as plain loops between the same int8 GEMMs Int8Linear uses;
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

It applies when every decoder linear is an ``Int8Linear`` on the ``cpu`` backend, the
model is float32 on the CPU, its cache float32 or bfloat16 (``kv_cache_dtype``: bf16 on an
AVX512-BF16 CPU, attended with bf16 products), and the C++ ops load (every kernel path:
AMX, AVX512-VNNI, AVX-VNNI, AVX2 or plain C++, see ``ext.kernel_path``;
``QUASAR_NO_EXT=1`` turns it off with the rest of the extension); otherwise
``__call__`` returns None and the model runs its modules. The per-layer argument lists
are built once and rebuilt when a module's tensors are replaced (loading, ``.to()``) or
an Int8Linear is repacked (call ``Int8Linear.repack()`` after editing weights in place).
"""

from __future__ import annotations

import operator
import os
from typing import Any

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.quant import step_cost
from quasar.quant.int8 import Int8Linear

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
        self._plan: tuple[list, ...] | None = None  # flat per-layer argument lists of the op
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
        cfg = self.model.config
        norms, weights, tiles, scales, biases, comps, act_bits = self._plan
        starts = [rows.starts[s] for s in rows.slots]
        return self._op(x.contiguous(), cos, sin, cache.k, cache.v, rows.slots, starts, rows.parents, norms,
                        cfg.rms_norm_eps, weights, tiles, scales, biases, comps, act_bits, cfg.num_heads,
                        cfg.num_kv_heads, prefill)

    def _unchanged(self) -> bool:
        """Every watched object is still in place: ~1,500 identity checks at 30 layers, run
        with map() so a step spends microseconds on them, not a millisecond."""
        dicts, keys, objects = self._watch
        return all(map(operator.is_, map(dict.get, dicts, keys), objects))

    def _build(self) -> bool:
        """(Re)build the per-layer argument lists; False when the fused layer cannot run."""
        self._plan, self._watch = None, ((), (), ())
        from quasar.quant import ext

        self._op = ext.decoder_layer_op()
        if self._op is None:
            return False
        self._bf16 = _bf16_attention(self.model)
        if self.model.config.head_dim not in _HEAD_DIMS:
            return False
        layers = self.model.model.layers
        norms, weights, tiles, scales, biases, comps, act_bits = [], [], [], [], [], [], []
        # Anything swapped later (a module, a tensor, a repack) invalidates the plan.
        watch = [(self.model.model._modules, "layers", layers)]
        for idx, layer in enumerate(layers):
            watch += [(layers._modules, str(idx), layer), (layer._modules, "self_attn", layer.self_attn),
                      (layer._modules, "mlp", layer.mlp)]
            watch += [(getattr(layer, block)._modules, name, getattr(getattr(layer, block), name))
                      for block, name in _LINEARS]
            linears = [getattr(getattr(layer, block), name) for block, name in _LINEARS]
            if not all(isinstance(m, Int8Linear) and m.resolved_backend() == "cpu" for m in linears):
                return False
            # q, k, v (and gate, up) are one GEMM on one quantized input
            if len({m.act_bits for m in linears[:3]}) > 1 or linears[4].act_bits != linears[5].act_bits:
                return False
            attn = layer.self_attn
            layer_norms = [layer.input_layernorm, layer.post_attention_layernorm]
            layer_norms += [attn.q_norm, attn.k_norm] if attn.qk_norm else []
            if not all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in layer_norms):
                return False
            for m in linears:
                packing = m.packing()
                w, s, b = m._buffers["weight"], m._buffers["weight_scale"], m._buffers["bias"]
                if not (w.is_contiguous() and s.dtype == torch.float32 and s.is_contiguous()):
                    return False
                if b is not None and not (b.dtype == torch.float32 and b.is_contiguous()):
                    return False
                if packing.packed.tiles is None:  # the op's GEMMs read the tile layout
                    return False
                weights.append(w)
                tiles.append(packing.packed.tiles)
                act_bits.append(m.act_bits)
                scales.append(s)
                biases.append(b)
                comps.append(packing.packed.comp)  # 128 * rowsum(W), made with the tiles
                watch += [(m._buffers, "weight", w), (m._buffers, "weight_scale", s), (m._buffers, "bias", b),
                          (m.__dict__, "_packing", packing), (m.__dict__, "act_bits", m.act_bits)]
            for n in layer_norms:
                watch.append((n._parameters, "weight", n.weight))
            watch += [(layer._modules, "input_layernorm", layer.input_layernorm),
                      (layer._modules, "post_attention_layernorm", layer.post_attention_layernorm)]
            if attn.qk_norm:
                watch += [(attn._modules, "q_norm", attn.q_norm), (attn._modules, "k_norm", attn.k_norm)]
            norms += [n.weight for n in layer_norms] + [None] * (4 - len(layer_norms))
        self._plan, self._watch = (norms, weights, tiles, scales, biases, comps, act_bits), tuple(zip(*watch))
        return True


ENV_KV_DTYPE = "QUASAR_KV_DTYPE"  # "fp32" keeps a float32 KV cache (for comparisons)


def _bf16_attention(model: nn.Module) -> bool:
    """Whether the op attends over a bf16 cache for this model here (AVX512-BF16, a head_dim
    that is a multiple of 32)."""
    from quasar.quant import ext

    return ext.bf16_kv_supported() and model.config.head_dim in _HEAD_DIMS and model.config.head_dim % 32 == 0


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
    """Give a W8A8 ``Transformer`` the fused step (it checks applicability when called), its
    KV cache dtype, the one-pass argmax / top-k of its logits rows, and the prior row cost,
    pass rows and key cost of quasar.quant.step_cost (LLM measures the row cost and pass rows)."""
    from quasar.quant import ext

    model.step_kernel = FusedW8A8Step(model)
    model.kv_dtype = kv_cache_dtype(model)
    model.select_kernel = ext.row_argmax_topk_op()
    model.row_cost = step_cost.prior_row_cost(model)
    model.pass_rows = step_cost.prior_pass_rows()
    model.key_cost = step_cost.key_cost(model)
