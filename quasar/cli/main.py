"""`quasar` command line: the parser, and the dispatch to the command that runs.

Each area registers its subcommands from a light module (argparse only at import time) and
names each handler "module:function"; the handler's module, which imports torch and the
engine at its top, is imported only when its command runs, so `quasar --help` stays fast.
A QuasarError becomes one line on stderr and exit status 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from quasar import __version__
from quasar.cli import bench as bench_commands
from quasar.cli import cache as cache_commands
from quasar.cli import eval as eval_commands
from quasar.cli import quantize as quant_commands
from quasar.cli import serve as server_commands
from quasar.cli.args import add_decoding_args, add_model_args
from quasar.errors import QuasarError

# each defines `register(subparsers)` for its subcommands
COMMAND_MODULES = (quant_commands, bench_commands, eval_commands, server_commands, cache_commands)


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
    p.set_defaults(handler="quasar.cli.generate_run:run_generate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quasar", description="Faster LLM decoding: n-gram drafts + INT8 verifier")
    parser.add_argument("--version", action="version", version=f"quasar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def load_handler(spec: str):
    """The function a command's "module:function" names, its module imported now."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return load_handler(args.handler)(args) or 0
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
