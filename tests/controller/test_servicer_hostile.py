"""Controller RPCs against hostile input: a clear status naming the field, never UNKNOWN."""

from __future__ import annotations

import grpc
import pytest

from metaps.rpc import make_channel
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
