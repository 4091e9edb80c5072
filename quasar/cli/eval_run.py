"""`quasar eval` (its flags: quasar.cli.eval): each task with the baseline and the verifier
under test, side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from quasar.api import LLM
from quasar.cli.eval import DEFAULT_OUT
from quasar.errors import QuasarError
from quasar.eval.runner import Runner, parse_verifiers, render_report
from quasar.eval.tasks import EvalConfig, parse_tasks


def run_eval(args) -> int:
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
    if args.text_file and not Path(args.text_file).is_file():
        raise QuasarError(f"--text-file {args.text_file}: file not found")
    cfg = EvalConfig(limit=args.limit, shots=args.shots, check_spec=args.check_spec,
                     max_new_tokens=args.max_new_tokens, text_file=args.text_file, window=args.window,
                     stride=args.stride, timeout_s=args.timeout, memory_mb=args.memory_mb)
    out = args.out if args.out is not None else (None if args.subtask else DEFAULT_OUT)
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
