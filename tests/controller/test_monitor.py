"""Monitor windows: closing, per-node means, PS latency sources."""

from __future__ import annotations

from controller.config import MonitorConfig
from controller.monitor import Monitor, median_of_peers


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_windows_close_in_order_with_means() -> None:
    clock = Clock()
    mon = Monitor(MonitorConfig(window_s=1.0, keep_windows=2), clock)
    mon.record_worker(0, [0.1, 0.3], samples_per_s=10.0)
    mon.record_worker(1, [0.5], ps_pull_latency_s={0: 0.02}, ps_push_latency_s={0: 0.04})
    assert mon.snapshot().windows == ()  # window 0 still open
    clock.t += 1.0
    mon.record_worker(0, [0.2])
    mon.record_ps(0, request_latency_s=0.01, queue_depth=3)
    clock.t += 1.0
    snap = mon.snapshot()
    w0, w1 = snap.windows
    assert w0.worker_batch_time == {0: 0.2, 1: 0.5} and w0.worker_samples_per_s == {0: 10.0}
    assert abs(w0.ps_latency[0] - 0.03) < 1e-12  # what workers saw
    assert w1.ps_latency == {0: 0.01} and w1.ps_queue == {0: 3.0}  # the PS's own figure wins
    clock.t += 5.0
    mon.record_worker(0, [1.0])
    clock.t += 1.0
    assert [w.index for w in mon.snapshot().windows] == [1, 7]  # keep_windows=2


def test_median_of_peers_excludes_the_node() -> None:
    assert median_of_peers({0: 5.0, 1: 5.0, 2: 15.0}, 2) == 5.0
    assert median_of_peers({0: 5.0}, 0) is None
