"""Row prices learned from the decoder's own verifier steps.

quasar.runtime.step_cost probes a model's steps once, a few dozen short chains at load, and
caches what it finds for good. On a shared host what a row costs moves within minutes (the
memory's speed, the other tenants' compute), so a probe taken at one moment can price rows at
half or twice what the decode then pays for them, and every tree after it is sized by that.
So the decoder times each verifier step and hands it to `LearnedRowPrices.record`, and the
prices of rows 2, 3, ... are read again from the last `WINDOW` steps:

- a one-row step's time without context, T0: the median over the window's one-row steps of
  their time over their context units (`generate.context_units`: the K/V reads a step adds);
- what rows 2..k add, for each row count k the window holds `MIN_STEPS` steps of: the median
  of (time / T0 - context units) over those steps;
- between row counts read so, straight lines; past the last, the probe's own prices; each
  row at least the probe's floor (step_cost.MIN_ROW_PRICE): `joined_prices`, the rule the
  probe's own prices follow (step_cost.StepCosts.row_prices).

All row counts are read from the same window, so a drift of the host's speed reaches a k-row
step and the one-row step it is compared with alike. While the window holds fewer than
`MIN_STEPS` one-row steps (at first, or while drafts land step after step), the prices stand.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["LearnedRowPrices", "MIN_STEPS", "REPRICE_EVERY", "WINDOW", "joined_prices"]

WINDOW = 192  # steps the prices are read from: two or three requests' worth
MIN_STEPS = 8  # steps of a row count the window holds before their median is trusted
REPRICE_EVERY = 8  # steps between readings


def joined_prices(points: list[tuple[int, float]], floor: float) -> tuple[float, ...]:
    """What rows 2, 3, ... up to the last point's row count each add to a step, as a fraction
    of a one-row step, from `points` (row count k, a k-row step's time over a one-row step's;
    k increasing from (1, 1.0)): the points joined by straight lines, never falling (a point
    under an earlier one was noise), at least `floor` a row."""
    ratios = [1.0]
    for k in range(2, points[-1][0] + 1):
        hi = next(i for i, (r, _) in enumerate(points) if r >= k)
        (k0, r0), (k1, r1) = points[hi - 1], points[hi]
        ratios.append(max(ratios[-1], r0 + (r1 - r0) * (k - k0) / (k1 - k0)))
    return tuple(max(floor, b - a) for a, b in zip(ratios, ratios[1:]))


class LearnedRowPrices:
    """The prices of rows 2 .. len(probed) + 1 of a step, from the probe's (`probed`, each a
    fraction of a one-row step) until the decoder's own steps say otherwise; none under `floor`."""

    def __init__(self, probed: tuple[float, ...], floor: float):
        if not probed:
            raise ValueError("a learner needs the probe's prices of at least one row")
        self.probed, self.floor = tuple(probed), floor
        self.prices = self.probed
        self.max_rows = len(probed) + 1
        self.steps: deque[tuple[int, float, float]] = deque(maxlen=WINDOW)  # (rows, seconds, units)
        self._since = 0

    def record(self, rows: int, seconds: float, units: float) -> tuple[float, ...] | None:
        """A verifier step of `rows` rows took `seconds` at `units` context units. Returns the
        prices when this step made them change (read every REPRICE_EVERY steps), else None.
        Steps of more rows than the probe priced are not kept."""
        if not 1 <= rows <= self.max_rows or not seconds > 0 or not units >= 1.0:
            return None
        self.steps.append((rows, seconds, units))
        self._since += 1
        if self._since < REPRICE_EVERY:
            return None
        self._since = 0
        prices = self.read()
        if prices == self.prices:
            return None
        self.prices = prices
        return prices

    def read(self) -> tuple[float, ...]:
        """The prices the window's steps give (see the module doc)."""
        ones = [s / u for k, s, u in self.steps if k == 1]
        if len(ones) < MIN_STEPS:  # drafts landed step after step: nothing to compare with
            return self.prices
        t0 = statistics.median(ones)
        added: dict[int, list[float]] = {}
        for k, s, u in self.steps:
            if k > 1:
                added.setdefault(k, []).append(s / t0 - u)
        points = [(1, 1.0)]  # (rows, a step's time over a one-row step's), never falling
        for k in sorted(added):
            if len(added[k]) >= MIN_STEPS:
                points.append((k, max(points[-1][1], 1.0 + statistics.median(added[k]))))
        for k in range(points[-1][0] + 1, self.max_rows + 1):  # past the last row count read: the probe's prices
            points.append((k, points[-1][1] + self.probed[k - 2]))
        return tuple(round(p, 6) for p in joined_prices(points, self.floor))
