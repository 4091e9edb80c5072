"""Time the W4A8 GEMM op against the W8A8 one on decode-sized steps (issue #34).

    python scripts/tools/w4_gemm_speed.py [--rows 1,4] [--group 32] [--threads 2] [--rounds 5] [--budget-ms 20]

For each Qwen2.5-1.5B layer shape (out x in) and row count, times ``ext.w4a8_linear_op()``
(activations quantized per row and group, the 4-bit weight streamed once) and the W8A8
``Int8Linear`` on the ``cpu`` backend (its small-M C++ kernel), both whole calls (quantize,
GEMM, epilogue), interleaved round by round so drifting machine load hits both alike, and
prints the medians, the weight bytes each reads over its time (GB/s: the nibbles with each
group's float16 scale and offset, ``w4_weight_bytes``; the int8 weight with its row scale)
and W4 time / W8 time. Names the CPU and both ops' kernel paths (``QUASAR_ISA`` forces a
lower one). A benchmark: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Callable

import torch

# (name, out_features, in_features): Qwen2.5-1.5B's projections.
SHAPES = [
    ("q/o 1536x1536", 1536, 1536),
    ("k/v 256x1536", 256, 1536),
    ("gate/up 8960x1536", 8960, 1536),
    ("down 1536x8960", 1536, 8960),
]


def _time(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float) -> dict[str, float]:
    """Median seconds per call, the callables interleaved (scripts/tools/bench_kernels.py's timer)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("bench_kernels.py"))
    bench_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_kernels)
    return bench_kernels._time(fns, rounds, budget_s)


def _calls(n: int, k: int, m: int, group: int) -> tuple[dict[str, Callable[[], object]], dict[str, int]]:
    """The W4 and W8 calls for one shape and row count, and the weight bytes each reads."""
    from quasar.kernels import ext
    from quasar.runtime.w8a8 import Int8Linear
    from quasar.runtime.w4a8_numerics import w4_weight_bytes

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) / 100).half()
    offsets = -8 * scales
    packed = ext.pack_w4(q, scales, offsets, group)
    w4 = ext.w4a8_linear_op()
    w8 = Int8Linear.from_float(torch.nn.Linear(k, n, bias=False), backend="cpu")
    w8.weight.copy_(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8))
    w8.repack()
    fns = {"W4A8": lambda: w4(x, packed, n, k, group, None), "W8A8": lambda: w8(x)}
    return fns, {"W4A8": w4_weight_bytes(n, k, group), "W8A8": n * k + 4 * n}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4", help="comma-separated row counts")
    ap.add_argument("--group", type=int, default=32, choices=(32, 64, 128))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=20.0, help="time per call kind per round")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from quasar.bench.runner import environment
    from quasar.kernels import ext

    if ext.w4a8_linear_op() is None:
        raise SystemExit(f"the W4A8 C++ op is unavailable: {ext.info()}")
    print(f"CPU {environment(args.threads)['cpu']}, {args.threads} threads; kernel path: int8 {ext.kernel_path()}, "
          f"W4A8 {ext.w4a8_kernel_path()}; group {args.group}")
    print("shape | M | W4A8 us | W4A8 GB/s | W8A8 us | W8A8 GB/s | W4/W8 time")
    with torch.inference_mode():
        for name, n, k in SHAPES:
            for m in (int(r) for r in args.rows.split(",")):
                fns, read = _calls(n, k, m, args.group)
                t = _time(fns, args.rounds, args.budget_ms / 1e3)
                gbps = {kind: read[kind] / t[kind] / 1e9 for kind in t}
                print(f"{name} | {m} | {t['W4A8'] * 1e6:.1f} | {gbps['W4A8']:.1f} | {t['W8A8'] * 1e6:.1f} | "
                      f"{gbps['W8A8']:.1f} | {t['W4A8'] / t['W8A8']:.2f}x")


if __name__ == "__main__":
    main()
