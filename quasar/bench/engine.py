"""What every engine `quasar bench` times has in common: the `Contender` interface, the
`RunResult` of one decode, and `Unavailable` for an engine that cannot run here.

Every engine takes the same prompt token ids and returns a `RunResult`. Timing follows one
rule for all of them: the *decode* rate counts tokens produced by decoding steps and the
time those steps took, prefill excluded.
- Quasar: prefill reads the prompt but its last token; every new token then comes from a
  decoding step, so decode time = `stats.decode_s`, rate tokens = new tokens.
- Peers (transformers, llama.cpp, OpenVINO): the prefill forward itself yields the first
  new token, so decode time = end − arrival of the first new token, rate tokens = new
  tokens − 1.
A verifier "step" is one forward after prefill (forward calls are counted), and the
tokens a step emits feed the acceptance-length histogram.

For the fidelity column each engine also names the model it decodes (`FidelitySource`), so
engines on the same model share one measurement (quasar.bench.fidelity).

The engines themselves live beside it (Quasar's modes in `runner`, the peers in `peers`
and `openvino`); they all import this leaf, so none of them needs another.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, ContextManager


class Unavailable(Exception):
    """An engine that cannot run here; the message says why (shown in the report)."""


@dataclass
class RunResult:
    token_ids: list[int]  # generated tokens, EOS excluded
    new_tokens: int  # len(token_ids)
    rate_tokens: int  # tokens produced by the timed decoding steps (see module doc)
    step_tokens: int  # tokens emitted by the counted steps (EOS included): acceptance numerator
    steps: int  # forwards after prefill
    prefill_s: float
    decode_s: float
    wall_s: float
    hist: Counter = field(default_factory=Counter)  # tokens emitted per step -> steps


@dataclass(frozen=True)
class FidelitySource:
    """The model an engine decodes. `key` names it (engines with the same key share one
    measurement); `scorer(window)` is a context manager giving that model's logits for token
    ids (an eval.fidelity LogitsFn over up to `window` ids). No scorer: the float model itself,
    the reference every other model is measured against."""
    key: str
    scorer: Callable[[int], ContextManager] | None = field(default=None, compare=False)  # equal by key


FLOAT_MODEL = FidelitySource("float model")  # ar-fp, ngram-fp, transformers


class Contender:
    name: str = ""
    kind: str = "peer"  # "mode" (Quasar) or "peer"
    description: str = ""
    bytes_per_step: int | None = None
    # Bytes of one KV cache element (None: not known, e.g. a peer that picks its own cache
    # precision): the runner adds the KV cache a step reads to its floor (runner.aggregate).
    kv_element_size: int | None = None
    weights: str = ""  # what weights it reads, for the report

    def prepare(self) -> None:
        """Load what is needed; raise Unavailable (or QuasarError) if it cannot run."""

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        raise NotImplementedError

    def fidelity_source(self) -> FidelitySource | None:
        """The model this engine decodes, once prepared; None: no logits to measure it by."""
        return None

    def info(self) -> dict:
        return {"kind": self.kind, "description": self.description, "weights": self.weights,
                "bytes_per_step": self.bytes_per_step, "kv_element_size": self.kv_element_size}
