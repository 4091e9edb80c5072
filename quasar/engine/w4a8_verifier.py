"""The W4A8 verifier (``--verifier w4a8``): a 4-bit GGUF's own groups as W4A8 layers, every
tensor the file keeps wider at no less than its own precision.

A model that comes as a 4-bit GGUF is, dequantized, the float model Quasar decodes and
measures against. Its Q4_0 / Q4_1 / Q4_K tensors are already affine int4 groups of 32
(quasar.models.gguf_groups), so they become ``W4A8Linear`` layers holding those weights:
rounding them again would lose twice. Q4_0 and Q4_1 carry float16 parameters, which the
kernels stream as they are; Q4_K's are two-level (a float16 times a 6-bit code), which the
kernels' Q4_K form streams as stored (fewer bytes than float16 products, and exact).

What happens to the rest is the layout (quasar.quant.w4a8_layouts). ``faithful``, the
default: the layer tensors the file keeps wider stay at its precision: a Q4_K_M file's Q6_K
half of the value and down projections as their own 6-bit blocks (``Q6KLinear``), any other
(Q5_K, Q8_0, float) int8 with 15-bit activations; the head is an ``ExactTopHead`` (its Q6_K
blocks, else int8, for the logits, the likeliest recomputed from the float rows).
``small`` (``--verifier w4a8-small``): those tensors fitted to affine int4 groups
(``fit_weight_w4_affine``, llama.cpp's weighted fit of a Q4_K block) and a ``RefinedHead``
(4-bit logits, the likeliest from the int8 head): fewer bytes a step, less faithful.
BENCHMARKS.md has both layouts' fidelity beside llama.cpp's on the same file.

A model given as a float directory has no 4-bit groups: it goes through the W8A8 verifier's
sequential pipeline with ``weight_bits=4`` (quasar.quant.sequential: rotated, each layer's
linears GPTQ-rounded to symmetric int4 groups of 32 against their calibrated inputs, not
smoothed; in the faithful layout the tensors llama.cpp's Q4_K_M keeps in 6 bits stay int8;
the output head int8).

A GGUF's groups are built from the memory-mapped float weights and the file, a layer at a
time (nothing is calibrated); either way the result is written to ``$QUASAR_CACHE/w4a8/`` as
a W4A8 checkpoint (quasar.quant.w4a8_checkpoint) a part at a time, keyed like the W8A8 cache
and by the layout, so later runs load it; ``quasar quantize --bits 4`` writes the same
checkpoint.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from quasar.cache.entries import lookup
from quasar.cache.keys import file_key
from quasar.engine import w8a8_verifier
from quasar.errors import QuasarError
from quasar.fileio import atomic_dir
from quasar.models.config import ModelConfig
from quasar.models.gguf import int4_group_readers, q6k_readers
from quasar.models.hf import build_model, load_hf_dir
from quasar.models.llama import Transformer
from quasar.models.loader import gguf_file
from quasar.models.tensors import SafetensorsSource
from quasar.quant import quantize
from quasar.quant.checkpoint import ShardWriter
from quasar.quant.options import QuantOptions
from quasar.quant.sequential import float_layer
from quasar.quant.w4a8_checkpoint import EXACT_HEAD, REFINED_HEAD, w4a8_config_of
from quasar.quant.w4a8_checkpoint import FORMAT_VERSION as W4A8_FORMAT_VERSION
from quasar.quant.w4a8_layouts import FAITHFUL, SMALL, check_layout
from quasar.runtime.exact_head import ExactTopHead
from quasar.runtime.q6k_linear import Q6KLinear
from quasar.runtime.refined_head import DEFAULT_TOP_K, RefinedHead
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w4a8_numerics import W4A8_GROUP as GROUP  # the verifier's group size
from quasar.runtime.w4a8_numerics import fit_weight_w4_affine

# What build_w4a8 makes of a GGUF, per layout, named in the cache key: change it when a recipe
# changes, so old cache entries are not taken for the new verifier.
RECIPES = {
    FAITHFUL: "gguf-int4-groups, Q6_K tensors and head as stored, other wider tensors int8 with 15-bit "
              "activations, int8 head (15-bit) unless Q6_K, head top-k exact in float64, Q4_K's own params else "
              "float16 group params, v7",
    SMALL: "gguf-int4-groups, wider layer tensors fitted to int4 groups, 4-bit head refined by int8, Q4_K's own "
           "params else float16 group params, v5",
}
HEAD_TOP_K = DEFAULT_TOP_K
WIDE_ACT_BITS = 15  # activations of the faithful layout's int8 layers (per token: 15 bits for 8-bit blocks)
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


def gguf_source(loaded) -> Path | None:
    """The GGUF file `loaded` (a LoadedModel) was converted from, or None (a directory)."""
    return gguf_file(loaded.source)


def groups_source(loaded, layout: str = FAITHFUL) -> Path | None:
    """The GGUF file whose own 4-bit groups `loaded`'s W4A8 model takes, or None: a float
    directory, or in the faithful layout a GGUF with no 4-bit tensor (F16, BF16, Q8_0), which is
    a float model to calibrate and GPTQ-round (its every tensor is wider than 4 bits)."""
    gguf = gguf_source(loaded)
    if gguf is None or check_layout(layout) == SMALL:
        return gguf
    return gguf if loaded.stores_int4 else None


def gguf_int4_groups(path: Path, cfg) -> dict[str, Callable[[], tuple]]:
    """{HF weight name: a function giving (q uint8 [out, in], scale, offset float32
    [out, in / 32])} for every 4-bit matrix of GGUF file `path`, rows in Hugging Face order
    (quasar.models.gguf.int4_group_readers: experts one matrix each, fused tensors split by
    rows; `cfg` is the model's ModelConfig). Each is unpacked only when asked for, so a build
    holds one at a time."""
    return int4_group_readers(path, cfg)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def cache_path(loaded, layout: str = FAITHFUL) -> Path:
    """The cache entry of `loaded`'s W4A8 verifier in `layout`, keyed like W8A8's (the model
    directory's identity, quasar.engine.w8a8_verifier.cache_key) and by the GGUF file its 4-bit groups
    are read from, the layout's recipe and the W4A8 format."""
    # Not groups_source: the GGUF's content (in the key) decides which way it is built.
    gguf = gguf_source(loaded)
    key: dict = {"gguf": file_key(gguf) if gguf is not None else None, "w4a8_format": W4A8_FORMAT_VERSION}
    if gguf is not None:
        key["recipe"] = RECIPES[check_layout(layout)]
    if gguf is None or layout == FAITHFUL:  # calibrated (a float model): the pipeline's options count too
        key["options"] = float_source_options(layout).cache_key(None)
    return w8a8_verifier.cache_path(Path(loaded.model_dir), torch.float32, key, kind="w4a8")


def w4a8_verifier(loaded, *, cache: bool = True, layout: str = FAITHFUL) -> Transformer:
    """The W4A8 Transformer of `loaded` (a LoadedModel of a float directory or GGUF file, or
    a W4A8 checkpoint, given as it is) in `layout` (quasar.quant.w4a8_layouts): loaded from the
    cache when built before, else written there part by part (``write_w4a8_checkpoint``) and
    loaded from it, memory-mapped. Without a cache, or when it cannot be written (a read-only
    or full disk only warns), built in memory (``build_w4a8``)."""
    if loaded.quantized:
        if loaded.quant_kind != "w4a8":
            raise QuasarError(f"{loaded.source} is a W8A8 checkpoint; the w4a8 verifier needs the float model "
                              "(its directory or GGUF file) or a W4A8 checkpoint", param="verifier")
        return loaded.model
    if cache:
        target = cache_path(loaded, layout)
        model = lookup(target, lambda entry: load_hf_dir(entry, torch.float32), "W4A8")
        if model is not None:
            return model
        try:
            write_w4a8_checkpoint(loaded, target, {"source": str(loaded.source)}, exist_ok=True, layout=layout)
            return load_hf_dir(target, torch.float32)
        except OSError as e:  # a read-only or full cache must not stop decoding
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"warning: could not cache the W4A8 model ({why}); building it in memory", file=sys.stderr)
    return build_w4a8(loaded, layout)


def float_source_options(layout: str = FAITHFUL):
    """How a float directory becomes the W4A8 verifier: the sequential pipeline's defaults
    (rotation, GPTQ, the built-in calibration text) with 4-bit layers; in the faithful layout
    the tensors llama.cpp's Q4_K_M keeps wider stay int8 (quasar.quant.w4a8_layouts)."""
    return QuantOptions(weight_bits=4, w4_layout=check_layout(layout))


def write_w4a8_checkpoint(loaded, out: Path, info: dict, *, exist_ok: bool = False, progress: bool = False,
                          options=None, calib_text: str | None = None, layout: str = FAITHFUL) -> dict:
    """Write the W4A8 checkpoint of `loaded` (a float directory or GGUF file) to `out`
    (quasar.quant.w4a8_checkpoint), one shard per part as it is made, so memory holds one
    float layer (or the embeddings) at a time; `out` appears only once complete. Returns its
    config.json. A GGUF source's config records `info` (e.g. the source); a float directory is
    calibrated instead (`options`, default ``float_source_options()``; `calib_text` replaces
    the built-in corpus), and its config records those options, as a W8A8 checkpoint does."""
    if groups_source(loaded, layout) is None:
        return quantize.quantize_to_dir(loaded.weights_dir(), loaded.tokenizer, out,
                                        options=options or float_source_options(layout), calib_text=calib_text,
                                        progress=progress, exist_ok=exist_ok)
    written: dict = {}

    def fill(tmp: Path) -> None:
        writer = ShardWriter(tmp, loaded.config.num_layers + 2)  # embeddings, each layer, norm + head
        written.update(_w4a8_parts(loaded, writer.add, info, progress, layout))
        writer.finish(written, Path(loaded.model_dir))

    atomic_dir(Path(out), fill, exist_ok)
    return written


def build_w4a8(loaded, layout: str = FAITHFUL) -> Transformer:
    """The W4A8 Transformer of `loaded` (a float directory or GGUF file), built in memory
    (RECIPES[layout]; ``write_w4a8_checkpoint`` streams the same tensors to disk)."""
    if groups_source(loaded, layout) is None:
        return quantize.build_w8a8(SafetensorsSource(loaded.weights_dir()), loaded.tokenizer, cfg=loaded.config,
                                   options=float_source_options(layout), progress=False)
    tensors: dict[str, torch.Tensor] = {}
    config = _w4a8_parts(loaded, tensors.update, {"source": str(loaded.source)}, layout=layout)
    return build_model(ModelConfig.from_hf(config), tensors, "w4a8", torch.float32, config["quantization_config"])


def _w4a8_parts(loaded, sink: Callable[[dict], None], info: dict, progress: bool = False,
                layout: str = FAITHFUL) -> dict:
    """Make the W4A8 model of a GGUF source's 4-bit groups in `layout`, its tensors (Hugging
    Face names) part by part into `sink`: the embeddings, each decoder layer (read from the
    memory-mapped float weights, its linears replaced as RECIPES[layout] says), the final norm
    with the head. Returns the config.json."""
    cfg, faithful = loaded.config, check_layout(layout) == FAITHFUL
    source = SafetensorsSource(loaded.weights_dir())
    groups = gguf_int4_groups(gguf_source(loaded), cfg)
    six = q6k_readers(gguf_source(loaded), cfg) if faithful else {}  # streamed as stored
    sink({"model.embed_tokens.weight": source.get("model.embed_tokens.weight").float()})
    wide = False  # whether any layer tensor stays int8 (the config records their activations)
    with torch.no_grad():  # not inference_mode: the tensors become a model's parameters
        for i in tqdm(range(cfg.num_layers), desc="W4A8 layers", unit="layer", file=sys.stderr,
                      disable=not progress, leave=False):
            layer = float_layer(source, cfg, i)
            for name in _linear_names(layer):
                key = f"model.layers.{i}.{name}.weight"
                found, blocks = groups.pop(key, None), six.pop(key, None)
                new = _layer_linear(layer.get_submodule(name), found, faithful, blocks)
                _set(layer, name, new)
                wide = wide or isinstance(new, Int8Linear)
            sink({f"model.layers.{i}.{n}": t for n, t in layer.state_dict().items()})
            del layer
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in source
        # the stored (memory-mapped) weight as it is: the quantizers widen it a block at a time
        weight = source.get("model.embed_tokens.weight" if tied else "lm_head.weight")
        top_k = min(HEAD_TOP_K, weight.shape[0])  # a vocabulary smaller than that: every logit exact
        blocks = six.get("model.embed_tokens.weight" if tied else "lm_head.weight")
        if faithful and blocks is not None and weight.shape[1] % 256 == 0:  # the file's Q6_K head as it is
            head: nn.Module = ExactTopHead.from_q6k(blocks(), weight, top_k, tied=tied)
        elif faithful:  # a tied head reads its exact rows from the embedding table, stored once
            head = ExactTopHead.from_float(weight, top_k, tied=tied)
        else:  # untied: the embedding stays float
            head = RefinedHead.from_float(weight, top_k, GROUP)
        sink({"model.norm.weight": source.get("model.norm.weight").float(),
              **{f"lm_head.{n}": t for n, t in head.state_dict().items()}})
    if faithful:
        bits = WIDE_ACT_BITS if wide else 8
        return w4a8_config_of(cfg, GROUP, bits, EXACT_HEAD, info, head_top_k=top_k, int8_act_bits=bits,
                              head_tied=tied)
    return w4a8_config_of(cfg, GROUP, 8, REFINED_HEAD, info, head_top_k=top_k)


def _linear_names(layer: nn.Module) -> list[str]:
    """The decoder layer's linears: LAYER_LINEARS, or a sparse MLP's experts' (the router is no
    ``nn.Linear`` and stays float)."""
    return [name for name, m in layer.named_modules() if isinstance(m, nn.Linear)]


def _layer_linear(linear: nn.Linear, groups: Callable[[], tuple] | None, faithful: bool,
                  q6k: Callable[[], tuple] | None = None) -> nn.Module:
    """A decoder linear of the W4A8 model: the file's own 4-bit groups where it has them; a
    tensor the file keeps wider stays at its precision (faithful: a Q6_K matrix as its blocks,
    any other int8) or is fitted to 4-bit groups (small)."""
    if groups is not None:
        q, scale, offset, q4k = groups()
        if q4k is not None:  # a Q4_K matrix streams its own two-level parameters
            return W4A8Linear.from_q4k(q, *q4k, linear.bias)
    elif faithful and q6k is not None and linear.in_features % 256 == 0:
        return Q6KLinear.from_blocks(*q6k(), linear.bias)
    elif faithful:
        return Int8Linear.from_float(linear, act_bits=WIDE_ACT_BITS)
    else:
        q, scale, offset = fit_weight_w4_affine(linear.weight, GROUP)
    return W4A8Linear.from_groups(q, scale, offset, GROUP, linear.bias)
