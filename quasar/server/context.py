"""What every route of one server shares: the LLM, its scheduler and metrics, the served
model's id, and the access rules (API key, model name). `create_app` makes one and keeps
it on `app.state.context`; a route finds it with `context(request)`."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from fastapi import Request

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
    api_key: str | None = None
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

    def check_auth(self, request: Request) -> None:
        """A 401 unless the server needs no key or the request's bearer token is it."""
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise ApiError(401, "You didn't provide an API key. Send it in an Authorization header: "
                                "'Authorization: Bearer YOUR_KEY'.", code="missing_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

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
