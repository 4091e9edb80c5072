"""Load a Hugging Face model directory: config.json + safetensors (single or sharded).

No pickle, no `trust_remote_code`: only safetensors are read, memory-mapped
(`safetensors_mmap`). Weights keep their stored dtype unless another float dtype is asked
for; int8 weights and `*_scale` tensors are never converted. A directory with a manifest
(quasar.cache.manifest: what Quasar writes) is checked against it when its weights load; one
in the cache must have one, a user's may not (older checkpoints, other tools' exports).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quasar.errors import QuasarError
from quasar.models.config import ModelConfig
from quasar.models.families import transformer
from quasar.models.formats import quantized_format
from quasar.models.hf_files import check_manifest, weight_files
from quasar.models.layouts import layout_tensors
from quasar.models.llama import Transformer, rope_inv_freq
from quasar.models.safetensors_mmap import mmap_safetensors, tensor_entries


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise QuasarError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuasarError(f"{path}: invalid JSON ({e})") from None


def check_weight_files(model_dir: Path) -> None:
    """Fail now, with a one-line QuasarError, on missing, pickle-only or damaged weight files
    (reads their headers only)."""
    for f in weight_files(model_dir):
        tensor_entries(f)


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of `files`, memory-mapped (see `safetensors_mmap`)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(mmap_safetensors(f))
    return tensors


_QUANT_PARAMS = ("_scale", ".scales", ".offsets", ".super_scales", ".super_offsets")


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str,
                dtype: torch.dtype = torch.float32, quant_config: dict | None = None) -> Transformer:
    """Instantiate the decoder and fill it from `tensors` (HF names), strictly."""
    tensors = layout_tensors(cfg, tensors)  # fused or renamed tensors of some families, as Llama's
    with torch.device("meta"):
        model = transformer(cfg)
    if quant_config is not None:
        quantized_format(quant_config, source)(model, quant_config, tensors)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = set(model.state_dict().keys())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        raise QuasarError(f"{source}: weights do not match a {cfg.model_type} model ({'; '.join(parts)})")
    # Quantization scales keep their stored dtype (int8 layers' float32 ``*_scale``, 4-bit
    # layers' float16 ``*.scales`` / ``*.offsets`` and Q4_K / Q6_K factors); only the float
    # model's tensors take `dtype`.
    state = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith(_QUANT_PARAMS) else v)
             for k, v in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.inv_freq = rope_inv_freq(cfg)  # buffers are not in the checkpoint
    return model.eval()


def load_hf_dir(model_dir: Path, dtype: torch.dtype = torch.float32) -> Transformer:
    check_manifest(model_dir, weights=False)  # the config and index as written, before they are read
    raw = read_config(model_dir)
    cfg = ModelConfig.from_hf(raw)
    tensors = read_safetensors(weight_files(model_dir))  # the headers checked against the sizes first
    check_manifest(model_dir)
    return build_model(cfg, tensors, str(model_dir), dtype, raw.get("quantization_config"))
