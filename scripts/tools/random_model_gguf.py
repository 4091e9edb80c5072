#!/usr/bin/env python
"""Write a random model of scripts/tools/make_random_model.py as a GGUF file, so llama.cpp can be
timed on the same shapes and weights as Quasar (`quasar bench --model DIR --gguf FILE`).

    python scripts/tools/random_model_gguf.py --model DIR --out FILE.gguf [--type Q4_K_M]

The weights are copied as they are stored (bf16 or fp16; norms as float32, as llama.cpp's
own converter writes them), one tensor at a time from the memory-mapped safetensors, under
llama.cpp's tensor names (Quasar's GGUF reader maps them back the same way). The tokenizer
is the GGUF's the random model took its tokenizer from (`--tokenizer`, default: the Qwen2.5
GGUF of scripts/setup/get_model.sh), copied field by field. `--type Q4_K_M` or `Q8_0` then
quantizes the file with llama.cpp's own quantizer (llama-cpp-python,
scripts/setup/install_llamacpp.sh), as people download such models. Only the Qwen architectures
of make_random_model.py are supported (they need no Q/K permutation): Qwen2, Qwen3 and
Qwen3-MoE, whose experts llama.cpp stacks into one tensor per projection and layer
(`ffn_gate_exps` [experts, width, hidden]) and whose router (`ffn_gate_inp`) it keeps in
float32, as its own converter does.
FILE appears only once complete (written to a temp file beside it, then renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from quasar.errors import QuasarError
from quasar.models.gguf import GLOBAL_NAMES, LAYER_NAMES
from quasar.models.hf import read_safetensors, weight_files

ARCHES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}  # model_type -> GGUF architecture
TYPES = ("BF16", "Q8_0", "Q4_K_M")
GGUF_NAMES = {hf: gguf for gguf, hf in {**GLOBAL_NAMES, **LAYER_NAMES}.items()}
GGUF_NAMES["mlp.gate"] = "ffn_gate_inp"  # a sparse layer's router
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def gguf_name(hf_name: str) -> str:
    """model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"
    return f"{GGUF_NAMES[base]}.{suffix}"


def gguf_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """GGUF name -> (shape, the source tensors whose rows it concatenates), in file order: one
    source per tensor, except a sparse layer's experts, stacked per projection."""
    out: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = EXPERT.fullmatch(name)
        if m is None:
            out[gguf_name(name)] = (list(t.shape), [t])
            continue
        layer, expert, proj = m.groups()
        stacked = out.setdefault(f"blk.{layer}.ffn_{proj}_exps.weight", ([0, *t.shape], []))
        if int(expert) != len(stacked[1]):
            raise ValueError(f"{name}: experts are not stored in order")
        stacked[0][0] += 1
        stacked[1].append(t)
    return out


def as_gguf_array(t: torch.Tensor, name: str = ""):
    """(numpy array of the stored bytes, GGML type): 1-D tensors and routers as float32, bf16
    as raw uint16."""
    from gguf import GGMLQuantizationType

    if t.dim() == 1 or t.dtype == torch.float32 or "ffn_gate_inp" in name:
        return t.float().numpy(), GGMLQuantizationType.F32
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), GGMLQuantizationType.BF16
    if t.dtype == torch.float16:
        return t.numpy(), GGMLQuantizationType.F16
    raise ValueError(f"unsupported weight dtype {t.dtype}")


def write_gguf(model: Path, out: Path, tokenizer_gguf: Path) -> None:
    """The random model directory `model` as a float GGUF file `out` (written in place)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    cfg = json.loads((model / "config.json").read_text())
    if cfg["model_type"] not in ARCHES:
        raise ValueError(f"{model}: model_type {cfg['model_type']!r}; only {', '.join(ARCHES)} are supported")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = GGUFWriter(str(out), ARCHES[cfg["model_type"]])
    w.add_name(f"random {model.name}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_experts"):
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{model}: llama.cpp's qwen3moe has no dense layers")
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    reader = GGUFReader(str(tokenizer_gguf))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub)

    tensors = read_safetensors(weight_files(model))  # views of private maps: nothing is read yet
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    planned = gguf_tensors(tensors)
    for name, (shape, parts) in planned.items():
        t = parts[0]
        arr, kind = as_gguf_array(t[:1] if t.dim() > 1 else t, name)
        nbytes = sum(p.numel() for p in parts) * arr.itemsize
        w.add_tensor_info(name, shape, arr.dtype, nbytes, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=out.name, file=sys.stderr) as bar:
        for name, (_, parts) in planned.items():  # a layer's experts: one projection at a time in memory
            w.write_tensor_data(as_gguf_array(torch.stack(parts) if len(parts) > 1 else parts[0], name)[0])
            bar.update(sum(p.numel() * p.element_size() for p in parts))
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="a directory written by make_random_model.py")
    ap.add_argument("--out", required=True, type=Path, help="the .gguf file to write")
    ap.add_argument("--type", default="Q4_K_M", choices=TYPES, help="BF16 (the stored weights) or llama.cpp's "
                    "quantization of them (default Q4_K_M, what people download)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="the GGUF the model's tokenizer came from (default: the Qwen2.5 GGUF of get_model.sh)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script
    from make_random_model import default_tokenizer

    tokenizer = args.tokenizer or default_tokenizer()
    if str(tokenizer) == "default" or not Path(tokenizer).is_file():
        sys.exit("random_model_gguf: no tokenizer GGUF; run scripts/setup/get_model.sh qwen2.5-coder-1.5b or pass --tokenizer")
    if args.out.exists():
        sys.exit(f"random_model_gguf: {args.out} already exists")
    if not (args.model / "config.json").is_file():
        sys.exit(f"random_model_gguf: {args.model} has no config.json")
    float_tmp = args.out.with_name(f".tmp-{os.getpid()}-bf16-{args.out.name}")
    try:
        write_gguf(args.model, float_tmp, Path(tokenizer))
        if args.type == "BF16":
            os.replace(float_tmp, args.out)
        else:
            from quasar.bench.engine import Unavailable
            from quasar.bench.peers import llamacpp_quantize

            print(f"quantizing to {args.type} with llama.cpp ...", file=sys.stderr)
            try:
                llamacpp_quantize(float_tmp, args.out, args.type, args.threads)
            except Unavailable as e:
                sys.exit(f"random_model_gguf: {e}")
    except (OSError, ValueError, QuasarError) as e:
        sys.exit(f"random_model_gguf: {e}")
    finally:
        float_tmp.unlink(missing_ok=True)
    print(args.out)


if __name__ == "__main__":
    main()
