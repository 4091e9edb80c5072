"""How faithful is the W8A8 verifier to the float model, token by token?

On held-out text (never used for calibration) both models score the same windows; per
predicted position we compare the next-token distributions: top-1 agreement (what
greedy acceptance depends on), KL(float || w8a8), and each model's perplexity.

Two ways to call ``run_fidelity``:
- ``run_fidelity(float_model, w8a8_model, token_ids, window=512)`` on Transformers;
- ``run_fidelity(llm, text, window=..., stride=..., limit=..., progress=...)`` on a
  ``quasar.api.LLM`` (what ``quasar eval fidelity`` does): its float model against its
  ``w8a8`` verifier, ``text`` tokenized with its tokenizer.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from quasar.errors import QuasarError

DEFAULT_WINDOW = 512


def fidelity_text(limit_tokens: int | None = None, tokenizer=None) -> str:
    """Held-out text (the tails of the standard calibration texts), an equal share of each.

    With ``limit_tokens``, each text contributes about ``limit_tokens / n_texts`` tokens
    (counted with ``tokenizer`` when given, else estimated at 4 characters a token), cut
    at a line break where possible.
    """
    from quasar.data import calibration_texts

    texts = [t for t in calibration_texts(part="heldout").values() if t.strip()]
    if limit_tokens is None:
        return "\n\n".join(texts)
    if limit_tokens < 1:
        raise QuasarError(f"limit_tokens must be >= 1, got {limit_tokens}")
    share = -(-limit_tokens // len(texts))
    parts = []
    for t in texts:
        if tokenizer is not None:
            ids = tokenizer.encode(t, add_special_tokens=False)
            piece = t if len(ids) <= share else tokenizer.decode(ids[:share], skip_special_tokens=False)
        else:
            piece = t[: share * 4]
        cut = piece.rfind("\n")
        parts.append(piece[:cut] if cut > len(piece) // 2 else piece)
    return "\n\n".join(parts)


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


def _windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) per window: position p predicts token p + 1.

    Windows advance by ``stride`` (at most ``window - 1``, so no target is skipped); each
    target is scored once, in the first window that reaches it; the last window is moved
    back to full length when the text allows.
    """
    stride = max(1, min(stride, window - 1))
    out, start, scored = [], 0, 0  # targets 1..scored are done
    while scored < n - 1:
        end = min(start + window, n)
        out.append((start, end, max(scored, start)))
        scored = end - 1
        start = max(0, min(start + stride, n - window))
    return out


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
    stride = int(stride or window - 1)
    if window < 2 or stride < 1:
        raise QuasarError(f"fidelity needs window >= 2 and stride >= 1, got {window} and {stride}")
    spans = _windows(len(ids), window, stride)
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
            # position i predicts token i+1; score targets start+1+i for indices >= first
            lo = first - start
            lf, lq = lf[lo:end - start - 1].float(), lq[lo:end - start - 1].float()
            target = torch.tensor(ids[first + 1:end], device=lf.device)
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


def run_fidelity(first, second, token_ids: Sequence[int] | None = None, window: int = DEFAULT_WINDOW,
                 stride: int | None = None, limit: int | None = None, progress: bool = False) -> dict:
    """``run_fidelity(float_model, w8a8_model, token_ids, window)`` or ``run_fidelity(llm, text, ...)``.

    Returns a dict with ``top1_agreement``, ``kl_mean`` (nats), ``ppl_fp``, ``ppl_w8a8``,
    plus ``kl_max``, ``ppl_increase`` (relative), ``tokens`` scored, ``windows``, ``window``
    and the seconds each model took. ``limit`` caps the number of windows.
    """
    from quasar.models.llama import Transformer

    if isinstance(first, Transformer):
        if not isinstance(second, Transformer) or token_ids is None:
            raise QuasarError("run_fidelity(float_model, w8a8_model, token_ids, window): missing arguments")
        return compare_models(first, second, token_ids, window, stride, limit, progress)
    llm, text = first, second
    if not isinstance(text, str):
        raise QuasarError("run_fidelity(llm, text): text must be a string")
    ids = token_ids if token_ids is not None else llm.tokenizer.encode(text)
    w8a8 = llm.verifier_model("w8a8")
    window = min(window, getattr(llm, "max_context", window))
    result = compare_models(llm.model, w8a8, ids, window, stride, limit, progress)
    return result
