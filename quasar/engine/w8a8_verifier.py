"""`--verifier w8a8`: the W8A8 copy of a model directory, quantized once and cached.

The directory is quantized layer by layer straight into the cache (never loading the float
model); decoding then loads only the int8 checkpoint.

The quantized checkpoint is kept under ``$QUASAR_CACHE/w8a8/`` keyed by what the model
directory holds (names, sizes and sampled content hashes of its config and weights: never
its path, so a GGUF's conversion and a copied cache keep their keys), the float dtype and the
quantization options (incl. the calibration file's content hash), so later runs load it in
about a second instead of recalibrating. Loading checks the entry against its manifest; a
damaged one is rebuilt with a one-line warning (quasar.cache.entries). One process builds an
entry while others wait for it (quasar.fileio.atomic_dir).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from quasar.cache.entries import entry_path, lookup
from quasar.cache.keys import dir_key
from quasar.data.user_files import read_text_file
from quasar.errors import QuasarError
from quasar.models.hf import load_hf_dir
from quasar.models.llama import Transformer
from quasar.models.tensors import SafetensorsSource
from quasar.paths import cache_dir
from quasar.quant import quantize
from quasar.quant.checkpoint import FORMAT_VERSION
from quasar.quant.options import QuantOptions
from quasar.runtime.w8a8 import set_backend

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


_TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                    "chat_template.json")


def _identifies(name: str) -> bool:
    """The files a W8A8 copy is made from: the config, the weights and the tokenizer (it
    tokenizes the calibration text, and the copy carries it)."""
    return (name == "config.json" or name.endswith((".safetensors", ".index.json")) or name.startswith("tokenizer")
            or name in _TOKENIZER_FILES)


def model_identity(model_dir: Path) -> list:
    """What changes when the model directory's config, weights or tokenizer change: their
    names, sizes and sampled content hashes (quasar.cache.keys), not the directory's path or
    times."""
    model_dir = Path(model_dir)
    return dir_key(model_dir, [p.name for p in model_dir.iterdir() if p.is_file() and _identifies(p.name)])


def cache_key(model_dir: Path, dtype: torch.dtype, key: dict) -> str:
    blob = json.dumps({"model": model_identity(model_dir), "dtype": str(dtype), "options": key,
                       "format": FORMAT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_path(model_dir: Path, dtype: torch.dtype, key: dict, kind: str = "w8a8") -> Path:
    """The cache entry of `model_dir` quantized with options whose `QuantOptions.cache_key` is
    `key`, under ``$QUASAR_CACHE/<kind>/`` (kind: w8a8, or w4a8 with its own key)."""
    label = f"{Path(model_dir).resolve().name}-{_DTYPE_NAMES.get(dtype, str(dtype))}"
    return entry_path(cache_dir(kind), label, cache_key(model_dir, dtype, key))


def _calib_text(calib: str | Path | None) -> tuple[str | None, str | None]:
    """(text, sha256) of a user calibration file, or (None, None) for the built-in corpus."""
    if calib is None:
        return None, None
    text = read_text_file(calib)
    return text, hashlib.sha256(text.encode()).hexdigest()


def w8a8_verifier(loaded, options: QuantOptions | None = None, *, cache: bool = True,
                  progress: bool | None = None) -> Transformer:
    """The W8A8 Transformer for ``loaded`` (a ``LoadedModel``), from its directory alone,
    quantized as ``options`` say (default: ``QuantOptions()``).

    A directory that is already W8A8 (a quantized checkpoint) gives ``loaded.model`` as is.
    Otherwise the first call quantizes the directory layer by layer (tens of seconds for the
    default model) straight into the cache; later calls with the same model and options
    load that checkpoint. The float model is never loaded for this.
    """
    options = options or QuantOptions()
    model_dir = Path(loaded.model_dir)
    if loaded.quantized:
        if loaded.quant_kind != "w8a8":
            raise QuasarError(f"{loaded.source} is a {loaded.quant_kind.upper()} checkpoint; decode it with "
                              f"--verifier {loaded.quant_kind}, or give the float model for w8a8", param="verifier")
        return _with_backend(loaded.model, options.backend)
    if progress is None:
        progress = sys.stderr.isatty()
    text, digest = _calib_text(options.calib)
    # The verifier's float parts (norms, embeddings, biases) are float32 whatever the float
    # model's dtype: they are a small share of the bytes, and the fused step needs them so.
    dtype = torch.float32
    build = dict(options=options, calib_text=text, progress=progress)
    if cache:
        target = cache_path(model_dir, dtype, options.cache_key(digest))
        model = lookup(target, lambda entry: _load(entry, dtype, options.backend), "W8A8")
        if model is not None:
            return model
        try:
            quantize.quantize_to_dir(loaded.weights_dir(), loaded.tokenizer, target, exist_ok=True,
                                     announce=f"quantizing the model to W8A8 layer by layer, once (cached in {target})",
                                     **build)
            return _load(target, dtype, options.backend)
        except OSError as e:  # a read-only or full cache must not stop decoding
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"warning: could not cache the W8A8 model ({why}); building it in memory", file=sys.stderr)
    return quantize.build_w8a8(SafetensorsSource(loaded.weights_dir()), loaded.tokenizer, cfg=loaded.config,
                               dtype=dtype, **build)


def _load(target: Path, dtype: torch.dtype, backend: str) -> Transformer:
    return _with_backend(load_hf_dir(target, dtype), backend)


def _with_backend(model: Transformer, backend: str) -> Transformer:
    if backend != "auto":
        set_backend(model, backend)
    return model
