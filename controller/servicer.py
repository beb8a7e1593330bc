"""gRPC servicer for ``protos/controller.proto``: translation only.

Requests become calls on the parts of a :class:`ServedController` (the structural type of
:class:`controller.server.ControllerServer`, so this module does not import the server and the
server imports it: no import circle);
errors that name bad input (unknown worker, dataset or shard; malformed shard
id; wrong role) become clear gRPC statuses:

    DdsError / BadNode            -> INVALID_ARGUMENT
    UnknownDataset / UnknownShard / UnknownNode / UnknownCut -> NOT_FOUND
    StateMismatch                 -> FAILED_PRECONDITION
"""

from __future__ import annotations

import json
import logging
import math
import threading
from typing import Any, Callable, Protocol

import grpc
from prometheus_client import Counter

from controller.checkpoint import FINAL_CUT, CheckpointCoordinator, RunNotFinished
from controller.config import ControllerConfig
from controller.dds import DynamicDataSharding
from controller.liveness import WorkerLiveness
from controller.monitor import Monitor
from controller.node_registry import NodeInfo, NodeRegistry
from controller.run_outcome import RunOutcome
from controller.types import GetStatus, UnknownNode, check_node
from controller.worker_claims import WorkerClaims
from common import exit_codes
from common.errors import MetapsError
from protos import controller_pb2 as pb
from protos import controller_pb2_grpc

log = logging.getLogger(__name__)

SHARDS_LEASED = Counter("metaps_controller_shards_leased_total", "Shards handed to workers", ["dataset"])
SHARD_REPORTS = Counter("metaps_controller_shard_reports_total", "Shard reports by outcome", ["kind"])

_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
}
_GET = {GetStatus.SHARD: pb.GetShardResponse.SHARD, GetStatus.WAIT: pb.GetShardResponse.WAIT,
        GetStatus.DONE: pb.GetShardResponse.DONE}


class RunFailedRefusal(MetapsError):
    """A process registers (or a pod claims a worker index) in a run the controller failed."""

    code = "failed_precondition"


class RunEndedRefusal(MetapsError):
    """A pod claims a worker index in a run that is complete: nothing is left for it to train."""

    code = "failed_precondition"


class ServedController(Protocol):
    """What the servicer calls: the parts and entry points of ``controller.server.ControllerServer``."""

    @property
    def cfg(self) -> ControllerConfig: ...
    @property
    def checkpoint_root(self) -> str | None: ...
    @property
    def checkpoints(self) -> CheckpointCoordinator: ...
    @property
    def dds(self) -> DynamicDataSharding: ...
    @property
    def liveness(self) -> WorkerLiveness | None: ...
    @property
    def monitor(self) -> Monitor: ...
    @property
    def registry(self) -> NodeRegistry: ...
    @property
    def worker_claims(self) -> WorkerClaims: ...
    @property
    def shutdown_requested(self) -> threading.Event: ...

    def register_node(self, role: str, index: int, address: str = "", metrics_port: int = 0, pid: int = 0,
                      source: str = "process", incarnation_id: str = "", pod_uid: str = "") -> tuple[NodeInfo, bool]: ...

    def node_down(self, role: str, index: int, reason: str, exit_code: int = 0) -> list[str]: ...

    def status(self, events_since: int = 0, brief: bool = False) -> dict[str, Any]: ...
    def recovery_pending(self) -> bool: ...
    def run_finished(self) -> bool: ...
    def trigger_checkpoint(self, reason: str = "interval") -> int: ...
    @property
    def outcome(self) -> RunOutcome: ...


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map metaps errors to gRPC statuses naming the problem."""

    def wrapper(self: "ControllerServicer", request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except MetapsError as exc:
            code = _CODES.get(getattr(exc, "code", ""), grpc.StatusCode.INVALID_ARGUMENT)
            log.warning("request refused: %s", exc)
            context.abort(code, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    wrapper.__name__ = fn.__name__
    return wrapper


def _check_figures(method: str, values: list[tuple[str, float]], *, signed: tuple[str, ...] = ()) -> None:
    """Refuse figures a report cannot carry (NaN, inf; negative unless named in ``signed``), naming
    the field: one would poison a median window, a progress figure or the run report.

    Raises:
        ValueError: the first bad figure (the RPC answers INVALID_ARGUMENT, nothing recorded).
    """
    for name, v in values:
        if not math.isfinite(v) or (v < 0 and name not in signed):
            kind = "a finite number" if name in signed else "a finite number >= 0"
            raise ValueError(f"{method}: {name} must be {kind}, got {v}")


def _check_metrics(request: pb.ReportMetricsRequest) -> None:
    """Refuse timings the Monitor cannot use (NaN, inf, negative): one would poison a median window."""
    values: list[tuple[str, float]] = [(f"batch_times_s[{i}]", float(v)) for i, v in enumerate(request.batch_times_s)]
    values += [("samples_per_s", request.samples_per_s), ("request_latency_s", request.request_latency_s),
               ("queue_depth", request.queue_depth), ("samples", float(request.samples))]
    values += [(f"ps_pull_latency_s[{k}]", v) for k, v in request.ps_pull_latency_s.items()]
    values += [(f"ps_push_latency_s[{k}]", v) for k, v in request.ps_push_latency_s.items()]
    _check_figures("ReportMetrics", values)


def _check_heartbeat(request: pb.HeartbeatRequest) -> None:
    """A heartbeat's figures: memory and CPU finite and >= 0, the free-form metrics finite."""
    metrics = [(f"metrics[{k!r}]", float(v)) for k, v in request.metrics.items()]
    _check_figures("Heartbeat", [("rss_bytes", request.rss_bytes), ("cpu_percent", request.cpu_percent)] + metrics,
                   signed=tuple(name for name, _ in metrics))


def _check_report(method: str, samples: int, elapsed_s: float) -> None:
    """A shard report's figures (the ledger keeps them): samples and seconds finite and >= 0."""
    _check_figures(method, [("samples", float(samples)), ("elapsed_s", elapsed_s)])


def _node(ref: pb.NodeRef) -> tuple[str, int, str]:
    source = ref.source or "process"
    check_node(ref.role, ref.index, source)
    return ref.role, ref.index, source


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    """One instance per server; thread-safe because every part it calls is."""

    def __init__(self, server: ServedController) -> None:
        self.s = server

    def _require_worker(self, worker: int) -> None:
        if not self.s.registry.known("worker", worker):
            raise UnknownNode(f"worker {worker} is not registered; call RegisterNode(role='worker', index={worker}) first")

    def _refuse_if_failed(self, method: str, who: str) -> None:
        """A process joining a failed run is told so at once (FAILED_PRECONDITION ``run_failed: <why>``:
        the client exits :data:`~common.exit_codes.RUN_FAILED`), instead of registering into a run
        nothing will end for it (a re-applied failed day's late pods crash-looped until backoffLimit)."""
        from controller.run_outcome import RunState

        state, why = self.s.outcome.state()
        if state is RunState.FAILED:
            raise RunFailedRefusal(f"{exit_codes.STOP_RUN_FAILED}: {why} ({method} of {who} refused: this run failed; "
                                   f"relaunch under a new run name)")

    @_guard
    def RegisterNode(self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext) -> pb.RegisterNodeResponse:
        role, index, source = _node(request.node)
        if source == "process":
            self._refuse_if_failed("RegisterNode", f"{role} {index}")
        info, restarted = self.s.register_node(role, index, request.address, request.metrics_port, request.pid,
                                               source, request.incarnation_id, request.pod_uid)
        self.s.monitor.heartbeat(info.name)
        return pb.RegisterNodeResponse(incarnation=info.incarnation, heartbeat_s=self.s.cfg.agent.heartbeat_s,
                                       lease_s=self.s.cfg.dds.lease_s, batch_size=info.batch_size,
                                       restarted=restarted)

    @_guard
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        role, index, source = _node(request.node)
        _check_heartbeat(request)
        got = self.s.registry.heartbeat(role, index, source, request.step, request.rss_bytes, request.cpu_percent,
                                        dict(request.metrics), request.child_restarts if source == "agent" else -1,
                                        request.incarnation_id, request.stopped)
        if got is None:
            return pb.HeartbeatResponse(known=False)
        info, cmds = got
        if source == "process" and request.incarnation_id and info.incarnation_id \
                and request.incarnation_id != info.incarnation_id:
            return pb.HeartbeatResponse(known=True, commands=[pb.Command(id=c.id, kind=c.kind, reason=c.reason)
                                                              for c in cmds])  # fenced: nothing renewed
        self.s.monitor.heartbeat(info.name)
        if role == "worker" and source == "process":
            self.s.dds.renew(index)
            if request.shard_id:
                self.s.dds.note_progress(index, request.shard_id, int(request.next_batch))
            if self.s.liveness is not None:
                self.s.liveness.step(index, request.step)
        leader = role == "worker" and source == "process" and self.s.outcome.leader() == index
        return pb.HeartbeatResponse(
            known=True, batch_size=info.batch_size, leader=leader,
            commands=[pb.Command(id=c.id, kind=c.kind, batch_size=c.batch_size, cut_id=c.cut_id, reason=c.reason,
                                shard_id=c.shard_id, stop_batch=c.stop_batch)
                      for c in cmds])

    @_guard
    def GetShard(self, request: pb.GetShardRequest, context: grpc.ServicerContext) -> pb.GetShardResponse:
        self._require_worker(request.worker)
        report = None
        if request.HasField("done"):  # report + lease in one transaction (dds.report_and_get)
            d = request.done
            _check_report("GetShard: done", d.samples, d.elapsed_s)
            if d.worker != request.worker:
                raise ValueError(f"GetShard: done.worker must be the requesting worker {request.worker}, "
                                 f"got {d.worker} (shard {d.shard_id})")
            if self.s.liveness is not None:
                self.s.liveness.reported(request.worker, d.shard_id)
            r, got = self.s.dds.report_and_get(request.worker, request.dataset, d.shard_id, d.attempt, d.status,
                                               d.samples, d.elapsed_s, d.error, int(d.stop_batch),
                                               step_limit=d.step_limit)
            SHARD_REPORTS.labels(r.kind).inc()
            report = pb.ReportShardResponse(accepted=r.accepted, duplicate=r.duplicate, kind=r.kind,
                                            message=r.message)
        else:
            got = self.s.dds.get_shard(request.worker, request.dataset)
        status = got.status
        if status is GetStatus.DONE and self.s.recovery_pending():
            # a pending PS recovery's rollback will requeue shards: keep the workers asking
            status = GetStatus.WAIT
        resp = pb.GetShardResponse(status=_GET[status], report=report)
        if got.lease is not None and self.s.liveness is not None:
            self.s.liveness.granted(request.worker, got.lease.shard_id)
        if got.lease is not None:
            l = got.lease
            SHARDS_LEASED.labels(l.dataset).inc()
            resp.lease_s = l.lease_s
            resp.shard.CopyFrom(pb.Shard(shard_id=l.shard_id, dataset=l.dataset, epoch=l.epoch, file=l.file,
                                         start_batch=l.start, stop_batch=l.stop, attempt=l.attempt))
        return resp

    @_guard
    def ReportShard(self, request: pb.ReportShardRequest, context: grpc.ServicerContext) -> pb.ReportShardResponse:
        self._require_worker(request.worker)
        _check_report("ReportShard", request.samples, request.elapsed_s)
        if self.s.liveness is not None:  # done with it, whatever the DDS makes of the report
            self.s.liveness.reported(request.worker, request.shard_id)
        r = self.s.dds.report(request.worker, request.shard_id, request.attempt, request.status,
                              request.samples, request.elapsed_s, request.error, int(request.stop_batch),
                              step_limit=request.step_limit)
        SHARD_REPORTS.labels(r.kind).inc()
        return pb.ReportShardResponse(accepted=r.accepted, duplicate=r.duplicate, kind=r.kind, message=r.message)

    @_guard
    def ReportMetrics(self, request: pb.ReportMetricsRequest, context: grpc.ServicerContext) -> pb.ReportMetricsResponse:
        role, index, _ = _node(request.node)
        if not self.s.registry.known(role, index):
            raise UnknownNode(f"{role}:{index} is not registered; call RegisterNode first")
        _check_metrics(request)
        if role == "worker":
            self.s.monitor.record_worker(index, list(request.batch_times_s), request.samples_per_s,
                                         dict(request.ps_pull_latency_s), dict(request.ps_push_latency_s))
            if request.batch_times_s and self.s.liveness is not None:
                self.s.liveness.progress(index)
        else:
            self.s.monitor.record_ps(index, request.request_latency_s, request.queue_depth)
        return pb.ReportMetricsResponse()

    @_guard
    def NodeDown(self, request: pb.NodeDownRequest, context: grpc.ServicerContext) -> pb.NodeDownResponse:
        role, index, _ = _node(request.node)
        if not self.s.registry.known(role, index):
            raise UnknownNode(f"{role}:{index} is not registered; nothing to requeue")
        return pb.NodeDownResponse(requeued=self.s.node_down(role, index, request.reason, request.exit_code))

    @_guard
    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        if request.brief:
            st = self.s.status(brief=True)
            return pb.GetStatusResponse(
                datasets=[pb.DatasetProgress(**d) for d in st["datasets"]], finished=st["finished"],
                run_state=st["run"]["state"], run_reason=st["run"]["reason"], leader=st["run"]["leader"],
                final_checkpoint=st["run"]["final_checkpoint"])
        st = self.s.status(events_since=request.events_since)
        return pb.GetStatusResponse(
            datasets=[pb.DatasetProgress(**d) for d in st["datasets"]],
            nodes=[pb.NodeStatus(**n) for n in st["nodes"]],
            events=[pb.Event(seq=e["seq"], time=e["time"], node=e["node"], kind=e["kind"],
                             evidence_json=json.dumps(e["evidence"], sort_keys=True, default=str),
                             action=e["action"]) for e in st["events"]],
            finished=st["finished"], run_state=st["run"]["state"], run_reason=st["run"]["reason"],
            leader=st["run"]["leader"], final_checkpoint=st["run"]["final_checkpoint"],
            coverage_json=json.dumps(st["coverage"], sort_keys=True),
            checkpoints_json=json.dumps(st["checkpoints"], sort_keys=True),
        )

    @_guard
    def CheckpointDone(self, request: pb.CheckpointDoneRequest, context: grpc.ServicerContext) -> pb.CheckpointDoneResponse:
        if request.cut_id < 0:
            raise ValueError(f"CheckpointDone: cut_id must be >= 0, got {request.cut_id}")
        if request.step < 0:
            raise ValueError(f"CheckpointDone: step must be >= 0, got {request.step}")
        if not request.dir:
            raise ValueError("CheckpointDone: dir must name the checkpoint directory, got ''")
        root = self.s.checkpoint_root
        if root is not None:  # a committed cut's dir is what a PS recovery restores from: keep it confined
            from common.paths import PathNotAllowed, confine

            try:
                confine(request.dir, root)
            except PathNotAllowed as exc:
                log.warning("CheckpointDone refused: %s", exc)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"CheckpointDone: {exc}")
        if request.cut_id == FINAL_CUT:  # the run's final checkpoint: a cut of the finished DDS
            if not self.s.run_finished():
                raise RunNotFinished(f"CheckpointDone: final checkpoint {request.dir} reported while the run is "
                                     f"not finished (a dataset is still trained, or a PS recovery is pending)")
            self.s.checkpoints.commit_final(request.step, request.dir)
        else:
            self.s.checkpoints.commit(request.cut_id, request.step, request.dir)
        return pb.CheckpointDoneResponse()

    @_guard
    def ClaimWorker(self, request: pb.ClaimWorkerRequest, context: grpc.ServicerContext) -> pb.ClaimWorkerResponse:
        from controller.run_outcome import RunState

        self._refuse_if_failed("ClaimWorker", f"pod {request.name!r}")
        # A pod the worker Job starts as the run ends (it replaced a failed worker just then) is told the
        # run is complete, so it exits 0 and the Job completes, instead of claiming an index and waiting
        # for a controller and PS fleet that are stopping (FAILED_PRECONDITION ``run_ended: ...``).
        if self.s.outcome.state()[0] is RunState.COMPLETE:
            raise RunEndedRefusal(f"{exit_codes.STOP_RUN_ENDED}: this run is complete (ClaimWorker of pod "
                                  f"{request.name!r} refused: nothing is left to train)")
        return pb.ClaimWorkerResponse(index=self.s.worker_claims.claim(request.name))

    @_guard
    def RequestCut(self, request: pb.RequestCutRequest, context: grpc.ServicerContext) -> pb.RequestCutResponse:
        cut_id = self.s.trigger_checkpoint(reason=request.reason or "requested")
        return pb.RequestCutResponse(cut_id=cut_id)

    @_guard
    def Shutdown(self, request: pb.ShutdownRequest, context: grpc.ServicerContext) -> pb.ShutdownResponse:
        log.info("shutdown requested: %s", request.reason or "-")
        self.s.shutdown_requested.set()
        return pb.ShutdownResponse()
