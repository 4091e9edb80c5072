"""The W4A8 verifier (issue #34): every decoder linear in 4-bit groups, the output head 4-bit
with its largest logits recomputed in int8.

A model that comes as a 4-bit GGUF is, dequantized, the float model Quasar decodes and
measures against. Its Q4_0 / Q4_1 / Q4_K tensors are already affine int4 groups of 32
(quasar.models.gguf_groups), so they become ``W4A8Linear`` layers holding those weights:
rounding them again would lose twice. (Exactly for Q4_0 and Q4_1; Q4_K's two-level scales,
a float16 times a 6-bit integer, are rounded once to the float16 the kernels stream.) The
layer tensors the file keeps wider (a Q4_K_M file's Q6_K half of the value and down
projections; every layer of a Q8_0 or float GGUF) are fitted to affine int4 groups of 32
(``fit_weight_w4_affine``, llama.cpp's weighted fit of a Q4_K block). At 1.5B that streams
1053 MB a step instead of 1127 (those tensors int8, as until session 24), for 96.0% top-1 and
KL 0.0066 against the float model where int8 gave 96.6% and 0.0036 and llama.cpp's own
Q4_K_M file 97.7% and 0.0091 (issue #34 asks for >= 95% and below Q4_K_M's KL). The output
head is a ``RefinedHead`` (quasar.quant.refined_head): 4-bit fitted groups for every logit,
the top 64 of each row recomputed from the int8 head, which is read only at those rows. At
1.5B that is 965 MB a step, for 96.0% and KL 0.0072 (the int8 head: 1053 MB, 0.0066; 4-bit
alone: 94.1%, 0.0129). A GGUF's build fits the head too (44.6 s at 1.5B instead of 33.5).
A model given as a float directory has no 4-bit groups: it goes through the W8A8 verifier's
sequential pipeline with ``weight_bits=4`` (quasar.quant.sequential: rotated, each layer's
linears GPTQ-rounded to symmetric int4 groups of 32 against their calibrated inputs, not
smoothed; the output head int8).

A GGUF's groups are built from the memory-mapped float weights and the file, a layer at a
time (nothing is calibrated: seconds for the default model, about half a minute at 1.5B);
either way the result is written to ``$QUASAR_CACHE/w4a8/`` as a W4A8 checkpoint
(quasar.quant.w4a8_checkpoint) a part at a time, keyed like the W8A8 cache, so later runs
load it; ``quasar quantize --bits 4`` writes the same checkpoint.
"""

from __future__ import annotations

import functools
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from quasar.errors import QuasarError
from quasar.models.llama import Transformer
from quasar.quant.refined_head import DEFAULT_TOP_K, RefinedHead
from quasar.quant.w4a8 import W4A8Linear
from quasar.quant.w4a8_checkpoint import REFINED_HEAD
from quasar.quant.w4a8_numerics import W4A8_GROUP as GROUP  # the verifier's group size
from quasar.quant.w4a8_numerics import fit_weight_w4_affine

# What build_w4a8 makes, named in the cache key: change it when the recipe changes, so old
# cache entries are not taken for the new verifier.
RECIPE = "gguf-int4-groups, wider layer tensors fitted to int4 groups, 4-bit head refined by int8, float16 group params, v4"
HEAD_TOP_K = DEFAULT_TOP_K
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


def gguf_source(loaded) -> Path | None:
    """The GGUF file `loaded` (a LoadedModel) was converted from, or None (a directory)."""
    return gguf_path(str(loaded.source))


def gguf_path(model: str) -> Path | None:
    """The GGUF file a `--model` value names ('default' is one), or None (a directory)."""
    if model == "default":
        from quasar.data.packages import default_model_path

        return Path(default_model_path())
    path = Path(model).expanduser()
    return path if path.suffix.lower() == ".gguf" else None


def gguf_int4_groups(path: Path, cfg) -> dict[str, Callable[[], tuple]]:
    """{HF weight name: a function giving (q uint8 [out, in], scale, offset float32
    [out, in / 32])} for every 4-bit matrix of GGUF file `path`, rows in Hugging Face order
    (llama.cpp's Q/K row permutation undone for llama-family models; `cfg` is the model's
    ModelConfig). Each is unpacked only when asked for, so a build holds one at a time."""
    from gguf import GGUFReader

    from quasar.models.gguf import _hf_name
    from quasar.models.gguf_groups import is_int4_type

    reader = GGUFReader(path)
    out = {}
    for t in reader.tensors:
        name = _hf_name(t, path)
        if name is not None and len(t.shape) == 2 and is_int4_type(t.tensor_type):
            out[name] = functools.partial(_read_groups, t, cfg)
    return out


def _read_groups(t, cfg) -> tuple:
    from quasar.models.gguf import _unpermute
    from quasar.models.gguf_groups import int4_groups

    groups = int4_groups(t.data, t.tensor_type, tuple(int(d) for d in reversed(t.shape)))
    role = t.name.split(".")[2:3]
    if cfg.model_type in ("llama", "mistral") and role in (["attn_q"], ["attn_k"]):
        groups = tuple(_unpermute(a, cfg.num_heads if role == ["attn_q"] else cfg.num_kv_heads) for a in groups)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in groups)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def cache_path(loaded) -> Path:
    """The cache entry of `loaded`'s W4A8 verifier, keyed like W8A8's (the model directory's
    identity, quasar.quant.verifier.cache_key) and by the GGUF file its 4-bit groups are read
    from, the recipe and the W4A8 format."""
    from quasar.quant import verifier
    from quasar.quant.w4a8_checkpoint import FORMAT_VERSION

    gguf = gguf_source(loaded)
    gguf_id = [str(gguf.resolve()), gguf.stat().st_size, gguf.stat().st_mtime_ns] if gguf is not None else None
    key = {"gguf": gguf_id, "recipe": RECIPE, "w4a8_format": FORMAT_VERSION}
    if gguf is None:  # calibrated: the pipeline's options are part of the recipe
        key["options"] = float_source_options().cache_key(None)
    return verifier.cache_path(Path(loaded.model_dir), torch.float32, key, kind="w4a8")


def w4a8_verifier(loaded, *, cache: bool = True) -> Transformer:
    """The W4A8 Transformer of `loaded` (a LoadedModel of a float directory or GGUF file, or
    a W4A8 checkpoint, given as it is): loaded from the cache when built before, else written
    there part by part (``write_w4a8_checkpoint``) and loaded from it, memory-mapped. Without
    a cache, or when it cannot be written (a read-only or full disk only warns), built in
    memory (``build_w4a8``)."""
    from quasar.models.hf import load_hf_dir

    if loaded.quantized:
        if loaded.quant_kind != "w4a8":
            raise QuasarError(f"{loaded.source} is a W8A8 checkpoint; the w4a8 verifier needs the float model "
                              "(its directory or GGUF file) or a W4A8 checkpoint", param="verifier")
        return loaded.model
    target = cache_path(loaded) if cache else None
    if target is not None and (target / "config.json").is_file():
        try:
            return load_hf_dir(target, torch.float32)
        except QuasarError as e:  # a damaged entry: build it again
            print(f"warning: rebuilding the W4A8 cache entry {target} ({e})", file=sys.stderr)
            shutil.rmtree(target, ignore_errors=True)
    if target is not None:
        try:
            write_w4a8_checkpoint(loaded, target, {"source": str(loaded.source)}, exist_ok=True)
            return load_hf_dir(target, torch.float32)
        except OSError as e:
            print(f"warning: could not cache the W4A8 model in {target} ({e}); building it in memory",
                  file=sys.stderr)
    return build_w4a8(loaded)


def float_source_options():
    """How a float directory becomes the W4A8 verifier: the sequential pipeline's defaults
    (rotation, GPTQ, the built-in calibration text) with 4-bit layers."""
    from quasar.quant.options import QuantOptions

    return QuantOptions(weight_bits=4)


def write_w4a8_checkpoint(loaded, out: Path, info: dict, *, exist_ok: bool = False, progress: bool = False,
                          options=None, calib_text: str | None = None) -> dict:
    """Write the W4A8 checkpoint of `loaded` (a float directory or GGUF file) to `out`
    (quasar.quant.w4a8_checkpoint), one shard per part as it is made, so memory holds one
    float layer (or the embeddings) at a time; `out` appears only once complete. Returns its
    config.json. A GGUF source's config records `info` (e.g. the source); a float directory is
    calibrated instead (`options`, default ``float_source_options()``; `calib_text` replaces
    the built-in corpus), and its config records those options, as a W8A8 checkpoint does."""
    from quasar.fileio import atomic_dir
    from quasar.quant.checkpoint import ShardWriter

    if gguf_source(loaded) is None:
        from quasar.quant.quantize import quantize_to_dir

        return quantize_to_dir(loaded.model_dir, loaded.tokenizer, out, options=options or float_source_options(),
                               calib_text=calib_text, progress=progress, exist_ok=exist_ok)
    written: dict = {}

    def fill(tmp: Path) -> None:
        writer = ShardWriter(tmp, loaded.config.num_layers + 2)  # embeddings, each layer, norm + head
        written.update(_w4a8_parts(loaded, writer.add, info, progress))
        writer.finish(written, Path(loaded.model_dir))

    atomic_dir(Path(out), fill, exist_ok)
    return written


def build_w4a8(loaded) -> Transformer:
    """The W4A8 Transformer of `loaded` (a float directory or GGUF file), built in memory
    (RECIPE; ``write_w4a8_checkpoint`` streams the same tensors to disk)."""
    from quasar.models.config import ModelConfig
    from quasar.models.hf import build_model

    if gguf_source(loaded) is None:
        from quasar.models.tensors import SafetensorsSource
        from quasar.quant.quantize import build_w8a8

        return build_w8a8(SafetensorsSource(loaded.model_dir), loaded.tokenizer, cfg=loaded.config,
                          options=float_source_options(), progress=False)
    tensors: dict[str, torch.Tensor] = {}
    config = _w4a8_parts(loaded, tensors.update, {"source": str(loaded.source)})
    return build_model(ModelConfig.from_hf(config), tensors, "w4a8", torch.float32, config["quantization_config"])


def _w4a8_parts(loaded, sink: Callable[[dict], None], info: dict, progress: bool = False) -> dict:
    """Make the W4A8 model of a GGUF source's 4-bit groups, its tensors (Hugging Face names)
    part by part into `sink`: the embeddings, each decoder layer (read from the memory-mapped
    float weights, its linears replaced as RECIPE says), the final norm with the int8 head.
    Returns the config.json."""
    from tqdm import tqdm

    from quasar.models.tensors import SafetensorsSource
    from quasar.quant.sequential import float_layer
    from quasar.quant.w4a8_checkpoint import w4a8_config_of

    cfg = loaded.config
    source = SafetensorsSource(loaded.model_dir)
    groups = gguf_int4_groups(gguf_source(loaded), cfg)
    sink({"model.embed_tokens.weight": source.get("model.embed_tokens.weight").float()})
    with torch.no_grad():  # not inference_mode: the tensors become a model's parameters
        for i in tqdm(range(cfg.num_layers), desc="W4A8 layers", unit="layer", file=sys.stderr,
                      disable=not progress, leave=False):
            layer = float_layer(source, cfg, i)
            for name in LAYER_LINEARS:
                linear = layer.get_submodule(name)
                found = groups.pop(f"model.layers.{i}.{name}.weight", None)
                # a tensor the file keeps wider than 4 bits: fitted to 4-bit groups (RECIPE)
                q, scale, offset = found() if found is not None else fit_weight_w4_affine(linear.weight, GROUP)
                _set(layer, name, W4A8Linear.from_groups(q, scale, offset, GROUP, linear.bias))
            sink({f"model.layers.{i}.{n}": t for n, t in layer.state_dict().items()})
            del layer
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in source
        # the stored (memory-mapped) weight as it is: both quantizers widen it a block at a time
        head = RefinedHead.from_float(source.get("model.embed_tokens.weight" if tied else "lm_head.weight"),
                                      HEAD_TOP_K, GROUP)  # untied: the embedding stays float
        sink({"model.norm.weight": source.get("model.norm.weight").float(),
              **{f"lm_head.{n}": t for n, t in head.state_dict().items()}})
    return w4a8_config_of(cfg, GROUP, 8, REFINED_HEAD, info, head_top_k=HEAD_TOP_K)
