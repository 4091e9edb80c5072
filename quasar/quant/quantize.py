"""Float model -> W8A8 model: the entry points of the sequential pipeline.

``quantize_to_dir`` reads a model directory tensor by tensor and writes a sharded W8A8
checkpoint as it goes (``quasar quantize``, the verifier cache): the float model is never
loaded. ``build_w8a8`` does the same for a model already in memory and returns the W8A8
Transformer (tests, small models); the float model is left untouched. Both run
``quasar.quant.sequential.quantize_layers``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn

from quasar.errors import QuasarError
from quasar.fileio import atomic_dir
from quasar.models.config import ModelConfig
from quasar.models.hf import build_model, read_config
from quasar.models.llama import Transformer
from quasar.models.tensors import SafetensorsSource, StateDictSource, TensorSource
from quasar.quant.calibrate import builtin_calibration_text, token_windows
from quasar.quant.checkpoint import ShardWriter, checkpoint_config
from quasar.runtime.w8a8 import Int8Linear
from quasar.quant.options import QuantOptions
from quasar.quant.sequential import WIDE_ACT_BITS, quantize_layers
from quasar.quant.smooth import rotation_folds
from quasar.quant.w4a8_checkpoint import w4a8_config_of
from quasar.quant.w4a8_layouts import FAITHFUL
from quasar.runtime.w4a8_numerics import W4A8_GROUP


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def _windows(tokenizer, cfg: ModelConfig, opts: QuantOptions, calib_text: str | None) -> list[list[int]]:
    texts = calib_text if calib_text is not None else builtin_calibration_text()
    return token_windows(tokenizer, texts, opts.samples, min(opts.seq_len, cfg.max_position_embeddings))


def _output_config(cfg: ModelConfig, opts: QuantOptions, info: dict) -> dict:
    untied = cfg.tie_word_embeddings and (opts.rotate or opts.int8_head)
    out_cfg = dataclasses.replace(cfg, tie_word_embeddings=cfg.tie_word_embeddings and not untied)
    if opts.weight_bits == 4:
        bits = WIDE_ACT_BITS if opts.w4_layout == FAITHFUL else 8  # the int8 linears the layout keeps
        return w4a8_config_of(out_cfg, W4A8_GROUP, bits, opts.lm_head, {"quasar": info}, int8_act_bits=bits)
    return checkpoint_config(out_cfg, opts.int8_head, info)


def _calib_source(opts: QuantOptions, calib_text: str | None, calib_source: str | None) -> str:
    return calib_source or opts.calib or ("file" if calib_text is not None else "builtin")


def quant_options(options: QuantOptions | None, fields: dict) -> QuantOptions:
    """`options`, or a QuantOptions of `fields` (keyword arguments of the Python entry points)."""
    if options is not None:
        if fields:
            raise QuasarError(f"pass either QuantOptions or its fields, not both (got {sorted(fields)[0]!r})")
        return options
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(QuantOptions)})
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(QuantOptions))
        raise QuasarError(f"unknown quantization option {unknown[0]!r}; known: {known}")
    return QuantOptions(**fields)


def for_model(opts: QuantOptions, cfg: ModelConfig) -> QuantOptions:
    """`opts` as they apply to `cfg`'s family: without the residual rotation where it does not
    fold (quasar.quant.smooth.rotation_folds); the checkpoint then records rotate false."""
    return opts if not opts.rotate or rotation_folds(cfg) else dataclasses.replace(opts, rotate=False)


def checkpoint_bytes(cfg: ModelConfig, opts: QuantOptions) -> int:
    """About the size of the checkpoint of a model with config ``cfg`` quantized as ``opts`` say
    (a little less: the norms, biases and tokenizer are left out), to check the free space first."""
    h, inter, heads, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads
    dim = cfg.head_dim
    linears = h * dim * (2 * heads + 2 * kv) + 3 * h * inter  # q, o; k, v; gate, up, down
    # a sparse layer's experts (and shared expert) instead of its dense MLP
    experts = 3 * h * (cfg.num_experts * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size - inter)
    per_weight = 0.5 + 4 / 32 if opts.weight_bits == 4 else 1.0  # 4-bit groups of 32: two float16s each
    head = cfg.vocab_size * h * (1 if opts.int8_head else 4)
    return int((cfg.num_layers * linears + len(cfg.moe_layers) * experts) * per_weight) + 4 * cfg.vocab_size * h + head


def quantize_source(source: TensorSource, cfg: ModelConfig, tokenizer, out: str | Path,
                    tokenizer_dir: Path | None = None, *, calib_text: str | None = None,
                    calib_source: str | None = None, progress: bool = True, exist_ok: bool = False,
                    announce: str | None = None, options: QuantOptions | None = None, **fields) -> dict:
    """Quantize ``source`` into a sharded W8A8 checkpoint directory ``out`` (made visible
    only when complete) as ``options`` say (or ``QuantOptions(**fields)``); returns its
    config.json. ``calib_text`` is the calibration text (None: the built-in corpus);
    ``announce`` is printed (stderr) when the work starts, not when another process did it."""
    opts = for_model(quant_options(options, fields), cfg)
    windows = _windows(tokenizer, cfg, opts, calib_text)
    written: dict = {}

    def fill(tmp: Path) -> None:
        if announce:
            print(announce, file=sys.stderr, flush=True)
        writer = ShardWriter(tmp, cfg.num_layers + 2)  # embeddings, each layer, norm + lm_head
        info = quantize_layers(source, cfg, windows, writer.add, opts, progress)
        info["calibration"]["source"] = _calib_source(opts, calib_text, calib_source)
        written.update(_output_config(cfg, opts, info))
        writer.finish(written, tokenizer_dir)

    atomic_dir(Path(out), fill, exist_ok, need_bytes=checkpoint_bytes(cfg, opts))
    return written


def quantize_to_dir(model_dir: str | Path, tokenizer, out: str | Path, **kwargs) -> dict:
    """``quantize_source`` over a Hugging Face directory, tokenizer files copied along."""
    model_dir = Path(model_dir)
    raw = read_config(model_dir)
    if raw.get("quantization_config") is not None:
        raise QuasarError(f"{model_dir} is already a quantized checkpoint")
    return quantize_source(SafetensorsSource(model_dir), ModelConfig.from_hf(raw), tokenizer, out, model_dir,
                           **kwargs)


def build_w8a8(model: Transformer | TensorSource, tokenizer, *, cfg: ModelConfig | None = None,
               calib_text: str | None = None, calib_source: str | None = None, progress: bool = True,
               dtype: torch.dtype | None = None, options: QuantOptions | None = None, **fields) -> Transformer:
    """The W8A8 Transformer of a float ``model`` in memory (or of a ``TensorSource`` with its
    ``cfg``), built in memory as ``options`` say (or ``QuantOptions(**fields)``); ``model``
    stays intact. ``calib_text`` (e.g. from ``quasar.data.read_text_file``) replaces the
    built-in calibration corpus."""
    if isinstance(model, Transformer):
        if is_quantized(model):
            raise QuasarError("model is already quantized")
        cfg, dtype, source = model.config, dtype or model.model.norm.weight.dtype, StateDictSource(model)
    else:
        source = model
    opts = for_model(quant_options(options, fields), cfg)
    tensors: dict[str, torch.Tensor] = {}
    info = quantize_layers(source, cfg, _windows(tokenizer, cfg, opts, calib_text), tensors.update, opts, progress)
    info["calibration"]["source"] = _calib_source(opts, calib_text, calib_source)
    config = _output_config(cfg, opts, info)
    qmodel = build_model(ModelConfig.from_hf(config), tensors, "w8a8", dtype or torch.float32,
                         config["quantization_config"])
    qmodel.quant_info = config["quantization_config"]["quasar"]
    return qmodel

