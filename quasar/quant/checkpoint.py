"""W8A8 checkpoints: our self-contained directory and the compressed-tensors export.

Both use the compressed-tensors "int-quantized" layout (ARCHITECTURE.md, "Interop"): HF module
names, ``*.weight`` int8 [out, in], ``*.weight_scale`` float32 [out, 1], smoothing folded
into the float norm weights, and ``quantization_config`` in config.json. Ours may keep
``lm_head`` in int8 (then it is untied from the embeddings) and records how it was made
under ``quantization_config.quasar``; the export always writes a float ``lm_head`` and
lists it under ``ignore``, which is what vLLM and transformers expect.

Directories are written to a temporary sibling and renamed into place, so a failure
leaves nothing behind and readers never see half a checkpoint; each carries a manifest of
its files' sizes and hashes (quasar.cache.manifest), checked when it loads.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.fileio import atomic_dir
from quasar.models.llama import Transformer
from quasar.runtime import fused_step
from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w8a8_numerics import ACT_BITS

FORMAT_VERSION = 1
_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
_SCHEME_DEFAULTS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}  # compressed-tensors'
# files of a model directory that are not tokenizer/generation metadata (the source's manifest
# lists the source's files: the checkpoint gets its own)
_NOT_COPIED = re.compile(r"(config\.json|.*\.safetensors|.*\.safetensors\.index\.json|.*\.bin|.*\.pt|.*\.pth|"
                         r".*\.gguf|.*\.ckpt|.*\.msgpack|.*\.h5|quasar-manifest\.json)$")


def quantization_config(ignore: list[str], quasar: dict | None = None) -> dict:
    """The ``quantization_config`` entry of config.json (compressed-tensors W8A8)."""
    cfg: dict[str, Any] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(_WEIGHTS),
                                      "input_activations": dict(_ACTIVATIONS)}},
    }
    if quasar is not None:
        cfg["quasar"] = quasar
    return cfg


# --------------------------------------------------------------------------- loading


def _check_scheme(group_name: str, group: dict) -> list[str]:
    if not isinstance(group, dict):
        raise QuasarError(f"quantization_config: config group {group_name!r} is not an object")
    targets = group.get("targets") or []
    if isinstance(targets, str):
        targets = [targets]
    for part, want in (("weights", _WEIGHTS), ("input_activations", _ACTIVATIONS)):
        got = group.get(part)
        if not isinstance(got, dict):
            raise QuasarError(f"quantization_config group {group_name!r} has no {part} scheme "
                              "(Quasar runs W8A8: int8 weights and int8 activations)")
        for key, value in want.items():
            if got.get(key, _SCHEME_DEFAULTS.get(key)) != value:
                raise QuasarError(
                    f"quantization_config group {group_name!r}: {part}.{key}={got.get(key)!r} is not supported "
                    f"(Quasar runs W8A8: int8 per-channel symmetric weights, dynamic per-token int8 activations)")
    return list(targets)


def _matches(name: str, module: nn.Module, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == type(module).__name__ or (
        pattern == "Linear" and isinstance(module, nn.Linear))


def prepare_quantized_modules(model: Transformer, quant_config: dict, tensors: dict[str, Tensor]) -> int:
    """Swap the quantized ``nn.Linear``s of a (meta-device) model for ``Int8Linear``.

    Called by the HF loader before its strict state-dict load when config.json has a
    ``quantization_config``. Zero ``*_zero_point`` tensors (symmetric schemes) are dropped
    from ``tensors``. Returns the number of layers swapped; a scheme or file we cannot run
    exactly is a QuasarError.
    """
    if not isinstance(quant_config, dict):
        raise QuasarError("config.json: quantization_config must be an object")
    method = quant_config.get("quant_method")
    if method != "compressed-tensors":
        raise QuasarError(f"unsupported quantization method {method!r} (Quasar loads compressed-tensors W8A8)")
    fmt = quant_config.get("format")
    if fmt != "int-quantized":
        raise QuasarError(f"unsupported compressed-tensors format {fmt!r} (Quasar loads 'int-quantized')")
    status = quant_config.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuasarError(f"unsupported quantization_status {status!r} (expected 'compressed')")
    groups = quant_config.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise QuasarError("quantization_config has no config_groups")
    targets = [t for name, g in groups.items() for t in _check_scheme(name, g)]
    ignore = quant_config.get("ignore") or []
    for key in [k for k in tensors if k.endswith("_zero_point")]:
        if torch.count_nonzero(tensors[key]):
            raise QuasarError(f"{key}: non-zero zero point (asymmetric quantization is not supported)")
        del tensors[key]

    # Quasar's own checkpoints may run the MLP down projections with 15-bit activations
    # (quantize_model's down_act_bits); the compressed-tensors scheme above stays W8A8.
    info = quant_config.get("quasar") if isinstance(quant_config.get("quasar"), dict) else {}
    down_act_bits = info.get("down_act_bits", 8)
    if down_act_bits not in ACT_BITS:
        raise QuasarError(f"quantization_config.quasar.down_act_bits={down_act_bits!r} is not supported "
                          f"(one of {', '.join(map(str, ACT_BITS))})")
    modules = dict(model.named_modules())
    swapped = 0
    for name, module in list(modules.items()):
        if not isinstance(module, nn.Linear):
            continue
        if not any(_matches(name, module, t) for t in targets) or any(_matches(name, module, p) for p in ignore):
            continue
        w = tensors.get(f"{name}.weight")
        if w is None or f"{name}.weight_scale" not in tensors:
            raise QuasarError(f"quantized checkpoint lacks {name}.weight or {name}.weight_scale")
        if w.dtype != torch.int8:
            raise QuasarError(f"{name}.weight is {w.dtype}, expected int8 (compressed 'int-quantized' layout)")
        if name == "lm_head" and model.config.tie_word_embeddings:
            raise QuasarError("checkpoint has an int8 lm_head but ties it to the embeddings")
        new = Int8Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta",
                         act_bits=down_act_bits if name.endswith("down_proj") else 8)
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
        swapped += 1
    if swapped == 0:
        raise QuasarError("quantization_config matches no linear layer of the model")
    fused_step.install(model)
    return swapped


# --------------------------------------------------------------------------- writing


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer and generation files of model directory ``src`` (never its weights)."""
    if not (Path(src) / "tokenizer.json").is_file():
        raise QuasarError(f"{src}: no tokenizer.json to copy into the checkpoint")
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not _NOT_COPIED.fullmatch(f.name):
            shutil.copy2(f, dst / f.name)


class ShardWriter:
    """Writes a checkpoint's tensors as they are made: one safetensors shard per ``add``,
    and the index naming each tensor's shard on ``finish``. Used inside ``atomic_dir``, so
    readers see the directory only once everything is written."""

    def __init__(self, folder: Path, n_shards: int):
        self.folder, self.n_shards = Path(folder), n_shards
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0

    def add(self, tensors: dict[str, Tensor]) -> None:
        k = len(set(self.weight_map.values())) + 1
        if k > self.n_shards:
            raise ValueError(f"more than the {self.n_shards} shards announced")
        name = f"model-{k:05d}-of-{self.n_shards:05d}.safetensors"
        tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
        save_file(tensors, str(self.folder / name), metadata={"format": "pt"})
        for n, t in tensors.items():
            self.weight_map[n] = name
            self.total_bytes += t.numel() * t.element_size()

    def finish(self, config: dict, tokenizer_dir: Path | None) -> None:
        if len(set(self.weight_map.values())) != self.n_shards:
            raise ValueError(f"{len(set(self.weight_map.values()))} of {self.n_shards} shards written")
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
        (self.folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer(Path(tokenizer_dir), self.folder)


def _state_tensors(model: Transformer, tied: bool, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue
        if dtype is not None and v.is_floating_point() and not k.endswith("_scale"):
            v = v.to(dtype)
        out[k] = v
    return out


def _write_one_shard(out: Path, config: dict, tensors: dict[str, Tensor], tokenizer_dir: Path,
                     exist_ok: bool = False) -> Path:
    def fill(tmp: Path) -> None:
        writer = ShardWriter(tmp, 1)
        writer.add(tensors)
        writer.finish(config, tokenizer_dir)

    return atomic_dir(out, fill, exist_ok)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def checkpoint_config(cfg, int8_head: bool, info: dict, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of our W8A8 checkpoint: the model's config, its float dtype, and the
    ``quantization_config`` (``info`` under ``quasar``; an int8 lm_head unties it)."""
    if int8_head:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    info = dict(info)
    info.update(version=FORMAT_VERSION, lm_head="int8" if int8_head else "float")
    config = cfg.to_hf()
    config["torch_dtype"] = _dtype_name(dtype)
    config["quantization_config"] = quantization_config([] if int8_head else ["lm_head"], info)
    return config


def save_checkpoint(model: Transformer, out: str | Path, tokenizer_dir: str | Path,
                    exist_ok: bool = False) -> Path:
    """Write a W8A8 ``model`` held in memory as a self-contained directory (one shard).

    ``quasar generate --model OUT`` (or ``load_model(OUT)``) loads it without recalibrating.
    """
    if not any(isinstance(m, Int8Linear) for m in model.modules()):
        raise QuasarError("save_checkpoint expects a quantized model (see quasar.quant.quantize)")
    int8_head = isinstance(model.lm_head, Int8Linear)
    config = checkpoint_config(model.config, int8_head, getattr(model, "quant_info", {}) or {},
                               model.model.norm.weight.dtype)
    tensors = _state_tensors(model, config["tie_word_embeddings"])
    return _write_one_shard(Path(out), config, tensors, Path(tokenizer_dir), exist_ok)


def export_compressed_tensors(model: Transformer, out: str | Path, tokenizer_dir: str | Path,
                              dtype: torch.dtype | None = None) -> Path:
    """Write a W8A8 ``model`` in the layout vLLM serves: ``lm_head`` float, in ``ignore``.

    An int8 ``lm_head`` is written dequantized (weight-only rounding; quantize with
    ``lm_head="float"`` to export the original weights). ``dtype`` converts the float
    tensors (norms, embeddings, lm_head), e.g. ``torch.bfloat16`` for GPU serving.
    """
    if not any(isinstance(m, Int8Linear) for m in model.modules()):
        raise QuasarError("export expects a quantized model")
    dtype = dtype or model.model.norm.weight.dtype
    head = model.lm_head
    cfg = model.config
    tensors = _state_tensors(model, cfg.tie_word_embeddings, dtype)
    if isinstance(head, Int8Linear):
        for k in ("lm_head.weight", "lm_head.weight_scale"):
            tensors.pop(k, None)
        tensors["lm_head.weight"] = head.dequantized_weight().to(dtype).contiguous().cpu()
        if head.bias is not None:
            tensors["lm_head.bias"] = head.bias.to(dtype).contiguous().cpu()
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    config = cfg.to_hf()
    config["torch_dtype"] = _dtype_name(dtype)
    config["quantization_config"] = quantization_config(["lm_head"])
    return _write_one_shard(Path(out), config, tensors, Path(tokenizer_dir))
