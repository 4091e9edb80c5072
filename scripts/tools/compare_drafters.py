"""Drafter configurations against each other, interleaved in one process, on bench prompts.

    python scripts/tools/compare_drafters.py --configs "chain;tree:15;tree:8" [--model M] [--verifier w8a8|w4a8]
        [--tasks code,qa] [--n 4] [--rounds 2] [--max-new-tokens 128]

A config is `chain` (the n-gram chain, adaptive k), `chain:K` (its first draft length) or
`tree:N` (tree drafts of at most N nodes), optionally `@COST` to price every row at COST of
a one-row step instead of the verifier's own prices (`row_prices` once measured, else
`row_cost`: what trees keep nodes by; held as they are at the start: the decoder's price
learner, quasar.runtime.learned_prices, is paused, so rounds repeat). Every
config decodes every prompt greedily with the same verifier (W8A8, or W4A8 with --verifier
w4a8), one after another, round by round, so drifting machine load hits them alike; each
prompt's fastest round counts. Tree configs keep their own recycling table across prompts,
and every run of a prompt starts from that table as it was before the prompt's first run,
as `quasar bench` does: a prompt never drafts from its own earlier decode. Greedy decoding
is exact, so every config must emit the same tokens for a prompt; the script checks that.
Small differences (a few %) need several rounds and prompts: two cores are noisy.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch

from quasar.api import LLM
from quasar.bench.runner import BenchConfig, load_prompts
from quasar.bench.tasks import TASKS
from quasar.errors import QuasarError
from quasar.speculative.tree_drafter import RecyclingTable

@dataclass(frozen=True)
class Config:
    text: str
    drafter: str  # "ngram" or "tree"
    size: int | None  # chain: first draft length; tree: node budget (None: the default)
    row_cost: float | None  # None: the verifier's own


def parse_config(text: str) -> Config:
    spec, _, cost = text.strip().partition("@")
    name, _, size = spec.partition(":")
    if name not in ("chain", "tree"):
        raise QuasarError(f"config {text!r}: expected chain[:K] or tree[:N], optionally @COST")
    try:
        n = int(size) if size else None
        price = float(cost) if cost else None
    except ValueError:
        raise QuasarError(f"config {text!r}: K, N must be integers and COST a number") from None
    if (n is not None and n < 1) or (price is not None and price < 0):
        raise QuasarError(f"config {text!r}: K, N must be >= 1 and COST >= 0")
    return Config(text.strip(), "ngram" if name == "chain" else "tree", n, price)


@dataclass
class Tally:
    tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    emitted: float = 0.0  # tokens emitted by steps (L * steps)

    def add(self, stats: dict) -> None:
        self.tokens += stats["new_tokens"]
        self.decode_s += stats["decode_s"]
        self.steps += stats["steps"]
        self.emitted += stats["mean_accepted"] * stats["steps"]

    @property
    def rate(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


@dataclass
class Outcome:
    overall: dict[str, Tally] = field(default_factory=dict)  # config -> all prompts
    per_task: dict[str, dict[str, Tally]] = field(default_factory=dict)  # config -> task -> tally
    same_output: bool = True
    # (config, prompt index) -> steps of each round: equal when every round starts from the
    # same table, as it must
    round_steps: dict[tuple[str, int], list[int]] = field(default_factory=dict)


def compare(llm: LLM, configs: list[Config], tasks: list[str], n: int, rounds: int,
            max_new_tokens: int, verifier: str = "w8a8") -> Outcome:
    prompts, _ = load_prompts(BenchConfig(tasks=tasks, n=n, max_new_tokens=max_new_tokens), llm)
    model = llm.verifier_model(verifier)
    table = llm.recycling_table(verifier)
    own_cost, own_prices, learner = model.row_cost, model.row_prices, model.learned_prices
    tables = {c: RecyclingTable() for c in configs}  # each config's table after its last run
    before: dict[tuple[Config, int], RecyclingTable] = {}  # the table before a prompt's first run
    runs: dict[tuple[Config, int], list[tuple[float, dict, list[int]]]] = {}

    def run(c: Config, i: int, ids: list[int]) -> None:
        table.restore(before.setdefault((c, i), tables[c]))
        if c.row_cost is not None:  # one flat price for every row
            model.row_cost, model.row_prices = c.row_cost, None
        size = {"num_draft": c.size} if c.drafter == "ngram" else {"draft_budget": c.size}
        try:
            res = llm.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0, drafter=c.drafter,
                               verifier=verifier, **{k: v for k, v in size.items() if v is not None})
        finally:
            model.row_cost, model.row_prices = own_cost, own_prices
        tables[c] = table.copy()
        runs.setdefault((c, i), []).append((res.stats["decode_s"], res.stats, list(res.token_ids)))

    model.learned_prices = None
    try:
        for c in configs:  # warm every code path once, outside the measurement and the tables
            llm.generate(prompt_ids=prompts[0].ids[:16], max_new_tokens=4, temperature=0.0, drafter=c.drafter,
                         verifier=verifier)
        table.restore(RecyclingTable())
        for _ in range(rounds):
            for i, p in enumerate(prompts):
                for c in configs:
                    run(c, i, p.ids)
    finally:
        model.learned_prices = learner
    out = Outcome()
    for c in configs:
        out.overall[c.text] = Tally()
        for i, p in enumerate(prompts):
            _, stats, ids = min(runs[(c, i)], key=lambda r: r[0])
            out.overall[c.text].add(stats)
            out.per_task.setdefault(c.text, {}).setdefault(p.task, Tally()).add(stats)
            out.same_output &= ids == runs[(configs[0], i)][0][2]
            out.round_steps[(c.text, i)] = [r[1]["steps"] for r in runs[(c, i)]]
    return out


def report(out: Outcome) -> str:
    first = next(iter(out.overall.values()))
    tasks = list(next(iter(out.per_task.values())))
    lines = ["| config | tokens/s | L | vs first | " + " | ".join(f"{t} tokens/s / L" for t in tasks) + " |",
             "|---|---|---|---|" + "---|" * len(tasks)]
    for name, t in out.overall.items():
        cells = [f"{out.per_task[name][task].rate:.1f} / {out.per_task[name][task].mean_accepted:.2f}"
                 for task in tasks]
        lines.append(f"| {name} | {t.rate:.2f} | {t.mean_accepted:.2f} | {t.rate / first.rate:.3f}x | "
                     + " | ".join(cells) + " |")
    lines.append("")
    lines.append("same output for every config: " + ("yes" if out.same_output else "NO (a bug: greedy is exact)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--configs", default="chain;tree", help='";"-separated configs (see above)')
    ap.add_argument("--verifier", choices=("w8a8", "w4a8"), default="w8a8")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--n", type=int, default=4, help="prompts per task")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        configs = [parse_config(c) for c in args.configs.split(";") if c.strip()]
        if not configs:
            raise QuasarError("--configs names no config")
        if len(set(configs)) < len(configs):
            raise QuasarError("--configs names a config twice")
        if args.rounds < 1:
            raise QuasarError(f"--rounds must be >= 1, got {args.rounds}")
        torch.set_num_threads(args.threads)
        llm = LLM(args.model, max_context=4096, max_batch=1)
        out = compare(llm, configs, [t.strip() for t in args.tasks.split(",")], args.n, args.rounds,
                      args.max_new_tokens, args.verifier)
    except QuasarError as e:
        print(f"compare_drafters: {e}", file=sys.stderr)
        return 2
    print(report(out))
    return 0 if out.same_output else 1


if __name__ == "__main__":
    sys.exit(main())
