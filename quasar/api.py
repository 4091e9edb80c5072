"""The Python API: `LLM(model=...)` then `.generate(prompt_or_messages, **options)`.

An LLM holds the opened model (config and tokenizer; its float weights load only when a
verifier that needs them, fp or pruned:F, is asked for) and its `Engine`
(quasar.engine.engine), which builds each verifier on first use; every verifier has its own
static KV cache with `max_batch` sequence slots. A verifier's name is parsed here, where a
call enters, into a `VerifierSpec` (quasar.engine.spec) that the engine takes.
`generate` / `stream` decode one prompt; `generate_batch` decodes many together, one
verifier step for all (quasar.speculative.batch), with the same tokens each would get
alone. One call at a time uses an LLM's verifiers (`lock`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

import quasar.quant  # noqa: F401  (registers the W8A8 checkpoint format with the model loader)
from quasar.defaults import DEFAULT_CONTEXT, DEFAULT_MAX_BATCH, DEFAULT_PROMPT_CACHE_MIB, MAX_BATCH
from quasar.engine.engine import Engine
from quasar.engine.plan import DecodePlan
from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError
from quasar.models.llama import Transformer
from quasar.models.loader import LoadedModel, load_model
from quasar.quant.options import QuantOptions
from quasar.speculative.batch import BatchDecoder
from quasar.speculative.drafters import Drafter
from quasar.speculative.generate import Chunk, Result
from quasar.speculative.options import DecodeOptions, DraftOptions, SamplingOptions, check_int
from quasar.speculative.tree_drafter import RecyclingTable


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    drafter: str
    verifier: str
    stats: dict
    kernel_path: str = "pytorch"  # how the verifier's int8 kernels ran (quasar.kernels.ext.kernel_path)

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "drafter": self.drafter, "verifier": self.verifier, "kernel_path": self.kernel_path,
                "stats": self.stats}


class LLM:
    """A loaded model ready to decode with any drafter/verifier pair.

    `draft` (with `drafter` as a shorthand for its drafter) and `verifier` are the defaults
    of every call; each call may override them. `quant` says how the W8A8 verifier is made.
    Verifiers are named by a string ("w8a8", "pruned:0.5") or a `VerifierSpec`, parsed here;
    the `engine` (quasar.engine.engine) builds, keeps and decodes with them.
    """

    def __init__(self, model: str = "default", *, dtype: str = "auto", drafter: str | None = None,
                 verifier: str | VerifierSpec | None = None, draft: DraftOptions | None = None,
                 max_context: int = DEFAULT_CONTEXT, threads: int | None = None,
                 quant: QuantOptions | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                 prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB):
        check_int("max_batch", max_batch, 1, MAX_BATCH)
        check_int("prompt_cache_mib", prompt_cache_mib, 0, 1 << 20)
        if threads:
            torch.set_num_threads(threads)
        spec = VerifierSpec.parse(verifier) if verifier is not None else None  # fails before the load
        # The per-call defaults: `draft` (its drafter replaced by `drafter` when given).
        self.draft = (draft or DraftOptions()).replace(drafter=drafter)
        self.loaded: LoadedModel = load_model(model, dtype)
        self.verifier_spec = spec or VerifierSpec.parse(self.loaded.default_verifier)
        self.tokenizer = self.loaded.tokenizer
        self.config = self.loaded.config
        self.dtype = dtype
        self.engine = Engine(self.loaded, quant or QuantOptions(),
                             min(max_context, self.config.max_position_embeddings), max_batch, prompt_cache_mib)
        # The engine's, fixed for its life; `lock` is held while a call uses the verifiers.
        self.max_context, self.max_batch = self.engine.max_context, self.engine.max_batch
        self.quant, self.lock = self.engine.quant, self.engine.lock

    @property
    def verifier(self) -> str:
        """The default verifier's canonical name."""
        return str(self.verifier_spec)

    @property
    def drafter(self) -> str:
        """The default drafter's name (may be "auto": `resolve_drafter`)."""
        return self.draft.drafter

    @property
    def model(self) -> Transformer:
        """The float model (for a W8A8 checkpoint directory: that model), loaded on first use."""
        return self.loaded.model

    def _spec(self, verifier: str | VerifierSpec | None = None) -> VerifierSpec:
        """The `VerifierSpec` of `verifier` (a name or a spec; None: this LLM's)."""
        return VerifierSpec.parse(verifier) if verifier else self.verifier_spec

    def verifier_model(self, verifier: str | VerifierSpec) -> Transformer:
        """The verifier `verifier`, built (for w8a8: quantized or loaded from the cache, its
        kernels compiled or loaded) and warmed up with one step, once (`Engine.model`)."""
        return self.engine.model(VerifierSpec.parse(verifier))

    @property
    def resident_verifiers(self) -> list[str]:
        """The verifiers built and kept (with their KV caches), oldest first."""
        return [str(spec) for spec in self.engine.resident]

    def release_verifier(self, verifier: str | VerifierSpec) -> None:
        """Drop `verifier`, its KV cache and its recycling table (a later use builds it
        again). The caller must hold no decoder over it."""
        self.engine.release(VerifierSpec.parse(verifier))

    def prepare(self, verifier: str | VerifierSpec | None = None, progress: bool = False) -> float | None:
        """Build `verifier` (default: this LLM's) now; returns the seconds it took, or None
        when it was ready already. With `progress`, a bar on stderr while it builds."""
        spec = self._spec(verifier)
        if spec in self.engine.resident:
            return None
        t0 = time.perf_counter()
        done = threading.Event()
        with tqdm(total=1, desc=f"building the {str(spec).upper()} verifier (once, cached)", file=sys.stderr,
                  disable=not progress, leave=False, bar_format="{desc}: {elapsed}") as bar:

            def tick() -> None:  # keep the elapsed time moving while the build runs
                while not done.wait(0.5):
                    bar.refresh()

            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
            try:
                self.engine.model(spec)
            finally:
                done.set()
                ticker.join()
        return time.perf_counter() - t0

    def encode(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if raw:
                return self.tokenizer.encode(prompt)
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        if isinstance(prompt, list):
            return self.tokenizer.encode_chat(prompt)
        raise QuasarError("prompt must be a string or a list of {role, content} messages")

    def check_options(self, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int | None = None, stop: list[str] | str | None = None,
                      drafter: str | None = None, verifier: str | VerifierSpec | None = None,
                      num_draft: int | None = None, ngram_min: int | None = None, ngram_max: int | None = None,
                      adaptive: bool | None = None, logprobs: int | None = None, draft_budget: int | None = None,
                      resolve: bool = True) -> DecodePlan:
        """The `DecodePlan` of these keyword options, without decoding (a QuasarError names a
        bad one, in `param`). Draft options left None are this LLM's (`draft`). `num_draft`
        and `adaptive` shape chain drafts; the tree drafter proposes up to `draft_budget`
        nodes per step instead. `logprobs=N` adds each output token's logprob and N
        alternatives to chunks and result (`quasar.speculative.logprobs`). `resolve=False`
        leaves "auto" unresolved (see `plan`)."""
        draft = self.draft.replace(drafter=drafter, num_draft=num_draft, ngram_min=ngram_min, ngram_max=ngram_max,
                                   draft_budget=draft_budget, adaptive=adaptive)
        sampling = SamplingOptions(temperature, top_k, top_p, seed)
        options = DecodeOptions(max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, draft=draft,
                                logprobs=logprobs)
        return self.plan(options, verifier, resolve)

    def plan(self, options: DecodeOptions, verifier: str | VerifierSpec | None = None,
             resolve: bool = True) -> DecodePlan:
        """The `DecodePlan` of checked `options` on `verifier` (None: this LLM's), checked
        here, with the drafter resolved for it ("auto": `resolve_drafter`, which measures the
        quantized verifier's step, building it first if needed; `resolve=False` leaves "auto")."""
        return self.engine.plan(options, self._spec(verifier), resolve)

    def resolve_drafter(self, drafter: str | None, verifier: str | VerifierSpec) -> str:
        """The drafter a call decodes with: `drafter` (None: this LLM's default), where "auto"
        becomes tree drafts if `verifier` is a quantized model (W8A8 or W4A8) whose fused step,
        measured on this CPU, takes 16 rows at little more than the cost of one or takes 10 ms
        or more for one row (quasar.runtime.step_cost.StepCosts.prefers_trees), else the chain
        (quasar.defaults.DEFAULT_DRAFTER)."""
        return self.engine.resolve_drafter(drafter or self.drafter, VerifierSpec.parse(verifier))

    def new_drafter(self, plan: DecodePlan) -> Drafter:
        """A fresh drafter for one sequence of `plan`. Tree drafters share their verifier's
        recycling table (`recycling_table`), except under seeded sampling, whose random draws
        follow the drafts: its output must not depend on what was decoded before."""
        return self.engine.new_drafter(plan)

    def recycling_table(self, verifier: str | VerifierSpec) -> RecyclingTable:
        """The token-recycling table the tree drafts of `verifier` share: the verifier's top-k
        next tokens after each token it verified, kept across requests (as Token Recycling
        keeps its matrix), so a request's first steps draft from earlier ones'. Greedy
        output never depends on it (drafts are verified exactly)."""
        return self.engine.recycling_table(VerifierSpec.parse(verifier))

    def encode_checked(self, prompt: str | list[dict] | None, prompt_ids: list[int] | None, raw: bool) -> list[int]:
        ids = prompt_ids if prompt_ids is not None else self.encode(prompt, raw)
        if len(ids) >= self.max_context:
            raise QuasarError(f"prompt has {len(ids)} tokens; the context holds {self.max_context}")
        return ids

    def batch_decoder(self, verifier: str | VerifierSpec, slots: list[int] | None = None) -> BatchDecoder:
        """A BatchDecoder over `verifier`'s cache slots (all by default); hold `lock` while using it."""
        return self.engine.batch_decoder(VerifierSpec.parse(verifier), slots)

    def stream(self, prompt: str | list[dict] | None = None, *, prompt_ids: list[int] | None = None,
               raw: bool = False, plan: DecodePlan | None = None, **options) -> Iterator[Chunk | Result]:
        """Yield a Chunk per verifier step, then the Result (see `quasar.speculative.generate`).

        Decodes with `plan`, or with the plan of `options` (those of `check_options`).
        """
        plan = self._plan(plan, options)
        ids = self.encode_checked(prompt, prompt_ids, raw)
        yield from self.engine.stream(plan, ids)

    def generate(self, prompt: str | list[dict] | None = None, *, plan: DecodePlan | None = None,
                 **options) -> GenerationResult:
        """Decode to the end; returns text, token ids, finish reason and stats."""
        plan = self._plan(plan, {k: v for k, v in options.items() if k not in ("prompt_ids", "raw")})
        stream_args = {k: v for k, v in options.items() if k in ("prompt_ids", "raw")}
        result = None
        for item in self.stream(prompt, plan=plan, **stream_args):
            if isinstance(item, Result):
                result = item
        return self._generation_result(result, plan)

    def generate_batch(self, prompts: list, *, raw: bool = False, plan: DecodePlan | None = None,
                       **options) -> list[GenerationResult]:
        """Decode every prompt (a string or a list of messages) to the end, up to `max_batch`
        at a time in one verifier step; the results are in prompt order, each with the tokens
        `generate` gives it alone. `plan` (or `options`, those of `check_options`) is every
        prompt's."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise QuasarError("prompts must be a non-empty list of prompts")
        plan = self._plan(plan, options)
        ids = [self.encode_checked(p, None, raw) for p in prompts]
        return [self._generation_result(r, plan) for r in self.engine.decode_batch(plan, ids)]

    def _plan(self, plan: DecodePlan | None, options: dict) -> DecodePlan:
        if plan is None:
            return self.check_options(**options)
        if options:
            raise QuasarError(f"pass either a plan or decoding options, not both (got {sorted(options)[0]!r})")
        return plan

    def _generation_result(self, result: Result, plan: DecodePlan) -> GenerationResult:
        return GenerationResult(result.text, result.token_ids, result.finish_reason, plan.drafter, plan.verifier,
                                result.stats.as_dict(), self.engine.kernel_path(plan.verifier_spec))

    def kernel_path(self, verifier: str | VerifierSpec | None = None) -> str:
        """The kernel path `verifier` (None: this LLM's) decodes on: the int8 kernels' (amx,
        avx512-vnni, avx-vnni, avx2 or portable) for w8a8, the 4-bit kernels' for w4a8 (its
        int8 layers run the same path or, with AMX, the tiles), "pytorch" for float verifiers."""
        return self.engine.kernel_path(self._spec(verifier))
