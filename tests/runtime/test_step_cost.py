"""Measured step costs (quasar.runtime.step_cost): the rule that turns step times into a row
cost, a pass size and the auto drafter's choice, and the probe on a real fused W8A8 step."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from quasar.models.loader import load_model
from quasar.kernels import ext
from quasar.runtime import step_cost
from quasar.quant.quantize import build_w8a8
from quasar.runtime.step_cost import PROBE_ROWS, StepCosts


def costs(*ratios: float) -> StepCosts:
    return StepCosts(PROBE_ROWS, tuple(0.01 * r for r in ratios), "test")


def test_cheap_rows_fill_a_pass_and_make_auto_draft_trees():
    amx_like = costs(1.0, 1.02, 1.06, 1.15, 1.30)  # 16 rows 1.3x one row
    assert amx_like.pass_rows == 16 and amx_like.rows_are_cheap
    slope = sum((k - 1) * (r - 1) for k, r in zip(PROBE_ROWS[1:], (1.02, 1.06, 1.15, 1.30))) / \
        sum((k - 1) ** 2 for k in PROBE_ROWS[1:])
    assert amx_like.row_cost == pytest.approx(slope)


def test_dear_rows_keep_a_chain_priced_at_their_cost():
    avx2_like = costs(1.0, 1.25, 1.9, 2.5, 4.1)  # every row ~0.2-0.3 of a step
    assert avx2_like.pass_rows == step_cost.MIN_PASS_ROWS and not avx2_like.rows_are_cheap
    ks = [k for k in PROBE_ROWS if 1 < k <= step_cost.MIN_PASS_ROWS]
    want = sum((k - 1) * (avx2_like.ratio(k) - 1) for k in ks) / sum((k - 1) ** 2 for k in ks)
    assert avx2_like.row_cost == pytest.approx(want) and avx2_like.row_cost > 0.2
    vnni_like = costs(1.0, 1.03, 1.1, 1.45, 2.0)  # a second pass over each tile from 8 rows on
    assert vnni_like.pass_rows == step_cost.MIN_PASS_ROWS and not vnni_like.rows_are_cheap
    big_vnni = costs(1.0, 1.01, 1.04, 1.2, 1.5)  # a model whose weights stream: rows cheap again
    assert big_vnni.pass_rows == 16 and big_vnni.rows_are_cheap
    assert costs(1.0, 0.9, 0.9, 0.95, 1.0).row_cost == 0.005  # noise never prices rows below zero


def test_row_prices_follow_the_probed_times_row_by_row():
    """Rows hidden under the weight stream priced apart from the dearer ones after the knee:
    the probed ratios joined by straight lines, each row the rise to it, never below
    MIN_ROW_PRICE, and a probe that fell (noise) priced as flat."""
    knee = costs(1.0, 1.0, 1.1, 1.8, 3.3)  # 2 rows free, then each row dearer
    prices = knee.row_prices
    assert len(prices) == PROBE_ROWS[-1] - 1  # rows 2 .. 16
    assert prices[0] == step_cost.MIN_ROW_PRICE  # the second row: free, at the floor
    assert prices[1:3] == pytest.approx([0.05, 0.05])  # rows 3, 4: (1.1 - 1.0) / 2 each
    assert prices[3:7] == pytest.approx([0.175] * 4)  # rows 5-8: (1.8 - 1.1) / 4
    assert prices[7:] == pytest.approx([0.1875] * 8)  # rows 9-16: (3.3 - 1.8) / 8
    assert 1.0 + sum(prices[:7]) == pytest.approx(1.8 + step_cost.MIN_ROW_PRICE)  # 8 rows: the probe's time
    assert knee.row_cost < prices[4]  # one slope up to pass_rows prices the dear rows too low
    noisy = costs(1.0, 1.1, 1.05, 1.3, 1.6)  # 4 rows "faster" than 2
    assert noisy.row_prices[1:3] == (step_cost.MIN_ROW_PRICE,) * 2
    floor = step_cost.MIN_ROW_PRICE
    assert 1.0 + sum(noisy.row_prices[:7]) == pytest.approx(1.3 + 2 * floor)  # 8 rows: still the probe's time


def test_auto_drafts_trees_where_rows_are_cheap_or_the_step_is_long():
    """Dear rows keep the chain on a short step (135M, forced AVX2: trees 0.95x the chain) and
    take trees on a long one (1.5B: 1.01-1.19x), at the same ratios."""
    dear = (1.0, 1.53, 1.92, 3.37, 6.42)  # a 1.5B W8A8 step on forced AVX2 (Zen 5)
    short = StepCosts(PROBE_ROWS, tuple(0.0031 * r for r in dear), "avx2")
    long = StepCosts(PROBE_ROWS, tuple(0.0256 * r for r in dear), "avx2")
    assert not short.rows_are_cheap and not short.prefers_trees
    assert not long.rows_are_cheap and long.prefers_trees
    assert short.row_cost == pytest.approx(long.row_cost)  # the trees' pricing is the same
    amx_like = StepCosts(PROBE_ROWS, (0.003, 0.00306, 0.00318, 0.00345, 0.0039), "amx")
    assert amx_like.rows_are_cheap and amx_like.prefers_trees


def test_a_disturbed_probe_is_not_cached():
    assert step_cost._plausible((0.010, 0.0101, 0.0105, 0.012, 0.016))
    assert not step_cost._plausible((0.010, 0.011, 0.004, 0.012, 0.016))  # 4 rows "faster" than 2


@pytest.fixture(scope="module")
def tiny_w8a8(tmp_path_factory, default_model_dir):
    loaded = load_model(make_tiny_model(tmp_path_factory.mktemp("m") / "m", "qwen3", default_model_dir))
    return build_w8a8(loaded.model, loaded.tokenizer, calib_text="a b c d e f g " * 40, samples=2, seq_len=32,
                      progress=False)


@pytest.mark.skipif(ext.decoder_layer_op() is None, reason="the fused step needs the C++ ops")
def test_probe_times_the_fused_step_in_a_cache_of_its_own(tiny_w8a8):
    q = tiny_w8a8
    cache = q.setup_cache(64, 2)
    measured = step_cost.install_measured(q)
    assert measured is not None and measured.kernel_path == ext.kernel_path()
    assert measured.rows == PROBE_ROWS and all(s > 0 for s in measured.seconds)
    assert q.step_costs is measured and (q.row_cost, q.pass_rows) == (measured.row_cost, measured.pass_rows)
    assert q.row_prices == measured.row_prices
    assert q.cache is cache and q.cache.lengths == [0, 0]  # the model's own cache is untouched


@pytest.mark.skipif(ext.decoder_layer_op() is None, reason="the fused step needs the C++ ops")
def test_measured_costs_are_cached_per_kernel_path_unless_disturbed(tiny_w8a8, default_model_dir, tmp_path,
                                                                     monkeypatch):
    probes = []
    plan = [(1e-3, 1.1e-3, 1.2e-3, 1.4e-3, 2.0e-3), (1e-3, 1e-3, 2e-4, 1.4e-3, 2.0e-3)]  # the second: disturbed

    def fake_probe(model, choose_prefetch, choose_distance):
        probes.append(model)
        return plan[min(len(probes) - 1, 1)], (False if choose_prefetch else None), None

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    monkeypatch.setattr(step_cost, "_probe", fake_probe)
    float_model = load_model(make_tiny_model(tmp_path / "f", "qwen3", default_model_dir)).model
    assert step_cost.measure(float_model) is None  # no fused step: nothing to measure
    first = step_cost.measure(tiny_w8a8)
    assert first.seconds == plan[0] and step_cost.measure(tiny_w8a8) == first and len(probes) == 1  # cached
    if ext.kernel_path() == "portable":  # QUASAR_ISA=portable: no lower path to measure apart
        pytest.skip("the process runs the portable path already: no second kernel path to cache apart")
    with ext.forced_kernel_path("portable"):
        assert step_cost.current(tiny_w8a8).seconds == plan[1] and len(probes) == 2  # another path: measured
        step_cost.measure(tiny_w8a8)
        assert len(probes) == 3  # a disturbed probe is not cached: measured again
    step_cost.install_measured(tiny_w8a8)
    assert len(probes) == 3 and tiny_w8a8.step_costs == first


@pytest.mark.skipif(ext.decoder_layer_op() is None or not ext.cpu_runs("avx2"),
                    reason="the fused step on the AVX2 path needs the C++ ops and an AVX2 CPU")
def test_probe_picks_how_the_avx2_stream_is_prefetched_and_results_do_not_change(tiny_w8a8, tmp_path, monkeypatch):
    """On the AVX2 path the probe times one-row steps with the whole weight stream prefetched
    and with only its starts, keeps the faster way with the costs and installs it; the way
    changes speed only: a step's logits are bitwise the same either way."""
    from quasar.models.rows import Rows

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    q = tiny_w8a8
    before = ext.prefetch_whole_stream()
    try:
        with ext.forced_kernel_path("avx2"):
            measured = step_cost.install_measured(q)
            assert measured.kernel_path == "avx2" and measured.prefetch_whole in (True, False)
            assert measured.prefetch_bytes is None  # no W4A8 layers: no distance to choose
            assert ext.prefetch_whole_stream() == measured.prefetch_whole
            assert step_cost.measure(q) == measured  # the choice is cached with the times
            q.setup_cache(64, 1)
            ids = [5, 9, 2, 7, 1, 3]
            outs = []
            with torch.inference_mode():
                q(torch.tensor([ids]), logits="none", slot=0)
                for way in (True, False):
                    ext.prefetch_whole_stream(way)
                    outs.append(q.step(Rows.chain([4], 0, q.cache.lengths)))
            assert torch.equal(outs[0], outs[1])
        with ext.forced_kernel_path("portable"):  # no such choice there
            assert step_cost.measure(q).prefetch_whole is None
    finally:
        ext.prefetch_whole_stream(before)
        q.cache = None


@pytest.mark.skipif(ext.decoder_layer_op() is None, reason="the fused step needs the C++ ops")
def test_each_models_fused_step_sets_its_own_prefetch_choice(tiny_w8a8):
    """The choice is per model (how long its weight streams are): two models in one process (a
    bench's W8A8 and W4A8 verifiers) each get theirs, set before each of their fused steps."""
    from quasar.models.rows import Rows

    q, before, saved = tiny_w8a8, ext.prefetch_whole_stream(), tiny_w8a8.step_costs
    try:
        q.setup_cache(64, 1)
        with torch.inference_mode():
            q(torch.tensor([[5, 9, 2]]), logits="none", slot=0)
            for way in (False, True, False):
                q.step_costs = StepCosts(PROBE_ROWS, (1e-3,) * len(PROBE_ROWS), ext.kernel_path(), way)
                ext.prefetch_whole_stream(not way)  # another model's choice, set meanwhile
                q.step(Rows.chain([4], 0, q.cache.lengths), logits="none")
                assert ext.prefetch_whole_stream() is way
                assert bool(torch.ops.quasar_quant.int8_stream_prefetch(-1)) is way  # the op's own setting
    finally:
        q.step_costs, q.cache = saved, None
        ext.prefetch_whole_stream(before)
