"""Spies that record whether the fused C++ step ran (quasar.runtime.fused_step): per step of
one model, or per call of every model's fused step."""

from __future__ import annotations

from contextlib import contextmanager

from quasar.runtime import fused_step


@contextmanager
def fused_calls(q):
    """Record, per verifier step of ``q``, whether the fused step ran (not None)."""
    kernel, calls = q.step_kernel, []

    def spy(*args, **kwargs):
        y = kernel(*args, **kwargs)
        calls.append(y is not None)
        return y

    spy.max_rows = kernel.max_rows  # prefill chunks take the same path as without the spy
    q.step_kernel = spy
    try:
        yield calls
    finally:
        q.step_kernel = kernel


def record_fused_steps(monkeypatch) -> list[bool]:
    """Whether each call of any model's fused step ran (not None), for this test."""
    calls: list[bool] = []
    call = fused_step.FusedW8A8Step.__call__

    def spy(self, *args, **kwargs):
        y = call(self, *args, **kwargs)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(fused_step.FusedW8A8Step, "__call__", spy)
    return calls
