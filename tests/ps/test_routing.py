"""Ids spread over several shards behave exactly like one shard."""

from __future__ import annotations

import numpy as np

from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.partition_map import PartitionMap


def _tables() -> list[TableConfig]:
    # Rowwise Adagrad: non-linear, so any misrouted or doubled update shows.
    opt = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
    return [TableConfig(name="user", dim=8, capacity=4096, optimizer=opt),
            TableConfig(name="item", dim=4, capacity=4096, optimizer=opt)]


def test_partition_map_routing_is_vectorized_and_versioned() -> None:
    pmap = PartitionMap.initial(3, 12)
    assert pmap.owners.tolist() == [0, 1, 2] * 4
    ids = np.arange(10_000, dtype=np.int64)
    shards = pmap.shard_of(ids)
    assert set(np.unique(shards).tolist()) == {0, 1, 2}
    moved = pmap.moved({0: 2})
    assert moved.version == 1 and moved.owners[0] == 2 and pmap.owners[0] == 0
    assert PartitionMap.from_proto(moved.to_proto()).same_assignment(moved)
    assert PartitionMap.from_dict(moved.to_dict()).version == 1


def test_three_shards_equal_one_shard(ps_fleet) -> None:
    one = ps_fleet(1, tables=_tables()).client()
    three = ps_fleet(3, tables=_tables()).client()
    rng = np.random.default_rng(0)
    users = rng.integers(0, 1 << 40, 600)
    items = rng.integers(0, 50, 300)  # many duplicates
    assert len(np.unique(three.pmap.shard_of(users))) == 3

    a, b = one.pull({"user": users, "item": items}), three.pull({"user": users, "item": items})
    for t in ("user", "item"):
        np.testing.assert_array_equal(a[t], b[t])

    for step in range(4):
        idx_u = rng.integers(0, users.size, 400)
        idx_i = rng.integers(0, items.size, 200)
        grads = {
            "user": (users[idx_u], rng.standard_normal((400, 8)).astype(np.float32)),
            "item": (items[idx_i], rng.standard_normal((200, 4)).astype(np.float32)),
        }
        ca, cb = one.push(grads), three.push(grads)
        assert ca == cb
        a, b = one.pull({"user": users, "item": items}), three.pull({"user": users, "item": items})
        for t in ("user", "item"):
            np.testing.assert_allclose(a[t], b[t], rtol=0, atol=1e-6)
    assert not np.allclose(a["user"], one.pull({"user": users + 1})["user"])  # rows really changed


def test_every_shard_gets_a_request_only_for_its_ids(ps_fleet) -> None:
    fleet = ps_fleet(3, tables=_tables())
    client = fleet.client()
    ids = np.arange(3000, dtype=np.int64)
    client.pull({"user": ids})
    per_shard = [s.metrics.registry.get_sample_value("metaps_ps_rows_pulled_total", {"shard": str(s.shard_id), "table": "user"})
                 for s in fleet.servers]
    expected = np.bincount(client.pmap.shard_of(ids), minlength=3)
    assert per_shard == expected.tolist()
