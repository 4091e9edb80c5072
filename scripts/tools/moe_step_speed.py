"""A one-row fused verifier step of a mixture-of-experts model against the floor of the bytes it reads.

    python scripts/tools/moe_step_speed.py [--layers 4] [--steps 20] [--rounds 3] [--threads 2]
                                      [--modules]

Builds a random Qwen3-MoE with OLMoE-1B-7B's shapes (hidden 2048, 64 experts, top-8, expert
width 1024, 16 heads of 128, vocab 50304, norm_topk_prob False) but `--layers` decoder layers,
in memory and already quantized: every decoder linear a W4A8Linear of random 4-bit groups of
32 (the W4A8 verifier's), the routers float32 (the float weights are never materialized).
It prefills a short prompt, then times one-row fused steps of random tokens (the decoder
layers in one C++ call: ``Transformer._run_rows``; the lm_head and the embedding gather are
not part of it) and prints per step its bytes (attention's and the touched experts' quantized
weights and the float32 routers, step_cost.touched_bytes without the lm_head), its time, and
time / (bytes / read bandwidth), the bandwidth sampled at the start of each round (a 1 GiB
streaming sum, as scripts/tools/step_rows.py). `--modules` also times the same step through
the modules (the Python router loop). Reports the median over rounds of each round's fastest
step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from quasar.bench.bandwidth import measure_read_bandwidth
from quasar.kernels import ext
from quasar.models.config import ModelConfig
from quasar.models.llama import Transformer, rope_inv_freq
from quasar.models.moe import sparse_blocks
from quasar.models.rows import Rows
from quasar.runtime import fused_step
from quasar.runtime.step_cost import touched_bytes
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w4a8_numerics import W4A8_GROUP

OLMOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=50304, hidden_size=2048, intermediate_size=1024,
             moe_intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
             num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, max_position_embeddings=4096)
_PROMPT = 16


def random_w4a8(linear: nn.Linear, gen: torch.Generator) -> W4A8Linear:
    """A W4A8Linear of `linear`'s shape with random nibbles and small scales."""
    out_features, in_features = linear.out_features, linear.in_features
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, in_features // W4A8_GROUP, generator=gen) * 0.004 + 0.001
    return W4A8Linear.from_groups(q, scales, -7.5 * scales, W4A8_GROUP)


def build(layers: int, dense: bool = False, seed: int = 0) -> Transformer:
    """The random W4A8 model (its float decoder linears allocated but never touched); `dense`:
    a dense Qwen3 of the same shapes whose MLP is as wide as top-k experts together."""
    raw = {**OLMOE, "num_hidden_layers": layers}
    if dense:
        raw.update(architectures=["Qwen3ForCausalLM"], num_experts=0,
                   intermediate_size=OLMOE["num_experts_per_tok"] * OLMOE["moe_intermediate_size"])
    cfg = ModelConfig.from_hf(raw)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.inv_freq = rope_inv_freq(cfg)
    for layer in model.model.layers:
        for name, m in list(layer.named_modules()):
            if isinstance(m, nn.Linear):
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent), child, random_w4a8(m, gen))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name != "lm_head.weight":  # the step does not read the lm_head
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.eval()
    fused_step.install(model)
    return model


def step_bytes_read(model: Transformer) -> float:
    """Bytes the last step read: touched_bytes without the lm_head (the lm_head is not quantized
    here), plus the float32 routers."""
    routers = sum(block.gate.weight.numel() * 4 for block in sparse_blocks(model))
    return touched_bytes(model) + routers


def one_row_step(model: Transformer, token: int, modules: bool) -> float:
    """Seconds of one one-row step after the prompt (its K/V left uncommitted)."""
    rows = Rows.chain([token], 0, model.cache.lengths)
    kernel = model.step_kernel
    if modules:
        model.step_kernel = None
    try:
        t0 = time.perf_counter()
        y = model._run_rows(rows)
        elapsed = time.perf_counter() - t0
    finally:
        model.step_kernel = kernel
    assert modules or kernel._plan is not None, "the fused step did not run"
    del y
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="steps a round (its fastest counts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modules", action="store_true", help="also time the steps through the modules")
    ap.add_argument("--dense", action="store_true",
                    help="a dense model reading the same bytes instead (its MLP as wide as top-k experts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = build(args.layers, args.dense)
    print(f"built {args.layers} layers in {time.perf_counter() - t0:.0f} s; kernel path {ext.w4a8_kernel_path()}, "
          f"{args.threads} threads")
    gen = torch.Generator().manual_seed(1)
    model.setup_cache(256)
    with torch.inference_mode():
        model(torch.randint(0, 50304, (1, _PROMPT), generator=gen), logits="none")  # also packs the weights
        ratios, times, reads, gbps, module_times = [], [], [], [], []
        for _ in range(args.rounds):
            bandwidth = measure_read_bandwidth(1 << 30, repeats=1)["gb_per_s"]
            best = (float("inf"), 0.0)
            for _ in range(args.steps):
                elapsed = one_row_step(model, int(torch.randint(0, 50304, (1,), generator=gen)), False)
                best = min(best, (elapsed, step_bytes_read(model)))
            if args.modules:
                module_times.append(one_row_step(model, int(torch.randint(0, 50304, (1,), generator=gen)), True))
            gbps.append(bandwidth)
            times.append(best[0])
            reads.append(best[1])
            ratios.append(best[0] / (best[1] / bandwidth / 1e9))
    print(f"bytes a one-row step reads {statistics.median(reads) / 1e6:.1f} MB; bandwidth per round "
          f"{min(gbps):.1f}-{max(gbps):.1f} GB/s")
    print(f"fused one-row step {statistics.median(times) * 1e3:.2f} ms (median of rounds' fastest); "
          f"vs floor {statistics.median(ratios):.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    if module_times:
        print(f"through the modules {statistics.median(module_times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
