"""`/v1/chat/completions` and `/v1/completions`.

A request is read (within MAX_BODY_BYTES), validated (`openai_schema`), tokenized off the
event loop, checked against the context, and submitted to the scheduler as one job for its
`n` choices (quasar.server.events). The first event is awaited before any byte is sent, so
an error the scheduler finds (an unavailable verifier, say) still gets a proper status
code even for a streamed request.

Every response carries a `quasar` object (drafter, verifier, verifier steps, mean
acceptance length, tokens/s, ..., summed over the choices; a streamed choice's final chunk
has its own); every streamed chunk carries `quasar: {"pieces": [[text, from_draft], ...],
"tokens", "steps", "accepted"}`, the last three cumulative, which is what the playground
highlights and counts.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from quasar.engine.plan import DecodePlan
from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError
from quasar.server.context import ServerContext, context
from quasar.server.events import PROGRESS, JobEvents, JobStream, next_event, scheduler_error, submit
from quasar.server.logprobs import ChoiceLogprobs
from quasar.server.openai_schema import (ApiError, GenRequest, choice, completion_response, new_id, now,
                                         parse_chat, parse_completion, parse_json_body, request_plan, sse,
                                         stream_chunk, usage)
from quasar.server.scheduler import Job, SchedulerClosed
from quasar.speculative.generate import Chunk, Result, Stats

MAX_BODY_BYTES = 8 * 1024 * 1024


async def read_body(request: Request) -> dict:
    """The request's JSON object; a 413 past MAX_BODY_BYTES (declared or sent)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.", code="body_too_large")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.", code="body_too_large")
    return parse_json_body(raw)


async def encode(ctx: ServerContext, req: GenRequest) -> list[int]:
    """The prompt's token ids (the chat template applied to messages), tokenized off the loop."""
    tokenizer = ctx.llm.tokenizer
    try:
        if req.prompt_ids is not None:
            ids = req.prompt_ids
        elif req.kind == "chat":
            ids = await run_in_threadpool(tokenizer.encode_chat, req.messages)
        else:
            ids = await run_in_threadpool(tokenizer.encode, req.prompt)
    except QuasarError as e:
        raise ApiError(400, str(e), param="messages" if req.kind == "chat" else "prompt",
                       code="invalid_value") from None
    if not ids:
        raise ApiError(400, "The prompt encodes to no tokens.", param="prompt", code="invalid_value")
    return ids


def completion_tokens(ctx: ServerContext, req: GenRequest, prompt_len: int) -> int:
    """The request's max_tokens, or the server's default cut to the room the context leaves;
    a 400 when the prompt (and max_tokens) do not fit."""
    max_context = ctx.llm.max_context
    prompt_field = "messages" if req.kind == "chat" else "prompt"
    if req.max_tokens is None:
        max_tokens = min(ctx.default_max_tokens, max_context - prompt_len)
        if max_tokens < 1:
            raise ApiError(400, f"This model's maximum context length is {max_context} tokens; "
                                f"the prompt alone has {prompt_len}.", param=prompt_field,
                           code="context_length_exceeded")
        return max_tokens
    if prompt_len + req.max_tokens > max_context:
        raise ApiError(400, f"This model's maximum context length is {max_context} tokens. However, "
                            f"you requested {prompt_len + req.max_tokens} tokens ({prompt_len} in the "
                            f"{prompt_field}, {req.max_tokens} in the completion). Please reduce the length "
                            "of the prompt or of max_tokens.", param="max_tokens", code="context_length_exceeded")
    return req.max_tokens


async def plan_request(ctx: ServerContext, req: GenRequest, verifier: VerifierSpec, max_tokens: int) -> DecodePlan:
    """The request's plan on `verifier`. Resolving drafter "auto" may measure the verifier's
    step, which builds it: a verifier not built yet is planned on the scheduler's thread, after
    room is made for it in its pool, so no model is built on the event loop or past the cap."""
    if verifier in ctx.llm.engine.resident:
        return request_plan(ctx.llm, req, verifier, max_tokens)
    scheduler = ctx.scheduler

    def plan() -> DecodePlan:
        scheduler.pool.make_room(verifier, scheduler.busy_verifiers())
        return request_plan(ctx.llm, req, verifier, max_tokens)

    try:
        return await run_in_threadpool(scheduler.call, plan)
    except SchedulerClosed as e:
        raise scheduler_error(e) from None


def quasar_stats(plan: DecodePlan, stats: Stats, job: Job) -> dict:
    """A reply's `quasar` object: what decoded it and how it went."""
    return {"drafter": plan.drafter, "verifier": plan.verifier,
            "num_draft": plan.draft.num_draft if plan.drafter != "none" else 0,
            **({"draft_budget": plan.draft.draft_budget} if plan.drafter == "tree" else {}),
            **stats.as_dict(), "queue_s": round(job.queue_s, 4)}


def choice_logprobs(ctx: ServerContext, req: GenRequest) -> list[ChoiceLogprobs] | None:
    return None if req.logprobs is None else [ChoiceLogprobs(req.kind, ctx.text_of) for _ in range(req.n)]


async def generate(request: Request, kind: str):
    """Answer a chat or completion request, whole or streamed."""
    arrived = time.perf_counter()
    ctx = context(request)
    body = await read_body(request)
    draft = ctx.llm.draft
    req = parse_chat(body, draft) if kind == "chat" else parse_completion(body, ctx.llm.tokenizer.vocab_size, draft)
    ctx.check_model(req.model)
    verifier = ctx.check_verifier(req.verifier)
    prompt_ids = await encode(ctx, req)
    plan = await plan_request(ctx, req, verifier, completion_tokens(ctx, req, len(prompt_ids)))
    events = submit(ctx.scheduler, lambda sink: Job(prompt_ids, plan, sink, n=req.n, created=arrived))
    first = await next_event(events, request)
    rid, created = new_id(kind), now()
    if req.stream:
        return JobStream(stream_events(ctx, req, events, first, rid, created), events,
                         media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    event = first
    while event[0] in PROGRESS:  # the result holds all of it
        event = await next_event(events, request)
    results: list[Result] = event[1]
    logprobs = choice_logprobs(ctx, req)
    choices = [choice(req, i, r.text, r.finish_reason, None if logprobs is None else logprobs[i].format(r.logprobs))
               for i, r in enumerate(results)]
    return completion_response(req, rid, created, ctx.served, choices,
                               usage(len(prompt_ids), sum(r.stats.new_tokens for r in results),
                                     max(r.stats.cached_tokens for r in results)),
                               quasar_stats(plan, Stats.combined([r.stats for r in results]), events.job))


class _Progress:
    """A choice's tokens, steps and accepted drafts so far, which its chunks report (the playground's counters)."""

    def __init__(self):
        self.tokens = self.steps = self.accepted = 0

    def add(self, chunk: Chunk) -> dict:
        self.tokens += len(chunk.token_ids)
        self.steps += 1
        self.accepted += sum(1 for _, from_draft in chunk.pieces if from_draft)
        return {"pieces": [[t, d] for t, d in chunk.pieces], "tokens": self.tokens, "steps": self.steps,
                "accepted": self.accepted}


async def stream_events(ctx: ServerContext, req: GenRequest, events: JobEvents, first, rid: str, created: int):
    """The server-sent events of a streamed reply, from the job's first event on. Its status
    is sent already: a failure mid-stream is an error event, then [DONE]."""
    job = events.job
    progress: dict[int, _Progress] = {}
    logprobs = choice_logprobs(ctx, req)

    def chunk(index: int, **kw) -> bytes:
        return sse(stream_chunk(req, rid, created, ctx.served, index=index, **kw))

    try:
        if req.kind == "chat":
            for i in range(req.n):
                yield chunk(i, text="", role=True)
        event = first
        while event[0] in PROGRESS:
            index, item = event[1]
            if event[0] == "choice":
                yield chunk(index, text=None if req.kind == "chat" else "", finish_reason=item.finish_reason,
                            quasar=quasar_stats(job.plan, item.stats, job))
            else:
                q = progress.setdefault(index, _Progress()).add(item)
                if item.pieces or item.logprobs:  # text held back before a stop string still has logprobs
                    yield chunk(index, text=item.text, quasar=q,
                                logprobs=None if logprobs is None else logprobs[index].format(item.logprobs))
            event = await events.next(None)
        if event[0] == "result" and req.include_usage:
            tokens = sum(r.stats.new_tokens for r in event[1])
            cached = max(r.stats.cached_tokens for r in event[1])
            yield sse(stream_chunk(req, rid, created, ctx.served, no_choices=True,
                                   use=usage(len(job.prompt_ids), tokens, cached)))
        elif event[0] == "error":
            yield sse(scheduler_error(event[1]).body())
        yield sse("[DONE]")
    finally:
        if job.outcome is None:
            job.cancel.set()


async def chat_completions(request: Request):
    return await generate(request, "chat")


async def completions(request: Request):
    return await generate(request, "completion")


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
