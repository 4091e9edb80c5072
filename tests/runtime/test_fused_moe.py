"""The fused decoder step over mixture-of-experts layers (quasar.runtime.fused_step,
csrc/decoder_layer/sparse_mlp.h): W8A8 and W4A8 verifiers of Qwen3-MoE (a dense layer among
the sparse ones), Mixtral and Qwen2-MoE (a shared expert) run their steps in one C++ call,
close to the modules' logits, with SparseMoE.last_experts naming the experts the step ran;
each row is bitwise the same alone or beside other rows (chains, trees, batches), so greedy
speculative decoding equals greedy autoregressive decoding; on every kernel path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_on_kernel_path
from fused_checks import assert_as_close_as_the_modules, fused_calls, record_fused_steps, tree_and_paths
from quasar.api import LLM
from quasar.engine.w4a8_verifier import w4a8_verifier
from quasar.kernels import ext
from quasar.models.loader import load_model
from quasar.models.moe import SparseMoE, sparse_blocks
from quasar.models.rows import Rows
from quasar.quant.quantize import build_w8a8
from quasar.quant.w4a8_layouts import SMALL
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w8a8 import Int8Linear
from tests.family_models import assert_speculative_matches_ar, make_family_model

pytestmark = pytest.mark.skipif(ext.decoder_layer_op() is None or ext.w4a8_linear_op() is None,
                                reason="the fused step needs the C++ ops (a C++ compiler and ninja)")

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
VERIFIERS = ("w8a8", "w4a8")
# Whole W4A8 groups of 32 in every linear (Mixtral's experts and Qwen2-MoE's shared expert
# are 48 wide in tests.family_models; a ragged W4A8 layer runs the modules).
WHOLE_GROUPS = {"mixtral": {"intermediate_size": 64}, "qwen2_moe": {"shared_expert_intermediate_size": 64}}
CALIB = dict(calib_text="abc def ghij klm abcabc hello " * 40, samples=2, seq_len=48, progress=False)
IDS = [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4, 5, 6, 9, 2, 3, 14, 15, 7]
CACHE = 96
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, verifier) -> (float model, quantized model)."""
    root = tmp_path_factory.mktemp("fused_moe")
    out = {}
    for family in FAMILIES:
        loaded = load_model(make_family_model(root / family, family, seed=3, **WHOLE_GROUPS.get(family, {})))
        out[family, "w8a8"] = (loaded.model, build_w8a8(loaded.model, loaded.tokenizer, **CALIB))
        out[family, "w4a8"] = (loaded.model, w4a8_verifier(loaded, cache=False, layout=SMALL))
    return out


def step_logits(model, k: int, fused: bool) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill all but the last k of IDS, then one k-token step: its logits [k, vocab] and
    each sparse layer's last_experts."""
    kernel = model.step_kernel
    if not fused:
        model.step_kernel = None
    try:
        model.setup_cache(CACHE)
        model(torch.tensor([IDS[:-k]]), logits="none")
        logits = model(torch.tensor([IDS[-k:]]))[0]
        return logits, [list(block.last_experts) for block in sparse_blocks(model)]
    finally:
        model.step_kernel = kernel


@pytest.mark.parametrize("verifier", VERIFIERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_moe_step_is_used_and_as_close_as_the_modules(models, family, verifier):
    """A 6-token step runs fused, is as close to the float model as the modules' (the dense
    fused step's tolerances), and reports the experts the modules run."""
    fp, q = models[family, verifier]
    kind = Int8Linear if verifier == "w8a8" else W4A8Linear
    assert all(isinstance(m, kind) for e in q.model.layers[0].mlp.experts for m in e.children())
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in q.model.layers]
    assert sparse == ([True, False] if family == "qwen3_moe" else [True, True])
    with fused_calls(q) as calls:
        fused, fused_experts = step_logits(q, 6, fused=True)
    assert calls and all(calls), "the fused step did not run"
    modules, module_experts = step_logits(q, 6, fused=False)
    assert fused_experts == module_experts and all(fused_experts)
    ref, _ = step_logits(fp, 6, fused=False)
    assert_as_close_as_the_modules(fused, modules, ref)


@pytest.mark.parametrize("k", [3, 12])
@pytest.mark.parametrize("verifier", VERIFIERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_chain_rows_are_bitwise_one_token_steps(models, family, verifier, k):
    """Each row of a k-token fused step equals its one-token step bitwise (12 rows: experts
    reached by several rows, each run once over them)."""
    _, q = models[family, verifier]
    with fused_calls(q) as calls:
        together, _ = step_logits(q, k, fused=True)
        q.setup_cache(CACHE)
        q(torch.tensor([IDS[:-k]]), logits="none")
        alone = torch.cat([q(torch.tensor([[t]]))[0] for t in IDS[-k:]])
    assert calls and all(calls)
    assert torch.equal(alone, together)


@pytest.mark.parametrize("verifier", VERIFIERS)
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_tree_rows_are_bitwise_their_paths_alone(models, family, verifier):
    _, q = models[family, verifier]
    with fused_calls(q) as calls:
        tree, alone = tree_and_paths(q, IDS[:7], IDS[7], 20, CACHE, seed=20)
    assert calls and all(calls)
    for node, logits in enumerate(alone):
        assert torch.equal(tree[node + 1], logits), node


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_batch_rows_are_bitwise_each_sequence_alone(models, verifier):
    """Two sequences' chains in one step (one cache slot each) give each one's own logits."""
    _, q = models["qwen2_moe", verifier]
    prompts = [IDS[:9], IDS[5:17]]
    drafts = [[4, 5, 6], [9, 2]]
    alone = []
    for p, d in zip(prompts, drafts):
        q.setup_cache(CACHE)
        q(torch.tensor([p[:-1]]), logits="none")
        alone.append(q(torch.tensor([[p[-1], *d]]))[0])
    q.setup_cache(CACHE, n_slots=2)
    tokens, slots, parents = [], [], []
    for slot, (p, d) in enumerate(zip(prompts, drafts)):
        q(torch.tensor([p[:-1]]), logits="none", slot=slot)
        parents += [-1] + [len(tokens) + i for i in range(len(d))]
        tokens += [p[-1], *d]
        slots += [slot] * (len(d) + 1)
    with fused_calls(q) as calls:
        together = q.step(Rows.build(tokens, slots, parents, q.cache.lengths))
    assert calls and all(calls)
    assert torch.equal(together, torch.cat(alone))


def test_a_step_runs_the_experts_in_place_now(models):
    """Experts are checked after a step, only those it ran: a replaced down projection is
    noticed and the step computed again with it (close to the modules' logits)."""
    _, q = models["mixtral", "w8a8"]
    before, _ = step_logits(q, 3, fused=True)
    block = q.model.layers[0].mlp
    old = [e.down_proj for e in block.experts]
    torch.manual_seed(5)
    try:
        for e in block.experts:
            e.down_proj = Int8Linear.from_float(torch.nn.Linear(e.down_proj.in_features, e.down_proj.out_features,
                                                                bias=False), act_bits=15)
        with fused_calls(q) as calls:
            fused, _ = step_logits(q, 3, fused=True)
        modules, _ = step_logits(q, 3, fused=False)
    finally:
        for e, down in zip(block.experts, old):
            e.down_proj = down
    assert calls and all(calls)
    assert not torch.equal(fused, before)
    assert float((fused - modules).abs().max() / modules.abs().max()) < 0.05


@pytest.mark.parametrize("verifier", VERIFIERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_autoregressive_through_the_fused_step(family, verifier, tmp_path, monkeypatch):
    calls = record_fused_steps(monkeypatch)
    model_dir = make_family_model(tmp_path / family, family, seed=3, **WHOLE_GROUPS.get(family, {}))
    llm = LLM(str(model_dir), drafter="ngram", verifier="fp", max_context=128)
    assert_speculative_matches_ar(llm, verifier)
    assert calls and all(calls), "the verifier's steps did not run fused"


@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_lower_kernel_paths_keep_the_fused_moe_properties(path):
    """The tests above again in a fresh process forced onto a lower kernel path (QUASAR_ISA)."""
    tests = "as_close or chain_rows or tree_rows or batch_rows"
    if path == "avx2":
        tests += " or (greedy and qwen2_moe)"
    run_on_kernel_path(path, __file__, tests, ROOT)  # from the repository root: `tests` imports
