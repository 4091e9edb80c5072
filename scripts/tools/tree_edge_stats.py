"""Measure the tree drafter's edge probabilities (quasar/speculative/tree_drafter.py, EDGE_PROB).

    python scripts/tools/tree_edge_stats.py [--model default] [--verifier V] [--n 13] [--budget 24]
                                            [--max-new-tokens 128]

Decodes held-out prompts of the five bench tasks (task_prompts(task, n) minus the prompts
the bench itself uses) greedily with the tree drafter at a large budget, no node dropped for
its row cost, and counts, for every verified node whose parent was accepted (a proposal's
tail past the step's row cap is never verified, so never counted), whether it was accepted
too, by its evidence: the longest n-gram proposing it, whether that n-gram's occurrences
were followed by it at least half the time, and its rank among the recycled verifier
candidates (the last two tokens' where that pair has a list, else the last token's).
Prints the acceptance rate per cell in EDGE_PROB's layout, with counts.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from quasar.api import LLM
from quasar.bench.tasks import TASKS, task_prompts
from quasar.speculative import registry
from quasar.speculative.tree_drafter import TreeDrafter

COLUMNS = ("rank 0", "rank 1", "rank 2+", "no rank", "pair 0", "pair 1", "pair 2+", "not in pair")


class CountingTreeDrafter(TreeDrafter):
    """A tree drafter that adds up, over every sequence, the verified nodes its calibration
    counts (`_count_outcomes`: tested when the parent row was accepted, accepted when the
    node is that row's argmax). Only the nodes a step verified count: a proposal's tail that
    the decode loop cut (its row cap) was never tested."""

    counts: dict = defaultdict(lambda: [0, 0])  # (n, majority, column) -> [nodes, accepted]

    def _count_outcomes(self, tokens, top_ids, parents):
        before = {cell: list(tally) for cell, tally in self.outcomes.items()}
        super()._count_outcomes(tokens, top_ids, parents)
        for cell, (accepted, tested) in self.outcomes.items():
            was = before.get(cell, [0, 0])
            c = self.counts[cell]
            c[0] += tested - was[1]
            c[1] += accepted - was[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--verifier", default=None, help="the verifier to decode with (default: the model's own)")
    ap.add_argument("--n", type=int, default=13, help="prompts per task before the bench's own are removed")
    ap.add_argument("--budget", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    registry._DRAFTERS["tree"] = CountingTreeDrafter
    llm = LLM(args.model, max_context=4096, max_batch=1)
    verifier = args.verifier or llm.verifier
    model = llm.verifier_model(verifier)
    # keep every proposed node (rows free, however many, whatever the context): measure them all;
    # no price learner (quasar.runtime.learned_prices) to price them again
    model.row_cost, model.row_prices, model.pass_rows, model.key_cost = 0.0, None, None, 0.0
    model.learned_prices = None
    bench = {item.id for task in TASKS for k in (2, 5) for item in task_prompts(task, k)}
    prompts = 0
    for task in TASKS:
        for item in task_prompts(task, args.n):
            if item.id in bench:
                continue
            ids = llm.encode(item.messages) if item.messages else llm.encode(item.text, raw=task == "code")
            llm.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter="tree",
                         draft_budget=args.budget, verifier=verifier)
            prompts += 1
    counts = CountingTreeDrafter.counts
    total = sum(c[0] for c in counts.values())
    print(f"{prompts} prompts, {total} nodes whose parent was accepted")
    print("n-gram | majority | " + " | ".join(COLUMNS))
    for n in range(4):
        for majority in ((False,) if n == 0 else (True, False)):
            cells = [counts.get((n, majority, col), [0, 0]) for col in range(len(COLUMNS))]
            print(f"{n} | {majority!s:5} | " + " | ".join(
                f"{a / c:.3f} ({c})" if c else "-" for c, a in cells))


if __name__ == "__main__":
    main()
