"""`quasar quantize` and `quasar export`: write W8A8 (and W4A8) checkpoints.

    quasar quantize --model M --out DIR [--bits 8|4] [--alpha auto|FLOAT] [--calib FILE] [--samples N]
                    [--seq-len L] [--lm-head int8|float] [--no-smooth-o-down] [--no-rotate] [--no-gptq]
    quasar export --format compressed-tensors --model M --out DIR

Only argparse at import time; torch and the quantizer are imported when a command runs.
Every check on the arguments (output directory, calibration file, options) happens
before the model is loaded, and the output directory appears only once complete.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from quasar.cli.args import positive_int


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--alpha", default=None,
                   help="smoothing strength: 'auto' (searched per layer group) or a number in [0, 1] "
                        "(default: auto)")
    p.add_argument("--calib", default=None,
                   help="calibration text (.txt, or .jsonl with 'text'); default: the built-in corpus "
                        "(exllamav2 standard_cal_data, calibration part)")
    p.add_argument("--samples", type=positive_int, default=None, help="calibration samples (default 16)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per calibration sample (default 512)")
    p.add_argument("--no-smooth-o-down", action="store_true",
                   help="do not smooth v->o_proj and up->down_proj (only the norm-fed groups)")
    p.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=None,
                   help="fold orthogonal rotations into the residual stream and the value heads before "
                        "smoothing (exact in float; spreads outlier channels) (default: on)")
    p.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                   help="round int8 weights with GPTQ error feedback instead of to nearest "
                        "(same format; needs a little more calibration time) (default: on)")
    p.add_argument("--down-act-bits", type=int, choices=[8, 15], default=None,
                   help="activation bits of the MLP down projections: 15 keeps them much closer to the "
                        "float model at the same bytes per step (two int8 GEMMs over one weight read); "
                        "8 is plain W8A8 everywhere (default: 15)")


def register(sub) -> None:
    from quasar.cli.args import add_model_args

    p = sub.add_parser(
        "quantize", help="write a W8A8 (int8 weights + int8 activations) or W4A8 checkpoint",
        description="Calibrate on text, fold SmoothQuant scales into the float weights, quantize every "
                    "decoder linear to int8 and write a self-contained model directory that "
                    "'--model DIR' loads without recalibrating. --bits 4 writes the W4A8 verifier instead.")
    add_model_args(p)
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--bits", type=int, choices=[8, 4], default=8,
                   help="weight bits: 8 = W8A8 (calibrated, smoothed; the default), 4 = W4A8: a 4-bit GGUF "
                        "keeps its own groups (other layers and the head int8; nothing calibrated, so the "
                        "options below do not apply); a float model is calibrated, rotated and GPTQ-rounded to "
                        "int4 groups of 32, layer by layer (--alpha and --down-act-bits do not apply)")
    _add_quant_args(p)
    p.add_argument("--lm-head", choices=["int8", "float"], default=None,
                   help="quantize lm_head too (int8) or keep it float (default: int8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_quantize)

    e = sub.add_parser(
        "export", help="export a W8A8 checkpoint for vLLM / transformers (compressed-tensors)",
        description="Write the compressed-tensors 'int-quantized' layout (lm_head float, listed in "
                    "'ignore'). --model may be a W8A8 checkpoint or a float model (quantized first, "
                    "with the quantization options below, using the W8A8 cache).")
    add_model_args(e)
    e.add_argument("--format", required=True, choices=["compressed-tensors"], help="export format")
    e.add_argument("--out", required=True, help="output directory (must not exist)")
    _add_quant_args(e)
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=run_export)


def _quant_options(args, lm_head: str | None = None):
    """The QuantOptions of the flags (the library defaults where a flag is not given), checked."""
    from quasar.quant.options import QuantOptions

    given = {"alpha": args.alpha, "samples": args.samples, "seq_len": args.seq_len, "rotate": args.rotate,
             "gptq": args.gptq, "down_act_bits": args.down_act_bits, "calib": args.calib,
             "lm_head": lm_head or getattr(args, "lm_head", None),
             "smooth_o_down": False if args.no_smooth_o_down else None}
    return QuantOptions(**{k: v for k, v in given.items() if v is not None})


def _check_out(out: str) -> Path:
    from quasar.errors import QuasarError

    path = Path(out)
    if path.exists():
        raise QuasarError(f"{path} already exists; choose a new output directory")
    return path


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6


# The calibration flags: a 4-bit GGUF's own groups read none of them (given with --bits 4
# they are an error); a float model's W4A8 recipe reads all but _NOT_W4 (its 4-bit layers
# are not smoothed, and quantize their activations per group).
_CALIBRATION_FLAGS = ("alpha", "calib", "samples", "seq_len", "rotate", "gptq", "down_act_bits", "lm_head")
_NOT_W4 = ("alpha", "down_act_bits")


def run_quantize(args) -> int:
    from quasar.errors import QuasarError

    out = _check_out(args.out)
    if args.bits == 4:
        return _run_quantize_w4(args, out)
    opts = _quant_options(args)
    calib_text = None
    if opts.calib is not None:
        from quasar.data.user_files import read_text_file

        calib_text = read_text_file(opts.calib)  # missing / empty / not UTF-8: clear errors
    import torch

    from quasar.models.loader import load_model
    from quasar.quant.quantize import quantize_to_dir
    from quasar.resources import peak_rss_gb

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
    import dataclasses

    from quasar.errors import QuasarError
    from quasar.models.loader import gguf_file
    from quasar.engine.w4a8_verifier import GROUP, write_w4a8_checkpoint

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
        options = dataclasses.replace(_quant_options(args), weight_bits=4)
        if options.calib is not None:
            from quasar.data.user_files import read_text_file

            calib_text = read_text_file(options.calib)
    import torch

    from quasar.models.loader import load_model
    from quasar.resources import peak_rss_gb

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
    opts = _quant_options(args, lm_head="float")
    if opts.calib is not None:
        from quasar.data.user_files import read_text_file

        read_text_file(opts.calib)  # fail early on a bad file
    import torch

    from quasar.models.loader import load_model
    from quasar.quant.checkpoint import export_compressed_tensors
    from quasar.engine.w8a8_verifier import w8a8_verifier

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
