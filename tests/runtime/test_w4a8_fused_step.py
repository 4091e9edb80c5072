"""The W4A8 verifier's steps in the fused decoder op (quasar.runtime.fused_step, issue #34):
W4A8Linear and Int8Linear layers in any mix run in one C++ call, close to the modules'
logits, each row bitwise alone (greedy speculative == greedy autoregressive), on every
kernel path the CPU has."""

from __future__ import annotations

import torch

import pytest
from conftest import make_tiny_model, run_on_kernel_path, swapped
from test_fused_step import (CACHE, PROMPT, assert_fused_and_close,
                             assert_tree_rows_are_their_paths, batch_rows, fused_calls, long_ids,
                             random_tree, step_logits, tree_step, tree_step_on_paths)
from quasar.models.loader import load_model
from quasar.kernels import ext
from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w4a8 import W4A8Linear
from quasar.quant.w4a8_layouts import SMALL
from quasar.engine.w4a8_verifier import w4a8_verifier

pytestmark = pytest.mark.skipif(ext.decoder_layer_op() is None or ext.w4a8_linear_op() is None,
                                reason="the fused W4A8 step needs the C++ ops (a C++ compiler and ninja)")

ARCHS = ("llama", "qwen3")  # head_dim 16 (float32 cache) and 32 (a bf16 cache on AVX512-BF16 CPUs)


def test_the_kernel_paths_in_use():
    """Both op families run C++ kernels, on the path QUASAR_ISA asks for when it is set."""
    import os

    assert ext.kernel_path() != "pytorch" and ext.w4a8_kernel_path() != "pytorch"
    if os.environ.get("QUASAR_ISA"):
        assert ext.kernel_path() == ext.w4a8_kernel_path() == os.environ["QUASAR_ISA"]


def mixed(loaded):
    """The W4A8 verifier (faithful: layer 1's v and down int8) with more linears int8, as a Q4_K_M
    file's wider tensors are: within
    q, k, v (v, 15-bit activations, as the faithful layout keeps it), within gate, up (gate)
    and a 15-bit down projection."""
    model = w4a8_verifier(loaded)
    for i, name, bits in ((0, "self_attn.v_proj", 15), (1, "mlp.gate_proj", 8), (1, "mlp.down_proj", 15)):
        parent, _, child = name.rpartition(".")
        block = model.model.layers[i].get_submodule(parent)
        float_linear = loaded.model.model.layers[i].get_submodule(name)
        setattr(block, child, Int8Linear.from_float(float_linear, act_bits=bits))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir):
    """(arch, kind) -> (float model, W4A8 model, prompt ids); kind "w4" (every decoder linear
    4-bit: the small layout of a float model) or "mixed"."""
    root = tmp_path_factory.mktemp("w4fused")
    out = {}
    for arch in ARCHS:
        loaded = load_model(make_tiny_model(root / arch, arch, default_model_dir, max_position_embeddings=CACHE))
        ids = loaded.tokenizer.encode(PROMPT)
        out[arch, "w4"] = (loaded.model, w4a8_verifier(loaded, layout=SMALL), ids)
        out[arch, "mixed"] = (loaded.model, mixed(loaded), ids)
    return out


def kinds_of(model) -> set[str]:
    return {type(m).__name__ for layer in model.model.layers for m in layer.modules()
            if isinstance(m, (Int8Linear, W4A8Linear))}


@pytest.mark.parametrize("kind", ["w4", "mixed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_w4a8_step_is_used_and_close_to_the_modules(models, arch, kind):
    fp, q, ids = models[arch, kind]
    assert kinds_of(q) == ({"W4A8Linear"} if kind == "w4" else {"W4A8Linear", "Int8Linear"})
    assert_fused_and_close(fp, q, ids)


@pytest.mark.parametrize("kind,nodes,long", [("w4", 9, False), ("mixed", 9, False), ("w4", 24, True),
                                             ("mixed", 24, True)])
def test_tree_rows_are_bitwise_their_paths_alone(models, kind, nodes, long):
    """Each node's logits in one fused tree step are bitwise those of one-token steps along its
    path (past 6 rows too, where the 4-bit kernels take the rows in several passes)."""
    _, q, ids = models["qwen3", kind]
    if long:
        ids = long_ids(ids)
    assert_tree_rows_are_their_paths(q, ids, nodes)


def test_batch_rows_are_bitwise_each_sequence_alone(models):
    _, q, ids = models["llama", "mixed"]
    prompts = [ids, ids[: len(ids) // 2], ids[3:] + ids[:5]]
    trees = [random_tree(5, 5, 1000), ([], []), ([41, 42, 43], [-1, 0, 1])]
    rows = batch_rows(q, prompts, trees)
    with fused_calls(q) as calls:
        got = q.step(rows)
    assert calls == [True], "the batch step did not run fused"
    row = 0
    for p, (t, par) in zip(prompts, trees):
        alone, _ = tree_step(q, p, t, par)
        assert torch.equal(got[row:row + len(t) + 1], alone)
        row += len(t) + 1


def test_replacing_a_linear_rebuilds_the_plan(models):
    """Swapping a W4A8Linear for an Int8Linear (or its buffers) after a fused step: the next
    step runs the new weights, still fused."""
    _, q, ids = models["llama", "w4"]
    before = step_logits(q, ids, 3, fused=True)
    attn = q.model.layers[1].self_attn
    old = attn.k_proj
    try:
        attn.k_proj = Int8Linear.from_float(torch.nn.Linear(old.in_features, old.out_features, bias=False))
        with fused_calls(q) as calls:
            changed = step_logits(q, ids, 3, fused=True)
        assert calls and all(calls) and not torch.equal(changed, before)
    finally:
        attn.k_proj = old
    assert torch.equal(step_logits(q, ids, 3, fused=True), before)
    with swapped(old, "scales", torch.zeros_like(old.scales)):
        assert not torch.equal(step_logits(q, ids, 3, fused=True), before)
    assert torch.equal(step_logits(q, ids, 3, fused=True), before)


def test_the_probe_picks_a_prefetch_distance_that_each_step_sets(models, tmp_path, monkeypatch):
    """For a model with W4A8 layers the probe times steps at each of PREFETCH_DISTANCES, keeps
    the fastest with the costs (cached) and installs it; the fused step sets its model's
    distance before each call (another model's may be set meanwhile); the distance changes
    speed only: a step's logits are bitwise the same at any."""
    from quasar.runtime import step_cost

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    monkeypatch.setattr(step_cost, "_plausible", lambda seconds: True)  # cached even if a busy host disturbs it
    _, q, ids = models["llama", "mixed"]
    before, saved = ext.w4_prefetch_distance(), q.step_costs
    try:
        measured = step_cost.install_measured(q)
        if ext.kernel_path() == "portable":  # QUASAR_ISA=portable: its kernel never prefetches
            assert measured.prefetch_bytes is None
            pytest.skip("the portable path has no prefetch distance to choose")
        assert measured.prefetch_bytes in step_cost.PREFETCH_DISTANCES
        assert ext.w4_prefetch_distance() == measured.prefetch_bytes
        assert step_cost.measure(q) == measured  # cached with the times
        want = step_logits(q, ids, 3, fused=True)
        for other in (1 << 10, 1 << 20):
            ext.w4_prefetch_distance(other)  # another model's choice, set meanwhile
            with fused_calls(q) as calls:
                got = step_logits(q, ids, 3, fused=True)
            assert calls and all(calls) and torch.equal(got, want)
            assert ext.w4_prefetch_distance() == measured.prefetch_bytes
    finally:
        q.step_costs = saved
        ext.w4_prefetch_distance(before)


@pytest.mark.parametrize("drafter", ["ngram", "tree"])
def test_greedy_speculative_equals_autoregressive_through_llm(tmp_path_factory, drafter):
    from quasar.api import LLM

    d = make_tiny_model(tmp_path_factory.mktemp("m") / "char", "llama", None, seed=3)
    llm = LLM(str(d), drafter="ngram", verifier="w4a8", max_context=256)
    model = llm.verifier_model("w4a8")
    accepted = 0
    with fused_calls(model) as calls:
        for prompt in ("abcabcabcabcabc", "abababab", "defgdefgdefgdefg", "kjihgfedcba"):
            ar = llm.generate(prompt, raw=True, max_new_tokens=40, drafter="none")
            spec = llm.generate(prompt, raw=True, max_new_tokens=40, drafter=drafter, draft_budget=16) \
                if drafter == "tree" else llm.generate(prompt, raw=True, max_new_tokens=40, num_draft=5)
            assert spec.token_ids == ar.token_ids, prompt
            accepted += spec.stats["accepted"]
    assert calls and all(calls), "the W4A8 verifier's steps did not run fused"
    assert accepted > 0, "no draft was ever accepted: the test did not exercise speculation"


def test_default_model_w4a8_step_is_fused_and_close_to_the_modules():
    """SmolLM2's Q4_1 file: every decoder linear 4-bit, the faithful head."""
    loaded = load_model("default")
    q = w4a8_verifier(loaded)
    ids = long_ids(loaded.tokenizer.encode(PROMPT))[:200]
    with fused_calls(q) as calls:
        fused = step_logits(q, ids, 4, fused=True)
    assert calls and all(calls), "the fused step did not run"
    modules = step_logits(q, ids, 4, fused=False)
    scale = modules.abs().max()
    assert float((fused - modules).abs().max() / scale) < 0.05
    assert (fused.argmax(-1) == modules.argmax(-1)).float().mean() >= 0.75


# ---------------------------------------------------------------- lower kernel paths

@pytest.mark.skipif(not ext.cpu_runs("avx2"), reason="this CPU does not run the avx2 kernel path")
def test_avx2_and_portable_steps_are_bitwise_equal(models):
    """The AVX2 and plain C++ paths: the same float kernels (step/vec8.inc) and W4A8 kernels
    with the same exact sums and epilogue, so a mixed tree step gives the same bits."""
    from quasar.runtime import fused_step

    _, q, ids = models["qwen3", "mixed"]

    def check_path(path: str) -> None:
        assert ext.w4a8_kernel_path() == path

    try:
        got = tree_step_on_paths(q, ids, ("avx2", "portable"), check_path)
    finally:
        fused_step.install(q)
    assert torch.equal(got["avx2"], got["portable"])


@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_lower_kernel_paths_keep_the_fused_properties(tmp_path, path):
    """The tests above again in a fresh process forced onto a lower kernel path (QUASAR_ISA)."""
    tests = "kernel_paths_in_use or close_to_the_modules and not default_model or tree_rows or batch_rows"
    run_on_kernel_path(path, __file__, tests, tmp_path)
