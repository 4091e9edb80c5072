"""Quantize a model one decoder layer at a time (ARCHITECTURE.md, "Sequential quantization").

The calibration hidden states of all samples (samples x seq x hidden, small) are carried
from layer to layer. For layer i: read its float weights from the source, rotate, collect
that layer's input statistics and Hessians only, smooth, round with GPTQ, hand the int8
layer to the sink (a checkpoint shard on disk, or a dict), then run the *quantized* layer
to make layer i + 1's inputs. The embeddings come first and the final norm and lm_head
last. With ``weight_bits=4`` (the W4A8 verifier of a float model) the layers are not
smoothed and their linears become W4A8Linear, GPTQ-rounded to int4 groups (in the faithful
layout the value and down projections llama.cpp's Q4_K_M keeps in 6 bits stay int8); the head
is as for W8A8. Peak memory is about one float layer, its Hessians and the activations; the float
model is never built whole.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm import tqdm

from quasar.models.config import ModelConfig
from quasar.models.families import decoder_layer, embed, final_norm
from quasar.models.llama import DecoderLayer, KVCache, Prefill, rope_cos_sin, rope_inv_freq
from quasar.models.layouts import read_tensor
from quasar.models.tensors import TensorSource
from quasar.quant.calibrate import StatsCollector
from quasar.quant.gptq import gptq_weights
from quasar.runtime.w8a8 import Int8Linear
from quasar.quant.options import QuantOptions
from quasar.quant.smooth import (head_groups, input_owners, layer_groups, rotate_layer, rotate_rows, rotations,
                                 sample_names, smooth_groups)
from quasar.runtime.w4a8 import W4A8Linear
from quasar.quant.w4a8_layouts import FAITHFUL, keeps_wider
from quasar.runtime.w4a8_numerics import W4A8_GROUP, symmetric_as_affine

WIDE_ACT_BITS = 15  # activations of the int8 linears a faithful 4-bit model keeps

Sink = Callable[[dict[str, Tensor]], None]  # receives each finished part's tensors (HF names)


class _Windows:
    """The calibration windows' hidden states [1, T, hidden] and what running a layer over
    them needs: RoPE tables and causal masks per length, a one-layer scratch KV cache."""

    def __init__(self, cfg: ModelConfig, hidden: list[Tensor]):
        self.cfg, self.hidden = cfg, hidden
        inv_freq = rope_inv_freq(cfg)
        self._rope: dict[int, tuple[Tensor, Tensor, Prefill]] = {}
        for x in hidden:
            t = x.shape[1]
            if t not in self._rope:
                pos = torch.arange(t)
                cos, sin = rope_cos_sin(inv_freq, pos, torch.float32)
                self._rope[t] = (cos, sin, Prefill(0, 0, pos[None, :] <= pos[:, None]))
        longest = max(x.shape[1] for x in hidden)
        self.cache = KVCache(1, cfg.num_kv_heads, longest, cfg.head_dim, torch.float32)

    @torch.inference_mode()
    def run(self, layer: DecoderLayer, collector: StatsCollector | None = None) -> list[Tensor]:
        """The layer's outputs for every window (statistics to ``collector`` on the way)."""
        out = []
        for x in self.hidden:
            if collector is not None:
                collector.window(x.shape[1])
            cos, sin, at = self._rope[x.shape[1]]
            out.append(layer(x, cos, sin, self.cache, 0, at))
        return out


def float_layer(source: TensorSource, cfg: ModelConfig, index: int) -> DecoderLayer:
    """Decoder layer ``index`` from the source, in float32 (only this layer is upcast)."""
    with torch.device("meta"):
        layer = decoder_layer(cfg, index)
    prefix = f"model.layers.{index}."
    state = {name: read_tensor(source, cfg, prefix + name).float() for name in layer.state_dict()}
    layer.load_state_dict(state, assign=True, strict=True)
    return layer.eval()


def _int8(linear: nn.Linear, rounded: tuple[Tensor, Tensor] | None, backend: str, act_bits: int) -> Int8Linear:
    if rounded is None:
        return Int8Linear.from_float(linear, backend, act_bits)
    layer = Int8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, backend=backend,
                       act_bits=act_bits)
    layer.weight.copy_(rounded[0])
    layer.weight_scale.copy_(rounded[1])
    if linear.bias is not None:
        layer.bias.copy_(linear.bias.detach())
    return layer


def _w4(linear: nn.Linear, rounded: tuple[Tensor, Tensor] | None) -> W4A8Linear:
    if rounded is None:
        return W4A8Linear.from_float(linear, W4A8_GROUP)
    return W4A8Linear.from_groups(*symmetric_as_affine(*rounded), W4A8_GROUP, linear.bias)


def _quantize_linears(root: nn.Module, prefix: str, groups, all_groups, stats, opts: QuantOptions,
                      chosen: dict[str, float | None], four_bit: bool = False, wide: frozenset = frozenset()) -> None:
    """Smooth ``groups`` (the enabled ones), round every linear under ``root`` (GPTQ where it
    has a Hessian) and swap it for an Int8Linear in place (``four_bit``: a W4A8Linear, but for
    the names in ``wide``, which stay int8 with WIDE_ACT_BITS activations)."""
    scales: dict[str, Tensor] = {}
    chosen.update(smooth_groups(groups, stats, opts.alpha, scales_out=scales))
    linears = {prefix + n: m for n, m in root.named_modules() if isinstance(m, nn.Linear)}
    four = {n: m for n, m in linears.items() if four_bit and n not in wide}
    rounded: dict = {}
    for part, group in ((four, W4A8_GROUP), ({n: m for n, m in linears.items() if n not in four}, None)):
        if opts.gptq and part:
            rounded.update(gptq_weights(part, input_owners(all_groups), stats.hessians, scales, group=group))
    modules = dict(root.named_modules())
    for name, lin in linears.items():
        parent, _, child = name[len(prefix):].rpartition(".")
        # every down projection (an expert's too) takes down_act_bits, as the loader reads them
        bits = WIDE_ACT_BITS if name in wide else opts.down_act_bits if name.endswith("down_proj") else 8
        new = _w4(lin, rounded.get(name)) if name in four else _int8(lin, rounded.get(name), opts.backend, bits)
        setattr(modules[parent] if parent else root, child, new)


def _wide_linears(layer: nn.Module, prefix: str, index: int, cfg: ModelConfig, opts: QuantOptions) -> frozenset:
    """The linears of a 4-bit layer that the faithful layout keeps int8 (w4a8_layouts.keeps_wider)."""
    if opts.weight_bits != 4 or opts.w4_layout != FAITHFUL:
        return frozenset()
    return frozenset(prefix + n for n, m in layer.named_modules()
                     if isinstance(m, nn.Linear) and keeps_wider(n, index, cfg.num_layers))


def _collector(groups, all_groups, opts: QuantOptions, n_windows: int) -> StatsCollector:
    keep = sample_names(groups) if opts.alpha == "auto" else ()
    hessians = sorted(set(input_owners(all_groups).values())) if opts.gptq else ()
    return StatsCollector(n_windows, keep=keep, hessians=hessians)


@torch.no_grad()
def quantize_layers(source: TensorSource, cfg: ModelConfig, windows: list[list[int]], sink: Sink,
                    opts: QuantOptions, progress: bool = False) -> dict:
    """Quantize the model in ``source`` part by part into ``sink``; returns what was done
    (the checkpoint's ``quantization_config.quasar``)."""
    t0 = time.perf_counter()
    q, r = rotations(cfg) if opts.rotate else (None, None)
    chosen: dict[str, float | None] = {}

    emb = source.get("model.embed_tokens.weight")  # memory-mapped, in its stored dtype
    emb = emb.float() if q is None else rotate_rows(emb, q, dtype=torch.float32)
    data = _Windows(cfg, [embed(cfg, emb, torch.tensor(ids))[None] for ids in windows])
    sink({"model.embed_tokens.weight": emb})
    del emb

    for i in tqdm(range(cfg.num_layers), desc="quantizing layers", unit="layer", file=sys.stderr,
                  disable=not progress, leave=False):
        layer = float_layer(source, cfg, i)
        if q is not None:
            rotate_layer(layer, cfg, q, r)
        # 4-bit layers are not smoothed: their activations are quantized per group, and
        # smoothing would move the outliers into the weights, where 4 bits hurt most
        groups = layer_groups(layer, cfg, i, opts.smooth_o_down) if opts.weight_bits == 8 else []
        all_groups = layer_groups(layer, cfg, i, True, experts=True)
        collector = _collector(groups, all_groups, opts, len(windows)).hook(
            {f"model.layers.{i}.{n}": m for n, m in layer.named_modules() if isinstance(m, nn.Linear)})
        float_out = data.run(layer, collector)
        stats = collector.finish()
        _quantize_linears(layer, f"model.layers.{i}.", groups, all_groups, stats, opts, chosen,
                          four_bit=opts.weight_bits == 4, wide=_wide_linears(layer, f"model.layers.{i}.", i, cfg, opts))
        data.hidden = data.run(layer) if opts.propagate == "quantized" else float_out
        sink({f"model.layers.{i}.{n}": t for n, t in layer.state_dict().items()})
        del layer, float_out, stats

    _quantize_head(source, cfg, data.hidden, q, sink, opts, chosen)
    return {
        **opts.recorded(),
        "alphas": _alpha_summary(chosen),
        "calibration": {"samples": len(windows), "seq_len": max(len(w) for w in windows),
                        "tokens": sum(len(w) for w in windows)},
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _quantize_head(source: TensorSource, cfg: ModelConfig, hidden: list[Tensor], q: Tensor | None, sink: Sink,
                   opts: QuantOptions, chosen: dict) -> None:
    """The final norm and lm_head. Rotation folds the norm into lm_head (which unties it from
    the embeddings); an int8 lm_head is calibrated on the last layer's quantized outputs."""
    norm = final_norm(cfg)
    norm.weight = nn.Parameter(source.get("model.norm.weight").float(), requires_grad=False)
    if q is None and not opts.int8_head:
        sink({"model.norm.weight": norm.weight.data})
        if not cfg.tie_word_embeddings:
            sink({"lm_head.weight": source.get("lm_head.weight")})
        return
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in source
    # on "meta": a vocabulary-sized Linear would otherwise allocate and initialize a weight
    # as large as the one read next (2.5 GB in float32 at the 8B shapes)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
    stored = source.get("model.embed_tokens.weight" if tied else "lm_head.weight")  # memory-mapped
    weight = stored.float() if q is None else rotate_rows(stored, q, norm.weight.data, dtype=torch.float32)
    head.weight = nn.Parameter(weight, requires_grad=False)
    del stored, weight
    if q is not None:
        norm.weight.data = torch.ones_like(norm.weight.data)
    holder = nn.Module()
    holder.lm_head = head
    if opts.int8_head:
        groups = head_groups(norm, head, cfg)
        collector = _collector(groups, groups, opts, len(hidden))
        with torch.inference_mode():
            for x in hidden:  # only lm_head's input is needed, not its (vocabulary-wide) output
                collector.window(x.shape[1])
                collector.observe("lm_head", norm(x))
        _quantize_linears(holder, "", groups, groups, collector.finish(), opts, chosen)
    sink({"model.norm.weight": norm.weight.data, **{f"lm_head.{n}": t for n, t in holder.lm_head.state_dict().items()}})


def _alpha_summary(chosen: dict[str, float | None]) -> dict[str, list]:
    """{"attn_in": [a_layer0, a_layer1, ...], ..., "head_in": [a]}: small enough for config.json."""
    out: dict[str, list] = {}
    for key, a in chosen.items():
        out.setdefault(key.rsplit(".", 1)[-1], []).append(None if a is None else round(a, 3))
    return out
