"""The scheduler: a bounded queue in front of one worker thread that owns the LLM.

An `LLM` decodes one request at a time, so the server never runs two generations at once:
requests wait in a FIFO queue of at most `max_queue` entries (beyond the one being
decoded) and a request that finds it full is refused at once (`QueueFull`, HTTP 429).

A job asks for `n` independent choices of one prompt (OpenAI's `n`), decoded one after
another; choice i samples with seed + i when the request has a seed, so every choice is
reproducible and greedy choices are identical. Each job reports back through
`on_event(kind, payload)`, called from the worker thread: `("chunk", (i, Chunk))` per
verifier step and `("choice", (i, Result))` as choice i ends, then exactly one of
`("result", [Result per choice])`, `("error", Exception)` or `("cancelled", None)`. A job's
`cancel` event is checked between verifier steps (and before a queued job starts), so a
client that goes away stops its generation within one step. Any failure is confined to
its own job: the worker catches everything, reports it, and goes on with the next request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quasar.errors import QuasarError
from quasar.server.metrics import ServerMetrics
from quasar.speculative.generate import Chunk, Result

log = logging.getLogger("quasar.server")

EventSink = Callable[[str, Any], None]


class QueueFull(Exception):
    """The engine's queue holds `max_queue` waiting requests already."""


class SchedulerClosed(Exception):
    """The engine is shutting down and takes no more requests."""


@dataclass
class Job:
    prompt_ids: list[int]
    options: dict  # keyword arguments for LLM.stream (besides prompt_ids)
    on_event: EventSink
    n: int = 1  # independent choices of the same prompt
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    cancel: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None
    outcome: str | None = None  # "result" | "error" | "cancelled"

    @property
    def queue_s(self) -> float:
        return (self.started or time.perf_counter()) - self.created


class Scheduler:
    def __init__(self, llm, max_queue: int = 32, metrics: ServerMetrics | None = None):
        if max_queue < 1:
            raise QuasarError(f"max_queue must be at least 1, got {max_queue}")
        self.llm, self.max_queue = llm, max_queue
        self.metrics = metrics or ServerMetrics()
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._paused = False
        self._closed = False
        self.current: Job | None = None
        self.completed = 0
        self._thread = threading.Thread(target=self._loop, name="quasar-scheduler", daemon=True)

    # ------------------------------------------------------------------ control
    def start(self) -> "Scheduler":
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, cancel what is queued and running, and wait for the worker."""
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), deque()
            if self.current is not None:
                self.current.cancel.set()
            self._cond.notify_all()
        self.metrics.waiting.set(0)
        for job in pending:
            self._emit(job, "error", SchedulerClosed("the server is shutting down"))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def pause(self) -> None:
        """Stop starting new jobs (the running one finishes); queued jobs wait. For maintenance and tests."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._pending)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._pending.append(job)
            self.metrics.waiting.set(len(self._pending))
            self._cond.notify_all()
        return job

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._paused or not self._pending):
                    self._cond.wait()
                if self._closed:
                    return
                job = self._pending.popleft()
                self.metrics.waiting.set(len(self._pending))
                self.current = job
            try:
                self._run(job)
            except BaseException:  # never let the worker die; the job has been told already
                log.exception("engine: unexpected failure around job %s", job.id)
            finally:
                with self._cond:
                    self.current = None
                    self.completed += 1

    def _emit(self, job: Job, kind: str, payload: Any) -> None:
        if kind in ("result", "error", "cancelled"):
            job.outcome, job.finished = kind, time.perf_counter()
        try:
            job.on_event(kind, payload)
        except Exception:  # a broken sink (e.g. the event loop has gone) must not stop the engine
            log.exception("engine: delivering %s for job %s failed", kind, job.id)

    def _run(self, job: Job) -> None:
        m = self.metrics
        job.started = time.perf_counter()
        m.queue_wait.observe(job.started - job.created)
        if job.cancel.is_set():  # the client left while the job was queued
            m.cancelled.inc()
            self._emit(job, "cancelled", None)
            return
        m.running.set(1)
        m.batch_size.set(1)  # one sequence per verifier step until the engine batches
        m.prompt_tokens.inc(len(job.prompt_ids))
        try:
            results = []
            for index in range(job.n):
                result = self._decode_choice(job, index)
                if result is None:
                    return
                results.append(result)
                self._emit(job, "choice", (index, result))
            self._emit(job, "result", results)
        except QuasarError as e:
            m.engine_errors.inc(kind="invalid_request")
            self._emit(job, "error", e)
        except Exception as e:
            log.exception("engine: job %s failed", job.id)
            m.engine_errors.inc(kind="internal")
            self._emit(job, "error", e)
        finally:
            m.running.set(0)
            m.batch_size.set(0)

    def _decode_choice(self, job: Job, index: int) -> Result | None:
        """Decode choice `index` of `job`, streaming its chunks; None when the client left
        (reported as "cancelled"). Errors propagate to `_run`."""
        m = self.metrics
        drafter = job.options.get("drafter") or self.llm.drafter
        verifier = job.options.get("verifier") or self.llm.verifier
        labels = {"drafter": drafter, "verifier": verifier}
        steps = tokens = 0
        stream = self.llm.stream(prompt_ids=job.prompt_ids, **choice_options(job.options, index))
        try:
            for item in stream:
                if isinstance(item, Result):
                    self._record_result(item, labels)
                    return item
                assert isinstance(item, Chunk)
                steps += 1
                tokens += len(item.token_ids)
                if job.first_token is None and item.token_ids:
                    job.first_token = time.perf_counter()
                    m.ttft.observe(job.first_token - job.created)
                self._emit(job, "chunk", (index, item))
                if job.cancel.is_set():
                    m.cancelled.inc()
                    m.steps.inc(steps, **labels)
                    m.completion_tokens.inc(tokens)
                    self._emit(job, "cancelled", None)
                    return None
            raise RuntimeError("the decoder ended without a result")
        finally:
            stream.close()  # releases the LLM's lock however the choice ends

    def _record_result(self, result: Result, labels: dict) -> None:
        m, s = self.metrics, result.stats
        m.completion_tokens.inc(s.new_tokens)
        m.steps.inc(s.steps, **labels)
        m.drafted.inc(s.drafted, **labels)
        m.accepted.inc(s.accepted, **labels)
        for emitted, n in s.accepted_hist.items():
            m.acceptance.observe(int(emitted), count=n, **labels)
        if s.new_tokens:
            m.tokens_per_s.observe(s.tokens_per_s)


def choice_options(options: dict, index: int) -> dict:
    """LLM.stream options for choice `index`: a seeded request samples choice i with seed + i."""
    seed = options.get("seed")
    return options if index == 0 or seed is None else {**options, "seed": seed + index}
