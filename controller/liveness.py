"""Worker liveness: a worker that holds shards but stops making progress.

A worker whose *process* lives but does not move (SIGSTOP, a deadlock, a
machine frozen under it) is invisible to the heartbeat timeout while its agent
keeps heartbeating for the node, and it stalls every other worker through the
PS step clocks (bounded staleness). This module tells such a worker from one
that is merely idle::

    GetShard -> SHARD  ------------>  BUSY  (holds an outstanding lease grant)
    ReportShard (every grant)  ---->  IDLE  (then GetShard -> WAIT / DONE: waiting
                                             for data, never flagged)

    progress = a step (ReportMetrics with batch times, or a heartbeat whose step grew),
               a shard granted or reported, a (re)registration of the process

    BUSY and no progress for worker_stall_timeout_s:
        process heartbeats silent too   -> STALLED (frozen: SIGSTOP, host freeze)
        heartbeats go on, a peer moved  -> STALLED (stuck alone: deadlock)
        heartbeats go on, nobody moved  -> not flagged: the fleet waits on something
                                           shared (a PS, a checkpoint pause); one
                                           ``fleet_stalled`` event per episode

A worker counts as BUSY while a lease grant is outstanding even if the DDS has
since expired the lease (a frozen worker stops renewing it): the grant is what
the worker believes it holds. After a controller restart the DDS's DOING shards
count as grants too. The controller (``server.py``) turns a :class:`Stall` into:
shards requeued (DDS leases released), a ``worker_stalled`` event, and a
``restart`` command to the node's agent; the worker's state is then reset (IDLE,
fresh progress clock), so one stall yields one restart.

Example::

    lv = WorkerLiveness(60.0)
    lv.granted(0, "train/0/0:0-8")
    lv.step(0, 12)
    stalls = lv.stalled(holders={0: ["train/0/0:0-8"]}, process_heartbeat={0: hb_time})
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence


@dataclass(frozen=True)
class Stall:
    """One worker judged stalled.

    Attributes:
        worker: worker index.
        idle_s: seconds since its last progress.
        heartbeat_age_s: seconds since its process last heartbeated.
        frozen: the process heartbeats stopped too (SIGSTOP, host freeze); else it is
            stuck alone while heartbeating (deadlock).
        last_step: the highest step it reported.
        shards: the shard ids it holds or was granted and never reported.
    """

    worker: int
    idle_s: float
    heartbeat_age_s: float
    frozen: bool
    last_step: int
    shards: tuple[str, ...] = field(default_factory=tuple)

    def reason(self, timeout_s: float) -> str:
        how = ("its process sent no heartbeat either (stopped or frozen)" if self.frozen
               else "its process heartbeats but makes no progress while peers do (deadlocked?)")
        return (f"worker {self.worker} stalled: no step for {self.idle_s:.1f}s (worker_stall_timeout_s "
                f"{timeout_s:g}) while holding shard(s) {list(self.shards)}; {how}")


class WorkerLiveness:
    """Thread-safe progress tracking and stall judgement. See the module docstring.

    Args:
        timeout_s: ``[controller] worker_stall_timeout_s`` (> 0).
        clock: ``time.time``-like.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.time) -> None:
        if timeout_s <= 0:
            raise ValueError(f"worker_stall_timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}
        self._step: dict[int, int] = {}
        self._grants: dict[int, set[str]] = {}
        self._fleet_stalled = False

    def progress(self, worker: int) -> None:
        """The worker moved (a step, a shard report)."""
        with self._lock:
            self._last[worker] = self._clock()
            self._fleet_stalled = False

    def step(self, worker: int, step: int) -> None:
        """A heartbeat's step: progress only when it grew."""
        with self._lock:
            if step > self._step.get(worker, -1):
                self._step[worker] = step
                self._last[worker] = self._clock()
                self._fleet_stalled = False

    def granted(self, worker: int, shard_id: str) -> None:
        """GetShard handed ``shard_id`` to the worker: BUSY from now on."""
        with self._lock:
            self._grants.setdefault(worker, set()).add(shard_id)
            self._last[worker] = self._clock()

    def reported(self, worker: int, shard_id: str) -> None:
        """The worker reported ``shard_id`` (any outcome): no longer outstanding."""
        with self._lock:
            self._grants.get(worker, set()).discard(shard_id)
            self._last[worker] = self._clock()
            self._fleet_stalled = False

    def reset(self, worker: int) -> None:
        """A fresh incarnation, a node down or a stall handled: IDLE with a fresh clock."""
        with self._lock:
            self._grants.pop(worker, None)
            self._step.pop(worker, None)
            self._last[worker] = self._clock()

    def stalled(self, holders: Mapping[int, Sequence[str]], process_heartbeat: Mapping[int, float],
                now: float | None = None) -> tuple[list[Stall], bool]:
        """Judge every BUSY worker.

        Args:
            holders: DOING shard ids by worker (``DynamicDataSharding.holders()``).
            process_heartbeat: the last heartbeat time of each worker's process.
            now: the time to judge at (default: the clock).

        Returns:
            (stalled workers, whether a fleet-wide stall episode started in this call).
        """
        now = self._clock() if now is None else now
        t = self.timeout_s
        with self._lock:
            busy: dict[int, set[str]] = {w: set(s) for w, s in self._grants.items() if s}
            for w, shards in holders.items():
                busy.setdefault(w, set()).update(shards)
            for w in busy:
                self._last.setdefault(w, now)  # first sight (e.g. after a controller restart): a grace period
            moved = {w for w, last in self._last.items() if now - last <= t}
            out: list[Stall] = []
            stuck_alone = 0
            for w in sorted(busy):
                idle = now - self._last[w]
                if idle <= t:
                    continue
                hb_age = now - process_heartbeat.get(w, self._last[w])
                frozen = hb_age > t
                # a peer "moves" only if it progressed well after w went quiet: two workers that stop
                # together (a PS outage, a pause) a few ms apart are a shared wait, not a deadlock
                peers_moving = any(self._last[p] - self._last[w] > t / 2 for p in moved - {w})
                if frozen or peers_moving:
                    out.append(Stall(w, idle, hb_age, frozen, self._step.get(w, 0), tuple(sorted(busy[w]))))
                else:
                    stuck_alone += 1
            episode = stuck_alone > 0 and not out and not self._fleet_stalled
            if episode:
                self._fleet_stalled = True
            return out, episode
