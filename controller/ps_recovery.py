"""PS failure recovery: put the whole fleet back at the last *good* committed checkpoint cut.

Who triggers it: the controller, when a PS *process* registers again under a new
incarnation id (its agent restarted it after a crash, its pod was replaced, or the
fleet was restarted against the same controller state; never decided by the pid). Its rows are gone (or came from an older
checkpoint), so the fleet is no longer at any consistent point. The controller
then, off the RPC thread (:class:`PsRecovery`)::

    wait until every PS shard answers at its registered address (settle, retry)
    PauseWrites(lease) on every shard         (drain in-flight requests, hold new ones)
    newest partition map -> every shard that lags   (migrations after the cut are kept:
                                                      a checkpoint restores onto any map)
    for each committed cut, newest first:
        Restore(cut's dir) on every shard     (all or nothing per shard: a corrupt
                                               checkpoint is refused with DATA_LOSS and
                                               leaves the shard as it was)
        refused -> try the previous committed cut
    DDS rollback_to(the cut actually restored): shards done after it and all DOING -> TODO,
                          ledger entries after it marked replayed
    pending (uncommitted) cuts -> aborted      (a late CheckpointDone for one is ignored)
    PauseWrites(false) on every shard
    event ps_recovery {node, incarnation, cut_id, dir, step, rows, requeued, seconds}
    (+ event ps_recovery_fallback {newest_dir, dir, rejected} when an older cut was used)

Workers keep going: their pushes wait out the pause (or retry UNAVAILABLE while
the shard restarts), a shard they were training comes back as TODO and their
late report is ledgered ``stale`` (duplicate samples, counted), and they pull
the restored rows on their next step.

**No committed cut: the run fails.** A shard restarted before any cut was
committed has lost its rows, while the other shards keep theirs and the DDS keeps
the shards whose updates are gone: carrying on would end "succeeded" with a
silent loss. There is nothing consistent to restore, so the recovery fails
(below) with the reason ``no committed checkpoint cut ...`` (pending cuts are
aborted first). Restoring the whole fleet to its initial state was the other
option; it would need every shard emptied, dense parameters re-initialised from
the workers' seeded model and the whole DDS replayed, for a job that can simply
be relaunched. Set ``[controller] checkpoint_interval_s`` for recoverable jobs.

The restarted shard itself serves no data and refuses checkpoints until the
Restore here reaches it (``metaps ps --awaiting-recovery``, set by its agent), so
a cut committed between its restart and this recovery cannot capture its empty
rows; that cut fails (nothing committed) and the next one after the recovery
succeeds.

A recovery that fails -- every committed cut refused, a shard unreachable, any
other error -- fails the run: events ``ps_recovery_failed`` (``fatal``) and
``run_failed`` {reason} (:data:`RUN_FAILED`). The fleet is then in no consistent
state; ``metaps launch`` reads ``run_failed`` from the controller's status, stops
the fleet and exits nonzero with the reason (``metaps.run_report.run_failure``).

The PS side of the recovery (pause, heal maps, restore, fall back, resume) is the
``restore`` operation of the :class:`~controller.ports.PsFleet` port
(``ps.fleet_admin.GrpcPsFleet``, wired in by the app floor); this module decides
when and to which cut, and records the outcome. A controller with no fleet wired in
fails the recovery (and the run) with a reason saying so.

Example::

    rec = PsRecovery(server, GrpcPsFleet(rpc_cfg))   # server: the ControllerServer
    rec.request("ps:1", incarnation=2)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from controller.checkpoint import CheckpointCoordinator
from controller.ports import PsFleet, RestoreReport
from controller.run_outcome import RUN_FAILED as _RUN_FAILED
from metaps.core.errors import MetapsError
from metaps.core.log import kv

log = logging.getLogger(__name__)


RUN_FAILED = _RUN_FAILED
"""Event kind: the run cannot go on (evidence ``reason``); the launcher fails the run on it."""


class RecoveryError(MetapsError):
    """The fleet could not be restored (a shard unreachable or refusing); the message names it."""


class NoCommittedCut(RecoveryError):
    """A PS restarted before any checkpoint cut was committed: nothing consistent to restore; the run fails."""


class RecoveryHost(Protocol):
    """What a recovery needs of the controller (``controller.server.ControllerServer`` has it)."""

    @property
    def checkpoints(self) -> CheckpointCoordinator: ...
    @property
    def fleet_lock(self) -> threading.Lock: ...

    def ps_addresses(self) -> list[str]: ...

    def record_event(self, node: str, kind: str, evidence: dict[str, Any], action: str = "") -> None: ...


class PsRecovery:
    """Runs fleet recoveries for a :class:`~controller.server.ControllerServer`, one at a time.

    Requests that arrive while one runs (several shards restarting together) are
    coalesced into one more run. See the module docstring.

    Args:
        server: the controller (PS addresses, checkpoints, events, fleet lock).
        fleet: the PS fleet operations (``ps.fleet_admin.GrpcPsFleet``); None: a PS restart
            fails the run (nothing can restore the fleet).
        settle_s: wait this long after a request before starting (lets restarts bunch up).
        reach_timeout_s: give up (event ``ps_recovery_failed``) if a shard stays unreachable.
    """

    def __init__(self, server: RecoveryHost, fleet: PsFleet | None = None, settle_s: float = 0.3,
                 reach_timeout_s: float = 60.0) -> None:
        self.s = server
        self.fleet = fleet
        self.settle_s = settle_s
        self.reach_timeout_s = reach_timeout_s
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self.runs = 0
        self.failed = ""  # why the last failed recovery failed ('' while none did)

    def request(self, node: str, incarnation: int) -> None:
        """A PS process came back as ``incarnation``: recover the fleet (asynchronously)."""
        log.warning("ps process restarted; fleet recovery requested", extra=kv(node=node, incarnation=incarnation))
        with self._lock:
            self._pending[node] = incarnation
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="ps-recovery", daemon=True)
                self._thread.start()

    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending) or (self._thread is not None and self._thread.is_alive())

    def join(self, timeout: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout)

    def _loop(self) -> None:
        while True:
            time.sleep(self.settle_s)
            with self._lock:
                nodes, self._pending = dict(self._pending), {}
                if not nodes:
                    self._thread = None
                    return
            try:
                self.recover(nodes)
            except Exception as exc:  # the fleet is in no consistent state: the run fails
                log.exception("ps recovery failed; the run fails", extra=kv(nodes=",".join(sorted(nodes))))
                self.fail(nodes, exc)

    def fail(self, nodes: dict[str, int], exc: BaseException) -> None:
        """Record a failed recovery: ``ps_recovery_failed`` (fatal) and ``run_failed`` {reason}."""
        node = ",".join(sorted(nodes))
        error = " ".join(str(exc).split())  # one line
        self.failed = f"PS recovery after the restart of {node} failed: {error}"
        self.s.record_event(node, "ps_recovery_failed", {"incarnations": nodes, "error": error, "fatal": True},
                            "fail the run")
        self.s.record_event("controller", RUN_FAILED, {"reason": self.failed, "source": "ps_recovery"}, "stop")

    def recover(self, nodes: dict[str, int]) -> RestoreReport:
        """One recovery for the restarted ``nodes`` (``role:index`` -> incarnation).

        Raises:
            RecoveryError: no fleet wired in, a shard unreachable, or no committed cut.
            MetapsError: the fleet's restore failed (every cut refused, a shard failing).
        """
        fleet = self.fleet
        if fleet is None:
            raise RecoveryError("no PS fleet is wired into the controller (ControllerServer(ps_fleet=...)): "
                                "the restarted shard cannot be restored")
        t0 = time.monotonic()
        deadline = t0 + self.reach_timeout_s
        while True:
            addresses = self.s.ps_addresses()
            why = fleet.unreachable(addresses)
            if not why:
                break
            if time.monotonic() > deadline:
                raise RecoveryError(f"PS shard {why} unreachable for {self.reach_timeout_s:.0f}s; fleet not restored")
            time.sleep(0.2)
        node = ",".join(sorted(nodes))
        with self.s.fleet_lock:  # no vshard move while the fleet is restored
            committed = [c for c in self.s.checkpoints.cuts() if c.get("state") == "committed" and c.get("dir")]
            committed.sort(key=lambda c: int(c["cut_id"]), reverse=True)  # newest first
            aborted = self.s.checkpoints.abort_pending("ps restart: fleet restored to an earlier cut")
            if not committed:
                log.error("ps restarted with no committed checkpoint; the run fails", extra=kv(nodes=node))
                raise NoCommittedCut(
                    f"no committed checkpoint cut to restore ({len(aborted)} pending cut(s) aborted): the restarted "
                    f"shard's rows are lost while the other shards and the data ledger kept theirs; relaunch the job "
                    f"(set [controller] checkpoint_interval_s to make PS restarts recoverable)")
            by_dir = {str(c["dir"]): c for c in reversed(committed)}  # a dir committed twice: its newest cut

            requeued: list[str] = []

            def rollback(ckpt_dir: str) -> None:
                requeued.extend(self.s.checkpoints.rollback_to(int(by_dir[ckpt_dir]["cut_id"])))

            out = fleet.restore(addresses, [str(c["dir"]) for c in committed], pause_lease_s=120.0,
                                while_paused=rollback)
        cut = by_dir[out.dir]
        cut_id = int(cut["cut_id"])
        seconds = round(time.monotonic() - t0, 3)
        self.runs += 1
        if out.rejected:
            self.s.record_event(node, "ps_recovery_fallback",
                                {"newest_dir": str(committed[0]["dir"]), "newest_cut_id": int(committed[0]["cut_id"]),
                                 "dir": cut["dir"], "cut_id": cut_id, "rejected": [dict(r) for r in out.rejected]},
                                "restored an older committed cut: the newer one(s) were refused as corrupt")
            log.error("newest checkpoint refused; the fleet was restored from an older one",
                      extra=kv(newest=str(committed[0]["dir"]), dir=cut["dir"], rejected=len(out.rejected)))
        self.s.record_event(node, "ps_recovery",
                            {"incarnations": nodes, "cut_id": cut_id, "dir": cut["dir"], "step": cut.get("step"),
                             "rows": out.rows, "map_version": out.map_version, "healed": list(out.healed),
                             "requeued": len(requeued), "aborted_cuts": aborted, "seconds": seconds,
                             "fallback": bool(out.rejected)},
                            "restore_fleet+rollback")
        log.info("ps fleet restored to a committed cut",
                 extra=kv(nodes=node, cut_id=cut_id, dir=cut["dir"], rows=out.rows, requeued=len(requeued),
                          seconds=seconds))
        return out
