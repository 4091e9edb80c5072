"""argparse pieces shared by the `quasar` subcommands (only argparse at import time).

`quasar.cli.main` builds the parser from them and each command's registering module;
keeping them here means no such module imports the main module that imports it. The
option objects the flags become are built by quasar.cli.options, when a command runs.
"""

from __future__ import annotations

import argparse

from quasar.defaults import (DEFAULT_4BIT_VERIFIER, DEFAULT_ADAPTIVE, DEFAULT_DRAFT_BUDGET, DEFAULT_DRAFTER,
                             DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_NUM_DRAFT, DEFAULT_VERIFIER)


def positive_int(value: str) -> int:
    """argparse type for counts that must be at least 1."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M, Q4_K_M), "
                        "a .gguf file, or a model directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="float dtype of the float model (default auto: as stored, bf16 stays bf16; "
                        "the W8A8 verifier's float parts are always fp32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """k, the tree budget and the n-gram lengths (the paper's k = 5, n in [1, 3] by default)."""
    p.add_argument("--num-draft", type=int, default=DEFAULT_NUM_DRAFT,
                   help=f"draft tokens per step (k, default {DEFAULT_NUM_DRAFT})")
    p.add_argument("--ngram-min", type=int, default=DEFAULT_NGRAM_MIN,
                   help=f"shortest n-gram to match (default {DEFAULT_NGRAM_MIN})")
    p.add_argument("--ngram-max", type=int, default=DEFAULT_NGRAM_MAX,
                   help=f"longest n-gram to match (default {DEFAULT_NGRAM_MAX})")
    p.add_argument("--draft-budget", type=int, default=DEFAULT_DRAFT_BUDGET,
                   help=f"draft tree nodes per step of --drafter tree (default {DEFAULT_DRAFT_BUDGET})")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """Drafter, verifier and draft options of generate and serve."""
    p.add_argument("--drafter", default=DEFAULT_DRAFTER,
                   help=f"auto | none | ngram | tree (default {DEFAULT_DRAFTER}: tree drafts where the quantized "
                        "verifier's extra rows are cheap, on CPUs with AMX tiles, else ngram)")
    p.add_argument("--verifier", default=None,
                   help=f"fp | w8a8 | w4a8 | w4a8-small | pruned:F (default: {DEFAULT_VERIFIER}; a GGUF file with "
                        f"4-bit tensors: {DEFAULT_4BIT_VERIFIER}; a quantized checkpoint: its own)")
    add_draft_args(p)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=DEFAULT_ADAPTIVE,
                   help="choose the draft length per step (up to k + 3) from recent acceptance")

