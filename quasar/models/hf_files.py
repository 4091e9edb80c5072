"""A Hugging Face model directory's files: which hold the weights, and the check of them all
against the directory's manifest (quasar.cache.manifest). No torch: the loader
(quasar.models.hf) and the tensor reader (quasar.models.tensors) both start here."""

from __future__ import annotations

import json
from pathlib import Path

from quasar.cache.manifest import verify
from quasar.errors import QuasarError
from quasar.paths import in_cache


def check_manifest(model_dir: Path, weights: bool = True) -> int | None:
    """Check ``model_dir``'s files (without ``weights``: all but the safetensors) against its
    manifest; the bytes checked, or None without one. A damaged file is a QuasarError naming it."""
    select = None if weights else (lambda rel: not rel.endswith(".safetensors"))
    return verify(model_dir, required=in_cache(model_dir), select=select)


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise QuasarError(f"{index}: invalid shard index ({type(e).__name__}: {e})") from None
        files = [model_dir / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise QuasarError(f"{model_dir}: shard files listed in the index are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise QuasarError(f"{model_dir}: only pickle weights (.bin/.pt) found; Quasar reads safetensors only")
    raise QuasarError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
