"""Log-probabilities of emitted tokens, from the verifier's own logits.

A token's logprob is the log-softmax of the verifier logits row that emitted it: the raw
model distribution, before temperature, top-k and top-p. That is what OpenAI and vLLM
report, and it does not depend on the request's sampling settings (a sampled token may
rank below the top-1; for greedy decoding the emitted token is always the top-1). The
loop computes them only when a request asks, so the default path pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # most alternatives per token (OpenAI's chat limit)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens of the same row, (id, logprob), best first


def token_logprobs(rows: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Entry i: token_ids[i] scored by logits row i, with the row's `top_n` best tokens."""
    if not token_ids:
        return []
    logp = torch.log_softmax(rows.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if top_n:
        # Rank equal logprobs by token id, greedy's tie rule, so a greedy token is always its
        # row's first alternative. topk's order among ties is unspecified and a full sort of
        # the vocabulary costs more than a verifier step, so take every token at least as
        # likely as the row's n-th best (n of them but for ties) and sort those few.
        at_least = logp >= logp.topk(top_n, dim=-1).values[:, -1:]
        for (row, token), lp in zip(at_least.nonzero().tolist(), logp[at_least].tolist()):  # both row-major
            tops[row].append((token, lp))
        tops = [sorted(top, key=lambda e: (-e[1], e[0]))[:top_n] for top in tops]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]
