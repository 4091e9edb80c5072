"""How faithful is the W8A8 verifier to the float model, token by token?

On held-out text (never used for calibration) both models score the same windows; per
predicted position we compare the next-token distributions: top-1 agreement (what
greedy acceptance depends on), KL(float || w8a8), and each model's perplexity.

``compare_models(float_model, w8a8_model, token_ids)`` scores two Transformers;
``run_fidelity(llm, text)`` (what ``quasar eval fidelity`` does) an LLM's float model
against its ``w8a8`` verifier. Windows as for perplexity (``eval.windows``).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from quasar.data.calibration import calibration_texts
from quasar.data.user_files import read_text_file
from quasar.errors import QuasarError
from quasar.eval.windows import default_stride, sliding_windows

DEFAULT_WINDOW = 512


def fidelity_text(text_file: str | None = None) -> str:
    """The user's text file, else the held-out calibration text (never calibrated on)."""
    if text_file:
        return read_text_file(text_file)
    return "\n\n".join(t for t in calibration_texts(part="heldout").values() if t.strip())


class _PrivateCache:
    """Give a model a temporary KV cache of ``size``; restore its own afterwards."""

    def __init__(self, model, size: int):
        self.model, self.size = model, size

    def __enter__(self):
        self.saved = self.model.cache
        self.model.cache = None
        self.model.setup_cache(self.size)
        return self.model

    def __exit__(self, *exc):
        self.model.cache = self.saved


@torch.inference_mode()
def compare_models(float_model, w8a8_model, token_ids: Sequence[int], window: int = DEFAULT_WINDOW,
                   stride: int | None = None, limit: int | None = None, progress: bool = False) -> dict:
    """Score ``token_ids`` with both models over sliding windows; see the module docstring."""
    from tqdm import tqdm

    ids = list(token_ids)
    if len(ids) < 2:
        raise QuasarError(f"fidelity needs at least 2 tokens of text, got {len(ids)}")
    ctx = min(float_model.config.max_position_embeddings, w8a8_model.config.max_position_embeddings)
    window = min(int(window), ctx)
    stride = int(stride or default_stride(window))
    if window < 2 or stride < 1:
        raise QuasarError(f"fidelity needs window >= 2 and stride >= 1, got {window} and {stride}")
    spans = sliding_windows(len(ids), window, stride)
    if limit is not None:
        spans = spans[: max(1, int(limit))]
    dev_f = next(float_model.parameters()).device
    n = agree = 0
    kl_sum = nll_fp = nll_q = 0.0
    kl_max = 0.0
    t_fp = t_q = 0.0
    with _PrivateCache(float_model, window), _PrivateCache(w8a8_model, window):
        for start, end, first in tqdm(spans, desc="fidelity", unit="window", file=sys.stderr,
                                      disable=not progress, leave=False):
            x = torch.tensor([ids[start:end]], device=dev_f)
            float_model.cache.length = 0
            t0 = time.perf_counter()
            lf = float_model(x, logits="all")[0]
            t1 = time.perf_counter()
            w8a8_model.cache.length = 0  # (the same model may be passed twice)
            lq = w8a8_model(x.to(next(w8a8_model.buffers()).device), logits="all")[0].to(lf.device)
            t_fp, t_q = t_fp + t1 - t0, t_q + time.perf_counter() - t1
            # position i predicts token i + 1: the targets ids[first:end] are predicted by the
            # window's rows first - 1 - start .. end - 2 - start
            lf, lq = lf[first - 1 - start:end - 1 - start].float(), lq[first - 1 - start:end - 1 - start].float()
            target = torch.tensor(ids[first:end], device=lf.device)
            pf, pq = F.log_softmax(lf, -1), F.log_softmax(lq, -1)
            kl = (pf.exp() * (pf - pq)).sum(-1).clamp_min(0)
            agree += int((lf.argmax(-1) == lq.argmax(-1)).sum())
            kl_sum += float(kl.sum())
            kl_max = max(kl_max, float(kl.max()))
            nll_fp -= float(pf.gather(1, target[:, None]).sum())
            nll_q -= float(pq.gather(1, target[:, None]).sum())
            n += target.numel()
    ppl_fp, ppl_q = math.exp(nll_fp / n), math.exp(nll_q / n)
    return {
        "top1_agreement": agree / n,
        "kl_mean": kl_sum / n,
        "kl_max": kl_max,
        "ppl_fp": ppl_fp,
        "ppl_w8a8": ppl_q,
        "ppl_increase": ppl_q / ppl_fp - 1.0,
        "tokens": n,
        "windows": len(spans),
        "window": window,
        "seconds_fp": round(t_fp, 3),
        "seconds_w8a8": round(t_q, 3),
    }


def run_fidelity(llm, text: str, window: int = DEFAULT_WINDOW, stride: int | None = None,
                 limit: int | None = None, progress: bool = False) -> dict:
    """``compare_models`` of an ``LLM``'s float model and its ``w8a8`` verifier on ``text``
    (tokenized with its tokenizer), the window capped by the LLM's context; see there."""
    if not isinstance(text, str):
        raise QuasarError("run_fidelity(llm, text): text must be a string")
    window = min(window, llm.max_context)
    return compare_models(llm.model, llm.verifier_model("w8a8"), llm.tokenizer.encode(text), window, stride, limit,
                          progress)
