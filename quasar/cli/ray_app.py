"""The server as a Ray Serve application: replicas of the one-process server's FastAPI app.

Each replica (`QuasarReplica`, an `@serve.ingress` deployment) builds the same app as
`quasar serve` (quasar.cli.serve_launch) with one engine and its continuous batching, on
`--threads` CPUs. It is ready, and gets requests, only once its default verifier is built
and one short generation has run through the batch path; its health check fails when its
engine has stopped, and Ray replaces it. A replica being removed stops taking requests and
lets the ones in flight finish (streams included) for up to `--drain-timeout` seconds.
Every response names the replica that answered (REPLICA_HEADER), and so does every sample
of its /metrics (the label `replica`). Requests reach replicas by conversation
(quasar.server.ray_router); replicas scale between --replicas and --max-replicas by the
requests in flight per replica (--target-ongoing).

`build_app(args)` is the application builder of a Serve config (deploy/ray/serve.yaml):
`args` are `quasar serve` options by their long names (`{"model": "default", "replicas":
2, "threads": 1}`), parsed by the command's own parser.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from ray import serve
from ray.serve.config import RequestRouterConfig

from quasar.errors import QuasarError
from quasar.cli.serve_launch import engine_app
from quasar.server.metrics import ServerMetrics
from quasar.cli.serve_args import check_args, serve_parser

APP_NAME = "quasar"
DEPLOYMENT_NAME = "QuasarReplica"
REPLICA_HEADER = "x-quasar-replica"
ROUTER = "quasar.server.ray_router:ConversationRouter"
WARM_UP = [{"role": "user", "content": "Say hello."}]
WARM_UP_TOKENS = 8


class ReplicaHeader:
    """Adds the answering replica's name to every HTTP response."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()), self.header])
            await send(message)

        return await self.app(scope, receive, named)


def ready_app(args: argparse.Namespace, name: str):
    """The replica's app: built, its verifier prepared, warmed by one short generation."""
    app = engine_app(args, metrics=ServerMetrics(labels={"replica": name}))
    llm = app.state.llm
    app.state.scheduler.call(lambda: llm.generate_batch([WARM_UP], max_new_tokens=WARM_UP_TOKENS))
    app.add_middleware(ReplicaHeader, name=name)
    return app


@serve.deployment
@serve.ingress()
class QuasarReplica:
    # (not `self.app`: that is the ingress wrapper's own property)
    async def __init__(self, settings: dict):
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.server_app = await asyncio.to_thread(ready_app, argparse.Namespace(**settings), self.replica)

    def __serve_build_asgi_app__(self):
        return self.server_app

    def check_health(self) -> None:
        if not self.server_app.state.scheduler.alive:
            raise RuntimeError("the engine has stopped")


def deployment_options(args: argparse.Namespace) -> dict:
    """The Serve deployment options of `quasar serve --replicas` options."""
    threads = replica_threads(args)
    replicas, most = args.replicas, args.max_replicas or args.replicas
    options = dict(name=DEPLOYMENT_NAME, ray_actor_options={"num_cpus": threads},
                   # a replica takes what its engine would: a full batch and a full queue
                   max_ongoing_requests=args.max_batch + args.max_queue,
                   graceful_shutdown_timeout_s=args.drain_timeout, graceful_shutdown_wait_loop_s=1.0,
                   max_constructor_retry_count=3,  # a model that fails to load fails again
                   request_router_config=RequestRouterConfig(
                       request_router_class=ROUTER, request_router_kwargs={"affinity_limit": args.max_batch}))
    if most > replicas:
        options["autoscaling_config"] = {"min_replicas": replicas, "initial_replicas": replicas,
                                         "max_replicas": most,
                                         "target_ongoing_requests": args.target_ongoing or args.max_batch}
    else:
        options["num_replicas"] = replicas
    return options


def replica_threads(args: argparse.Namespace) -> int:
    """--threads, or this machine's cores shared among the replicas when it is not given."""
    return args.threads or max(1, (os.cpu_count() or 1) // (args.max_replicas or args.replicas))


def quasar_app(args: argparse.Namespace, **options):
    """The bound application of checked `quasar serve --replicas` options (`options`: Serve
    deployment options over `deployment_options`')."""
    settings = dict(vars(args), threads=replica_threads(args))  # no api_key given: a replica reads its $QUASAR_API_KEY
    settings.pop("handler", None)  # the CLI's handler: not an option
    return QuasarReplica.options(**{**deployment_options(args), **options}).bind(settings)


def parse_settings(args: dict | None) -> argparse.Namespace:
    """`quasar serve` options from a Serve config's `args` (long option names, `-` or `_`)."""
    argv = []
    for name, value in (args or {}).items():
        flag = "--" + str(name).replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    try:
        parsed, unknown = serve_parser().parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise QuasarError(f"bad Quasar application args: {e}") from None
    if unknown:
        raise QuasarError(f"unknown Quasar application args: {' '.join(unknown)}")
    if parsed.replicas is None:
        parsed.replicas = 1
    check_args(parsed)
    return parsed


def build_app(args: dict | None = None):
    """The application builder of a Serve config (`import_path: quasar.cli.ray_app:build_app`)."""
    return quasar_app(parse_settings(args))
