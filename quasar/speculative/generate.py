"""The decoding loop: draft, verify in one forward, accept, keep the accepted rows.

A `Sequence` is one request's state (drafter, sampling, output, stats); it never calls the
model: `quasar.speculative.batch` runs the model for one sequence (`decode`) or many. Each step feeds the rows [pending token, draft tree], where the
pending token is the last emitted one, not yet in the cache; everything before it is.
Autoregressive decoding is the same loop with a drafter that never proposes.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from quasar.defaults import DEFAULT_ROW_COST
from quasar.errors import QuasarError
from quasar.models.tokenizer import StreamDecoder, Tokenizer
from quasar.speculative.acceptance import (AdaptiveDraftLength, accept_greedy_tree, accept_sampling,
                                          accept_sampling_tree)
from quasar.speculative.drafters import Drafter, DraftTree
from quasar.speculative.logprobs import TokenLogprob, token_logprobs
from quasar.speculative.options import DecodeOptions
from quasar.speculative.sampling import make_generator, probs_from_logits


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prompt cache, not a prefill
    new_tokens: int = 0  # output tokens (EOS and anything past a stop excluded)
    steps: int = 0  # verifier forwards after prefill
    emitted: int = 0  # tokens the verifier steps emitted, EOS and tokens past a stop included
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0
    accepted_hist: Counter = field(default_factory=Counter)  # tokens emitted per step -> steps

    @classmethod
    def combined(cls, parts: list["Stats"]) -> "Stats":
        """The stats of several decodes of one prompt, one after another (the prompt counted once)."""
        total = cls(prompt_tokens=parts[0].prompt_tokens, cached_tokens=parts[0].cached_tokens)
        for p in parts:
            for name in ("new_tokens", "steps", "emitted", "drafted", "accepted", "prefill_s", "decode_s", "wall_s"):
                setattr(total, name, getattr(total, name) + getattr(p, name))
            total.accepted_hist.update(p.accepted_hist)
        return total

    @property
    def mean_accepted(self) -> float:
        """Emitted tokens per verifier step (L): exactly 1.0 for autoregressive decoding, whose
        every step emits one token (the last may be an EOS that is not output)."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "mean_accepted": round(self.mean_accepted, 4),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }


@dataclass
class Chunk:
    """What one verifier step added to the output: text pieces, each flagged by origin."""

    pieces: list[tuple[str, bool]]  # (text, came from an accepted draft)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for

    @property
    def text(self) -> str:
        return "".join(p for p, _ in self.pieces)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length" (max tokens or context end)
    stats: Stats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for


class _Output:
    """Accumulates emitted tokens; applies EOS, stop strings and max tokens per token.

    Text that could still turn out to be the start of a stop string is held back, so a
    stream never shows characters that the final result drops.
    """

    def __init__(self, tokenizer: Tokenizer, opts: DecodeOptions):
        self.tok, self.opts = tokenizer, opts
        self.decoder = StreamDecoder(tokenizer)
        self.ids: list[int] = []
        self.text = ""  # full decoded text so far (may include a stop string)
        self.shown = 0  # characters of self.text already handed out
        self.finish: str | None = None
        self.stop_at: int | None = None  # character index where a stop string begins

    def add(self, token: int, from_draft: bool) -> tuple[str, bool] | None:
        if token in self.tok.eos_ids:
            self.finish = "stop"
            return self._flush(from_draft)
        self.ids.append(token)
        self.text += self.decoder.push([token])
        if self.opts.stop:
            window = max(len(s) for s in self.opts.stop) + 8
            lo = max(0, self.shown - window)
            hits = [i for i in (self.text.find(s, lo) for s in self.opts.stop) if i >= 0]
            if hits:
                self.stop_at, self.finish = min(hits), "stop"
        if self.finish is None and len(self.ids) >= self.opts.max_new_tokens:
            self.finish = "length"
        return self._flush(from_draft)

    def _safe_end(self) -> int:
        if self.finish is not None:
            return self.stop_at if self.stop_at is not None else len(self.text)
        end = len(self.text)
        for s in self.opts.stop:  # hold back a suffix that is a prefix of a stop string
            for n in range(min(len(s) - 1, end), 0, -1):
                if s.startswith(self.text[end - n:]):
                    end = min(end, len(self.text) - n)
                    break
        return end

    def _flush(self, from_draft: bool) -> tuple[str, bool] | None:
        end = self._safe_end()
        if end <= self.shown:
            return None
        piece, self.shown = self.text[self.shown:end], end
        return piece, from_draft

    @property
    def final_text(self) -> str:
        return self.text[: self.stop_at] if self.stop_at is not None else self.text


# A row's attention over one cached key costs a verifier step about this share of what
# reading that key's K/V costs it. The attention alone measures lower (a row's extra time
# at a long context against the one-row step's K/V reads), but a share above it decodes long
# prompts fastest, as deeper trees also cost the drafter more: set by decoding
# `scripts/tools/make_long_prompt.py`'s prompt with `quasar bench --prompts long.jsonl --modes
# quasar,quasar-tree` at each candidate share.
ROW_KEY_SHARE = 0.25


def row_cost_at(row_cost: float, key_cost: float, n_keys: int) -> float:
    """The extra time of one more row, as a fraction of a one-row step, with `n_keys` cached
    keys: a one-row step takes 1 + key_cost * n_keys (its weights, then its K/V reads) in units
    of its time without context, a row row_cost + ROW_KEY_SHARE * key_cost * n_keys. Long
    contexts make rows dearer: trees shrink as the context grows."""
    kv = key_cost * n_keys
    return (row_cost + ROW_KEY_SHARE * kv) / (1.0 + kv)


def context_units(key_cost: float, slots: list[tuple[int, int]]) -> float:
    """A verifier step's time over its time without context, its rows' prices aside (the model
    of row_cost_at): each sequence's cached keys read once, key_cost each, and attended by
    each of its rows past the first at ROW_KEY_SHARE of that. `slots`: (cached keys, rows)
    of each sequence in the step."""
    return 1.0 + sum(key_cost * n_keys * (1.0 + ROW_KEY_SHARE * (rows - 1)) for n_keys, rows in slots)


def row_prices_at(row_prices: tuple[float, ...] | None, row_cost: float, key_cost: float, n_keys: int,
                  n: int) -> list[float]:
    """What each of the next n rows past a step's first adds (at least one row): the measured
    row_prices (Transformer.row_prices; None: row_cost each), the last holding past its end,
    with `n_keys` cached keys (row_cost_at)."""
    base = row_prices or (row_cost,)
    return [row_cost_at(base[min(i, len(base) - 1)], key_cost, n_keys) for i in range(max(1, n))]


class Sequence:
    """One request being decoded: its drafter, sampling, output and stats. It never calls
    the model; a driver runs the model on the rows it asks for and hands back their logits:

        seq = Sequence(prompt_ids, drafter, opts, tokenizer, max_seq_len)
        # run seq.prefill_ids into the sequence's cache slot, then seq.prefilled()
        while (rows := seq.next_rows()) is not None:      # ([pending, *draft], parents)
            kept, chunk = seq.accept(logits_of_those_rows)   # commit `kept`; chunk may be None
        result = seq.result()

    `quasar.speculative.batch` drives them: one alone (`decode`) or many in one step.
    """

    def __init__(self, prompt_ids: list[int], drafter: Drafter, opts: DecodeOptions, tokenizer: Tokenizer,
                 max_seq_len: int, row_cost: float = DEFAULT_ROW_COST, pass_rows: int | None = None,
                 key_cost: float = 0.0, row_prices: tuple[float, ...] | None = None):
        if not prompt_ids:
            raise QuasarError("the prompt is empty")
        if len(prompt_ids) >= max_seq_len:
            raise QuasarError(f"prompt has {len(prompt_ids)} tokens; the context holds {max_seq_len}")
        self.t0 = time.perf_counter()
        self.prompt_ids, self.drafter, self.opts, self.max_seq_len = list(prompt_ids), drafter, opts, max_seq_len
        self.stats = Stats(prompt_tokens=len(prompt_ids))
        self.gen = None if opts.sampling.greedy else make_generator(opts.sampling)
        # row_cost: the verifier's extra time per row over a one-row step (Transformer.row_cost);
        # draft lengths and tree sizes are chosen to pay for their rows at that price, and a
        # tree stays within pass_rows rows (Transformer.pass_rows: more cost another pass);
        # key_cost (Transformer.key_cost) makes rows dearer as the context grows (row_cost_at);
        # row_prices (Transformer.row_prices), once measured, price rows 2, 3, ... apart.
        self.row_cost, self.pass_rows, self.key_cost, self.row_prices = row_cost, pass_rows, key_cost, row_prices
        k = opts.draft.num_draft
        self.adaptive = AdaptiveDraftLength(k_max=k + 3, start=k, token_cost=row_cost) \
            if opts.draft.adaptive_chain else None
        self.out = _Output(tokenizer, opts)
        self.logprobs: list[TokenLogprob] | None = [] if opts.logprobs is not None else None
        drafter.reset(self.prompt_ids)
        self.pending = self.prompt_ids[-1]  # the last token, not yet in the cache
        self.tree: DraftTree | None = None  # the draft of the step in flight

    @property
    def prefill_ids(self) -> list[int]:
        """What to run into the cache before the first step: the prompt but its last token."""
        return self.prompt_ids[:-1]

    def prefilled(self) -> None:
        self.stats.prefill_s = time.perf_counter() - self.t0

    @property
    def finished(self) -> bool:
        return self.out.finish is not None

    def next_rows(self, max_draft: int | None = None) -> tuple[list[int], list[int]] | None:
        """The next step's rows: tokens [pending, *draft] and parents (-1 for the pending
        token, whose own K/V are not in the cache yet); None once the sequence has ended.
        `max_draft` caps the draft (a batch sharing its rows out)."""
        if self.finished:
            return None
        # Prompt + output never exceed the context; a step emits at most its depth + 1 tokens.
        room = self.max_seq_len - len(self.prompt_ids) - len(self.out.ids)
        if room <= 0:
            self.out.finish = "length"
            return None
        want = self.adaptive.next_k() if self.adaptive else self.opts.draft.step_nodes
        k = max(0, min(want, room - 1, self.opts.max_new_tokens - len(self.out.ids) - 1))
        if max_draft is not None:
            k = min(k, max_draft)
        tree = self.drafter.propose_tree(k).limit(k) if k > 0 else DraftTree.EMPTY
        max_nodes = None if self.pass_rows is None else self.pass_rows - 1
        prices = row_prices_at(self.row_prices, self.row_cost, self.key_cost,
                               len(self.prompt_ids) + len(self.out.ids), len(tree))
        self.tree = tree.limit(tree.worth_keeping(prices, max_nodes))  # the nodes worth their rows
        return self._rows()

    def draft_probs(self) -> list[float]:
        """The step's drafts' estimated chances of being accepted (their paths), in row order,
        non-increasing: a tree's own, or for a chain a^1, a^2, ... with a the adaptive
        acceptance rate (0.5 before any evidence)."""
        tree = self.tree
        if tree.probs is not None:
            return list(tree.probs)
        rate = (self.adaptive.rate if self.adaptive else None) or 0.5
        return [rate ** (i + 1) for i in range(len(tree))]

    def cut_draft(self, n: int) -> tuple[list[int], list[int]]:
        """Keep the first n draft nodes of the step in flight (a batch sharing out its rows);
        returns its rows as `next_rows` does."""
        self.tree = self.tree.limit(n)
        return self._rows()

    def _rows(self) -> tuple[list[int], list[int]]:
        """The step's rows: the pending token, then the draft nodes (parents as row indices)."""
        return [self.pending, *self.tree.tokens], [-1, *(p + 1 for p in self.tree.parents)]

    def accept(self, logits: torch.Tensor, best: list[int] | None = None,
               top: list[list[int]] | None = None) -> tuple[list[int], Chunk | None]:
        """Judge the step's rows (`logits` [rows, vocab], in `next_rows` order): returns the
        rows to keep in the cache (the pending token and the accepted drafts, root first)
        and what the step added to the output (None when nothing shows yet). A driver that
        has the rows' argmax (`best`) and top ids (`top`, at least the drafter's
        `observe_top_k` per row) passes them; otherwise they are computed here."""
        tree, params = self.tree, self.opts.sampling
        if self.gen is None:
            path, emitted = accept_greedy_tree(tree, logits, best)
        elif tree.is_chain:
            emitted = accept_sampling(tree.tokens, probs_from_logits(logits, params), self.gen)
            path = list(range(len(emitted) - 1))
        else:
            path, emitted = accept_sampling_tree(tree, probs_from_logits(logits, params), self.gen)
        n_acc = len(path)
        stats = self.stats
        stats.steps += 1
        stats.emitted += len(emitted)
        stats.drafted += len(tree)
        stats.accepted += n_acc
        stats.accepted_hist[len(emitted)] += 1
        if self.adaptive and tree.is_chain:
            self.adaptive.update(len(tree), n_acc)
        if (k := self.drafter.observe_top_k):
            row_tokens, row_parents = self._rows()
            top = [ids[:k] for ids in top] if top is not None else logits.topk(k, dim=-1).indices.tolist()
            self.drafter.observe(row_tokens, top, row_parents)

        n_before, pieces = len(self.out.ids), []
        for i, token in enumerate(emitted):
            piece = self.out.add(token, from_draft=i < n_acc)
            if piece:
                pieces.append(piece)
            if self.out.finish is not None:
                break
        kept_ids = self.out.ids[n_before:]  # an EOS and tokens past a stop are not output
        kept_rows = [0, *(i + 1 for i in path)]  # also the rows that emitted `emitted`, in order
        logprobs = None
        if self.logprobs is not None:
            logprobs = token_logprobs(logits[kept_rows[:len(kept_ids)]], kept_ids, self.opts.logprobs)
            self.logprobs += logprobs
        self.drafter.extend(emitted)
        self.pending = emitted[-1]
        self.tree = None
        chunk = Chunk(pieces, kept_ids, logprobs) if pieces or kept_ids else None
        return kept_rows, chunk

    def result(self) -> Result:
        stats = self.stats
        stats.new_tokens = len(self.out.ids)
        stats.wall_s = time.perf_counter() - self.t0
        stats.decode_s = stats.wall_s - stats.prefill_s
        return Result(self.out.final_text, list(self.out.ids), self.out.finish, stats, self.logprobs)

