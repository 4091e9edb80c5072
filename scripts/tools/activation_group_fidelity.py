"""How faithful the W4A8 verifier would stay with coarser activation groups in its Q4_K layers.

    python scripts/tools/activation_group_fidelity.py --model FILE.gguf [--groups 32,64,128,256]
                                                      [--tokens 2048] [--threads 2]

Today every Q4_K group of 32 columns has its own int8 activation scale, so each group pays
a float epilogue per row; one scale per 64, 128 or 256 columns (llama.cpp's Q8_K is per 256)
would let the kernels sum several groups in int32 first. This measures the fidelity side of
that trade before any kernel: each Q4_K linear of the verifier computes the file's
dequantized weights times its activations quantized per G columns (round to nearest, scale
amax / 127, as the kernels round them), in float. That is the kernels' arithmetic but for
float rounding, so G = 32 reproduces the real verifier's figures. The Q6_K layers, the exact
head and attention run as the verifier runs them. Each G is scored against the float model
as `quasar bench --fidelity-tokens` scores an engine: top-1 agreement and KL(float ||
verifier) over the held-out text's windows.

Memory: the float model, the verifier and a float32 copy of its Q4_K weights (about 13 GB at
1.5B).
"""

from __future__ import annotations

import argparse

import torch

from quasar.api import LLM
from quasar.eval.fidelity import DEFAULT_WINDOW, compare_logits, fidelity_text, model_logits
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w8a8_numerics import quantize_activation


def grouped_forward(weight: torch.Tensor, state: dict):
    """A forward for a Q4_K W4A8Linear: its dequantized `weight` times its input quantized
    per state["group"] columns."""

    def forward(self: W4A8Linear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        rows, group = x2.shape[0], state["group"]
        q, scale = quantize_activation(x2.view(rows, self.in_features // group, group))
        y = (q.float() * scale).view(rows, self.in_features) @ weight.T
        if self.bias is not None:
            y = y + self.bias.float()
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    return forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file with Q4_K tensors (Q4_K_M)")
    ap.add_argument("--groups", default="32,64,128,256", help="activation group sizes, multiples of 32")
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    if any(g < 32 or g % 32 or 256 % g for g in groups):
        ap.error(f"--groups must divide 256 in multiples of 32, got {args.groups}")
    torch.set_num_threads(args.threads)

    llm = LLM(args.model, max_context=DEFAULT_WINDOW, max_batch=1)
    ids = llm.tokenizer.encode(fidelity_text())[:args.tokens]
    window = min(DEFAULT_WINDOW, llm.max_context, llm.config.max_position_embeddings)
    verifier = llm.verifier_model("w4a8")
    layers = [m for m in verifier.modules() if isinstance(m, W4A8Linear) and m.q4k]
    if not layers:
        raise SystemExit(f"{args.model}: the W4A8 verifier has no Q4_K layer")
    state = {"group": groups[0]}
    for layer in layers:
        layer.forward = grouped_forward(layer.dequantized_weight().float().contiguous(), state).__get__(layer)
    verifier.step_kernel = None  # the fused step would run the real kernels, not these forwards
    print(f"{len(layers)} Q4_K linears; {len(ids)} tokens, windows of {window}")
    print("| activation group | top-1 | KL mean | median | p99 | max |")
    print("|---|---|---|---|---|---|")
    with model_logits(llm.model, window) as reference:
        for group in groups:
            state["group"] = group
            with model_logits(verifier, window) as scored:
                r = compare_logits(reference, {"w4a8": scored}, ids, window)["w4a8"]
            print(f"| {group} | {r['top1_agreement']:.2%} | {r['kl_mean']:.6f} | {r['kl_median']:.6f} | "
                  f"{r['kl_p99']:.5f} | {r['kl_max']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
