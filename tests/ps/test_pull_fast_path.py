"""The pull path's fast paths (issue 15 point 1, pull7) answer exactly what the general paths do.

* the shard's ownership check skips hashing when it owns every vshard and none is frozen:
  a frozen vshard, or a map that gives some vshards away, still refuses;
* ``routing.split_by_owner`` sends everything to the one owner without hashing when one
  shard owns every vshard;
* ``IdMap.lookup(checked=True)`` (the store's pull, after ``check_ids``) finds the same rows;
* the shard's cached labelled metric children count per table and method as before.

Real in-process shards on 127.0.0.1 (``ps_fleet``), real frames over gRPC.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from common.hashing import vshard_of
from protos import ps_pb2
from ps import frame, routing
from ps.id_map import IdMap
from ps.partition_map import PartitionMap
from ps.types import ERROR_KEY, WRONG_OWNER


def _pull_frame(client, ids: np.ndarray, map_version: int, table: str = "user") -> np.ndarray:
    """One raw PullFrame call to shard 0 (no client retries: a refusal surfaces as RpcError)."""
    req = frame.encode_pull_request([(table, ids, None)], map_version=map_version, fp16=False, worker_id="", step=None)
    t = client._pull_frame[0](req, timeout=10).tables[0]
    return np.frombuffer(bytes(t.values), dtype=np.float32).reshape(t.rows, t.dim)


def test_owner_fast_path_still_refuses_frozen_and_given_away_vshards(ps_fleet) -> None:
    fleet = ps_fleet(2, num_vshards=8)
    server, c = fleet.servers[0], fleet.client()
    ids = np.arange(1, 200, dtype=np.int64)
    server.adopt_map(PartitionMap(1, 2, np.zeros(8, dtype=np.int32)))  # shard 0 owns every vshard
    before = _pull_frame(c, ids, 1)  # nothing frozen: served (unknown ids read as their initial value)
    assert before.shape == (ids.size, 8)

    # freeze the vshard of ids[5]: the fast path must not apply, the pull is refused naming it
    v = int(vshard_of(ids[5:6], 8)[0])
    c.stub(0).FreezeVshards(ps_pb2.FreezeRequest(vshards=[v], frozen=True, lease_s=60), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        _pull_frame(c, ids, 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"id {int(ids[5])} (vshard {v}) is being migrated" in err.value.details()
    assert dict(err.value.trailing_metadata())[ERROR_KEY] == WRONG_OWNER
    c.stub(0).FreezeVshards(ps_pb2.FreezeRequest(vshards=[v], frozen=False), timeout=10)
    np.testing.assert_array_equal(_pull_frame(c, ids, 1), before)  # thawed: served again

    # a map that gives vshard v to shard 1: shard 0 no longer owns all
    owners = np.zeros(8, dtype=np.int32)
    owners[v] = 1
    server.adopt_map(PartitionMap(2, 2, owners))
    with pytest.raises(grpc.RpcError) as err:
        _pull_frame(c, ids, 2)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"(vshard {v}) is owned by shard 1" in err.value.details()
    mine = vshard_of(ids, 8) != v
    np.testing.assert_array_equal(_pull_frame(c, ids[mine], 2), before[mine])
    server.adopt_map(PartitionMap(3, 2, np.zeros(8, dtype=np.int32)))  # all back: the fast path again
    np.testing.assert_array_equal(_pull_frame(c, ids, 3), before)


def test_split_by_owner_single_owner_equals_the_hashed_split() -> None:
    ids = np.random.default_rng(0).choice(1 << 40, 5000, replace=False).astype(np.int64)
    pos = np.random.default_rng(1).permutation(ids.size)[:3000]
    for pmap in (PartitionMap.initial(1, 16), PartitionMap(3, 4, np.full(16, 2, dtype=np.int32))):
        got = routing.split_by_owner(ids, pos, pmap)
        owner = int(pmap.owners[0])
        assert list(got) == [owner]
        np.testing.assert_array_equal(got[owner], pos)  # every position, order kept
        assert got[owner] is not pos and not np.shares_memory(got[owner], pos)  # as the general path: a new array
        assert (pmap.shard_of(ids[got[owner]]) == owner).all()
    # a map with two owners still splits by hash
    owners = np.full(16, 2, dtype=np.int32)
    owners[3] = 0
    got = routing.split_by_owner(ids, pos, PartitionMap(4, 4, owners))
    assert sorted(got) == [0, 2]
    for s, part in got.items():
        assert (PartitionMap(4, 4, owners).shard_of(ids[part]) == s).all()


def test_checked_lookup_finds_the_same_rows_and_unchecked_still_refuses_minus_one() -> None:
    m = IdMap(1024)
    ids = np.arange(10, 110, dtype=np.int64)
    m.insert(ids, np.arange(100, dtype=np.int64))
    probe = np.concatenate([ids[::3], np.array([5, 999, 7], dtype=np.int64)])
    assert torch.equal(m.lookup(probe, checked=True), m.lookup(probe))
    assert m.lookup(probe, checked=True).tolist()[-3:] == [-1, -1, -1]
    with pytest.raises(ValueError, match="id -1 is reserved"):
        m.lookup(np.array([3, -1], dtype=np.int64))


def test_pull_metrics_count_per_table_and_method_with_cached_children(ps_fleet) -> None:
    fleet = ps_fleet(1)
    c = fleet.client()
    reg = fleet.servers[0].metrics.registry
    c.pull({"user": np.arange(1, 11, dtype=np.int64)})
    c.pull({"user": np.arange(1, 6, dtype=np.int64), "item": np.arange(1, 4, dtype=np.int64)})
    c.pull({"item": np.arange(1, 8, dtype=np.int64)})

    def val(name: str, **labels: str) -> float:
        got = reg.get_sample_value(name, {"shard": "0", **labels})
        return 0.0 if got is None else got

    assert val("metaps_ps_rows_pulled_total", table="user") == 15
    assert val("metaps_ps_rows_pulled_total", table="item") == 10
    assert val("metaps_ps_table_requests_total", table="user", method="PullMany") == 2
    assert val("metaps_ps_table_requests_total", table="item", method="PullMany") == 2
    assert val("metaps_ps_table_rpc_seconds_count", table="item", method="PullMany") == 2
    assert val("metaps_ps_rpc_seconds_count", method="PullMany") == 3
