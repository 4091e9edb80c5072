"""The fused decoder step over Gemma 3's block (quasar.runtime.fused_step, BlockArgs in
csrc/decoder_layer/decoder_layer.cpp): six norms a layer (each 1 + w), GELU-tanh, its own
attention scale, and sliding layers with their own RoPE table and window. A tiny random
Gemma 3 (window 6, so every test sequence slides past it) at W8A8 and W4A8: steps run fused,
close to the modules' logits; each row bitwise the same alone or in a chain or a tree past
the window; greedy speculative == greedy autoregressive; on every kernel path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_on_kernel_path
from fused_checks import assert_as_close_as_the_modules, record_fused_steps, tree_and_paths
from quasar.api import LLM
from quasar.kernels import ext
from quasar.quant.options import QuantOptions
from tests.models.test_gemma3 import REPETITIVE, WINDOW, make_tiny_gemma3

pytestmark = pytest.mark.skipif(ext.decoder_layer_op() is None or ext.w4a8_linear_op() is None,
                                reason="the fused step needs the C++ ops (a C++ compiler and ninja)")

VERIFIERS = ("w8a8", "w4a8")
IDS = [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4, 5, 6, 9, 2, 3, 14, 15, 7]
CACHE = 96
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = make_tiny_gemma3(tmp_path_factory.mktemp("fused_gemma3") / "tiny", intermediate_size=128)
    return LLM(str(model_dir), drafter="ngram", verifier="fp", max_context=128,
               quant=QuantOptions(samples=4, seq_len=64))


def _logits(model, prefix: list[int], step: list[int], fused: bool) -> torch.Tensor:
    kernel = model.step_kernel
    if not fused:
        model.step_kernel = None
    try:
        model.setup_cache(CACHE)
        model(torch.tensor([prefix]), logits="none")
        return model(torch.tensor([step]))[0]
    finally:
        model.step_kernel = kernel


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_fused_gemma3_step_runs_and_is_close_to_the_modules(llm, verifier):
    """A 6-token step past the window runs fused, as close to the float model as the modules."""
    q, fp = llm.verifier_model(verifier), llm.verifier_model("fp")
    assert q.step_kernel is not None and q.step_kernel._build(), "the fused step declined Gemma 3"
    block = q.step_kernel._plan.block
    assert block["window"] == WINDOW and 0 < sum(block["local_layers"]) < len(q.model.layers)
    fused = _logits(q, IDS[:-6], IDS[-6:], fused=True)
    modules = _logits(q, IDS[:-6], IDS[-6:], fused=False)
    ref = _logits(fp, IDS[:-6], IDS[-6:], fused=False)
    assert_as_close_as_the_modules(fused, modules, ref)


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_rows_past_the_window_are_bitwise_their_one_token_steps(llm, verifier):
    """A 12-row chain crossing the window, and a tree, equal their rows' one-token steps."""
    q = llm.verifier_model(verifier)
    together = _logits(q, IDS[:3], IDS[3:15], fused=True)
    q.setup_cache(CACHE)
    q(torch.tensor([IDS[:3]]), logits="none")
    alone = torch.cat([q(torch.tensor([[t]]))[0] for t in IDS[3:15]])
    assert torch.equal(alone, together)
    tree, alone = tree_and_paths(q, IDS[:4], IDS[4], 12, CACHE, seed=0)
    for node, logits in enumerate(alone):
        assert torch.equal(tree[node + 1], logits), node


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_greedy_speculative_equals_autoregressive_through_the_fused_step(llm, verifier, monkeypatch):
    calls = record_fused_steps(monkeypatch)
    accepted = 0
    for prompt in REPETITIVE:
        ar = llm.generate(prompt, raw=True, max_new_tokens=30, drafter="none", verifier=verifier)
        for drafter, extra in (("ngram", {"num_draft": 4}), ("tree", {"draft_budget": 16})):
            spec = llm.generate(prompt, raw=True, max_new_tokens=30, drafter=drafter, verifier=verifier, **extra)
            assert spec.token_ids == ar.token_ids, (prompt, drafter)
            accepted += spec.stats["accepted"]
    assert accepted > 0
    assert calls and all(calls), "the verifier's steps did not run fused"


@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_lower_kernel_paths_keep_the_fused_gemma3_properties(path):
    """The tests above again in a fresh process forced onto a lower kernel path (QUASAR_ISA)."""
    run_on_kernel_path(path, __file__, "close or bitwise", ROOT)
