"""`quasar bench`: argparse only at import time; the command runs in quasar.cli.bench_run,
imported when it runs."""

from __future__ import annotations

import argparse

from quasar.cli.args import add_draft_args, add_model_args
from quasar.defaults import DEFAULT_FIDELITY_TOKENS

DEFAULT_MODE_NAMES = ("ar-fp", "ar-w8a8", "ngram-fp", "quasar", "quasar-tree", "ngram-pruned")
# The W4A8 verifier's modes (issue #34) run only when asked for: a second quantized verifier
# in the process costs its build, its memory and a fidelity pass.
MODE_NAMES = (*DEFAULT_MODE_NAMES, "ar-w4a8", "quasar-w4a8", "quasar-w4a8-tree", "ar-w4a8-small", "quasar-w4a8-small",
              "quasar-w4a8-small-tree")
PEER_NAMES = ("hf", "hf-pld", "llamacpp", "llamacpp-pld", "llamacpp-q8", "llamacpp-pld-q8",
              "openvino", "openvino-pld")
TASK_NAMES = ("code", "summarization", "qa", "math", "chat")
PROTOCOLS = ("engines", "serving")
SERVER_NAMES = ("quasar", "llama-server", "llama-server-spec-default", "llama-server-ngram")


HELP = "benchmark Quasar's modes against peers (tokens/s, speedup, acceptance, bandwidth floor)"
DESCRIPTION = ("Same prompts, greedy, batch 1, warm-up, engines interleaved per prompt, median of repeats, "
              "threads fixed. Writes report.md, results.json and PNG plots to --out. With --protocol serving, "
              "times servers through the OpenAI API instead (serving.md, serving.json).")

def _names(value: str, choices: tuple[str, ...], what: str, allow_none: bool) -> list[str]:
    items = [v.strip() for v in value.replace(" ", ",").split(",") if v.strip()]
    if items == ["all"]:
        return list(choices)
    if items == ["none"] and allow_none:
        return []
    bad = [v for v in items if v not in choices]
    if bad or not items:
        extra = " (or all" + (", none)" if allow_none else ")")
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or repr(value)}; "
                                         f"choose from {', '.join(choices)}{extra}")
    return list(dict.fromkeys(items))


def register(sub) -> None:
    p = sub.add_parser("bench", help=HELP, description=DESCRIPTION)
    add_model_args(p)
    p.add_argument("--tasks", default=",".join(TASK_NAMES),
                   type=lambda v: _names(v, TASK_NAMES, "task", False),
                   help=f"comma-separated tasks from the shipped data: {','.join(TASK_NAMES)} (default: all)")
    p.add_argument("--prompts", metavar="FILE",
                   help="JSONL prompts (prompt | messages | turns, optional category = task) instead of --tasks")
    p.add_argument("--n", type=int, default=None,
                   help="prompts per task (default: 5 for shipped tasks, every line of --prompts)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODE_NAMES),
                   type=lambda v: _names(v, MODE_NAMES, "mode", False),
                   help=f"Quasar modes: {','.join(MODE_NAMES)} (default: all but the w4a8 ones; ar-fp is always "
                        "run as the baseline, except on a W8A8 checkpoint, which has no float weights)")
    p.add_argument("--peers", default=",".join(PEER_NAMES),
                   type=lambda v: _names(v, PEER_NAMES, "peer", True),
                   help=f"peers: {','.join(PEER_NAMES)}, all or none (default: all; unavailable ones are reported)")
    p.add_argument("--gguf", metavar="FILE",
                   help="GGUF file the llama.cpp peers decode: the same model as --model in llama.cpp's format "
                        "(default: --model itself when it is a GGUF file or the default model)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and engine; the median is kept")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up run of each engine")
    p.add_argument("--fidelity-tokens", type=int, default=DEFAULT_FIDELITY_TOKENS, metavar="N",
                   help="score each engine's model against the float model (top-1 agreement, KL) on the first N "
                        f"tokens of held-out text, once per model (default {DEFAULT_FIDELITY_TOKENS}; 0: skip)")
    add_draft_args(p)
    p.add_argument("--bandwidth-gb", type=float, default=2.0,
                   help="GiB read to measure memory bandwidth (keep it far above the L3 cache)")
    p.add_argument("--out", default="bench-results", help="folder for report.md, results.json, plots")
    p.add_argument("--json", action="store_true", help="print results JSON to stdout instead of the summary")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    _add_serving_args(p)
    p.set_defaults(handler="quasar.cli.bench_run:run_bench_command")


def _concurrency(value: str) -> list[int]:
    try:
        levels = [int(v) for v in value.replace(" ", ",").split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency wants integers >= 1 like 1,4; got {value!r}")
    return list(dict.fromkeys(levels))


def _add_serving_args(p) -> None:
    p.add_argument("--protocol", choices=PROTOCOLS, default="engines",
                   help="engines (default): Quasar's modes and the peers in this process, batch 1. serving: "
                        "the servers users run, each started by the bench on a loopback port and sent the same "
                        "prompts through the OpenAI API, streamed and greedy, at each --concurrency: quasar "
                        "serve with its defaults, llama-server plain, with --spec-default, and with the fastest "
                        "n-gram configuration of a short sweep (named). Reports decode and aggregate tokens/s and "
                        "time to first token in serving.md / serving.json; uses --model, --gguf, --threads, "
                        "--tasks/--prompts/--n, --max-new-tokens, --no-warmup, --bandwidth-gb, --out")
    p.add_argument("--concurrency", default="1,4", type=_concurrency,
                   help="serving: requests in flight at once, one phase per value (default 1,4)")
    p.add_argument("--servers", default=",".join(SERVER_NAMES),
                   type=lambda v: _names(v, SERVER_NAMES, "server", False),
                   help=f"serving: which servers, from {','.join(SERVER_NAMES)} (default: all)")
    p.add_argument("--rounds", type=int, default=1,
                   help="serving: phases per server and concurrency; the servers take turns in each round, in "
                        "reverse order every other round, and their requests are pooled (default 1)")
    p.add_argument("--llama-server", metavar="FILE", default=None,
                   help="serving: the llama-server binary (default: the one scripts/setup/install_llamacpp.sh puts "
                        "in the virtualenv's bin folder)")
    p.add_argument("--quasar-serve-args", default="", metavar="ARGS",
                   help="serving: extra options for quasar serve, e.g. \"--verifier w4a8\" (default: none)")

