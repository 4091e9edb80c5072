"""`Engine`: the verifiers of one loaded model, built once each and what they decode with.

An engine owns every verifier it built (its `VerifierSpec` to its Transformer, each with its
own static KV cache of `max_batch` sequence slots): fp and pruned:F from the float model,
w8a8 through quasar.engine.w8a8_verifier, w4a8 and w4a8-small through
quasar.engine.w4a8_verifier. A verifier is built on first use, its measured step costs
installed (quasar.runtime.step_cost) and warmed up with one step. The engine also holds each
verifier's token-recycling table, prices its rows (`step_costs`, `prefers_trees`), plans
requests on it (`plan`) and decodes them (`stream`, `decode_batch`). One call at a time uses
its verifiers (`lock`). `quasar.api.LLM` is its front: one engine per LLM.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Iterator

import torch

from quasar.defaults import DEFAULT_BATCH_ROWS, DEFAULT_PROMPT_CACHE_MIB
from quasar.engine.plan import DecodePlan
from quasar.engine.spec import VerifierSpec
from quasar.engine.verifiers import pruned_model
from quasar.engine.w4a8_verifier import w4a8_verifier
from quasar.engine.w8a8_verifier import w8a8_verifier
from quasar.errors import QuasarError
from quasar.kernels import ext
from quasar.models.llama import Transformer
from quasar.models.loader import LoadedModel
from quasar.quant.options import QuantOptions
from quasar.runtime import step_cost
from quasar.runtime.step_cost import StepCosts
from quasar.speculative.batch import BatchDecoder, decode
from quasar.speculative.drafters import Drafter
from quasar.speculative.generate import Chunk, Result
from quasar.speculative.prompt_cache import PromptCache
from quasar.speculative.options import DecodeOptions
from quasar.speculative.registry import AUTO, make_drafter, resolve_drafter
from quasar.speculative.tree_drafter import RecyclingTable


class Engine:
    """The verifiers of `loaded` (a LoadedModel), each with a KV cache of `max_batch` slots of
    `max_context` tokens; `quant` says how the W8A8 verifier is made."""

    def __init__(self, loaded: LoadedModel, quant: QuantOptions, max_context: int, max_batch: int,
                 prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB):
        self.loaded, self.quant = loaded, quant
        self.max_context, self.max_batch = max_context, max_batch
        self.prompt_cache_mib = prompt_cache_mib
        self.lock = threading.RLock()  # held while a call uses the verifiers and their caches
        self._models: dict[VerifierSpec, Transformer] = {}
        self._recycled: dict[VerifierSpec, RecyclingTable] = {}
        self._prompts: dict[VerifierSpec, PromptCache] = {}

    # ------------------------------------------------------------ verifiers
    def model(self, spec: VerifierSpec) -> Transformer:
        """The verifier `spec`, built (for w8a8: quantized or loaded from the cache, its kernels
        compiled or loaded), its step costs installed and warmed up with one step, once."""
        if spec not in self._models:
            model = self._build(spec)
            step_cost.install_measured(model)  # what its rows cost on this CPU (a fused step only)
            model.setup_cache(self.max_context, n_slots=self.max_batch)
            # One step now, so one-time work (loading the int8 kernels, packing weights) is
            # not timed as decoding later.
            model(torch.zeros((1, 1), dtype=torch.long, device=model.model.norm.weight.device), logits="last")
            model.cache.lengths = [0] * self.max_batch
            self._models[spec] = model
        return self._models[spec]

    def _build(self, spec: VerifierSpec) -> Transformer:
        """A new model of verifier `spec`; the float weights load only for fp and pruned:F."""
        if spec.kind == "fp":
            return self._float_model()
        if spec.kind == "pruned":
            return pruned_model(self._float_model(), spec.fraction)
        if spec.kind == "w8a8":
            return w8a8_verifier(self.loaded, self.quant)
        return w4a8_verifier(self.loaded, layout=spec.layout)

    def _float_model(self) -> Transformer:
        if self.loaded.quantized:  # its `model` is the int8 one: "fp" would silently time W8A8
            raise QuasarError(f"{self.loaded.source} is a {self.loaded.quant_kind.upper()} checkpoint with no float "
                              "weights; the fp and pruned verifiers need the float model (its directory or GGUF "
                              "file)", param="verifier")
        return self.loaded.model

    @property
    def resident(self) -> list[VerifierSpec]:
        """The verifiers built and kept (with their KV caches), oldest first."""
        return list(self._models)

    def release(self, spec: VerifierSpec) -> None:
        """Drop verifier `spec`, its KV cache, prompt cache and recycling table (a later use builds it
        again). The caller must hold no decoder over it."""
        with self.lock:
            model = self._models.pop(spec, None)
            self._recycled.pop(spec, None)
            self._prompts.pop(spec, None)
            if model is not None:
                model.cache = None  # the cache goes even if something still holds the model
        if model is not None:
            del model
            gc.collect()  # module trees may hold reference cycles: free their memory now

    def kernel_path(self, spec: VerifierSpec) -> str:
        """The kernel path `spec` decodes on: the int8 kernels' (amx, avx512-vnni, avx-vnni,
        avx2 or portable) for w8a8, the 4-bit kernels' for w4a8 (its int8 layers run the same
        path or, with AMX, the tiles), "pytorch" for float verifiers."""
        if spec.kind == "w8a8":
            return ext.kernel_path()
        return ext.w4a8_kernel_path() if spec.kind == "w4a8" else ext.PYTORCH_PATH

    # ------------------------------------------------------------ drafting
    def step_costs(self, spec: VerifierSpec) -> StepCosts | None:
        """What a step of `spec`'s rows costs on the active kernel path (building it first),
        or None where its steps do not run fused."""
        return step_cost.current(self.model(spec))

    def prefers_trees(self, spec: VerifierSpec) -> bool:
        """Whether tree drafts pay on `spec`: a quantized verifier whose fused step, measured on
        this CPU, takes 16 rows at little more than the cost of one or takes 10 ms or more for
        one row (StepCosts.prefers_trees); never a float one."""
        if not spec.quantized:
            return False
        costs = self.step_costs(spec)
        return costs is not None and costs.prefers_trees

    def resolve_drafter(self, drafter: str, spec: VerifierSpec) -> str:
        """`drafter`, with "auto" made tree drafts where they pay on `spec` (`prefers_trees`),
        else the chain (quasar.defaults.DEFAULT_DRAFTER)."""
        return resolve_drafter(drafter, drafter == AUTO and self.prefers_trees(spec))

    def plan(self, options: DecodeOptions, spec: VerifierSpec, resolve: bool = True) -> DecodePlan:
        """The `DecodePlan` of checked `options` on `spec`, its drafter resolved
        (`resolve_drafter`; `resolve=False` leaves "auto")."""
        if resolve:
            drafter = self.resolve_drafter(options.draft.drafter, spec)
            if drafter != options.draft.drafter:
                options = dataclasses.replace(options, draft=options.draft.replace(drafter=drafter))
        return DecodePlan(spec, options)

    def recycling_table(self, spec: VerifierSpec) -> RecyclingTable:
        """The token-recycling table the tree drafts of `spec` share: the verifier's top-k
        next tokens after each token it verified, kept across requests (as Token Recycling
        keeps its matrix), so a request's first steps draft from earlier ones'. Greedy
        output never depends on it (drafts are verified exactly)."""
        return self._recycled.setdefault(spec, RecyclingTable())

    def new_drafter(self, plan: DecodePlan) -> Drafter:
        """A fresh drafter for one sequence of `plan`. Tree drafters share their verifier's
        recycling table, except under seeded sampling, whose random draws follow the drafts:
        its output must not depend on what was decoded before."""
        options = plan.draft.drafter_kwargs()
        sampling = plan.options.sampling
        if plan.drafter == "tree" and (sampling.greedy or sampling.seed is None):
            options["recycled"] = self.recycling_table(plan.verifier_spec)
        return make_drafter(plan.drafter, **options)

    # ------------------------------------------------------------ decoding
    def prompt_cache(self, spec: VerifierSpec) -> PromptCache | None:
        """The finished sequences' K/V that `spec`'s batches reuse (quasar.speculative.
        prompt_cache), up to `prompt_cache_mib`; None when that is 0."""
        if self.prompt_cache_mib <= 0:
            return None
        return self._prompts.setdefault(spec, PromptCache(self.prompt_cache_mib << 20))

    def batch_decoder(self, spec: VerifierSpec, slots: list[int] | None = None) -> BatchDecoder:
        """A BatchDecoder over `spec`'s cache slots (all by default), with its prompt cache;
        hold `lock` while using it."""
        model = self.model(spec)
        cache = model.cache
        if cache is None or cache.n_slots < self.max_batch or cache.max_seq_len != self.max_context:
            model.setup_cache(self.max_context, n_slots=self.max_batch)  # someone resized it
            if spec in self._prompts:
                self._prompts[spec].clear()  # kept for the old cache's layout: they never match again
        return BatchDecoder(model, self.loaded.tokenizer, slots, max_rows=DEFAULT_BATCH_ROWS,
                            prompt_cache=self.prompt_cache(spec))

    def stream(self, plan: DecodePlan, ids: list[int]) -> Iterator[Chunk | Result]:
        """Decode prompt `ids` with `plan`: a Chunk per verifier step, then the Result."""
        draft = self.new_drafter(plan)
        with self.lock:
            model = self.model(plan.verifier_spec)
            yield from decode(model, self.loaded.tokenizer, ids, draft, plan.options,
                              prompt_cache=self.prompt_cache(plan.verifier_spec))

    def decode_batch(self, plan: DecodePlan, prompts: list[list[int]]) -> list[Result]:
        """Decode every prompt in `prompts` (token ids) with `plan`, up to `max_batch` at a time
        in one verifier step; the results in prompt order."""
        results: list[Result | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))[::-1]
        with self.lock:
            batch = self.batch_decoder(plan.verifier_spec)
            while todo or batch.n_running:
                while todo and batch.n_free:
                    i = todo.pop()
                    batch.add(i, prompts[i], self.new_drafter(plan), plan.options)
                for i, item in batch.step():
                    if isinstance(item, Exception):
                        raise item
                    if isinstance(item, Result):
                        results[i] = item
        return results
