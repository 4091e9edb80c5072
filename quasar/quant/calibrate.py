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

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import Tensor, nn

from quasar.data.calibration import calibration_texts
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
    ``hessians[name]``: float32 [in, in], ``X^T X`` over a subsample of tokens (only for the
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


class StatsCollector:
    """Accumulates ``CalibrationStats`` from the inputs of named linear layers.

    ``observe(name, x)`` takes one window's input rows of a layer; ``hook(modules)`` feeds
    it from forward pre-hooks instead. Call ``window(n_tokens)`` before each calibration
    window: it picks the rows kept for the alpha search (the same rows for every layer).
    Hessians (``X^T X`` over every ``hessian_stride``-th token) are summed in float32: over
    a few dozen windows that is well within what GPTQ's damped Cholesky needs, at half the
    memory of float64.
    """

    def __init__(self, n_windows: int, keep: Iterable[str] = (), hessians: Iterable[str] = (),
                 keep_rows: int = DEFAULT_KEEP_ROWS, seed: int = 0, hessian_stride: int = 4):
        self.stats = CalibrationStats()
        self.keep, self.hessian_names = set(keep), set(hessians)
        self.keep_rows, self.stride = keep_rows, hessian_stride
        self.per_window = max(1, -(-keep_rows // max(1, n_windows)))  # rows kept per window, per layer
        self._gen = torch.Generator().manual_seed(seed)
        self._rows: dict[str, list[Tensor]] = {name: [] for name in self.keep}
        self._pick: Tensor | None = None
        self._handles: list = []

    def window(self, n_tokens: int) -> None:
        take = min(self.per_window, n_tokens)
        self._pick = torch.randperm(n_tokens, generator=self._gen)[:take].sort().values

    def observe(self, name: str, x: Tensor) -> None:
        st = self.stats
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        m = x2.abs().amax(dim=0).cpu()
        prev = st.act_max.get(name)
        st.act_max[name] = m if prev is None else torch.maximum(prev, m)
        if name in self._rows and self._pick is not None:
            self._rows[name].append(x2[self._pick.to(x2.device)].cpu())
        if name in self.hessian_names:
            xs = x2[::self.stride]
            h = (xs.t() @ xs).cpu()
            prev = st.hessians.get(name)
            st.hessians[name] = h if prev is None else prev.add_(h)

    def hook(self, modules: Mapping[str, nn.Module]) -> "StatsCollector":
        unknown = (self.keep | self.hessian_names) - modules.keys()
        if unknown:
            raise QuasarError(f"calibration: no linear layer named {sorted(unknown)[0]!r}")
        for name, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, args, name=name: self.observe(name, args[0])))
        return self

    def finish(self) -> CalibrationStats:
        """Remove the hooks and return the statistics."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for name, chunks in self._rows.items():
            if chunks:
                self.stats.samples[name] = torch.cat(chunks)[:self.keep_rows]
        return self.stats
