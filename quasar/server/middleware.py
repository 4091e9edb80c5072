"""What wraps every route: request metrics, access rules (quasar.server.access), and errors
answered in OpenAI's JSON shape."""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from quasar.server.access import AccessMiddleware, AccessPolicy
from quasar.server.events import ClientGone
from quasar.server.metrics import ServerMetrics
from quasar.server.openai_schema import ApiError, error_body

log = logging.getLogger("quasar.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/")
GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away before the reply


class MetricsMiddleware:
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


async def _api_error(request: Request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _client_gone(request: Request, exc: ClientGone):
    return Response(status_code=CLIENT_CLOSED)


async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404:
        msg = f"Unknown route {request.method} {request.url.path}."
    return JSONResponse(error_body(msg, kind), status_code=exc.status_code, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    return JSONResponse(error_body(f"Invalid request: {first.get('msg', exc)}", param=param,
                                   code="invalid_value"), status_code=400)


async def _internal_error(request: Request, exc: Exception):
    log.exception("unhandled error for %s %s", request.method, request.url.path)
    return JSONResponse(error_body("The server had an error while processing your request.", "server_error"),
                        status_code=500)


def install(app: FastAPI, metrics: ServerMetrics, policy: AccessPolicy) -> None:
    """Check `app`'s requests against `policy`, count them into `metrics` (refused ones
    too), and answer its errors in OpenAI's shape."""
    app.add_middleware(AccessMiddleware, policy=policy)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # added last: the outermost
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
