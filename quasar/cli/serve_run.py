"""`quasar serve` (its flags: quasar.cli.serve_args): the server in this process on uvicorn,
or with --replicas N as replicas on Ray Serve (quasar.cli.serve_ray, imported only then)."""

from __future__ import annotations

import argparse
import sys

from quasar.cli.options import draft_options
from quasar.cli.serve_args import check_args, check_port, names
from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError

try:
    import uvicorn

    from quasar.cli.serve_launch import describe, engine_app, url, warn_if_open
    from quasar.server.app import UVICORN_STACK
except ModuleNotFoundError as e:
    raise QuasarError(f"'quasar serve' needs {e.name}: pip install fastapi uvicorn") from None

RAY_EXTRA = "pip install 'quasar-llm[ray]'"


def run_replicas(args: argparse.Namespace) -> int:
    """The server as replicas on Ray Serve, or a one-line QuasarError naming the extra that
    installs Ray when it (or a module it needs) is missing."""
    try:
        from quasar.cli import serve_ray  # lazy: optional dependency (ray[serve]), only with --replicas
    except ImportError as e:
        missing = getattr(e, "name", None) or "ray"
        if missing.startswith("quasar"):
            raise
        raise QuasarError(f"'quasar serve --replicas' needs Ray Serve ({missing} is not installed): "
                          f"{RAY_EXTRA}") from None
    return serve_ray.run_replicas(args)


def run_serve(args: argparse.Namespace) -> int:
    check_args(args)
    draft_options(args)  # every request's defaults, checked before the (slow) load
    for name in names(args.verifiers):
        VerifierSpec.parse(name)
    if args.replicas is not None:
        return run_replicas(args)
    check_port(args.host, args.port)
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
