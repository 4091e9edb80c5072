"""The FastAPI application: OpenAI-compatible endpoints, health, metrics and the playground.

`create_app(llm, ...)` only wires the parts: a `Scheduler` (bounded queue + one worker
thread, quasar.server.scheduler) and what the routes share (`ServerContext`), the access
rules (`access`), the middleware and error handlers (`middleware`), the generation routes
(`generation`, over the thread-to-asyncio bridge in `events`) and the others (`info`).
Requests are validated in `openai_schema`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from quasar import __version__
from quasar.engine.spec import VerifierSpec
from quasar.server import generation, info, middleware
from quasar.server.access import AccessPolicy
from quasar.server.context import ServerContext
from quasar.server.metrics import ServerMetrics
from quasar.server.scheduler import Scheduler
from quasar.server.verifier_pool import DEFAULT_MAX_VERIFIERS

# uvicorn's event loop and HTTP parser, named rather than "auto": the stack the server is
# tested on, whatever else is installed (Ray's extra brings uvloop and httptools)
UVICORN_STACK = {"loop": "asyncio", "http": "h11"}


def create_app(llm, *, api_key: str | None = None, max_queue: int = 32, model_name: str | None = None,
               default_max_tokens: int = 1024, metrics: ServerMetrics | None = None,
               max_batch: int | None = None, verifiers: Iterable[str] = (),
               max_verifiers: int = DEFAULT_MAX_VERIFIERS, allowed_hosts: Iterable[str] = ()) -> FastAPI:
    """An app serving `llm` (a `quasar.api.LLM`), whose drafter, draft options and verifier
    are every request's defaults; up to `max_batch` sequences (default: the LLM's) decode
    together. Requests may name the LLM's verifier or one of `verifiers`; at most
    `max_verifiers` are built at a time. With `api_key` every route but /health needs it;
    without one, requests must be addressed to a loopback name or one of `allowed_hosts`
    (quasar.server.access)."""
    metrics = metrics or ServerMetrics()
    offered = tuple(VerifierSpec.parse(v) for v in verifiers)  # a bad name fails before the engine starts
    policy = AccessPolicy(api_key, allowed_hosts)
    scheduler = Scheduler(llm, max_queue=max_queue, metrics=metrics, max_batch=max_batch,
                          max_verifiers=max_verifiers).start()
    ctx = ServerContext(llm, scheduler, metrics, model_name or _model_name(llm), offered, default_max_tokens)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="Quasar", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.context = ctx
    app.state.scheduler, app.state.metrics, app.state.llm, app.state.model_name = scheduler, metrics, llm, ctx.served
    app.state.defaults = ctx.defaults
    middleware.install(app, metrics, policy)
    info.add_routes(app)
    generation.add_routes(app)
    return app


def _model_name(llm) -> str:
    source = getattr(getattr(llm, "loaded", None), "source", None) or "model"
    if source == "default":
        return "SmolLM2-135M-Instruct"
    p = Path(source)
    return p.stem if p.suffix.lower() == ".gguf" else (p.name or str(p))


class BackgroundServer:
    """Serve an app with uvicorn from a daemon thread (tests, notebooks, the load script).

    `port=0` lets the OS pick a free port; `url` is known once `start()` returns.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=2, lifespan="on", **UVICORN_STACK))
        self.host = host
        self.port: int | None = None
        self._thread = None

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
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
