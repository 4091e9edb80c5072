"""The client side of the serving protocol: one streamed greedy request through the real
`openai` client, timed from the moment it is sent, and a phase of requests at a fixed
concurrency.

Per request: time to first token (TTFT) = arrival of the first chunk with text − send;
decode rate = (tokens − 1) ÷ (arrival of the last chunk with text or a finish reason −
arrival of the first), so it counts only tokens produced after the first, as the engine
protocol does for peers. Tokens are the server's own count (`stream_options.include_usage`)
where it gives one, else the number of chunks with text (exact only for one token a chunk).
Per phase: aggregate rate = all completion tokens ÷ the phase's wall time (first send to
last reply), medians of the per-request decode rates and TTFTs.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from quasar.errors import QuasarError

REQUEST_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ServingPrompt:
    """A prompt as a request: chat `messages`, or raw `text` for /v1/completions."""
    id: str
    task: str
    messages: tuple[dict, ...] | None = None
    text: str | None = None


@dataclass
class RequestResult:
    id: str
    task: str
    completion_tokens: int
    counted_by: str  # "usage" (the server's count) or "chunks"
    finish_reason: str | None
    prompt_tokens: int | None
    cached_tokens: int | None  # prompt tokens the server reused from its prompt cache, where it says
    ttft_s: float | None
    decode_s: float | None
    total_s: float
    decode_tokens_per_s: float | None
    sent_at_s: float  # offset from the phase's start


def make_client(base_url: str):
    try:
        import openai  # lazy: optional dependency (the serving protocol's client)
    except ModuleNotFoundError:
        raise QuasarError("the serving protocol needs the openai client: pip install openai") from None
    # no retries: a failed request is a result, not something to paper over
    return openai.OpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def _open_stream(client, model: str, prompt: ServingPrompt, max_tokens: int):
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    if prompt.messages is not None:
        return client.chat.completions.create(messages=list(prompt.messages), **common)
    return client.completions.create(prompt=prompt.text, **common)


def _chunk_text(choice) -> str | None:
    delta = getattr(choice, "delta", None)
    return delta.content if delta is not None else getattr(choice, "text", None)


def stream_request(client, model: str, prompt: ServingPrompt, max_tokens: int, phase_t0: float) -> RequestResult:
    """Send one streamed greedy request and time its chunks as they arrive."""
    sent = time.perf_counter()
    first = last = None
    chunks, finish, usage = 0, None, None
    stream = _open_stream(client, model, prompt, max_tokens)
    try:
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices or ():
                if _chunk_text(choice):
                    chunks += 1
                    first = now if first is None else first
                    last = now
                if choice.finish_reason is not None:
                    finish, last = choice.finish_reason, now
    finally:
        stream.close()
    done = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else chunks
    decode_s = (last - first) if first is not None and last is not None else None
    rate = (tokens - 1) / decode_s if decode_s and tokens > 1 else None
    return RequestResult(
        id=prompt.id, task=prompt.task, completion_tokens=tokens, counted_by="usage" if usage else "chunks",
        finish_reason=finish, prompt_tokens=getattr(usage, "prompt_tokens", None),
        cached_tokens=getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None),
        ttft_s=None if first is None else first - sent, decode_s=decode_s, total_s=done - sent,
        decode_tokens_per_s=rate, sent_at_s=sent - phase_t0)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_phase(base_url: str, model: str, prompts: list[ServingPrompt], max_tokens: int,
              concurrency: int) -> dict:
    """Every prompt once, at most `concurrency` in flight; the phase's summary and requests."""
    client = make_client(base_url)
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench-client")
    t0 = time.perf_counter()
    try:
        futures = [pool.submit(stream_request, client, model, p, max_tokens, t0) for p in prompts]
        results = [f.result() for f in futures]
    finally:
        # on an error or Ctrl-C, don't wait here for requests still streaming: the caller
        # stops the server, which ends them
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - t0
    return summarize(results, wall, concurrency)


def summarize(results: list[RequestResult], wall_s: float, concurrency: int) -> dict:
    return _summary([_rounded(asdict(r)) for r in results], wall_s, concurrency)


def pool_phases(phases: list[dict]) -> dict:
    """Several rounds of one server's phase at one concurrency as one phase: their requests
    together, over their summed wall time."""
    if len(phases) == 1:
        return phases[0]
    return _summary([r for p in phases for r in p["per_request"]], sum(p["wall_s"] for p in phases),
                    phases[0]["concurrency"], rounds=len(phases))


def _summary(requests: list[dict], wall_s: float, concurrency: int, rounds: int = 1) -> dict:
    tokens = sum(r["completion_tokens"] for r in requests)
    out = {
        "concurrency": concurrency,
        "requests": len(requests),
        "completion_tokens": tokens,
        "prompt_tokens": _total([r["prompt_tokens"] for r in requests]),
        "cached_tokens": _total([r["cached_tokens"] for r in requests]),
        "wall_s": round(wall_s, 3),
        "aggregate_tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "median_decode_tokens_per_s": _round(_median([r["decode_tokens_per_s"] for r in requests])),
        "median_ttft_s": _round(_median([r["ttft_s"] for r in requests]), 4),
        "pooled_decode_tokens_per_s": _pooled_rate(requests),
        "finish_reasons": dict(Counter(str(r["finish_reason"]) for r in requests)),
        "counted_by": sorted({r["counted_by"] for r in requests}),
        "per_request": requests,
    }
    if rounds > 1:
        out["rounds"] = rounds
    return out


def _pooled_rate(requests: list[dict]) -> float | None:
    """Σ (tokens − 1) ÷ Σ decode time over the requests that decoded: the sweep's pick, less
    swayed than a median of a few prompts by one prompt's luck."""
    timed = [r for r in requests if r["decode_s"] and r["completion_tokens"] > 1]
    total_s = sum(r["decode_s"] for r in timed)
    return _round(sum(r["completion_tokens"] - 1 for r in timed) / total_s) if total_s > 0 else None


def _total(values: list) -> int | None:
    """The sum of the counts the server gave (None when it gave none)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _round(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}
