"""Calibration: what the inputs of every decoder linear layer look like on real text.

Forward hooks on the float model record, per linear layer, the per-input-channel maximum
``max|X_j|`` over all calibration tokens (SmoothQuant's activation statistic); for the
layers named in ``keep``, a random subsample of whole input rows (tokens) that the
per-group alpha search replays (see ``smooth.search_alpha``); and for the layers named in
``hessians``, ``X^T X`` over every ``hessian_stride``-th token (GPTQ's statistic).

Samples are ``n_samples`` windows of ``seq_len`` tokens cut evenly from each calibration
text (round-robin over the texts, so every domain is represented). The built-in corpus is
the *calibration* part of exllamav2's standard texts; their held-out tails are for
fidelity measurements only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError

DEFAULT_SAMPLES = 16
DEFAULT_SEQ_LEN = 512
DEFAULT_KEEP_ROWS = 256  # activation rows kept per layer for the alpha search


@dataclass
class CalibrationStats:
    """Per-linear activation statistics of a float model.

    ``act_max[name]``: float32 [in_features], max |input| per channel over all tokens.
    ``samples[name]``: float32 [rows, in_features], a subsample of input rows (only for
    the layers that were asked for).
    ``hessians[name]``: float64 [in, in], ``X^T X`` over a subsample of tokens (only for the
    layers asked for; GPTQ's second-order statistics).
    """

    act_max: dict[str, Tensor] = field(default_factory=dict)
    samples: dict[str, Tensor] = field(default_factory=dict)
    hessians: dict[str, Tensor] = field(default_factory=dict)
    n_samples: int = 0
    seq_len: int = 0
    n_tokens: int = 0
    source: str = ""

    def summary(self) -> dict:
        return {"samples": self.n_samples, "seq_len": self.seq_len, "tokens": self.n_tokens, "source": self.source}


def builtin_calibration_text() -> dict[str, str]:
    """The calibration part of the standard corpus (never its held-out tail)."""
    from quasar.data.calibration import calibration_texts

    return {k: v for k, v in calibration_texts(part="calibration").items() if v.strip()}


def token_windows(tokenizer, texts: str | Mapping[str, str], n_samples: int, seq_len: int) -> list[list[int]]:
    """Cut ``n_samples`` windows of ``seq_len`` tokens, spread evenly over each text.

    Windows are shared round-robin between the texts; within a text they start at evenly
    spaced line breaks. Only the pieces used are tokenized (a generous number of
    characters per window), so a large corpus costs little. A text shorter than one
    window contributes once, whole. Deterministic.
    """
    if n_samples < 1:
        raise QuasarError(f"calibration samples must be >= 1, got {n_samples}")
    if seq_len < 2:
        raise QuasarError(f"calibration sequence length must be >= 2, got {seq_len}")
    if isinstance(texts, str):
        texts = {"text": texts}
    bodies = [t for t in texts.values() if t.strip()]
    if not bodies:
        raise QuasarError("calibration text is empty")
    shares = [0] * len(bodies)
    for i in range(n_samples):
        shares[i % len(bodies)] += 1
    chars = seq_len * 12  # far more characters than seq_len tokens need
    windows: list[list[int]] = []
    for text, share in zip(bodies, shares):
        if share == 0:
            continue
        if len(text) <= chars:
            ids = tokenizer.encode(text)
            if len(ids) <= seq_len:
                if len(ids) >= 2:
                    windows.append(ids)
                continue
        span = max(0, len(text) - chars)
        for k in range(share):
            start = span * k // (share - 1) if share > 1 else span // 2
            if start > 0:  # begin at a line (or word) boundary
                nl = text.find("\n", start, start + chars // 4)
                start = nl + 1 if nl >= 0 else start
            ids = tokenizer.encode(text[start:start + chars])[:seq_len]
            if len(ids) >= 2:
                windows.append(ids)
    if not windows:
        raise QuasarError("calibration text is too short (fewer than 2 tokens)")
    return windows


def decoder_linears(model: nn.Module, include_lm_head: bool = True) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` of the decoder layers (and ``lm_head``) by its HF name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (name.startswith("model.layers.") or
                                               (include_lm_head and name == "lm_head")):
            out[name] = module
    return out


@torch.inference_mode()
def calibrate(model: nn.Module, windows: list[list[int]], keep: Iterable[str] = (),
              keep_rows: int = DEFAULT_KEEP_ROWS, include_lm_head: bool = True, progress: bool = True,
              seed: int = 0, source: str = "", hessians: Iterable[str] = (),
              hessian_stride: int = 4) -> CalibrationStats:
    """Run the float ``model`` over ``windows`` and collect input statistics per linear.

    ``include_lm_head=False`` skips the vocabulary projection (a large share of the time)
    when its statistics are not needed.

    The model's KV cache is swapped for a private one for the duration, so calibrating a
    model that is also serving requests leaves its cache untouched.
    """
    from tqdm import tqdm

    if not windows:
        raise QuasarError("no calibration windows")
    keep, hessians = set(keep), set(hessians)
    linears = decoder_linears(model, include_lm_head)
    unknown = (keep | hessians) - linears.keys()
    if unknown:
        raise QuasarError(f"calibration: no linear layer named {sorted(unknown)[0]!r}")
    stats = CalibrationStats(n_samples=len(windows), seq_len=max(len(w) for w in windows), source=source)
    per_window = max(1, -(-keep_rows // len(windows)))  # rows kept from each window, per layer
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list[Tensor]] = {name: [] for name in keep}
    pick: list[Tensor | None] = [None]  # row indices for the current window (same for all layers)

    def hook(name: str):
        def fn(module, args):
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1]).float()
            m = x2.abs().amax(dim=0)
            prev = stats.act_max.get(name)
            stats.act_max[name] = m if prev is None else torch.maximum(prev, m)
            if name in rows and pick[0] is not None:
                rows[name].append(x2[pick[0]].clone())
            if name in hessians:
                xs = x2[::hessian_stride]
                h = (xs.t() @ xs).double()
                prev = stats.hessians.get(name)
                stats.hessians[name] = h if prev is None else prev.add_(h)
        return fn

    handles = [lin.register_forward_pre_hook(hook(name)) for name, lin in linears.items()]
    saved_cache = getattr(model, "cache", None)
    dev = next(model.parameters()).device
    try:
        model.cache = None
        model.setup_cache(stats.seq_len)
        bar = tqdm(windows, desc="calibrating", unit="sample", file=sys.stderr, disable=not progress,
                   leave=False)
        for ids in bar:
            n = len(ids)
            take = min(per_window, n)
            pick[0] = torch.randperm(n, generator=gen)[:take].sort().values.to(dev)
            model.cache.length = 0
            # logits="all" makes lm_head see every position; "none" skips it
            model(torch.tensor([ids], device=dev), logits="all" if include_lm_head else "none")
            stats.n_tokens += n
    finally:
        for h in handles:
            h.remove()
        model.cache = saved_cache
    for name, chunks in rows.items():
        if chunks:
            stats.samples[name] = torch.cat(chunks)[:keep_rows].cpu()
    stats.act_max = {k: v.cpu() for k, v in stats.act_max.items()}
    stats.hessians = {k: v.cpu() for k, v in stats.hessians.items()}
    return stats
