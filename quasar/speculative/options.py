"""Decoding options as frozen objects, checked once where a request enters.

The CLI, `LLM` and the server's request schema each build a `DraftOptions` and a
`SamplingOptions`; `LLM.plan` joins them with the loop's own options and the verifier into
a `DecodePlan` (quasar.engine.plan), which the scheduler, the batch decoder and the drafter
then read as it is. Construction is the check: an out-of-range value is a QuasarError naming
the option (`param`), with the same one-line message whichever door it came in by, and
nothing downstream checks again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from quasar.defaults import (DEFAULT_ADAPTIVE, DEFAULT_DRAFT_BUDGET, DEFAULT_DRAFTER, DEFAULT_NGRAM_MAX,
                             DEFAULT_NGRAM_MIN, DEFAULT_NUM_DRAFT, MAX_DRAFT, MAX_NGRAM)
from quasar.errors import QuasarError
from quasar.speculative.logprobs import MAX_TOP_LOGPROBS
from quasar.speculative.registry import check_drafter_name, drafter_options


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    """A value as a message shows it: a number the same whether it came as 1, 1.0 or "1.0"
    (CLI, Python and JSON callers), anything else as its repr."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:g}"
    return repr(value)


def check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    """A QuasarError (param `name`) unless `value` is an integer in [lo, hi] (hi None: no cap)."""
    if _is_int(value) and value >= lo and (hi is None or value <= hi):
        return
    bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    raise QuasarError(f"{name} must be an integer {bounds}, got {value!r}", param=name)


@dataclass(frozen=True)
class DraftOptions:
    """Which drafter and how much it may propose. `num_draft` (k) and `adaptive` shape chain
    drafts; the tree drafter proposes up to `draft_budget` nodes a step instead; both match
    n-grams of `ngram_min`..`ngram_max` tokens. `drafter` may be "auto" until `LLM.plan`
    resolves it for a verifier."""

    drafter: str = DEFAULT_DRAFTER
    num_draft: int = DEFAULT_NUM_DRAFT
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    draft_budget: int = DEFAULT_DRAFT_BUDGET
    adaptive: bool = DEFAULT_ADAPTIVE

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, str):
            raise QuasarError(f"drafter must be a string, got {self.drafter!r}", param="drafter")
        check_drafter_name(self.drafter)
        check_int("num_draft", self.num_draft, 0, MAX_DRAFT)
        check_int("ngram_min", self.ngram_min, 1, MAX_NGRAM)
        check_int("ngram_max", self.ngram_max, 1, MAX_NGRAM)
        if self.ngram_max < self.ngram_min:
            raise QuasarError(f"ngram_max must be at least ngram_min ({self.ngram_min}), got {self.ngram_max}",
                              param="ngram_max")
        check_int("draft_budget", self.draft_budget, 1, MAX_DRAFT)
        if not isinstance(self.adaptive, bool):
            raise QuasarError(f"adaptive must be true or false, got {self.adaptive!r}", param="adaptive")

    def replace(self, **changes) -> "DraftOptions":
        """These options with `changes` (None values ignored: "keep the default"), checked."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def step_nodes(self) -> int:
        """The most draft nodes one step may propose: the budget of a tree, k of a chain,
        none without a drafter."""
        if self.drafter == "none":
            return 0
        return self.draft_budget if self.drafter == "tree" else self.num_draft

    @property
    def adaptive_chain(self) -> bool:
        """Whether a chain's length is chosen per step (AdaptiveDraftLength): a chain rule,
        never applied to trees."""
        return self.adaptive and self.drafter not in ("none", "tree") and self.num_draft > 0

    def drafter_kwargs(self) -> dict:
        """The drafter's constructor options (quasar.speculative.registry.make_drafter)."""
        return drafter_options(self.drafter, ngram_min=self.ngram_min, ngram_max=self.ngram_max,
                               draft_budget=self.draft_budget)


@dataclass(frozen=True)
class SamplingOptions:
    """How to pick tokens: temperature 0 is greedy; top_k=0 and top_p=1 disable filtering."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p, k, seed = self.temperature, self.top_p, self.top_k, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise QuasarError(f"temperature must be a finite number >= 0, got {_show(t)}", param="temperature")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise QuasarError(f"top_p must be in (0, 1], got {_show(p)}", param="top_p")
        if not _is_int(k) or k < 0:
            raise QuasarError(f"top_k must be an integer >= 0 (0 = off), got {k!r}", param="top_k")
        if seed is not None and not _is_int(seed):
            raise QuasarError(f"seed must be an integer or None, got {seed!r}", param="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, seed: int | None) -> "SamplingOptions":
        return dataclasses.replace(self, seed=seed)


def _stops(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise QuasarError("stop strings must be non-empty strings", param="stop")
    return stops


@dataclass(frozen=True)
class DecodeOptions:
    """What one sequence's decode loop reads: its length, stops, sampling, drafting, and
    whether to report logprobs (None: off; N: each output token's logprob and its row's N
    best alternatives)."""

    max_new_tokens: int = 128
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop: tuple[str, ...] = ()
    draft: DraftOptions = field(default_factory=DraftOptions)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise QuasarError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}",
                              param="max_new_tokens")
        object.__setattr__(self, "stop", _stops(self.stop))
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise QuasarError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {lp!r}",
                              param="logprobs")

    def with_seed(self, seed: int | None) -> "DecodeOptions":
        """The same options sampling with `seed` (choice i of a request samples with seed + i)."""
        return dataclasses.replace(self, sampling=self.sampling.with_seed(seed))
