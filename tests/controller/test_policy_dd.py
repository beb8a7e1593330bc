"""DD policy: step-cost fit, balanced sizes, damping and hysteresis in a closed loop.

The closed loop feeds the policy synthetic monitor windows from workers whose
step time is ``a_i + b_i * n_i`` (times noise), adopting each plan one window
after it is sent, as real workers do (workers/dd.py switches at a shared step).
"""

from __future__ import annotations

import random

import pytest

from controller.config import DdConfig, MonitorConfig
from controller.monitor import MonitorSnapshot, WindowStats
from controller.policy.base import SetBatchSizes
from controller.policy.dd import DdPolicy, balanced_batch_sizes, fit_step_cost, round_to_total


def closed_loop(pol: DdPolicy, costs: dict[int, tuple[float, float]], n_global: int, windows: int,
                noise: float = 0.0, seed: int = 0, times: bool = True) -> tuple[list[dict[int, int]], list[int]]:
    """Sizes in force per window and the windows at which a plan was sent."""
    rng = random.Random(seed)
    sizes = round_to_total({k: 1.0 for k in costs}, n_global)
    incoming: dict[int, dict[int, int]] = {}
    ws: list[WindowStats] = []
    history, planned = [], []
    for i in range(windows):
        sizes = incoming.pop(i, sizes)
        bt = {k: (a + b * sizes[k]) * max(0.5, 1 + rng.gauss(0, noise)) for k, (a, b) in costs.items()}
        ws.append(WindowStats(i, i, i + 1, worker_batch_time=bt if times else {},
                              worker_samples_per_s={k: sizes[k] / bt[k] for k in costs}))
        acts = [x for x in pol.evaluate(MonitorSnapshot(i + 1.0, tuple(ws[-6:])), i + 1.0) if isinstance(x, SetBatchSizes)]
        if acts:
            assert sum(acts[-1].sizes.values()) == n_global
            assert min(acts[-1].sizes.values()) >= pol.cfg.min_size
            incoming[i + 2] = dict(acts[-1].sizes)  # adopted a window later
            planned.append(i)
        history.append(dict(sizes))
    return history, planned


def test_fit_step_cost_recovers_a_and_b_and_refuses_one_size() -> None:
    pts = [(n, 0.03 + 0.002 * n) for n in (64, 80, 50, 64)]
    a, b = fit_step_cost(pts)
    assert a == pytest.approx(0.03) and b == pytest.approx(0.002)
    assert fit_step_cost([(64, 0.1), (64, 0.12), (64, 0.09)]) is None  # intercept unidentifiable
    assert fit_step_cost([(64, 0.2), (80, 0.1)]) is None  # bigger batch faster: noise, not a cost
    assert fit_step_cost([(10, 0.01), (20, 0.025)]) == (0.0, pytest.approx((0.1 + 0.5) / 500))  # a < 0 clamped


def test_balanced_sizes_equalise_predicted_times_and_sum_exactly() -> None:
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(1, 16)
        costs = {i: (rng.uniform(0, 0.2), rng.uniform(1e-4, 1e-2)) for i in range(n)}
        g = rng.randint(4 * n, 4000)
        m = rng.randint(1, 4)
        sizes = balanced_batch_sizes(costs, g, m)
        assert sum(sizes.values()) == g and min(sizes.values()) >= m
        t = {k: a + b * sizes[k] for k, (a, b) in costs.items()}
        top = max(t, key=t.get)
        # the slowest worker could not hand one unit to anyone without making that one as slow
        if sizes[top] > m:
            assert all(t[top] - costs[top][1] <= t[k] + costs[k][1] + 1e-12 for k in costs)
    assert balanced_batch_sizes({0: (0.0, 0.001), 1: (0.0, 0.002)}, 128) == {0: 85, 1: 43}
    assert balanced_batch_sizes({0: (0.05, 0.001), 1: (0.10, 0.002)}, 128) == {0: 102, 1: 26}
    assert balanced_batch_sizes({0: (0.0, 0.001), 1: (1.0, 0.001)}, 100, min_size=5) == {0: 95, 1: 5}  # pinned
    with pytest.raises(ValueError, match="global batch 7 is smaller than the 4 workers x min_size 2"):
        balanced_batch_sizes({i: (0.0, 1.0) for i in range(4)}, 7, 2)
    with pytest.raises(ValueError, match=r"step costs \(a, b\) must be finite with a >= 0 and b > 0"):
        balanced_batch_sizes({0: (0.0, 0.0)}, 8)


def test_runaway_case_converges_to_the_balanced_split() -> None:
    # E5's shape: per-step fixed cost comparable to a batch's per-sample cost, worker 1 2x slower in both.
    costs = {0: (0.04, 0.0005), 1: (0.08, 0.001)}
    best = balanced_batch_sizes(costs, 128)
    assert best == {0: 112, 1: 16}
    pol = DdPolicy(MonitorConfig(), DdConfig(global_batch=128))
    hist, planned = closed_loop(pol, costs, 128, 40, noise=0.03)
    assert abs(hist[-1][1] - best[1]) <= 2
    assert all(abs(h[1] - best[1]) <= 2 for h in hist[-10:])
    assert all(p < 30 for p in planned), f"re-planned on noise at windows {planned}"  # hysteresis holds still
    assert min(h[1] for h in hist) >= best[1] - 3  # damped: no overshoot to a starving split


def test_pure_per_sample_cost_converges_to_the_speed_split() -> None:
    pol = DdPolicy(MonitorConfig(), DdConfig(global_batch=128))
    hist, _ = closed_loop(pol, {0: (0.0, 0.001), 1: (0.0, 0.002)}, 128, 30, noise=0.03, seed=3)
    assert abs(hist[-1][0] - 85) <= 2


def test_damping_moves_part_of_the_way_and_one_size_falls_back_to_proportional() -> None:
    pol = DdPolicy(MonitorConfig(), DdConfig(global_batch=100, damping=0.5, smoothing=1.0))

    def window(i: int, sps: dict[int, float]) -> WindowStats:
        return WindowStats(i, i, i + 1, worker_batch_time={k: 50 / v for k, v in sps.items()}, worker_samples_per_s=sps)

    ws = [window(0, {0: 100.0, 1: 100.0})]
    acts = [a for a in pol.evaluate(MonitorSnapshot(1, tuple(ws)), 1) if isinstance(a, SetBatchSizes)]
    assert acts[0].sizes == {0: 50, 1: 50}
    ws.append(window(1, {0: 100.0, 1: 50.0}))  # still one size per worker: samples/s split, half way
    acts = [a for a in pol.evaluate(MonitorSnapshot(2, tuple(ws)), 2) if isinstance(a, SetBatchSizes)]
    assert acts[0].evidence["mode"] == "proportional"
    assert acts[0].sizes == {0: 59, 1: 41}  # target 67/33, half way: 58.5/41.5 (tie to the lower index)


def test_dd_config_validates_the_new_keys() -> None:
    for kw, msg in ((dict(damping=0.0), "dd.damping"), (dict(min_size=0), "dd.min_size"),
                    (dict(global_batch=8, min_size=9), "dd.min_size"), (dict(tolerance=1.0), "dd.tolerance"),
                    (dict(fit_windows=1), "dd.fit_windows")):
        with pytest.raises(ValueError, match=msg):
            DdConfig(**kw).validate()


@pytest.mark.parametrize("times", [True, False], ids=["fit", "samples-per-s-only"])
def test_hysteresis_alone_holds_still_on_noise(times: bool) -> None:
    # min_change=0: only the predicted-step-time tolerance stands between noise and a re-plan per window
    pol = DdPolicy(MonitorConfig(), DdConfig(global_batch=1024, min_change=0.0))
    costs = {0: (0.04, 0.00005), 1: (0.08, 0.0001)} if times else {0: (0.0, 0.0001), 1: (0.0, 0.0002)}
    hist, planned = closed_loop(pol, costs, 1024, 60, noise=0.03, seed=5, times=times)
    assert len(planned) >= 2 and all(p < 25 for p in planned), f"re-planned on noise at windows {planned}"
    step = lambda sizes: max(a + b * sizes[k] for k, (a, b) in costs.items())  # noqa: E731
    assert step(hist[-1]) <= 1.05 * step(balanced_batch_sizes(costs, 1024))  # within the tolerance of the best
