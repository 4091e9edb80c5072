"""Finished sequences' K/V kept in host memory, for later prompts that start the same way.

A chat's next turn repeats the whole conversation so far, and requests share system prompts
and few-shot examples. When a sequence leaves a `BatchDecoder`, the K/V of its slot's
committed positions are copied here with their token ids. A later prompt gets the longest
prefix it shares with a kept sequence copied into its own slot, and is prefilled only past
it, as llama-server's prompt cache does. At most `max_bytes` are kept; the least recently
used sequence goes first.

Reuse changes no bit of the new sequence's output. A kept position qualifies only where its
K/V are exactly what prefilling the new prompt would write:
- on a verifier that computes every step and prefill chunk row by row (`regime` exact: the
  fused step, without AMX prefill tiles), a position's K/V depend only on the tokens up to
  it, whatever ran them (a prefill chunk, a draft row, an accepted token): the whole common
  prefix qualifies;
- elsewhere only whole prefill chunks of a prompt qualify: chunks start at fixed offsets
  (quasar.speculative.batch), so each is the same computation in every prompt that starts
  with the same tokens.
A record made under one regime (rule, kernel paths, the fused step's build) serves only that
regime.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch import Tensor

# The regime of a verifier whose prefill chunks are not computed row by row.
CHUNKS_ONLY = ("whole chunks",)


def regime(model) -> tuple:
    """(exact, key): `exact` when every step and prefill chunk of `model` over its cache is
    computed row by row; `key` names what the bits depend on besides the tokens, the cache's
    dtype and length among them (a record copied into a cache of another dtype would be cast,
    and a long-context rotary embedding's factors follow the cache's length)."""
    kernel, cache = model.step_kernel, model.cache
    key = kernel.exact_rows_key(cache) if hasattr(kernel, "exact_rows_key") else None
    layout = (str(cache.k.dtype), cache.max_seq_len)
    return (True, (*key, *layout)) if key is not None else (False, (*CHUNKS_ONLY, *layout))


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class _Kept:
    tokens: list[int]  # the ids at positions 0 .. len - 1
    k: Tensor  # [layers, kv heads, len, head_dim] in the cache's dtype
    v: Tensor
    regime: Hashable

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class PromptCache:
    """K/V of finished sequences' committed positions, up to `max_bytes` (see the module doc)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.kept: OrderedDict[int, _Kept] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self._ids = 0

    def save(self, cache, slot: int, tokens: list[int], whole_chunks: int, rule: tuple) -> None:
        """Keep slot `slot`'s first positions, whose ids are `tokens`: all of them under an
        exact `rule` (`regime`), else the first `whole_chunks` (the prompt's whole prefill
        chunks). A kept sequence that this one extends is dropped; one that extends this one
        makes it redundant."""
        exact, _ = rule
        n = len(tokens) if exact else min(whole_chunks, len(tokens))
        if n <= 0 or 2 * cache.k[:, slot, :, :n].numel() * cache.k.element_size() > self.max_bytes:
            return
        tokens = list(tokens[:n])
        for key, kept in list(self.kept.items()):
            if kept.regime != rule:
                continue
            if len(kept.tokens) >= n and kept.tokens[:n] == tokens:
                self.kept.move_to_end(key)
                return
            if kept.tokens == tokens[:len(kept.tokens)]:
                self._drop(key)
        kept = _Kept(tokens, cache.k[:, slot, :, :n].clone(), cache.v[:, slot, :, :n].clone(), rule)
        self._ids += 1
        self.kept[self._ids] = kept
        self.nbytes += kept.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.kept)))

    def load(self, cache, slot: int, ids: list[int], rule: tuple, chunk: int) -> int:
        """Copy into slot `slot` the longest prefix of `ids` a kept sequence holds under
        `rule` (whole `chunk`s of it unless the rule is exact) and return its length (0: none)."""
        exact, _ = rule
        best, n = None, 0
        for key, kept in self.kept.items():
            if kept.regime == rule:
                m = shared_prefix(kept.tokens, ids)
                m = m if exact else m // chunk * chunk
                if m > n:
                    best, n = key, m
        if best is None:
            return 0
        kept = self.kept[best]
        self.kept.move_to_end(best)
        cache.k[:, slot, :, :n] = kept.k[:, :, :n]
        cache.v[:, slot, :, :n] = kept.v[:, :, :n]
        return n

    def clear(self) -> None:
        self.kept.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self.kept.pop(key).nbytes
