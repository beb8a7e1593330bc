"""ps.digest: what a shard serves after a restore has the digest of its part of the cut on disk, and
only then (a dropped row, a changed value or optimizer state, a row the cut lacks: a different digest)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from common.hashing import vshard_of
from ps.checkpoint import checkpoint_tmp_dir, commit_checkpoint, save_shard
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.coordinator import restore_shard_checkpoint
from ps.digest import checkpoint_digests, rows_digest, served_digest
from ps.partition_map import PartitionMap
from ps.shard_store import ShardStore

torch.set_num_threads(1)
V = 8
TABLES = [
    TableConfig(name="item", dim=4, capacity=256, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM)),
    TableConfig(name="user", dim=8, capacity=256),
    TableConfig(name="unused", dim=4, capacity=64, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM)),
]


def _fleet() -> list[ShardStore]:
    stores = [ShardStore(list(TABLES), shard_id=k, num_vshards=V, seed=3) for k in range(2)]
    rng = np.random.default_rng(0)
    for _ in range(3):
        for name, dim in (("user", 8), ("item", 4)):
            ids = rng.integers(0, 200, size=60).astype(np.int64)
            g = rng.normal(size=(60, dim)).astype(np.float32)
            home = vshard_of(ids, V) % 2
            for k, s in enumerate(stores):
                s.push(name, ids[home == k], g[home == k])
    return stores


def _cut(stores: list[ShardStore], root: Path) -> Path:
    tmp = checkpoint_tmp_dir(root, 5)
    for k, s in enumerate(stores):
        save_shard(s, tmp, k)
    return commit_checkpoint(tmp, {"step": 5, "partition_map": PartitionMap.initial(2, V).to_dict()})


def _host(k: int) -> SimpleNamespace:
    host = SimpleNamespace(store=ShardStore(list(TABLES), shard_id=k, num_vshards=V, seed=9), shard_id=k,
                           pmap=PartitionMap.initial(2, V))
    host.adopt_map = lambda m: setattr(host, "pmap", m)
    return host


def test_restored_shards_serve_the_cut_on_disk_and_only_it(tmp_path: Path) -> None:
    stores = _fleet()
    ck = _cut(stores, tmp_path)
    want = checkpoint_digests(ck, 2)
    assert [served_digest(s) for s in stores] == [want[0], want[1]]
    assert want[0]["item"]["rows"] > 0 and want[1]["unused"] == {"rows": 0, "sha256": want[0]["unused"]["sha256"]}

    hosts = [_host(0), _host(1)]
    for h in hosts:  # the real restore (in place on a pristine store), then a second one built aside and swapped
        restore_shard_checkpoint(h, ck)
        assert served_digest(h.store) == want[h.shard_id]
        h.store.push("user", np.array([1000 + h.shard_id * 1000], np.int64), np.ones((1, 8), np.float32))
        assert served_digest(h.store) != want[h.shard_id]  # a row the cut lacks
        restore_shard_checkpoint(h, ck)
        assert served_digest(h.store) == want[h.shard_id]

    s = hosts[0].store
    ids = s.all_rows("item").ids
    s.remove_ids("item", ids[:1])  # one row dropped
    got = served_digest(s)
    assert got["item"]["rows"] == want[0]["item"]["rows"] - 1 and got["item"]["sha256"] != want[0]["item"]["sha256"]
    assert got["user"] == want[0]["user"]

    restore_shard_checkpoint(hosts[0], ck)
    rows = hosts[0].store.all_rows("item")
    base = rows_digest(rows)
    assert base == want[0]["item"]
    for field in ("weights", "m", "step"):  # one value of one row, or one row's optimizer state
        r = hosts[0].store.all_rows("item")
        arr = r.weights if field == "weights" else r.state[field]
        arr.reshape(len(r), -1)[len(r) // 2, 0] += 1
        assert rows_digest(r) != base, field
    shuffled = rows.take(np.random.default_rng(1).permutation(len(rows)))
    assert rows_digest(shuffled) == base  # order-free
