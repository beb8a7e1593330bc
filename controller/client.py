"""What workers, PS processes, agents and the launcher call on the controller.

Calls retry with backoff while the controller is unreachable (it may be
restarting; its state survives in LMDB), up to ``retry_s``; any other refusal
raises :class:`ControllerError` with the controller's message (unknown worker,
dataset or shard...).

Worker loop::

    ctl = ControllerClient("127.0.0.1:7070", RpcConfig(token="t"), role="worker", index=rank)
    ctl.register(metrics_port=9300)
    for lease in ctl.shards("train"):              # WAIT handled inside, stops at DONE
        t0 = time.monotonic()
        for b in range(lease.start, lease.stop): ...   # train on batches of file lease.file
        ctl.report_shard(lease, "done", samples=n, elapsed_s=time.monotonic() - t0)
        ctl.report_metrics(batch_times_s=times, samples_per_s=n / elapsed)
    # in a side thread every heartbeat_s:
    reply = ctl.heartbeat(step=step)   # renews leases; reply.batch_size (DD), reply.commands

Launcher::

    st = ControllerClient(addr, rpc).status()   # datasets, nodes, events, coverage, checkpoints
"""

from __future__ import annotations

import json
import logging
import os
import time
import queue
import secrets
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

import grpc

from controller.types import Command, GetResult, GetStatus, ReportResult, ShardLease
from common import exit_codes
from common.errors import MetapsError
from common.rpc import RpcConfig, make_channel
from protos import controller_pb2 as pb
from protos import controller_pb2_grpc

log = logging.getLogger(__name__)

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_STATUS = {pb.GetShardResponse.SHARD: GetStatus.SHARD, pb.GetShardResponse.WAIT: GetStatus.WAIT,
           pb.GetShardResponse.DONE: GetStatus.DONE}


class ControllerError(MetapsError):
    """The controller refused a call; ``code`` is the gRPC status.

    A refusal because the run failed (FAILED_PRECONDITION ``run_failed: <why>``: a process that
    registers or claims into a failed run) carries ``exit_code`` RUN_FAILED (4), so the command
    exits as a process told to stop would: its agent does not restart it and a worker Job's
    podFailurePolicy fails the Job at once.
    """

    def __init__(self, code: grpc.StatusCode, message: str, method: str) -> None:
        super().__init__(f"controller {method}: {code.name}: {message}")
        self.code = code
        self.details = message
        if code == grpc.StatusCode.FAILED_PRECONDITION and message.startswith(exit_codes.STOP_RUN_FAILED + ":"):
            self.exit_code = exit_codes.RUN_FAILED

    @property
    def run_ended(self) -> bool:
        """The refusal says the run is complete (FAILED_PRECONDITION ``run_ended: ...``): a pod that asked
        to join it has nothing to do and exits 0."""
        return (self.code == grpc.StatusCode.FAILED_PRECONDITION
                and self.details.startswith(exit_codes.STOP_RUN_ENDED + ":"))


@dataclass(frozen=True)
class HeartbeatReply:
    """Commands for this caller, and (workers) the batch size to use now (0 = job default)."""

    commands: list[Command] = field(default_factory=list)
    batch_size: int = 0
    known: bool = True
    leader: bool = False  # a worker: it is the checkpoint leader now


@dataclass(frozen=True)
class DoneReport:
    """A shard report to piggy-back on the next lease request (``ControllerClient.lease``)."""

    lease: ShardLease
    status: str = "done"
    samples: int = 0
    elapsed_s: float = 0.0
    error: str = ""
    stop: int = 0  # where a lease told to truncate was stopped (0: the whole shard)
    step_limit: bool = False  # the worker reached its step limit at ``stop``


@dataclass(frozen=True)
class LeaseReply:
    """What a combined report + lease request got: the lease result and the report's."""

    got: GetResult
    report: ReportResult | None = None


_INCARNATION: tuple[int, str] = (0, "")


def incarnation_id() -> str:
    """This process start's random identity (a new one in a forked child).

    A pod recreated by a drain or a rolling update starts in a fresh PID namespace and
    gets the same small pid as the one it replaces, so the controller tells process
    starts apart by this id, never by the pid.
    """
    global _INCARNATION
    pid = os.getpid()
    if _INCARNATION[0] != pid:
        _INCARNATION = (pid, secrets.token_hex(8))
    return _INCARNATION[1]


@dataclass(frozen=True)
class Registration:
    """What RegisterNode answered.

    Attributes:
        incarnation: how many process registrations this node has had (1: the first).
        restarted: the controller knew an earlier process of this node under another
            incarnation id: this is a restart (a PS shard then awaits the fleet's recovery).
    """

    incarnation: int
    heartbeat_s: float
    lease_s: float
    batch_size: int
    restarted: bool = False


class ControllerClient:
    """A channel to the controller for one node.

    Args:
        address: ``host:port``.
        rpc_cfg: token / TLS / limits (same as the job's).
        role: ``worker`` or ``ps``.
        index: the node's index (worker rank or PS shard).
        source: ``process`` (the worker/PS itself) or ``agent``.
        retry_s: how long to keep retrying while the controller is unreachable.
    """

    def __init__(self, address: str, rpc_cfg: RpcConfig | None = None, role: str = "worker", index: int = 0,
                 source: str = "process", retry_s: float = 60.0) -> None:
        self.address = address
        self.rpc_cfg = rpc_cfg or RpcConfig()
        self.role, self.index, self.source = role, index, source
        self.retry_s = retry_s
        self._channel = make_channel(address, self.rpc_cfg)
        self._stub = controller_pb2_grpc.ControllerStub(self._channel)
        self._reg_args: dict[str, Any] | None = None
        self._deferred: DoneReport | None = None  # defer_report(): rides on the next get_shard
        self._sender: _Sender | None = None  # the *_async calls (see _submit)

    def _ref(self) -> pb.NodeRef:
        return pb.NodeRef(role=self.role, index=self.index, source=self.source)

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        fn: Callable[..., Any] = getattr(self._stub, method)
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                return fn(request, timeout=timeout or self.rpc_cfg.timeout_s)
            except grpc.RpcError as exc:
                code = exc.code()
                if code in _RETRYABLE and time.monotonic() + delay < deadline:
                    log.debug("controller unreachable, retrying", extra={"kv": {"method": method, "code": code.name}})
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                raise ControllerError(code, exc.details() or "", method) from None

    # ---------------------------------------------------------------- nodes

    def register(self, address: str = "", metrics_port: int = 0, pid: int | None = None,
                 incarnation: str | None = None) -> Registration:
        """Register this node (a process: with :func:`incarnation_id`, and its pod UID in a pod).

        Args:
            pid: evidence for the event log (default: this process's).
            incarnation: the process start's id (default: :func:`incarnation_id`).
        """
        self._reg_args = {"address": address, "metrics_port": metrics_port, "pid": os.getpid() if pid is None else pid,
                          "incarnation": incarnation_id() if incarnation is None else incarnation}
        args = dict(self._reg_args)
        req = pb.RegisterNodeRequest(node=self._ref(), address=address, metrics_port=metrics_port, pid=args["pid"],
                                     incarnation_id=args["incarnation"],
                                     pod_uid=os.environ.get("METAPS_POD_UID", ""))
        r = self._call("RegisterNode", req)
        return Registration(r.incarnation, r.heartbeat_s, r.lease_s, r.batch_size, r.restarted)

    def heartbeat(self, step: int = 0, rss_bytes: float = 0.0, cpu_percent: float = 0.0,
                  metrics: Mapping[str, float] | None = None, child_alive: bool = False,
                  child_restarts: int = 0, shard_id: str = "", next_batch: int = 0,
                  stopped: str = "") -> HeartbeatReply:
        """Renew this node (and a worker's shard leases); get pending commands.

        If the controller does not know this node (a fresh state dir), it registers again.

        Args:
            shard_id, next_batch: a worker's progress in its lease (the DDS tail split).
            stopped: a worker that stopped training early says why (``max_steps``).
        """
        req = pb.HeartbeatRequest(node=self._ref(), step=step, rss_bytes=rss_bytes, cpu_percent=cpu_percent,
                                  metrics=dict(metrics or {}), child_alive=child_alive, child_restarts=child_restarts,
                                  shard_id=shard_id, next_batch=next_batch,
                                  incarnation_id=(self._reg_args or {}).get("incarnation", ""), stopped=stopped)
        r = self._call("Heartbeat", req)
        if not r.known:
            self.register(**(self._reg_args or {}))
            r = self._call("Heartbeat", req)
        cmds = [Command(c.id, c.kind, self.source, c.batch_size, c.cut_id, c.reason, c.shard_id, c.stop_batch)
                for c in r.commands]
        return HeartbeatReply(cmds, r.batch_size, r.known, r.leader)

    def node_down(self, role: str, index: int, reason: str, exit_code: int = 0) -> list[str]:
        """Report that ``role:index``'s process died; returns the shards requeued."""
        r = self._call("NodeDown", pb.NodeDownRequest(node=pb.NodeRef(role=role, index=index), reason=reason,
                                                      exit_code=exit_code))
        return list(r.requeued)

    # ---------------------------------------------------------------- shards

    def get_shard(self, dataset: str) -> GetResult:
        """A lease (status SHARD), WAIT (ask again soon) or DONE.

        A report left by :meth:`defer_report` rides on this request (one RPC, one
        controller transaction for both)."""
        done, self._deferred = self._deferred, None
        if done is not None:
            return self.lease(dataset, done).got
        return self._get_result(self._call("GetShard", pb.GetShardRequest(worker=self.index, dataset=dataset)))

    def defer_report(self, lease: ShardLease, status: str = "done", samples: int = 0, elapsed_s: float = 0.0,
                     error: str = "", stop: int = 0, step_limit: bool = False) -> None:
        """Report ``lease`` with the next :meth:`get_shard` instead of its own RPC.

        Call :meth:`flush_reports` when no further ``get_shard`` follows (the loop stops
        early); a second deferral first sends the pending one on its own.
        """
        if self._deferred is not None:
            self.flush_reports()
        self._deferred = DoneReport(lease, status, samples, elapsed_s, error, stop, step_limit)

    def flush_reports(self) -> ReportResult | None:
        """Send a report still waiting for a ``get_shard`` on its own (ReportShard)."""
        done, self._deferred = self._deferred, None
        if done is None:
            return None
        r = self.report_shard(done.lease, done.status, done.samples, done.elapsed_s, done.error, done.stop,
                              done.step_limit)
        _check_report_result(done, r)
        return r

    def lease(self, dataset: str, done: DoneReport | None = None) -> LeaseReply:
        """Report ``done`` (if given) and lease the next shard of ``dataset`` in one RPC.

        The controller records the report and the lease in one transaction, the report
        durable before the reply; a retry after a lost reply gets the same lease back.
        A controller that predates the combined request answers without a report: the
        report is then sent on its own (nothing is lost).
        """
        r = self._call("GetShard", self._lease_request(dataset, done))
        return self._lease_reply(r, done)

    def lease_async(self, dataset: str, done: DoneReport | None = None) -> "Pending[LeaseReply]":
        """:meth:`lease` without waiting (prefetch the next shard during the current one,
        carrying the report of the shard finished before it)."""
        return self._submit(lambda: self.lease(dataset, done))

    def _lease_request(self, dataset: str, done: DoneReport | None) -> pb.GetShardRequest:
        req = pb.GetShardRequest(worker=self.index, dataset=dataset)
        if done is not None:
            l = done.lease
            req.done.CopyFrom(pb.ReportShardRequest(worker=self.index, shard_id=l.shard_id, attempt=l.attempt,
                                                    status=done.status, samples=done.samples,
                                                    elapsed_s=done.elapsed_s, error=done.error,
                                                    stop_batch=done.stop, step_limit=done.step_limit))
        return req

    def _lease_reply(self, r: Any, done: DoneReport | None) -> LeaseReply:
        got = self._get_result(r)
        if done is None:
            return LeaseReply(got)
        if r.HasField("report"):
            rep = ReportResult(r.report.accepted, r.report.duplicate, r.report.kind, r.report.message)
        else:  # an older controller ignored the piggy-backed report: send it on its own
            log.info("controller ignored a combined report; sending ReportShard",
                     extra={"kv": {"shard": done.lease.shard_id}})
            rep = self.report_shard(done.lease, done.status, done.samples, done.elapsed_s, done.error, done.stop,
                                    done.step_limit)
        _check_report_result(done, rep)
        return LeaseReply(got, rep)

    def report_shard(self, lease: ShardLease, status: str = "done", samples: int = 0, elapsed_s: float = 0.0,
                     error: str = "", stop: int = 0, step_limit: bool = False) -> ReportResult:
        """Report ``lease``; ``stop``: where a lease told to ``truncate`` was stopped, or where the
        worker reached its step limit (``step_limit``); 0: the whole shard."""
        r = self._call("ReportShard", pb.ReportShardRequest(
            worker=self.index, shard_id=lease.shard_id, attempt=lease.attempt, status=status,
            samples=samples, elapsed_s=elapsed_s, error=error, stop_batch=stop, step_limit=step_limit))
        return ReportResult(r.accepted, r.duplicate, r.kind, r.message)

    def get_shard_async(self, dataset: str) -> "Pending[GetResult]":
        """Start a GetShard now, collect it with ``.result()`` (prefetch the next shard
        during the current one's last batch to keep the RPC off the critical path)."""
        return self._submit(lambda: self._get_result(
            self._call("GetShard", pb.GetShardRequest(worker=self.index, dataset=dataset))))

    def report_shard_async(self, lease: ShardLease, status: str = "done", samples: int = 0, elapsed_s: float = 0.0,
                           error: str = "") -> "Pending[ReportResult]":
        """ReportShard without waiting; ``.result()`` before relying on it (retries synchronously)."""
        return self._submit(lambda: self.report_shard(lease, status, samples, elapsed_s, error))

    def _get_result(self, r: Any) -> GetResult:
        status = _STATUS[r.status]
        if status is not GetStatus.SHARD:
            return GetResult(status)
        s = r.shard
        return GetResult(status, ShardLease(s.shard_id, s.dataset, s.epoch, s.file, s.start_batch, s.stop_batch,
                                            s.attempt, r.lease_s))

    def shards(self, dataset: str, poll_s: float = 0.2) -> Iterator[ShardLease]:
        """Leases until the dataset is DONE (sleeps ``poll_s`` on WAIT)."""
        while True:
            got = self.get_shard(dataset)
            if got.status is GetStatus.DONE:
                return
            if got.status is GetStatus.WAIT:
                time.sleep(poll_s)
                continue
            assert got.lease is not None
            yield got.lease

    # ---------------------------------------------------------------- metrics

    def report_metrics(self, batch_times_s: Sequence[float] = (), samples_per_s: float = 0.0,
                       ps_pull_latency_s: Mapping[int, float] | None = None,
                       ps_push_latency_s: Mapping[int, float] | None = None,
                       request_latency_s: float = 0.0, queue_depth: float = 0.0, samples: int = 0,
                       wait: bool = True) -> None:
        """Workers: batch times, samples/s, per-PS latency. PS: request latency, queue depth.

        ``wait=False`` sends without waiting for the reply (keeps metrics off a training
        step's critical path; a lost report only thins one Monitor window).
        """
        req = pb.ReportMetricsRequest(
            node=self._ref(), batch_times_s=list(batch_times_s), samples_per_s=samples_per_s,
            ps_pull_latency_s=dict(ps_pull_latency_s or {}), ps_push_latency_s=dict(ps_push_latency_s or {}),
            request_latency_s=request_latency_s, queue_depth=queue_depth, samples=samples)
        if wait:
            self._call("ReportMetrics", req)
        else:
            self._submit(lambda: self._send_once("ReportMetrics", req))

    # ---------------------------------------------------------------- job

    def status(self, events_since: int = 0, brief: bool = False) -> dict[str, Any]:
        """Progress per dataset, nodes, events, coverage and checkpoint cuts as plain data.

        Args:
            events_since: events with a larger sequence number only.
            brief: only ``datasets``, ``finished`` and ``run`` (a poller's view: the controller skips
                the ledger's coverage scan); the other keys come back empty.
        """
        r = self._call("GetStatus", pb.GetStatusRequest(events_since=events_since, brief=brief))
        return {
            "datasets": [_msg_dict(d) for d in r.datasets],
            "nodes": [_msg_dict(n) for n in r.nodes],
            "events": [{"seq": e.seq, "time": e.time, "node": e.node, "kind": e.kind,
                        "evidence": json.loads(e.evidence_json or "{}"), "action": e.action} for e in r.events],
            "finished": r.finished,
            "run": {"state": r.run_state or "running", "reason": r.run_reason, "leader": r.leader,
                    "final_checkpoint": r.final_checkpoint},
            "coverage": json.loads(r.coverage_json or "{}"),
            "checkpoints": json.loads(r.checkpoints_json or "[]"),
        }

    def checkpoint_done(self, cut_id: int, step: int, directory: str) -> None:
        self._call("CheckpointDone", pb.CheckpointDoneRequest(cut_id=cut_id, step=step, dir=directory))

    def claim_worker(self, name: str) -> int:
        """The worker index the controller gives pod ``name`` (controller/worker_claims.py)."""
        return int(self._call("ClaimWorker", pb.ClaimWorkerRequest(name=name)).index)

    def request_cut(self, reason: str = "") -> int:
        """Ask for a coordinated checkpoint cut now; returns its id (committed once the leader wrote it)."""
        return int(self._call("RequestCut", pb.RequestCutRequest(reason=reason)).cut_id)

    def shutdown(self, reason: str = "") -> None:
        self._call("Shutdown", pb.ShutdownRequest(reason=reason))

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._channel.close()

    # ---------------------------------------------------------------- calls off the caller's thread

    def _submit(self, fn: Callable[[], T]) -> "Pending[T]":
        """Run ``fn`` (blocking RPCs with their retries) on this client's one sender thread.

        Not grpc's ``future()``: with no other call in flight on the channel, each future
        starts a new polling thread, and ``Thread.start`` waits for it to run: measured at
        1-4 ms of the caller's time per call on the loaded 2-core box (E6 profile,
        docs/BENCHMARKS.md), more than the RPC. One long-lived thread runs the calls in
        submission order instead.
        """
        if self._sender is None:
            self._sender = _Sender(f"ctl-{self.role}{self.index}")
        return Pending(self._sender.submit(fn))

    def _send_once(self, method: str, request: Any) -> None:
        """One attempt, errors logged (fire-and-forget metrics: a lost one only thins a window)."""
        try:
            getattr(self._stub, method)(request, timeout=self.rpc_cfg.timeout_s)
        except grpc.RpcError as exc:
            log.debug("fire-and-forget call failed", extra={"kv": {"method": method, "code": exc.code().name}})

    def __enter__(self) -> "ControllerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


T = TypeVar("T")


class _Sender:
    """One daemon thread running submitted calls in order (a daemon, unlike a
    ThreadPoolExecutor's worker, so a call stuck on an unreachable controller never holds
    the process at exit; what is still queued then is dropped, as grpc futures were)."""

    def __init__(self, name: str) -> None:
        self._q: "queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        fut: Future[T] = Future()
        self._q.put((fut, fn))
        return fut

    def close(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to whoever calls result()
                fut.set_exception(exc)


class Pending(Generic[T]):
    """A controller call running on the client's sender thread; ``result()`` waits for it.

    The call retries while the controller is unreachable (``retry_s``), like the
    synchronous one; a refusal raises :class:`ControllerError` from ``result()``.
    """

    def __init__(self, future: "Future[T]") -> None:
        self._future = future

    def result(self) -> T:
        return self._future.result()


def _check_report_result(done: DoneReport, r: ReportResult) -> None:
    """Log a deferred report the controller did not take as ``done`` (the caller is gone by then)."""
    if r.kind not in ("done", "retry", "requeued"):
        log.warning("shard report not recorded as done",
                    extra={"kv": {"shard": done.lease.shard_id, "attempt": done.lease.attempt, "kind": r.kind,
                                  "message": r.message}})


def _msg_dict(msg: Any) -> dict[str, Any]:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
