"""`quasar quantize` and `quasar export` (their flags: quasar.cli.quantize).

Every check on the arguments (output directory, calibration file, options) happens
before the model is loaded, and the output directory appears only once complete.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from quasar.cli.options import quant_options
from quasar.data.user_files import read_text_file
from quasar.engine.w4a8_verifier import GROUP, write_w4a8_checkpoint
from quasar.engine.w8a8_verifier import w8a8_verifier
from quasar.errors import QuasarError
from quasar.models.loader import gguf_file, load_model
from quasar.quant.checkpoint import export_compressed_tensors
from quasar.quant.quantize import quantize_to_dir
from quasar.resources import peak_rss_gb

# The calibration flags: a 4-bit GGUF's own groups read none of them (given with --bits 4
# they are an error); a float model's W4A8 recipe reads all but _NOT_W4 (its 4-bit layers
# are not smoothed, and quantize their activations per group).
_CALIBRATION_FLAGS = ("alpha", "calib", "samples", "seq_len", "rotate", "gptq", "down_act_bits", "lm_head")
_NOT_W4 = ("alpha", "down_act_bits")


def _check_out(out: str) -> Path:
    path = Path(out)
    if path.exists():
        raise QuasarError(f"{path} already exists; choose a new output directory")
    return path


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6


def run_quantize(args) -> int:
    out = _check_out(args.out)
    if args.bits == 4:
        return _run_quantize_w4(args, out)
    opts = quant_options(args)
    calib_text = None
    if opts.calib is not None:
        calib_text = read_text_file(opts.calib)  # missing / empty / not UTF-8: clear errors
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype)  # config and tokenizer only: weights stream from disk
    if loaded.quantized:
        raise QuasarError(f"{args.model} is already a W8A8 checkpoint")
    config = quantize_to_dir(loaded.model_dir, loaded.tokenizer, out, calib_text=calib_text, options=opts,
                             progress=not args.no_progress)
    info = config["quantization_config"]["quasar"]
    print(f"wrote {out}: W8A8, alpha={info['alpha']}, lm_head={info['lm_head']}, "
          f"smooth_o_down={info['smooth_o_down']}, rotate={info['rotate']}, gptq={info['gptq']}, "
          f"down_act_bits={info['down_act_bits']}, "
          f"{_size_mb(out):.0f} MB, "
          f"{time.perf_counter() - t0:.0f} s, peak RSS {peak_rss_gb():.2f} GB", file=sys.stderr)
    return 0


def _run_quantize_w4(args, out: Path) -> int:
    gguf = gguf_file(args.model) is not None
    flags = _CALIBRATION_FLAGS if gguf else _NOT_W4
    given = [f"--{k.replace('_', '-')}" for k in flags if getattr(args, k, None) is not None]
    given += ["--no-smooth-o-down"] if args.no_smooth_o_down else []
    if given:
        why = "a 4-bit GGUF keeps its own groups, nothing is calibrated" if gguf else \
            "4-bit layers are not smoothed and quantize their activations per group"
        raise QuasarError(f"{', '.join(given)} do not apply to --bits 4 ({why})")
    options = calib_text = None
    if not gguf:
        options = dataclasses.replace(quant_options(args), weight_bits=4)
        if options.calib is not None:
            calib_text = read_text_file(options.calib)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype)
    if loaded.quantized:
        raise QuasarError(f"{args.model} is already a {loaded.quant_kind.upper()} checkpoint")
    if not args.no_progress:
        how = "its GGUF's 4-bit groups" if gguf else "calibrated, rotated, GPTQ-rounded" if options.gptq else \
            "calibrated, rounded to nearest"
        print(f"writing the W4A8 model layer by layer ({how})...", file=sys.stderr)
    write_w4a8_checkpoint(loaded, out, {"source": str(args.model)}, progress=not args.no_progress,
                          options=options, calib_text=calib_text)
    weights = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    four, eight = (sum(n.endswith(suffix) for n in weights) for suffix in (".qweight", ".weight_scale"))
    print(f"wrote {out}: W4A8, group {GROUP}, {four} layers 4-bit, {eight} int8 (the head included), "
          f"{_size_mb(out):.0f} MB, {time.perf_counter() - t0:.0f} s, peak RSS {peak_rss_gb():.2f} GB", file=sys.stderr)
    return 0


def run_export(args) -> int:
    out = _check_out(args.out)
    # a W8A8 checkpoint is exported as it is (an int8 lm_head dequantized)
    opts = quant_options(args, lm_head="float")
    if opts.calib is not None:
        read_text_file(opts.calib)  # fail early on a bad file
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.dtype)
    model = w8a8_verifier(loaded, opts, progress=not args.no_progress)
    export_compressed_tensors(model, out, loaded.model_dir)
    print(f"wrote {out} (compressed-tensors int-quantized, lm_head float, {_size_mb(out):.0f} MB)\n"
          f"serve it: vllm serve {out} --speculative-config "
          "'{\"method\":\"ngram\",\"num_speculative_tokens\":5,\"prompt_lookup_min\":1,\"prompt_lookup_max\":3}'",
          file=sys.stderr)
    return 0
