"""Percent done and time left of a run, from successive (done, total) readings.

The launcher feeds it the controller's coverage (batches of every requested epoch: a total
fixed at the start, :mod:`metaps.progress`); ``train-local`` feeds it its steps. The rate
is measured over a sliding window, so a run that slows down or speeds up shows within a
window; work rolled back (done going down: a PS recovery replays shards) restarts it.

Example::

    eta = JobEta(window_s=60.0)
    r = eta.update(done=120, total=400, now=time.monotonic())
    r.pct, r.eta_s, duration_text(r.eta_s)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class ProgressHook(Protocol):
    """Told how far a long operation has come: ``done`` of ``total`` units of ``stage`` (cumulative).

    Library code (``meta_io.build``, ``delivery``) calls it on the working thread, between
    batches: it must be cheap and must not raise. The CLI renders it
    (:class:`metaps.progress.StageProgress`); the library never prints.
    """

    def __call__(self, stage: str, done: int, total: int) -> None: ...


@dataclass(frozen=True)
class EtaReading:
    """The whole job's progress at one moment.

    Args:
        done: batches done (every requested epoch of every dataset).
        total: batches the job needs in all.
        batches_per_s: recent rate (over :class:`JobEta`'s window); None until two readings differ in time.
        eta_s: seconds left at that rate; None while the rate is unknown or zero.
    """

    done: int
    total: int
    batches_per_s: float | None
    eta_s: float | None

    @property
    def pct(self) -> float:
        """Percent done (100 for an empty job)."""
        return 100.0 * self.done / self.total if self.total else 100.0

    def fields(self) -> dict[str, Any]:
        """The figures as log-line fields."""
        return {"done": f"{self.done}/{self.total}", "pct": round(self.pct, 1),
                "batches_per_s": None if self.batches_per_s is None else round(self.batches_per_s, 3),
                "eta_s": None if self.eta_s is None else round(self.eta_s)}


def duration_text(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``42s``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = max(0, int(round(seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class JobEta:
    """Percent done and time left of a run, from the controller's coverage.

    The rate is measured over the last ``window_s`` seconds of readings (all of them
    until the window fills), so a fleet that slows down or speeds up is reflected within a
    window; a rollback (done going down: a PS recovery replays work) restarts the window.

    Args:
        window_s: how far back the rate looks.
    """

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._points: deque[tuple[float, int]] = deque()

    def update(self, done: int, total: int, now: float) -> EtaReading:
        """Add one reading (``now`` from a monotonic clock) and return the figures."""
        if self._points and done < self._points[-1][1]:
            self._points.clear()
        self._points.append((now, done))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()
        t0, d0 = self._points[0]
        rate = (done - d0) / (now - t0) if now > t0 else None
        left = max(total - done, 0)
        eta = 0.0 if left == 0 else (left / rate if rate else None)
        return EtaReading(done=done, total=total, batches_per_s=rate, eta_s=eta)

    def from_status(self, status: Mapping[str, Any] | None, now: float) -> EtaReading | None:
        """:meth:`update` with ``status["coverage"]`` (None when the status has none yet)."""
        cov = (status or {}).get("coverage") or {}
        if "total_batches" not in cov:
            return None
        return self.update(int(cov.get("done_batches") or 0), int(cov["total_batches"]), now)
