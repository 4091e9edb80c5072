"""Resolve a model source (`default` or another packaged model's name, a GGUF file, a Hugging
Face directory) and open it.

Opening reads the config and the tokenizer only; the weights are loaded on first use of
`LoadedModel.model`, so a caller that never needs them (decoding with a cached W8A8
verifier) never pays for them. What is read is checked against the directory's manifest
first (quasar.cache.manifest): the config and tokenizer on opening, the weights when
`weights_dir` or `model` first needs them (a GGUF's damaged conversion is then rebuilt).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quasar.data.packages import packaged_model_path
from quasar.defaults import DEFAULT_4BIT_VERIFIER, DEFAULT_VERIFIER
from quasar.errors import QuasarError
from quasar.models.config import ModelConfig
from quasar.models.gguf import gguf_to_hf_dir
from quasar.models.gguf_groups import stores_int4
from quasar.models.hf import check_manifest, check_weight_files, load_hf_dir, read_config
from quasar.models.llama import Transformer
from quasar.models.tokenizer import Tokenizer

DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}
# "auto": the dtype the weights are stored in, so a bf16 model is never upcast whole; other
# half-precision formats compute in float32 (this engine's float kernels are fp32 and bf16).
_STORED = {"bfloat16": torch.bfloat16}


def stored_dtype(raw_config: dict) -> torch.dtype:
    """The float dtype `auto` picks for a config.json (transformers writes `torch_dtype`, v5 `dtype`)."""
    name = raw_config.get("torch_dtype") or raw_config.get("dtype")
    return _STORED.get(str(name), torch.float32)


class LoadedModel:
    """A model directory opened for decoding: its config and tokenizer now, its weights lazily.

    `quantized` says the directory is itself a W8A8 or W4A8 checkpoint (config.json has a
    quantization_config; `quant_kind` says which); then `model` is that quantized model,
    otherwise the float one.
    """

    def __init__(self, tokenizer: Tokenizer, model_dir: Path, source: str, config: ModelConfig,
                 dtype: torch.dtype, quantization_config: dict | None, stores_int4: bool = False):
        self.tokenizer = tokenizer
        self.model_dir = model_dir  # the HF-format directory of the weights (cache dir for GGUF)
        self.source = source  # what the user asked for
        self.config = config
        self.dtype = dtype  # the float dtype asked for
        self.quantization_config = quantization_config
        self.stores_int4 = stores_int4  # a GGUF file with 4-bit tensors (Q4_0, Q4_1, Q4_K)
        self._model: Transformer | None = None
        self._weights_checked = False

    @property
    def quantized(self) -> bool:
        return self.quantization_config is not None

    @property
    def quant_kind(self) -> str | None:
        """The verifier a quantized checkpoint is ("w8a8" or "w4a8"); None for a float model."""
        if not self.quantized:
            return None
        qc = self.quantization_config
        return "w4a8" if isinstance(qc, dict) and qc.get("quant_method") == "quasar-w4a8" else "w8a8"

    @property
    def default_verifier(self) -> str:
        """The verifier a model decodes with unless told: a quantized checkpoint's own kind, a
        4-bit GGUF's own precision (the faithful W4A8 layout, which keeps the file's 4-bit
        groups and its wider tensors as wide), else W8A8."""
        if self.quantized:
            return self.quant_kind
        return DEFAULT_4BIT_VERIFIER if self.stores_int4 else DEFAULT_VERIFIER

    def weights_dir(self) -> Path:
        """``model_dir`` once its weights have been checked against its manifest (the first
        call reads them all): a GGUF's damaged conversion is rebuilt with a warning, a user's
        damaged directory is a QuasarError naming the file. Call it before reading the weights."""
        if not self._weights_checked:
            self.model_dir = resolve_model_dir(self.source, weights=True)
            self._weights_checked = True
        return self.model_dir

    @property
    def model(self) -> Transformer:
        """The model's weights as a Transformer, loaded (memory-mapped) on first access."""
        if self._model is None:
            self._model = load_hf_dir(self.weights_dir(), self.dtype)
        return self._model

    @property
    def float_loaded(self) -> bool:
        """Whether the float model's weights have been loaded (never, for a quantized checkpoint)."""
        return self._model is not None and not self.quantized


def resolve_model_dir(source: str | Path, weights: bool = False) -> Path:
    """Map a model source to a Hugging Face-format directory (converting GGUF once), checked
    against its manifest: all of it with ``weights``, else all but the weights."""
    source = packaged_model_path(source) or source
    path = Path(source).expanduser()
    if not path.exists():
        raise QuasarError(f"model not found: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise QuasarError(f"{path}: expected a .gguf file or a model directory")
        return gguf_to_hf_dir(path, weights)
    check_manifest(path, weights)
    return path


def load_model(source: str | Path = "default", dtype: str = "auto") -> LoadedModel:
    """Open `source`: its config, tokenizer and weight-file headers; the weights themselves
    load on first use of `.model`."""
    if dtype not in DTYPES:
        raise QuasarError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    model_dir = resolve_model_dir(source)
    raw = read_config(model_dir)
    config = ModelConfig.from_hf(raw)
    check_weight_files(model_dir)  # bad files are reported now, not at first use
    tokenizer = Tokenizer(model_dir)
    tokenizer.add_eos_ids(config.eos_token_ids)
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        tokenizer.add_eos_ids([eos] if isinstance(eos, int) else (eos or []))
    torch_dtype = DTYPES[dtype] or stored_dtype(raw)
    return LoadedModel(tokenizer, model_dir, str(source), config, torch_dtype, raw.get("quantization_config"),
                       _stores_int4(source, raw))


def _stores_int4(source: str | Path, raw: dict) -> bool:
    """Whether `source` is a GGUF file with 4-bit tensors: as its conversion recorded it, or,
    for a conversion made before that was recorded, from the file's header."""
    info = raw.get("quasar_gguf")
    if isinstance(info, dict) and isinstance(info.get("int4_tensors"), bool):
        return info["int4_tensors"]
    path = gguf_file(source)
    if path is None:
        return False
    return stores_int4(path)


def gguf_file(source: str | Path) -> Path | None:
    """The GGUF file a model source (`--model`) names ('default' is one), or None (a directory)."""
    packaged = packaged_model_path(source)
    if packaged is not None:
        return Path(packaged)
    path = Path(source).expanduser()
    return path if path.suffix.lower() == ".gguf" else None
