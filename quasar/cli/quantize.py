"""`quasar quantize` and `quasar export`: write W8A8 (and W4A8) checkpoints.

    quasar quantize --model M --out DIR [--bits 8|4] [--alpha auto|FLOAT] [--calib FILE] [--samples N]
                    [--seq-len L] [--lm-head int8|float] [--no-smooth-o-down] [--no-rotate] [--no-gptq]
    quasar export --format compressed-tensors --model M --out DIR

Only argparse at import time: the commands run in quasar.cli.quantize_run, imported when
one runs.
"""

from __future__ import annotations

import argparse

from quasar.cli.args import add_model_args, positive_int


HELP = "write a W8A8 (int8 weights + int8 activations) or W4A8 checkpoint"
DESCRIPTION = ("Calibrate on text, fold SmoothQuant scales into the float weights, quantize every "
              "decoder linear to int8 and write a self-contained model directory that "
              "'--model DIR' loads without recalibrating. --bits 4 writes the W4A8 verifier instead.")

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
    p = sub.add_parser("quantize", help=HELP, description=DESCRIPTION)
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
    p.set_defaults(handler="quasar.cli.quantize_run:run_quantize")

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
    e.set_defaults(handler="quasar.cli.quantize_run:run_export")

