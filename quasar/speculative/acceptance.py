"""Deciding which drafted tokens the verifier keeps, and how many to draft next time.

Row j of the verifier output is its distribution for the token after position j of
[last, d1..dk]; so row j judges d_{j+1}, and row k gives the bonus token when every draft
is accepted. Both rules return the emitted tokens: the accepted drafts plus exactly one
token chosen by the verifier, so 1..k+1 tokens, and `len(result) - 1` drafts accepted.
"""

from __future__ import annotations

import math

import torch

from quasar.errors import QuasarError
from quasar.speculative.drafters import DraftTree
from quasar.speculative.sampling import sample


def _check_rows(draft: list[int], rows: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.shape[0] != len(draft) + 1:
        raise ValueError(
            f"expected {len(draft) + 1} verifier rows for {len(draft)} drafts, "
            f"got shape {tuple(rows.shape)}"
        )


def accept_greedy(draft: list[int], logits: torch.Tensor) -> list[int]:
    """Keep drafts while each equals the verifier's argmax, then emit the argmax of the next row.

    Ties go to the lowest token id (torch.argmax), the same choice as plain greedy decoding,
    so the output equals autoregressive greedy decoding with this verifier.
    """
    _check_rows(draft, logits)
    return accept_greedy_tree(DraftTree.chain(draft), logits)[1]


def accept_sampling(draft: list[int], probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Speculative sampling for a deterministic draft: the output follows `probs` exactly.

    A draft d is accepted with probability p(d); on rejection the emitted token is drawn from
    p with d removed (renormalised), which adds up to p overall. With all drafts accepted a
    bonus token is drawn from the last row. `probs` must already be processed
    (temperature/top-k/top-p) the same way for every row; rows need not sum exactly to 1.
    """
    _check_rows(draft, probs)
    k = len(draft)
    out: list[int] = []
    if k:
        accepted = _accept_draws(draft, probs[:k], generator)
        for i, d in enumerate(draft):
            if accepted[i]:
                out.append(d)
                continue
            residual = probs[i].clone()
            residual[d] = 0
            if not bool(residual.sum() > 0):
                # p(d) holds all the mass and only rounding said "reject": d is certain.
                out.append(d)
                continue
            out.append(sample(residual, generator))
            return out
    out.append(sample(probs[k], generator))
    return out


def accept_greedy_tree(tree: DraftTree, logits: torch.Tensor,
                       best: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Greedy acceptance over a draft tree: from the pending token (row 0), follow the child
    whose token is the row's argmax while there is one. Row i + 1 judges node i's children.
    `best`: the rows' argmax when the caller has it already (torch.argmax's choices).

    Returns (accepted nodes, root first down the path; emitted tokens: theirs plus the
    argmax of the last accepted row). Equal to autoregressive greedy decoding of the
    verifier, and to `accept_greedy` on a chain.
    """
    if logits.dim() != 2 or logits.shape[0] != len(tree) + 1:
        raise ValueError(f"expected {len(tree) + 1} verifier rows for {len(tree)} draft nodes, "
                         f"got shape {tuple(logits.shape)}")
    if best is None:
        best = logits.argmax(dim=-1).tolist()  # one device sync for the whole step
    elif len(best) != len(tree) + 1:
        raise ValueError(f"expected {len(tree) + 1} argmax values, got {len(best)}")
    path, node = [], -1
    while True:
        want = best[node + 1]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return path, [tree.tokens[i] for i in path] + [want]
        path.append(nxt)
        node = nxt


def accept_sampling_tree(tree: DraftTree, probs: torch.Tensor,
                         generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Multi-candidate speculative sampling over a tree of deterministic drafts: exact.

    At a node whose verifier distribution is p (row node + 1, processed like `accept_sampling`),
    its children c1..cm (distinct tokens) are tried in order: accept c_i with probability
    p(c_i) / sum(p) and descend; on rejection set p(c_i) = 0 and try the next. If all are
    rejected, the emitted token is drawn from what is left of p. Each step of this keeps the
    emitted token's distribution exactly p (SpecInfer's recursive rejection with
    deterministic drafts). Returns (accepted nodes, emitted tokens) like `accept_greedy_tree`.
    """
    if probs.dim() != 2 or probs.shape[0] != len(tree) + 1:
        raise ValueError(f"expected {len(tree) + 1} verifier rows for {len(tree)} draft nodes, "
                         f"got shape {tuple(probs.shape)}")
    path, node = [], -1
    while True:
        p = probs[node + 1].double().clone()
        accepted = None
        for c in tree.children(node):
            token = tree.tokens[c]
            total = p.sum()
            u = torch.rand((), generator=generator, device=generator.device, dtype=torch.float64)
            if bool(u.to(p.device) * total < p[token]):
                accepted = c
                break
            p[token] = 0
            if not bool(p.sum() > 0):  # the candidate held all the mass; only rounding rejected it
                accepted = c
                break
        if accepted is None:
            return path, [tree.tokens[i] for i in path] + [sample(p, generator)]
        path.append(accepted)
        node = accepted


def _accept_draws(draft: list[int], rows: torch.Tensor, generator: torch.Generator) -> list[bool]:
    """Accept/reject for every draft at once (independent uniforms), one device sync.

    Drawing all k uniforms up front is still exact: the decision for d_{i+1} is only used
    when d_1..d_i were accepted, and the uniforms are independent.
    """
    ids = torch.tensor(draft, device=rows.device, dtype=torch.long).unsqueeze(1)
    rows64 = rows.double()
    p_draft = rows64.gather(1, ids).squeeze(1)
    total = rows64.sum(dim=-1)
    u = torch.rand(len(draft), generator=generator, device=generator.device, dtype=torch.float64)
    return (u.to(rows.device) * total < p_draft).tolist()


class AdaptiveDraftLength:
    """Choose the next draft length k from recent acceptance (not in the paper; measure it).

    Model: each drafted token is accepted with probability a (estimated online), so a step
    drafting k tokens emits E(k) = 1 + a + ... + a^k tokens on average and costs about
    1 + token_cost * k verifier-step units (token_cost = extra time per verified token over
    a one-token step; measure it: t(k) ~ t0 + t1*k gives token_cost = t1/t0). `next_k`
    returns the k in [k_min, k_max] that maximises E(k) / cost(k): long drafts while drafts
    are mostly accepted, short ones when mostly rejected.

    The estimate of a is accepted / judged over exponentially decayed counts, decayed per
    judged draft token (memory of about 1 / (1 - decay) tokens), so a long accepted burst
    is forgotten after a similar number of rejections rather than dominating for many
    steps. A step judges its accepted drafts plus the first rejected one, if any; drafts
    after a rejection were never judged and carry no evidence, nor do steps that proposed
    nothing.
    """

    def __init__(
        self,
        k_min: int = 1,
        k_max: int = 8,
        start: int = 5,
        token_cost: float = 0.1,
        decay: float = 0.85,
    ) -> None:
        if not (1 <= k_min <= start <= k_max):
            raise QuasarError(
                "adaptive draft length needs 1 <= k_min <= start <= k_max, "
                f"got {k_min}, {start}, {k_max}"
            )
        if not (token_cost > 0 and math.isfinite(token_cost)):
            raise QuasarError(f"token_cost must be a positive number, got {token_cost!r}")
        if not (0.0 <= decay < 1.0):
            raise QuasarError(f"decay must be in [0, 1), got {decay!r}")
        self.k_min, self.k_max, self.start = k_min, k_max, start
        self.token_cost, self.decay = token_cost, decay
        self._accepted = 0.0
        self._examined = 0.0
        self._k = start

    @property
    def rate(self) -> float | None:
        """Current estimate of the per-draft-token acceptance probability (None before data)."""
        return self._accepted / self._examined if self._examined > 0 else None

    def next_k(self) -> int:
        """Draft length for the next step."""
        return self._k

    def update(self, proposed: int, accepted: int) -> None:
        """Record one step: `proposed` drafts were verified and the first `accepted` kept."""
        if not (0 <= accepted <= proposed):
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        if proposed == 0:
            return
        outcomes = [1.0] * accepted + ([0.0] if accepted < proposed else [])
        for outcome in outcomes:
            self._accepted = self.decay * self._accepted + outcome
            self._examined = self.decay * self._examined + 1.0
        self._k = self._best_k(self._accepted / self._examined)

    def _best_k(self, a: float) -> int:
        best_k, best_value = self.k_min, -1.0
        for k in range(self.k_min, self.k_max + 1):
            expected = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
            value = expected / (1.0 + self.token_cost * k)
            if value > best_value + 1e-12:  # ties go to the shorter draft
                best_k, best_value = k, value
        return best_k
