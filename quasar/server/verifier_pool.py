"""The engine's verifiers: one `BatchDecoder` per verifier, each over its own KV cache, at
most `max_verifiers` of them built at a time.

Each verifier is a model (a W4A8 one a second whole model) with a cache of `max_batch`
sequences, so the pool is bounded: making room for one more first releases the least
recently used verifier that no running job uses (`Engine.release` frees its model and
cache). When every resident verifier is in use the new one waits. Verifiers are
`VerifierSpec`s (quasar.engine.spec). Only the scheduler's thread uses a pool.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from quasar.errors import QuasarError

if TYPE_CHECKING:  # `quasar serve --help` imports this module's default: no torch for it
    from quasar.engine.engine import Engine
    from quasar.engine.spec import VerifierSpec
    from quasar.speculative.batch import BatchDecoder

log = logging.getLogger("quasar.server")

DEFAULT_MAX_VERIFIERS = 2


class VerifierPool:
    def __init__(self, engine: Engine, max_batch: int, max_verifiers: int = DEFAULT_MAX_VERIFIERS):
        if max_verifiers < 1:
            raise QuasarError(f"max_verifiers must be at least 1, got {max_verifiers}")
        self.engine, self.max_batch, self.max_verifiers = engine, max_batch, max_verifiers
        self._batches: dict[VerifierSpec, BatchDecoder] = {}  # in order of last use, oldest first

    def __getitem__(self, verifier: VerifierSpec) -> BatchDecoder:
        return self._batches[verifier]

    def decoders(self) -> list[BatchDecoder]:
        return list(self._batches.values())

    def _resident(self) -> list[VerifierSpec]:
        """Every verifier the engine holds, least recently used first (one built outside the
        pool, such as the default prepared at start-up, counts as the oldest)."""
        return [v for v in self.engine.resident if v not in self._batches] + list(self._batches)

    def make_room(self, verifier: VerifierSpec, busy: Iterable[VerifierSpec]) -> bool:
        """Release idle verifiers, oldest first, until `verifier` fits under the cap; False
        when the others in use already fill it."""
        busy = set(busy)
        others = [v for v in self._resident() if v != verifier]
        while len(others) >= self.max_verifiers:
            victim = next((v for v in others if v not in busy), None)
            if victim is None:
                return False
            self._batches.pop(victim, None)
            self.engine.release(victim)
            others.remove(victim)
            log.info("engine: released the %s verifier (at most %d are kept)", victim, self.max_verifiers)
        return True

    def acquire(self, verifier: VerifierSpec, busy: Iterable[VerifierSpec]) -> BatchDecoder | None:
        """The decoder of `verifier`, built the first time (making room first), marked most
        recently used; None while the verifiers in use fill the pool."""
        batch = self._batches.pop(verifier, None)
        if batch is None:
            if not self.make_room(verifier, busy):
                return None
            with self.engine.lock:
                batch = self.engine.batch_decoder(verifier, list(range(self.max_batch)))
        self._batches[verifier] = batch
        return batch
