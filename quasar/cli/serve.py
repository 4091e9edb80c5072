"""`quasar serve`: an OpenAI-compatible HTTP server with a playground at `/`.

Only argparse-level work happens at import time; FastAPI, uvicorn and the model are
imported when the command runs. With `--replicas N` the server runs as N replicas on Ray
Serve instead (quasar.cli.serve_ray); without it Ray is never imported.
"""

from __future__ import annotations

import argparse
import sys

from quasar.errors import QuasarError
from quasar.cli.serve_args import add_serve_args, check_args, check_port, names, warn_if_open


def register(sub) -> None:
    from quasar.cli.args import add_decoding_args, add_model_args

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (with a playground)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics "
                                   "and a playground page at /. Requests are decoded one at a time from a "
                                   "bounded queue; the speculative flags below are the per-request defaults "
                                   "(a request may override drafter, verifier and num_draft).")
    add_model_args(p)
    add_decoding_args(p)
    add_serve_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from quasar.cli.args import draft_options

    from quasar.engine.verifiers import canonical_verifier

    check_args(args)
    draft_options(args)  # every request's defaults, checked before the (slow) load
    for name in names(args.verifiers):
        canonical_verifier(name)
    if args.replicas is not None:
        from quasar.cli.serve_ray import run_replicas

        return run_replicas(args)
    check_port(args.host, args.port)
    try:
        import uvicorn  # noqa: F401

        from quasar.server.app import UVICORN_STACK
        from quasar.cli.serve_launch import describe, engine_app, url
    except ModuleNotFoundError as e:
        raise QuasarError(f"'quasar serve' needs {e.name}: pip install fastapi uvicorn") from None

    warn_if_open(args)
    # The weights load lazily: engine_app builds the default verifier before listening, so
    # bad weights fail here and the first request is not the one that waits for them.
    app = engine_app(args, progress=sys.stderr.isatty())
    print(f"quasar: serving {describe(app, args)} at {url(args.host, args.port)}  (playground at /, API at /v1)",
          file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, **UVICORN_STACK)
    server = uvicorn.Server(config)
    server.run()
    return 0
