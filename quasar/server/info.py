"""The routes that do not generate: the playground page, health, metrics and the model list.
Who may read them is quasar.server.access's (with a key, all but /health need it)."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from quasar.server.context import context
from quasar.server.metrics import CONTENT_TYPE


@cache
def _playground_html() -> str:
    return resources.files("quasar.server").joinpath("playground.html").read_text(encoding="utf-8")


async def playground():
    return HTMLResponse(_playground_html())


async def health(request: Request):
    ctx = context(request)
    scheduler = ctx.scheduler
    ok = scheduler.alive
    body = {"status": "ok" if ok else "unavailable", "model": ctx.served, "queue_depth": scheduler.queue_depth,
            "max_queue": scheduler.max_queue, "running": scheduler.running, "completed": scheduler.completed,
            "defaults": ctx.defaults, "verifiers": ctx.verifier_names, "max_context": ctx.llm.max_context}
    return JSONResponse(body, status_code=200 if ok else 503)


async def metrics(request: Request):
    return Response(context(request).metrics.render(), media_type=CONTENT_TYPE)


async def list_models(request: Request):
    ctx = context(request)
    return {"object": "list", "data": [ctx.model_card()]}


async def get_model(model_id: str, request: Request):
    ctx = context(request)
    ctx.check_model(model_id)
    return ctx.model_card()


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/", playground, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
