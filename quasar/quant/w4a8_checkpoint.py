"""W4A8 checkpoints: what ``quasar quantize --bits 4`` writes and the W4A8 cache holds.

A Hugging Face directory like the W8A8 checkpoint (quasar.quant.checkpoint): config.json,
one safetensors shard, the tokenizer. Each layer keeps the names its module has, so the
loader's strict state-dict load checks every tensor:

- a 4-bit layer (``W4A8Linear``): ``NAME.qweight`` uint8 [out, in / 2] (two weights a byte,
  w4a8_numerics.pack_int4), ``NAME.scales`` and ``NAME.offsets`` float16 [out, in / group]
  (w = scale * q + offset), ``NAME.bias`` where the layer has one; in the Q4_K form (version 2)
  ``NAME.scales`` and ``NAME.offsets`` are uint8 codes and ``NAME.super_scales`` and
  ``NAME.super_offsets`` float16 [out, in / 256] (scale = super_scale * code);
- a Q6_K layer (``Q6KLinear``, version 2; also an exact head's ``lm_head.approx``): ``NAME.qweight``
  uint8 [out, in] (6-bit values), ``NAME.scales`` int8 [out, in / 16], ``NAME.super_scales``
  float16 [out, in / 256];
- an 8-bit layer (``Int8Linear``: a float model's output head; in older checkpoints of the
  same format version, also a Q4_K_M file's Q6_K tensors and the GGUF's head): ``NAME.weight``
  int8 [out, in] and ``NAME.weight_scale`` float32 [out, 1], as W8A8's;
- a GGUF's output head in the small layout (``RefinedHead``, quasar.runtime.refined_head):
  ``lm_head.approx.*`` as a 4-bit layer and ``lm_head.exact.*`` as an 8-bit one, with
  ``head_top_k`` in the config;
- a GGUF's output head in the faithful layout (``ExactTopHead``, quasar.runtime.exact_head):
  ``lm_head.approx.*`` as an 8-bit layer (15-bit activations) and, unless ``head_tied`` (the
  rows are then the embedding table's), ``lm_head.exact.weight`` float32, with ``head_top_k``.

``quantization_config`` is ``{"quant_method": "quasar-w4a8", "version", "group_size",
"down_act_bits", "lm_head", "source"}`` (and ``head_top_k`` / ``head_tied`` for a refined or
exact head, ``int8_act_bits`` where the other int8 layers take 15-bit activations).
The affine groups carry float offsets (GGUF's Q4_K
minimums), which compressed-tensors' integer zero points cannot hold, so the format is our
own and vLLM does not read it; the W8A8 export stays the interop path.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from quasar.errors import QuasarError
from quasar.models.llama import Transformer
from quasar.quant.checkpoint import _state_tensors, _write_one_shard
from quasar.runtime import fused_step
from quasar.runtime.exact_head import ExactTopHead
from quasar.runtime.q6k_linear import Q6KLinear
from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w8a8_numerics import ACT_BITS
from quasar.runtime.refined_head import RefinedHead
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w4a8_numerics import GROUP_SIZES, SCALE_DTYPE

QUANT_METHOD = "quasar-w4a8"
FORMAT_VERSION = 2  # 2: a layer may be in the Q4_K or the Q6_K form
READ_VERSIONS = (1, 2)
REFINED_HEAD = "w4a8-refined-int8"  # quantization_config's lm_head for a RefinedHead
EXACT_HEAD = "int8-exact-top"  # ... and for an ExactTopHead


def w4a8_config(model: Transformer, info: dict) -> dict:
    """config.json of a W4A8 ``model`` held in memory (``w4a8_config_of`` for what it holds)."""
    groups = {m.group for m in model.modules() if isinstance(m, W4A8Linear)}
    if len(groups) != 1:
        raise QuasarError(f"a W4A8 checkpoint holds one group size; this model has {sorted(groups) or 'none'}")
    layers = {n: m.act_bits for n, m in model.model.named_modules() if isinstance(m, Int8Linear)}
    down = {bits for n, bits in layers.items() if n.endswith("mlp.down_proj")}
    other = {bits for n, bits in layers.items() if not n.endswith("mlp.down_proj")}
    if len(other) > 1:
        raise QuasarError(f"a W4A8 checkpoint runs its int8 layers at one activation precision; this model has "
                          f"{sorted(other)}")
    head = model.lm_head
    kind = "int8" if isinstance(head, Int8Linear) else "w4a8" if isinstance(head, W4A8Linear) \
        else REFINED_HEAD if isinstance(head, RefinedHead) else EXACT_HEAD if isinstance(head, ExactTopHead) \
        else "float"
    extra = {"head_top_k": head.top_k} if isinstance(head, (RefinedHead, ExactTopHead)) else {}
    if isinstance(head, ExactTopHead):
        extra["head_tied"] = head.tied
    return w4a8_config_of(model.config, groups.pop(), max(down, default=8), kind, info,
                          int8_act_bits=max(other, default=8), **extra)


def w4a8_config_of(cfg, group: int, down_act_bits: int, head: str, info: dict, head_top_k: int | None = None,
                   int8_act_bits: int = 8, head_tied: bool | None = None) -> dict:
    """config.json of a W4A8 checkpoint of a model with config ``cfg`` (a ModelConfig): its
    config (an int8 or 4-bit head unties it) and the ``quantization_config`` of the module
    docstring, ``info`` (e.g. the source) added. ``int8_act_bits``: the activations of the int8
    layers other than the down projections; ``head_tied``: an exact head reads its rows from
    the embedding table."""
    if head != "float":
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    config = cfg.to_hf()
    config["torch_dtype"] = "float32"
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "version": FORMAT_VERSION, "group_size": group,
                                     "down_act_bits": down_act_bits, "lm_head": head, **info}
    if head_top_k is not None:
        config["quantization_config"]["head_top_k"] = head_top_k
    if int8_act_bits != 8:
        config["quantization_config"]["int8_act_bits"] = int8_act_bits
    if head_tied is not None:
        config["quantization_config"]["head_tied"] = bool(head_tied)
    return config


def save_w4a8_checkpoint(model: Transformer, out: str | Path, tokenizer_dir: str | Path, info: dict | None = None,
                         exist_ok: bool = False) -> Path:
    """Write a W4A8 ``model`` held in memory as a self-contained directory (one shard),
    atomically: ``--model OUT`` loads it without the float model or the GGUF file."""
    if not any(isinstance(m, W4A8Linear) for m in model.modules()):
        raise QuasarError("save_w4a8_checkpoint expects a W4A8 model (quasar.engine.w4a8_verifier)")
    config = w4a8_config(model, info or {})
    tensors = _state_tensors(model, config["tie_word_embeddings"])
    return _write_one_shard(Path(out), config, tensors, Path(tokenizer_dir), exist_ok)


def _check_config(qc: dict) -> tuple[int, int, int]:
    version, group, down = qc.get("version"), qc.get("group_size"), qc.get("down_act_bits", 8)
    other = qc.get("int8_act_bits", 8)
    if version not in READ_VERSIONS:
        raise QuasarError(f"W4A8 checkpoint format version {version!r} is not supported (this Quasar reads "
                          f"{', '.join(map(str, READ_VERSIONS))}); quantize the model again")
    if group not in GROUP_SIZES:
        raise QuasarError(f"W4A8 checkpoint: group_size {group!r} is not one of {', '.join(map(str, GROUP_SIZES))}")
    if down not in ACT_BITS:
        raise QuasarError(f"W4A8 checkpoint: down_act_bits {down!r} is not one of {', '.join(map(str, ACT_BITS))}")
    if other not in ACT_BITS:
        raise QuasarError(f"W4A8 checkpoint: int8_act_bits {other!r} is not one of {', '.join(map(str, ACT_BITS))}")
    return group, down, other


def _head_top_k(qc: dict) -> int:
    top_k = qc.get("head_top_k")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise QuasarError(f"W4A8 checkpoint: a refined lm_head needs a positive integer head_top_k, got {top_k!r}")
    return top_k


def _expect(tensors: dict, key: str, dtype: torch.dtype) -> None:
    t = tensors.get(key)
    if t is None:
        raise QuasarError(f"W4A8 checkpoint lacks {key}")
    if t.dtype != dtype:
        raise QuasarError(f"W4A8 checkpoint: {key} is {t.dtype}, expected {dtype}")


def _exact_head(model: Transformer, head: nn.Linear, quant_config: dict, tensors: dict) -> ExactTopHead:
    tied = quant_config.get("head_tied")
    if not isinstance(tied, bool):
        raise QuasarError(f"W4A8 checkpoint: an exact lm_head needs head_tied true or false, got {tied!r}")
    q6k = "lm_head.approx.qweight" in tensors
    if q6k:
        _expect_q6k(tensors, "lm_head.approx")
    else:
        _expect(tensors, "lm_head.approx.weight", torch.int8)
    if not tied:
        _expect(tensors, "lm_head.exact.weight", torch.float32)
    return ExactTopHead(head.in_features, head.out_features, _head_top_k(quant_config),
                        tied=model.model.embed_tokens if tied else None, device="meta", q6k=q6k)


def _expect_q6k(tensors: dict, name: str) -> None:
    for part, dtype in (("qweight", torch.uint8), ("scales", torch.int8), ("super_scales", SCALE_DTYPE)):
        _expect(tensors, f"{name}.{part}", dtype)


def prepare_w4a8_modules(model: Transformer, quant_config: dict, tensors: dict) -> int:
    """Swap the (meta-device) model's quantized ``nn.Linear``s for ``W4A8Linear`` (where the
    checkpoint has ``NAME.qweight``) or ``Int8Linear`` (an int8 ``NAME.weight``) before the
    loader's strict state-dict load; returns how many were swapped."""
    group, down_bits, other_bits = _check_config(quant_config)
    modules = dict(model.named_modules())
    swapped = 0
    for name, module in list(modules.items()):
        if not isinstance(module, nn.Linear):
            continue
        bias = module.bias is not None
        if name == "lm_head" and quant_config.get("lm_head") == EXACT_HEAD:
            new: nn.Module = _exact_head(model, module, quant_config, tensors)
        elif name == "lm_head" and "lm_head.approx.qweight" in tensors:
            _expect(tensors, "lm_head.exact.weight", torch.int8)
            new = RefinedHead(module.in_features, module.out_features, _head_top_k(quant_config), group, device="meta")
        elif f"{name}.qweight" in tensors and f"{name}.offsets" not in tensors:
            _expect_q6k(tensors, name)
            new = Q6KLinear(module.in_features, module.out_features, bias, device="meta")
        elif f"{name}.qweight" in tensors:
            _expect(tensors, f"{name}.qweight", torch.uint8)
            q4k = f"{name}.super_scales" in tensors
            for part in ("scales", "offsets"):
                _expect(tensors, f"{name}.{part}", torch.uint8 if q4k else SCALE_DTYPE)
            for part in ("super_scales", "super_offsets") if q4k else ():
                _expect(tensors, f"{name}.{part}", SCALE_DTYPE)
            new = W4A8Linear(module.in_features, module.out_features, group, bias, device="meta", q4k=q4k)
        elif f"{name}.weight_scale" in tensors:
            _expect(tensors, f"{name}.weight", torch.int8)
            new = Int8Linear(module.in_features, module.out_features, bias=bias, device="meta",
                             act_bits=down_bits if name.endswith("mlp.down_proj")
                             else other_bits if name.startswith("model.layers.") else 8)
        else:
            continue
        if name == "lm_head" and model.config.tie_word_embeddings:
            raise QuasarError("W4A8 checkpoint has a quantized lm_head but ties it to the embeddings")
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)
        swapped += 1
    if not any(isinstance(m, W4A8Linear) for m in model.modules()):
        raise QuasarError("W4A8 checkpoint has no 4-bit layer (no NAME.qweight tensor)")
    model.quant_kind = "w4a8"
    fused_step.install(model)
    return swapped
