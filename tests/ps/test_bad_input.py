"""Every bad request gets the right gRPC status and message, and changes nothing."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from common.rpc import RpcConfig, make_channel
from ps.client import PsClient, PsRequestError
from ps.partition_map import PartitionMap
from ps.types import ERROR_KEY, MAP_VERSION_KEY, WRONG_OWNER
from protos import ps_pb2, ps_pb2_grpc

from .conftest import TOKEN

IDS = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int64)


@pytest.fixture
def one(ps_fleet):
    """One shard (owns every vshard), a raw stub, and the table's rows before the test."""
    fleet = ps_fleet(1, max_request_rows=64)
    client = fleet.client()
    client.push({"user": (IDS, np.ones((IDS.size, 8), np.float32))})
    before = client.pull({"user": IDS})["user"]
    stub = ps_pb2_grpc.ParameterServerStub(make_channel(fleet.addresses[0], fleet.rpc))
    return fleet, client, stub, before


def _push_req(ids: np.ndarray, grads: np.ndarray, *, table: str = "user", dtype: int = ps_pb2.DTYPE_FP32,
              version: int = 0, grads_bytes: bytes | None = None) -> ps_pb2.PushManyRequest:
    return ps_pb2.PushManyRequest(
        tables=[ps_pb2.TableGrads(table=table, ids=ids.astype("<i8").tobytes(),
                                  grads=grads.tobytes() if grads_bytes is None else grads_bytes, dtype=dtype)],
        map_version=version,
    )


def _refused(call, code: grpc.StatusCode, *needles: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, (err.value.code(), err.value.details())
    for n in needles:
        assert n in err.value.details(), (n, err.value.details())
    return err.value


def _unchanged(client: PsClient, before: np.ndarray) -> None:
    np.testing.assert_array_equal(client.pull({"user": IDS})["user"], before)


def test_unknown_table(one) -> None:
    _, client, stub, before = one
    g = np.ones((IDS.size, 8), np.float32)
    _refused(lambda: stub.PushMany(_push_req(IDS, g, table="nope"), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "unknown table 'nope'", "user")
    _refused(lambda: stub.PullMany(ps_pb2.PullManyRequest(tables=[ps_pb2.TableIds(table="nope", ids=b"")]), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "unknown table 'nope'")
    with pytest.raises(PsRequestError, match="unknown table 'nope'"):
        client.pull({"nope": IDS})
    _unchanged(client, before)


def test_multi_table_push_with_one_bad_table_applies_nothing(one) -> None:
    _, client, stub, before = one
    req = _push_req(IDS, np.ones((IDS.size, 8), np.float32))
    req.tables.append(ps_pb2.TableGrads(table="item", ids=IDS.tobytes(), grads=b"\x00" * 3, dtype=ps_pb2.DTYPE_FP32))
    _refused(lambda: stub.PushMany(req, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, "table 'item'", "grads buffer has 3 bytes")
    _unchanged(client, before)


def test_buffer_length_mismatch(one) -> None:
    _, client, stub, before = one
    g = np.ones((IDS.size, 8), np.float32)
    _refused(lambda: stub.PushMany(_push_req(IDS, g, grads_bytes=g.tobytes()[:-4]), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "grads buffer has 252 bytes, expected 256", "8 ids x dim 8")
    bad_ids = ps_pb2.PullManyRequest(tables=[ps_pb2.TableIds(table="user", ids=b"\x01" * 12)])
    _refused(lambda: stub.PullMany(bad_ids, timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
             "ids buffer has 12 bytes, not a multiple of 8")
    _unchanged(client, before)


def test_wrong_dtype(one) -> None:
    _, client, stub, before = one
    g = np.ones((IDS.size, 8), np.float32)
    _refused(lambda: stub.PushMany(_push_req(IDS, g, dtype=ps_pb2.DTYPE_UNSPECIFIED), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "grad dtype must be DTYPE_FP32 or DTYPE_FP16", "DTYPE_UNSPECIFIED")
    # fp32 bytes declared as fp16 are twice too long: refused by size, not misread.
    _refused(lambda: stub.PushMany(_push_req(IDS, g, dtype=ps_pb2.DTYPE_FP16), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "expected 128", "(fp16)")
    _unchanged(client, before)


def test_negative_ids(one) -> None:
    _, client, stub, before = one
    ids = IDS.copy()
    ids[3] = -1
    _refused(lambda: stub.PushMany(_push_req(ids, np.ones((8, 8), np.float32)), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "ids must be >= 0, got -1 at position 3")
    _unchanged(client, before)


def test_nonfinite_rejected_and_counted(one) -> None:
    fleet, client, stub, before = one
    g = np.ones((IDS.size, 8), np.float32)
    g[5, 2] = np.nan
    g[6, 0] = np.inf
    _refused(lambda: stub.PushMany(_push_req(IDS, g), timeout=10), grpc.StatusCode.INVALID_ARGUMENT,
             "2 gradient row(s) contain NaN/Inf", "first: id 6 at position 5")
    with pytest.raises(PsRequestError, match="NaN/Inf"):
        client.push({"user": (IDS, g)})
    _unchanged(client, before)
    reg = fleet.servers[0].metrics.registry
    assert reg.get_sample_value("metaps_ps_nonfinite_grads_total", {"shard": "0", "table": "user", "action": "reject"}) == 4


def test_finite_grads_whose_sum_overflows_are_applied(one) -> None:
    """The server's fast finite check sums the gradients; an overflowing sum of finite values is not NaN/Inf."""
    fleet, client, stub, before = one
    g = np.full((IDS.size, 8), 3e38, np.float32)  # every value finite, their float32 sum is inf
    counts = client.push({"user": (IDS, g)})
    assert counts["user"]["rows"] == IDS.size  # not refused (the store may still drop non-finite updates)
    reg = fleet.servers[0].metrics.registry
    assert not reg.get_sample_value("metaps_ps_nonfinite_grads_total", {"shard": "0", "table": "user", "action": "reject"})


def test_nonfinite_dropped_and_counted(ps_fleet) -> None:
    fleet = ps_fleet(2, nonfinite_grads="drop")
    client = fleet.client()
    before = client.pull({"user": IDS})["user"]
    g = np.ones((IDS.size, 8), np.float32)
    g[[1, 4]] = np.nan
    counts = client.push({"user": (IDS, g)})["user"]
    assert counts["nonfinite_dropped"] == 2 and counts["applied"] == 6
    after = client.pull({"user": IDS})["user"]
    np.testing.assert_array_equal(after[[1, 4]], before[[1, 4]])  # dropped rows untouched
    np.testing.assert_allclose(after[[0, 2, 3, 5, 6, 7]], before[[0, 2, 3, 5, 6, 7]] - 0.5, rtol=1e-6)
    dropped = sum(
        s.metrics.registry.get_sample_value("metaps_ps_nonfinite_grads_total", {"shard": str(s.shard_id), "table": "user", "action": "drop"}) or 0
        for s in fleet.servers
    )
    assert dropped == 2


def test_oversized_request_refused_then_split_by_client(one) -> None:
    fleet, client, stub, before = one  # max_request_rows = 64
    ids = np.arange(1000, 1100, dtype=np.int64)
    err = _refused(lambda: stub.PullMany(ps_pb2.PullManyRequest(tables=[ps_pb2.TableIds(table="user", ids=ids.tobytes())]), timeout=10),
                   grpc.StatusCode.RESOURCE_EXHAUSTED, "request has 100 rows", "max_request_rows is 64")
    assert err is not None
    # The client learns the limit from RESOURCE_EXHAUSTED and splits; results match row-by-row pulls.
    rows = client.pull({"user": ids})["user"]
    assert rows.shape == (100, 8)
    small = PsClient(fleet.addresses, fleet.rpc, max_request_rows=10)
    np.testing.assert_array_equal(small.pull({"user": ids})["user"], rows)
    counts = small.push({"user": (ids, np.ones((100, 8), np.float32))})["user"]
    assert counts["applied"] == 100
    small.close()
    _unchanged(client, before)


def test_stale_map_version_is_wrong_owner(one) -> None:
    fleet, client, stub, before = one
    server = fleet.servers[0]
    server_map = server.pmap
    stub.UpdatePartitionMap(PartitionMap(server_map.version + 1, 1, server_map.owners).to_proto(), timeout=10)
    err = _refused(lambda: stub.PushMany(_push_req(IDS, np.ones((8, 8), np.float32), version=0), timeout=10),
                   grpc.StatusCode.FAILED_PRECONDITION, WRONG_OWNER, "map v0", "has v1")
    md = dict(err.trailing_metadata())
    assert md[ERROR_KEY] == WRONG_OWNER and md[MAP_VERSION_KEY] == "1"
    _unchanged(client, before)  # the client refreshes its map and retries transparently
    assert client.pmap.version == 1


def test_not_owned_vshard_is_wrong_owner(ps_fleet) -> None:
    fleet = ps_fleet(2)
    client = fleet.client()
    stub = client.stub(0)
    ids = np.arange(200, dtype=np.int64)
    foreign = ids[client.pmap.shard_of(ids) == 1][:3]
    err = _refused(lambda: stub.PushMany(_push_req(foreign, np.ones((3, 8), np.float32)), timeout=10),
                   grpc.StatusCode.FAILED_PRECONDITION, WRONG_OWNER, f"id {foreign[0]}", "owned by shard 1")
    assert dict(err.trailing_metadata())[ERROR_KEY] == WRONG_OWNER


def test_map_update_older_version_refused(one) -> None:
    fleet, client, stub, _ = one
    cur = fleet.servers[0].pmap
    stub.UpdatePartitionMap(cur.moved({}).to_proto(), timeout=10)  # v1
    _refused(lambda: stub.UpdatePartitionMap(cur.to_proto(), timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
             "partition map v0 is not newer than shard 0's v1")
    bad = ps_pb2.PartitionMap(version=9, num_vshards=4, num_shards=1, owners=[0, 0, 0, 0])
    _refused(lambda: stub.UpdatePartitionMap(bad, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, "does not match")


def test_drop_of_owned_vshards_refused(one) -> None:
    fleet, client, stub, before = one
    _refused(lambda: stub.DropVshards(ps_pb2.VshardsRequest(vshards=[0, 1]), timeout=10),
             grpc.StatusCode.FAILED_PRECONDITION, "still owns vshards [0, 1]")
    _unchanged(client, before)


@pytest.mark.parametrize("token", ["", "not-the-token"])
def test_missing_or_wrong_token(one, token: str) -> None:
    fleet, client, _, before = one
    ch = make_channel(fleet.addresses[0], RpcConfig(token=token))
    stub = ps_pb2_grpc.ParameterServerStub(ch)
    _refused(lambda: stub.PushMany(_push_req(IDS, np.ones((8, 8), np.float32)), timeout=10),
             grpc.StatusCode.UNAUTHENTICATED, "auth token")
    _refused(lambda: list(stub.ExportVshards(ps_pb2.ExportRequest(vshards=[0]), timeout=10)),
             grpc.StatusCode.UNAUTHENTICATED, "auth token")
    with pytest.raises(PsRequestError, match="GetPartitionMap failed: missing or wrong auth token"):
        PsClient(fleet.addresses, RpcConfig(token=token), retry_timeout_s=2)
    ch.close()
    _unchanged(client, before)
    assert TOKEN != token


def test_client_side_validation() -> None:
    from ps.client import _as_ids

    with pytest.raises(ValueError, match="table 'user': ids must be integers, got dtype float64"):
        _as_ids(np.array([1.5]), "user")
