"""Controller RPCs against hostile input: a clear status naming the field, never UNKNOWN."""

from __future__ import annotations

import grpc
import pytest

from common.rpc import make_channel
from protos import controller_pb2 as pb
from protos import controller_pb2_grpc

from .conftest import RPC


@pytest.mark.parametrize("req,code,needle", [
    (pb.CheckpointDoneRequest(cut_id=-1, step=1, dir="/x"), grpc.StatusCode.INVALID_ARGUMENT, "cut_id must be >= 0"),
    (pb.CheckpointDoneRequest(cut_id=-(2**63), step=1, dir="/x"), grpc.StatusCode.INVALID_ARGUMENT, "cut_id"),
    (pb.CheckpointDoneRequest(cut_id=0, step=-1, dir="/x"), grpc.StatusCode.INVALID_ARGUMENT, "step must be >= 0"),
    (pb.CheckpointDoneRequest(cut_id=0, step=1, dir=""), grpc.StatusCode.INVALID_ARGUMENT, "dir"),
    (pb.CheckpointDoneRequest(cut_id=2**40, step=1, dir="/x"), grpc.StatusCode.NOT_FOUND, "never opened"),
])
def test_checkpoint_done_with_bad_fields_is_refused(controller, req, code, needle) -> None:
    srv = controller()
    stub = controller_pb2_grpc.ControllerStub(make_channel(srv.address, RPC))
    with pytest.raises(grpc.RpcError) as err:
        stub.CheckpointDone(req, timeout=10)
    assert err.value.code() == code, (err.value.code(), err.value.details())
    assert needle in err.value.details()


@pytest.mark.parametrize("fields,needle", [
    ({"batch_times_s": [0.01, float("nan")]}, "batch_times_s[1]"),
    ({"batch_times_s": [-1.0]}, "batch_times_s[0]"),
    ({"samples_per_s": float("inf")}, "samples_per_s"),
    ({"ps_pull_latency_s": {0: float("nan")}}, "ps_pull_latency_s[0]"),
])
def test_report_metrics_with_non_finite_or_negative_timings_is_refused(controller, fields, needle) -> None:
    srv = controller()
    stub = controller_pb2_grpc.ControllerStub(make_channel(srv.address, RPC))
    node = pb.NodeRef(role="worker", index=0)
    stub.RegisterNode(pb.RegisterNodeRequest(node=node, incarnation_id="t-1"), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportMetrics(pb.ReportMetricsRequest(node=node, **fields), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
    assert needle in err.value.details()
    stub.ReportMetrics(pb.ReportMetricsRequest(node=node, batch_times_s=[0.01, 0.02], samples_per_s=100.0), timeout=10)


def _worker_stub(srv):  # a registered worker 0 and a raw stub (no client-side retries)
    stub = controller_pb2_grpc.ControllerStub(make_channel(srv.address, RPC))
    node = pb.NodeRef(role="worker", index=0)
    stub.RegisterNode(pb.RegisterNodeRequest(node=node, incarnation_id="t-1"), timeout=10)
    return stub, node


@pytest.mark.parametrize("fields,needle", [
    ({"rss_bytes": float("nan")}, "Heartbeat: rss_bytes must be a finite number >= 0, got nan"),
    ({"cpu_percent": float("inf")}, "Heartbeat: cpu_percent must be a finite number >= 0, got inf"),
    ({"rss_bytes": -1.0}, "Heartbeat: rss_bytes must be a finite number >= 0, got -1.0"),
    ({"metrics": {"loss": float("nan")}}, "Heartbeat: metrics['loss'] must be a finite number, got nan"),
])
def test_heartbeat_with_non_finite_figures_is_refused_and_records_nothing(controller, fields, needle) -> None:
    srv = controller()
    stub, node = _worker_stub(srv)
    def step() -> int:
        (info,) = [n for n in srv.status()["nodes"] if n["role"] == "worker"]
        return int(info["step"])

    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(pb.HeartbeatRequest(node=node, incarnation_id="t-1", step=7, **fields), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
    assert needle in err.value.details()
    assert step() == 0  # the refused beat left no trace
    stub.Heartbeat(pb.HeartbeatRequest(node=node, incarnation_id="t-1", step=7, rss_bytes=5e6, metrics={"loss": -0.5}),
                   timeout=10)
    assert step() == 7  # a sound one is recorded (negative metrics allowed: they are free-form)


@pytest.mark.parametrize("via", ["ReportShard", "GetShard"])
@pytest.mark.parametrize("samples,elapsed_s,needle", [
    (10, float("inf"), "elapsed_s must be a finite number >= 0, got inf"),
    (10, float("nan"), "elapsed_s must be a finite number >= 0, got nan"),
    (-5, 1.0, "samples must be a finite number >= 0, got -5.0"),
])
def test_shard_report_with_bad_figures_is_refused_and_the_shard_stays_leased(controller, via, samples, elapsed_s,
                                                                             needle) -> None:
    srv = controller()
    stub, _ = _worker_stub(srv)
    got = stub.GetShard(pb.GetShardRequest(worker=0, dataset="train"), timeout=10)
    shard = got.shard
    def states() -> list[tuple[int, int]]:
        return [(d["shards_done"], d["shards_doing"]) for d in srv.status()["datasets"]]

    before = states()
    assert any(doing == 1 for _, doing in before), before
    bad = dict(worker=0, shard_id=shard.shard_id, attempt=shard.attempt, status="done", samples=samples,
               elapsed_s=elapsed_s)
    with pytest.raises(grpc.RpcError) as err:
        if via == "ReportShard":
            stub.ReportShard(pb.ReportShardRequest(**bad), timeout=10)
        else:
            stub.GetShard(pb.GetShardRequest(worker=0, dataset="train", done=pb.ReportShardRequest(**bad)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
    assert needle in err.value.details()
    assert states() == before  # nothing reached the ledger: the shard is still leased, none done
    ok = stub.ReportShard(pb.ReportShardRequest(**{**bad, "samples": 10, "elapsed_s": 1.0}), timeout=10)
    assert ok.accepted and ok.kind == "done", ok
