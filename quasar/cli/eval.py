"""`quasar eval`: does the quantized verifier keep the model's quality?

Only argparse at import time; the command runs in quasar.cli.eval_run, imported when it runs.

    quasar eval [--model M] [--tasks fidelity,perplexity,humaneval,mmlu,boolq,asdiv]
                [--limit N|all] [--shots N] [--verifiers fp,w8a8] [--check-spec]
                [--json] [--out DIR]
    quasar eval fidelity [--model M] [--text-file F] [--json]
"""

from __future__ import annotations

from quasar.cli.args import add_model_args, positive_int

DEFAULT_OUT = "quasar-eval"
_TASKS = "fidelity,perplexity,humaneval,mmlu,boolq,asdiv"


HELP = "task quality of two verifiers side by side (float vs W8A8)"
DESCRIPTION = ("Run each task with the float model and the W8A8 verifier and report the difference. "
              "Log-likelihood tasks (perplexity, mmlu, boolq) score the verifier's logits; generation "
              "tasks (humaneval, asdiv) decode greedily in Quasar mode (n-gram drafter + the verifier).")

def _limit(value: str) -> int:
    """A positive number of items, or 'all' (-1)."""
    return -1 if value.strip().lower() == "all" else positive_int(value)


def register(sub) -> None:
    p = sub.add_parser("eval", help=HELP, description=DESCRIPTION)
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
    p.set_defaults(handler="quasar.cli.eval_run:run_eval")

