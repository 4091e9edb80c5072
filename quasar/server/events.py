"""The bridge from the scheduler's thread to a request on the event loop.

The scheduler reports a job's progress by calling `JobEvents.sink` on its own thread; the
request's coroutine reads the events with `next_event`, which is also where a request's
way out is decided, once for every endpoint:
- a client that goes away (checked every DISCONNECT_POLL_S while waiting) sets the job's
  cancel flag and ends the request with 499, as does a job the scheduler cancelled;
- a failed job becomes the ApiError its failure deserves (`scheduler_error`);
- a request task cancelled by the server (shutdown) cancels its job too.
A streamed reply can no longer change its status; `JobStream` cancels the job however its
stream ends early.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from quasar.errors import QuasarError
from quasar.server.openai_schema import ApiError
from quasar.server.scheduler import Job, QueueFull, Scheduler, SchedulerClosed

DISCONNECT_POLL_S = 0.25
# Events a job sends while it decodes; anything else ends it ("result", "error", "cancelled").
PROGRESS = ("chunk", "choice")


class ClientGone(Exception):
    """The request is over without a reply: its client left or its job was cancelled (499)."""


class JobEvents:
    """The asyncio side of a job: the scheduler's events, delivered to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.job: Job | None = None
        self._polled = time.monotonic()

    def sink(self, kind: str, payload: Any) -> None:  # called from the scheduler's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            if self.job is not None:
                self.job.cancel.set()

    async def next(self, request: Request | None) -> tuple[str, Any]:
        """The next event; checks for a client disconnect (then cancels the job and raises
        ClientGone) every DISCONNECT_POLL_S."""
        while True:
            if request is not None and time.monotonic() - self._polled >= DISCONNECT_POLL_S:
                self._polled = time.monotonic()
                if await request.is_disconnected():
                    self.job.cancel.set()
                    raise ClientGone()
            if not self.queue.empty():
                return self.queue.get_nowait()
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue


def scheduler_error(exc: Exception) -> ApiError:
    """What the client is told about a job that failed with `exc`."""
    if isinstance(exc, QuasarError):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, SchedulerClosed):
        return ApiError(503, str(exc), "server_error", code="shutting_down")
    return ApiError(500, "The server had an error while generating this reply.", "server_error")


def submit(scheduler: Scheduler, job_of) -> JobEvents:
    """Queue the job `job_of(sink)` makes (429 at once when the queue is full) and return
    its events."""
    events = JobEvents(asyncio.get_running_loop())
    events.job = job_of(events.sink)
    try:
        scheduler.submit(events.job)
    except QueueFull as e:
        raise ApiError(429, f"The server is busy: {e}. Retry shortly.", "rate_limit_error",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    except SchedulerClosed as e:
        raise scheduler_error(e) from None
    return events


async def next_event(events: JobEvents, request: Request) -> tuple[str, Any]:
    """The job's next "chunk", "choice" or "result" event, for a reply not sent yet: an
    error raises its ApiError, a cancelled job or a client gone raises ClientGone."""
    try:
        kind, payload = await events.next(request)
    except asyncio.CancelledError:
        events.job.cancel.set()
        raise
    if kind == "error":
        raise scheduler_error(payload)
    if kind == "cancelled":
        raise ClientGone()
    return kind, payload


class JobStream(StreamingResponse):
    """A streaming response that cancels its job however the stream ends early."""

    def __init__(self, content, events: JobEvents, **kw):
        super().__init__(content, **kw)
        self.events = events

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.events.job is not None and self.events.job.outcome is None:
                self.events.job.cancel.set()
