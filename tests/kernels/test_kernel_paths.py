"""The kernel path is an argument of the ops (csrc/bindings.cpp: `path`, "" for the process
default that QUASAR_ISA sets): one process runs any path this CPU has, call by call, without
touching the default, and the int8 and W4A8 GEMMs give the same bits on every one of them."""

from __future__ import annotations

import pytest
import torch

from quasar.kernels import ext
from quasar.runtime.w8a8_backends import exact_cpu_variants

pytestmark = pytest.mark.skipif(ext.int8_linear_op() is None, reason="the C++ extension is unavailable here")


def paths_here() -> list[str]:
    return [p for p in ext.KERNEL_PATHS if ext.cpu_runs(p)]


def test_int8_linear_gives_the_same_bits_on_every_path_in_one_process():
    gen = torch.Generator().manual_seed(50)
    n, k = 70, 200
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    ws = torch.rand(n, 1, generator=gen) / 100
    bias = torch.randn(n, generator=gen)
    comp = w.sum(dim=1, dtype=torch.int32).mul_(128)
    tiles = ext.pack_tiles(w)
    default = ext.kernel_path()
    # as Int8Linear's backend does: rows past the small-M kernel go to oneDNN's s8 GEMM only
    # where it is exact (not where ONEDNN_MAX_CPU_ISA caps it below VNNI)
    ext.onednn_exact("s8" in exact_cpu_variants())
    op = torch.ops.quasar_quant.int8_linear
    for m in (1, 5, 20):
        x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
        for act_bits in (8, 15):
            outs = {p: op(x, w, ws, bias, comp, False, False, tiles, act_bits, p) for p in paths_here()}
            for path, y in outs.items():
                assert torch.equal(y, outs["portable"]), f"{path} differs from portable (M={m}, act_bits={act_bits})"
    assert ext.kernel_path() == default  # a call's path leaves the default alone


def test_w4a8_linear_gives_the_same_bits_on_every_path_in_one_process():
    if ext.w4a8_linear_op() is None:
        pytest.skip("the W4A8 op is unavailable here")
    gen = torch.Generator().manual_seed(51)
    n, k, group = 40, 128, 32
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) / 10).half()
    offsets = (torch.randn(n, k // group, generator=gen) / 10).half()
    packed = ext.pack_w4(q, scales, offsets, group)
    x = torch.randn(3, k, generator=gen)
    outs = {p: torch.ops.quasar_quant.w4a8_linear(x, packed, n, k, group, None, p)
            for p in paths_here()}
    for path, y in outs.items():
        assert torch.equal(y, outs["portable"]), f"{path} differs from portable"


def test_row_selection_gives_the_same_rows_on_every_path_in_one_process():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(52))
    outs = {p: torch.ops.quasar_quant.row_argmax_topk(logits, 8, p) for p in paths_here()}
    for path, (best, top) in outs.items():
        assert torch.equal(best, outs["portable"][0]) and torch.equal(top, outs["portable"][1]), path


def test_an_unknown_path_is_an_error():
    w = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="kernel path"):
        torch.ops.quasar_quant.int8_linear(torch.zeros(1, 8), w, torch.ones(4), None, None, False, False, None, 8,
                                           "avx9")
