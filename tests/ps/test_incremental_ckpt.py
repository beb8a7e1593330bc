"""Incremental (delta) checkpoints (issue 15 point 4).

Real ShardStores, real LMDB files, real commits. A delta holds the rows
changed since its parent's cut (``row_version`` above it) and the ids evicted
since then; restore replays base + deltas and must equal a full checkpoint
taken at the same moment, onto the same or another shard / vshard count.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from common.hashing import vshard_of
from ps.checkpoint import (
    DeltaUnavailable,
    begin_checkpoint,
    checkpoint_chain,
    commit_checkpoint,
    load_dense,
    load_shard,
    pack_arrays,
    prune_checkpoints,
    read_changes,
    read_manifest,
    read_rows,
    save_shard,
    shard_path,
    unpack_arrays,
    verify_for_restore,
)
from ps.config import EvictionConfig, OptimizerConfig, OptimizerKind, TableConfig
from ps.errors import CheckpointError
from ps.shard_store import ShardStore

torch.set_num_threads(1)

V = 16
TABLES = [
    TableConfig(name="user", dim=8, capacity=160, eviction=EvictionConfig(policy="lfu", evict_fraction=0.05)),
    TableConfig(name="item", dim=4, capacity=160, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM),
                eviction=EvictionConfig(policy="lfu", evict_fraction=0.05)),
]
DIMS = {"user": 8, "item": 4}


def fleet(shards: int, nv: int = V) -> list[ShardStore]:
    return [ShardStore(list(TABLES), shard_id=k, num_vshards=nv, seed=3) for k in range(shards)]


def owned(shard: int, shards: int, nv: int = V) -> list[int]:
    return [v for v in range(nv) if v % shards == shard]


def train(stores: list[ShardStore], seed: int, id_range: tuple[int, int] = (0, 200), n: int = 80) -> None:
    """Pushes routed by vshard; ids beyond capacity make the tables evict."""
    rng = np.random.default_rng(seed)
    for name, dim in DIMS.items():
        ids = rng.integers(*id_range, size=n).astype(np.int64)
        g = rng.normal(size=(n, dim)).astype(np.float32)
        home = vshard_of(ids, V) % len(stores)
        for k, s in enumerate(stores):
            sel = home == k
            s.push(name, ids[sel], g[sel])
    w = stores[0].dense
    if "mlp.w" not in w.names():
        w.register("mlp.w", np.ones((2, 3), np.float32))
    w.push({"mlp.w": rng.normal(size=(2, 3)).astype(np.float32)})


def checkpoint(stores: list[ShardStore], root: Path, step: int, full_every: int) -> Path:
    tmp, _plan = begin_checkpoint(root, step, full_every)
    for k, s in enumerate(stores):
        save_shard(s, tmp, k)
    return commit_checkpoint(tmp, {"step": step, "dense_names": ["mlp.w"]})


def state(stores: list[ShardStore]) -> dict:
    """Every table's rows by id (weights, optimizer state, freq, last_step as bytes), steps, dense."""
    out: dict = {}
    for name in DIMS:
        parts = [s.all_rows(name) for s in stores]
        ids = np.concatenate([p.ids for p in parts])
        order = np.argsort(ids)
        cat = lambda f: np.concatenate([f(p) for p in parts])[order].tobytes()  # noqa: E731
        out[name] = {
            "ids": ids[order].tobytes(),
            "weights": cat(lambda p: p.weights),
            "state": {k: cat(lambda p, k=k: p.state[k]) for k in sorted(parts[0].state)},
            "freq": cat(lambda p: p.freq),
            "last_step": cat(lambda p: p.last_step),
            "step": max(s.tables[name].step for s in stores),
        }
    out["dense"] = {k: {a: np.asarray(b).tobytes() for a, b in sorted(e.items())}
                    for s in stores for k, e in sorted(s.dense.state().items())}
    return out


def restore(ckpt: Path, shards: int, nv: int = V) -> list[ShardStore]:
    stores = fleet(shards, nv)
    for k, s in enumerate(stores):
        load_shard(s, ckpt, owned(k, shards, nv))
    load_dense(stores[0], ckpt, ["mlp.w"])
    assert all(t.counters["evictions"] == 0 for s in stores for t in s.tables.values())  # all fit
    return stores


def rewrite_chunk(path: Path, key: str, change) -> None:
    """Replace one chunk by a *valid* chunk with changed values (so only the checksum can tell)."""
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        a = unpack_arrays(txn.get(key.encode()), key)
        change(a)
        txn.put(key.encode(), pack_arrays(a))
    env.close()


def first_chunk_key(path: Path, table: str) -> str:
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        cur = txn.cursor()
        cur.set_range(f"t/{table}/".encode())
        key = bytes(cur.key()).decode()
    env.close()
    return key


# -- dirty tracking -----------------------------------------------------------------------------
def test_delta_holds_exactly_the_rows_pushed_inserted_and_evicted_since_the_parent(tmp_path: Path) -> None:
    [s] = fleet(1)
    s.push("user", np.arange(100), np.ones((100, 8), np.float32))
    base = checkpoint([s], tmp_path, 1, full_every=4)
    assert read_manifest(base)["kind"] == "full"
    s.push("user", np.array([3, 7, 7]), np.ones((3, 8), np.float32))      # known rows
    s.push("user", np.arange(1000, 1040), np.ones((40, 8), np.float32))  # new rows (60 free)
    assert s.dirty_count("user", s.cut_version(read_manifest(base)["ckpt_id"])) == 42
    d = checkpoint([s], tmp_path, 2, full_every=4)
    rows, removed = read_changes(d, "user")
    assert sorted(rows.ids.tolist()) == [3, 7, *range(1000, 1040)]
    assert removed.size == 0
    assert len(read_changes(d, "item")[0]) == 0
    # beyond capacity: evictions are listed as removed in the next delta, the new rows as changed
    s.push("user", np.arange(2000, 2050), np.ones((50, 8), np.float32))
    evicted = np.setdiff1d(np.concatenate([np.arange(100), np.arange(1000, 1040)]), s.all_rows("user").ids)
    assert evicted.size > 0
    d3 = checkpoint([s], tmp_path, 3, full_every=4)
    rows, removed = read_changes(d3, "user")
    assert set(rows.ids.tolist()) == set(range(2000, 2050))
    assert removed.tolist() == sorted(evicted.tolist())
    assert [p.name for p, _ in checkpoint_chain(d3)] == ["ckpt-1", "ckpt-2", "ckpt-3"]


def test_migrated_rows_arrive_dirty_and_are_not_removals(tmp_path: Path) -> None:
    a, b = fleet(2)
    train([a, b], seed=1)
    checkpoint([a, b], tmp_path, 1, full_every=4)
    moved = [v for v in owned(0, 2)][:3]
    rows = a.export_vshards(moved)
    for name, r in rows.items():
        b.import_rows(name, r)
    a.drop_vshards(moved)
    d = checkpoint([a, b], tmp_path, 2, full_every=4)
    for name in DIMS:
        changed, removed = read_changes(d, name)
        assert sorted(changed.ids.tolist()) == sorted(rows[name].ids.tolist())
        assert removed.size == 0  # a migration drop is not a removal
    assert state(restore(d, 2)) == state([a, b])


def test_aborted_cut_keeps_its_rows_dirty(tmp_path: Path) -> None:
    [s] = fleet(1)
    s.push("user", np.arange(50), np.ones((50, 8), np.float32))
    checkpoint([s], tmp_path, 1, full_every=4)
    s.push("user", np.arange(10), np.ones((10, 8), np.float32))
    tmp, plan = begin_checkpoint(tmp_path, 2, 4)
    assert plan.kind == "delta"
    save_shard(s, tmp, 0)          # the cut happened ...
    shutil.rmtree(tmp)             # ... but was never committed (coordinator failed)
    s.push("user", np.arange(40, 45), np.ones((5, 8), np.float32))
    d = checkpoint([s], tmp_path, 3, full_every=4)
    assert read_manifest(d)["parent"] == "ckpt-1"
    changed, _ = read_changes(d, "user")
    assert sorted(changed.ids.tolist()) == [*range(10), *range(40, 45)]
    assert state(restore(d, 1)) == state([s])


def test_a_store_without_the_parents_cut_refuses_the_delta(tmp_path: Path) -> None:
    [s] = fleet(1)
    s.push("user", np.arange(50), np.ones((50, 8), np.float32))
    base = checkpoint([s], tmp_path, 1, full_every=4)
    [other] = fleet(1)  # e.g. a restarted shard that did not restore
    tmp, plan = begin_checkpoint(tmp_path, 2, 4)
    with pytest.raises(DeltaUnavailable, match="delta unavailable: shard 0 has no cut of parent ckpt-1"):
        save_shard(other, tmp, 0)
    assert not shard_path(tmp, 0).exists()
    # a restored store knows the checkpoint it loaded: its delta holds only what changed after
    [r] = restore(base, 1)
    r.push("user", np.array([5]), np.ones((1, 8), np.float32))
    save_shard(r, tmp, 0)
    d = commit_checkpoint(tmp, {"step": 2})
    assert read_changes(d, "user")[0].ids.tolist() == [5]


# -- restore: base + deltas == full ----------------------------------------------------------------
@pytest.mark.parametrize("new_shards,new_v", [(2, V), (3, V), (3, 8)])  # (fewer shards would overflow 160 rows)
def test_base_plus_deltas_restore_equals_full_restore(tmp_path: Path, new_shards: int, new_v: int) -> None:
    stores = fleet(2)
    train(stores, seed=1)
    checkpoint(stores, tmp_path / "chain", 1, full_every=8)
    for step in (2, 3, 4):
        train(stores, seed=step, id_range=(0, 600), n=300)  # 600 ids > 2 x 160 rows: evictions too
        tip = checkpoint(stores, tmp_path / "chain", step, full_every=8)
    assert read_manifest(tip)["kind"] == "delta" and len(checkpoint_chain(tip)) == 4
    assert sum(s.tables["user"].counters["evictions"] for s in stores) > 0
    full = checkpoint(stores, tmp_path / "full", 4, full_every=1)  # same moment, full
    assert read_manifest(full)["kind"] == "full"
    want = state(stores)
    got_chain = state(restore(tip, new_shards, new_v))
    got_full = state(restore(full, new_shards, new_v))
    assert got_chain == got_full
    if new_v == V:
        assert got_chain == want
    # delivery-side reader resolves the chain the same way
    for name in DIMS:
        [r] = list(read_rows(tip, name, verify=True))
        o = np.argsort(r.ids)
        assert r.ids[o].tobytes() == want[name]["ids"] and r.weights[o].tobytes() == want[name]["weights"]


@pytest.mark.parametrize("member", [0, 1])  # the base, a middle delta
def test_a_corrupt_member_refuses_the_whole_restore(tmp_path: Path, member: int) -> None:
    stores = fleet(2)
    train(stores, seed=1)
    checkpoint(stores, tmp_path, 1, full_every=8)
    train(stores, seed=2)
    checkpoint(stores, tmp_path, 2, full_every=8)
    train(stores, seed=3)
    tip = checkpoint(stores, tmp_path, 3, full_every=8)
    bad = checkpoint_chain(tip)[member][0]
    f = shard_path(bad, 0)
    key = first_chunk_key(f, "user")

    def plus_one(a: dict) -> None:
        a["weights"] += 1.0
    rewrite_chunk(f, key, plus_one)  # a valid chunk: only the checksum can tell
    with pytest.raises(CheckpointError, match=f"{bad.name}/shard-0.lmdb: (sha256 mismatch|size)"):
        verify_for_restore(tip)
    target = fleet(1)[0]
    before = state([target])
    with pytest.raises(CheckpointError, match=f"{bad.name}/shard-0.lmdb"):
        load_shard(target, tip, range(V))
    assert state([target]) == before  # verified before the first import


def test_a_missing_or_replaced_base_is_named(tmp_path: Path) -> None:
    stores = fleet(1)
    train(stores, seed=1)
    checkpoint(stores, tmp_path, 1, full_every=8)
    train(stores, seed=2)
    tip = checkpoint(stores, tmp_path, 2, full_every=8)
    shutil.rmtree(tmp_path / "ckpt-1")
    with pytest.raises(CheckpointError, match="chain member ckpt-1 is not a committed checkpoint"):
        verify_for_restore(tip)


# -- retention --------------------------------------------------------------------------------------
def test_retention_keeps_every_base_a_kept_delta_needs(tmp_path: Path) -> None:
    stores = fleet(1)
    kinds = []
    for step in range(1, 6):  # full_every=3: full, delta, delta, full, delta
        train(stores, seed=step)
        kinds.append(read_manifest(checkpoint(stores, tmp_path, step, full_every=3))["kind"])
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    assert prune_checkpoints(tmp_path, keep=3) == []  # ckpt-3 is kept, so are its base 1 and delta 2
    want = state(restore(tmp_path / "ckpt-3", 1))
    deleted = prune_checkpoints(tmp_path, keep=1)  # ckpt-5 needs ckpt-4 only
    assert sorted(p.name for p in deleted) == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-4", "ckpt-5"]
    assert state(restore(tmp_path / "ckpt-5", 1)) == state(stores)
    assert want != state(stores)


def test_the_in_process_row_source_takes_deltas_when_asked(tmp_path: Path) -> None:
    from workers.row_source import LocalRowSource

    [s] = fleet(1)
    src = LocalRowSource(s)
    train([s], seed=1)
    c1 = src.checkpoint(tmp_path, 1, {"step": 1}, full_every=2)
    train([s], seed=2)
    c2 = src.checkpoint(tmp_path, 2, {"step": 2}, full_every=2)
    c3 = src.checkpoint(tmp_path, 3, {"step": 3}, full_every=2)
    assert [read_manifest(c)["kind"] for c in (c1, c2, c3)] == ["full", "delta", "full"]
    assert state(restore(c2, 1)) == state([s])
