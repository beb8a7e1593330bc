"""The controller process: DDS + Monitor + Policy + node registry behind gRPC.

``ControllerServer`` wires the parts together, serves ``protos/controller.proto``
(token auth as the PS, via :func:`common.rpc.make_server`) and runs a
background loop every ``tick_s``::

    tick: expire leases / hung shards -> requeue
          nodes silent > heartbeat_timeout_s -> DEAD, their shards requeued (every dataset)
          workers holding shards with no progress > worker_stall_timeout_s (controller/liveness.py)
              -> shards requeued, `worker_stalled` event, `restart` command to the node's agent
          close Monitor windows -> Policy.evaluate -> apply actions (each one an event)
          checkpoint interval due -> open a cut, send `checkpoint` commands

Example::

    srv = ControllerServer(ControllerConfig(), "/tmp/ctl",
                           [DatasetSpec("train", [64] * 4)], RpcConfig(token="t"))
    port = srv.start("127.0.0.1:0")
    ...
    srv.stop()
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import lmdb

from controller.checkpoint import CheckpointCoordinator
from controller.config import ControllerConfig
from controller.dds import DynamicDataSharding
from controller.liveness import WorkerLiveness
from controller.monitor import Monitor
from controller.node_registry import NodeInfo, NodeRegistry
from controller.worker_claims import WorkerClaims
from controller.policy import (
    Action,
    MoveVshards,
    Policy,
    Recovered,
    RejoinClock,
    ReleaseClock,
    RestartNode,
    RestoreShards,
    SetBatchSizes,
    ShrinkShards,
    SlowDetected,
    make_policy,
)
from controller.ports import PsFleet, PsMover
from controller.ps_mover import NothingToMove
from controller.ps_recovery import PsRecovery
from controller.run_outcome import RUN_FAILED, RunOutcome
from controller.servicer import ControllerServicer
from controller.state import Event, EventLog, StateDirLock, StateStore
from controller.types import NODE_CHECKPOINT_FAILED, NODE_FINISHED, DatasetSpec
from common.atomic_write import write_text_atomic
from common.log import kv
from common.rpc import RpcConfig, add_health, add_port, make_server
from protos import controller_pb2_grpc

log = logging.getLogger(__name__)


class ControllerServer:
    """The whole controller. See the module docstring.

    Args:
        cfg: ``[controller]`` settings.
        state_dir: LMDB state directory (reuse it to resume after a restart).
        datasets: the job's datasets (must match the state dir's on restart).
        rpc_cfg: token / TLS / message limits shared by the job.
        policy: a custom :class:`~controller.policy.Policy` (default: ``cfg.policy``).
        ps_mover: executes MoveVshards; None records the decision as skipped.
        ps_fleet: the PS fleet operations a PS restart's recovery runs (``controller/ports.py``;
            ``ps.fleet_admin.GrpcPsFleet``, wired by the app floor); None: a PS restart fails the run.
        clock: ``time.time``-like.
        end_fleet: when the run ends, stop the PS processes and shut down (controller/run_outcome.py).
        expected_workers: ``[train] workers`` (closing the data on request waits for that many).
        warm_start: the checkpoint every PS restored before training (a warm start), recorded as
            the run's first committed cut on its first start (``CheckpointCoordinator.commit_warm_start``).
    """

    checkpoint_root: str | None = None
    """CheckpointDone accepts only dirs under this root (``metaps controller`` sets it); None: any."""

    def __init__(self, cfg: ControllerConfig, state_dir: str | Path, datasets: Sequence[DatasetSpec] = (),
                 rpc_cfg: RpcConfig | None = None, policy: Policy | None = None, ps_mover: PsMover | None = None,
                 clock: Callable[[], float] = time.time, ps_fleet: PsFleet | None = None,
                 end_fleet: bool = False, expected_workers: int = 0, warm_start: str = "") -> None:
        cfg.validate()
        self.cfg = cfg
        self.rpc_cfg = rpc_cfg or RpcConfig()
        self.state_dir = Path(state_dir)
        self.clock = clock
        self._dir_lock = StateDirLock(self.state_dir)  # one controller per state directory, before any read
        try:
            self.store = StateStore(self.state_dir, fsync=cfg.fsync)
            self.events = EventLog(self.store)
            self.dds = DynamicDataSharding(self.store, cfg.dds, datasets, self.events, clock)
            self.monitor = Monitor(cfg.monitor, clock)
            self.registry = NodeRegistry(self.store, clock)
            self.worker_claims = WorkerClaims(self.store, self.registry, clock)  # pods of a work-queue Job
            self.liveness = WorkerLiveness(cfg.worker_stall_timeout_s, clock) if cfg.worker_stall_timeout_s > 0 else None
            self.checkpoints = CheckpointCoordinator(self.store, self.dds, clock)
            if warm_start:  # the checkpoint every PS restored before training: the run's cut 0
                self.checkpoints.commit_warm_start(warm_start)
            self.policy = policy or make_policy(cfg)
            self.ps_mover = ps_mover
            self._server: Any = None
            self._stop = threading.Event()
            self.shutdown_requested = threading.Event()
            self._loop: threading.Thread | None = None
            self._last_ckpt = clock()
            self._movers: list[threading.Thread] = []
            self.fleet_lock = threading.Lock()  # one fleet change at a time: a vshard move or a PS recovery
            self.recovery = PsRecovery(self, ps_fleet, pause_lease_s=cfg.heartbeat_timeout_s)
            self.outcome = RunOutcome(self, end_fleet=end_fleet, expected_workers=expected_workers)
            self.address = ""
            self._truncates: set[tuple[str, int]] = set()  # truncate commands sent by this process
        except BaseException:
            if hasattr(self, "store"):
                self.store.close()
            self._dir_lock.release()
            raise

    # ---------------------------------------------------------------- lifecycle

    def start(self, address: str | None = None) -> int:
        """Serve on ``address`` (default ``cfg.address``); return the bound port."""
        address = address or self.cfg.address
        self._server = make_server(self.rpc_cfg, max_workers=self.cfg.max_workers)
        controller_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(self), self._server)
        add_health(self._server)
        port = add_port(self._server, address, self.rpc_cfg)
        self._server.start()
        self.address = f"{address.rsplit(':', 1)[0]}:{port}"
        write_text_atomic(self.state_dir / "address", self.address + "\n")  # the launcher polls it
        self._stop.clear()
        self._loop = threading.Thread(target=self._run_loop, name="controller-tick", daemon=True)
        self._loop.start()
        self.recovery.resume_pending()  # a PS recovery this state records as unfinished (ps_recovery.py)
        log.info("controller serving", extra=kv(address=self.address, policy=self.policy.name,
                                                datasets=",".join(sorted(self.dds.specs))))
        return port

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving and the background loop; close LMDB."""
        self._stop.set()
        if self._loop is not None:
            self._loop.join(timeout=max(5.0, 2 * self.cfg.tick_s))
        for t in self._movers:
            t.join(timeout=30)
        self.recovery.join(timeout=30)
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        self.store.close()
        self._dir_lock.release()
        log.info("controller stopped", extra=kv(address=self.address))

    def continue_from_latest_cut(self) -> dict[str, Any]:
        """Continue an interrupted run (before serving): the DDS goes back to the latest committed
        cut (what was done after it is redone, as the PS restore that cut's rows), and the
        previous attempt's processes are retired (the new ones register as fresh processes,
        not restarts: they restore the cut themselves, no fleet recovery runs).

        Raises:
            UnknownCut: no committed cut.
        """
        cut = self.checkpoints.latest_committed()
        requeued = self.checkpoints.rollback_to_latest()
        self.registry.retire_all()  # the new attempt's PS restore the cut themselves: no restart recovery
        self.recovery.discard("the run continues from its latest committed cut")  # nor a pending one
        assert cut is not None  # rollback_to_latest raised otherwise
        evidence = {"cut_id": cut["cut_id"], "step": cut.get("step"), "dir": cut.get("dir"), "requeued": requeued}
        self.events.record(Event.now("controller", "run_continued", evidence, "rollback to the cut"))
        log.info("continuing the run from its latest committed cut", extra=kv(cut_id=cut["cut_id"],
                                                                               requeued=len(requeued)))
        return evidence

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a Shutdown RPC arrives (True) or ``timeout`` passes (False)."""
        return self.shutdown_requested.wait(timeout)

    def _run_loop(self) -> None:
        while not self._stop.wait(self.cfg.tick_s):
            try:
                self.tick()
            except Exception:  # one bad tick must not stop lease expiry forever
                log.exception("controller tick failed")

    # ---------------------------------------------------------------- the loop

    def tick(self) -> None:
        """One pass of leases, liveness, policy and checkpoint trigger (public for tests)."""
        self.dds.expire()
        for info in self.registry.timed_out(self.cfg.heartbeat_timeout_s):
            self.node_down(info.role, info.index, f"no heartbeat for {self.cfg.heartbeat_timeout_s}s")
        self.check_stalls()
        self.tail_split()
        now = self.clock()
        self.apply(self.policy.evaluate(self.monitor.snapshot(now), now))
        if self.cfg.checkpoint_interval_s > 0 and now - self._last_ckpt >= self.cfg.checkpoint_interval_s:
            self._last_ckpt = now
            self.trigger_checkpoint()
        self.outcome.tick()

    def check_stalls(self) -> list[int]:
        """Workers holding shards without progress: requeue, record, restart (controller/liveness.py).

        Returns:
            the indices of the workers handled as stalled in this call.
        """
        if self.liveness is None:
            return []
        beats = {i.index: i.last_process_heartbeat for i in self.registry.nodes() if i.role == "worker"}
        stalls, episode = self.liveness.stalled(self.dds.holders(), beats)
        if episode:
            log.warning("every busy worker is waiting; none is flagged (a shared cause: a PS, a pause)",
                        extra=kv(timeout_s=self.liveness.timeout_s))
            self.events.record(Event.now("controller", "fleet_stalled",
                                         {"timeout_s": self.liveness.timeout_s}, ""))
        for st in stalls:
            reason = st.reason(self.liveness.timeout_s)
            requeued = self.dds.requeue_worker(st.worker, reason)
            self.liveness.reset(st.worker)
            action = "requeue+restart"
            if self.registry.known("worker", st.worker):
                self.registry.enqueue("worker", st.worker, "restart", target="agent", reason=reason)
            else:
                action = "requeue"
            log.error("worker stalled", extra=kv(worker=st.worker, idle_s=round(st.idle_s, 1),
                                                 frozen=st.frozen, requeued=len(requeued)))
            self.events.record(Event.now(f"worker:{st.worker}", "worker_stalled", {
                "reason": reason, "idle_s": round(st.idle_s, 3), "heartbeat_age_s": round(st.heartbeat_age_s, 3),
                "frozen": st.frozen, "last_step": st.last_step, "shards": list(st.shards),
                "requeued": requeued, "timeout_s": self.liveness.timeout_s}, action))
        return [st.worker for st in stalls]

    def tail_split(self) -> list[tuple[int, str, int]]:
        """The DDS tail fix (controller/dds.py): tell lease holders to stop early for waiting workers.

        A ``truncate`` command goes to each holder once per controller run (a restarted
        controller sends the ones its state still holds again).

        Returns:
            the (worker, shard id, stop batch) sent in this call.
        """
        sent = []
        for worker, shard_id, stop in self.dds.tail_split():
            if (shard_id, stop) in self._truncates or not self.registry.known("worker", worker):
                continue
            self._truncates.add((shard_id, stop))
            self.registry.enqueue("worker", worker, "truncate", target="process", shard_id=shard_id,
                                  stop_batch=stop, reason="tail split: a worker waits for data")
            sent.append((worker, shard_id, stop))
        return sent

    def trigger_checkpoint(self, reason: str = "interval") -> int:
        """Open a cut and send a ``checkpoint`` command to every live process (the leader acts).

        Args:
            reason: why, for the event log (``interval``, or a ``RequestCut``'s: a drain's preStop).
        """
        cut_id = self.checkpoints.open_cut()
        targets = [i.name for i in self.registry.alive()]
        for info in self.registry.alive():
            self.registry.enqueue(info.role, info.index, "checkpoint", target="process", cut_id=cut_id)
        self.events.record(Event.now("controller", "checkpoint", {"cut_id": cut_id, "targets": targets,
                                                                  "reason": reason}, "checkpoint"))
        return cut_id

    def node_down(self, role: str, index: int, reason: str, exit_code: int = 0) -> list[str]:
        """A node's process died: mark it, requeue its shards in every dataset, record it.

        A worker reporting reason :data:`~controller.types.NODE_FINISHED` with exit code 0
        finished its part of the run: it is marked done (``node_finished``), not dead.
        """
        if reason == NODE_FINISHED and exit_code == 0:
            if role == "worker":
                self.outcome.worker_finished(index)  # before it leaves the live set: was it the leader?
            self.registry.mark_done(role, index)
            requeued = self.dds.requeue_worker(index, reason) if role == "worker" else []  # holds none: a guard
            self.events.record(Event.now(f"{role}:{index}", "node_finished", {"requeued": requeued}, ""))
            return requeued
        if role == "worker" and reason.startswith(NODE_CHECKPOINT_FAILED + ":"):  # before it leaves: no new leader
            self.outcome.final_checkpoint_failed(index, reason.partition(":")[2].strip())
        self.registry.mark_dead(role, index)
        requeued = self.dds.requeue_worker(index, reason) if role == "worker" else []
        if role == "worker" and self.liveness is not None:
            self.liveness.reset(index)
        self.events.record(Event.now(f"{role}:{index}", "node_down",
                                     {"reason": reason, "exit_code": exit_code, "requeued": requeued}, "requeue"))
        return requeued

    def register_node(self, role: str, index: int, address: str = "", metrics_port: int = 0, pid: int = 0,
                      source: str = "process", incarnation_id: str = "", pod_uid: str = "") -> tuple[NodeInfo, bool]:
        """Register a node; returns it and whether this is a restart.

        A *process* registering under a new ``incarnation_id`` when the controller knew an
        earlier one is a restart (a crashed process, or a pod replaced by a drain or a rolling
        update: same pid in a fresh PID namespace, so pids decide nothing). A restarted PS
        starts a fleet recovery (ps_recovery.py). The same id registering again (its link
        re-registers after a controller restart) is no restart.
        """
        prev = self.registry.get(role, index) if self.registry.known(role, index) else None
        prev_id, prev_pid, prev_uid = (prev.incarnation_id, prev.pid, prev.pod_uid) if prev else ("", 0, "")
        restarted = source == "process" and bool(prev_id) and incarnation_id != prev_id
        if role == "ps" and restarted and incarnation_id:
            # durable before the registry forgets the old incarnation: a controller that dies
            # right after still recovers the fleet when it starts again
            self.recovery.note(f"{role}:{index}", prev.incarnation + 1 if prev else 1)
        info = self.registry.register(role, index, address, metrics_port, pid, source, incarnation_id, pod_uid)
        if role == "worker" and source == "process" and self.liveness is not None:
            self.liveness.reset(index)  # a fresh incarnation holds nothing yet
        if role == "ps" and restarted:
            self.events.record(Event.now(info.name, "ps_restarted",
                                         {"incarnation": info.incarnation, "incarnation_id": incarnation_id,
                                          "previous_incarnation_id": prev_id, "pod_uid": pod_uid,
                                          "previous_pod_uid": prev_uid, "pid": pid, "previous_pid": prev_pid,
                                          "address": address}, "recover"))
            self.recovery.request(info.name, info.incarnation)
        return info, restarted

    def recovery_pending(self) -> bool:
        """A PS recovery is recorded and not ended (controller/ps_recovery.py)."""
        return self.recovery.pending()

    def run_finished(self) -> bool:
        """Every dataset done and no PS recovery pending (its rollback may requeue shards)."""
        return self.dds.finished() and not self.recovery_pending()

    def ps_addresses(self) -> list[str]:
        """Every PS shard's registered address, in shard order (the PsMover's and recovery's view).

        Raises:
            ValueError: no PS registered, or a shard below the highest one has not registered its address.
        """
        ps = {i.index: i.address for i in self.registry.nodes() if i.role == "ps"}
        if not ps:
            raise ValueError("no PS shard has registered with the controller (start `metaps ps --controller ADDR`)")
        missing = [k for k in range(max(ps) + 1) if not ps.get(k)]
        if missing:
            raise ValueError(f"PS shard(s) {missing} have not registered an address with the controller "
                             f"(registered: {sorted(k for k, a in ps.items() if a)})")
        return [ps[k] for k in range(max(ps) + 1)]

    def record_event(self, node: str, kind: str, evidence: dict[str, Any], action: str = "",
                     txn: lmdb.Transaction | None = None) -> None:
        """Append one event to the LMDB event log (inside ``txn`` when given; a ``run_failed`` one
        also fails the run's outcome)."""
        self.events.record(Event.now(node, kind, evidence, action), txn)
        if kind == RUN_FAILED:
            self.outcome.note_failed(str(evidence.get("reason") or "the controller failed the run"))

    def apply(self, actions: Sequence[Action]) -> None:
        """Carry out policy actions; each one becomes an event."""
        for a in actions:
            action = a.kind.value
            evidence = dict(a.evidence)
            role, _, idx = a.node.partition(":")
            if isinstance(a, SlowDetected):
                self.registry.set_slow(role, int(idx), True)
                action = ""
            elif isinstance(a, Recovered):
                self.registry.set_slow(role, int(idx), False)
                action = ""
            elif isinstance(a, ShrinkShards):
                self.dds.set_slow(a.worker, True)
                evidence["shard_size"] = self.dds.shard_size(a.worker)
            elif isinstance(a, RestoreShards):
                self.dds.set_slow(a.worker, False)
                evidence["shard_size"] = self.dds.shard_size(a.worker)
            elif isinstance(a, (ReleaseClock, RejoinClock)):
                # the worker process leaves / rejoins the PS step clocks itself (workers/worker.py):
                # controller/ never talks to the PS's clocks directly
                if self.registry.known("worker", a.worker):
                    self.registry.enqueue("worker", a.worker, a.kind.value, target="process",
                                          reason=f"flagged slow: {a.kind.value}")
                else:
                    action = f"{a.kind.value} skipped: worker {a.worker} is not registered"
            elif isinstance(a, RestartNode):
                self.registry.enqueue(a.role, a.index, "restart", target="agent", reason="persistently slow")
            elif isinstance(a, SetBatchSizes):
                evidence["sizes"] = {str(k): v for k, v in a.sizes.items()}
                live = sorted(i.index for i in self.registry.alive() if i.role == "worker")
                if sorted(a.sizes) != live:
                    # workers switch only to a plan every one of them holds (workers/dd.py): a plan
                    # that leaves out a live worker, or names a dead one, could never be adopted
                    action = f"set_batch_sizes skipped: sizes for workers {sorted(a.sizes)}, live workers {live}"
                else:
                    # One stamp for the whole plan, carried in Command.cut_id: workers adopt a plan
                    # at the first step every worker holds it, so the sizes always sum to the global batch.
                    plan = self._next_plan()
                    evidence["plan"] = plan
                    self.registry.set_batch_sizes(a.sizes)
                    for w, size in a.sizes.items():
                        self.registry.enqueue("worker", w, "set_batch_size", target="process", batch_size=size,
                                              cut_id=plan)
            elif isinstance(a, MoveVshards):
                evidence.update(src=a.src, dst=a.dst, n=a.n)
                if self.ps_mover is None:
                    action = "move_vshards skipped: no PsMover configured"
                else:
                    t = threading.Thread(target=self._move, args=(a,), name="vshard-move", daemon=True)
                    self._movers = [m for m in self._movers if m.is_alive()] + [t]
                    t.start()
            self.events.record(Event(self.clock(), a.node, a.kind.value, evidence, action))

    def _next_plan(self) -> int:
        """A batch-size plan stamp: increasing, also across controller restarts (milliseconds)."""
        self._plan = max(getattr(self, "_plan", 0) + 1, int(self.clock() * 1000))
        return self._plan

    def _move(self, a: MoveVshards) -> None:
        t0 = time.monotonic()
        try:
            assert self.ps_mover is not None
            with self.fleet_lock:
                self.ps_mover.move_vshards(a.src, a.dst, a.n)
            self.events.record(Event.now(a.node, "move_vshards_done",
                                         {"src": a.src, "dst": a.dst, "n": a.n,
                                          "seconds": round(time.monotonic() - t0, 3)}))
        except NothingToMove as exc:  # the slow PS is already down to what it keeps
            log.info("vshard move skipped", extra=kv(src=a.src, dst=a.dst, reason=str(exc)))
            self.events.record(Event.now(a.node, "move_vshards_skipped",
                                         {"src": a.src, "dst": a.dst, "n": a.n, "reason": str(exc)}))
        except Exception as exc:
            log.exception("vshard move failed", extra=kv(src=a.src, dst=a.dst, n=a.n))
            self.events.record(Event.now(a.node, "move_vshards_failed",
                                         {"src": a.src, "dst": a.dst, "n": a.n, "error": str(exc)}))

    # ---------------------------------------------------------------- status

    def status(self, events_since: int = 0, brief: bool = False) -> dict[str, Any]:
        """Progress, nodes, events, coverage and checkpoint cuts as plain data (the run report's input).

        Args:
            events_since: events with a larger sequence number only.
            brief: only datasets, ``finished`` and ``run`` (what a worker waiting for the run's end
                polls): no coverage (a scan of the whole ledger under the DDS lock), nodes, events,
                recovery or checkpoint cuts.
        """
        run_state, run_reason = self.outcome.state()
        run = {"state": run_state.value, "reason": run_reason, "leader": self.outcome.leader(),
               "final_checkpoint": self.outcome.final_done}
        if brief:
            return {"datasets": self.dds.progress(), "finished": self.run_finished(), "run": run}
        cov = self.dds.coverage()
        nodes = []
        for i in self.registry.nodes():
            nodes.append({"role": i.role, "index": i.index, "state": i.state.value, "slow": i.slow,
                          "last_heartbeat": i.last_heartbeat, "step": i.step, "rss_bytes": i.rss_bytes,
                          "cpu_percent": i.cpu_percent, "batch_size": i.batch_size,
                          "shard_size": self.dds.shard_size(i.index) if i.role == "worker" else 0,
                          "address": i.address, "restarts": i.restarts})
        return {
            "datasets": self.dds.progress(),
            "nodes": nodes,
            "events": [e.__dict__ for e in self.events.list(since=events_since)],
            "finished": self.run_finished(),
            "recovery": self.recovery.record(),
            "run": run,
            "coverage": cov.to_status(),
            "checkpoints": self.checkpoints.cuts(),
        }


def dump_status(status: dict[str, Any]) -> str:
    return json.dumps(status, indent=2, sort_keys=True, default=str)
