"""The options of `quasar serve`, and their checks (only argparse at import time).

`quasar.cli.serve` registers them as the subcommand; the Ray Serve application
builder (quasar.cli.ray_app.build_app) parses a Serve config's `args` with the same
parser (`serve_parser`), so a YAML file and the command line mean the same thing.
"""

from __future__ import annotations

import argparse
import os
import socket

from quasar.cli.args import add_decoding_args, add_model_args
from quasar.defaults import DEFAULT_MAX_BATCH, DEFAULT_PROMPT_CACHE_MIB
from quasar.errors import QuasarError
from quasar.server.verifier_pool import DEFAULT_MAX_VERIFIERS

DEFAULT_DRAIN_S = 60.0


def add_serve_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--prompt-cache-mib", type=int, default=DEFAULT_PROMPT_CACHE_MIB, metavar="MIB",
                   help="host memory per verifier for finished requests' K/V, which later prompts that start "
                        "the same way (a chat's next turn, a shared system prompt) reuse instead of prefilling "
                        f"them (default {DEFAULT_PROMPT_CACHE_MIB}; 0: off)")
    p.add_argument("--max-context", type=int, default=None, help="context length in tokens (default: 8192 "
                                                                   "or the model's, whichever is smaller)")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="completion length when a request sets no max_tokens (capped by the context)")
    p.add_argument("--served-model-name", default=None,
                   help="model id reported by /v1/models, and the one a request may name (default: the model's "
                        "file or directory name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_replica_args(p)


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (pip install 'quasar-llm[ray]'; see docs/RAY.md)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N replicas of the server on Ray Serve, each one engine with --threads CPUs "
                        "(default: one process, no Ray)")
    g.add_argument("--max-replicas", type=int, default=None, metavar="M",
                   help="scale between --replicas and M replicas by queue depth (default: --replicas, fixed)")
    g.add_argument("--target-ongoing", type=float, default=None, metavar="R",
                   help="requests per replica the autoscaler aims at (default: --max-batch, a full batch)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. auto, or HEAD:6379) instead of starting a local one")
    g.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_S, metavar="S",
                   help=f"seconds a replica being removed lets its requests finish (default {DEFAULT_DRAIN_S:g})")


def serve_parser() -> argparse.ArgumentParser:
    """Every `quasar serve` option, alone (what a Serve config's `args` are parsed with)."""
    p = argparse.ArgumentParser(prog="quasar serve", add_help=False, exit_on_error=False)
    add_model_args(p)
    add_decoding_args(p)
    add_serve_args(p)
    return p


def check_args(args: argparse.Namespace) -> None:
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
    if args.prompt_cache_mib < 0:
        raise QuasarError(f"--prompt-cache-mib must be at least 0, got {args.prompt_cache_mib}")
    check_replica_args(args)


def check_replica_args(args: argparse.Namespace) -> None:
    if args.replicas is None:
        for flag in ("max_replicas", "target_ongoing", "ray_address"):
            if getattr(args, flag) is not None:
                raise QuasarError(f"--{flag.replace('_', '-')} needs --replicas")
        return
    if args.replicas < 1:
        raise QuasarError(f"--replicas must be at least 1, got {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise QuasarError(f"--max-replicas must be at least --replicas ({args.replicas}), got {args.max_replicas}")
    if args.target_ongoing is not None and args.target_ongoing <= 0:
        raise QuasarError(f"--target-ongoing must be positive, got {args.target_ongoing}")
    if args.drain_timeout < 0:
        raise QuasarError(f"--drain-timeout must be at least 0, got {args.drain_timeout}")
    if args.threads is not None and args.threads < 1:
        raise QuasarError(f"--threads must be at least 1, got {args.threads}")


def names(option: str) -> list[str]:
    """A comma-separated option's entries."""
    return [name.strip() for name in option.split(",") if name.strip()]


def allowed_hosts(args: argparse.Namespace) -> list[str]:
    """--allowed-hosts, and the address served when it is one (not a wildcard)."""
    hosts = names(args.allowed_hosts)
    if args.host not in ("0.0.0.0", "::", ""):
        hosts.append(args.host)
    return hosts


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("QUASAR_API_KEY") or None


def check_port(host: str, port: int) -> None:
    """Fail before the (slow) model load when the address cannot be bound."""
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
