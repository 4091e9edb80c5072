"""Quantized checkpoint formats the model loader can read, registered by who implements them.

A Hugging Face directory whose config.json has a ``quantization_config`` is loaded by the
handler registered for its ``quant_method``: ``prepare(model, quant_config, tensors)`` swaps
the quantized layers of the (meta-device) model before the strict state-dict load. The
quantization package registers the W8A8 format on import (``quasar.quant``), so the model
code never depends on it. This module imports nothing heavy.
"""

from __future__ import annotations

from typing import Any, Callable

from quasar.errors import QuasarError

Prepare = Callable[[Any, dict, dict], int]
_FORMATS: dict[str, Prepare] = {}


def register_quantized_format(quant_method: str, prepare: Prepare) -> None:
    """Load checkpoints whose ``quantization_config.quant_method`` is ``quant_method`` with ``prepare``."""
    _FORMATS[quant_method] = prepare


def quantized_format(quant_config: Any, source: str) -> Prepare:
    """The handler for a checkpoint's ``quantization_config``; a QuasarError names what is unsupported."""
    if not isinstance(quant_config, dict):
        raise QuasarError(f"{source}: config.json's quantization_config must be an object")
    method = quant_config.get("quant_method")
    prepare = _FORMATS.get(method)
    if prepare is None:
        known = ", ".join(sorted(_FORMATS)) or "none registered; import quasar.quant"
        raise QuasarError(f"{source}: unsupported quantization method {method!r} (supported: {known})")
    return prepare
