"""How the bytes a mixture-of-experts verifier step reads grow with its rows, on random routing.

    python scripts/tools/moe_step_bytes.py [--model qwen3-30b-a3b|mixtral-8x7b|olmoe-1b-7b|all]
                                     [--rows 1,2,4,6,8,16,32] [--trials 10]

Routing is measured on a small random model of the real model's experts and top-k (its
router and experts random, hidden size 64, a few layers): steps of R random rows after a
short prompt, each sparse layer counting the distinct experts its rows reach
(SparseMoE.last_experts). The bytes are then those of the real model's shapes, built on the
meta device with every linear int8 (W8A8) or 4-bit (W4A8): everything outside the experts
plus, per sparse layer, the measured experts times one expert's bytes (step_cost.expert_bytes).
Prints, per row count: mean experts touched per layer (and the uniform-routing expectation
step_cost.expected_experts), the step's GB at W8A8 and W4A8, and its ratio to a one-row step.
Real routing is skewed towards popular experts, so real steps touch fewer experts than this.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from quasar.models.config import ModelConfig
from quasar.models.llama import Transformer
from quasar.models.moe import experts_touched
from quasar.models.rows import Rows
from quasar.runtime.step_cost import expected_experts, expert_bytes
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w4a8_numerics import W4A8_GROUP
from quasar.runtime.w8a8 import Int8Linear

# config.json fields of the real models (Hugging Face), enough for their linears' shapes
SHAPES = {
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2),
    "olmoe-1b-7b": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=50304, hidden_size=2048,
                        intermediate_size=1024, moe_intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, head_dim=128, num_experts=64,
                        num_experts_per_tok=8, norm_topk_prob=False),
}
_PROMPT = 8


def proxy_model(raw: dict, layers: int = 4, seed: int = 0) -> Transformer:
    """A small random float model routing like config.json `raw` (its experts and top-k)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf({**raw, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 8,
                               "moe_intermediate_size": 8, "num_hidden_layers": layers, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 16})
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.fill_(1.0)
    return model.eval()


def touched_per_layer(model: Transformer, rows: int, trials: int) -> float:
    """Mean distinct experts a sparse layer's rows reach in a step of `rows` random tokens."""
    gen = torch.Generator().manual_seed(rows)
    counts = []
    for _ in range(trials):
        ids = torch.randint(0, model.config.vocab_size, (_PROMPT + rows,), generator=gen).tolist()
        model.setup_cache(_PROMPT + rows + 1)
        model(torch.tensor([ids[:_PROMPT]]), logits="none")
        model.step(Rows.chain(ids[_PROMPT:], 0, model.cache.lengths), logits="none")
        counts += experts_touched(model)
    return statistics.mean(counts)


def quantized_on_meta(cfg: ModelConfig, bits: int) -> Transformer:
    """The model with `cfg`'s shapes on the meta device, every linear int8 or 4-bit (the
    lm_head int8, as the verifiers keep it)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear):
            parent, _, child = name.rpartition(".")
            new = W4A8Linear(m.in_features, m.out_features, W4A8_GROUP, False, device="meta") \
                if bits == 4 and name != "lm_head" else Int8Linear(m.in_features, m.out_features, False, device="meta")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def report(name: str, rows: list[int], trials: int) -> None:
    cfg = ModelConfig.from_hf(SHAPES[name])
    proxy = proxy_model(SHAPES[name])
    sizes = {bits: expert_bytes(quantized_on_meta(cfg, bits)) for bits in (8, 4)}
    layers = len(cfg.moe_layers)
    print(f"\n{name}: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, {layers} sparse layers; "
          f"one expert {sizes[8][1][0] / 1e6:.1f} MB at W8A8, outside the experts {sizes[8][0] / 1e9:.2f} GB")
    print(f"{'rows':>5} {'experts/layer':>13} {'uniform':>8} " + " ".join(f"{c:>8}" for c in (
        "W8A8 GB", "x 1 row", "W4A8 GB", "x 1 row")))
    first: dict[int, float] = {}
    for r in rows:
        touched = touched_per_layer(proxy, r, trials)
        line = f"{r:>5} {touched:>13.2f} {expected_experts(cfg.num_experts, cfg.num_experts_per_tok, r):>8.2f}"
        for bits in (8, 4):
            dense, per_expert = sizes[bits]
            gb = (dense + layers * per_expert[0] * touched) / 1e9
            first.setdefault(bits, gb)
            line += f" {gb:>8.2f} {gb / first[bits]:>8.2f}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="all", choices=["all", *SHAPES])
    ap.add_argument("--rows", default="1,2,4,6,8,16,32")
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        for name in SHAPES if args.model == "all" else [args.model]:
            report(name, rows, args.trials)


if __name__ == "__main__":
    main()
