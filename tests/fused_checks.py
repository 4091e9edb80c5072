"""Checks shared by the fused-step suites (quasar.runtime.fused_step): spies that record
whether the fused C++ step ran, its closeness to the modules, and a tree step against its
paths computed one token at a time."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from quasar.models.rows import Rows
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


def assert_as_close_as_the_modules(fused, modules, ref) -> None:
    """Fused logits are as close to the float model's `ref` as the modules' (within 1.5x),
    and the same computation as the modules up to float rounding (and the int8 flips it can
    cause)."""
    scale = ref.abs().max()
    err_fused = float((fused - ref).abs().max() / scale)
    err_modules = float((modules - ref).abs().max() / scale)
    assert err_fused <= 1.5 * err_modules + 1e-3, (err_fused, err_modules)
    assert float((fused - modules).abs().max() / scale) < 0.05
    assert (fused.argmax(-1) == modules.argmax(-1)).float().mean() >= 0.8


def tree_and_paths(q, prefix: list[int], pending: int, nodes: int, cache: int,
                   seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step of a random tree of `nodes` drafts (token ids 1..15) under `pending` after
    `prefix`, and each node's logits from one-token steps along its path."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 16, (nodes,), generator=gen).tolist()
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, nodes)]
    q.setup_cache(cache)
    q(torch.tensor([prefix]), logits="none")
    tree = q.step(Rows.build([pending, *tokens], [0] * (nodes + 1), [-1, *(p + 1 for p in parents)],
                             q.cache.lengths))
    alone = []
    for node in range(nodes):
        path, at = [], node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]
        q.setup_cache(cache)
        q(torch.tensor([prefix]), logits="none")
        alone.append(torch.cat([q(torch.tensor([[t]]))[0] for t in [pending, *path]])[-1])
    return tree, alone
