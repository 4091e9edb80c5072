"""`quasar generate`: decode one prompt, streamed to stdout (its flags: quasar.cli.main)."""

from __future__ import annotations

import json
import sys

from quasar.api import LLM
from quasar.cli.options import decode_options
from quasar.errors import QuasarError
from quasar.fileio import read_text
from quasar.speculative.generate import Result

BUILTIN_PROMPT = ("Write a Python function `fizzbuzz(n)` that returns a list of strings for 1..n, "
                  "then explain it briefly.")


def _read_prompt(args) -> str:
    if args.prompt_file:
        text = read_text(args.prompt_file)
        if not text.strip():
            raise QuasarError(f"{args.prompt_file}: prompt file is empty")
        return text
    return args.prompt if args.prompt is not None else BUILTIN_PROMPT


def run_generate(args) -> int:
    prompt = _read_prompt(args)
    options = decode_options(args)  # bad options fail here, before any one-time work
    llm = LLM(args.model, dtype=args.dtype, draft=options.draft, verifier=args.verifier, threads=args.threads)
    args.verifier = llm.verifier  # the default resolved (a quantized checkpoint's own kind)
    # One-time work (quantizing or loading the W8A8 copy, loading its kernels, measuring its
    # step) on its own line, so the decode rate below is decoding only.
    seconds = llm.prepare(args.verifier, progress=sys.stderr.isatty())
    if seconds is not None and args.verifier != "fp":
        print(f"building the {args.verifier.upper()} verifier (once, cached): {seconds:.1f} s", file=sys.stderr)
    plan = llm.plan(options)  # "auto" resolved on the verifier's measured step
    if args.json:
        print(json.dumps(llm.generate(prompt, raw=args.raw, plan=plan).as_dict(), ensure_ascii=False))
        return 0
    result = None
    for item in llm.stream(prompt, raw=args.raw, plan=plan):
        if isinstance(item, Result):
            result = item
        else:
            sys.stdout.write(item.text)
            sys.stdout.flush()
    s = result.stats
    print(file=sys.stdout)
    print(f"[{plan.drafter}+{args.verifier}] {s.new_tokens} tokens in {s.wall_s:.2f} s: "
          f"{s.tokens_per_s:.1f} tokens/s, {s.steps} verifier steps, "
          f"mean accepted {s.mean_accepted:.2f} ({result.finish_reason}; kernels: {llm.kernel_path(args.verifier)})",
          file=sys.stderr)
    return 0
