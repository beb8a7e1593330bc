"""E5i's bookkeeping: which steps belong to which arm, and the paired ratios.

Pure functions over step records shaped like ``workers.dd.DdStepRecord.to_dict()``:
no processes needed. The learning phase's plans (neither the frozen plan nor the
equal split) must never be counted as an arm: before, every size other than the
plan counted as "equal", so a learning plan was paired as if it were the equal split.
"""

from __future__ import annotations

import statistics

import pytest

from bench.stragglers import _e5_profile, _InterleavedDd, _paired_windows
from controller.config import DdConfig, MonitorConfig
from controller.monitor import MonitorSnapshot, WindowStats
from controller.policy.dd import DdPolicy


def _recs(sizes: list[int], period: dict[int, float], units: int = 1024) -> list[dict[str, float]]:
    out, t = [], 0.0
    for i, s in enumerate(sizes):
        t += period[s]
        out.append({"step": i + 1, "size": s, "units_sum": units, "size_sum": units, "t": t,
                    "compute_s": period[s] / 2})
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


def test_profile_period_is_per_global_batch_and_agrees_with_the_pairs() -> None:
    # What a run on the bench's small data looked like: at an epoch's end one worker finds no
    # lease and trains 0 units while its peer trains its share (a partial step), more often
    # under the DD plan. The DD arm: 3 full steps of 0.8 s then a 300-unit step of 0.5 s; the
    # equal arm: full steps of 1.0 s. Windows of 9 steps, the first (the switch) dropped.
    g = 1024
    recs: list[dict[str, float]] = []
    t = 0.0
    for w in range(6):
        dd = w % 2 == 1
        for i in range(9):
            part = dd and i % 4 == 0 and i > 0
            t += 0.5 if part else (0.8 if dd else 1.0)
            recs.append({"step": len(recs) + 1, "size": 680 if dd else 512, "units_sum": 300 if part else g,
                         "size_sum": g, "t": t})
    pairs = _paired_windows(recs, 680, 512)
    per_window = ((3 * g + 300) * 2 / ((3 * 0.8 + 0.5) * 2)) / (g / 1.0)  # samples/s dd / equal
    assert pairs == pytest.approx([per_window] * 5)
    prof = _e5_profile([{"dd_steps": recs}], 680, 512)
    # seconds per global batch: the same throughput the pairs measure (the median step period,
    # 0.8 vs 1.0 s, says 1.25x: it ignores that 1 DD step in 4 trained 300 units, not 1024)
    assert prof["equal"]["period_s"] / prof["dd"]["period_s"] == pytest.approx(statistics.median(pairs), rel=1e-3)
    assert prof["dd"]["step_median_s"] == pytest.approx(0.8) and prof["equal"]["step_median_s"] == pytest.approx(1.0)
    assert prof["dd"]["partial_steps"] == 6 and prof["equal"]["partial_steps"] == 0
    assert prof["dd"]["units_per_step"] == pytest.approx((3 * g + 300) / 4, abs=0.1)


def test_interleaving_waits_for_the_policy_to_turn_after_noisy_first_windows() -> None:
    # The real DD policy fed 2 s monitor windows: 6 windows in which the slowed worker 1 looks
    # faster (warm-up noise), then worker 0 twice as fast. The EMA needs several windows to
    # turn; the plan frozen for the interleaving must be the turned one (~2:1), not the first.
    pol = _InterleavedDd(DdPolicy(MonitorConfig(window_s=2.0), DdConfig(global_batch=1024, min_change=0.05)),
                         {0: 512, 1: 512}, window_s=10.0)
    windows: list[WindowStats] = []
    for i in range(200):
        sps = (600.0, 800.0) if i < 6 else (1600.0, 800.0)
        windows.append(WindowStats(i, 2.0 * i, 2.0 * i + 2, {0: 0.5, 1: 0.5}, {0: sps[0], 1: sps[1]}))
        for tick in range(20):  # the controller ticks every 0.1 s
            now = 2.0 * i + 2 + 0.1 * tick
            pol.evaluate(MonitorSnapshot(now, tuple(windows)), now)
        if pol.plan is not None:
            break
    assert pol.plan is not None and pol.settled
    assert pol.learned[0]["sizes"] == [476, 548]  # the first plan went the wrong way
    assert pol.plan[0] > 640 and pol.plan[0] + pol.plan[1] == 1024, pol.learned
