"""Per-worker step clocks on a PS shard: bounded staleness and sync barriers.

A worker's *clock* is the number of steps it has completed (its last pushed
step + 1). Registered workers hold the others back::

    clocks   w0: 7   w1: 5   w2: 6          min_clock = 5
    max_staleness = 2  ->  a pull for step s waits while s > min_clock + 2
                            (w0 may pull step 7, not step 8)
    sync (staleness 0) ->  step s waits until every worker completed s - 1

A worker that never registered (or left) holds nobody back.

The PS service never blocks on these clocks: it asks :meth:`StepClock.check_pull`
and :meth:`StepClock.arrive` (non-blocking; they return a :class:`Behind` when
the caller must wait) and answers at once, and the *client* waits with backoff
(see ``ps/server.py``). :meth:`wait_pull` / :meth:`barrier` are the blocking
forms for in-process callers; their waits have a timeout, so a dead worker
stalls the others for at most that long and the caller gets a clear error
instead of a hang (the controller unregisters it).

Example::

    clock = StepClock(max_staleness=1)
    clock.register("w0"); clock.register("w1")
    clock.advance("w0", 0)            # w0 finished step 0
    clock.wait_pull("w0", 1, 5.0)     # ok: 1 <= min_clock(0) + 1
"""

from __future__ import annotations

import dataclasses
import threading
import time

from metaps.errors import MetapsError


class StalenessTimeout(MetapsError, TimeoutError):
    """A worker waited longer than its timeout for slower workers."""


@dataclasses.dataclass(frozen=True)
class Behind:
    """Why a caller must wait: the slowest registered worker and its clock.

    Args:
        min_clock: steps the slowest registered worker has completed.
        slowest: that worker's id.
        message: one line naming the caller, its step and the bound.
    """

    min_clock: int
    slowest: str
    message: str


class StepClock:
    """Thread-safe worker clocks with blocking staleness checks.

    Args:
        max_staleness: how many steps a worker may run ahead of the slowest
            registered worker; < 0 means unbounded (pure async).
    """

    def __init__(self, max_staleness: int = -1) -> None:
        self.max_staleness = max_staleness
        self._clocks: dict[str, int] = {}
        self._cond = threading.Condition()

    def register(self, worker: str, clock: int = 0) -> int:
        """Add (or re-add) ``worker`` with ``clock`` completed steps; returns the worker count."""
        with self._cond:
            self._clocks[worker] = max(clock, self._clocks.get(worker, clock))
            self._cond.notify_all()
            return len(self._clocks)

    def leave(self, worker: str) -> int:
        with self._cond:
            self._clocks.pop(worker, None)
            self._cond.notify_all()
            return len(self._clocks)

    def advance(self, worker: str, step: int) -> None:
        """``worker`` completed ``step`` (its pushes of that step are applied)."""
        with self._cond:
            if worker in self._clocks and step + 1 > self._clocks[worker]:
                self._clocks[worker] = step + 1
                self._cond.notify_all()

    def min_clock(self) -> int | None:
        with self._cond:
            return min(self._clocks.values()) if self._clocks else None

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return dict(self._clocks)

    def _behind(self, ok, what: str) -> Behind | None:
        """None when ``ok(min_clock)`` (or nobody is registered); else who holds the caller back."""
        with self._cond:
            if not self._clocks:
                return None
            slow = min(self._clocks, key=self._clocks.__getitem__)
            m = self._clocks[slow]
            if ok(m):
                return None
            return Behind(m, slow, f"{what}; slowest worker '{slow}' has completed {m} steps")

    def check_pull(self, worker: str, step: int, max_staleness: int | None = None) -> Behind | None:
        """Non-blocking :meth:`wait_pull`: None when a pull of ``step`` may proceed now.

        Args:
            worker: the caller (for the message).
            step: the step the caller is about to compute.
            max_staleness: override of the clock's bound.
        """
        bound = self.max_staleness if max_staleness is None else max_staleness
        if bound < 0:
            return None
        return self._behind(lambda m: step <= m + bound, f"worker '{worker}' pulling step {step} is more than {bound} steps ahead")

    def arrive(self, worker: str, step: int) -> Behind | None:
        """Non-blocking :meth:`barrier`: mark ``step`` done; None once every worker has done it.

        Args:
            worker: the caller; its clock advances to ``step + 1`` (idempotent).
            step: the barrier's step.
        """
        self.advance(worker, step)
        return self._behind(lambda m: m >= step + 1, f"barrier of step {step} (worker '{worker}')")

    def _wait(self, ok, timeout_s: float, what: str) -> int | None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                m = min(self._clocks.values()) if self._clocks else None
                if m is None or ok(m):
                    return m
                left = deadline - time.monotonic()
                if left <= 0:
                    slow = min(self._clocks, key=self._clocks.__getitem__)
                    raise StalenessTimeout(
                        f"{what}: waited {timeout_s:.1f}s; slowest worker '{slow}' has completed {m} steps"
                    )
                self._cond.wait(min(left, 1.0))

    def wait_pull(self, worker: str, step: int, timeout_s: float, max_staleness: int | None = None) -> None:
        """Block while ``step`` is more than the staleness bound ahead of the slowest worker."""
        bound = self.max_staleness if max_staleness is None else max_staleness
        if bound < 0:
            return
        self._wait(
            lambda m: step <= m + bound,
            timeout_s,
            f"worker '{worker}' pulling step {step} is more than {bound} steps ahead",
        )

    def barrier(self, worker: str, step: int, timeout_s: float) -> int:
        """Mark ``step`` done for ``worker``, then wait until every worker has done it."""
        self.advance(worker, step)
        m = self._wait(lambda m: m >= step + 1, timeout_s, f"barrier of step {step} (worker '{worker}')")
        return -1 if m is None else m
