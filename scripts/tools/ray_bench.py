#!/usr/bin/env python3
"""What `quasar serve --replicas` costs and buys (issue #49), written to --out as report.md and
report.json.

  overhead   concurrency 1: the one-process server (`quasar serve`, a subprocess) against one
             Ray Serve replica of the same threads: tokens/s and time to first token
  scaling    concurrency 8: one replica of 2 threads against two replicas of 1 thread each:
             aggregate tokens/s
  affinity   20 two-turn conversations (the bench's chat task; the second turn repeats the
             first and the replica's own answer) under conversation affinity
             (quasar.server.ray_router.ConversationRouter) and under round robin: L (tokens per
             verifier step) and tokens/s of the second turns, and how many went to the
             replica of their first

Ray runs here, once, on this machine's cores (its proxy derives conversation keys,
quasar.server.affinity); every Ray arm is one application deployed on it, then deleted.
Requests are greedy. `--quick` is a smoke run (2 prompts of 8 tokens, 2 conversations).

  .venv/bin/python scripts/tools/ray_bench.py --out bench-ray [--model default] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quasar.bench.serving_client import ServingPrompt, run_phase
from quasar.bench.serving_servers import quasar_spec, start_server
from quasar.bench.tasks import task_prompts
from quasar.fileio import write_atomic
from quasar.server.affinity import PROXY_CALLBACK, PROXY_CALLBACK_ENV

REPLICA = "x-quasar-replica"


def chat_prompts(n: int) -> list[ServingPrompt]:
    return [ServingPrompt(item.id or f"chat-{i}", "chat", messages=tuple(item.messages))
            for i, item in enumerate(task_prompts("chat", n))]


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:  # noqa: S310 (our own loopback server)
        return json.loads(r.read())["data"][0]["id"]


def ray_start(port: int):
    import ray
    from ray import serve

    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=128 << 20,
             logging_level="warning", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return ray, serve


def deploy(serve, url: str, a: argparse.Namespace, replicas: int, threads: int, router: str | None = None,
           name: str | None = None) -> str:
    """Deploy the arm's application (`name`: its own, so Ray's proxy makes a new handle and router
    for it rather than reusing the last arm's); the model id it serves."""
    from ray.serve.config import RequestRouterConfig

    from quasar.cli.ray_app import APP_NAME, parse_settings, quasar_app

    settings = parse_settings({"model": a.model, "replicas": replicas, "threads": threads,
                               "max_context": a.max_context, **({"drafter": a.drafter} if a.drafter else {})})
    options = {} if router is None else {"request_router_config": RequestRouterConfig(request_router_class=router)}
    serve.run(quasar_app(settings, **options), name=name or APP_NAME, route_prefix="/")
    return served_model(url)


def undeploy(serve, name: str | None = None) -> None:
    from quasar.cli.ray_app import APP_NAME

    serve.delete(name or APP_NAME)


def warm(url: str, model: str) -> None:
    run_phase(url, model, [ServingPrompt("warm-up", "warm-up", messages=({"role": "user", "content": "Hi."},))],
              8, 1)


def phase(url: str, model: str, prompts, a: argparse.Namespace, concurrency: int) -> dict:
    warm(url, model)
    result = run_phase(url, model, prompts, a.max_tokens, concurrency)
    result.pop("per_request", None)
    return result


def overhead(a: argparse.Namespace, serve, url: str, prompts) -> dict:
    extra = ("--max-context", str(a.max_context), *(("--drafter", a.drafter) if a.drafter else ()))
    server = start_server(quasar_spec(a.model, a.threads, extra), a.out / "one-process.log", 600)
    try:
        one = phase(server.base_url, server.model_id, prompts, a, 1)
    finally:
        server.stop()
    model = deploy(serve, url, a, 1, a.threads)
    try:
        ray_one = phase(url, model, prompts, a, 1)
    finally:
        undeploy(serve)
    return {"one_process": one, "ray_1_replica": ray_one}


def scaling(a: argparse.Namespace, serve, url: str, prompts) -> dict:
    out = {}
    for replicas, threads in ((1, 2), (2, 1)):
        model = deploy(serve, url, a, replicas, threads)
        try:
            out[f"{replicas}x{threads}"] = phase(url, model, prompts, a, 8)
        finally:
            undeploy(serve)
    return out


def post_chat(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 (our own loopback server)
        reply = json.loads(r.read())
        replica = r.headers.get(REPLICA, "")
    stats = reply.get("quasar", {})
    return {"replica": replica, "text": reply["choices"][0]["message"]["content"], "s": time.perf_counter() - t0,
            "tokens": stats.get("new_tokens", 0), "steps": stats.get("steps", 0)}


def conversations(url: str, model: str, chats, a: argparse.Namespace) -> dict:
    """Every chat's first turn, then every second turn (the first, its answer and the
    follow-up), in another order (seeded): in the first turns' order, round robin would send
    each second turn to its first turn's replica whenever the replicas divide the count."""
    firsts = [c.messages[:1] for c in chats]
    order = random.Random(0).sample(range(len(chats)), len(chats))
    with ThreadPoolExecutor(a.concurrency) as pool:
        turn1 = list(pool.map(lambda m: post_chat(url, model, m, a.max_tokens), firsts))
        seconds = [[*firsts[i], {"role": "assistant", "content": turn1[i]["text"]}, chats[i].messages[2]]
                   for i in order]
        t0 = time.perf_counter()
        turn2 = list(pool.map(lambda m: post_chat(url, model, m, a.max_tokens), seconds))
        wall = time.perf_counter() - t0
    turn1 = [turn1[i] for i in order]
    tokens, steps = sum(r["tokens"] for r in turn2), sum(r["steps"] for r in turn2)
    return {"conversations": len(chats), "second_turn_L": round(tokens / steps, 3) if steps else None,
            "second_turn_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
            "second_turn_on_first_replica": sum(r1["replica"] == r2["replica"] for r1, r2 in zip(turn1, turn2)),
            "replicas_used": len({r["replica"] for r in turn1 + turn2})}


def affinity(a: argparse.Namespace, serve, url: str) -> dict:
    from quasar.cli.ray_app import ROUTER

    chats = task_prompts("chat", a.conversations)
    out = {}
    for name, router in (("affinity", ROUTER), ("round_robin", "quasar.server.ray_router:RoundRobinRouter")):
        model = deploy(serve, url, a, 2, 1, router, name=f"quasar-{name}")
        try:
            warm(url, model)
            out[name] = conversations(url, model, chats, a)
        finally:
            undeploy(serve, f"quasar-{name}")
    return out


def markdown(report: dict) -> str:
    lines = [f"# Ray Serve replicas ({report['model']}, {report['max_tokens']} tokens, greedy)", ""]
    if "overhead" in report:
        o = report["overhead"]
        lines += ["## Overhead at concurrency 1", "", "| server | median decode tokens/s | median TTFT s | aggregate tokens/s |",
                  "|---|---|---|---|"]
        for name, r in o.items():
            lines.append(f"| {name} | {r['median_decode_tokens_per_s']} | {r['median_ttft_s']} | "
                         f"{r['aggregate_tokens_per_s']} |")
        lines.append("")
    if "scaling" in report:
        lines += ["## Concurrency 8", "", "| replicas x threads | aggregate tokens/s | median TTFT s |", "|---|---|---|"]
        for name, r in report["scaling"].items():
            lines.append(f"| {name} | {r['aggregate_tokens_per_s']} | {r['median_ttft_s']} |")
        lines.append("")
    if "affinity" in report:
        lines += ["## Affinity against round robin (second turns)", "",
                  "| routing | L | tokens/s | on the first turn's replica | replicas used |", "|---|---|---|---|---|"]
        for name, r in report["affinity"].items():
            lines.append(f"| {name} | {r['second_turn_L']} | {r['second_turn_tokens_per_s']} | "
                         f"{r['second_turn_on_first_replica']}/{r['conversations']} | {r['replicas_used']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default=None, help="the servers' --drafter (default: theirs)")
    p.add_argument("--parts", default="overhead,scaling,affinity")
    p.add_argument("--prompts", type=int, default=8, help="chat prompts of the overhead and scaling runs")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2, help="threads of the one-process server and its replica")
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight in the affinity run")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 prompts of 8 tokens, 2 conversations")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.max_tokens, a.conversations = 2, 8, 2
    return a


def main(argv: list[str] | None = None) -> int:
    from quasar.bench.serving_servers import free_port

    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    parts = set(a.parts.split(","))
    prompts = chat_prompts(a.prompts)
    port = free_port()
    ray, serve = ray_start(port)
    url = f"http://127.0.0.1:{port}"
    report = {"model": a.model, "max_tokens": a.max_tokens, "cpus": os.cpu_count(), "drafter": a.drafter or "default"}
    try:
        if "overhead" in parts:
            report["overhead"] = overhead(a, serve, url, prompts)
        if "scaling" in parts:
            report["scaling"] = scaling(a, serve, url, prompts if a.quick else prompts * 4)
        if "affinity" in parts:
            report["affinity"] = affinity(a, serve, url)
    finally:
        serve.shutdown()
        ray.shutdown()
    write_atomic(a.out / "report.json", json.dumps(report, indent=2))
    write_atomic(a.out / "report.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
