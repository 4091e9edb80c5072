"""Continuous batching: several sequences decoded together, one verifier forward a step.

A `BatchDecoder` drives `Sequence`s (quasar.speculative.generate) in the slots of one
verifier's KV cache. Each `step()`:
1. prefills waiting sequences in whole chunks, the prompt with the fewest tokens left first,
   at most `prefill_budget` prompt tokens a step, so a long prompt does not stall the
   sequences already decoding (a prompt that matches one already in the cache is copied from
   that slot instead: `n` choices share one prefill; with a `PromptCache`, a prompt starts
   from the longest prefix a finished sequence left there);
2. runs one verifier step over the rows of every decoding sequence ([pending, *drafts]
   each, in its own slot), hands each its logits, commits what it accepted and returns
   what each emitted. A sequence that ends leaves at once and frees its slot.

A sequence's tokens are bitwise the same whether it decodes alone or beside others:
- a prompt is always prefilled in the same chunks (fixed offsets, `prefill`), whatever
  else is in flight, and K/V copied from another slot or the prompt cache are exactly those
  (quasar.speculative.prompt_cache);
- a verifier step computes each row on its own (quasar.models.rows, "row invariance"), so
  other slots' rows change no bit of a sequence's logits;
- a batch may shorten the drafts of greedy sequences (their output does not depend on the
  drafts; the rows go to the likeliest drafts batch-wide) but never those of seeded
  sampling, whose random draws follow its draft lengths.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from quasar.models.llama import Transformer
from quasar.models.rows import Rows
from quasar.models.tokenizer import Tokenizer
from quasar.speculative.drafters import Drafter, worth_verifying
from quasar.speculative.generate import Chunk, DecodeOptions, Result, Sequence, context_units, row_prices_at
from quasar.speculative.prompt_cache import PromptCache, regime

# Prompt tokens per prefill call: the most rows the fused W8A8 step takes (faster than the
# modules' causal prefill). Chunks start at multiples of this, so a prompt's cache is the
# same however the prefill is interleaved with other sequences' steps.
PREFILL_CHUNK = 128
# Rows of one verifier call (the fused step takes up to 128); a bigger batch makes more calls.
MAX_STEP_ROWS = 128
# Steps a waiting prompt lets prompts with fewer tokens left go first before it goes first.
PREFILL_PATIENCE = 4


def chunk_end(done: int, n: int) -> int:
    """Where the prefill chunk of an n-token prompt that starts at `done` ends."""
    return min(n, (done // PREFILL_CHUNK + 1) * PREFILL_CHUNK)


def prefill(model: Transformer, slot: int, ids: list[int], start: int = 0, budget: int | None = None) -> int:
    """Run `ids[start:]` into `slot` (whose committed length must be `start`), in chunks of
    PREFILL_CHUNK at fixed offsets, at most `budget` tokens (rounded up to whole chunks;
    None: all). Returns the new committed length."""
    done = start
    while done < len(ids) and (budget is None or done - start < budget):
        end = chunk_end(done, len(ids))
        # model() picks its path (rows, the fused step's chain, or a causal prefill) from
        # the chunk's length alone: the same every time.
        model(torch.tensor([ids[done:end]], device=model.model.norm.weight.device), logits="none", slot=slot)
        done = end
    return done


@dataclass
class _Entry:
    key: Hashable
    seq: Sequence
    slot: int
    filled: int = 0  # prefill tokens in the cache so far
    passed: int = 0  # steps that prefilled others while this prompt waited
    decoded: list[int] = field(default_factory=list)  # ids its steps committed after the prompt

    @property
    def prefilled(self) -> bool:
        return self.filled >= len(self.seq.prefill_ids)


class BatchDecoder:
    """Decodes up to len(slots) sequences of one verifier together (see the module doc).

    `add` places a sequence in a free slot; `step` advances every sequence by one verifier
    step (after this step's prefill work) and returns [(key, Chunk, Result or the
    exception it failed with)]; after a Result or an exception the slot is free again.
    `remove` drops one (a cancelled request). With a `prompt_cache`, a sequence that leaves
    is kept there and a new one starts from the longest prefix kept.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, slots: list[int] | None = None,
                 prefill_budget: int | None = PREFILL_CHUNK, max_rows: int | None = None,
                 prompt_cache: PromptCache | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.cache = model.cache if model.cache is not None else model.setup_cache()
        self.free = list(slots if slots is not None else range(self.cache.n_slots))
        if not self.free or any(not 0 <= s < self.cache.n_slots for s in self.free):
            raise ValueError(f"slots {self.free} are not slots of the cache ({self.cache.n_slots})")
        self.prefill_budget = prefill_budget
        # Rows a step aims for over the whole batch: greedy drafts are cut to fit (None: no cap).
        self.max_rows = max_rows
        self.entries: dict[Hashable, _Entry] = {}  # in arrival order
        self.float_gemms = any(type(m) is nn.Linear for m in model.modules())
        self.prompt_cache = prompt_cache

    # ------------------------------------------------------------------ membership
    @property
    def n_free(self) -> int:
        return len(self.free)

    @property
    def n_running(self) -> int:
        return len(self.entries)

    @property
    def n_decoding(self) -> int:
        return sum(e.prefilled for e in self.entries.values())

    def add(self, key: Hashable, prompt_ids: list[int], drafter: Drafter, opts: DecodeOptions) -> Sequence:
        """Start decoding `prompt_ids` under `key` in a free slot (QuasarError when the
        prompt does not fit the context, ValueError when no slot is free or `key` is taken)."""
        if not self.free:
            raise ValueError("no free slot in the batch")
        if key in self.entries:
            raise ValueError(f"key {key!r} is decoding already")
        seq = Sequence(prompt_ids, drafter, opts, self.tokenizer, self.cache.max_seq_len, self.model.row_cost,
                       self.model.pass_rows, self.model.key_cost, self.model.row_prices)
        if self._fixed_drafts(seq) and self.model.learned_prices is not None:
            seq.row_prices = self.model.learned_prices.probed  # what a learner read does not move its drafts
        slot = self.free.pop(0)  # the least recently freed
        self.cache.lengths[slot] = 0
        if self.prompt_cache is not None and self.model.cache is self.cache:
            self.cache.lengths[slot] = self.prompt_cache.load(self.cache, slot, seq.prefill_ids, regime(self.model),
                                                              PREFILL_CHUNK)
            seq.stats.cached_tokens = self.cache.lengths[slot]
        self.entries[key] = _Entry(key, seq, slot, filled=self.cache.lengths[slot])
        if self.entries[key].prefilled:  # nothing (left) to prefill
            seq.prefilled()
        return seq

    def remove(self, key: Hashable, keep: bool = True) -> None:
        """Drop a sequence (cancelled) and free its slot; nothing happens for an unknown key.
        `keep`: its committed positions go to the prompt cache (not after a failure)."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        if keep and self.prompt_cache is not None and self.model.cache is self.cache:
            ids = entry.seq.prefill_ids[:entry.filled] + entry.decoded
            if len(ids) == self.cache.lengths[entry.slot]:
                self.prompt_cache.save(self.cache, entry.slot, ids, entry.filled // PREFILL_CHUNK * PREFILL_CHUNK,
                                       regime(self.model))
        self.free.append(entry.slot)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[tuple[Hashable, Chunk | Result | Exception]]:
        """One step: this step's prefill work, then one verifier step for every decoding
        sequence. A sequence that fails (its drafter, its acceptance, or the verifier call
        it was in) gets its exception as its item and leaves; the others go on."""
        out: list[tuple[Hashable, Chunk | Result | Exception]] = []
        self._prefill(out)
        active: list[tuple[_Entry, list[int], list[int]]] = []
        decoding = [e for e in self.entries.values() if e.prefilled]
        cap = self._draft_cap(len(decoding))
        for entry in decoding:
            seq = entry.seq
            try:
                rows = seq.next_rows(max_draft=None if self._fixed_drafts(seq) else cap)
            except Exception as e:
                out.append(self._fail(entry, e))
                continue
            if rows is None:  # ended before stepping (context full)
                out.append(self._finish(entry))
            else:
                active.append((entry, *rows))
        if cap is not None:
            active = self._share_rows(active)
        for group in self._calls(active):
            try:
                rows, logits = self._verify(group)
            except Exception as e:
                out += [self._fail(entry, e) for entry, _, _ in group]
                continue
            try:  # every row's argmax and top ids at once (what greedy acceptance and recycling read)
                k = max(entry.seq.drafter.observe_top_k for entry, _, _ in group)
                best, top = self.model.row_argmax_topk(logits, k)
            except Exception as e:
                out += [self._fail(entry, e) for entry, _, _ in group]
                continue
            end = 0
            for entry, toks, _ in group:
                base, end = end, end + len(toks)  # the sequence's rows in the call
                try:
                    kept, chunk = entry.seq.accept(logits[base:end], best[base:end],
                                                   top[base:end] if top is not None else None)
                    self.cache.commit(entry.slot, [base + r for r in kept], rows)
                    entry.decoded += [toks[r] for r in kept]
                except Exception as e:
                    out.append(self._fail(entry, e))
                    continue
                if chunk is not None:
                    out.append((entry.key, chunk))
                if entry.seq.finished:
                    out.append(self._finish(entry))
        return out

    def _verify(self, group: list) -> tuple[Rows, torch.Tensor]:
        """One verifier call over the rows of `group`'s sequences: (rows, logits)."""
        tokens, slots, parents = [], [], []
        for entry, toks, pars in group:
            base = len(tokens)
            tokens += toks
            slots += [entry.slot] * len(toks)
            parents += [p if p < 0 else base + p for p in pars]
        rows = Rows.build(tokens, slots, parents, self.cache.lengths)
        t0 = time.perf_counter()
        logits = self.model.step(rows)
        self._learn_prices(group, len(rows), time.perf_counter() - t0)
        return rows, logits

    def _learn_prices(self, group: list, n_rows: int, seconds: float) -> None:
        """Hand the step's time to the verifier's row-price learner (a measured fused step
        has one: quasar.runtime.learned_prices); prices it reads again reach every sequence
        but seeded sampling's, which keeps the probe's: its draws follow its drafts, which
        must not depend on the steps other requests took before it."""
        learner = self.model.learned_prices
        if learner is None:
            return
        units = context_units(self.model.key_cost, [(self.cache.lengths[e.slot], len(t)) for e, t, _ in group])
        prices = learner.record(n_rows, seconds, units)
        if prices is not None:
            self.model.row_prices = prices
            for entry in self.entries.values():
                if not self._fixed_drafts(entry.seq):
                    entry.seq.row_prices = prices

    def _fail(self, entry: _Entry, error: Exception) -> tuple[Hashable, Exception]:
        self.remove(entry.key, keep=False)
        return entry.key, error

    def _finish(self, entry: _Entry) -> tuple[Hashable, Result]:
        self.remove(entry.key)
        return entry.key, entry.seq.result()

    @staticmethod
    def _fixed_drafts(seq: Sequence) -> bool:
        """Seeded sampling keeps the drafts it would have alone: its random draws follow them."""
        return seq.gen is not None and seq.opts.sampling.seed is not None

    def _draft_cap(self, n: int) -> int | None:
        """Most drafts one sequence may propose this step: twice its even share of the batch's
        max_rows (proposing costs Python time; most of them would be cut); _share_rows then
        shares the spare rows out."""
        if self.max_rows is None or n <= 1:
            return None
        return max(0, min(self.max_rows - n, 2 * (self.max_rows // n) - 1))

    def _share_rows(self, active: list) -> list:
        """Keep the batch's rows worth their price, and within max_rows: of the drafts of the
        sequences that may be cut, the rows go to the likeliest ones batch-wide (each
        sequence's drafts are ordered likeliest first, so each keeps a prefix), not the same
        number to each: a sequence copying a long repeat gets several, one whose drafts rarely
        land none. Each sequence priced its drafts as if its step were alone; beside the other
        sequences' rows they are the step's later rows, dearer where a step hides only its
        first few under the weight stream (worth_verifying at the verifier's row prices)."""
        fixed = [(entry, toks) for entry, toks, _ in active if self._fixed_drafts(entry.seq)]
        base_rows = sum(len(toks) for _, toks in fixed) + len(active) - len(fixed)
        offers = sorted(((p, i, j) for i, (entry, _, _) in enumerate(active) if not self._fixed_drafts(entry.seq)
                         for j, p in enumerate(entry.seq.draft_probs())), key=lambda o: (-o[0], o[2], o[1]))
        # priced at the step's longest context
        n_keys = max(self.cache.lengths[entry.slot] for entry, _, _ in active)
        m = self.model
        prices = row_prices_at(m.row_prices, m.row_cost, m.key_cost, n_keys, base_rows + len(offers) - 1)
        gain = len(active) + sum(sum(entry.seq.draft_probs()) for entry, _ in fixed)
        cost = 1.0 + sum(prices[:base_rows - 1])
        n_keep = min(max(0, self.max_rows - base_rows),
                     worth_verifying([p for p, _, _ in offers], prices[base_rows - 1:], gain, cost))
        if n_keep == len(offers):
            return active
        keep = [0] * len(active)
        for _, i, _ in offers[:n_keep]:
            keep[i] += 1
        out = []
        for i, (entry, toks, parents) in enumerate(active):
            if not self._fixed_drafts(entry.seq) and keep[i] < len(toks) - 1:
                toks, parents = entry.seq.cut_draft(keep[i])
            out.append((entry, toks, parents))
        return out

    def _calls(self, active: list) -> list[list]:
        """Split the step's sequences into verifier calls: at most MAX_STEP_ROWS rows each,
        and one sequence per call on a model with float linears (a float GEMM's rounding
        depends on how many rows it multiplies, an int8 one's does not)."""
        if self.float_gemms:
            return [[item] for item in active]
        calls, rows = [[]], 0
        for item in active:
            n = len(item[1])
            if calls[-1] and rows + n > MAX_STEP_ROWS:
                calls.append([])
                rows = 0
            calls[-1].append(item)
            rows += n
        return [c for c in calls if c]

    def _prefill(self, out: list) -> None:
        """This step's prefill work: copy prompts already in a slot, then whole chunks of the
        waiting prompts while they fit `prefill_budget` tokens (None: all of them; the step's
        first chunk always runs). The prompt with the fewest tokens left goes first (the
        others' first tokens wait least), unless one has waited PREFILL_PATIENCE steps."""
        waiting = [e for e in list(self.entries.values())
                   if not e.prefilled and not self._copy_prompt(e, e.seq.prefill_ids)]
        # a stable sort of the entries (in arrival order): the older of two equal prompts first
        waiting.sort(key=lambda e: (e.passed < PREFILL_PATIENCE, len(e.seq.prefill_ids) - e.filled))
        spent, budget, served = 0, self.prefill_budget, set()
        for entry in waiting:
            ids = entry.seq.prefill_ids
            while not entry.prefilled:
                end = chunk_end(entry.filled, len(ids))
                if budget is not None and spent and spent + end - entry.filled > budget:
                    break
                try:
                    prefill(self.model, entry.slot, ids, entry.filled, end - entry.filled)
                except Exception as e:
                    out.append(self._fail(entry, e))
                    break
                spent += end - entry.filled
                entry.filled = end
                served.add(entry.key)
            if entry.prefilled:
                entry.seq.prefilled()
        for entry in waiting:
            if entry.key not in served and entry.key in self.entries and spent:
                entry.passed += 1

    def _copy_prompt(self, entry: _Entry, ids: list[int]) -> bool:
        """Fill `entry`'s slot from a sequence whose cache starts with the same prompt.

        Its first len(ids) positions are committed and never change, and a prefill is the
        same computation in every slot, so the copy is exactly what prefilling would give."""
        for other in self.entries.values():
            if other is entry or not other.prefilled or other.seq.prefill_ids != ids:
                continue
            n = len(ids)
            self.cache.k[:, entry.slot, :, :n] = self.cache.k[:, other.slot, :, :n]
            self.cache.v[:, entry.slot, :, :n] = self.cache.v[:, other.slot, :, :n]
            self.cache.lengths[entry.slot] = entry.filled = n
            entry.seq.prefilled()
            return True
        return False


def decode(model: Transformer, tokenizer: Tokenizer, prompt_ids: list[int], drafter: Drafter,
           opts: DecodeOptions, slot: int = 0, prompt_cache: PromptCache | None = None) -> Iterator[Chunk | Result]:
    """Yield a Chunk per verifier step, then the Result, decoding one sequence alone in cache
    slot `slot`: a batch of one, so its tokens are those it would get in any batch (with
    `prompt_cache`: starting from the longest prefix kept there, and kept there once done)."""
    batch = BatchDecoder(model, tokenizer, slots=[slot], prefill_budget=None, prompt_cache=prompt_cache)
    batch.add(0, prompt_ids, drafter, opts)
    while True:
        for _, item in batch.step():
            if isinstance(item, Exception):
                raise item
            yield item
            if isinstance(item, Result):
                return
