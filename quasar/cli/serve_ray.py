"""`quasar serve --replicas N`: the server as N replicas on Ray Serve (quasar.cli.ray_app).

With no --ray-address a local Ray instance is started for the command (as many CPUs as the
replicas take, no dashboard, a small object store: requests and replies are small) and shut
down with it; with one, the command joins that cluster and removes its application on exit.
Ray's HTTP proxy listens on --host:--port and runs the conversation-key middleware
(quasar.server.affinity) when Ray was started with its callback set: a local instance is.
Ray is imported at the top: `quasar serve` imports this module only with --replicas.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import ray
from ray import serve

from quasar.cli.ray_app import APP_NAME, quasar_app, replica_threads
from quasar.cli.serve_args import api_key, check_port
from quasar.cli.serve_launch import url, warn_if_open
from quasar.errors import QuasarError
from quasar.server.affinity import PROXY_CALLBACK, PROXY_CALLBACK_ENV

OBJECT_STORE_BYTES = 128 * 1024 * 1024


def start_ray(ray, args: argparse.Namespace, cpus: int) -> None:
    """Join --ray-address, or start a local instance whose HTTP proxy derives conversation keys."""
    if args.ray_address:
        try:
            ray.init(address=args.ray_address, logging_level="warning")
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise QuasarError(f"cannot join the Ray cluster at {args.ray_address}: {first_line(e)}") from None
        return
    check_port(args.host, args.port)
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # the proxy inherits it
    # "local": a new instance, even where `ray start` runs one (or left its address behind)
    ray.init(address="local", num_cpus=max(cpus, os.cpu_count() or 1), include_dashboard=False,
             object_store_memory=OBJECT_STORE_BYTES, logging_level="warning")


def first_line(error: BaseException) -> str:
    """What a Ray error says in one line: a QuasarError a replica raised, else its first line."""
    text = str(error) or type(error).__name__
    for line in text.splitlines():
        if "QuasarError:" in line:
            return line.split("QuasarError:", 1)[1].strip()
    return text.strip().splitlines()[0]


def wait_for_signal() -> None:
    """Block until Ctrl-C or SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass


def run_replicas(args: argparse.Namespace) -> int:
    args.api_key = api_key(args)  # this shell's $QUASAR_API_KEY, which a joined cluster's replicas lack
    warn_if_open(args)
    most = args.max_replicas or args.replicas
    start_ray(ray, args, most * replica_threads(args))
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        print(f"quasar: starting {args.replicas} replica(s) on Ray Serve (each loads the model)...", file=sys.stderr)
        try:
            serve.run(quasar_app(args), name=APP_NAME, route_prefix="/")
        except Exception as e:  # a replica's constructor failed (bad weights, say): Ray says why
            raise QuasarError(f"the replicas did not start: {first_line(e)}") from None
        scaling = f", autoscaled up to {most}" if most > args.replicas else ""
        print(f"quasar: serving {args.model} as {args.replicas} replica(s) of {replica_threads(args)} thread(s)"
              f"{scaling} at {url(args.host, args.port)}  (playground at /, API at /v1)", file=sys.stderr)
        wait_for_signal()
    finally:
        stop_serving(ray, serve, APP_NAME, joined=bool(args.ray_address))
    return 0


def stop_serving(ray, serve, app_name: str, joined: bool) -> None:
    """Drain and remove the application; a Ray this command started goes with it."""
    try:
        if joined:
            serve.delete(app_name)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
