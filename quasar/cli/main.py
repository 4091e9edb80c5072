"""`quasar` command line: generate, and the subcommands other modules register.

Each area registers its own subcommand from a light `commands` module (argparse only at
import time), so `quasar --help` stays fast. A QuasarError becomes one line on stderr and
exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from quasar.cli import bench as bench_commands
from quasar.cli import cache as cache_commands
from quasar.cli.args import add_decoding_args, add_model_args
from quasar.errors import QuasarError
from quasar.fileio import read_text
from quasar.cli import eval as eval_commands
from quasar.cli import quantize as quant_commands
from quasar.cli import serve as server_commands

# each defines `register(subparsers)` for its subcommands
COMMAND_MODULES = (quant_commands, bench_commands, eval_commands, server_commands, cache_commands)

BUILTIN_PROMPT = ("Write a Python function `fizzbuzz(n)` that returns a list of strings for 1..n, "
                  "then explain it briefly.")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply (streamed to stdout)")
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default: a built-in code prompt)")
    src.add_argument("--prompt-file", help="read the prompt from a text file")
    p.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", nargs="+", default=[], help="stop strings")
    add_decoding_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run_generate)


def _read_prompt(args) -> str:
    if args.prompt_file:
        text = read_text(args.prompt_file)
        if not text.strip():
            raise QuasarError(f"{args.prompt_file}: prompt file is empty")
        return text
    return args.prompt if args.prompt is not None else BUILTIN_PROMPT


def _decode_options(args):
    """The decoding options of `quasar generate`'s flags, checked before any model work."""
    from quasar.cli.args import draft_options
    from quasar.speculative.options import DecodeOptions, SamplingOptions

    sampling = SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return DecodeOptions(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                         draft=draft_options(args))


def run_generate(args) -> int:
    from quasar.api import LLM
    from quasar.speculative.generate import Result

    prompt = _read_prompt(args)
    options = _decode_options(args)  # bad options fail here, before any one-time work
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quasar", description="Faster LLM decoding: n-gram drafts + INT8 verifier")
    from quasar import __version__

    parser.add_argument("--version", action="version", version=f"quasar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except QuasarError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
