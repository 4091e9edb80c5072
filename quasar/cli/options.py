"""The library's option objects from parsed `quasar` flags, checked (a QuasarError names a
bad one). The command handlers import this; the argparse modules never do (it loads torch)."""

from __future__ import annotations

import argparse

from quasar.quant.options import QuantOptions
from quasar.speculative.options import DecodeOptions, DraftOptions, SamplingOptions


def draft_options(args: argparse.Namespace) -> DraftOptions:
    """The `DraftOptions` of add_decoding_args' flags."""
    return DraftOptions(drafter=args.drafter, num_draft=args.num_draft, ngram_min=args.ngram_min,
                        ngram_max=args.ngram_max, draft_budget=args.draft_budget, adaptive=args.adaptive)


def decode_options(args: argparse.Namespace) -> DecodeOptions:
    """The decoding options of `quasar generate`'s flags, checked before any model work."""
    sampling = SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return DecodeOptions(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                         draft=draft_options(args))


def quant_options(args: argparse.Namespace, lm_head: str | None = None) -> QuantOptions:
    """The QuantOptions of the flags (the library defaults where a flag is not given)."""
    given = {"alpha": args.alpha, "samples": args.samples, "seq_len": args.seq_len, "rotate": args.rotate,
             "gptq": args.gptq, "down_act_bits": args.down_act_bits, "calib": args.calib,
             "lm_head": lm_head or getattr(args, "lm_head", None),
             "smooth_o_down": False if args.no_smooth_o_down else None}
    return QuantOptions(**{k: v for k, v in given.items() if v is not None})
