"""The Monitor: fixed time windows of per-node speed figures.

Workers report per-batch processing times, samples/s and the pull/push latency
they see from each PS; PS processes report their request latency and queueing;
every node heartbeats. The Monitor buckets reports into fixed windows
(``window_s`` long, aligned to its start time) and, when a window closes,
reduces it to one value per node (mean batch time, mean samples/s, mean
latency). Policies compare a node with the median of its peers per window.

    t0        t0+w       t0+2w      t0+3w   (now)
    |--- w0 ---|--- w1 ---|--- w2 ---|-- open --|
      closed     closed     closed     not yet in snapshot()

Example::

    mon = Monitor(MonitorConfig(window_s=1.0))
    mon.record_worker(0, batch_times_s=[0.05, 0.06], samples_per_s=900.0)
    snap = mon.snapshot()          # closed windows, oldest first
    snap.windows[-1].worker_batch_time
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from controller.config import MonitorConfig


@dataclass(frozen=True)
class WindowStats:
    """One closed window, one value per node that reported in it.

    Attributes:
        worker_batch_time: mean seconds per batch, by worker index.
        worker_samples_per_s: mean samples/s, by worker index.
        ps_latency: mean request latency, by PS index (PS-reported if any, else
            what workers observed pulling/pushing).
        ps_queue: mean queued requests, by PS index.
    """

    index: int
    start: float
    end: float
    worker_batch_time: dict[int, float] = field(default_factory=dict)
    worker_samples_per_s: dict[int, float] = field(default_factory=dict)
    ps_latency: dict[int, float] = field(default_factory=dict)
    ps_queue: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MonitorSnapshot:
    """Closed windows (oldest first) and the last heartbeat time of every node."""

    now: float
    windows: tuple[WindowStats, ...]
    last_heartbeat: dict[str, float] = field(default_factory=dict)

    @property
    def latest(self) -> WindowStats | None:
        return self.windows[-1] if self.windows else None


@dataclass
class _Acc:
    batch_times: dict[int, list[float]] = field(default_factory=dict)
    sps: dict[int, list[float]] = field(default_factory=dict)
    ps_server: dict[int, list[float]] = field(default_factory=dict)
    ps_client: dict[int, list[float]] = field(default_factory=dict)
    ps_queue: dict[int, list[float]] = field(default_factory=dict)


def median_of_peers(values: Mapping[int, float], node: int) -> float | None:
    """Median of every value except ``node``'s (None without peers)."""
    peers = [v for k, v in values.items() if k != node]
    return statistics.median(peers) if peers else None


class Monitor:
    """Thread-safe windowed figures. See the module docstring.

    Args:
        cfg: window length and how many closed windows to keep.
        clock: ``time.time``-like, injectable for tests.
    """

    def __init__(self, cfg: MonitorConfig, clock: Callable[[], float] = time.time) -> None:
        cfg.validate()
        self._cfg = cfg
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self._open: dict[int, _Acc] = {}
        self._closed: deque[WindowStats] = deque(maxlen=cfg.keep_windows)
        self._heartbeats: dict[str, float] = {}

    def _acc(self, t: float | None) -> _Acc:
        t = self._clock() if t is None else t
        idx = int((t - self._t0) // self._cfg.window_s)
        if self._closed and idx <= self._closed[-1].index:
            idx = self._closed[-1].index + 1  # late report: count it in the open window
        return self._open.setdefault(idx, _Acc())

    def record_worker(self, index: int, batch_times_s: Sequence[float] = (), samples_per_s: float = 0.0,
                      ps_pull_latency_s: Mapping[int, float] | None = None,
                      ps_push_latency_s: Mapping[int, float] | None = None, t: float | None = None) -> None:
        """A worker's figures since its last report."""
        with self._lock:
            acc = self._acc(t)
            if batch_times_s:
                acc.batch_times.setdefault(index, []).extend(float(x) for x in batch_times_s)
            if samples_per_s > 0:
                acc.sps.setdefault(index, []).append(float(samples_per_s))
            for lat in (ps_pull_latency_s or {}, ps_push_latency_s or {}):
                for ps, v in lat.items():
                    acc.ps_client.setdefault(int(ps), []).append(float(v))

    def record_ps(self, index: int, request_latency_s: float, queue_depth: float = 0.0, t: float | None = None) -> None:
        """A PS's own mean request latency and queue depth since its last report."""
        with self._lock:
            acc = self._acc(t)
            acc.ps_server.setdefault(index, []).append(float(request_latency_s))
            acc.ps_queue.setdefault(index, []).append(float(queue_depth))

    def heartbeat(self, node: str, t: float | None = None) -> None:
        with self._lock:
            self._heartbeats[node] = self._clock() if t is None else t

    def snapshot(self, now: float | None = None) -> MonitorSnapshot:
        """Close every window that ended before ``now``; return the kept closed windows."""
        now = self._clock() if now is None else now
        current = int((now - self._t0) // self._cfg.window_s)
        with self._lock:
            for idx in sorted(i for i in self._open if i < current):
                acc = self._open.pop(idx)
                start = self._t0 + idx * self._cfg.window_s

                def mean(d: dict[int, list[float]]) -> dict[int, float]:
                    return {k: sum(v) / len(v) for k, v in d.items() if v}

                ps_lat = mean(acc.ps_client)
                ps_lat.update(mean(acc.ps_server))  # the PS's own figure wins when it reports one
                self._closed.append(WindowStats(idx, start, start + self._cfg.window_s, mean(acc.batch_times),
                                                mean(acc.sps), ps_lat, mean(acc.ps_queue)))
            return MonitorSnapshot(now, tuple(self._closed), dict(self._heartbeats))
