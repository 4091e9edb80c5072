"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral): logits
against transformers, each expert run once per step over its rows, experts quantized like
every other linear (the router stays float), greedy speculative == greedy autoregressive."""

import pytest
import torch

from quasar.api import LLM
from quasar.models.hf import load_hf_dir
from quasar.models.loader import load_model
from quasar.models.moe import SparseMoE, experts_touched, sparse_blocks
from quasar.models.rows import Rows
from quasar.runtime import step_cost
from quasar.runtime.w8a8 import Int8Linear
from tests.family_models import assert_speculative_matches_ar, make_family_model
from tests.models.test_models import TOL, _reference_logits

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
CALIB = dict(calib_text="abc def ghij klm abcabc hello " * 40, samples=2, seq_len=48, progress=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tmp_path):
    model_dir = make_family_model(tmp_path / family, family)
    torch.manual_seed(1)
    ids = torch.randint(0, 16, (1, 24))
    ref = _reference_logits(model_dir, ids)
    model = load_hf_dir(model_dir)
    model.setup_cache(64)
    parts = [model(ids[:, :10])] + [model(ids[:, p:p + 1]) for p in range(10, 14)] + [model(ids[:, 14:])]
    assert float((torch.cat(parts, dim=1) - ref).abs().max()) <= TOL
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert sparse == ([True, False] if family == "qwen3_moe" else [True, True])  # mlp_only_layers=[1]


def test_a_step_runs_each_expert_once_over_its_rows(tmp_path):
    model = load_hf_dir(make_family_model(tmp_path / "m", "qwen3_moe"))
    block = model.model.layers[0].mlp
    calls: list[tuple[int, int]] = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_pre_hook(lambda _m, args, e=e: calls.append((e, args[0].shape[0])))
    model.setup_cache(64)
    ids = [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4]
    model(torch.tensor([ids[:4]]))
    calls.clear()
    logits = model.step(Rows.chain(ids[4:], 0, model.cache.lengths))
    experts = [e for e, _ in calls]
    assert experts == sorted(set(experts)) == block.last_experts and experts_touched(model) == [len(experts)]
    assert sum(n for _, n in calls) == len(ids[4:]) * block.top_k  # every row reaches its k experts
    _rows_match_one_token_steps(model, ids, logits, exact=False)


def _rows_match_one_token_steps(model, ids: list[int], logits, exact: bool) -> None:
    """Each row of a step over ids[4:] (after ids[:4]) gives its one-token decode's logits:
    bitwise with int8 linears (a float GEMM over several rows may round otherwise)."""
    for r in range(len(ids) - 4):
        model.cache.lengths[0] = 4 + r
        one = model.step(Rows.chain([ids[4 + r]], 0, model.cache.lengths))
        assert torch.equal(one[0], logits[r]) if exact else torch.allclose(one[0], logits[r], atol=1e-5)


def test_experts_are_int8_and_the_router_stays_float(tmp_path):
    from quasar.quant.quantize import build_w8a8

    loaded = load_model(make_family_model(tmp_path / "m", "qwen2_moe"))
    block = loaded.model.model.layers[0].mlp
    with torch.no_grad():  # expert 5 is never routed to: it has no calibration tokens
        block.gate.weight[5] = -100.0
    q = build_w8a8(loaded.model, loaded.tokenizer, **CALIB)
    qblock = q.model.layers[0].mlp
    linears = [m for e in [*qblock.experts, qblock.shared_expert] for m in (e.gate_proj, e.up_proj, e.down_proj)]
    assert all(isinstance(m, Int8Linear) for m in linears)
    assert qblock.experts[0].down_proj.act_bits == q.model.layers[0].mlp.shared_expert.down_proj.act_bits == 15
    assert qblock.gate.weight.dtype == torch.float32 and not isinstance(qblock.gate, Int8Linear)
    unrouted = qblock.experts[5].up_proj
    assert unrouted.weight.abs().max() == 127 and torch.all(unrouted.weight_scale > 0)  # plainly rounded
    q.setup_cache(64)
    ids = [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4]
    q(torch.tensor([ids[:4]]))
    rows = Rows.chain(ids[4:], 0, q.cache.lengths)
    assert q._run_rows(rows, modules=False) is not None  # the fused step runs the experts
    _rows_match_one_token_steps(q, ids, q.step(rows), exact=True)
    _check_step_bytes(q)


def _check_step_bytes(q) -> None:
    """A step reads the experts its rows reach: fewer bytes than the model, more with more
    rows; the prior row cost prices the experts one more row reaches."""
    dense, per_expert = step_cost.expert_bytes(q)
    assert step_cost.step_bytes(q, 1) < step_cost.step_bytes(q, 4) < step_cost.weight_bytes(q)
    q.step(Rows.chain([4, 5, 6], 0, q.cache.lengths))
    touched = [len(block.last_experts) for block in sparse_blocks(q)]
    assert touched == experts_touched(q) and step_cost.touched_bytes(q) == dense + sum(
        b * n for b, n in zip(per_expert, touched))
    assert step_cost.expected_experts(6, 2, 1) == pytest.approx(2.0)
    assert q.row_cost >= step_cost.expert_row_cost(q) > 0  # a second row reaches more experts


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("verifier", ["fp", "w8a8", "w4a8"])
def test_greedy_speculative_equals_autoregressive(family, verifier, tmp_path):
    llm = LLM(str(make_family_model(tmp_path / family, family, seed=3)), drafter="ngram", verifier="fp",
              max_context=128)
    assert_speculative_matches_ar(llm, verifier)
