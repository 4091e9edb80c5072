"""`quasar bench` (its flags: quasar.cli.bench): the engine protocol in this process, or the
serving protocol against servers it starts."""

from __future__ import annotations

import shlex
import sys

from quasar.bench import report, serving_report
from quasar.bench.runner import BenchConfig, run_bench
from quasar.bench.serving import ServingConfig, run_serving
from quasar.data.user_files import load_prompt_file
from quasar.errors import QuasarError


def _command() -> str:
    """The command line as typed, for the report (empty when not run as `quasar bench`)."""
    return "quasar " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] else ""


def _run_serving(args) -> int:
    if not args.bandwidth_gb > 0:
        raise QuasarError(f"--bandwidth-gb must be positive, got {args.bandwidth_gb}")
    cfg = ServingConfig(
        model=args.model, gguf=args.gguf, threads=args.threads, tasks=args.tasks, prompts_file=args.prompts,
        n=args.n, max_tokens=args.max_new_tokens, concurrency=tuple(args.concurrency), servers=tuple(args.servers),
        rounds=args.rounds,
        llama_server=args.llama_server, quasar_args=tuple(shlex.split(args.quasar_serve_args)),
        warmup=args.warmup, bandwidth_bytes=int(args.bandwidth_gb * 2**30), out=args.out, command=_command(),
    )
    results = run_serving(cfg)
    paths = serving_report.write_serving(results, args.out)
    print(serving_report.to_json(results) if args.json else serving_report.render_markdown(results)
          + f"\nWrote {paths['markdown']} and {paths['json']}")
    return 0


def run_bench_command(args) -> int:
    if args.protocol == "serving":
        return _run_serving(args)
    if not args.bandwidth_gb > 0:
        raise QuasarError(f"--bandwidth-gb must be positive, got {args.bandwidth_gb}")
    cfg = BenchConfig(
        model=args.model, dtype=args.dtype, threads=args.threads, tasks=args.tasks, prompts_file=args.prompts,
        n=args.n, max_new_tokens=args.max_new_tokens, modes=args.modes, peers=args.peers, repeats=args.repeats,
        warmup=args.warmup, num_draft=args.num_draft, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        draft_budget=args.draft_budget, gguf=args.gguf, fidelity_tokens=args.fidelity_tokens,
        bandwidth_bytes=int(args.bandwidth_gb * 2**30), progress=args.progress, command=_command(),
    )
    if args.prompts:  # fail on a bad file before loading anything heavy
        load_prompt_file(args.prompts)
    results = run_bench(cfg)
    paths = report.write_outputs(results, args.out)
    if args.json:
        print(report.to_json(results))
    else:
        print(report.summary_text(results, paths))
    return 0
