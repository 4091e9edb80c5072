"""Measured step costs (quasar.quant.step_cost): the rule that turns step times into a row
cost, a pass size and the auto drafter's choice, and the probe on a real fused W8A8 step."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from quasar.models.loader import load_model
from quasar.quant import ext, step_cost
from quasar.quant.quantize import build_w8a8
from quasar.quant.step_cost import PROBE_ROWS, StepCosts


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


@pytest.mark.skipif(ext.decoder_layer_op() is None, reason="the fused step needs the C++ ops")
def test_probe_times_the_fused_step_caches_it_and_leaves_the_cache_alone(tmp_path, default_model_dir, monkeypatch):
    loaded = load_model(make_tiny_model(tmp_path / "m", "qwen3", default_model_dir))
    q = build_w8a8(loaded.model, loaded.tokenizer, calib_text="a b c d e f g " * 40, samples=2, seq_len=32,
                   progress=False)
    cache = q.setup_cache(64, 2)
    measured = step_cost.install_measured(q)
    assert measured is not None and measured.kernel_path == ext.kernel_path()
    assert measured.rows == PROBE_ROWS and all(s > 0 for s in measured.seconds)
    assert q.step_costs is measured and (q.row_cost, q.pass_rows) == (measured.row_cost, measured.pass_rows)
    assert q.cache is cache and q.cache.lengths == [0, 0]  # the probe ran in a cache of its own

    def no_probe(model):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(step_cost, "_probe", no_probe)
    assert step_cost.measure(q) == measured  # same shapes, path, build and threads: from the cache
    torch.set_num_threads(torch.get_num_threads())
    with ext.forced_kernel_path("portable"):
        with pytest.raises(AssertionError, match="measured again"):
            step_cost.current(q)  # another kernel path is measured anew
    assert step_cost.measure(load_model(make_tiny_model(tmp_path / "f", "qwen3", default_model_dir)).model) is None
