"""Controller RPCs against hostile input: a clear status naming the field, never UNKNOWN."""

from __future__ import annotations

import grpc
import pytest

from metaps.core.rpc import make_channel
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
