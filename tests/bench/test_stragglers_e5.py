"""E5i's bookkeeping: which steps belong to which arm, and the paired ratios.

Pure functions over step records shaped like ``workers.dd.DdStepRecord.to_dict()``:
no processes needed. The learning phase's plans (neither the frozen plan nor the
equal split) must never be counted as an arm: before, every size other than the
plan counted as "equal", so a learning plan was paired as if it were the equal split.
"""

from __future__ import annotations

import pytest

from bench.stragglers import _e5_profile, _paired_windows


def _recs(sizes: list[int], period: dict[int, float], units: int = 1024) -> list[dict[str, float]]:
    out, t = [], 0.0
    for i, s in enumerate(sizes):
        t += period[s]
        out.append({"step": i + 1, "size": s, "units_sum": units, "t": t, "compute_s": period[s] / 2})
    return out


def test_pairs_count_only_the_two_arms_after_the_learning_phase() -> None:
    # equal 512 at start, a learning plan 600, then the frozen plan 680 / equal 512 in turns
    period = {512: 1.0, 600: 0.1, 680: 0.8}
    sizes = [512] * 5 + [600] * 5 + [680] * 5 + [512] * 5 + [680] * 5
    recs = _recs(sizes, period)
    since = recs[10]["t"]  # the alternation begins with the first 680 step
    ratios = _paired_windows(recs, 680, 512, since=since)
    assert ratios == pytest.approx([1.0 / 0.8, 1.0 / 0.8])
    # without `since`, the first equal window pairs with nothing: the learning plan breaks the run
    assert _paired_windows(recs, 680, 512) == pytest.approx([1.0 / 0.8, 1.0 / 0.8])


def test_profile_splits_steps_by_arm() -> None:
    period = {512: 1.0, 600: 0.1, 680: 0.8}
    sizes = [600] * 4 + [680] * 4 + [512] * 4
    recs = _recs(sizes, period)
    prof = _e5_profile([{"dd_steps": recs}, {"dd_steps": recs}], 680, 512, skip=1)
    assert prof["dd"]["steps"] == 3 and prof["equal"]["steps"] == 3
    assert prof["dd"]["period_s"] == pytest.approx(0.8) and prof["equal"]["period_s"] == pytest.approx(1.0)
    assert prof["dd"]["w1"]["compute_s"] == pytest.approx(0.4)
