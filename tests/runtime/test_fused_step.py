"""The fused W8A8 decoder layer (quasar.runtime.fused_step): it is really used, its logits
stay as close to the float model as the module path's, a token's logits do not depend on
the tokens verified with it, and it gets out of the way when it does not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import make_tiny_model, run_on_kernel_path, swapped
from fused_checks import assert_as_close_as_the_modules, fused_calls
from quasar.models.llama import Transformer
from quasar.models.rows import Rows
from quasar.models.loader import load_model
from quasar.kernels import ext
from quasar.quant.checkpoint import save_checkpoint
from quasar.runtime.w8a8 import Int8Linear
from quasar.quant.quantize import build_w8a8

pytestmark = pytest.mark.skipif(ext.decoder_layer_op() is None,
                                reason="the fused layer needs the C++ ops (a C++ compiler and ninja)")

CALIB = ("The committee met on Tuesday to review the annual budget and the new transit plan.\n"
         "def mean(xs):\n    return sum(xs) / len(xs)\n") * 12
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who went out"
ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {}}
CACHE = 2048  # cache rows of the tests' steps (and the tiny models' context)


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir):
    """arch -> (float model, W8A8 model, prompt ids) on tiny random models."""
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for arch in ARCHS:
        loaded = load_model(make_tiny_model(root / arch, arch, default_model_dir, max_position_embeddings=CACHE))
        q = build_w8a8(loaded.model, loaded.tokenizer, calib_text=CALIB, samples=2, seq_len=48, progress=False)
        out[arch] = (loaded.model, q, loaded.tokenizer.encode(PROMPT))
    return out


def step_logits(model: Transformer, ids: list[int], k: int, fused: bool) -> torch.Tensor:
    """Prefill all but the last k tokens, then one k-token step; its logits [k, vocab]."""
    kernel = model.step_kernel
    if not fused:
        model.step_kernel = None
    try:
        model.setup_cache(CACHE)
        model(torch.tensor([ids[:-k]]), logits="none")
        return model(torch.tensor([ids[-k:]]))[0]
    finally:
        model.step_kernel = kernel


# 1,030 tokens: a context of many 16-key chunks, where the rows of a step end in different
# chunks and the longest row decides how far the shared loops run, and of three 512-key
# attention blocks of a bf16 cache (the rows of a 12-row step end on both sides of the
# block boundary at 1,024, so some are joined from two blocks and some from three).
LONG = 1030


def long_ids(ids: list[int]) -> list[int]:
    return (ids * (LONG // len(ids) + 1))[:LONG]


def batch_rows(q, prompts, trees) -> Rows:
    """One step's rows for several sequences, one cache slot each: every prompt but its last
    token prefilled into its slot, then that token and its draft tree (tokens, parents)."""
    q.setup_cache(CACHE, n_slots=len(prompts))
    for slot, p in enumerate(prompts):
        q(torch.tensor([p[:-1]]), logits="none", slot=slot)
    tokens, slots, parents = [], [], []
    for slot, (p, (t, par)) in enumerate(zip(prompts, trees)):
        base = len(tokens)
        tokens += [p[-1], *t]
        slots += [slot] * (len(t) + 1)
        parents += [-1, *(base + 1 + x if x >= 0 else base for x in par)]
    return Rows.build(tokens, slots, parents, q.cache.lengths)


@pytest.mark.parametrize("arch,long", [(a, False) for a in ARCHS] + [("llama", True), ("qwen2", True)])
def test_fused_layer_is_used_and_as_close_to_float_as_the_modules(models, arch, long):
    fp, q, ids = models[arch]
    if long:
        ids = long_ids(ids)
    assert_fused_and_close(fp, q, ids)


def assert_fused_and_close(fp, q, ids):
    """A 6-token step of quantized ``q`` runs fused, is as close to float ``fp`` as the
    modules' (within 1.5x), and close to the modules' own logits."""
    with fused_calls(q) as calls:
        fused = step_logits(q, ids, 6, fused=True)
    assert calls and all(calls), "the fused layer did not run"
    modules = step_logits(q, ids, 6, fused=False)
    ref = step_logits(fp, ids, 6, fused=False)
    assert_as_close_as_the_modules(fused, modules, ref)


@pytest.mark.parametrize("k", [6, 12])
@pytest.mark.parametrize("long", [False, True])
def test_row_invariance_of_the_fused_layer(models, k, long):
    """Rows computed one at a time equal the same rows in one k-token step, bitwise (also
    past 8 rows, where the GEMM makes a second pass, and over a longer context)."""
    _, q, ids = models["qwen3"]
    if long:
        ids = long_ids(ids)
    together = step_logits(q, ids, k, fused=True)
    q.setup_cache(CACHE)
    q(torch.tensor([ids[:-k]]), logits="none")
    alone = torch.cat([q(torch.tensor([[t]]))[0] for t in ids[-k:]])
    assert torch.equal(alone, together)


def test_checkpoint_reload_and_replaced_weights(models, default_model_dir, tmp_path):
    """A reloaded checkpoint runs the fused layer with the same bits; replacing a weight
    rebuilds the plan (the step must never run stale weights)."""
    _, q, ids = models["llama"]
    before = step_logits(q, ids, 3, fused=True)
    loaded = load_model(save_checkpoint(q, tmp_path / "ckpt", default_model_dir)).model
    assert loaded.step_kernel is not None
    assert [layer.mlp.down_proj.act_bits for layer in loaded.model.layers] == \
        [layer.mlp.down_proj.act_bits for layer in q.model.layers] == [15] * len(q.model.layers)
    assert torch.equal(step_logits(loaded, ids, 3, fused=True), before)
    lin: Int8Linear = q.model.layers[0].mlp.down_proj
    with swapped(lin, "weight", torch.zeros_like(lin.weight)):
        assert not torch.equal(step_logits(q, ids, 3, fused=True), before)
    assert torch.equal(step_logits(q, ids, 3, fused=True), before)


def test_not_applicable_falls_back(models, monkeypatch):
    fp, q, ids = models["llama"]
    assert getattr(fp, "step_kernel", None) is None  # float models run their modules
    monkeypatch.setattr(ext, "decoder_layer_op", lambda: None)
    q.step_kernel._plan = None
    torch.testing.assert_close(step_logits(q, ids, 4, fused=True), step_logits(q, ids, 4, fused=False),
                               rtol=0, atol=0)
    monkeypatch.undo()
    q.step_kernel._plan = None


# ---------------------------------------------------------------- bf16 KV cache

needs_bf16 = pytest.mark.skipif(not ext.bf16_kv_supported(), reason="a bf16 KV cache needs an AVX512-BF16 CPU")


@needs_bf16
def test_kv_cache_is_bf16_where_the_op_attends_over_it(models, monkeypatch):
    """head_dim 32 (the tiny qwen3) takes the bf16 cache; head_dim 16 keeps float32 (the
    bf16 kernel works on pairs of 16-dim halves); QUASAR_KV_DTYPE=fp32 turns it off."""
    from quasar.runtime import fused_step

    fp, q, _ = models["qwen3"]
    assert q.kv_dtype == torch.bfloat16 and q.setup_cache(64).k.dtype == torch.bfloat16
    assert models["llama"][1].kv_dtype is None and fp.kv_dtype is None
    monkeypatch.setenv(fused_step.ENV_KV_DTYPE, "fp32")
    assert fused_step.kv_cache_dtype(q) is None
    monkeypatch.setenv(fused_step.ENV_KV_DTYPE, "fp16")
    with pytest.raises(Exception, match="QUASAR_KV_DTYPE"):
        fused_step.kv_cache_dtype(q)


@needs_bf16
@pytest.mark.parametrize("long", [False, True])
def test_bf16_cache_step_is_close_to_the_float32_cache_and_the_modules(models, long):
    """The bf16 kernel (bf16 keys, values, q and softmax numerators; float32 sums) is the
    same attention: its logits are as close to the float32-cache kernel's as the modules'
    are, and the modules path reads the same bf16 cache."""
    fp, q, ids = models["qwen3"]
    if long:
        ids = long_ids(ids)
    with fused_calls(q) as calls:
        bf16 = step_logits(q, ids, 6, fused=True)
    assert calls and all(calls) and q.cache.k.dtype == torch.bfloat16
    modules_bf16 = step_logits(q, ids, 6, fused=False)
    q.kv_dtype = None
    try:
        f32 = step_logits(q, ids, 6, fused=True)
        assert q.cache.k.dtype == torch.float32
    finally:
        q.kv_dtype = torch.bfloat16
    ref = step_logits(fp, ids, 6, fused=False)
    scale = ref.abs().max()
    err = {name: float((x - ref).abs().max() / scale) for name, x in
           (("bf16", bf16), ("f32", f32), ("modules_bf16", modules_bf16))}
    assert err["bf16"] <= 1.5 * err["f32"] + 1e-2, err
    assert float((bf16 - f32).abs().max() / scale) < 0.05
    assert float((bf16 - modules_bf16).abs().max() / scale) < 0.05
    assert (bf16.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.8


# ---------------------------------------------------------------- token trees

def random_tree(seed: int, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """n draft nodes (tokens, parents): parents before children, some deep, some wide."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)]
    return tokens, parents


def path_of(tokens: list[int], parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path


def prefill(model: Transformer, ids: list[int]) -> None:
    """All but the last token into a fresh cache (the last one is the pending token)."""
    model.setup_cache(CACHE)
    model(torch.tensor([ids[:-1]]), logits="none")


def one_token_steps(model: Transformer, ids: list[int], path: list[int]) -> torch.Tensor:
    """The logits [len(path) + 1, vocab] of decoding the pending token and then `path` one token a step."""
    prefill(model, ids)
    return torch.cat([model(torch.tensor([[t]]))[0] for t in [ids[-1], *path]])


def tree_step(model: Transformer, ids: list[int], tokens: list[int], parents: list[int]) -> tuple[torch.Tensor, Rows]:
    prefill(model, ids)
    rows = Rows.build([ids[-1], *tokens], [0] * (len(tokens) + 1), [-1, *(p + 1 for p in parents)],
                      model.cache.lengths)
    return model.step(rows), rows


@pytest.mark.parametrize("arch,nodes,long", [(a, 9, False) for a in ARCHS] + [("qwen3", 40, False),
                                                                            ("llama", 24, True),
                                                                            ("qwen3", 24, True)])
def test_tree_rows_are_bitwise_their_paths_alone(models, arch, nodes, long):
    """Each node's logits in one fused tree step are bitwise those of one-token steps along its
    path (also past 16 rows, where the GEMMs run in blocks, and over a longer context)."""
    _, q, ids = models[arch]
    if long:
        ids = long_ids(ids)
    assert_tree_rows_are_their_paths(q, ids, nodes)


def assert_tree_rows_are_their_paths(q, ids, nodes):
    """A fused step of a random tree of `nodes` nodes after `ids`: every row bitwise the last
    of one-token steps along its path."""
    tokens, parents = random_tree(nodes, nodes, 1000)
    with fused_calls(q) as calls:
        got, _ = tree_step(q, ids, tokens, parents)
    assert calls and calls[-1], "the tree step did not run fused"
    assert torch.equal(got[0], one_token_steps(q, ids, [])[0])
    for node in range(nodes):
        path = path_of(tokens, parents, node)
        assert torch.equal(got[node + 1], one_token_steps(q, ids, path)[-1]), node


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4, 5])
def test_commit_after_a_fused_tree_step_at_every_depth(models, depth):
    """Keeping the pending token and an accepted path of each depth, then decoding on, gives
    bitwise what decoding that path one token at a time gives."""
    _, q, ids = models["qwen2"]
    tokens = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    parents = [-1, -1, 0, 0, 3, 1, 4, 4, 7, 2]  # the path 0 -> 3 -> 4 -> 7 -> 8 and side branches
    deepest = {0: None, 1: 1, 2: 3, 3: 4, 4: 7, 5: 8}[depth]  # the accepted path's last node
    _, rows = tree_step(q, ids, tokens, parents)
    nodes = []
    node = deepest
    while node is not None and node >= 0:
        nodes.insert(0, node)
        node = parents[node]
    q.cache.commit(0, [0, *(n + 1 for n in nodes)], rows)
    assert q.cache.length == len(ids) + depth
    after = torch.cat([q(torch.tensor([[t]]))[0] for t in (21, 22, 23)])
    path = [tokens[n] for n in nodes]
    assert torch.equal(after, one_token_steps(q, ids, path + [21, 22, 23])[-3:])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tree_decoding_equals_autoregressive(models, default_model_dir, arch):
    """The tree drafter on the fused W8A8 step changes no token of greedy decoding."""
    from quasar.models.tokenizer import Tokenizer
    from quasar.speculative.drafters import NoDrafter
    from quasar.speculative.batch import decode
    from quasar.speculative.generate import Result
    from quasar.speculative.options import DecodeOptions, DraftOptions
    from quasar.speculative.tree_drafter import TreeDrafter

    _, q, ids = models[arch]
    tokenizer = Tokenizer(default_model_dir)
    q.setup_cache(CACHE)

    def run(drafter, budget):
        draft = DraftOptions("tree", draft_budget=budget) if budget else DraftOptions("none")
        out = [r for r in decode(q, tokenizer, ids, drafter, DecodeOptions(max_new_tokens=48, draft=draft))
               if isinstance(r, Result)]
        return out[0]

    ar = run(NoDrafter(), 0)
    for budget in (4, 16, 31):
        tree = run(TreeDrafter(budget=budget), budget)
        assert tree.token_ids == ar.token_ids, budget
        assert tree.stats.accepted > 0 and tree.stats.steps < ar.stats.steps


@pytest.mark.parametrize("arch,long", [("qwen3", False), ("llama", True), ("qwen3", True)])
def test_batch_rows_are_bitwise_each_sequence_alone(models, arch, long):
    """One fused step over several cache slots (chains, trees and a bare pending token, of
    different lengths) gives each row bitwise the logits of its own sequence decoded alone,
    and writes each slot's K/V where a one-slot step would."""
    _, q, ids = models[arch]
    if long:
        ids = long_ids(ids)
    prompts = [ids, ids[: len(ids) // 2], ids[3:] + ids[:5], ids[:7]]
    trees = [random_tree(5, 5, 1000 + i) for i in range(4)]
    trees[1] = ([], [])  # a sequence without drafts
    trees[2] = ([41, 42, 43], [-1, 0, 1])  # a chain
    rows = batch_rows(q, prompts, trees)
    with fused_calls(q) as calls:
        got = q.step(rows)
    assert calls == [True], "the batch step did not run fused"
    k_batch, v_batch = q.cache.k.clone(), q.cache.v.clone()
    row = 0
    for slot, (p, (t, par)) in enumerate(zip(prompts, trees)):
        alone, one = tree_step(q, p, t, par)
        assert torch.equal(got[row:row + len(t) + 1], alone), slot
        n = len(p) + len(t)  # its prompt but the pending token, then the step's rows
        assert torch.equal(k_batch[:, slot, :, :n], q.cache.k[:, 0, :, :n]), slot
        assert torch.equal(v_batch[:, slot, :, :n], q.cache.v[:, 0, :, :n]), slot
        row += len(t) + 1


def test_w8a8_models_get_the_row_select_op_and_their_row_cost(models):
    """install() gives a W8A8 model the one-pass argmax / top-k (the same tokens as torch's)
    and the row cost of this CPU's kernel; float models keep torch and the default cost."""
    from quasar.defaults import DEFAULT_ROW_COST
    from quasar.runtime import step_cost

    fp, q, ids = models["qwen3"]
    assert q.select_kernel is not None and fp.select_kernel is None
    expected = {"amx": step_cost.AMX_ROW_COST, "avx512-vnni": step_cost.VNNI_ROW_COST}.get(
        ext.kernel_path(), step_cost.AVX2_ROW_COST)  # the prior, before LLM measures the step
    assert q.row_cost == expected == step_cost.prior_row_cost() and fp.row_cost == DEFAULT_ROW_COST  # tiny: the cap
    assert q.pass_rows == (step_cost.AMX_PASS_ROWS if ext.amx_supported() else step_cost.VNNI_PASS_ROWS)
    assert fp.pass_rows is None
    cfg = q.config  # key cost: a key's K/V bytes over the int8 weight bytes
    key_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (2 if q.kv_dtype == torch.bfloat16 else 4)
    weights = sum(m.in_features * m.out_features for m in q.modules() if isinstance(m, Int8Linear))
    assert q.key_cost == pytest.approx(key_bytes / weights) and fp.key_cost == 0.0
    big = nn.Sequential(*[Int8Linear(4096, 4096) for _ in range(16)])  # 268 MB: rows relatively cheaper
    assert step_cost.prior_row_cost(big) == pytest.approx(expected * (135e6 / (16 * 4096 * 4096)) ** 0.5)
    logits = step_logits(q, long_ids(ids), 9, fused=True)
    best, top = q.row_argmax_topk(logits, 8)
    want_best, want_top = fp.row_argmax_topk(logits, 8)  # torch
    assert best == want_best and best == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits.gather(1, torch.tensor(top)), logits.gather(1, torch.tensor(want_top)))
    assert q.row_argmax_topk(logits, 0) == (best, None)


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory, default_model_dir):
    """A tiny W8A8 Llama with head_dim 64 (the default model's), 2 query heads per kv head."""
    d = make_tiny_model(tmp_path_factory.mktemp("hd64") / "m", "llama", default_model_dir, hidden_size=128,
                        num_attention_heads=2, num_key_value_heads=1)
    loaded = load_model(d)
    q = build_w8a8(loaded.model, loaded.tokenizer, calib_text=CALIB, samples=2, seq_len=48, progress=False)
    return q, loaded.tokenizer.encode(PROMPT)


@pytest.mark.skipif(not ext.amx_attention_supported(), reason="prompt chunks attend with tiles on AMX-BF16 CPUs")
@pytest.mark.parametrize("arch,cached", [("qwen3", 70), ("head_dim_64", 70), ("qwen3", 600)])
def test_prompt_chunks_attend_with_tiles_like_the_step_kernel(models, head_dim_64, arch, cached):
    """A prompt chunk (prefill=True) attends with AMX-BF16 tiles over all its keys at once;
    an AMX CPU's verifier steps use tiles too, over 512-key blocks. Within one block the
    two are the same arithmetic, bitwise; over several blocks (joined per query) close, for
    the logits and for the K/V the chunk leaves; the same prompt always gives the same cache."""
    q, ids = head_dim_64 if arch == "head_dim_64" else models[arch][1:]
    assert q.kv_dtype == torch.bfloat16
    ids = long_ids(ids)
    head, chunk = ids[:cached], ids[cached:cached + 120]  # a chunk attends to cached keys, then its own

    def chunk_logits(prefill: bool):
        q.setup_cache(CACHE)
        q(torch.tensor([head]), logits="none")
        x = q._run_rows(Rows.chain(chunk, 0, q.cache.lengths), modules=False, prefill=prefill)
        n = len(head) + len(chunk)
        return q._logits(x, "all")[0], q.cache.k[:, 0, :, :n].float().clone(), q.cache.v[:, 0, :, :n].float().clone()

    tiles, tiles_k, tiles_v = chunk_logits(True)
    steps, steps_k, steps_v = chunk_logits(False)
    assert torch.equal(chunk_logits(True)[0], tiles)  # deterministic
    if cached + len(chunk) <= 512:
        assert torch.equal(tiles, steps) and torch.equal(tiles_k, steps_k) and torch.equal(tiles_v, steps_v)
        return
    assert not torch.equal(tiles, steps)  # several blocks, joined: another summation order
    scale = steps.abs().max()
    assert (tiles - steps).abs().max() < 2e-2 * scale
    assert (tiles.argmax(-1) == steps.argmax(-1)).float().mean() > 0.95
    assert (tiles_k - steps_k).abs().max() < 5e-2 * steps_k.abs().max()
    assert (tiles_v - steps_v).abs().max() < 5e-2 * steps_v.abs().max()


@pytest.mark.skipif(not ext.amx_attention_supported(), reason="without AMX the tests above already run the vector kernel")
def test_the_vector_kernel_of_cpus_without_amx(tmp_path):
    """On an AMX CPU every step attends with tiles, so the vector kernel other AVX512-BF16
    CPUs use (key blocks included) is run here with QUASAR_NO_AMX=1 in a fresh process:
    rows, trees and batches bitwise alone, and close to the float32 cache and the modules."""
    import os
    import subprocess
    import sys

    tests = "row_invariance or tree_rows or batch_rows or bf16_cache_step or greedy_tree"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                         env={**os.environ, "QUASAR_NO_AMX": "1"}, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout


# ---------------------------------------------------------------- lower kernel paths

@pytest.mark.skipif(not ext.cpu_runs("avx2"), reason="this CPU does not run the avx2 kernel path")
@pytest.mark.parametrize("kv", ["bf16", "fp32"])
def test_avx2_and_portable_steps_are_bitwise_equal(models, monkeypatch, kv):
    """The AVX2 float kernels and the plain C++ ones are one code (step/vec8.inc) with the same
    IEEE operations in the same order: a tree step over a long context gives the same bits,
    over a float32 cache and over a bfloat16 one (stored rounded, widened to float32 on load)."""
    from quasar.runtime import fused_step

    monkeypatch.setenv(fused_step.ENV_KV_DTYPE, kv)
    _, q, ids = models["qwen3"]

    def check_cache(path: str) -> None:
        assert q.kv_dtype == (torch.bfloat16 if kv == "bf16" else None)

    try:
        got = tree_step_on_paths(q, ids, ("avx2", "portable"), check_cache)
        assert q.cache.k.dtype == (torch.bfloat16 if kv == "bf16" else torch.float32)
    finally:
        monkeypatch.undo()
        fused_step.install(q)
    assert torch.equal(got["avx2"], got["portable"])


def tree_step_on_paths(q, ids, paths, check=lambda path: None) -> dict:
    """Logits of one random tree step over a long context, fused, on each kernel path in
    `paths` (the step installed again for each; `check(path)` runs after each install)."""
    from quasar.runtime import fused_step

    tokens, parents = random_tree(9, 9, 1000)
    got = {}
    for path in paths:
        with ext.forced_kernel_path(path):
            fused_step.install(q)
            check(path)
            with fused_calls(q) as calls:
                got[path], _ = tree_step(q, long_ids(ids), tokens, parents)
            assert calls and calls[-1], "the tree step did not run fused"
    return got


@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_lower_kernel_paths_keep_the_fused_properties(tmp_path, path):
    """The tests above again in a fresh process forced onto a lower kernel path (QUASAR_ISA):
    the fused step runs, stays as close to the float model as the modules (over a float32
    and a bfloat16 cache), and keeps row invariance for chains, trees and batches, so greedy
    tree decoding still equals autoregressive decoding. (The portable path, slower, runs the
    exactness ones.)"""
    tests = ("fused_layer_is_used or row_invariance or tree_rows or batch_rows or greedy_tree or commit_after or "
             "bf16_cache_step or kv_cache_is_bf16")
    if path == "portable":
        tests = "row_invariance or tree_rows or greedy_tree"
    run_on_kernel_path(path, __file__, tests, tmp_path)
