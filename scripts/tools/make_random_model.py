#!/usr/bin/env python
"""Write a randomly initialised model with a real model's exact shapes, to measure memory
and speed at real sizes. Its weights are noise, so is its text.

    python scripts/tools/make_random_model.py --config qwen3-8b --dtype bf16 --out DIR

Dense configs: Qwen2.5 0.5B-3B, Qwen3 8B. Mixture-of-experts (Qwen3-MoE block): qwen3-30b-a3b,
and olmoe-1b-7b (OLMoE-1B-7B's layers and experts with Qwen3's vocabulary).

DIR gets a Hugging Face directory: config.json (the real model's), sharded safetensors
with model.safetensors.index.json, and a tokenizer with its chat template. Linear and
embedding weights (and biases) are N(0, 0.02), norm weights ones, so activations stay
finite through every layer. Each tensor is drawn from its own generator, seeded from
--seed and its name, so the output does not depend on the shard size.

Memory stays near one chunk of one tensor: the safetensors files are written by hand,
header first, then each tensor in row chunks as it is drawn. DIR appears only once
complete (written to a temp dir next to it, then renamed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

# config.json of each real model (as published; shapes and hyper-parameters).
_QWEN2 = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", vocab_size=151936,
    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    sliding_window=None, use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02,
)
CONFIGS = {
    "qwen2.5-0.5b": dict(_QWEN2, num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(_QWEN2, num_hidden_layers=28, hidden_size=1536, intermediate_size=8960,
                         num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-3b": dict(_QWEN2, num_hidden_layers=36, hidden_size=2048, intermediate_size=11008,
                       num_attention_heads=16, num_key_value_heads=2),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", vocab_size=151936,
        num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
        rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        sliding_window=None, use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02,
    ),
}
_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu", vocab_size=151936,
    max_position_embeddings=40960, rope_theta=1000000.0, rope_scaling=None, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, sliding_window=None, use_sliding_window=False,
    attention_dropout=0.0, initializer_range=0.02, decoder_sparse_step=1, mlp_only_layers=[],
    norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001,
)
CONFIGS["qwen3-30b-a3b"] = dict(_QWEN3_MOE, num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
                                moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128)
# OLMoE-1B-7B's layers and experts (16 layers, 64 experts of width 1024, 8 per token) as a
# Qwen3-MoE block, with Qwen3's vocabulary, so the Qwen tokenizer serves Quasar and llama.cpp alike.
CONFIGS["olmoe-1b-7b"] = dict(_QWEN3_MOE, num_hidden_layers=16, hidden_size=2048, intermediate_size=1024,
                              moe_intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                              num_attention_heads=16, num_key_value_heads=16, head_dim=128, norm_topk_prob=False,
                              max_position_embeddings=4096)

DTYPES = {"bf16": (torch.bfloat16, "BF16", "bfloat16"), "fp16": (torch.float16, "F16", "float16"),
          "fp32": (torch.float32, "F32", "float32")}
INIT_STD = 0.02
CHUNK_ELEMENTS = 1 << 25  # rows drawn and written at a time (64 MiB in bf16)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
QWEN_GGUF = "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"  # from scripts/setup/get_model.sh


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor in the checkpoint, in module order."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    qk_norm = cfg["model_type"] in ("qwen3", "qwen3_moe")
    specs = [("model.embed_tokens.weight", (vocab, hidden), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.append((p + "input_layernorm.weight", (hidden,), "ones"))
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            specs.append((f"{p}self_attn.{proj}_proj.weight", (rows, hidden), "normal"))
            if qkv_bias:
                specs.append((f"{p}self_attn.{proj}_proj.bias", (rows,), "normal"))
        if qk_norm:
            specs += [(p + "self_attn.q_norm.weight", (head_dim,), "ones"),
                      (p + "self_attn.k_norm.weight", (head_dim,), "ones")]
        specs += [
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim), "normal"),
            (p + "post_attention_layernorm.weight", (hidden,), "ones"),
        ]
        specs += _mlp_specs(cfg, p + "mlp.", i)
    specs.append(("model.norm.weight", (hidden,), "ones"))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, hidden), "normal"))
    return specs


def _mlp_specs(cfg: dict, p: str, layer: int) -> list[tuple[str, tuple[int, ...], str]]:
    """A layer's MLP: dense, or (a mixture-of-experts config's sparse layers) router and experts."""
    hidden = cfg["hidden_size"]

    def swiglu(prefix: str, inter: int):
        return [(prefix + "gate_proj.weight", (inter, hidden), "normal"),
                (prefix + "up_proj.weight", (inter, hidden), "normal"),
                (prefix + "down_proj.weight", (hidden, inter), "normal")]

    experts = cfg.get("num_experts", 0)
    step = cfg.get("decoder_sparse_step", 1)
    if not experts or layer in cfg.get("mlp_only_layers", []) or (layer + 1) % step:
        return swiglu(p, cfg["intermediate_size"])
    specs = [(p + "gate.weight", (experts, hidden), "normal")]
    for e in range(experts):
        specs += swiglu(f"{p}experts.{e}.", cfg["moe_intermediate_size"])
    return specs


def plan_shards(specs, itemsize: int, max_shard_bytes: int) -> list[list]:
    """Consecutive tensors grouped into shards of at most max_shard_bytes (a larger tensor
    gets a shard of its own)."""
    shards, size = [[]], 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def write_shard(path: Path, specs, dtype: str, seed: int, progress: tqdm) -> None:
    """A safetensors file: 8-byte header length, JSON header (padded to 8 bytes), raw data."""
    torch_dtype, st_dtype, _ = DTYPES[dtype]
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name, shape, init in specs:
            gen = _generator(seed, name)
            row = math.prod(shape[1:])
            rows_per_chunk = max(1, CHUNK_ELEMENTS // row)
            for start in range(0, shape[0], rows_per_chunk):
                chunk = torch.empty((min(rows_per_chunk, shape[0] - start), *shape[1:]), dtype=torch_dtype)
                if init == "ones":
                    chunk.fill_(1.0)
                else:
                    chunk.normal_(0.0, INIT_STD, generator=gen)
                f.write(chunk.reshape(-1).view(torch.uint8).numpy())
                progress.update(chunk.numel() * itemsize)


def default_tokenizer() -> Path | str:
    """The real Qwen2.5 tokenizer (inside the GGUF from scripts/setup/get_model.sh) if it is in a
    Quasar cache, else the default model's (ids < 49152 are valid in a 151936 vocabulary)."""
    roots = [os.environ.get("QUASAR_CACHE"), Path.home() / ".cache" / "quasar"]
    for root in filter(None, roots):
        if (Path(root) / QWEN_GGUF).is_file():
            return Path(root) / QWEN_GGUF
    return "default"


def write_tokenizer(source: Path | str, out: Path) -> tuple[int | None, int | None, int]:
    """Copy or convert the tokenizer from `source` (a GGUF file, a model directory, or
    "default") into `out`, chat template in tokenizer_config.json. Returns (bos id, eos id,
    number of tokens)."""
    if str(source) == "default":
        from quasar.models.loader import resolve_model_dir

        source = resolve_model_dir("default")
    source = Path(source)
    if source.is_file() and source.suffix == ".gguf":
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(out)
    elif (source / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, out / name)
    else:
        raise ValueError(f"{source}: not a GGUF file or a directory with tokenizer.json")
    cfg_path, jinja = out / "tokenizer_config.json", out / "chat_template.jinja"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if jinja.is_file():  # transformers 5 saves the template beside the config; v4 reads it inside
        cfg.setdefault("chat_template", jinja.read_text())
        jinja.unlink()
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))

    def token_id(key):
        value = cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return tok.token_to_id(value) if value else None

    return token_id("bos_token"), token_id("eos_token"), tok.get_vocab_size(with_added_tokens=True)


def write_random_model(out: Path, config: dict, dtype: str = "bf16", seed: int = 0,
                       tokenizer: Path | str | None = None, max_shard_bytes: int = 2 << 30) -> Path:
    """Write the random model `config` (a config.json dict) to the new directory `out`."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; remove it or choose another --out")
    torch_dtype, _, dtype_name = DTYPES[dtype]
    specs = tensor_specs(config)
    total = sum(math.prod(shape) for _, shape, _ in specs) * torch.empty(0, dtype=torch_dtype).element_size()
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total + (1 << 30):
        raise OSError(f"{out.parent}: {free / 2**30:.1f} GiB free, the model needs {total / 2**30:.1f} GiB")

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        cfg = dict(config, torch_dtype=dtype_name)
        if tokenizer is not None:
            bos, eos, n_tokens = write_tokenizer(tokenizer, tmp)
            if n_tokens > config["vocab_size"]:
                raise ValueError(f"tokenizer has {n_tokens} tokens, more than vocab_size {config['vocab_size']}")
            cfg.update(bos_token_id=bos, eos_token_id=eos)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

        shards = plan_shards(specs, torch.empty(0, dtype=torch_dtype).element_size(), max_shard_bytes)
        weight_map = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc=out.name, file=sys.stderr) as progress:
            for k, shard in enumerate(shards, 1):
                name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                write_shard(tmp / name, shard, dtype, seed, progress)
                weight_map.update({spec[0]: name for spec in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS), help="which real model's shapes")
    ap.add_argument("--out", required=True, type=Path, help="new directory to write")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, metavar="DIR_OR_GGUF",
                    help="a GGUF file or model directory to take the tokenizer from, or 'default' for the "
                         "default model's; default: the Qwen2.5 GGUF of scripts/setup/get_model.sh if cached, else 'default'")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="largest shard size in GiB")
    args = ap.parse_args()
    tokenizer = args.tokenizer or default_tokenizer()
    print(f"tokenizer from {tokenizer}", file=sys.stderr)
    try:
        out = write_random_model(args.out, CONFIGS[args.config], args.dtype, args.seed, tokenizer,
                                 int(args.shard_gb * 2**30))
    except (OSError, ValueError) as e:
        sys.exit(f"make_random_model: {e}")
    print(out)


if __name__ == "__main__":
    main()
