"""How faithful is a quantized model to the float model, token by token?

On held-out text (never used for calibration) both models score the same windows; per
predicted position we compare the next-token distributions: top-1 agreement (what
greedy acceptance depends on), KL(float || other) (its mean, median, 99th percentile and
maximum: one token can decide a mean), and each model's perplexity.

A model enters as a ``LogitsFn``: token ids in, one row of logits per id out, each call
scored from an empty cache. ``model_logits`` makes one of a Quasar Transformer; the bench
makes them of llama.cpp and OpenVINO too, so every engine is measured by the same
``compare_logits``. ``compare_models(float_model, w8a8_model, token_ids)`` scores two
Transformers; ``run_fidelity(llm, text)`` (what ``quasar eval fidelity`` does) an LLM's
float model against its ``w8a8`` verifier. Windows as for perplexity (``eval.windows``).
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from quasar.data.calibration import calibration_texts
from quasar.data.user_files import read_text_file
from quasar.errors import QuasarError
from quasar.eval.windows import default_stride, sliding_windows

DEFAULT_WINDOW = 512

LogitsFn = Callable[[list[int]], torch.Tensor]  # ids -> logits [len(ids), vocab]


def fidelity_text(text_file: str | None = None) -> str:
    """The user's text file, else the held-out calibration text (never calibrated on)."""
    if text_file:
        return read_text_file(text_file)
    return "\n\n".join(t for t in calibration_texts(part="heldout").values() if t.strip())


@contextmanager
def model_logits(model, window: int) -> Iterator[LogitsFn]:
    """A Transformer as a LogitsFn over up to ``window`` ids, on a KV cache of its own for
    the while (the model's cache is restored afterwards)."""
    saved = model.cache
    device = next(itertools.chain(model.parameters(), model.buffers())).device
    model.cache = None
    model.setup_cache(window)

    def logits(ids: list[int]) -> torch.Tensor:
        model.cache.length = 0  # read at call time: the same model may be open twice
        return model(torch.tensor([ids], device=device), logits="all")[0]

    try:
        yield logits
    finally:
        model.cache = saved


class _Tally:
    """Running sums of one model's agreement with the reference, window by window."""

    ROWS = 64  # rows per step: whole-vocabulary temporaries of a full window would set the peak memory

    def __init__(self):
        self.n = self.agree = 0
        self.kl_sum = self.kl_max = self.nll = self.seconds = 0.0
        self.kls: list[torch.Tensor] = []  # every token's KL: a mean one token can decide needs its quantiles

    def add(self, ref_logp: torch.Tensor, ref_top: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
            seconds: float) -> None:
        for i in range(0, target.numel(), self.ROWS):
            rows = slice(i, i + self.ROWS)
            logp = F.log_softmax(logits[rows], -1)
            kl = (ref_logp[rows].exp() * (ref_logp[rows] - logp)).sum(-1).clamp_min(0)
            self.agree += int((ref_top[rows] == logits[rows].argmax(-1)).sum())
            self.kl_sum += float(kl.sum())
            self.kl_max = max(self.kl_max, float(kl.max()))
            self.kls.append(kl.double().cpu())
            self.nll -= float(logp.gather(1, target[rows, None]).sum())
        self.n += target.numel()
        self.seconds += seconds

    def kl_quantile(self, q: float) -> float:
        return float(torch.quantile(torch.cat(self.kls), q))


@torch.inference_mode()
def compare_logits(reference: LogitsFn, candidates: dict[str, LogitsFn], token_ids: Sequence[int],
                   window: int = DEFAULT_WINDOW, stride: int | None = None, limit: int | None = None,
                   progress: bool = False) -> dict[str, dict]:
    """Score ``token_ids`` over sliding windows with the reference and every candidate (the
    reference once per window); {candidate: its metrics against the reference}."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise QuasarError(f"fidelity needs at least 2 tokens of text, got {len(ids)}")
    window = int(window)
    stride = int(stride or default_stride(window))
    if window < 2 or stride < 1:
        raise QuasarError(f"fidelity needs window >= 2 and stride >= 1, got {window} and {stride}")
    spans = sliding_windows(len(ids), window, stride)
    if limit is not None:
        spans = spans[: max(1, int(limit))]
    tallies = {name: _Tally() for name in candidates}
    n_ref, nll_ref, seconds_ref = 0, 0.0, 0.0
    with tqdm(total=len(spans) * (1 + len(candidates)), desc="fidelity", unit="forward", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        for start, end, first in spans:
            # position i predicts token i + 1: the targets ids[first:end] are predicted by the
            # window's rows first - 1 - start .. end - 2 - start
            rows = slice(first - 1 - start, end - 1 - start)
            t0 = time.perf_counter()
            ref = reference(ids[start:end])[rows].float()
            seconds_ref += time.perf_counter() - t0
            bar.update(1)
            # log_softmax copies: a model's output buffer may be reused by the next call
            ref_logp, ref_top = F.log_softmax(ref, -1), ref.argmax(-1)
            target = torch.tensor(ids[first:end], device=ref.device)
            nll_ref -= float(ref_logp.gather(1, target[:, None]).sum())
            n_ref += target.numel()
            for name, logits_of in candidates.items():
                t0 = time.perf_counter()
                logits = logits_of(ids[start:end])[rows]
                seconds = time.perf_counter() - t0
                bar.update(1)
                if logits.shape != ref.shape:
                    raise QuasarError(f"fidelity: {name} gave logits of shape {tuple(logits.shape)}, the "
                                      f"reference {tuple(ref.shape)} (a different vocabulary?)")
                tallies[name].add(ref_logp, ref_top, logits.to(ref.device).float(), target, seconds)
    ppl_ref = math.exp(nll_ref / n_ref)
    return {name: {
        "top1_agreement": t.agree / t.n,
        "kl_mean": t.kl_sum / t.n,
        "kl_median": t.kl_quantile(0.5),
        "kl_p99": t.kl_quantile(0.99),
        "kl_max": t.kl_max,
        "ppl_fp": ppl_ref,
        "ppl": math.exp(t.nll / t.n),
        "ppl_increase": math.exp(t.nll / t.n) / ppl_ref - 1.0,
        "tokens": t.n,
        "windows": len(spans),
        "window": window,
        "seconds_fp": round(seconds_ref, 3),
        "seconds": round(t.seconds, 3),
    } for name, t in tallies.items()}


def compare_models(float_model, quantized_model, token_ids: Sequence[int], window: int = DEFAULT_WINDOW,
                   stride: int | None = None, limit: int | None = None, progress: bool = False,
                   name: str = "w8a8") -> dict:
    """``compare_logits`` of two Transformers, the window capped by both contexts; see the
    module docstring. The second model's perplexity and time are keyed ``ppl_<name>`` and
    ``seconds_<name>``."""
    ctx = min(float_model.config.max_position_embeddings, quantized_model.config.max_position_embeddings)
    window = min(int(window), ctx)
    with ExitStack() as stack:
        reference = stack.enter_context(model_logits(float_model, window))
        other = stack.enter_context(model_logits(quantized_model, window))
        scores = compare_logits(reference, {name: other}, token_ids, window, stride, limit, progress)
    keys = {"ppl": f"ppl_{name}", "seconds": f"seconds_{name}"}
    return {keys.get(k, k): v for k, v in scores[name].items()}


def run_fidelity(llm, text: str, window: int = DEFAULT_WINDOW, stride: int | None = None,
                 limit: int | None = None, progress: bool = False, verifier: str = "w8a8") -> dict:
    """``compare_models`` of an ``LLM``'s float model and its `verifier` (w8a8 or w4a8) on
    ``text`` (tokenized with its tokenizer), the window capped by the LLM's context."""
    if not isinstance(text, str):
        raise QuasarError("run_fidelity(llm, text): text must be a string")
    window = min(window, llm.max_context)
    return compare_models(llm.model, llm.verifier_model(verifier), llm.tokenizer.encode(text), window, stride, limit,
                          progress, name=verifier)
