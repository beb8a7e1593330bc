"""AntDT-DD: per-worker batch sizes for all-reduce mode on dedicated clusters.

In synchronous all-reduce every step waits for the slowest worker: step time =
max_i(t_i(n_i)) where worker i spends ``t_i(n) = a_i + b_i * n`` seconds on a
batch of ``n`` (``a_i``: fixed per-step cost - pull/push RPCs, lease fetches,
optimizer; ``b_i``: per-sample cost). With the global batch ``N`` held
constant, the step time is smallest when every worker's predicted time is
equal::

    T   = (N + sum_i a_i / b_i) / sum_i (1 / b_i)
    n_i = (T - a_i) / b_i          (workers below min_size are pinned there and T re-solved)

The policy fits ``a_i, b_i`` per worker by least squares on the (batch size,
step time) pairs of its recent monitor windows (the batch size of a window is
``batch_time x samples_per_s``, so a plan still being adopted is measured as
what it was). Until a worker has two distinct sizes observed (or the fit is
degenerate: slope <= 0), it falls back to sizes proportional to samples/s.

Equalising samples/s alone (the old policy) converges to the same equal-time
split only when the fixed costs are negligible; with large ``a_i`` the
proportional iteration is slow and noisy, and it moved the whole way each
window. Every decision here is damped (move ``damping`` of the way from the
current sizes to the target) and has hysteresis: no plan while the current
sizes' predicted step time is within ``tolerance`` of the balanced one, or
while no size would change by more than ``min_change``.

Sizes are integers that always sum exactly to the global batch (largest
remainder rounding), each >= ``min_size``.

Example::

    proportional_batch_sizes({0: 100.0, 1: 100.0, 2: 50.0}, 250)   # {0: 100, 1: 100, 2: 50}
    balanced_batch_sizes({0: (0.05, 0.001), 1: (0.10, 0.002)}, 128)  # {0: 102, 1: 26}
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping, Sequence

from controller.config import DdConfig, MonitorConfig
from controller.monitor import MonitorSnapshot
from controller.policy.base import Action, Policy, SetBatchSizes, StragglerDetector, WindowCursor, detection_actions


def round_to_total(quotas: Mapping[int, float], total: int, minimum: int = 1) -> dict[int, int]:
    """Integers close to ``quotas`` that sum exactly to ``total``, each >= ``minimum``.

    Quotas are floored and lifted to ``minimum``; a shortfall goes +1 to the
    largest remainders (ties to the lower index), an overshoot (from lifting)
    is taken from the largest surplus above ``minimum``.

    Args:
        quotas: real-valued shares by worker index.
        total: the exact sum wanted; >= ``minimum x len(quotas)``.
        minimum: the smallest size any worker may get (>= 1).

    Raises:
        ValueError: no workers, or a total too small for the minimum.
    """
    if not quotas:
        raise ValueError("no workers to size batches for")
    n = len(quotas)
    if total < minimum * n:
        raise ValueError(f"global batch {total} is smaller than the {n} workers"
                         f"{' (each needs >= 1)' if minimum == 1 else f' x min_size {minimum}'}")
    sizes = {k: max(minimum, int(math.floor(q))) for k, q in quotas.items()}
    left = total - sum(sizes.values())
    if left > 0:  # floors fall short by < n (+ what the quotas miss): +1 to the largest remainders
        order = sorted(quotas, key=lambda k: (-(quotas[k] - sizes[k]), k))
        i = 0
        while left > 0:
            sizes[order[i % n]] += 1
            left -= 1
            i += 1
    while left < 0:  # lifting tiny quotas to the minimum overshot: take from the largest surplus
        k = max((k for k in sizes if sizes[k] > minimum), key=lambda k: (sizes[k] - quotas[k], -k))
        sizes[k] -= 1
        left += 1
    return sizes


def proportional_batch_sizes(speeds: Mapping[int, float], global_batch: int, min_size: int = 1) -> dict[int, int]:
    """Integer batch sizes proportional to ``speeds`` summing exactly to ``global_batch``.

    Quotas ``global_batch * speed / sum(speeds)`` are floored, lifted to >= ``min_size``
    (nobody may starve), and the difference is settled by largest remainder
    (ties to the lower worker index).

    Args:
        speeds: samples/s by worker index; each finite and > 0.
        global_batch: the total, >= the number of workers x ``min_size``.
        min_size: the smallest size any worker gets.

    Raises:
        ValueError: no workers, a bad speed, or a global batch smaller than the worker count.
    """
    if not speeds:
        raise ValueError("no workers to size batches for")
    bad = {k: v for k, v in speeds.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)}
    if bad:
        raise ValueError(f"speeds must be finite and > 0, got {bad}")
    total = float(sum(speeds.values()))
    return round_to_total({k: global_batch * v / total for k, v in speeds.items()}, global_batch, min_size)


def fit_step_cost(points: Sequence[tuple[float, float]], min_spread: float = 0.05) -> tuple[float, float] | None:
    """Least-squares ``t = a + b * n`` over (n, t) pairs, or None when it cannot be trusted.

    None when the sizes do not spread by at least ``min_spread`` of their mean
    (one size observed: the intercept is unidentifiable) or the slope is not
    positive (noise dominates). A negative intercept is clamped to 0 and the
    slope refitted through the origin.

    Args:
        points: (batch size, step seconds) pairs; sizes and times > 0.
        min_spread: smallest (max - min) / mean of the sizes to fit at all.
    """
    if len(points) < 2:
        return None
    ns = [p[0] for p in points]
    mean_n = sum(ns) / len(ns)
    if mean_n <= 0 or (max(ns) - min(ns)) < min_spread * mean_n:
        return None
    mean_t = sum(p[1] for p in points) / len(points)
    sxx = sum((n - mean_n) ** 2 for n in ns)
    b = sum((n - mean_n) * (t - mean_t) for n, t in points) / sxx
    if not (math.isfinite(b) and b > 0):
        return None
    a = mean_t - b * mean_n
    if a < 0:
        a, b = 0.0, sum(n * t for n, t in points) / sum(n * n for n in ns)
    return a, b


def balanced_batch_sizes(costs: Mapping[int, tuple[float, float]], global_batch: int,
                         min_size: int = 1) -> dict[int, int]:
    """Integer sizes that equalise the predicted step times ``a_i + b_i * n_i``.

    ``T = (N + sum a_i/b_i) / sum 1/b_i``, ``n_i = (T - a_i) / b_i``; a worker
    whose ``n_i`` falls below ``min_size`` is pinned there and T re-solved for
    the others. Rounded with :func:`round_to_total` (sum exactly ``global_batch``).

    Args:
        costs: (a_i seconds, b_i seconds per unit) by worker index; a >= 0, b > 0.
        global_batch: N, >= workers x ``min_size``.
        min_size: the smallest size any worker gets.

    Raises:
        ValueError: no workers, a bad cost, or a global batch too small.
    """
    if not costs:
        raise ValueError("no workers to size batches for")
    bad = {k: v for k, v in costs.items()
           if not (math.isfinite(v[0]) and math.isfinite(v[1]) and v[0] >= 0 and v[1] > 0)}
    if bad:
        raise ValueError(f"step costs (a, b) must be finite with a >= 0 and b > 0, got {bad}")
    if global_batch < min_size * len(costs):
        return round_to_total({k: 0.0 for k in costs}, global_batch, min_size)  # raises the clear error
    return round_to_total(_balanced_quotas(costs, global_batch, min_size), global_batch, min_size)


def _balanced_quotas(costs: Mapping[int, tuple[float, float]], global_batch: int, min_size: int) -> dict[int, float]:
    free = dict(costs)
    pinned: dict[int, float] = {}
    while free:
        left = global_batch - min_size * len(pinned)
        t = (left + sum(a / b for a, b in free.values())) / sum(1 / b for _, b in free.values())
        quotas = {k: (t - a) / b for k, (a, b) in free.items()}
        low = [k for k, q in quotas.items() if q < min_size]
        if not low:
            return {**quotas, **pinned}
        for k in low:
            pinned[k] = float(min_size)
            del free[k]
    return pinned


def predicted_times(costs: Mapping[int, tuple[float, float]], sizes: Mapping[int, int]) -> dict[int, float]:
    """``a_i + b_i * n_i`` for every worker in ``costs``."""
    return {k: a + b * sizes[k] for k, (a, b) in costs.items()}


class DdPolicy(Policy):
    """Re-balances batch sizes to equalise predicted step times (see the module docstring).

    Args:
        monitor: detection thresholds (slow workers are still reported as events).
        dd: global batch, min size, damping, hysteresis and the fit window.
    """

    name = "dd"

    def __init__(self, monitor: MonitorConfig, dd: DdConfig) -> None:
        dd.validate()
        self.cfg = dd
        self.detector = StragglerDetector(monitor.ratio, monitor.consecutive, monitor.min_peers)
        self._cursor = WindowCursor()
        self.speeds: dict[int, float] = {}
        self.sizes: dict[int, int] = {}
        self.points: dict[int, deque[tuple[float, float]]] = {}
        self.samples_per_unit = 1.0
        self.costs: dict[int, tuple[float, float]] = {}  # last fit, per unit (for reports and tests)
        self._fits: dict[int, tuple[float, float]] = {}  # last good fit per worker, per sample

    def evaluate(self, snapshot: MonitorSnapshot, now: float) -> list[Action]:
        out: list[Action] = []
        fresh = self._cursor.new(snapshot)
        for w in fresh:
            out += detection_actions("worker", self.detector, w.worker_batch_time, w.index)
            self._observe(w.worker_samples_per_s, w.worker_batch_time)
        if not fresh or not self.speeds or len(self.speeds) * self.cfg.min_size > self.cfg.global_batch:
            return out
        current = self._current()
        target, mode = self._target()
        if not self._worth_it(current, target, mode):
            return out
        d = self.cfg.damping
        sizes = round_to_total({k: current[k] + d * (target[k] - current[k]) for k in target},
                               self.cfg.global_batch, self.cfg.min_size)
        if not self._changed(sizes):
            return out
        self.sizes = sizes
        reason: dict[str, Any] = {"window": fresh[-1].index, "mode": mode, "target": target,
                        "samples_per_s": {k: round(v, 3) for k, v in self.speeds.items()},
                        "global_batch": self.cfg.global_batch}
        if mode == "fit":
            reason["step_cost_a_b"] = {k: (round(a, 6), round(b, 8)) for k, (a, b) in self.costs.items()}
        out.append(SetBatchSizes("workers", reason, sizes=sizes))
        return out

    def _observe(self, sps: Mapping[int, float], batch_time: Mapping[int, float]) -> None:
        n_est: dict[int, float] = {}
        for k, v in sps.items():
            if v > 0:  # EMA: one noisy window must not swing the fallback split
                self.speeds[k] = v if k not in self.speeds else (1 - self.cfg.smoothing) * self.speeds[k] + self.cfg.smoothing * v
                t = batch_time.get(k, 0.0)
                if t > 0:
                    n_est[k] = v * t
                    self.points.setdefault(k, deque(maxlen=self.cfg.fit_windows)).append((v * t, t))
        if n_est and set(n_est) >= set(self.speeds):  # every worker this window: sizes sum to N units
            self.samples_per_unit = sum(n_est.values()) / self.cfg.global_batch

    def _current(self) -> dict[int, int]:
        if set(self.sizes) == set(self.speeds):
            return dict(self.sizes)
        return round_to_total({k: 1.0 for k in self.speeds}, self.cfg.global_batch, 1)  # workers start equal

    def _target(self) -> tuple[dict[int, int], str]:
        fits = {k: self._fit(k) for k in self.speeds}
        if all(f is not None for f in fits.values()):
            r = self.samples_per_unit
            self.costs = {k: (f[0], f[1] * r) for k, f in fits.items() if f is not None}
            return balanced_batch_sizes(self.costs, self.cfg.global_batch, self.cfg.min_size), "fit"
        return proportional_batch_sizes(self.speeds, self.cfg.global_batch, self.cfg.min_size), "proportional"

    def _fit(self, k: int) -> tuple[float, float] | None:
        """A fresh fit, else the last one while it still predicts the recent windows.

        Once the sizes settle the fit has one size to go on (unidentifiable); the
        last fit stays in use while the last 3 windows' mean time is within
        ``2 x tolerance`` of its prediction. A worker whose speed changes drops
        it and falls back to samples/s until new sizes make it fittable again.
        """
        pts = list(self.points.get(k, ()))
        f = fit_step_cost(pts)
        if f is not None:
            self._fits[k] = f
            return f
        last = self._fits.get(k)
        if last is None or not pts:
            return None
        recent = pts[-3:]
        pred = sum(last[0] + last[1] * n for n, _ in recent)
        if abs(sum(t for _, t in recent) / pred - 1) <= 2 * self.cfg.tolerance:
            return last
        del self._fits[k]
        return None

    def _worth_it(self, current: dict[int, int], target: dict[int, int], mode: str) -> bool:
        """Hysteresis: the current split's predicted step time must exceed the target's by ``tolerance``."""
        if set(current) != set(self.sizes):
            return True  # first plan / membership change
        if mode == "fit":
            now_t = max(predicted_times(self.costs, current).values())
            best_t = max(predicted_times(self.costs, target).values())
        else:
            now_t = max(current[k] / self.speeds[k] for k in current)
            best_t = max(target[k] / self.speeds[k] for k in target)
        return now_t > (1 + self.cfg.tolerance) * best_t

    def _changed(self, sizes: dict[int, int]) -> bool:
        if set(sizes) != set(self.sizes):
            return True
        return any(abs(sizes[k] - self.sizes[k]) > self.cfg.min_change * self.sizes[k] for k in sizes)
