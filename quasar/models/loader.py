"""Resolve a model source (`default`, a GGUF file, a Hugging Face directory) and load it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from quasar.errors import QuasarError
from quasar.models.hf import load_hf_dir
from quasar.models.llama import Transformer
from quasar.models.tokenizer import Tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    model_dir: Path  # the HF-format directory the weights came from (cache dir for GGUF)
    source: str  # what the user asked for


def resolve_model_dir(source: str | Path) -> Path:
    """Map a model source to a Hugging Face-format directory (converting GGUF once)."""
    if str(source) == "default":
        from quasar.data.packages import default_model_path

        source = default_model_path()
    path = Path(source).expanduser()
    if not path.exists():
        raise QuasarError(f"model not found: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise QuasarError(f"{path}: expected a .gguf file or a model directory")
        from quasar.models.gguf import gguf_to_hf_dir

        return gguf_to_hf_dir(path)
    return path


def load_model(source: str | Path = "default", dtype: str = "fp32") -> LoadedModel:
    if dtype not in DTYPES:
        raise QuasarError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    model_dir = resolve_model_dir(source)
    model = load_hf_dir(model_dir, DTYPES[dtype])
    tokenizer = Tokenizer(model_dir)
    tokenizer.add_eos_ids(model.config.eos_token_ids)
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        tokenizer.add_eos_ids([eos] if isinstance(eos, int) else (eos or []))
    return LoadedModel(model, tokenizer, model_dir, str(source))
