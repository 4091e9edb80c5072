"""The row model: token trees and several cache slots in one step, and keeping accepted rows.

A row's logits must be those of running its path alone, one token at a time (its
ancestors' K/V are written by the same step), whatever other rows (siblings, other slots)
share the step; `KVCache.commit` must leave the cache as if only the accepted path had
been decoded.
"""

from __future__ import annotations

import pytest
import torch

from quasar.models.hf import load_hf_dir
from quasar.models.rows import Rows
from tests.conftest import ARCHES

# A tree below the pending token 5: nodes (token, parent node), -1 = the pending token.
TREE = [(3, -1), (7, -1), (4, 0), (9, 0), (6, 2), (8, 1), (2, 4), (10, 3)]
PROMPT = [1, 4, 6, 8, 3, 5, 7, 9, 11, 2, 12, 5]


def _paths(tree):
    """Each node's path of tokens below the pending token."""
    out = []
    for tok, parent in tree:
        out.append((out[parent] if parent >= 0 else []) + [tok])
    return out


def _alone(model, prefix: list[int], path: list[int]) -> torch.Tensor:
    """Logits of the path's last token, decoding prefix (prefilled) and path one token at a time."""
    model.setup_cache(64)
    model(torch.tensor([prefix[:-1]]), logits="none")
    out = None
    for tok in [prefix[-1], *path]:
        out = model(torch.tensor([[tok]]))[0, -1]
    return out


@pytest.fixture(scope="module", params=ARCHES)
def model(request, tmp_path_factory):
    from tests.conftest import make_tiny_model

    return load_hf_dir(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param))


def test_rows_metadata():
    rows = Rows.build([5, *(t for t, _ in TREE)], [0] * 9, [-1, *(p + 1 for _, p in TREE)], [12])
    assert rows.depth == [0, 1, 1, 2, 2, 3, 2, 4, 3]
    assert rows.positions == [12 + d for d in rows.depth]
    assert rows.cache_index == list(range(12, 21))
    assert rows.paths[7] == [12, 13, 15, 17, 19]  # pending, 3, 4, 6, 2
    assert not rows.is_chain and Rows.chain([1, 2, 3], 0, [4]).is_chain
    for bad in ([-1, -1], [0, -1], [-1, 1]):  # two roots / root not first / parent not earlier
        with pytest.raises(ValueError):
            Rows.build([1, 2], [0, 0], bad, [0])
    with pytest.raises(ValueError, match="contiguous"):
        Rows.build([1, 2, 3], [0, 1, 0], [-1, -1, -1], [0, 0])


def test_tree_rows_equal_their_paths_alone(model):
    model.setup_cache(64)
    model(torch.tensor([PROMPT[:-1]]), logits="none")
    tokens = [PROMPT[-1], *(t for t, _ in TREE)]
    rows = Rows.build(tokens, [0] * len(tokens), [-1, *(p + 1 for _, p in TREE)], model.cache.lengths)
    got = model.step(rows)
    assert model.cache.length == len(PROMPT) - 1  # a step commits nothing
    assert torch.allclose(got[0], _alone(model, PROMPT, []), atol=1e-5, rtol=0)
    for node, path in enumerate(_paths(TREE)):
        assert torch.allclose(got[node + 1], _alone(model, PROMPT, path), atol=1e-5, rtol=0), node


def test_slots_of_a_batch_do_not_see_each_other(model):
    prompts = [PROMPT, [2, 9, 9, 4, 1], [7, 3, 11, 6, 6, 6, 1, 8]]
    drafts = [[3, 4], [], [5, 5, 5]]
    model.setup_cache(64, n_slots=3)
    for slot, p in enumerate(prompts):
        model(torch.tensor([p[:-1]]), logits="none", slot=slot)
    tokens, slots, parents = [], [], []
    for slot, (p, d) in enumerate(zip(prompts, drafts)):
        base = len(tokens)  # parents are row indices of the whole step
        tokens += [p[-1], *d]
        slots += [slot] * (len(d) + 1)
        parents += [-1, *(base + i for i in range(len(d)))]
    got = model.step(Rows.build(tokens, slots, parents, model.cache.lengths))
    row = 0
    for p, d in zip(prompts, drafts):
        for i in range(len(d) + 1):
            assert torch.allclose(got[row], _alone(model, p, d[:i]), atol=1e-5, rtol=0)
            row += 1


@pytest.mark.parametrize("accept_node", [None, 0, 2, 4, 6])
def test_commit_keeps_the_accepted_path(model, accept_node):
    """After keeping the pending token and an accepted path (of every depth), decoding on
    gives what decoding that path from scratch gives."""
    model.setup_cache(64)
    model(torch.tensor([PROMPT[:-1]]), logits="none")
    tokens = [PROMPT[-1], *(t for t, _ in TREE)]
    rows = Rows.build(tokens, [0] * len(tokens), [-1, *(p + 1 for _, p in TREE)], model.cache.lengths)
    model.step(rows)
    path_nodes = []
    node = accept_node
    while node is not None and node >= 0:
        path_nodes.insert(0, node)
        node = TREE[node][1]
    model.cache.commit(0, [0, *(n + 1 for n in path_nodes)], rows)
    accepted = [TREE[n][0] for n in path_nodes]
    assert model.cache.length == len(PROMPT) + len(accepted)
    after = model(torch.tensor([[12, 1, 3]]))[0]
    model.setup_cache(64)
    ref = model(torch.tensor([PROMPT + accepted + [12, 1, 3]]))[0, -3:]
    assert torch.allclose(after, ref, atol=1e-5, rtol=0)
