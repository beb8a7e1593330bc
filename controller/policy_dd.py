"""AntDT-DD: per-worker batch sizes for all-reduce mode on dedicated clusters.

In synchronous all-reduce every step waits for the slowest worker: step time =
max_i(batch_i / speed_i). Giving each worker a batch proportional to its
measured speed (samples/s), with the global batch held constant, equalises the
per-worker times. Sizes are integers that always sum exactly to the global
batch (largest-remainder rounding) and are each >= 1.

Example::

    proportional_batch_sizes({0: 100.0, 1: 100.0, 2: 50.0}, 250)   # {0: 100, 1: 100, 2: 50}
"""

from __future__ import annotations

import math
from typing import Mapping

from controller.config import DdConfig, MonitorConfig
from controller.monitor import MonitorSnapshot
from controller.policy import Action, Policy, SetBatchSizes, StragglerDetector, WindowCursor, detection_actions


def proportional_batch_sizes(speeds: Mapping[int, float], global_batch: int) -> dict[int, int]:
    """Integer batch sizes proportional to ``speeds`` summing exactly to ``global_batch``.

    Quotas ``global_batch * speed / sum(speeds)`` are floored, lifted to >= 1
    (nobody may starve), and the difference is settled by largest remainder
    (ties to the lower worker index).

    Args:
        speeds: samples/s by worker index; each finite and > 0.
        global_batch: the total, >= the number of workers.

    Raises:
        ValueError: no workers, a bad speed, or a global batch smaller than the worker count.
    """
    if not speeds:
        raise ValueError("no workers to size batches for")
    bad = {k: v for k, v in speeds.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)}
    if bad:
        raise ValueError(f"speeds must be finite and > 0, got {bad}")
    n = len(speeds)
    if global_batch < n:
        raise ValueError(f"global batch {global_batch} is smaller than the {n} workers (each needs >= 1)")
    total = float(sum(speeds.values()))
    quotas = {k: global_batch * v / total for k, v in speeds.items()}
    sizes = {k: max(1, int(math.floor(q))) for k, q in quotas.items()}
    left = global_batch - sum(sizes.values())
    if left > 0:  # floors fall short by < n: +1 to the largest remainders
        for k in sorted(quotas, key=lambda k: (-(quotas[k] - sizes[k]), k))[:left]:
            sizes[k] += 1
    while left < 0:  # lifting tiny quotas to 1 overshot: take from the largest surplus
        k = max((k for k in sizes if sizes[k] > 1), key=lambda k: (sizes[k] - quotas[k], -k))
        sizes[k] -= 1
        left += 1
    return sizes


class DdPolicy(Policy):
    """Re-balances batch sizes each window from the workers' samples/s.

    Args:
        monitor: detection thresholds (slow workers are still reported as events).
        dd: global batch and the change threshold.
    """

    name = "dd"

    def __init__(self, monitor: MonitorConfig, dd: DdConfig) -> None:
        dd.validate()
        self.cfg = dd
        self.detector = StragglerDetector(monitor.ratio, monitor.consecutive, monitor.min_peers)
        self._cursor = WindowCursor()
        self.speeds: dict[int, float] = {}
        self.sizes: dict[int, int] = {}

    def evaluate(self, snapshot: MonitorSnapshot, now: float) -> list[Action]:
        out: list[Action] = []
        fresh = self._cursor.new(snapshot)
        for w in fresh:
            out += detection_actions("worker", self.detector, w.worker_batch_time, w.index)
            for k, v in w.worker_samples_per_s.items():
                if v > 0:  # EMA: one noisy window must not swing the batch split
                    self.speeds[k] = v if k not in self.speeds else (1 - self.cfg.smoothing) * self.speeds[k] + self.cfg.smoothing * v
        if not fresh or len(self.speeds) > self.cfg.global_batch or not self.speeds:
            return out
        # speed per sample: a worker's samples/s depends on its batch size only through
        # fixed per-step overheads, so samples/s is the quantity to equalise.
        sizes = proportional_batch_sizes(self.speeds, self.cfg.global_batch)
        if self._changed(sizes):
            self.sizes = sizes
            out.append(SetBatchSizes("workers", {"window": fresh[-1].index,
                                                 "samples_per_s": {k: round(v, 3) for k, v in self.speeds.items()},
                                                 "global_batch": self.cfg.global_batch}, sizes=sizes))
        return out

    def _changed(self, sizes: dict[int, int]) -> bool:
        if set(sizes) != set(self.sizes):
            return True
        return any(abs(sizes[k] - self.sizes[k]) > self.cfg.min_change * self.sizes[k] for k in sizes)
