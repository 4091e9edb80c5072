"""Row prices learned from the decoder's own steps (quasar.runtime.learned_prices)."""

import random

import pytest

from quasar.runtime.learned_prices import MIN_STEPS, REPRICE_EVERY, WINDOW, LearnedRowPrices
from quasar.speculative.generate import context_units

FLOOR = 0.005
PROBED = (0.04,) * 15  # what a probe said: rows 2..16


def true_added(k: int) -> float:
    """What rows 2..k add to a one-row step in the steps below: the next two rows nearly
    free, the rows after them dear."""
    return 0.02 * min(k - 1, 2) + 0.25 * max(0, k - 3)


def feed(learner, rng, n, t0, added=true_added, rows=(1, 1, 2, 3, 4, 4, 6), key_cost=2e-4, noise=0.02):
    """n steps of the given row counts at a one-row time t0 and contexts of 0..800 keys,
    each time off by up to +-noise; returns the last prices `record` returned."""
    last = None
    for _ in range(n):
        k, keys = rng.choice(rows), rng.randrange(800)
        units = context_units(key_cost, [(keys, k)])
        seconds = t0 * (units + added(k)) * (1 + rng.uniform(-noise, noise))
        last = learner.record(k, seconds, units) or last
    return last


def cum(prices, k):
    return sum(prices[:k - 1])


def test_prices_follow_the_steps_the_decoder_timed():
    """Rows the window saw enough steps of are priced as they cost (at any context: the K/V
    reads are divided out); rows between two such counts on the straight line between them;
    rows past the last the probe's; and `record` hands back the prices when they change."""
    learner = LearnedRowPrices(PROBED, FLOOR)
    assert learner.prices == PROBED and learner.max_rows == 16
    last = feed(learner, random.Random(0), WINDOW, t0=0.03)
    assert last == learner.prices != PROBED
    for k in (2, 3, 4, 6):
        assert cum(learner.prices, k) == pytest.approx(true_added(k), abs=0.02), k
    assert cum(learner.prices, 5) == pytest.approx((cum(learner.prices, 4) + cum(learner.prices, 6)) / 2)
    assert learner.prices[5:] == PROBED[5:]  # rows 7.. never timed


def test_prices_move_with_the_host_and_forget_the_old_window():
    """Faster memory makes a one-row step shorter while a row's arithmetic costs the same
    seconds: each row's price as a share of the step grows, and a window later the prices
    are the new host's alone."""
    learner = LearnedRowPrices(PROBED, FLOOR)
    rng = random.Random(1)
    feed(learner, rng, WINDOW, t0=0.03)
    slow = learner.prices
    # the same seconds of arithmetic a row over a one-row step 1.5x faster
    feed(learner, rng, WINDOW, t0=0.02, added=lambda k: 1.5 * true_added(k))
    for k in (3, 4, 6):
        assert cum(learner.prices, k) == pytest.approx(1.5 * true_added(k), abs=0.03)
        assert cum(learner.prices, k) > cum(slow, k)


def test_prices_stand_without_one_row_steps():
    """Without MIN_STEPS one-row steps in the window there is nothing to compare with: the
    prices stand, the probe's at first and the last learned ones later."""
    learner = LearnedRowPrices(PROBED, FLOOR)
    rng = random.Random(2)
    assert feed(learner, rng, WINDOW, t0=0.03, rows=(2, 4)) is None
    assert learner.prices == PROBED
    feed(learner, rng, WINDOW, t0=0.03)
    assert learner.prices != PROBED
    feed(learner, rng, WINDOW, t0=0.03, rows=(2, 3, 4))  # the one-row steps leave the window
    learned = learner.prices
    assert feed(learner, rng, WINDOW, t0=0.03, rows=(2, 3, 4)) is None
    assert learner.prices == learned
    assert MIN_STEPS <= REPRICE_EVERY * 4 <= WINDOW


def test_prices_never_fall_under_the_floor_and_odd_steps_are_not_kept():
    """A row count whose steps came out faster than fewer rows' (noise) adds nothing but the
    floor; steps of more rows than the probe priced, and times that cannot be, are not kept."""
    learner = LearnedRowPrices(PROBED[:5], FLOOR)  # rows 2..6
    feed(learner, random.Random(3), WINDOW, t0=0.03, added=lambda k: {1: 0.0, 2: 0.1, 3: 0.05, 4: 0.3}[k],
         rows=(1, 2, 3, 4))
    assert learner.prices[0] == pytest.approx(0.1, abs=0.01)
    assert learner.prices[1] == FLOOR  # 3 rows timed faster than 2
    assert min(learner.prices) >= FLOOR
    kept = len(learner.steps)
    for rows, seconds, units in ((7, 0.05, 1.0), (0, 0.05, 1.0), (2, 0.0, 1.0), (2, float("nan"), 1.0),
                                 (2, 0.05, 0.5)):
        assert learner.record(rows, seconds, units) is None
    assert len(learner.steps) == kept
    with pytest.raises(ValueError):
        LearnedRowPrices((), FLOOR)


def test_context_units_count_each_sequences_keys_once_and_its_rows_share():
    """A step's context units: 1, plus each sequence's keys at key_cost, plus its rows past
    the first at ROW_KEY_SHARE of that (row_cost_at's model of a step)."""
    from quasar.speculative.generate import ROW_KEY_SHARE, row_cost_at

    assert context_units(1e-3, []) == 1.0
    assert context_units(1e-3, [(100, 1)]) == pytest.approx(1.1)
    assert context_units(1e-3, [(100, 3), (50, 1)]) == pytest.approx(1.0 + 0.1 * (1 + 2 * ROW_KEY_SHARE) + 0.05)
    # a k-row step priced by row_cost_at at price p a row takes (units + (k - 1) p) one-row steps without context
    p, kc, keys, k = 0.07, 1e-3, 300, 4
    one_row = context_units(kc, [(keys, 1)])
    assert 1 + (k - 1) * row_cost_at(p, kc, keys) == pytest.approx((context_units(kc, [(keys, k)]) + (k - 1) * p) / one_row)
