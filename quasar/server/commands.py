"""`quasar serve`: an OpenAI-compatible HTTP server with a playground at `/`.

Only argparse-level work happens at import time; FastAPI, uvicorn and the model are
imported when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from quasar.defaults import DEFAULT_MAX_BATCH
from quasar.errors import QuasarError
from quasar.server.verifier_pool import DEFAULT_MAX_VERIFIERS


def register(sub) -> None:
    from quasar.cli_args import add_decoding_args, add_model_args

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (with a playground)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics "
                                   "and a playground page at /. Requests are decoded one at a time from a "
                                   "bounded queue; the speculative flags below are the per-request defaults "
                                   "(a request may override drafter, verifier and num_draft).")
    add_model_args(p)
    add_decoding_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$QUASAR_API_KEY if set)")
    p.add_argument("--allowed-hosts", default="", metavar="HOST,...",
                   help="without a key, host names (Host header) the server answers to besides its loopback "
                        "names and --host (the defence against DNS rebinding)")
    p.add_argument("--verifiers", default="", metavar="NAME,...",
                   help="verifiers a request may ask for besides --verifier, e.g. w8a8,pruned:0.5 (default: "
                        "none: every request decodes with --verifier)")
    p.add_argument("--max-verifiers", type=int, default=DEFAULT_MAX_VERIFIERS,
                   help=f"verifiers kept built at a time, each a model and a KV cache; the least recently "
                        f"used idle one is released first (default {DEFAULT_MAX_VERIFIERS})")
    p.add_argument("--max-queue", type=int, default=32,
                   help="requests allowed to wait for the engine; more are answered 429 at once")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"sequences decoded together in one verifier step (default {DEFAULT_MAX_BATCH}); "
                        "each has its own slot in the KV cache")
    p.add_argument("--max-context", type=int, default=None, help="context length in tokens (default: 8192 "
                                                                   "or the model's, whichever is smaller)")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="completion length when a request sets no max_tokens (capped by the context)")
    p.add_argument("--served-model-name", default=None,
                   help="model id reported by /v1/models, and the one a request may name (default: the model's "
                        "file or directory name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def _check_args(args: argparse.Namespace) -> None:
    """The serving options; the draft options and --max-batch are checked where they are
    built (`draft_options`, `LLM`), as for every other way in."""
    if not 0 < args.port < 65536:
        raise QuasarError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue < 1:
        raise QuasarError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.default_max_tokens < 1:
        raise QuasarError(f"--default-max-tokens must be at least 1, got {args.default_max_tokens}")
    if args.max_context is not None and args.max_context < 2:
        raise QuasarError(f"--max-context must be at least 2, got {args.max_context}")
    if args.max_verifiers < 1:
        raise QuasarError(f"--max-verifiers must be at least 1, got {args.max_verifiers}")


def _names(option: str) -> list[str]:
    """A comma-separated option's entries."""
    return [name.strip() for name in option.split(",") if name.strip()]


def _allowed_hosts(args: argparse.Namespace) -> list[str]:
    """--allowed-hosts, and the address served when it is one (not a wildcard)."""
    hosts = _names(args.allowed_hosts)
    if args.host not in ("0.0.0.0", "::", ""):
        hosts.append(args.host)
    return hosts


def _check_port(host: str, port: int) -> None:
    """Fail before the (slow) model load when the address cannot be bound."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise QuasarError(f"cannot resolve --host {host!r}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise QuasarError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run_serve(args: argparse.Namespace) -> int:
    from quasar.cli_args import draft_options

    from quasar.speculative.verifiers import canonical_verifier

    _check_args(args)
    draft = draft_options(args)  # every request's defaults
    offered = [canonical_verifier(name) for name in _names(args.verifiers)]  # before the (slow) load
    _check_port(args.host, args.port)
    try:
        import uvicorn  # noqa: F401

        from quasar.server.access import is_loopback
        from quasar.server.app import create_app
    except ModuleNotFoundError as e:
        raise QuasarError(f"'quasar serve' needs {e.name}: pip install fastapi uvicorn") from None
    from quasar.api import DEFAULT_CONTEXT, LLM

    api_key = args.api_key or os.environ.get("QUASAR_API_KEY") or None
    if not is_loopback(args.host) and api_key is None:
        print(f"warning: serving on {args.host} without an API key; anyone who can reach it can use it "
              "(by the host names of --allowed-hosts)", file=sys.stderr)
    llm = LLM(args.model, dtype=args.dtype, draft=draft, verifier=args.verifier,
              max_context=args.max_context or DEFAULT_CONTEXT, threads=args.threads, max_batch=args.max_batch)
    args.verifier = llm.verifier  # the default resolved (a quantized checkpoint's own kind)
    app = create_app(llm, api_key=api_key, max_queue=args.max_queue, model_name=args.served_model_name,
                     default_max_tokens=args.default_max_tokens, verifiers=offered,
                     max_verifiers=args.max_verifiers, allowed_hosts=_allowed_hosts(args))
    # The weights load lazily: build the default verifier before listening, so bad weights
    # fail here and the first request is not the one that waits for them; on the engine's
    # thread, which does all of the model's work (Scheduler.call).
    try:
        app.state.scheduler.call(lambda: llm.prepare(progress=sys.stderr.isatty()))
    except BaseException:
        app.state.scheduler.stop()
        raise
    url_host = f"[{args.host}]" if ":" in args.host else args.host
    drafter = llm.resolve_drafter(None, args.verifier)
    print(f"quasar: serving {app.state.model_name} ({drafter}+{args.verifier}, k={args.num_draft}, "
          f"batch {args.max_batch}) at "
          f"http://{url_host}:{args.port}/  (playground at /, API at /v1)", file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    return 0
