"""`quasar eval`: does the quantized verifier keep the model's quality?

Only argparse at import time; the engine is imported when the command runs.

    quasar eval [--model M] [--tasks fidelity,perplexity,humaneval,mmlu,boolq,asdiv]
                [--limit N|all] [--shots N] [--verifiers fp,w8a8] [--check-spec]
                [--json] [--out DIR]
    quasar eval fidelity [--model M] [--text-file F] [--json]
"""

from __future__ import annotations

import json
import sys

from quasar.cli.args import positive_int

DEFAULT_OUT = "quasar-eval"
_TASKS = "fidelity,perplexity,humaneval,mmlu,boolq,asdiv"


def _limit(value: str) -> int:
    """A positive number of items, or 'all' (-1)."""
    return -1 if value.strip().lower() == "all" else positive_int(value)


def register(sub) -> None:
    from quasar.cli.args import add_model_args

    p = sub.add_parser(
        "eval", help="task quality of two verifiers side by side (float vs W8A8)",
        description="Run each task with the float model and the W8A8 verifier and report the difference. "
                    "Log-likelihood tasks (perplexity, mmlu, boolq) score the verifier's logits; generation "
                    "tasks (humaneval, asdiv) decode greedily in Quasar mode (n-gram drafter + the verifier).")
    p.add_argument("subtask", nargs="?", choices=["fidelity"],
                   help="'fidelity': only the fidelity of the float model against W8A8 (or, with "
                        "--verifiers fp,w4a8, W4A8): top-1 agreement, KL, perplexity")
    add_model_args(p)
    p.add_argument("--tasks", default=_TASKS, help=f"comma-separated tasks (default: {_TASKS})")
    p.add_argument("--verifiers", default="fp,w8a8",
                   help="baseline and verifier under test, e.g. fp,w8a8 or fp,pruned:0.5 (default fp,w8a8)")
    p.add_argument("--limit", type=_limit, default=None,
                   help="items per task (perplexity: windows per text); 'all' for everything "
                        "(default: all HumanEval, 500 MMLU, 500 BoolQ, 300 ASDiv, all held-out text)")
    p.add_argument("--shots", type=int, default=0, help="few-shot examples for mmlu/boolq (default 0)")
    p.add_argument("--check-spec", action="store_true",
                   help="also decode autoregressively and check the n-gram output is identical")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="generation limit (default: humaneval 384, asdiv 256)")
    p.add_argument("--text-file", help="text for perplexity/fidelity (.txt, or .jsonl with 'text'); "
                                       "default: the held-out part of the calibration corpus")
    p.add_argument("--window", type=positive_int, default=None,
                   help="perplexity window in tokens (default: min(context, 2048))")
    p.add_argument("--stride", type=positive_int, default=None, help="perplexity stride (default: window / 2)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HumanEval problem (default 10)")
    p.add_argument("--memory-mb", type=positive_int, default=1024, help="memory per HumanEval run (default 1024)")
    p.add_argument("--out", default=None,
                   help=f"folder for results.json, report.md, samples.jsonl (default ./{DEFAULT_OUT}; "
                        "'quasar eval fidelity' writes only when given)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_eval)


def run_eval(args) -> int:
    from quasar.errors import QuasarError
    from quasar.eval.runner import Runner, parse_verifiers, render_report
    from quasar.eval.tasks import EvalConfig, parse_tasks

    verifiers = parse_verifiers(args.verifiers)
    if args.subtask == "fidelity":
        tasks = ["fidelity"]
        if verifiers not in (["fp", "w8a8"], ["fp", "w4a8"]):
            raise QuasarError("'quasar eval fidelity' compares fp with w8a8 (the default) or w4a8 "
                              "(--verifiers fp,w4a8)")
    else:
        tasks = parse_tasks(args.tasks)
    if not 0 <= args.shots <= 16:
        raise QuasarError(f"--shots must be between 0 and 16, got {args.shots}")
    if args.timeout <= 0:
        raise QuasarError(f"--timeout must be > 0, got {args.timeout}")
    if args.text_file:
        from pathlib import Path

        if not Path(args.text_file).is_file():
            raise QuasarError(f"--text-file {args.text_file}: file not found")
    cfg = EvalConfig(limit=args.limit, shots=args.shots, check_spec=args.check_spec,
                     max_new_tokens=args.max_new_tokens, text_file=args.text_file, window=args.window,
                     stride=args.stride, timeout_s=args.timeout, memory_mb=args.memory_mb)
    out = args.out if args.out is not None else (None if args.subtask else DEFAULT_OUT)

    from quasar.api import LLM

    llm = LLM(args.model, dtype=args.dtype, threads=args.threads)
    runner = Runner(llm, tasks, verifiers, cfg, out, progress=False if args.no_progress else None,
                    model_name=args.model)
    results = runner.run()
    if args.subtask == "fidelity":
        entry = results["tasks"]["fidelity"]
        if entry["status"] != "ok":
            raise QuasarError(f"fidelity: {entry.get('reason')}")
        raw = entry["details"]
        if args.json:
            print(json.dumps(raw, ensure_ascii=False))
        else:
            for key, value in raw.items():
                if isinstance(value, (int, float, str)):
                    print(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")
        return 0
    if args.json:
        print(json.dumps(results, ensure_ascii=False))
    else:
        print(render_report(results))
    if out:
        print(f"wrote {out}/results.json, {out}/report.md, {out}/samples.jsonl", file=sys.stderr)
    return 0
