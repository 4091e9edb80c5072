"""The Python API: `LLM(model=...)` then `.generate(prompt_or_messages, **options)`.

An LLM holds the float model and, built on first use, each verifier (w8a8, pruned:F);
every verifier has its own static KV cache. One LLM decodes one request at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from quasar.defaults import DEFAULT_ADAPTIVE, DEFAULT_CONTEXT, DEFAULT_DRAFTER, DEFAULT_VERIFIER
from quasar.errors import QuasarError
from quasar.models.loader import LoadedModel, load_model
from quasar.models.llama import Transformer
from quasar.spec.drafters import make_drafter
from quasar.spec.generate import Chunk, DecodeOptions, Result, decode
from quasar.spec.sampling import SamplingParams
from quasar.spec.verifiers import build_verifier, parse_verifier



@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    drafter: str
    verifier: str
    stats: dict

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "drafter": self.drafter, "verifier": self.verifier, "stats": self.stats}


class LLM:
    """A loaded model ready to decode with any drafter/verifier pair.

    `drafter` and `verifier` are the defaults for `generate`; each call may override them.
    """

    def __init__(self, model: str = "default", *, dtype: str = "fp32", drafter: str = DEFAULT_DRAFTER,
                 verifier: str = DEFAULT_VERIFIER, max_context: int = DEFAULT_CONTEXT, threads: int | None = None,
                 quant_options: dict | None = None):
        if threads:
            torch.set_num_threads(threads)
        parse_verifier(verifier)
        make_drafter(drafter)
        self.loaded: LoadedModel = load_model(model, dtype)
        self.tokenizer = self.loaded.tokenizer
        self.config = self.loaded.model.config
        self.drafter, self.verifier, self.dtype = drafter, verifier, dtype
        self.max_context = min(max_context, self.config.max_position_embeddings)
        self.quant_options = quant_options or {}
        self._verifiers: dict[str, Transformer] = {}
        self._lock = threading.Lock()

    @property
    def model(self) -> Transformer:
        return self.loaded.model

    def verifier_model(self, name: str) -> Transformer:
        """The verifier `name`, built (and for w8a8 quantized or loaded from cache) once."""
        if name not in self._verifiers:
            model = build_verifier(name, self.model, self._w8a8)
            model.setup_cache(self.max_context)
            self._verifiers[name] = model
        return self._verifiers[name]

    def _w8a8(self) -> Transformer:
        try:
            from quasar.quant.verifier import w8a8_verifier  # heavy; only when asked for
        except ImportError:
            raise QuasarError("verifier 'w8a8' is not available yet") from None

        return w8a8_verifier(self.loaded, **self.quant_options)

    def encode(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if raw:
                return self.tokenizer.encode(prompt)
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        if isinstance(prompt, list):
            return self.tokenizer.encode_chat(prompt)
        raise QuasarError("prompt must be a string or a list of {role, content} messages")

    def stream(self, prompt: str | list[dict] | None = None, *, prompt_ids: list[int] | None = None,
               raw: bool = False, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: list[str] | str | None = None,
               drafter: str | None = None, verifier: str | None = None, num_draft: int = 5,
               ngram_min: int = 1, ngram_max: int = 3, adaptive: bool = DEFAULT_ADAPTIVE) -> Iterator[Chunk | Result]:
        """Yield a Chunk per verifier step, then the Result (see `quasar.spec.generate`)."""
        drafter = drafter or self.drafter
        verifier = verifier or self.verifier
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        opts = DecodeOptions(max_new_tokens=max_new_tokens, stop=stops, num_draft=num_draft, adaptive=adaptive,
                             sampling=SamplingParams(temperature, top_k, top_p, seed)).validate()
        if drafter == "none":
            opts.num_draft = 0
        draft = make_drafter(drafter, **({"n_min": ngram_min, "n_max": ngram_max} if drafter == "ngram" else {}))
        ids = prompt_ids if prompt_ids is not None else self.encode(prompt, raw)
        if len(ids) >= self.max_context:
            raise QuasarError(f"prompt has {len(ids)} tokens; the context holds {self.max_context}")
        with self._lock:
            model = self.verifier_model(verifier)
            yield from decode(model, self.tokenizer, ids, draft, opts)

    def generate(self, prompt: str | list[dict] | None = None, **options) -> GenerationResult:
        """Decode to the end; returns text, token ids, finish reason and stats."""
        result = None
        for item in self.stream(prompt, **options):
            if isinstance(item, Result):
                result = item
        drafter = options.get("drafter") or self.drafter
        verifier = options.get("verifier") or self.verifier
        return GenerationResult(result.text, result.token_ids, result.finish_reason, drafter, verifier,
                                result.stats.as_dict())
