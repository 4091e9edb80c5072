#!/usr/bin/env python
"""Load test for `quasar serve`: loopback only, bounded in request count and time.

Either point it at a running server on this machine:

    python scripts/tools/load_test.py --url http://127.0.0.1:8000 --requests 40 --concurrency 4

or let it start one in-process on 127.0.0.1 (an OS-chosen port) for a model:

    python scripts/tools/load_test.py --model default --threads 2 --stream --max-tokens 128 \
        --concurrency 1,4,8 --requests 8,64,128

For each `--concurrency` level (a comma-separated list runs them one after another against
the same server, with `--requests` per level, one number or one per level) it sends chat
(or, with `--completions`, completion) requests from that many client threads, stops issuing
new ones after `--time-limit` seconds, and reports requests/s, p50/p95/max latency (and time
to first token with `--stream`), aggregate generated tokens/s, the mean acceptance length
reported by the server, and errors by status; with several levels, each level's tokens/s
relative to the first. Greedy decoding (temperature 0) unless `--temperature` is given.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MAX_REQUESTS = 10_000
MAX_CONCURRENCY = 64
MAX_TIME_LIMIT = 1800.0

BUILTIN_PROMPTS = [
    "Write a Python function `is_prime(n)` and a few asserts that test it.",
    "Explain what a hash map is, then give a short Python example that counts words.",
    "Rewrite this loop as a list comprehension: result = []\nfor x in range(10):\n    result.append(x * x)",
    "List the planets of the solar system in order, one per line, with one fact each.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
    "Summarize the rules of tic-tac-toe in three sentences.",
    "Write a bash one-liner that counts the lines of every .py file under the current directory.",
    "Give a JSON object describing a book with title, author, year and a list of three tags.",
]


@dataclass
class Outcome:
    ok: bool
    status: int
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    steps: int = 0
    error: str = ""


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    not_started: int = 0

    def summary(self) -> dict:
        ok = [o for o in self.outcomes if o.ok]
        lat = sorted(o.latency_s for o in ok)
        ttft = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
        errors: dict[str, int] = {}
        for o in self.outcomes:
            if not o.ok:
                key = str(o.status) if o.status else (o.error.split(":")[0] or "error")
                errors[key] = errors.get(key, 0) + 1
        tokens = sum(o.completion_tokens for o in ok)
        steps = sum(o.steps for o in ok)
        return {
            "requests": len(self.outcomes), "ok": len(ok), "errors": sum(errors.values()), "errors_by_kind": errors,
            "not_started_time_limit": self.not_started, "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(len(ok) / self.wall_s, 3) if self.wall_s > 0 else 0.0,
            "latency_p50_s": _pct(lat, 50), "latency_p95_s": _pct(lat, 95), "latency_max_s": _pct(lat, 100),
            "latency_mean_s": round(statistics.fmean(lat), 4) if lat else None,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95),
            "completion_tokens": tokens,
            "tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s > 0 else 0.0,
            "mean_acceptance_length": round(tokens / steps, 3) if steps else None,
        }


def _pct(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not sorted_values:
        return None
    rank = max(1, min(len(sorted_values), int(-(-p * len(sorted_values) // 100))))
    return round(sorted_values[rank - 1], 4)


def check_loopback(url: str) -> tuple[str, int]:
    """(host, port) of an http:// URL whose host resolves only to loopback addresses."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SystemExit(f"error: --url must look like http://127.0.0.1:PORT, got {url!r}")
    host, port = parts.hostname, parts.port or 80
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except socket.gaierror as e:
        raise SystemExit(f"error: cannot resolve {host}: {e}") from None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(f"error: refusing to load-test {host} ({', '.join(sorted(addrs))}): loopback only")
    return host, port


def one_request(host: str, port: int, path: str, body: dict, headers: dict, stream: bool,
                timeout: float) -> Outcome:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=max(1.0, timeout))
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            data = resp.read()
            try:
                msg = json.loads(data)["error"]["message"]
            except Exception:
                msg = data[:200].decode(errors="replace")
            return Outcome(False, resp.status, time.perf_counter() - t0, error=msg)
        if not stream:
            data = json.loads(resp.read())
            q = data.get("quasar") or {}
            return Outcome(True, 200, time.perf_counter() - t0, completion_tokens=data["usage"]["completion_tokens"],
                           steps=q.get("steps", 0))
        ttft, tokens, steps, error = None, 0, 0, ""
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                error = chunk["error"].get("message", "stream error")
                break
            choices = chunk.get("choices") or []
            text = choices and (choices[0].get("delta", {}).get("content") or choices[0].get("text"))
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if choices and choices[0].get("finish_reason") and chunk.get("quasar"):
                steps = chunk["quasar"].get("steps", 0)
        latency = time.perf_counter() - t0
        if error:
            return Outcome(False, 0, latency, error=f"stream: {error}")
        return Outcome(True, 200, latency, ttft_s=ttft, completion_tokens=tokens, steps=steps)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        return Outcome(False, 0, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def load_prompts(args) -> list:
    if args.prompts_file:
        from quasar.data.user_files import load_prompt_file

        items = load_prompt_file(args.prompts_file)
        return [it.messages if it.is_chat else it.text for it in items]
    if args.prompt:
        return [args.prompt]
    return list(BUILTIN_PROMPTS)


def make_body(args, prompt) -> tuple[str, dict]:
    body: dict = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.model_name is not None:
        body["model"] = args.model_name
    if args.completions:
        path = "/v1/completions"
        body["prompt"] = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    else:
        path = "/v1/chat/completions"
        body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if args.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    for name in ("drafter", "verifier", "num_draft", "seed"):
        value = getattr(args, name)
        if value is not None:
            body[name] = value
    return path, body


def run_load(args, host: str, port: int, concurrency: int, requests: int, warmup: int) -> Report:
    prompts = load_prompts(args)
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    for i in range(warmup):
        path, body = make_body(args, prompts[i % len(prompts)])
        o = one_request(host, port, path, body, headers, args.stream, args.time_limit)
        if not o.ok:
            raise SystemExit(f"error: warm-up request failed ({o.status}): {o.error}")
    report, lock = Report(), threading.Lock()
    counter = iter(range(requests))
    t0 = time.perf_counter()
    deadline = t0 + args.time_limit

    def worker():
        while True:
            with lock:
                i = next(counter, None)
                if i is None:
                    return
                if time.perf_counter() >= deadline:
                    report.not_started += 1
                    continue
            path, body = make_body(args, prompts[i % len(prompts)])
            o = one_request(host, port, path, body, headers, args.stream, deadline - time.perf_counter() + 5)
            with lock:
                report.outcomes.append(o)

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    report.wall_s = time.perf_counter() - t0
    return report


def start_local_server(args):
    """An in-process server on 127.0.0.1 (OS-chosen port) for --model."""
    from quasar.api import LLM
    from quasar.server.app import BackgroundServer, create_app
    from quasar.speculative.options import DraftOptions

    draft = DraftOptions().replace(drafter=args.drafter, num_draft=args.num_draft)
    llm = LLM(args.model, max_context=args.max_context, threads=args.threads, max_batch=args.max_batch,
              draft=draft, **({"verifier": args.verifier} if args.verifier is not None else {}))
    app = create_app(llm, api_key=args.api_key, max_queue=max(args.max_queue, max(args.levels)))
    app.state.scheduler.call(lambda: llm.prepare(progress=sys.stderr.isatty()))  # on the engine's thread
    return BackgroundServer(app, "127.0.0.1", 0).start()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server on this machine, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="start an in-process server on 127.0.0.1 for this model ('default', path)")
    p.add_argument("--requests", default="40",
                   help=f"requests to send per level: one number, or one per --concurrency level (each at most "
                        f"{MAX_REQUESTS})")
    p.add_argument("--concurrency", default="4",
                   help=f"client threads: one number, or a comma-separated list of levels run in turn (each at most "
                        f"{MAX_CONCURRENCY})")
    p.add_argument("--time-limit", type=float, default=120.0,
                   help=f"stop issuing requests after this many seconds (at most {MAX_TIME_LIMIT:g})")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests sent first")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stream", action="store_true", help="stream the replies (measures time to first token)")
    p.add_argument("--completions", action="store_true", help="use /v1/completions instead of chat")
    p.add_argument("--prompt", help="send this one prompt every time")
    p.add_argument("--prompts-file", help="JSONL prompts (prompt / messages / turns per line)")
    p.add_argument("--drafter", default=None, help="per-request drafter (default: the server's)")
    p.add_argument("--verifier", default=None, help="per-request verifier (default: the server's)")
    p.add_argument("--num-draft", type=int, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model-name", default=None,
                   help="the 'model' field sent (default: none, which the server answers with its model)")
    p.add_argument("--threads", type=int, default=None, help="with --model: torch threads")
    p.add_argument("--max-context", type=int, default=2048, help="with --model: context length")
    p.add_argument("--max-queue", type=int, default=64, help="with --model: the server's queue bound")
    p.add_argument("--max-batch", type=int, default=8, help="with --model: sequences the server decodes together")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.concurrency.split(",")]
        counts = [int(x) for x in args.requests.split(",")]
    except ValueError:
        p.error("--concurrency and --requests take integers, or comma-separated lists of them")
    if len(counts) == 1:
        counts *= len(args.levels)
    if len(counts) != len(args.levels):
        p.error("--requests needs one number, or one per --concurrency level")
    if not all(1 <= n <= MAX_REQUESTS for n in counts):
        p.error(f"--requests must be in 1..{MAX_REQUESTS}")
    if not all(1 <= c <= MAX_CONCURRENCY for c in args.levels):
        p.error(f"--concurrency must be in 1..{MAX_CONCURRENCY}")
    if not 0 < args.time_limit <= MAX_TIME_LIMIT:
        p.error(f"--time-limit must be in (0, {MAX_TIME_LIMIT:g}]")
    if args.max_tokens < 1 or args.warmup < 0:
        p.error("--max-tokens must be >= 1 and --warmup >= 0")

    server = None
    if args.url:
        host, port = check_loopback(args.url)
    else:
        server = start_local_server(args)
        host, port = "127.0.0.1", server.port
    summaries = []
    try:
        for i, (concurrency, requests) in enumerate(zip(args.levels, counts)):
            report = run_load(args, host, port, concurrency, requests, args.warmup if i == 0 else 0)
            s = report.summary()
            s.update(concurrency=concurrency, max_tokens=args.max_tokens, stream=args.stream)
            if summaries and summaries[0]["tokens_per_s"]:
                s["tokens_per_s_vs_first"] = round(s["tokens_per_s"] / summaries[0]["tokens_per_s"], 2)
            summaries.append(s)
            if not args.json:
                print_summary(s, args)
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else summaries))
    return 1 if any(s["errors"] for s in summaries) else 0


def print_summary(s: dict, args) -> None:
    print(f"{s['ok']}/{s['requests']} ok in {s['wall_s']:.2f} s with {s['concurrency']} clients "
          f"({'stream' if args.stream else 'no stream'}, max_tokens {args.max_tokens})")
    print(f"  requests/s        {s['requests_per_s']:.2f}")
    print(f"  latency p50/p95   {s['latency_p50_s']} / {s['latency_p95_s']} s (max {s['latency_max_s']} s)")
    if args.stream:
        print(f"  first token p50/p95 {s['ttft_p50_s']} / {s['ttft_p95_s']} s")
    ratio = f", {s['tokens_per_s_vs_first']}x the first level" if "tokens_per_s_vs_first" in s else ""
    print(f"  generated tokens  {s['completion_tokens']} ({s['tokens_per_s']:.1f} tokens/s overall{ratio})")
    print(f"  mean acceptance   {s['mean_acceptance_length']}")
    print(f"  errors            {s['errors']} {s['errors_by_kind'] or ''}"
          + (f"; {s['not_started_time_limit']} not sent (time limit)" if s["not_started_time_limit"] else ""))


if __name__ == "__main__":
    sys.exit(main())
