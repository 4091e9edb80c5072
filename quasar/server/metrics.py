"""Prometheus metrics written by hand in the text exposition format (no client library).

Counters, gauges and histograms with optional labels; every update takes one lock, so
the engine's worker thread and the event loop can both record. `render()` produces the
body of `GET /metrics` (content type `text/plain; version=0.0.4`). A registry's constant
labels go on every sample: a Ray Serve replica names itself with one (`replica`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LabelKey = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(key: LabelKey, extra: tuple[str, str] | None = None) -> str:
    items = list(key) + ([extra] if extra else [])
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(float(x))


class _Metric:
    kind = "untyped"

    def __init__(self, registry: "Registry", name: str, help: str, labelnames: Sequence[str] = ()):
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = registry.lock
        self._const: LabelKey = registry.const_labels
        registry.metrics.append(self)

    def _key(self, labels: dict[str, str]) -> LabelKey:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {tuple(labels)}")
        return tuple((n, str(labels[n])) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._values: dict[LabelKey, float] = {}
        if not self.labelnames:
            self._values[()] = 0.0

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self._const + k)} {_number(v)}" for k, v in sorted(self._values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._values: dict[LabelKey, float] = {}
        if not self.labelnames:
            self._values[()] = 0.0

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self._const + k)} {_number(v)}" for k, v in sorted(self._values.items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry, name, help, buckets: Sequence[float], labelnames: Sequence[str] = ()):
        super().__init__(registry, name, help, labelnames)
        self.buckets = tuple(sorted(float(b) for b in buckets)) + (math.inf,)
        self._series: dict[LabelKey, list] = {}  # key -> [bucket counts..., sum, count]

    def observe(self, value: float, count: int = 1, **labels: str) -> None:
        """Record `value` `count` times (a histogram of n equal observations in one call)."""
        key = self._key(labels)
        with self._lock:
            s = self._series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    s[i] += count
            s[-2] += value * count
            s[-1] += count

    def count(self, **labels: str) -> int:
        with self._lock:
            s = self._series.get(self._key(labels))
            return s[-1] if s else 0

    def lines(self) -> list[str]:
        out = []
        for key, s in sorted(self._series.items()):
            key = self._const + key
            for bound, c in zip(self.buckets, s):
                out.append(f"{self.name}_bucket{_labels(key, ('le', _number(bound)))} {c}")
            out.append(f"{self.name}_sum{_labels(key)} {_number(s[-2])}")
            out.append(f"{self.name}_count{_labels(key)} {s[-1]}")
        return out


class Registry:
    def __init__(self, const_labels: dict[str, str] | None = None):
        self.const_labels: LabelKey = tuple((k, str(v)) for k, v in (const_labels or {}).items())
        self.lock = threading.Lock()
        self.metrics: list[_Metric] = []

    def render(self) -> str:
        out: list[str] = []
        with self.lock:
            for m in self.metrics:
                out += m.header() + m.lines()
        return "\n".join(out) + "\n"


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """Every metric the server exports, in one registry; `labels` go on every sample."""

    def __init__(self, labels: dict[str, str] | None = None):
        r = self.registry = Registry(labels)
        self.requests = Counter(r, "quasar_requests_total", "HTTP API requests answered, by endpoint and status",
                                ("endpoint", "status"))
        self.cancelled = Counter(r, "quasar_requests_cancelled_total",
                                 "Generations stopped early because the client went away")
        self.rejected = Counter(r, "quasar_requests_rejected_total", "Requests refused because the queue was full")
        self.engine_errors = Counter(r, "quasar_engine_errors_total",
                                     "Generations that failed inside the engine, by kind", ("kind",))
        self.prompt_tokens = Counter(r, "quasar_prompt_tokens_total", "Prompt tokens processed")
        self.cached_tokens = Counter(r, "quasar_prompt_cached_tokens_total",
                                     "Prompt tokens whose K/V came from the prompt cache instead of a prefill")
        self.completion_tokens = Counter(r, "quasar_completion_tokens_total", "Tokens generated")
        self.steps = Counter(r, "quasar_verifier_steps_total", "Verifier forward passes (after prefill)",
                             ("drafter", "verifier"))
        self.drafted = Counter(r, "quasar_draft_tokens_total", "Draft tokens proposed", ("drafter", "verifier"))
        self.accepted = Counter(r, "quasar_draft_tokens_accepted_total", "Draft tokens accepted by the verifier",
                                ("drafter", "verifier"))
        self.acceptance = Histogram(r, "quasar_acceptance_length",
                                    "Tokens emitted per verifier step (1 = no draft token accepted)",
                                    (1, 2, 3, 4, 5, 6, 8, 12, 16), ("drafter", "verifier"))
        self.latency = Histogram(r, "quasar_request_duration_seconds",
                                 "Time from a generation request's arrival to its last byte", LATENCY_BUCKETS,
                                 ("endpoint",))
        self.queue_wait = Histogram(r, "quasar_queue_wait_seconds", "Time a request waited for the engine",
                                    LATENCY_BUCKETS)
        self.ttft = Histogram(r, "quasar_time_to_first_token_seconds",
                              "Time from arrival to the first generated text", LATENCY_BUCKETS)
        self.tokens_per_s = Histogram(r, "quasar_generation_tokens_per_second",
                                      "Decode speed of each finished generation",
                                      (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000))
        self.waiting = Gauge(r, "quasar_requests_waiting", "Requests queued for the engine")
        self.running = Gauge(r, "quasar_requests_running", "Requests being decoded (their sequences share the engine's batch)")
        self.batch_size = Gauge(r, "quasar_batch_size", "Sequences in the engine's last verifier step (0 when idle)")

    def render(self) -> str:
        return self.registry.render()
