"""The decoding loop: draft, verify in one forward, accept, roll the KV cache back.

Autoregressive decoding is the same loop with a drafter that never proposes: each step
feeds [last token] instead of [last token, d1..dk]. The token fed at a step is always the
last emitted token, which is not yet in the cache; everything before it is.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from quasar.defaults import DEFAULT_NUM_DRAFT
from quasar.errors import QuasarError
from quasar.models.llama import Transformer
from quasar.models.tokenizer import StreamDecoder, Tokenizer
from quasar.speculative.acceptance import AdaptiveDraftLength, accept_greedy, accept_sampling
from quasar.speculative.drafters import Drafter
from quasar.speculative.sampling import SamplingParams, make_generator, probs_from_logits


@dataclass
class DecodeOptions:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    num_draft: int = DEFAULT_NUM_DRAFT
    adaptive: bool = False  # choose k per step from recent acceptance

    def validate(self) -> "DecodeOptions":
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise QuasarError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}", param="max_new_tokens")
        if isinstance(self.num_draft, bool) or not isinstance(self.num_draft, int) or not 0 <= self.num_draft <= 64:
            raise QuasarError(f"num_draft must be an integer in [0, 64], got {self.num_draft!r}", param="num_draft")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise QuasarError("stop strings must be non-empty strings", param="stop")
        self.sampling.validate()
        return self


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0  # output tokens (EOS and anything past a stop excluded)
    steps: int = 0  # verifier forwards after prefill
    emitted: int = 0  # tokens the verifier steps emitted, EOS and tokens past a stop included
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0
    accepted_hist: Counter = field(default_factory=Counter)  # tokens emitted per step -> steps

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

    @property
    def text(self) -> str:
        return "".join(p for p, _ in self.pieces)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length" (max tokens or context end)
    stats: Stats


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


def decode(model: Transformer, tokenizer: Tokenizer, prompt_ids: list[int], drafter: Drafter,
           opts: DecodeOptions) -> Iterator[Chunk | Result]:
    """Yield a Chunk per verifier step, then the Result. Works for any drafter/verifier pair."""
    opts.validate()
    if not prompt_ids:
        raise QuasarError("the prompt is empty")
    cache = model.cache if model.cache is not None else model.setup_cache()
    if len(prompt_ids) >= cache.max_seq_len:
        raise QuasarError(f"prompt has {len(prompt_ids)} tokens; the context holds {cache.max_seq_len}")
    stats = Stats(prompt_tokens=len(prompt_ids))
    params = opts.sampling
    gen = None if params.greedy else make_generator(params)
    adaptive = AdaptiveDraftLength(k_max=max(opts.num_draft, 1) + 3, start=max(opts.num_draft, 1)) \
        if opts.adaptive and opts.num_draft > 0 else None
    out = _Output(tokenizer, opts)
    device = model.model.norm.weight.device

    t0 = time.perf_counter()
    cache.length = 0
    if len(prompt_ids) > 1:
        model(torch.tensor([prompt_ids[:-1]], device=device), logits="none")
    drafter.reset(prompt_ids)
    pending = prompt_ids[-1]
    stats.prefill_s = time.perf_counter() - t0

    while out.finish is None:
        # Prompt + output never exceed the context; a step emits at most k + 1 tokens.
        room = cache.max_seq_len - len(prompt_ids) - len(out.ids)
        if room <= 0:
            out.finish = "length"
            break
        want = adaptive.next_k() if adaptive else opts.num_draft
        k = max(0, min(want, room - 1, opts.max_new_tokens - len(out.ids) - 1))
        draft = drafter.propose(k)[:k] if k > 0 else []
        start = cache.length
        logits = model(torch.tensor([[pending, *draft]], device=device))[0]
        if gen is None:
            emitted = accept_greedy(draft, logits)
        else:
            emitted = accept_sampling(draft, probs_from_logits(logits, params), gen)
        n_acc = len(emitted) - 1
        cache.length = start + 1 + n_acc  # roll back the rejected drafts
        stats.steps += 1
        stats.emitted += len(emitted)
        stats.drafted += len(draft)
        stats.accepted += n_acc
        if adaptive:
            adaptive.update(len(draft), n_acc)

        n_before, pieces = len(out.ids), []
        for i, token in enumerate(emitted):
            piece = out.add(token, from_draft=i < n_acc)
            if piece:
                pieces.append(piece)
            if out.finish is not None:
                break
        kept = out.ids[n_before:]  # an EOS and tokens past a stop are not output
        stats.accepted_hist[len(emitted)] += 1
        drafter.extend(emitted)
        pending = emitted[-1]
        if pieces or kept:
            yield Chunk(pieces, kept)

    stats.new_tokens = len(out.ids)
    stats.wall_s = time.perf_counter() - t0
    stats.decode_s = stats.wall_s - stats.prefill_s
    yield Result(out.final_text, list(out.ids), out.finish, stats)
