"""From checked `quasar serve` options to an app ready to answer: the LLM, the app over it,
and its default verifier built. The one-process server (quasar.cli.serve) and each
Ray Serve replica (quasar.cli.ray_app) start the same way, so they answer alike."""

from __future__ import annotations

import argparse
import sys

from fastapi import FastAPI

from quasar.api import DEFAULT_CONTEXT, LLM
from quasar.cli.options import draft_options
from quasar.cli.serve_args import allowed_hosts, api_key, names
from quasar.engine.spec import VerifierSpec
from quasar.server.access import is_loopback
from quasar.server.app import create_app
from quasar.server.metrics import ServerMetrics


def engine_app(args: argparse.Namespace, metrics: ServerMetrics | None = None, progress: bool = False) -> FastAPI:
    """The app serving `args.model` with its engine started and its default verifier built
    (bad weights fail here, and the first request does not wait for the build)."""
    offered = [VerifierSpec.parse(name) for name in names(args.verifiers)]
    llm = LLM(args.model, dtype=args.dtype, draft=draft_options(args), verifier=args.verifier,
              max_context=args.max_context or DEFAULT_CONTEXT, threads=args.threads, max_batch=args.max_batch,
              prompt_cache_mib=args.prompt_cache_mib)
    args.verifier = llm.verifier  # the default resolved (a quantized checkpoint's own kind)
    app = create_app(llm, api_key=api_key(args), max_queue=args.max_queue, model_name=args.served_model_name,
                     default_max_tokens=args.default_max_tokens, verifiers=offered, metrics=metrics,
                     max_verifiers=args.max_verifiers, allowed_hosts=allowed_hosts(args))
    # On the engine's thread, which does all of the model's work (Scheduler.call).
    try:
        app.state.scheduler.call(lambda: llm.prepare(progress=progress))
    except BaseException:
        app.state.scheduler.stop()
        raise
    return app


def describe(app: FastAPI, args: argparse.Namespace) -> str:
    """What is served, for the start-up line: model, drafter+verifier, k, batch."""
    llm = app.state.llm
    drafter = llm.resolve_drafter(None, llm.verifier)
    return (f"{app.state.model_name} ({drafter}+{llm.verifier}, k={args.num_draft}, batch {args.max_batch})")


def url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def warn_if_open(args: argparse.Namespace) -> None:
    """Say so on stderr when a non-loopback address is served without an API key."""
    if not is_loopback(args.host) and api_key(args) is None:
        print(f"warning: serving on {args.host} without an API key; anyone who can reach it can use it "
              "(by the host names of --allowed-hosts)", file=sys.stderr)
