"""Time fp32 vs each exact int8 CPU path per layer shape, to pick the ``cpu`` policy.

Run ``python scripts/tools/bench_kernels.py [--threads 2] [--budget-ms 15]`` (quasar installed). Paths are
interleaved round by round (A B C A B C ...) after warm-up and the median per-call time is
reported, so drifting machine load hits every path alike. "gemm" times the int8 x int8 ->
int32 product alone; "layer" adds per-token quantization and the fp32 epilogue (what a
model pays); "Int8Linear" is the real module with the ``cpu`` backend's per-shape choice.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w8a8_numerics import quantize_activation, scale_output
from quasar.runtime.w8a8_backends import CPU_VARIANTS, exact_cpu_variants

# (name, out_features, in_features): SmolLM2-135M layers, plus a Qwen2.5-1.5B MLP layer.
SHAPES = [
    ("k/v 192x576", 192, 576),
    ("q/o 576x576", 576, 576),
    ("gate/up 1536x576", 1536, 576),
    ("down 576x1536", 576, 1536),
    ("lm_head 49152x576", 49152, 576),
    ("ref 8960x1536", 8960, 1536),
]


def _time(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float) -> dict[str, float]:
    """Median seconds per call, paths interleaved, each round ~budget_s per path."""
    reps = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, int(budget_s / max(time.perf_counter() - t0, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(reps[name]):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


def _paths(n: int, k: int, m: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) / k**0.5
    x = torch.randn(m, k, generator=gen)
    layer = Int8Linear.from_float(torch.nn.Linear(k, n, bias=False), backend="cpu")
    layer.weight.copy_(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8))
    layer.repack()
    qx, _ = quantize_activation(x)
    fns: dict[str, Callable[[], object]] = {"fp32": lambda: F.linear(x, w)}
    for name in exact_cpu_variants():
        pack, mm = CPU_VARIANTS[name]
        packed = pack(layer.weight)
        fns[f"gemm {name}"] = lambda mm=mm, packed=packed: mm(qx, packed)
    for name in exact_cpu_variants():
        pack, mm = CPU_VARIANTS[name]
        packed = pack(layer.weight)

        def full(mm=mm, packed=packed) -> torch.Tensor:
            q, sx = quantize_activation(x)
            return scale_output(mm(q, packed), sx, layer.weight_scale, None, x.dtype)

        fns[f"layer {name}"] = full
    fns["Int8Linear"] = lambda: layer(x)
    return fns


def main(argv: list[str] | None = None) -> None:
    """Print one row per (shape, M): times in microseconds and fp32 / Int8Linear."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=15.0, help="per path per round")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 6])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {args.threads} threads, exact cpu variants: "
          f"{', '.join(exact_cpu_variants())}; median us per call")
    header = None
    for label, n, k in SHAPES:
        for m in args.m:
            times = _time(_paths(n, k, m), args.rounds, args.budget_ms / 1e3)
            if header is None:
                header = ["shape", "M", *times, "fp32/Int8Linear"]
                print(" | ".join(header))
                print(" | ".join("---" for _ in header))
            row = [label, str(m), *(f"{t * 1e6:.1f}" for t in times.values())]
            row.append(f"{times['fp32'] / times['Int8Linear']:.2f}x")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
