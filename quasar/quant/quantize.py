"""Float model -> W8A8 model: copy, calibrate, smooth, swap linears for Int8Linear.

``build_w8a8`` is the whole pipeline on a loaded float model (it never touches the float
model itself); ``quantize_model`` is the last step on a model you already calibrated.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping

import torch
from torch import nn

from quasar.errors import QuasarError
from quasar.models.llama import Transformer
from quasar.quant.calibrate import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    CalibrationStats,
    builtin_calibration_text,
    calibrate,
    token_windows,
)
from quasar.quant.int8 import BACKEND_NAMES, Int8Linear
from quasar.quant.smooth import bind_groups, rotate_model, sample_names, smooth_model

DEFAULT_ALPHA: float | str = "auto"
DEFAULT_LM_HEAD = "int8"
DEFAULT_SMOOTH_O_DOWN = True
DEFAULT_ROTATE = False
LM_HEAD_CHOICES = ("int8", "float")


def parse_alpha(value: float | str) -> float | str:
    """'auto' or a number in [0, 1] (as float); anything else is a QuasarError."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = float(value)
        except ValueError:
            raise QuasarError(f"--alpha must be 'auto' or a number in [0, 1], got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise QuasarError(f"alpha must be 'auto' or a number in [0, 1], got {value!r}")
    return float(value)


def check_options(alpha: float | str, lm_head: str, backend: str) -> float | str:
    if lm_head not in LM_HEAD_CHOICES:
        raise QuasarError(f"lm_head must be one of {', '.join(LM_HEAD_CHOICES)}, got {lm_head!r}")
    if backend not in BACKEND_NAMES:
        raise QuasarError(f"unknown int8 backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return parse_alpha(alpha)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def clone_model(model: Transformer) -> Transformer:
    """A float copy with its own weights (ties kept) and no KV cache; ``model`` is untouched."""
    cfg = dataclasses.replace(model.config)
    with torch.device("meta"):
        new = Transformer(cfg)
    with torch.inference_mode(False), torch.no_grad():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        new.load_state_dict(state, assign=True, strict=True)
        if cfg.tie_word_embeddings:
            new.tie_weights()
        new.inv_freq = model.inv_freq.detach().clone()
    return new.eval()


def _untie_lm_head(model: Transformer) -> None:
    """Give lm_head its own weight so smoothing/quantizing it leaves the embeddings alone."""
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    model.config = dataclasses.replace(model.config, tie_word_embeddings=False)


@torch.no_grad()
def quantize_model(model: Transformer, stats: CalibrationStats, alpha: float | str = DEFAULT_ALPHA,
                   smooth_o_down: bool = DEFAULT_SMOOTH_O_DOWN, lm_head: str = DEFAULT_LM_HEAD,
                   backend: str = "auto", progress: bool = False) -> Transformer:
    """Smooth ``model`` in place (exact in float), then swap every decoder linear (and
    lm_head when ``lm_head="int8"``) for an ``Int8Linear``. Returns ``model``.

    Records what was done in ``model.quant_info`` (read by the checkpoint writer).
    """
    alpha = check_options(alpha, lm_head, backend)
    if is_quantized(model):
        raise QuasarError("model is already quantized")
    int8_head = lm_head == "int8"
    if int8_head:
        _untie_lm_head(model)
    chosen = smooth_model(model, stats, alpha, smooth_o_down, lm_head=int8_head, progress=progress)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
             and (n.startswith("model.layers.") or (int8_head and n == "lm_head"))]
    modules = dict(model.named_modules())
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, child, Int8Linear.from_float(modules[name], backend=backend))
    model.quant_info = {
        "alpha": alpha,
        "smooth_o_down": bool(smooth_o_down),
        "lm_head": lm_head,
        "backend": backend,
        "alphas": _alpha_summary(chosen),
        "calibration": stats.summary(),
    }
    return model


def _alpha_summary(chosen: Mapping[str, float | None]) -> dict[str, list]:
    """{"attn_in": [a_layer0, a_layer1, ...], ..., "head_in": [a]}: small enough for config.json."""
    out: dict[str, list] = {}
    for key, a in chosen.items():
        out.setdefault(key.rsplit(".", 1)[-1], []).append(None if a is None else round(a, 3))
    return out


def build_w8a8(model: Transformer, tokenizer, *, alpha: float | str = DEFAULT_ALPHA,
               smooth_o_down: bool = DEFAULT_SMOOTH_O_DOWN, lm_head: str = DEFAULT_LM_HEAD,
               calib_text: str | None = None, calib_source: str | None = None,
               samples: int = DEFAULT_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN, rotate: bool = DEFAULT_ROTATE,
               backend: str = "auto", progress: bool = True) -> Transformer:
    """Calibrate a copy of the float ``model`` and quantize it; ``model`` stays intact.

    ``calib_text`` (e.g. from ``quasar.data.read_text_file``) replaces the built-in
    calibration corpus. ``rotate`` first folds orthogonal rotations into the copy (see
    ``smooth.rotate_model``), then calibrates and smooths the rotated model.
    """
    alpha = check_options(alpha, lm_head, backend)
    if is_quantized(model):
        raise QuasarError("model is already quantized")
    seq_len = min(seq_len, model.config.max_position_embeddings)
    texts = calib_text if calib_text is not None else builtin_calibration_text()
    windows = token_windows(tokenizer, texts, samples, seq_len)
    t0 = time.perf_counter()
    work = clone_model(model)
    if rotate:
        rotate_model(work)
    int8_head = lm_head == "int8"
    keep = sample_names(bind_groups(work, smooth_o_down, int8_head)) if alpha == "auto" else ()
    source = calib_source or ("file" if calib_text is not None else "builtin")
    stats = calibrate(work, windows, keep=keep, include_lm_head=int8_head, progress=progress, source=source)
    quantize_model(work, stats, alpha, smooth_o_down, lm_head, backend, progress=progress)
    work.quant_info["rotate"] = bool(rotate)
    work.quant_info["seconds"] = round(time.perf_counter() - t0, 1)
    return work
