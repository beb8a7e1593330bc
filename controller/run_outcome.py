"""The run's outcome as the controller knows it, and the stops it sends when the run ends.

::

    running --(every dataset done, no PS recovery pending, the final checkpoint written,
               no worker left running)--> complete

A worker that stops training early on request (its ``[train] max_steps``) says so in
its heartbeats; once every live worker has, the train datasets are closed (the DDS hands
out no more; coverage ``partial_by_request``), so the run ends instead of waiting for
shards no worker will take.
    running --(a run_failed event: e.g. a PS recovery with nothing to restore)--> failed
    running --(the leader's final checkpoint could not be written: a run_failed event with
               cause "final_checkpoint"; training finished)--> failed

A worker process reports itself finished (``NodeDown`` with reason
:data:`~controller.types.NODE_FINISHED`, exit code 0) after its last duty; the
registry keeps it ``done``.

**The checkpoint leader** is the live worker with the lowest index (:meth:`RunOutcome.leader`),
not a fixed rank: it takes the periodic checkpoint cuts and, once every dataset is
done, writes the final checkpoint and finishes (``final_checkpoint``, durable as an
event). The other workers wait for that before they finish. When the leader leaves
(deleted on a scale-down, crashed) the next live worker is the leader at once, so no
worker index has duties another cannot take over.

**The final checkpoint fails** (the leader could not write it: a full disk, an I/O error,
no permission): the leader reports ``NodeDown`` with reason
``final_checkpoint_failed: <path and OS error>`` and exits 4. That is deterministic (a
restart would write the same checkpoint to the same disk), so the run fails at once, with
the reason ``training finished (...); the final checkpoint failed: ...`` and the event's
``cause`` ``final_checkpoint`` (the run report says training finished and the checkpoint
failed); a failed run has no leader (-1), so no other worker retries it.

**Failed.** Every live process (worker and PS) is sent ``stop`` with the reason
``run_failed: <why>``, once per incarnation (a crash-looping worker that registers
again is told again), and exits with :data:`common.exit_codes.RUN_FAILED`: the
worker Job's ``podFailurePolicy`` fails the Job on that code instead of retrying
until ``backoffLimit``. The failure is durable: it is read back from the event log
when the controller restarts.

**End the fleet** (``metaps controller --exit-when-done``, as the Kubernetes manifests
run it, where nothing else stops the controller and PS pods). When the run is
complete, each PS process is sent ``stop`` ``run_ended`` (it exits 0: its Job
completes and frees its node); when it failed, every live process is told as above.
Once every stop was handed out (or ``linger_s`` passed) the controller asks itself to
shut down, and exits 0 (complete) or 4 (failed). Without it (``metaps launch``, the
scripts) the launcher ends the fleet and no ``run_ended`` stop is sent.

**The checkpoint the outcome names** (``metaps status``, the controller's termination
message) is the run's final checkpoint, the committed cut the leader reported with
``CheckpointDone(cut_id=FINAL_CUT)`` (:func:`outcome_checkpoint`), whatever cut was committed
after it: when the leader finished, the next live worker became the leader and could still
commit an interval cut, named by its own (lower) step, so "the newest committed cut" named a
checkpoint older than the final one. Before the final checkpoint (a run still running, or
failed) it is the newest committed cut.

Example::

    outcome = RunOutcome(server, end_fleet=True)
    outcome.tick()              # from the controller's loop
    outcome.state()             # (RunState.COMPLETE, "")
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from controller.dds import DynamicDataSharding
from controller.node_registry import NodeRegistry, NodeState
from controller.state import Event, EventLog
from common import exit_codes
from common.log import kv

log = logging.getLogger(__name__)

RUN_FAILED = "run_failed"
"""Event kind: the run cannot go on (evidence ``reason``)."""
FINAL_CHECKPOINT = "final_checkpoint"
"""Event kind: the leader wrote the run's final checkpoint and finished (evidence ``worker``)."""
CAUSE_FINAL_CHECKPOINT = "final_checkpoint"
"""``cause`` in a ``run_failed`` event's evidence: training finished, the final checkpoint could not be written."""


def outcome_checkpoint(cuts: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The checkpoint cut a run's outcome names: the newest committed final one (the leader's
    final checkpoint), else the newest committed cut; None when none is committed.

    Args:
        cuts: the controller's checkpoint cuts in cut-id order (``status()["checkpoints"]``).
    """
    committed = [c for c in cuts if c.get("state") == "committed"]
    final = [c for c in committed if c.get("final")]
    found = final or committed
    return found[-1] if found else None


class RunState(str, enum.Enum):
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"


class OutcomeHost(Protocol):
    """What the outcome needs of the controller (``controller.server.ControllerServer`` has it)."""

    @property
    def dds(self) -> DynamicDataSharding: ...
    @property
    def registry(self) -> NodeRegistry: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def shutdown_requested(self) -> threading.Event: ...

    def run_finished(self) -> bool:
        """Every dataset done and no PS recovery pending (a pending one's rollback requeues shards)."""
        ...


class RunOutcome:
    """See the module docstring.

    Args:
        host: the controller.
        end_fleet: stop the PS processes and this controller when the run ends.
        linger_s: the longest wait for the stops to be handed out before shutting down.
        clock: ``time.monotonic``-like.
        expected_workers: ``[train] workers``: the train datasets are closed on request only
            once at least this many workers have registered (a slow starter still trains).
    """

    def __init__(self, host: OutcomeHost, end_fleet: bool = False, linger_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, expected_workers: int = 0) -> None:
        self.h = host
        self.end_fleet = end_fleet
        self.expected_workers = expected_workers
        self.linger_s = linger_s
        self.clock = clock
        self._lock = threading.Lock()
        self._failed = ""
        self.final_done = False
        for e in host.events.list():
            if e.kind == RUN_FAILED and not self._failed:
                self._failed = str(e.evidence.get("reason") or "the controller failed the run")
            elif e.kind == FINAL_CHECKPOINT:
                self.final_done = True
        self._told: set[tuple[str, int, str]] = set()  # (role, index, incarnation id) sent a stop
        self._ended_at: float | None = None
        self.exit_code = exit_codes.OK
        self.ended = False
        """``end_fleet``: the run ended and the shutdown was asked for (``exit_code`` says how)."""

    # ------------------------------------------------------------------ state
    def note_failed(self, reason: str) -> None:
        """A ``run_failed`` event was recorded (the first reason wins)."""
        with self._lock:
            if not self._failed:
                self._failed = reason

    def leader(self) -> int:
        """The checkpoint leader: the live worker with the lowest index (-1: none, or the run failed:
        nobody takes a cut or the final checkpoint of a failed run)."""
        with self._lock:
            if self._failed:
                return -1
        live = [i.index for i in self.h.registry.alive("worker")]
        return min(live) if live else -1

    def worker_finished(self, index: int) -> None:
        """Worker ``index`` reported itself finished; if it led a finished run, the final checkpoint is written."""
        if not self.final_done and self.h.run_finished() and index == self.leader():
            self.final_done = True
            self.h.events.record(Event.now(f"worker:{index}", FINAL_CHECKPOINT, {"worker": index}, ""))

    def final_checkpoint_failed(self, index: int, why: str) -> None:
        """Worker ``index`` (the leader) could not write the final checkpoint: fail the run once,
        durably (a ``run_failed`` event with ``cause`` ``final_checkpoint``), saying training finished.

        Args:
            index: the worker that tried.
            why: one line naming the checkpoint path and the OS error.
        """
        with self._lock:
            if self._failed:
                return
        train = [d for d in self.h.dds.progress() if d.get("kind") == "train"]
        done = ", ".join(f"{d['dataset']} {d['batches_done']}/{d['batches_total']} batches" for d in train)
        trained = f"training finished ({done})" if self.h.run_finished() else "training not finished"
        reason = f"{trained}; the final checkpoint failed: {why}"
        self.h.events.record(Event.now(f"worker:{index}", RUN_FAILED,
                                       {"reason": reason, "cause": CAUSE_FINAL_CHECKPOINT, "worker": index,
                                        "error": why, "training_finished": self.h.run_finished()},
                                       "fail the run (a write failure: a restart would fail the same way)"))
        self.note_failed(reason)
        log.error("final checkpoint failed; run failed", extra=kv(worker=index, reason=reason))

    def state(self) -> tuple[RunState, str]:
        """(state, reason): failed wins over complete; complete needs the final checkpoint and
        every worker process gone (finished, or dead: a scaled-down pod)."""
        with self._lock:
            if self._failed:
                return RunState.FAILED, self._failed
        if self.final_done and self.h.run_finished() and not self.h.registry.alive("worker"):
            return RunState.COMPLETE, ""  # the leader's final checkpoint written, no worker left running
        return RunState.RUNNING, ""

    # ------------------------------------------------------------------ stops
    def close_by_request(self) -> None:
        """Once every live worker stopped training early on request (its ``[train] max_steps``),
        close the train datasets: the run ends with partial coverage, by request, instead of
        waiting for shards no worker will take."""
        live = self.h.registry.alive("worker")
        seen = [i for i in self.h.registry.nodes() if i.role == "worker"]
        if not live or any(not i.stopped for i in live) or len(seen) < self.expected_workers:
            return
        why = ", ".join(sorted({i.stopped for i in live}))
        for name, spec in self.h.dds.specs.items():
            if spec.kind.value == "train":
                self.h.dds.close(name, f"every worker stopped training early: {why}")

    def tick(self) -> None:
        """Close datasets on request; send the stops the outcome calls for; with ``end_fleet``,
        shut down once they were handed out."""
        self.close_by_request()
        st, reason = self.state()
        if st is RunState.RUNNING:
            return
        if st is RunState.FAILED:
            self._stop_all(("worker", "ps"), f"{exit_codes.STOP_RUN_FAILED}: {reason}")
        elif self.end_fleet:
            self._stop_all(("ps",), f"{exit_codes.STOP_RUN_ENDED}: every dataset done, every worker finished")
        if not self.end_fleet:
            return
        now = self.clock()
        if self._ended_at is None:
            self._ended_at = now
            self.h.events.record(Event.now("controller", "run_ended", {"state": st.value, "reason": reason},
                                           "stop the fleet and exit"))
            log.info("run ended; stopping the fleet", extra=kv(state=st.value, reason=reason or "-"))
        # only a live process can still take its commands: a finished or dead one's queue (a cut sent
        # just before it left, a stop for a crashed PS) would hold the shutdown for the whole linger
        # only the stops count: a command the policy queued meanwhile (a clock release, a truncate)
        # for a process that obeyed its stop and exited is never handed out, and held the shutdown
        # for the whole linger (a failed k8s run's Jobs failed 60 s late)
        pending = [n for n in self.h.registry.alive() if self.h.registry.pending(n.role, n.index, kind="stop")]
        if not pending or now - self._ended_at >= self.linger_s:
            self.exit_code = exit_codes.RUN_FAILED if st is RunState.FAILED else exit_codes.OK
            self.ended = True
            if pending:
                log.warning("stops not handed out before shutdown",
                            extra=kv(nodes=",".join(n.name for n in pending), linger_s=self.linger_s))
            self.h.shutdown_requested.set()

    def _stop_all(self, roles: tuple[str, ...], reason: str) -> None:
        for info in self.h.registry.alive():
            key = (info.role, info.index, info.incarnation_id)
            if info.role not in roles or key in self._told or info.state is NodeState.DONE:
                continue
            self._told.add(key)
            self.h.registry.enqueue(info.role, info.index, "stop", target="process", reason=reason)
            log.warning("stop sent", extra=kv(node=info.name, reason=reason))
