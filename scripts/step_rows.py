"""How a W8A8 verifier step's time grows with its rows, against the weight-streaming floor.

    python scripts/step_rows.py --model DIR_OR_GGUF [--rows 1,4,6,7,8,12,16] [--rounds 5]

Builds the W8A8 verifier (as `quasar generate` does; a W8A8 checkpoint directory loads
directly), prefills a short prompt, then times `Transformer.step` on chains of each row
count, the counts interleaved round by round so drifting machine load hits them alike,
and prints the median per count with its ratio to the one-row step and to the floor: the
int8 weights a step reads (lm_head included, the embedding gather not) over the memory
read bandwidth measured in the same process. Use it to pick row budgets (chain k, tree
nodes, batch rows): extra rows are nearly free up to one register-blocked GEMM pass.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quasar.api import LLM
from quasar.bench.bandwidth import measure_read_bandwidth
from quasar.models.rows import Rows

PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, then explain it."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", default="1,4,6,7,8,12,16", help="comma-separated row counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    counts = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)

    llm = LLM(args.model, max_context=2048, max_batch=1)
    model = llm.verifier_model("w8a8")
    model.setup_cache(2048, 1)
    ids = llm.encode(PROMPT)
    with torch.inference_mode():
        model(torch.tensor([ids]), logits="none", slot=0)  # also packs the weights
        times: dict[int, list[float]] = {k: [] for k in counts}
        for _ in range(args.rounds):
            for k in counts:
                rows = Rows.chain([ids[-1]] * k, 0, model.cache.lengths)
                t0 = time.perf_counter()
                model.step(rows)
                times[k].append(time.perf_counter() - t0)
    read = sum(b.numel() for name, b in model.named_buffers()
               if name.endswith(".weight") and b.dtype == torch.int8 and "embed" not in name)
    gbps = measure_read_bandwidth()["gb_per_s"]
    floor_ms = read / gbps / 1e6
    one = statistics.median(times[counts[0]])
    from quasar.quant import ext

    print(f"kernel path {ext.kernel_path()} (QUASAR_ISA=... forces a lower one); CPU {_cpu()}")
    print(f"int8 weights read per step {read / 1e9:.3f} GB, bandwidth {gbps:.1f} GB/s, floor {floor_ms:.1f} ms")
    print("rows | step ms (median) | vs first | vs floor")
    for k in counts:
        t = statistics.median(times[k])
        print(f"{k:4d} | {t * 1e3:9.1f} | {t / one:5.2f}x | {t * 1e3 / floor_ms:5.2f}x")


def _cpu() -> str:
    from quasar.bench.runner import environment

    return environment(torch.get_num_threads())["cpu"]


if __name__ == "__main__":
    main()
