"""The FastAPI application: OpenAI-compatible endpoints, health, metrics and the playground.

`create_app(llm, ...)` wires a `Scheduler` (bounded queue + one worker thread) to the HTTP
routes. A generation request is validated and tokenized on the event loop side, checked
against the context, submitted to the scheduler (429 at once when the queue is full) and
answered from the scheduler's events. The first event is awaited before any byte is sent, so
an error the scheduler finds (an unavailable verifier, say) still gets a proper status code
even for a streamed request. A client that goes away, while waiting or mid-stream, sets
the job's cancel flag; the scheduler stops within one verifier step.

A request for `n` choices is one scheduler job: n sequences decoded side by side in the
engine's batch; their chunks interleave, each with its `index`. Every response carries a `quasar`
object (drafter, verifier, verifier steps, mean acceptance length, tokens/s, ..., summed
over the choices; a streamed choice's final chunk has its own); every streamed chunk carries
`quasar: {"pieces": [[text, from_draft], ...], "tokens", "steps", "accepted"}`, the
last three cumulative, which is what the playground highlights and counts.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from quasar.defaults import (DEFAULT_ADAPTIVE, DEFAULT_DRAFT_BUDGET, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN,
                             DEFAULT_NUM_DRAFT)
from quasar.errors import QuasarError
from quasar.server.scheduler import Job, QueueFull, Scheduler, SchedulerClosed
from quasar.server.metrics import CONTENT_TYPE, ServerMetrics
from quasar.server.logprobs import ChoiceLogprobs, token_texts
from quasar.server.openai_schema import (ApiError, GenRequest, choice, completion_response, error_body, new_id, now,
                                         parse_chat, parse_completion, parse_json_body, sse, stream_chunk, usage)
from quasar.speculative.generate import Chunk, Result, Stats

log = logging.getLogger("quasar.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
DISCONNECT_POLL_S = 0.25
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/")
GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def _playground_html() -> str:
    return resources.files("quasar.server").joinpath("playground.html").read_text(encoding="utf-8")


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _MetricsMiddleware:
    """Counts every HTTP request by endpoint and status; times the generation endpoints."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
            self.metrics.requests.inc(endpoint=endpoint, status=str(status[0]))
            if endpoint in GENERATION_ENDPOINTS:
                self.metrics.latency.observe(time.perf_counter() - t0, endpoint=endpoint)


class _JobEvents:
    """The asyncio side of a job: the scheduler's events, delivered to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.job: Job | None = None
        self._polled = time.monotonic()

    def sink(self, kind: str, payload: Any) -> None:  # called from the scheduler's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            if self.job is not None:
                self.job.cancel.set()

    async def next(self, request: Request | None) -> tuple[str, Any]:
        """The next event; checks for a client disconnect (then cancels the job) every DISCONNECT_POLL_S."""
        while True:
            if request is not None and time.monotonic() - self._polled >= DISCONNECT_POLL_S:
                self._polled = time.monotonic()
                if await request.is_disconnected():
                    self.job.cancel.set()
                    raise _ClientGone()
            if not self.queue.empty():
                return self.queue.get_nowait()
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

class _ClientGone(Exception):
    pass


class _JobStream(StreamingResponse):
    """A streaming response that cancels its job however the stream ends early."""

    def __init__(self, content, events: _JobEvents, **kw):
        super().__init__(content, **kw)
        self.events = events

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.events.job is not None and self.events.job.outcome is None:
                self.events.job.cancel.set()


def create_app(llm, *, api_key: str | None = None, max_queue: int = 32, model_name: str | None = None,
               num_draft: int = DEFAULT_NUM_DRAFT, ngram_min: int = DEFAULT_NGRAM_MIN,
               ngram_max: int = DEFAULT_NGRAM_MAX, adaptive: bool = DEFAULT_ADAPTIVE,
               draft_budget: int = DEFAULT_DRAFT_BUDGET, default_max_tokens: int = 1024, metrics: ServerMetrics | None = None,
               max_batch: int | None = None) -> FastAPI:
    """An app serving `llm` (a `quasar.api.LLM`). The drafter/verifier defaults are the LLM's
    own; up to `max_batch` sequences (default: the LLM's) decode together."""
    metrics = metrics or ServerMetrics()
    scheduler = Scheduler(llm, max_queue=max_queue, metrics=metrics, max_batch=max_batch).start()
    served = model_name or _model_name(llm)
    defaults = dict(drafter=llm.drafter, verifier=llm.verifier, num_draft=num_draft, ngram_min=ngram_min,
                    ngram_max=ngram_max, adaptive=adaptive, draft_budget=draft_budget)
    created_at = now()
    html = _playground_html()
    text_of = token_texts(llm.tokenizer)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="Quasar", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.scheduler, app.state.metrics, app.state.llm, app.state.model_name = scheduler, metrics, llm, served
    app.state.defaults = defaults
    app.add_middleware(_MetricsMiddleware, metrics=metrics)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            msg = f"Unknown route {request.method} {request.url.path}."
        return JSONResponse(error_body(msg, kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"Invalid request: {first.get('msg', exc)}", param=param,
                                       code="invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error for %s %s", request.method, request.url.path)
        return JSONResponse(error_body("The server had an error while processing your request.", "server_error"),
                            status_code=500)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise ApiError(401, "You didn't provide an API key. Send it in an Authorization header: "
                                "'Authorization: Bearer YOUR_KEY'.", code="missing_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    # ------------------------------------------------------------------ plain routes
    @app.get("/", include_in_schema=False)
    async def playground():
        return HTMLResponse(html)

    @app.get("/health")
    async def health():
        ok = scheduler.alive
        body = {"status": "ok" if ok else "unavailable", "model": served, "queue_depth": scheduler.queue_depth,
                "max_queue": scheduler.max_queue, "running": scheduler.running,
                "completed": scheduler.completed, "defaults": defaults, "max_context": llm.max_context}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": created_at, "owned_by": "quasar",
                "max_context": llm.max_context}

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    def check_model(model_id: str | None) -> None:
        """The one model this server knows is the id `/v1/models` lists; a request may also omit it."""
        if model_id is not None and model_id != served:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves '{served}'.",
                           param="model", code="model_not_found")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        check_auth(request)
        check_model(model_id)
        return model_card()

    # ------------------------------------------------------------------ generation
    async def read_body(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.", code="body_too_large")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.", code="body_too_large")
        return parse_json_body(raw)

    def decode_options(req: GenRequest, prompt_len: int) -> dict:
        """LLM.stream keyword arguments, checked now so bad values are a 400 before queueing."""
        room = llm.max_context - prompt_len
        if req.max_tokens is None:
            max_tokens = min(default_max_tokens, room)
            if max_tokens < 1:
                raise ApiError(400, f"This model's maximum context length is {llm.max_context} tokens; "
                                    f"the prompt alone has {prompt_len}.", param="messages" if req.kind == "chat"
                               else "prompt", code="context_length_exceeded")
        else:
            max_tokens = req.max_tokens
            if prompt_len + max_tokens > llm.max_context:
                raise ApiError(400, f"This model's maximum context length is {llm.max_context} tokens. However, "
                                    f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                                    f"{'messages' if req.kind == 'chat' else 'prompt'}, {max_tokens} in the "
                                    "completion). Please reduce the length of the prompt or of max_tokens.",
                               param="max_tokens", code="context_length_exceeded")
        opts = {k: (getattr(req, k) if getattr(req, k) is not None else v) for k, v in defaults.items()}
        opts.update(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    seed=req.seed, stop=req.stop, logprobs=req.logprobs)
        try:
            opts["drafter"] = llm.check_options(**opts).drafter  # "auto" resolved: what decodes
        except QuasarError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
        return opts

    async def encode(req: GenRequest) -> list[int]:
        try:
            if req.prompt_ids is not None:
                ids = req.prompt_ids
            elif req.kind == "chat":
                ids = await run_in_threadpool(llm.tokenizer.encode_chat, req.messages)
            else:
                ids = await run_in_threadpool(llm.tokenizer.encode, req.prompt)
        except QuasarError as e:
            raise ApiError(400, str(e), param="messages" if req.kind == "chat" else "prompt",
                           code="invalid_value") from None
        if not ids:
            raise ApiError(400, "The prompt encodes to no tokens.", param="prompt", code="invalid_value")
        return ids

    def scheduler_error(exc: Exception) -> ApiError:
        if isinstance(exc, QuasarError):
            return ApiError(400, str(exc), code="invalid_value")
        if isinstance(exc, SchedulerClosed):
            return ApiError(503, str(exc), "server_error", code="shutting_down")
        return ApiError(500, "The server had an error while generating this reply.", "server_error")

    def quasar_stats(opts: dict, stats: Stats, job: Job) -> dict:
        return {"drafter": opts["drafter"], "verifier": opts["verifier"],
                "num_draft": opts["num_draft"] if opts["drafter"] != "none" else 0,
                **({"draft_budget": opts["draft_budget"]} if opts["drafter"] == "tree" else {}),
                **stats.as_dict(), "queue_s": round(job.queue_s, 4)}

    def choice_logprobs(req: GenRequest) -> list[ChoiceLogprobs] | None:
        return None if req.logprobs is None else [ChoiceLogprobs(req.kind, text_of) for _ in range(req.n)]

    async def generate(request: Request, kind: str):
        arrived = time.perf_counter()
        check_auth(request)
        body = await read_body(request)
        req = parse_chat(body) if kind == "chat" else parse_completion(body, llm.tokenizer.vocab_size)
        check_model(req.model)
        prompt_ids = await encode(req)
        opts = decode_options(req, len(prompt_ids))
        events = _JobEvents(asyncio.get_running_loop())
        job = Job(prompt_ids, opts, events.sink, n=req.n, created=arrived)
        events.job = job
        try:
            scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(429, f"The server is busy: {e}. Retry shortly.", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except SchedulerClosed as e:
            raise scheduler_error(e) from None
        try:
            first = await events.next(request)
        except _ClientGone:
            return Response(status_code=499)
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        if first[0] == "error":
            raise scheduler_error(first[1])
        if first[0] == "cancelled":
            return Response(status_code=499)
        rid, created = new_id(kind), now()
        if req.stream:
            return _JobStream(stream_events(req, opts, job, events, first, rid, created), events,
                              media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        event = first
        try:
            while event[0] in ("chunk", "choice"):  # the result holds all of it
                event = await events.next(request)
        except _ClientGone:
            return Response(status_code=499)
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        if event[0] == "error":
            raise scheduler_error(event[1])
        if event[0] == "cancelled":
            return Response(status_code=499)
        results: list[Result] = event[1]
        logprobs = choice_logprobs(req)
        choices = [choice(req, i, r.text, r.finish_reason,
                          None if logprobs is None else logprobs[i].format(r.logprobs))
                   for i, r in enumerate(results)]
        return completion_response(req, rid, created, served, choices,
                                   usage(len(prompt_ids), sum(r.stats.new_tokens for r in results)),
                                   quasar_stats(opts, Stats.combined([r.stats for r in results]), job))

    async def stream_events(req: GenRequest, opts: dict, job: Job, events: _JobEvents, first, rid: str,
                            created: int):
        progress: dict[int, list[int]] = {}  # choice -> [tokens, steps, accepted drafts], for the playground
        logprobs = choice_logprobs(req)
        try:
            if req.kind == "chat":
                for i in range(req.n):
                    yield sse(stream_chunk(req, rid, created, served, index=i, text="", role=True))
            event = first
            while event[0] in ("chunk", "choice"):
                index, item = event[1]
                if event[0] == "chunk":
                    chunk: Chunk = item
                    p = progress.setdefault(index, [0, 0, 0])
                    p[0] += len(chunk.token_ids)
                    p[1] += 1
                    p[2] += sum(1 for _, from_draft in chunk.pieces if from_draft)
                    if chunk.pieces or chunk.logprobs:  # text held back before a stop string still has logprobs
                        q = {"pieces": [[t, d] for t, d in chunk.pieces], "tokens": p[0], "steps": p[1],
                             "accepted": p[2]}
                        yield sse(stream_chunk(req, rid, created, served, index=index, text=chunk.text, quasar=q,
                                               logprobs=None if logprobs is None
                                               else logprobs[index].format(chunk.logprobs)))
                else:
                    result: Result = item
                    yield sse(stream_chunk(req, rid, created, served, index=index,
                                           text=None if req.kind == "chat" else "", finish_reason=result.finish_reason,
                                           quasar=quasar_stats(opts, result.stats, job)))
                event = await events.next(None)
            if event[0] == "result":
                if req.include_usage:
                    tokens = sum(r.stats.new_tokens for r in event[1])
                    yield sse(stream_chunk(req, rid, created, served, no_choices=True,
                                           use=usage(len(job.prompt_ids), tokens)))
            elif event[0] == "error":
                yield sse(scheduler_error(event[1]).body())
            yield sse("[DONE]")
        finally:
            if job.outcome is None:
                job.cancel.set()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    return app


def _model_name(llm) -> str:
    source = getattr(getattr(llm, "loaded", None), "source", None) or "model"
    if source == "default":
        return "SmolLM2-135M-Instruct"
    from pathlib import Path

    p = Path(source)
    return p.stem if p.suffix.lower() == ".gguf" else (p.name or str(p))


def _version() -> str:
    try:
        from quasar import __version__

        return __version__
    except ImportError:
        return "0"


class BackgroundServer:
    """Serve an app with uvicorn from a daemon thread (tests, notebooks, the load script).

    `port=0` lets the OS pick a free port; `url` is known once `start()` returns.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=2, lifespan="on"))
        self.host = host
        self.port: int | None = None
        self._thread = None

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        import threading

        self._thread = threading.Thread(target=self.server.run, name="quasar-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
