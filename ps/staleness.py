"""Per-worker step clocks on a PS shard: bounded staleness and sync barriers.

A worker's *clock* is the number of steps it has completed (its last pushed
step + 1; in sync mode the barrier ids count half-steps, so it is twice that).
Registered workers hold the others back::

    clocks   w0: 7   w1: 5   w2: 6          min_clock = 5
    max_staleness = 2  ->  a pull for step s waits while s > min_clock + 2
                            (w0 may pull step 7, not step 8)
    sync (staleness 0) ->  step s waits until every worker completed s - 1

A worker that never registered (or left) holds nobody back. Its requests still work:
its pulls never wait for anyone, its pushes are applied (as in async mode) and do
not advance any clock. Workers leave while idle on the data queue, when done, and
while the controller flags them slow (``[controller.nd] release_slow_clock``: a
persistently slow worker would otherwise hold every other worker to its step rate
+ ``max_staleness``); they rejoin with :meth:`StepClock.join` (below).

**Joining, resuming.** :meth:`StepClock.join` answers the clock the worker now
has on this shard (``RegisterWorkerResponse.clock``), and the worker numbers its
steps from it:

* a worker whose clock is still here (a restarted process re-registering within
  the lease) *resumes* at that clock: registration keeps the larger of the old
  and the asked clock, and the new process continues the numbering instead of
  starting again from 0 (which would hold every other worker back until it
  caught up);
* a worker with no clock here (new, scaled up, back from an idle wait on the
  data queue, or whose lease ran out) joins at no less than the slowest clock
  of the workers present: it is counted from the step the fleet is at, never
  drags the fleet back to steps it missed. In sync mode it is therefore waited
  for from the next barrier on.

**Leases.** With ``lease_s > 0`` a clock is renewed by each request of its
worker (a pull or push with a step, a Barrier, a registration). A clock not
renewed within ``lease_s`` (the worker died for good: its agent gave up, the
worker Job scaled down) *expires*: it leaves the min computation at once (the
others stop waiting for it), is logged and counted (:attr:`StepClock.expired_total`,
``Stats.clocks_expired``, ``metaps_ps_clocks_expired``) and remembered. If that
worker comes back, its next request with a step is refused with
:class:`ClockExpired` (``FAILED_PRECONDITION`` + ``metaps-error: clock_expired``;
nothing applied); the client re-registers on that shard (joining as above) and
resends. The lease must exceed the longest step a live worker can take; a
lease of 0 turns expiry off (a dead worker then blocks the others until their
wait times out, as before). Expiry is evaluated lazily, whenever a clock is read.

The PS service never blocks on these clocks: it asks :meth:`StepClock.check_pull`
and :meth:`StepClock.arrive` (non-blocking; they return a :class:`Behind` when
the caller must wait) and answers at once, and the *client* waits with backoff
(see ``ps/servicer.py``). :meth:`wait_pull` / :meth:`barrier` are the blocking
forms for in-process callers; their waits have a timeout, so a dead worker
stalls the others for at most that long and the caller gets a clear error
instead of a hang.

Example::

    clock = StepClock(max_staleness=1, lease_s=60.0)
    clock.register("w0"); clock.register("w1")
    clock.advance("w0", 0)            # w0 finished step 0
    clock.wait_pull("w0", 1, 5.0)     # ok: 1 <= min_clock(0) + 1
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from common.errors import MetapsError
from common.log import kv

log = logging.getLogger(__name__)

from common.errors import MetapsError


class StalenessTimeout(MetapsError, TimeoutError):
    """A worker waited longer than its timeout for slower workers."""


class ClockExpired(MetapsError):
    """The worker's clock lease ran out on this shard; it must re-register (join) before stepping on.

    Args:
        worker: the worker id.
        clock: its clock when the lease ran out.
    """

    def __init__(self, worker: str, clock: int, lease_s: float) -> None:
        super().__init__(
            f"worker '{worker}': its step clock (at {clock}) expired after {lease_s:g}s without a request "
            f"(clock_lease_s); re-register to rejoin"
        )
        self.worker = worker
        self.clock = clock


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
    """Thread-safe worker clocks with leases and non-blocking (and blocking) staleness checks.

    Args:
        max_staleness: how many steps a worker may run ahead of the slowest
            registered worker; < 0 means unbounded (pure async).
        lease_s: a clock not renewed by its worker's requests for this long
            expires (leaves the min computation); 0 = never.
        now: monotonic time source (tests pass a fake one).
        name: for log lines (e.g. ``shard 1``).
    """

    def __init__(self, max_staleness: int = -1, lease_s: float = 0.0,
                 now: Callable[[], float] = time.monotonic, name: str = "") -> None:
        if not lease_s >= 0:
            raise ValueError(f"clock lease_s must be >= 0, got {lease_s}")
        self.max_staleness = max_staleness
        self.lease_s = float(lease_s)
        self.name = name
        self._now = now
        self._clocks: dict[str, int] = {}
        self._seen: dict[str, float] = {}
        self._expired: dict[str, int] = {}
        self.expired_total = 0
        self._cond = threading.Condition()

    # -- membership ----------------------------------------------------------------
    def _expire_locked(self) -> None:
        """Drop every clock not renewed within the lease (caller holds the lock)."""
        if self.lease_s <= 0 or not self._clocks:
            return
        now = self._now()
        for w in [w for w, t in self._seen.items() if now - t > self.lease_s]:
            clock = self._clocks.pop(w)
            silent = now - self._seen.pop(w)
            self._expired[w] = clock
            self.expired_total += 1
            log.warning("worker clock lease expired; it no longer holds the other workers back",
                        extra=kv(where=self.name, worker=w, clock=clock, silent_s=round(silent, 3), lease_s=self.lease_s))
            self._cond.notify_all()

    def join(self, worker: str, clock: int = 0) -> int:
        """Add (or re-add) ``worker``; returns the clock it now has (see the module doc).

        Args:
            worker: the worker id.
            clock: the steps it says it has completed.
        """
        with self._cond:
            self._expire_locked()
            prev = self._clocks.get(worker)
            if prev is not None:
                c = max(clock, prev)
            else:
                others = list(self._clocks.values())
                c = max(clock, min(others) if others else self._expired.get(worker, 0))
                if self._expired.pop(worker, None) is not None:
                    log.info("expired worker rejoined its step clock", extra=kv(where=self.name, worker=worker, clock=c))
            self._clocks[worker] = c
            self._seen[worker] = self._now()
            self._cond.notify_all()
            return c

    def register(self, worker: str, clock: int = 0) -> int:
        """:meth:`join` ``worker``; returns the worker count."""
        self.join(worker, clock)
        with self._cond:
            return len(self._clocks)

    def leave(self, worker: str) -> int:
        """``worker`` stops holding others back (and is forgotten if it had expired); returns the worker count."""
        with self._cond:
            self._clocks.pop(worker, None)
            self._seen.pop(worker, None)
            self._expired.pop(worker, None)
            self._cond.notify_all()
            return len(self._clocks)

    def touch(self, worker: str) -> None:
        """Renew ``worker``'s lease (any request of it with a step).

        Raises:
            ClockExpired: its lease ran out since its last request: it must re-register first.
        """
        with self._cond:
            self._expire_locked()
            if worker in self._clocks:
                self._seen[worker] = self._now()
            elif worker in self._expired:
                raise ClockExpired(worker, self._expired[worker], self.lease_s)

    def advance(self, worker: str, step: int) -> None:
        """``worker`` completed ``step`` (its pushes of that step are applied)."""
        with self._cond:
            if worker in self._clocks:
                self._seen[worker] = self._now()
                if step + 1 > self._clocks[worker]:
                    self._clocks[worker] = step + 1
                    self._cond.notify_all()

    def min_clock(self) -> int | None:
        with self._cond:
            self._expire_locked()
            return min(self._clocks.values()) if self._clocks else None

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            self._expire_locked()
            return dict(self._clocks)

    def lags(self) -> dict[str, tuple[int, int]]:
        """worker -> (its clock, how far it is behind the fastest registered clock): the
        staleness bound at work (``metaps_ps_worker_clock`` / ``metaps_ps_worker_clock_lag``)."""
        clocks = self.snapshot()
        top = max(clocks.values(), default=0)
        return {w: (c, top - c) for w, c in clocks.items()}

    def expired(self) -> dict[str, int]:
        """Workers whose lease ran out (and that have not re-registered), with their clock then."""
        with self._cond:
            self._expire_locked()
            return dict(self._expired)

    def _behind(self, ok: Callable[[int], bool], what: str) -> Behind | None:
        """None when ``ok(min_clock)`` (or nobody is registered); else who holds the caller back."""
        with self._cond:
            self._expire_locked()
            if not self._clocks:
                return None
            slow = min(self._clocks, key=self._clocks.__getitem__)
            m = self._clocks[slow]
            if ok(m):
                return None
            return Behind(m, slow, f"{what}; slowest worker '{slow}' has completed {m} steps")

    def check_pull(self, worker: str, step: int, max_staleness: int | None = None) -> Behind | None:
        """Non-blocking :meth:`wait_pull`: None when a pull of ``step`` may proceed now.

        Renews the caller's lease.

        Args:
            worker: the caller (for the message).
            step: the step the caller is about to compute.
            max_staleness: override of the clock's bound.

        Raises:
            ClockExpired: the caller's lease ran out: it must re-register first.
        """
        self.touch(worker)
        bound = self.max_staleness if max_staleness is None else max_staleness
        if bound < 0:
            return None
        return self._behind(lambda m: step <= m + bound, f"worker '{worker}' pulling step {step} is more than {bound} steps ahead")

    def arrive(self, worker: str, step: int) -> Behind | None:
        """Non-blocking :meth:`barrier`: mark ``step`` done; None once every worker has done it.

        Args:
            worker: the caller; its clock advances to ``step + 1`` (idempotent).
            step: the barrier's step.

        Raises:
            ClockExpired: the caller's lease ran out: it must re-register first.
        """
        self.touch(worker)
        self.advance(worker, step)
        return self._behind(lambda m: m >= step + 1, f"barrier of step {step} (worker '{worker}')")

    def _wait(self, ok: Callable[[int], bool], timeout_s: float, what: str) -> int | None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._expire_locked()
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
        self.touch(worker)
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
        self.touch(worker)
        self.advance(worker, step)
        m = self._wait(lambda m: m >= step + 1, timeout_s, f"barrier of step {step} (worker '{worker}')")
        return -1 if m is None else m
