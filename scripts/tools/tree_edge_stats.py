"""Measure the tree drafter's edge probabilities (quasar/speculative/tree_drafter.py, EDGE_PROB).

    python scripts/tools/tree_edge_stats.py [--model default] [--n 13] [--budget 24] [--max-new-tokens 128]

Decodes held-out prompts of the five bench tasks (task_prompts(task, n) minus the prompts the
bench itself uses) greedily with the tree drafter at a large budget, no node dropped for its
row cost, and counts, for every proposed node whose parent was accepted, whether it was
accepted too, by its evidence: the longest n-gram proposing it, whether that n-gram's
occurrences were followed by it at least half the time, and its rank among the recycled
verifier candidates. Prints the acceptance rate per cell in EDGE_PROB's layout, with counts.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from quasar.api import LLM
from quasar.bench.tasks import TASKS, task_prompts
from quasar.speculative import registry
from quasar.speculative.tree_drafter import TreeDrafter

RANKS = ("0", "1", "2+", "none")


def rank_column(rank: int | None) -> int:
    return 3 if rank is None else min(rank, 2)


class CountingTreeDrafter(TreeDrafter):
    """A tree drafter that records each proposed node's evidence and, once the step's emitted
    tokens arrive, whether the node was accepted."""

    counts: dict = defaultdict(lambda: [0, 0])  # (n, majority, rank column) -> [nodes, accepted]

    def propose_tree(self, budget):
        tree = super().propose_tree(budget)
        self._nodes, paths = [], []
        for token, parent in zip(tree.tokens, tree.parents):
            above = paths[parent] if parent >= 0 else ()
            n, count, total, _, rank = self.candidates(list(above))[token]
            paths.append(above + (token,))
            self._nodes.append((paths[-1], (min(n, 3), n > 0 and 2 * count >= total, rank_column(rank))))
        return tree

    def extend(self, new_ids):
        nodes, self._nodes = getattr(self, "_nodes", None), None
        if nodes:  # the step's emitted tokens: accepted drafts, then the verifier's own
            emitted = tuple(new_ids)
            accepted = {p for p, _ in nodes if len(p) < len(emitted) and emitted[:len(p)] == p}
            for path, cell in nodes:
                if len(path) == 1 or path[:-1] in accepted:
                    c = self.counts[cell]
                    c[0] += 1
                    c[1] += path in accepted
        super().extend(new_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--n", type=int, default=13, help="prompts per task before the bench's own are removed")
    ap.add_argument("--budget", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    registry._DRAFTERS["tree"] = CountingTreeDrafter
    llm = LLM(args.model, max_context=4096, max_batch=1)
    llm.verifier_model("w8a8").row_cost = 0.0  # keep every proposed node: measure them all
    bench = {item.id for task in TASKS for k in (2, 5) for item in task_prompts(task, k)}
    prompts = 0
    for task in TASKS:
        for item in task_prompts(task, args.n):
            if item.id in bench:
                continue
            ids = llm.encode(item.messages) if item.messages else llm.encode(item.text, raw=task == "code")
            llm.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter="tree",
                         draft_budget=args.budget)
            prompts += 1
    counts = CountingTreeDrafter.counts
    total = sum(c[0] for c in counts.values())
    print(f"{prompts} prompts, {total} nodes whose parent was accepted")
    print("n-gram | majority | " + " | ".join(f"rank {r}" for r in RANKS))
    for n in range(4):
        for majority in ((False,) if n == 0 else (True, False)):
            cells = [counts.get((n, majority, col), [0, 0]) for col in range(4)]
            print(f"{n} | {majority!s:5} | " + " | ".join(
                f"{a / c:.3f} ({c})" if c else "-" for c, a in cells))


if __name__ == "__main__":
    main()
