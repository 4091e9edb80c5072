"""How a verifier step's time grows with its rows, against the weight-streaming floor.

    python scripts/tools/step_rows.py --model DIR_OR_GGUF [--verifier w8a8|w4a8] [--rows 1,4,6,7,8,12,16]
                                [--rounds 5]

Builds the verifier (as `quasar generate` does; a W8A8 or W4A8 checkpoint directory loads
directly), prefills a short prompt, then times `Transformer.step` on chains of each row
count (the fastest of three tries a round), the counts interleaved round by round so
drifting machine load hits them alike, and prints the median per count with its ratio to the one-row step and to the floor: the
quantized weights a step reads (lm_head included, the embedding gather not;
step_cost.weight_bytes) over the memory read bandwidth. Each round first samples the
bandwidth (a 1 GiB streaming sum), and "vs floor" is the median over rounds of the step
against that round's own floor: on a VM whose bandwidth moves from minute to minute a floor
measured once, before or after, can mislead by 1.5x. Use it to pick row budgets (chain k,
tree nodes, batch rows): extra rows are nearly free up to one register-blocked GEMM pass.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quasar.api import LLM
from quasar.bench.bandwidth import measure_read_bandwidth
from quasar.models.rows import Rows
from quasar.runtime.step_cost import weight_bytes

PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, then explain it."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--verifier", choices=("w8a8", "w4a8"), default="w8a8")
    ap.add_argument("--rows", default="1,4,6,7,8,12,16", help="comma-separated row counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    counts = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)

    llm = LLM(args.model, max_context=2048, max_batch=1)
    model = llm.verifier_model(args.verifier)
    model.setup_cache(2048, 1)
    ids = llm.encode(PROMPT)
    read = weight_bytes(model)
    bandwidth: list[float] = []  # GB/s, sampled at the start of each round
    with torch.inference_mode():
        model(torch.tensor([ids]), logits="none", slot=0)  # also packs the weights
        times: dict[int, list[float]] = {k: [] for k in counts}
        for _ in range(args.rounds):
            bandwidth.append(measure_read_bandwidth(1 << 30, repeats=1)["gb_per_s"])
            for k in counts:
                rows = Rows.chain([ids[-1]] * k, 0, model.cache.lengths)
                tries = []
                for _ in range(3):  # the fastest of three: other processes only ever add time
                    t0 = time.perf_counter()
                    model.step(rows)
                    tries.append(time.perf_counter() - t0)
                times[k].append(min(tries))
    floors = [read / gbps / 1e9 for gbps in bandwidth]  # seconds, per round
    one = statistics.median(times[counts[0]])
    from quasar.kernels import ext

    path = ext.w4a8_kernel_path() if args.verifier == "w4a8" else ext.kernel_path()
    print(f"{args.verifier} kernel path {path} (QUASAR_ISA=... forces a lower one); CPU {_cpu()}")
    print(f"weights read per step {read / 1e9:.3f} GB; bandwidth per round {min(bandwidth):.1f}-"
          f"{max(bandwidth):.1f} GB/s (median {statistics.median(bandwidth):.1f}), floor at the median "
          f"{statistics.median(floors) * 1e3:.1f} ms")
    print("rows | step ms (median) | vs first | vs floor (median of rounds)")
    for k in counts:
        t = statistics.median(times[k])
        paired = statistics.median(tk / f for tk, f in zip(times[k], floors))
        print(f"{k:4d} | {t * 1e3:9.1f} | {t / one:5.2f}x | {paired:5.2f}x")


def _cpu() -> str:
    from quasar.bench.runner import environment

    return environment(torch.get_num_threads())["cpu"]


if __name__ == "__main__":
    main()
