"""Replies larger than the message limit are split (issue 10, point 6).

A 100k-id pull at dim 128 is ~51 MB of values. Under gRPC's usual 4 MiB limit the
shard refuses (RESOURCE_EXHAUSTED + a rows-per-request hint) *before* reading any
row, and the client re-plans its requests from the dim; the rows come back
correct and the shard never reads a row whose reply it could not send.
"""

from __future__ import annotations

import numpy as np

from common.rpc import RpcConfig
from ps.shard_store import ShardStore

from .conftest import TOKEN, sgd_tables

LIMIT = 4 * 1024 * 1024  # gRPC's default receive limit


def test_100k_id_pull_at_dim_128_under_a_4_mib_limit(ps_fleet) -> None:
    tables = sgd_tables(user_dim=128)
    fleet = ps_fleet(1, tables=tables, rpc=RpcConfig(token=TOKEN, timeout_s=60.0, max_message_bytes=LIMIT))
    client = fleet.client()
    ids = np.arange(100_000, dtype=np.int64)[::-1].copy()  # not sorted: exercises the reorder too
    rows = client.pull({"user": ids})["user"]
    local = ShardStore(tables, shard_id=0, num_vshards=1, seed=0)
    np.testing.assert_array_equal(rows, local.pull("user", ids))
    server = fleet.servers[0]
    # every row read was delivered: no pull was served and then lost to the size limit
    assert server.metrics.registry.get_sample_value("metaps_ps_rows_pulled_total", {"shard": "0", "table": "user"}) == ids.size
    # and the client now plans requests that fit: a second pull is not refused again
    refused = server.metrics.errors.labels("0", "PullMany", "RESOURCE_EXHAUSTED")._value.get()
    again = client.pull({"user": ids[:50_000]})["user"]
    np.testing.assert_array_equal(again, rows[:50_000])
    assert server.metrics.errors.labels("0", "PullMany", "RESOURCE_EXHAUSTED")._value.get() == refused


def test_a_client_with_a_smaller_receive_limit_gets_replies_sized_to_it(ps_fleet) -> None:
    """The shard may send 16 MiB, the client receives 1 MiB: its limit travels in the call's
    metadata, so the shard refuses with a hint sized to the client (before reading a row)
    instead of sending a reply the client's channel would drop."""
    import grpc
    import pytest

    from common.rpc import make_channel
    from protos import ps_pb2, ps_pb2_grpc
    from ps.types import MAX_ROWS_KEY, REPLY_LIMIT_KEY

    tables = sgd_tables(user_dim=64)
    fleet = ps_fleet(1, tables=tables, rpc=RpcConfig(token=TOKEN, timeout_s=60.0, max_message_bytes=16 << 20))
    small = RpcConfig(token=TOKEN, timeout_s=60.0, max_message_bytes=1 << 20)
    ids = np.arange(20_000, dtype=np.int64)  # 5.1 MB of fp32 values: fits the shard's limit, not the client's
    rows = fleet.client(rpc=small).pull({"user": ids})["user"]
    np.testing.assert_array_equal(rows, ShardStore(tables, shard_id=0, num_vshards=1, seed=0).pull("user", ids))
    server = fleet.servers[0]
    assert server.metrics.registry.get_sample_value("metaps_ps_rows_pulled_total", {"shard": "0", "table": "user"}) == ids.size  # no reply was dropped

    stub = ps_pb2_grpc.ParameterServerStub(make_channel(fleet.addresses[0], small))
    req = ps_pb2.PullManyRequest(tables=[ps_pb2.TableIds(table="user", ids=ids.astype("<i8").tobytes())])
    with pytest.raises(grpc.RpcError) as err:
        stub.PullMany(req, timeout=30, metadata=((REPLY_LIMIT_KEY, str(1 << 20)),))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hint = int(dict(err.value.trailing_metadata() or ())[MAX_ROWS_KEY])
    assert 0 < hint * 64 * 4 <= 1 << 20
    with pytest.raises(grpc.RpcError) as err:
        stub.PullMany(req, timeout=30, metadata=((REPLY_LIMIT_KEY, "lots"),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
