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
    event ps_recovery {node, incarnation, cut_id, dir, step, rows, digests, requeued, seconds}
                          (digests: shard -> what it served once restored, ps.digest)
    (+ event ps_recovery_fallback {newest_dir, dir, rejected} when an older cut was used)

**Durable.** Every step is recorded in the controller's LMDB state (``meta`` key
``ps_recovery``, :data:`RECORD_KEY`) *before* it acts: the request (which nodes,
before the restart is even registered), the pause and its lease, the directory being
restored and each shard restored to it, and the DDS rollback -- written in the
rollback's own transaction, so it happens exactly once. A controller that dies
mid-recovery finds the record on start (:meth:`PsRecovery.resume_pending`) and drives
it to the end: a record whose rollback committed only resumes the shards; otherwise
the fleet is paused again, the shards not yet restored to the recorded directory are
restored (all of them when the recorded pause may have lapsed since: writes may have
reached a restored shard), the DDS is rolled back once, the shards resume, and the
``ps_recovery`` event commits with the record's removal. While a record is pending
the run is not ``finished`` (no final checkpoint can be taken over rows a rollback is
about to replay).

**The pause is bounded by the controller's life.** Its lease is the controller's node
timeout (``heartbeat_timeout_s``), renewed every third of it while the recovery runs:
a controller that dies leaves a pause that ends by itself within one node timeout; a
restarted controller pauses again before it goes on.

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
from typing import Any, Callable, Protocol

import lmdb

from controller.checkpoint import CheckpointCoordinator
from controller.ports import PsFleet, RestoreReport
from controller.run_outcome import RUN_FAILED as _RUN_FAILED
from controller.state import EventLog, StateStore, dumps, loads
from common.errors import MetapsError
from common.log import kv

log = logging.getLogger(__name__)


RUN_FAILED = _RUN_FAILED
"""Event kind: the run cannot go on (evidence ``reason``); the launcher fails the run on it."""

RECORD_KEY = "ps_recovery"
"""Key of the pending recovery's record in the controller state's ``meta`` database."""


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
    @property
    def store(self) -> StateStore: ...
    @property
    def events(self) -> EventLog: ...

    def ps_addresses(self) -> list[str]: ...

    def record_event(self, node: str, kind: str, evidence: dict[str, Any], action: str = "",
                     txn: lmdb.Transaction | None = None) -> None: ...


class _Restored:
    """A :class:`~controller.ports.RestoreReport` for a recovery resumed after its rollback."""

    def __init__(self, rec: dict[str, Any]) -> None:
        self.dir = str(rec.get("dir", ""))
        self.rows = sum(int(r) for r in (rec.get("restored") or {}).values())
        self.map_version = int(rec.get("map_version", 0))
        self.healed: list[int] = []
        self.rejected: list[dict[str, str]] = list(rec.get("rejected") or [])


class PsRecovery:
    """Runs fleet recoveries for a :class:`~controller.server.ControllerServer`, one at a time.

    Requests that arrive while one runs (several shards restarting together) are
    coalesced into one more run. Each step is recorded durably first (see the module
    docstring); :meth:`resume_pending` re-drives a recorded one after a restart.

    Args:
        server: the controller (PS addresses, checkpoints, events, fleet lock, state).
        fleet: the PS fleet operations (``ps.fleet_admin.GrpcPsFleet``); None: a PS restart
            fails the run (nothing can restore the fleet).
        settle_s: wait this long after a request before starting (lets restarts bunch up).
        reach_timeout_s: give up (event ``ps_recovery_failed``) if a shard stays unreachable.
        pause_lease_s: the fleet pause's lease (renewed every third of it while the recovery
            runs): how long a pause outlives a dead controller. The server passes its node
            timeout (``heartbeat_timeout_s``).
    """

    fault_hook: Callable[[str, dict[str, Any]], None] | None = None
    """Tests: called after each step's record is durable (``pause``, ``restore``, ``restored``,
    ``rolled_back``, ``resume``) with its detail; a test's controller process dies there."""

    def __init__(self, server: RecoveryHost, fleet: PsFleet | None = None, settle_s: float = 0.3,
                 reach_timeout_s: float = 60.0, pause_lease_s: float = 30.0) -> None:
        self.s = server
        self.fleet = fleet
        self.settle_s = settle_s
        self.reach_timeout_s = reach_timeout_s
        self.pause_lease_s = pause_lease_s
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self.runs = 0
        self.failed = ""  # why the last failed recovery failed ('' while none did)

    # ------------------------------------------------------------ the durable record

    def record(self) -> dict[str, Any] | None:
        """The pending recovery's durable record (None: none pending)."""
        rec: dict[str, Any] | None = self.s.store.get_json("meta", RECORD_KEY)
        return rec

    def pending(self) -> bool:
        """A recovery was requested and has not ended (durably: true across a controller restart)."""
        return self.record() is not None

    def _update(self, fn: Callable[[dict[str, Any]], None], txn: lmdb.Transaction | None = None) -> dict[str, Any]:
        def apply(t: lmdb.Transaction) -> dict[str, Any]:
            raw = t.get(RECORD_KEY.encode(), db=self.s.store.db("meta"))
            rec = loads(raw) if raw is not None else _new_record()
            fn(rec)
            t.put(RECORD_KEY.encode(), dumps(rec), db=self.s.store.db("meta"))
            return rec

        if txn is not None:  # LMDB write transactions are serialised: read-modify-write is atomic
            return apply(txn)
        with self.s.store.begin(write=True) as own:
            return apply(own)

    def note(self, node: str, incarnation: int | str) -> None:
        """Record durably that ``node`` (``ps:K``) restarted, before anything acts on it.

        A new request after an earlier one's rollback (or mid-run) makes the record's
        current run finish by starting over (``gen`` changes; its restored shards are void).
        """
        def fn(rec: dict[str, Any]) -> None:
            rec["nodes"][node] = incarnation
            rec["gen"] = int(rec.get("gen", 0)) + 1
            rec["restored"].pop(node.partition(":")[2], None)
            if rec["phase"] == "rolled_back":
                rec.update(phase="requested", restored={}, dir="")

        self._update(fn)

    def discard(self, why: str) -> bool:
        """Drop a pending record without acting on it (a continued run restores its cut itself);
        True if there was one."""
        with self.s.store.begin(write=True) as txn:
            gone = bool(txn.delete(RECORD_KEY.encode(), db=self.s.store.db("meta")))
        if gone:
            log.warning("pending PS recovery discarded", extra=kv(why=why))
        return gone

    def request(self, node: str, incarnation: int) -> None:
        """A PS process came back as ``incarnation``: recover the fleet (asynchronously)."""
        log.warning("ps process restarted; fleet recovery requested", extra=kv(node=node, incarnation=incarnation))
        self.note(node, incarnation)
        self._start({node: incarnation})

    def resume_pending(self) -> bool:
        """On controller start: drive a recovery its record says is pending to its end (True if one is)."""
        rec = self.record()
        if rec is None:
            return False
        log.warning("a PS recovery was pending when the controller stopped; resuming it",
                    extra=kv(nodes=",".join(sorted(rec["nodes"])), phase=rec["phase"], dir=rec.get("dir") or "-",
                             restored=",".join(sorted(rec["restored"])) or "-"))
        self.s.record_event(",".join(sorted(rec["nodes"])), "ps_recovery_resumed",
                            {"phase": rec["phase"], "dir": rec.get("dir", ""), "restored": sorted(rec["restored"]),
                             "incarnations": rec["nodes"]}, "resume the recovery")
        self._start({str(k): int(v) for k, v in rec["nodes"].items()})
        return True

    def _start(self, nodes: dict[str, int]) -> None:
        with self._lock:
            self._pending.update(nodes)
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
        """Record a failed recovery: ``ps_recovery_failed`` (fatal) and ``run_failed`` {reason},
        in one transaction with the record's removal."""
        rec = self.record()
        if rec is not None:
            nodes = {**{str(k): int(v) for k, v in rec["nodes"].items()}, **nodes}
        node = ",".join(sorted(nodes))
        error = " ".join(str(exc).split())  # one line
        self.failed = f"PS recovery after the restart of {node} failed: {error}"
        with self.s.store.begin(write=True) as txn:
            txn.delete(RECORD_KEY.encode(), db=self.s.store.db("meta"))
            self.s.record_event(node, "ps_recovery_failed", {"incarnations": nodes, "error": error, "fatal": True},
                                "fail the run", txn=txn)
            self.s.record_event("controller", RUN_FAILED, {"reason": self.failed, "source": "ps_recovery"}, "stop",
                                txn=txn)

    def _hook(self, what: str, detail: dict[str, Any]) -> None:
        if self.fault_hook is not None:
            self.fault_hook(what, detail)

    def _on_step(self, what: str, detail: dict[str, Any]) -> None:
        """The fleet's progress: recorded durably before the step acts (see ``PsFleet.restore``)."""
        now = time.time()
        if what in ("pause", "renewed"):
            self._update(lambda r: r.update(phase=r["phase"] if r["phase"] == "rolled_back" else "paused",
                                            paused_until=now + self.pause_lease_s))
        elif what == "restore":
            def fn(r: dict[str, Any]) -> None:
                if r.get("dir") != detail["dir"]:
                    r.update(dir=detail["dir"], restored={})
            self._update(fn)
        elif what == "restored":
            def done(r: dict[str, Any]) -> None:
                r["restored"][str(detail["shard"])] = int(detail["rows"])
                if "digest" in detail:  # what the shard serves now (ps.digest): the event's evidence
                    r.setdefault("digests", {})[str(detail["shard"])] = detail["digest"]
            self._update(done)
        self._hook(what, detail)

    # ------------------------------------------------------------ one run

    def recover(self, nodes: dict[str, int]) -> RestoreReport:
        """One recovery for the restarted ``nodes`` (``role:index`` -> incarnation), from its record.

        Raises:
            RecoveryError: no fleet wired in, a shard unreachable, or no committed cut.
            MetapsError: the fleet's restore failed (every cut refused, a shard failing).
        """
        fleet = self.fleet
        if fleet is None:
            raise RecoveryError("no PS fleet is wired into the controller (ControllerServer(ps_fleet=...)): "
                                "the restarted shard cannot be restored")
        rec = self.record()
        if rec is None:  # called directly (tests): record it first
            for n, inc in nodes.items():
                self.note(n, inc)
            rec = self.record()
            assert rec is not None
        nodes = {**{str(k): int(v) for k, v in rec["nodes"].items()}, **nodes}
        gen = int(rec["gen"])
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
            rec = self.record() or rec
            aborted = self.s.checkpoints.abort_pending("ps restart: fleet restored to an earlier cut")
            if aborted:  # (rec: the record as updated, so the failure below counts these too)
                rec = self._update(lambda r: r.__setitem__("aborted", sorted(set(r["aborted"]) | set(aborted))))
            committed = [c for c in self.s.checkpoints.cuts() if c.get("state") == "committed" and c.get("dir")]
            committed.sort(key=lambda c: int(c["cut_id"]), reverse=True)  # newest first
            by_dir = {str(c["dir"]): c for c in reversed(committed)}  # a dir committed twice: its newest cut
            out: RestoreReport
            if rec["phase"] == "rolled_back":
                # the DDS rollback committed, so every shard was restored before it: only the pause is left
                log.info("recovery resumed after its rollback; resuming the shards", extra=kv(nodes=node))
                self._hook("resume", {"shards": len(addresses)})
                fleet.resume(addresses)
                out = _Restored(rec)
            else:
                if not committed:
                    log.error("ps restarted with no committed checkpoint; the run fails", extra=kv(nodes=node))
                    raise NoCommittedCut(
                        f"no committed checkpoint cut to restore ({len(rec['aborted'])} pending cut(s) aborted): the "
                        f"restarted shard's rows are lost while the other shards and the data ledger kept theirs; "
                        f"relaunch the job (set [controller] checkpoint_interval_s to make PS restarts recoverable)")
                skip: dict[str, list[int]] = {}
                if rec.get("dir") in by_dir and rec["restored"]:
                    if time.time() < float(rec.get("paused_until", 0.0)) - 1.0:
                        skip = {str(rec["dir"]): sorted(int(k) for k in rec["restored"])}
                    else:  # the pause may have lapsed: writes may have reached a restored shard
                        log.warning("the recorded pause may have lapsed; restoring every shard again",
                                    extra=kv(dir=rec["dir"], restored=",".join(sorted(rec["restored"]))))

                def rollback(ckpt_dir: str) -> None:
                    cut_id = int(by_dir[ckpt_dir]["cut_id"])

                    def also(txn: lmdb.Transaction, returned: list[str]) -> None:
                        self._update(lambda r: r.update(phase="rolled_back", dir=ckpt_dir, cut_id=cut_id,
                                                        requeued=len(returned)), txn=txn)

                    returned = self.s.checkpoints.rollback_to(cut_id, also)
                    self._hook("rolled_back", {"dir": ckpt_dir, "cut_id": cut_id, "requeued": len(returned)})

                out = fleet.restore(addresses, [str(c["dir"]) for c in committed], pause_lease_s=self.pause_lease_s,
                                    while_paused=rollback, on_step=self._on_step, skip=skip,
                                    renew_s=self.pause_lease_s / 3)
                if out.rejected:
                    self._update(lambda r: r.__setitem__("rejected", [dict(x) for x in out.rejected]))
        return self._finish(nodes, gen, out, committed, by_dir, t0)

    def _finish(self, nodes: dict[str, int], gen: int, out: RestoreReport, committed: list[dict[str, Any]],
                by_dir: dict[str, dict[str, Any]], t0: float) -> RestoreReport:
        """Record the outcome (``ps_recovery``) with the record's removal, in one transaction; a
        request that came in meanwhile (``gen`` moved) keeps the record for one more run."""
        node = ",".join(sorted(nodes))
        cut = by_dir[out.dir]
        cut_id = int(cut["cut_id"])
        seconds = round(time.monotonic() - t0, 3)
        self.runs += 1
        rec = self.record() or _new_record()
        rows = sum(int(r) for r in rec["restored"].values()) if rec["restored"] else int(out.rows)
        with self.s.store.begin(write=True) as txn:
            raw = txn.get(RECORD_KEY.encode(), db=self.s.store.db("meta"))
            cur = loads(raw) if raw is not None else None
            if cur is not None and int(cur.get("gen", 0)) != gen:
                cur.update(phase="requested", restored={}, dir="")  # a shard restarted meanwhile: run again
                txn.put(RECORD_KEY.encode(), dumps(cur), db=self.s.store.db("meta"))
            else:
                txn.delete(RECORD_KEY.encode(), db=self.s.store.db("meta"))
            if out.rejected:
                self.s.record_event(node, "ps_recovery_fallback",
                                    {"newest_dir": str(committed[0]["dir"]),
                                     "newest_cut_id": int(committed[0]["cut_id"]),
                                     "dir": cut["dir"], "cut_id": cut_id, "rejected": [dict(r) for r in out.rejected]},
                                    "restored an older committed cut: the newer one(s) were refused as corrupt",
                                    txn=txn)
                log.error("newest checkpoint refused; the fleet was restored from an older one",
                          extra=kv(newest=str(committed[0]["dir"]), dir=cut["dir"], rejected=len(out.rejected)))
            self.s.record_event(node, "ps_recovery",
                                {"incarnations": nodes, "cut_id": cut_id, "dir": cut["dir"], "step": cut.get("step"),
                                 "rows": rows, "map_version": out.map_version, "healed": list(out.healed),
                                 "digests": {k: v for k, v in (rec.get("digests") or {}).items()
                                             if k in rec["restored"]},
                                 "requeued": int(rec.get("requeued", 0)), "aborted_cuts": list(rec["aborted"]),
                                 "seconds": seconds, "fallback": bool(out.rejected)},
                                "restore_fleet+rollback", txn=txn)
        log.info("ps fleet restored to a committed cut",
                 extra=kv(nodes=node, cut_id=cut_id, dir=cut["dir"], rows=rows, requeued=rec.get("requeued", 0),
                          seconds=seconds))
        return out


def _new_record() -> dict[str, Any]:
    return {"nodes": {}, "gen": 0, "phase": "requested", "dir": "", "restored": {}, "aborted": [],
            "requeued": 0, "paused_until": 0.0, "opened": time.time()}
