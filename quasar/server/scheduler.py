"""The scheduler: a bounded queue in front of one worker thread that owns the LLM and
decodes up to `max_batch` sequences together (continuous batching).

A request is refused at once (`QueueFull`, HTTP 429) only when every sequence slot is
taken or promised to an earlier request and `max_queue` requests wait for a slot already:
the batch fills before anyone is turned away. Between verifier steps the worker admits
waiting requests (FIFO) while sequence slots are free, and a finished or cancelled one
leaves at once. Each verifier (w8a8, fp, ...) has its own `BatchDecoder` over its own KV
cache, at most `max_verifiers` of them (quasar.server.verifier_pool); a step advances every
sequence of every decoder by one verifier step (prompts are prefilled a bounded number of
tokens per step, so a long prompt does not stall the others). A
sequence's tokens are the same whether it decodes alone or beside others
(quasar.speculative.batch).

A job asks for `n` choices of one prompt (OpenAI's `n`): n sequences that share one
prefill; choice i samples with seed + i when the request has a seed, so every choice is
reproducible and greedy choices are identical. Each job reports back through
`on_event(kind, payload)`, called from the worker thread: `("chunk", (i, Chunk))` per
verifier step of choice i and `("choice", (i, Result))` as choice i ends, then exactly one
of `("result", [Result per choice])`, `("error", Exception)` or `("cancelled", None)`. A
job's `cancel` event is checked between verifier steps (and before a queued job starts),
so a client that goes away stops its generation within one step. Any failure is confined
to its own job: the worker catches everything, reports it, and goes on with the others.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from quasar.engine.plan import DecodePlan
from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError
from quasar.server.metrics import ServerMetrics
from quasar.server.verifier_pool import DEFAULT_MAX_VERIFIERS, VerifierPool
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
    plan: DecodePlan  # checked where the request came in; choice i samples with seed + i
    on_event: EventSink
    n: int = 1  # choices of the same prompt
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


@dataclass
class _Running:
    """A job the worker has taken: its plan, its choices' results, the choices in a batch."""

    job: Job
    results: list[Result | None]
    next_choice: int = 0  # choices [0, next_choice) have been given a slot
    live: set[int] = field(default_factory=set)
    # choice -> [output tokens, steps] streamed so far, while it decodes (a finished choice
    # reports its result's stats instead; these are reported when the job is cancelled)
    partial: dict[int, list[int]] = field(default_factory=dict)

    @property
    def plan(self) -> DecodePlan:
        return self.job.plan

    @property
    def labels(self) -> dict:
        return {"drafter": self.plan.drafter, "verifier": self.plan.verifier}


class Scheduler:
    def __init__(self, llm, max_queue: int = 32, metrics: ServerMetrics | None = None,
                 max_batch: int | None = None, max_verifiers: int = DEFAULT_MAX_VERIFIERS):
        if max_queue < 1:
            raise QuasarError(f"max_queue must be at least 1, got {max_queue}")
        self.llm, self.max_queue = llm, max_queue
        self.max_batch = min(max_batch or llm.max_batch, llm.max_batch)
        self.metrics = metrics or ServerMetrics()
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._paused = False
        self._closed = False
        self._running: dict[str, _Running] = {}  # job id -> state, in admission order
        self.pool = VerifierPool(llm.engine, self.max_batch, max_verifiers)
        # sequences of admitted jobs not finished yet (running or about to get a slot); with
        # _pending, what `submit` decides by. Guarded by _cond: the worker changes it.
        self._reserved = 0
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # see `call`
        self._holding = False  # the worker holds llm.lock (see _hold_llm)
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
            for run in list(self._running.values()):
                run.job.cancel.set()
            self._cond.notify_all()
        self.metrics.waiting.set(0)
        for job in pending:
            self._emit(job, "error", SchedulerClosed("the server is shutting down"))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the worker thread between steps and return its result (or raise).

        Use it for model work outside requests (building a verifier before serving): every
        torch computation of the LLM stays on one thread. A second thread running OpenMP
        regions gives libgomp more threads than cores, after which its workers sleep
        between regions instead of spinning, and a decode step (hundreds of small parallel
        regions) takes about twice as long (measured on the 2-core development machine)."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result()

    def pause(self) -> None:
        """Stop admitting new jobs (running ones go on); queued jobs wait. For maintenance and tests."""
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
    def running(self) -> int:
        """Jobs being decoded now."""
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            if not self._room_for(job):
                self.metrics.rejected.inc()
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._pending.append(job)
            self.metrics.waiting.set(len(self._pending))
            self._cond.notify_all()
        return job

    def _room_for(self, job: Job) -> bool:
        """Whether `job` may be queued (under _cond): it gets a slot at the next admission,
        or fewer than `max_queue` jobs wait for one. Admission is FIFO, so once a job does
        not fit every later one waits too."""
        free, waiting = self.max_batch - self._reserved, 0
        for j in (*self._pending, job):
            if not waiting and j.n <= free:
                free -= j.n
            else:
                waiting += 1
        return waiting <= self.max_queue

    def _release(self, sequences: int) -> None:
        with self._cond:
            self._reserved -= sequences

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._running and not self._calls and \
                        (self._paused or not self._pending):
                    self._cond.wait()
                if self._closed:
                    break
                calls, self._calls = list(self._calls), deque()
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)
            try:
                self._admit()
                self._drop_cancelled()
                self._hold_llm(bool(self._running))
                self._step()
            except BaseException:  # never let the worker die
                log.exception("engine: unexpected failure in the worker")
                for run in list(self._running.values()):
                    self._end(run, "error", RuntimeError("the engine failed"))
            finally:
                self._hold_llm(bool(self._running))
        for run in list(self._running.values()):
            self._end(run, "cancelled", None)
        self._hold_llm(False)
        with self._cond:
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            future.set_exception(SchedulerClosed("the server is shutting down"))

    def _hold_llm(self, busy: bool) -> None:
        """Hold the LLM's lock while sequences are in the batch: the cache slots are the
        batch's, so a direct LLM.generate from another thread waits until the engine is idle."""
        if busy and not self._holding:
            self.llm.lock.acquire()
            self._holding = True
        elif not busy and self._holding:
            self.llm.lock.release()
            self._holding = False

    def _live_sequences(self) -> int:
        return sum(len(run.live) for run in self._running.values())

    def _admit(self) -> None:
        """Give waiting choices slots, then take waiting jobs in order while slots are free."""
        while True:
            for run in list(self._running.values()):
                while run.next_choice < run.job.n and self._live_sequences() < self.max_batch:
                    if not self._add_choice(run):
                        break
            with self._cond:
                if self._paused or not self._pending or self._live_sequences() >= self.max_batch or \
                        any(run.next_choice < run.job.n for run in self._running.values()):
                    return
                job = self._pending[0]  # only this thread takes jobs: it stays the head
            if not job.cancel.is_set():
                try:
                    if self.pool.acquire(job.plan.verifier_spec, self.busy_verifiers()) is None:
                        return  # the verifiers in use fill the pool: the job waits for one
                except Exception as e:  # the verifier cannot be built
                    if self._take(job):
                        self._unstarted(job, "error", e)
                    continue
            if self._take(job):
                self._start(job)

    def busy_verifiers(self) -> set[VerifierSpec]:
        return {run.plan.verifier_spec for run in self._running.values()}

    def _take(self, job: Job) -> bool:
        """Move `job`, the queue's head, to the admitted; False when `stop` emptied the queue."""
        with self._cond:
            if not self._pending or self._pending[0] is not job:
                return False
            self._pending.popleft()
            self._reserved += job.n
            self.metrics.waiting.set(len(self._pending))
        return True

    def _unstarted(self, job: Job, kind: str, payload: Any) -> None:
        """A taken job that ends before it runs: cancelled while queued, or failed."""
        self._release(job.n)
        if kind == "error":
            self._job_failed(job, payload)
        else:
            self.metrics.cancelled.inc()
            self._emit(job, kind, payload)
        self.completed += 1

    def _start(self, job: Job) -> None:
        m = self.metrics
        job.started = time.perf_counter()
        m.queue_wait.observe(job.started - job.created)
        if job.cancel.is_set():  # the client left while the job was queued
            self._unstarted(job, "cancelled", None)
            return
        m.prompt_tokens.inc(len(job.prompt_ids))
        self._running[job.id] = _Running(job, [None] * job.n)
        self._update_gauges()

    def _add_choice(self, run: _Running) -> bool:
        """Give run's next choice a slot; False when its decoder has none free or the job failed."""
        batch = self.pool[run.plan.verifier_spec]
        if not batch.n_free:
            return False
        index = run.next_choice
        plan = run.plan
        try:
            options = plan.options
            if index and options.sampling.seed is not None:  # choice i samples with seed + i
                options = options.with_seed(options.sampling.seed + index)
            batch.add((run.job.id, index), run.job.prompt_ids, self.llm.new_drafter(plan), options)
        except Exception as e:
            self._end(run, "error", e)
            return False
        run.next_choice += 1
        run.live.add(index)
        return True

    def _drop_cancelled(self) -> None:
        for run in list(self._running.values()):
            if run.job.cancel.is_set():
                m = self.metrics
                m.cancelled.inc()
                m.steps.inc(sum(steps for _, steps in run.partial.values()), **run.labels)
                m.completion_tokens.inc(sum(tokens for tokens, _ in run.partial.values()))
                self._end(run, "cancelled", None)

    def _step(self) -> None:
        """One step of every decoder with sequences in it; deliver what each sequence emitted."""
        for batch in self.pool.decoders():
            if not batch.n_running:
                continue
            self.metrics.batch_size.set(batch.n_decoding or batch.n_running)
            items = batch.step()  # under llm.lock (_hold_llm)
            for (job_id, index), item in items:
                run = self._running.get(job_id)
                if run is None:
                    continue
                if isinstance(item, Exception):
                    self._end(run, "error", item)
                elif isinstance(item, Chunk):
                    self._chunk(run, index, item)
                else:
                    self._choice_done(run, index, item)
        self._update_gauges()

    def _chunk(self, run: _Running, index: int, chunk: Chunk) -> None:
        job = run.job
        counts = run.partial.setdefault(index, [0, 0])
        counts[0] += len(chunk.token_ids)
        counts[1] += 1
        if job.first_token is None and chunk.token_ids:
            job.first_token = time.perf_counter()
            self.metrics.ttft.observe(job.first_token - job.created)
        self._emit(job, "chunk", (index, chunk))

    def _choice_done(self, run: _Running, index: int, result: Result) -> None:
        self._release(1)
        run.live.discard(index)
        run.results[index] = result
        run.partial.pop(index, None)
        self._record_result(result, run.labels)
        self._emit(run.job, "choice", (index, result))
        if all(r is not None for r in run.results):
            self._end(run, "result", list(run.results))

    def _end(self, run: _Running, kind: str, payload: Any) -> None:
        """The job is over: free its slots, report `kind` once."""
        if self._running.pop(run.job.id, None) is None:
            return
        self._release(sum(r is None for r in run.results))
        for index in run.live:
            self.pool[run.plan.verifier_spec].remove((run.job.id, index))
        run.live.clear()
        if kind == "error":
            self._job_failed(run.job, payload)
        else:
            self._emit(run.job, kind, payload)
        self.completed += 1
        self._update_gauges()

    def _job_failed(self, job: Job, error: Exception) -> None:
        if isinstance(error, QuasarError):
            self.metrics.engine_errors.inc(kind="invalid_request")
        else:
            log.error("engine: job %s failed", job.id, exc_info=error)
            self.metrics.engine_errors.inc(kind="internal")
        self._emit(job, "error", error)

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self._running))
        if not self._running:
            self.metrics.batch_size.set(0)

    def _emit(self, job: Job, kind: str, payload: Any) -> None:
        if kind in ("result", "error", "cancelled"):
            job.outcome, job.finished = kind, time.perf_counter()
        try:
            job.on_event(kind, payload)
        except Exception:  # a broken sink (e.g. the event loop has gone) must not stop the engine
            log.exception("engine: delivering %s for job %s failed", kind, job.id)

    def _record_result(self, result: Result, labels: dict) -> None:
        m, s = self.metrics, result.stats
        m.completion_tokens.inc(s.new_tokens)
        m.cached_tokens.inc(s.cached_tokens)
        m.steps.inc(s.steps, **labels)
        m.drafted.inc(s.drafted, **labels)
        m.accepted.inc(s.accepted, **labels)
        for emitted, n in s.accepted_hist.items():
            m.acceptance.observe(int(emitted), count=n, **labels)
        if s.new_tokens:
            m.tokens_per_s.observe(s.tokens_per_s)

