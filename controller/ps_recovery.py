"""PS failure recovery: put the whole fleet back at the last *good* committed checkpoint cut.

Who triggers it: the controller, when a PS *process* registers again with a new
pid (its agent restarted it after a crash, or the fleet was restarted against
the same controller state). Its rows are gone (or came from an older
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

Example::

    rec = PsRecovery(server)          # ControllerServer
    rec.request("ps:1", incarnation=2)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import grpc

from metaps.core.errors import MetapsError
from metaps.core.log import kv
from metaps.core.rpc import RpcConfig, make_channel
from protos import ps_pb2, ps_pb2_grpc

log = logging.getLogger(__name__)


RUN_FAILED = "run_failed"
"""Event kind: the run cannot go on (evidence ``reason``); the launcher fails the run on it."""


class RecoveryError(MetapsError):
    """The fleet could not be restored (a shard unreachable or refusing); the message names it."""


class NoCommittedCut(RecoveryError):
    """A PS restarted before any checkpoint cut was committed: nothing consistent to restore; the run fails."""


class CheckpointRefused(RecoveryError):
    """A shard refused the checkpoint as corrupt or incomplete (DATA_LOSS); it is unchanged."""


def restore_fleet(addresses: list[str], rpc_cfg: RpcConfig, ckpt_dirs: str | list[str], *,
                  pause_lease_s: float = 120.0,
                  while_paused: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Restore every shard from the first of ``ckpt_dirs`` that every shard accepts, under one pause.

    A shard refuses a corrupt or incomplete checkpoint with DATA_LOSS and is left
    unchanged (the PS restore is all or nothing); the next directory is then tried
    on *every* shard, so the fleet always ends at one cut. ``while_paused(dir)``
    runs once, for the directory restored, before the shards resume.

    Returns:
        ``{"dir", "rows", "map_version", "healed", "rejected", "result"}``: the directory
        restored, rows loaded, the map every shard has, shards whose map was behind,
        ``[{"dir", "error"}]`` refused before it, and ``while_paused``'s result.

    Raises:
        CheckpointRefused: every directory was refused (the message names each and why).
        RecoveryError: a shard unreachable or failing otherwise.
    """
    from ps.partition_map import PartitionMap

    dirs = [ckpt_dirs] if isinstance(ckpt_dirs, str) else list(ckpt_dirs)
    if not dirs:
        raise CheckpointRefused("no checkpoint directory to restore from")
    channels = [make_channel(a, rpc_cfg) for a in addresses]
    stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    timeout = rpc_cfg.timeout_s
    paused: list[int] = []
    rejected: list[dict[str, str]] = []
    try:
        try:
            for k, s in enumerate(stubs):
                s.PauseWrites(ps_pb2.PauseRequest(paused=True, lease_s=pause_lease_s), timeout=timeout)
                paused.append(k)
            maps = [PartitionMap.from_proto(s.GetPartitionMap(ps_pb2.GetPartitionMapRequest(), timeout=timeout))
                    for s in stubs]
            newest = max(maps, key=lambda m: m.version)
            healed = [k for k, m in enumerate(maps) if m.version < newest.version]
            for k in healed:
                stubs[k].UpdatePartitionMap(newest.to_proto(), timeout=timeout)
            for ckpt_dir in dirs:
                rows = 0
                try:
                    for k, s in enumerate(stubs):
                        rows += int(s.Restore(ps_pb2.RestoreRequest(dir=ckpt_dir), timeout=timeout * 10).rows)
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND):
                        raise  # corrupt or vanished cuts fall back to the previous one; anything else fails
                    log.error("a shard refused the checkpoint; trying the previous one",
                              extra=kv(shard=k, dir=ckpt_dir, error=(exc.details() or "")[:300]))
                    rejected.append({"dir": ckpt_dir, "shard": str(k), "error": exc.details() or ""})
                    continue
                result = while_paused(ckpt_dir) if while_paused is not None else None
                return {"dir": ckpt_dir, "rows": rows, "map_version": newest.version, "healed": healed,
                        "rejected": rejected, "result": result}
        except grpc.RpcError as exc:
            raise RecoveryError(f"restoring the PS fleet {addresses} failed: "
                                f"{exc.code().name}: {exc.details()}") from None
        why = "; ".join(f"{r['dir']}: {r['error']}" for r in rejected)
        raise CheckpointRefused(f"no committed checkpoint could be restored ({len(rejected)} refused): {why}")
    finally:
        for k in paused:
            try:
                stubs[k].PauseWrites(ps_pb2.PauseRequest(paused=False), timeout=timeout)
            except grpc.RpcError as exc:  # the pause lease ends it anyway
                log.warning("could not resume a shard after recovery", extra=kv(shard=k, error=exc.details()))
        for c in channels:
            c.close()


def _reachable(addresses: list[str], rpc_cfg: RpcConfig) -> str:
    """'' when every shard answers GetPartitionMap, else the first failure."""
    for a in addresses:
        ch = make_channel(a, rpc_cfg)
        try:
            ps_pb2_grpc.ParameterServerStub(ch).GetPartitionMap(ps_pb2.GetPartitionMapRequest(),
                                                                timeout=min(2.0, rpc_cfg.timeout_s))
        except grpc.RpcError as exc:
            return f"{a}: {exc.code().name}"
        finally:
            ch.close()
    return ""


class PsRecovery:
    """Runs fleet recoveries for a :class:`~controller.server.ControllerServer`, one at a time.

    Requests that arrive while one runs (several shards restarting together) are
    coalesced into one more run. See the module docstring.

    Args:
        server: the controller (registry, checkpoints, events, rpc_cfg, fleet lock).
        settle_s: wait this long after a request before starting (lets restarts bunch up).
        reach_timeout_s: give up (event ``ps_recovery_failed``) if a shard stays unreachable.
    """

    def __init__(self, server: Any, settle_s: float = 0.3, reach_timeout_s: float = 60.0) -> None:
        self.s = server
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

    def recover(self, nodes: dict[str, int]) -> dict[str, Any]:
        """One recovery for the restarted ``nodes`` (``role:index`` -> incarnation)."""
        t0 = time.monotonic()
        deadline = t0 + self.reach_timeout_s
        while True:
            addresses = self.s.ps_addresses()
            why = _reachable(addresses, self.s.rpc_cfg)
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

            def rollback(ckpt_dir: str) -> list[str]:
                return self.s.checkpoints.rollback_to(int(by_dir[ckpt_dir]["cut_id"]))

            out = restore_fleet(addresses, self.s.rpc_cfg, [str(c["dir"]) for c in committed],
                                while_paused=rollback)
        cut = by_dir[out["dir"]]
        cut_id = int(cut["cut_id"])
        requeued = out["result"] or []
        seconds = round(time.monotonic() - t0, 3)
        self.runs += 1
        if out["rejected"]:
            self.s.record_event(node, "ps_recovery_fallback",
                                {"newest_dir": str(committed[0]["dir"]), "newest_cut_id": int(committed[0]["cut_id"]),
                                 "dir": cut["dir"], "cut_id": cut_id, "rejected": out["rejected"]},
                                "restored an older committed cut: the newer one(s) were refused as corrupt")
            log.error("newest checkpoint refused; the fleet was restored from an older one",
                      extra=kv(newest=str(committed[0]["dir"]), dir=cut["dir"], rejected=len(out["rejected"])))
        self.s.record_event(node, "ps_recovery",
                            {"incarnations": nodes, "cut_id": cut_id, "dir": cut["dir"], "step": cut.get("step"),
                             "rows": out["rows"], "map_version": out["map_version"], "healed": out["healed"],
                             "requeued": len(requeued), "aborted_cuts": aborted, "seconds": seconds,
                             "fallback": bool(out["rejected"])},
                            "restore_fleet+rollback")
        log.info("ps fleet restored to a committed cut",
                 extra=kv(nodes=node, cut_id=cut_id, dir=cut["dir"], rows=out["rows"], requeued=len(requeued),
                          seconds=seconds))
        return out
