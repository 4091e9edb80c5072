"""Which int4 weights a W4A8 verifier should use (issue #34), measured before any kernel:
top-1 agreement and KL against the float model on held-out text, for each candidate.

    python scripts/tools/w4_fidelity.py --model default|FILE.gguf [--windows 8] [--threads 2]

Candidates (linear layers of the decoder; lm_head and embeddings stay float here):
- ``w8a8-rtn``: int8 per output channel, round to nearest (W8A8 without smoothing or GPTQ);
- ``file-4bit``: the GGUF's own 4-bit groups kept as they are (affine groups of 32,
  ``models.gguf_groups``), tensors the file stores in 6 or 8 bits as int8 per channel;
- ``sym-gN``: symmetric int4 groups of N (32, 64, 128), round to nearest.
Every candidate quantizes activations to int8 per token, as W8A8 does, or with
``--act-group 32`` per token and group of 32 columns (llama.cpp's Q8 blocks). The products are
computed in float from the dequantized weights and activations (the same values an exact
integer kernel multiplies; float rounding aside), so this measures the weights' and the
activations' rounding, not a kernel. Memory: the float model twice (about 20 GB peak at 1.5B).

Measured (2026-12-03, session 16; top-1 agreement / KL against the float model):

| activations | candidate | 135M, 8 windows | 1.5B, 4 windows |
|---|---|---|---|
| per token | w8a8-rtn | 91.3% / 0.025 | 95.7% / 0.017 |
| per token | file-4bit | 91.6% / 0.025 | 95.9% / 0.016 |
| per token | sym-g32 / g64 / g128 | 71.7 / 65.8 / 63.1% | – |
| per 32 columns | file-4bit | **97.7% / 0.0020** | **99.2% / 0.0006** |
| per 32 columns | w8a8-rtn | 96.4% / 0.0046 | 98.3% / 0.0015 |
| per 32 columns | sym-g32 | 72.5% / 0.34 | 91.1% / 0.043 |

Rounding the activations per token, not the weights, is what costs (W8A8's smoothing and
15-bit down projections exist for that); the file's own 4-bit groups lose nothing, and
symmetric groups, re-rounding a 4-bit file, lose most.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from quasar.api import LLM
from quasar.eval.fidelity import compare_models, fidelity_text
from quasar.runtime.w8a8_numerics import quantize_activation, quantize_weight
from quasar.runtime.w4a8_numerics import dequantize_w4, quantize_weight_w4


class FakeQuantLinear(nn.Module):
    """y = dequant(int8 x) @ w_q^T + b, w_q the candidate's dequantized weight; x quantized
    per token, or per token and group of ``act_group`` columns (llama.cpp's Q8 blocks)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_group: int | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias, self.act_group = bias, act_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.act_group and xf.shape[-1] % self.act_group == 0:
            groups = xf.unflatten(-1, (-1, self.act_group))
            q, s = quantize_activation(groups)
            xq = (q.float() * s).flatten(-2)
        else:
            q, s = quantize_activation(xf)
            xq = q.float() * s
        return F.linear(xq.to(x.dtype), self.weight, self.bias)


def _four_bit_names(path: str) -> set[str]:
    """The Hugging Face names of the weights a GGUF file stores in 4 bits."""
    from pathlib import Path

    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    from quasar.models.gguf import _hf_name

    reader = GGUFReader(path)
    return {_hf_name(t, Path(path)) for t in reader.tensors if t.tensor_type in (T.Q4_0, T.Q4_1, T.Q4_K)}


def _int8_rtn(w: torch.Tensor) -> torch.Tensor:
    q, s = quantize_weight(w)
    return q.float() * s


def candidate_weight(name: str, w: torch.Tensor, how: str, four_bit: set[str]) -> torch.Tensor:
    if how == "w8a8-rtn":
        return _int8_rtn(w)
    if how == "file-4bit":  # the float model *is* these 4-bit groups, dequantized
        return w.float() if f"{name}.weight" in four_bit else _int8_rtn(w)
    group = int(how.removeprefix("sym-g"))
    q, s = quantize_weight_w4(w, group)
    return dequantize_w4(q, s, group)


def quantized_copy(model: nn.Module, how: str, four_bit: set[str], act_group: int | None) -> nn.Module:
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in list(m.named_modules()):
            for child_name, child in list(mod.named_children()):
                full = f"{name}.{child_name}" if name else child_name
                if isinstance(child, nn.Linear) and "lm_head" not in full:
                    w = candidate_weight(full, child.weight, how, four_bit).to(child.weight.dtype)
                    setattr(mod, child_name, FakeQuantLinear(w, child.bias, act_group))
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--windows", type=int, default=8, help="512-token windows of held-out text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--candidates", default="w8a8-rtn,file-4bit,sym-g32,sym-g64,sym-g128")
    ap.add_argument("--act-group", type=int, default=0,
                    help="quantize activations per group of this many columns (0: per token, as W8A8)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "default":
        from quasar.data.packages import default_model_path

        gguf_path = str(default_model_path())
    elif args.model.endswith(".gguf"):
        gguf_path = args.model
    else:
        raise SystemExit("--model must be 'default' or a .gguf file (the file-4bit candidate reads its blocks)")
    llm = LLM(args.model)
    four_bit = _four_bit_names(gguf_path)
    ids = llm.tokenizer.encode(fidelity_text())
    results = {}
    for how in args.candidates.split(","):
        t0 = time.perf_counter()
        m = quantized_copy(llm.model, how, four_bit, args.act_group or None)
        r = compare_models(llm.model, m, ids, limit=args.windows)
        results[how] = {"top1": round(r["top1_agreement"], 4), "kl": round(r["kl_mean"], 4),
                        "ppl_increase": round(r["ppl_increase"], 4), "tokens": r["tokens"]}
        print(how, results[how], f"{time.perf_counter() - t0:.0f} s", flush=True)
        del m
    print(json.dumps({"model": args.model, "windows": args.windows, "act_group": args.act_group,
                      "results": results}))


if __name__ == "__main__":
    main()
