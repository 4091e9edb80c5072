"""Turning verifier logits into the distribution the output must follow, and drawing from it.

Speculative sampling is exact only with respect to the *processed* distribution, so the
same `probs_from_logits` must be applied to every verifier row (p_0..p_k) before
acceptance. Greedy decoding is the temperature-0 case: a one-hot at the argmax.
"""

from __future__ import annotations

import torch

from quasar.speculative.options import SamplingOptions


def make_generator(params: SamplingOptions, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from params.seed (reproducible) or from fresh entropy when None."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def probs_from_logits(logits: torch.Tensor, params: SamplingOptions) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p; return float32 probabilities over the last dim.

    Ties are broken towards the lower token id (stable sort, first argmax), so the kept set
    and the greedy choice are deterministic.
    """
    logits = logits.float()
    if params.greedy:
        return _one_hot_argmax(logits)
    # Shifted so the best logit is 0, and the temperature kept a normal number of the logits'
    # dtype: a tiny one then gives the limit (a one-hot, or uniform over tied maxima), not inf - inf.
    temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        logits = _keep_top_k(logits, params.top_k)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _keep_top_p(probs, params.top_p)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _sorted_desc(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Descending sort where equal values keep id order (lower id ranks first)."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def _keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    _, order = _sorted_desc(logits)
    drop = torch.ones_like(logits, dtype=torch.bool)
    drop.scatter_(-1, order[..., :k], False)
    return logits.masked_fill(drop, float("-inf"))


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest top-ranked set whose mass reaches top_p (always at least one token)."""
    sorted_p, order = _sorted_desc(probs)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a 1-D distribution (need not sum exactly to 1).

    Inverse-CDF with a single uniform from `generator`: one random number per draw keeps runs
    reproducible, and zero-probability tokens are never returned.
    """
    if probs.dim() != 1:
        raise ValueError(f"sample expects a 1-D distribution, got shape {tuple(probs.shape)}")
    cdf = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), generator=generator, device=generator.device, dtype=torch.float64)
    target = u.to(cdf.device) * cdf[-1]
    idx = int(torch.searchsorted(cdf, target.reshape(1), right=True).item())
    if idx >= probs.shape[0]:  # u * total rounded up to total: take the last token with mass
        nonzero = torch.nonzero(probs > 0)
        if nonzero.numel() == 0:
            raise ValueError("sample got a distribution with no positive mass")
        idx = int(nonzero[-1].item())
    return idx
