"""`--verifier w8a8`: the W8A8 copy of a model directory, quantized once and cached.

The directory is quantized layer by layer straight into the cache (never loading the float
model); decoding then loads only the int8 checkpoint.

The quantized checkpoint is kept under ``$QUASAR_CACHE/w8a8/`` keyed by the identity of
the model directory (path, sizes and modification times of its config and weights), the
float dtype and the quantization options (incl. the calibration file's content hash), so
later runs load it in about a second instead of recalibrating.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from quasar.errors import QuasarError
from quasar.models.llama import Transformer
from quasar.paths import cache_dir
from quasar.quant.options import QuantOptions

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _file_identity(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def model_identity(model_dir: Path) -> list:
    """What changes when the model directory's config or weights change."""
    model_dir = Path(model_dir).resolve()
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and
                   (p.name == "config.json" or p.suffix == ".safetensors" or p.name.endswith(".index.json")))
    return [str(model_dir), *[_file_identity(p) for p in files]]


def cache_key(model_dir: Path, dtype: torch.dtype, key: dict) -> str:
    from quasar.quant.checkpoint import FORMAT_VERSION

    blob = json.dumps({"model": model_identity(model_dir), "dtype": str(dtype), "options": key,
                       "format": FORMAT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_path(model_dir: Path, dtype: torch.dtype, key: dict, kind: str = "w8a8") -> Path:
    """The cache entry of `model_dir` quantized with options whose `QuantOptions.cache_key` is
    `key`, under ``$QUASAR_CACHE/<kind>/`` (kind: w8a8, or w4a8 with its own key)."""
    name = f"{Path(model_dir).resolve().name}-{_DTYPE_NAMES.get(dtype, str(dtype))}"
    return cache_dir(kind) / f"{name}-{cache_key(model_dir, dtype, key)}"


def _calib_text(calib: str | Path | None) -> tuple[str | None, str | None]:
    """(text, sha256) of a user calibration file, or (None, None) for the built-in corpus."""
    if calib is None:
        return None, None
    from quasar.data.user_files import read_text_file

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
    from quasar.quant.quantize import build_w8a8, quantize_to_dir

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
    target = cache_path(model_dir, dtype, options.cache_key(digest)) if cache else None
    if target is not None and (target / "config.json").is_file():
        try:
            return _load(target, dtype, options.backend)
        except QuasarError as e:  # damaged entry: rebuild it
            print(f"warning: rebuilding the W8A8 cache entry {target} ({e})", file=sys.stderr)
            shutil.rmtree(target, ignore_errors=True)
    if target is not None:
        if progress:
            print("quantizing the model to W8A8 layer by layer (once; the result is cached)...", file=sys.stderr)
        try:
            quantize_to_dir(model_dir, loaded.tokenizer, target, exist_ok=True, **build)
            return _load(target, dtype, options.backend)
        except OSError as e:  # a read-only or full cache must not stop decoding
            print(f"warning: could not cache the W8A8 model in {target} ({e}); building it in memory",
                  file=sys.stderr)
    from quasar.models.tensors import SafetensorsSource

    return build_w8a8(SafetensorsSource(model_dir), loaded.tokenizer, cfg=loaded.config, dtype=dtype, **build)


def _load(target: Path, dtype: torch.dtype, backend: str) -> Transformer:
    from quasar.models.hf import load_hf_dir

    return _with_backend(load_hf_dir(target, dtype), backend)


def _with_backend(model: Transformer, backend: str) -> Transformer:
    from quasar.quant.int8 import set_backend

    if backend != "auto":
        set_backend(model, backend)
    return model
