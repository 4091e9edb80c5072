"""What every route of one server shares: the LLM, its scheduler and metrics, the served
model's id, and what a request may choose (the model name, the verifiers offered).
`create_app` makes one and keeps it on `app.state.context`; a route finds it with
`context(request)`. Who may send requests at all is quasar.server.access's."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from fastapi import Request

from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError
from quasar.server.logprobs import token_texts
from quasar.server.metrics import ServerMetrics
from quasar.server.openai_schema import ApiError, now
from quasar.server.scheduler import Scheduler


@dataclass
class ServerContext:
    llm: object  # quasar.api.LLM: its `draft` and `verifier` are every request's defaults
    scheduler: Scheduler
    metrics: ServerMetrics
    served: str  # the model id /v1/models lists, and the one a request may name
    verifiers: tuple[VerifierSpec, ...] = ()  # what a request may name; the LLM's own is always the first
    default_max_tokens: int = 1024  # a request's completion length when it sets none (capped by the context)
    created_at: int = field(default_factory=now)

    @cached_property
    def text_of(self) -> Callable[[int], str]:
        """Token id -> its text, for logprobs (cached: alternatives repeat a lot)."""
        return token_texts(self.llm.tokenizer)

    @property
    def defaults(self) -> dict:
        """The decoding defaults a request that sets none gets (as /health reports them)."""
        d = self.llm.draft
        return dict(drafter=d.drafter, verifier=self.llm.verifier, num_draft=d.num_draft, ngram_min=d.ngram_min,
                    ngram_max=d.ngram_max, adaptive=d.adaptive, draft_budget=d.draft_budget)

    def __post_init__(self):
        own, offered = self.llm.verifier_spec, dict.fromkeys(VerifierSpec.parse(v) for v in self.verifiers)
        self.verifiers = (own, *(v for v in offered if v != own))

    @property
    def verifier_names(self) -> list[str]:
        """The offered verifiers' canonical names, the server's own first."""
        return [str(v) for v in self.verifiers]

    def check_verifier(self, name: str | None) -> VerifierSpec:
        """The verifier a request names (None: the server's), parsed; a 400 for a name that
        is no verifier (the message `LLM` gives), or one listing the offered ones. Each
        verifier is a model and a KV cache, so requests choose among what the operator
        offered (--verifiers)."""
        if name is None:
            return self.llm.verifier_spec
        try:
            spec = VerifierSpec.parse(name)
        except QuasarError as e:
            raise ApiError(400, str(e)[:300], param="verifier", code="invalid_value") from None
        if spec not in self.verifiers:
            raise ApiError(400, f"The verifier {json.dumps(name)[:80]} is not offered by this server; choose one of: "
                                f"{', '.join(self.verifier_names)}.", param="verifier", code="verifier_not_offered")
        return spec

    def check_model(self, model_id: str | None) -> None:
        """The one model this server knows is the id `/v1/models` lists; a request may also omit it."""
        if model_id is not None and model_id != self.served:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves '{self.served}'.",
                           param="model", code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.served, "object": "model", "created": self.created_at, "owned_by": "quasar",
                "max_context": self.llm.max_context}


def context(request: Request) -> ServerContext:
    return request.app.state.context
