"""Float model -> W8A8 model: copy, rotate, calibrate, smooth, round (GPTQ), swap linears.

``build_w8a8`` is the whole pipeline on a loaded float model (it never touches the float
model itself); ``quantize_model`` is the last step on a model you already calibrated.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping

import torch
from torch import Tensor, nn

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
from quasar.quant import fused_step
from quasar.quant.int8 import BACKEND_NAMES, Int8Linear
from quasar.quant.numerics import ACT_BITS, quantize_weight
from quasar.quant.smooth import bind_groups, input_owners, rotate_model, sample_names, smooth_model

DEFAULT_ALPHA: float | str = "auto"
DEFAULT_LM_HEAD = "int8"
DEFAULT_SMOOTH_O_DOWN = True
DEFAULT_ROTATE = True
DEFAULT_GPTQ = True
# Bits of the MLP down projection's activations (weights stay int8; see quasar.quant.int8):
# its inputs, silu(gate) * up, are the hardest for per-token int8. On the default model 15
# bits took top-1 agreement with the float model from 94.9% to ~97% (2,048 held-out
# tokens) and halved the KL, at the same bytes per step.
DEFAULT_DOWN_ACT_BITS = 15
GPTQ_DAMP = 0.1  # of the mean diagonal of X^T X
_GPTQ_BLOCK = 128
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


def check_options(alpha: float | str, lm_head: str, backend: str,
                  down_act_bits: int = DEFAULT_DOWN_ACT_BITS) -> float | str:
    if down_act_bits not in ACT_BITS:
        raise QuasarError(f"down_act_bits must be one of {', '.join(map(str, ACT_BITS))}, got {down_act_bits!r}")
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
def gptq_quantize(weight: Tensor, hessian: Tensor, damp: float = GPTQ_DAMP,
                  block: int = _GPTQ_BLOCK) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8 like ``quantize_weight`` (same scales), but the
    rounding of each column is chosen with error feedback onto the columns not yet
    quantized, weighted by the input second moments ``hessian`` = X^T X (GPTQ), which
    minimises ||X W^T - X Q^T|| instead of ||W - Q||. Returns (int8 [out, in], float32 [out, 1]).

    Batched: ``weight`` [B, out, in] with ``hessian`` [B, in, in] runs B independent
    problems at once (one Python loop over the columns for all of them).
    """
    single = weight.dim() == 2
    w = (weight[None] if single else weight).detach().float().clone()
    h = (hessian[None] if single else hessian).detach().double().clone()
    n_batch, _, n = w.shape
    scale = torch.stack([quantize_weight(w[b])[1] for b in range(n_batch)])  # [B, out, 1]
    diag = torch.diagonal(h, dim1=1, dim2=2)
    diag[diag <= 0] = 1.0  # inputs never seen: no error feedback through them
    diag += damp * diag.mean(dim=1, keepdim=True)
    try:
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    except RuntimeError:  # not positive definite even after damping: plain rounding
        q, s = zip(*(quantize_weight(w[b]) for b in range(n_batch)))
        q, s = torch.stack(q), torch.stack(s)
        return (q[0], s[0]) if single else (q, s)
    q = torch.empty_like(w)
    s2, inv = scale[:, None, :, 0], 1.0 / scale[:, None, :, 0]  # [B, 1, out]
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        wt = w[:, :, i1:i2].transpose(1, 2).contiguous()  # [B, cols, out]: a column is a row
        qt = torch.empty_like(wt)
        err = torch.empty_like(wt)
        u1 = u[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = wt[:, i:i + 1]
            qi = torch.round(col * inv).clamp_(-127, 127)
            qt[:, i:i + 1] = qi
            e = (col - qi * s2) / u1[:, i, i, None, None]
            err[:, i:i + 1] = e
            if i + 1 < i2 - i1:
                wt[:, i + 1:].baddbmm_(u1[:, i, i + 1:, None], e, alpha=-1)
        q[:, :, i1:i2] = qt.transpose(1, 2)
        if i2 < n:
            w[:, :, i2:].sub_(torch.bmm(err.transpose(1, 2), u[:, i1:i2, i2:]))
    q = q.to(torch.int8)
    return (q[0], scale[0]) if single else (q, scale)


def _gptq_weights(model: Transformer, names: list[str], stats: CalibrationStats, scales: dict[str, Tensor],
                  progress: bool, batch: int = 8) -> dict[str, tuple[Tensor, Tensor]]:
    """GPTQ-rounded (int8, scale) for the linears in ``names`` whose input has a Hessian.

    Linears reading the same input (q, k, v; gate, up) share it and are done as one
    matrix; same-shaped problems of different layers are batched. The Hessians come
    from the unsmoothed activations: smoothing divides the input by s, so H becomes
    H / (s s^T).
    """
    import sys

    from tqdm import tqdm

    modules = dict(model.named_modules())
    owners = input_owners(model)
    by_owner: dict[str, list[str]] = {}
    for name in names:
        owner = owners.get(name)
        if owner is not None and owner in stats.hessians:
            by_owner.setdefault(owner, []).append(name)
    by_shape: dict[tuple, list[str]] = {}
    for owner, group in by_owner.items():
        rows = sum(modules[n].out_features for n in group)
        by_shape.setdefault((rows, modules[group[0]].in_features, len(group)), []).append(owner)
    jobs = [owners_[i:i + batch] for owners_ in by_shape.values() for i in range(0, len(owners_), batch)]
    out = {}
    for job in tqdm(jobs, desc="gptq", unit="batch", file=sys.stderr, disable=not progress, leave=False):
        ws, hs = [], []
        for owner in job:
            h = stats.hessians[owner]
            s = scales.get(owner)
            if s is not None:
                s = s.double()
                h = h / (s[:, None] * s[None, :])
            hs.append(h)
            ws.append(torch.cat([modules[n].weight.detach().float() for n in by_owner[owner]]))
        q, scale = gptq_quantize(torch.stack(ws), torch.stack(hs))
        for b, owner in enumerate(job):
            start = 0
            for n in by_owner[owner]:
                rows = modules[n].out_features
                out[n] = (q[b, start:start + rows], scale[b, start:start + rows])
                start += rows
    return out


def _int8_linear(linear: nn.Linear, q: Tensor, scale: Tensor, backend: str, act_bits: int) -> Int8Linear:
    layer = Int8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, backend=backend,
                       device=linear.weight.device, act_bits=act_bits)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(scale)
    if linear.bias is not None:
        layer.bias.copy_(linear.bias.detach())
    return layer


@torch.no_grad()
def quantize_model(model: Transformer, stats: CalibrationStats, alpha: float | str = DEFAULT_ALPHA,
                   smooth_o_down: bool = DEFAULT_SMOOTH_O_DOWN, lm_head: str = DEFAULT_LM_HEAD,
                   backend: str = "auto", progress: bool = False, gptq: bool = DEFAULT_GPTQ,
                   down_act_bits: int = DEFAULT_DOWN_ACT_BITS) -> Transformer:
    """Smooth ``model`` in place (exact in float), then swap every decoder linear (and
    lm_head when ``lm_head="int8"``) for an ``Int8Linear``; the MLP down projections
    quantize their activations to ``down_act_bits``. Returns ``model``.

    With ``gptq`` the int8 weights of every linear whose input has a Hessian in ``stats``
    are rounded by GPTQ (same format and scales), the others by plain rounding. Records
    what was done in ``model.quant_info`` (read by the checkpoint writer).
    """
    alpha = check_options(alpha, lm_head, backend, down_act_bits)
    if is_quantized(model):
        raise QuasarError("model is already quantized")
    int8_head = lm_head == "int8"
    if int8_head:
        _untie_lm_head(model)
    scales: dict[str, torch.Tensor] = {}
    chosen = smooth_model(model, stats, alpha, smooth_o_down, lm_head=int8_head, progress=progress,
                          scales_out=scales)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
             and (n.startswith("model.layers.") or (int8_head and n == "lm_head"))]
    rounded = _gptq_weights(model, names, stats, scales, progress) if gptq else {}
    modules = dict(model.named_modules())
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        lin = modules[name]
        bits = down_act_bits if name.endswith("mlp.down_proj") else 8
        new = (_int8_linear(lin, *rounded[name], backend, bits) if name in rounded
               else Int8Linear.from_float(lin, backend, bits))
        setattr(parent, child, new)
    model.quant_info = {
        "alpha": alpha,
        "smooth_o_down": bool(smooth_o_down),
        "lm_head": lm_head,
        "backend": backend,
        "alphas": _alpha_summary(chosen),
        "gptq": bool(rounded),
        "down_act_bits": int(down_act_bits),
        "calibration": stats.summary(),
    }
    fused_step.install(model)
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
               gptq: bool = DEFAULT_GPTQ, backend: str = "auto", progress: bool = True,
               down_act_bits: int = DEFAULT_DOWN_ACT_BITS) -> Transformer:
    """Calibrate a copy of the float ``model`` and quantize it; ``model`` stays intact.

    ``calib_text`` (e.g. from ``quasar.data.read_text_file``) replaces the built-in
    calibration corpus. ``rotate`` first folds orthogonal rotations into the copy (see
    ``smooth.rotate_model``), then calibrates and smooths the rotated model.
    """
    alpha = check_options(alpha, lm_head, backend, down_act_bits)
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
    hessians = sorted({o for o in input_owners(work).values() if int8_head or o != "lm_head"}) if gptq else ()
    source = calib_source or ("file" if calib_text is not None else "builtin")
    stats = calibrate(work, windows, keep=keep, include_lm_head=int8_head, progress=progress, source=source,
                      hessians=hessians)
    quantize_model(work, stats, alpha, smooth_o_down, lm_head, backend, progress=progress, gptq=gptq,
                   down_act_bits=down_act_bits)
    work.quant_info["rotate"] = bool(rotate)
    work.quant_info["seconds"] = round(time.perf_counter() - t0, 1)
    return work
