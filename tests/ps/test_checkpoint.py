"""Checkpoints: save N shards -> load onto M shards, manifest, atomic commit, corruption."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import numpy as np
import torch
import pytest

from common.hashing import vshard_of
from ps.checkpoint import (
    checkpoint_tmp_dir,
    commit_checkpoint,
    latest_checkpoint,
    load_dense,
    load_shard,
    read_manifest,
    read_rows,
    save_shard,
    shard_path,
)
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.errors import CheckpointError
from ps.shard_store import ShardStore

TABLES = [
    TableConfig(name="user", dim=8, capacity=256),
    TableConfig(name="item", dim=4, capacity=256, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM)),
]

# fbgemm's CPU backward spins OpenMP threads: on 2 shared cores more than one
# thread made each push ~100x slower here. PS processes run single-threaded too.
torch.set_num_threads(1)


def owned(shard: int, shards: int, V: int) -> list[int]:
    return [v for v in range(V) if v % shards == shard]


def fleet(shards: int, V: int, tables=TABLES) -> list[ShardStore]:
    return [ShardStore(list(tables), shard_id=k, num_vshards=V, seed=3) for k in range(shards)]


def train(stores: list[ShardStore], V: int) -> None:
    rng = np.random.default_rng(0)
    for _ in range(3):
        for name, dim in (("user", 8), ("item", 4)):
            ids = rng.integers(0, 200, size=60).astype(np.int64)
            g = rng.normal(size=(60, dim)).astype(np.float32)
            home = vshard_of(ids, V) % len(stores)
            for k, s in enumerate(stores):
                sel = home == k
                s.push(name, ids[sel], g[sel])
    stores[0].dense.register("mlp.w", np.ones((2, 3), np.float32))
    stores[0].dense.push({"mlp.w": np.full((2, 3), 0.5, np.float32)})


def merged(stores: list[ShardStore], table: str) -> dict[int, tuple]:
    out = {}
    for s in stores:
        r = s.all_rows(table)
        for i in range(len(r)):
            out[int(r.ids[i])] = (r.weights[i].tobytes(), {k: v[i].tobytes() for k, v in r.state.items()},
                                  int(r.freq[i]), int(r.last_step[i]))
    return out


def save_all(stores: list[ShardStore], root: Path, step: int) -> Path:
    tmp = checkpoint_tmp_dir(root, step)
    for k, s in enumerate(stores):
        save_shard(s, tmp, k)
    return commit_checkpoint(tmp, {"step": step, "dds": {"epoch": 1}})


@pytest.mark.parametrize("new_shards,new_V", [(3, 16), (1, 8)])
def test_save_two_shards_restore_onto_other_layout(tmp_path: Path, new_shards: int, new_V: int) -> None:
    old = fleet(2, 16)
    train(old, 16)
    final = save_all(old, tmp_path, 5)
    assert final.name == "ckpt-5" and latest_checkpoint(tmp_path) == final
    man = read_manifest(final)
    assert man["shards"] == 2 and man["num_vshards"] == 16 and man["step"] == 5
    assert man["tables"]["user"]["dim"] == 8 and man["tables"]["item"]["optimizer"] == "adam"
    assert man["tables"]["user"]["rows"] == sum(len(s.all_rows("user")) for s in old)
    assert man["info"]["dds"] == {"epoch": 1}
    assert set(man["files"]) == {"shard-0.lmdb", "shard-1.lmdb"}

    new = fleet(new_shards, new_V)
    for k, s in enumerate(new):
        load_shard(s, final, owned(k, new_shards, new_V))
    load_dense(new[0], final)
    for table in ("user", "item"):
        assert merged(new, table) == merged(old, table)
        for k, s in enumerate(new):  # every row landed on its owner
            r = s.all_rows(table)
            assert np.isin(vshard_of(r.ids, new_V) % new_shards, [k]).all()
    np.testing.assert_array_equal(new[0].dense.pull(["mlp.w"])["mlp.w"], old[0].dense.pull(["mlp.w"])["mlp.w"])
    # training continues identically on the restored layout
    ids = np.arange(0, 200, 7, dtype=np.int64)
    g = np.ones((ids.size, 4), np.float32)
    ref = fleet(1, 16)
    load_shard(ref[0], final, range(16))
    ref[0].push("item", ids, g)
    for k, s in enumerate(new):
        sel = vshard_of(ids, new_V) % new_shards == k
        s.push("item", ids[sel], g[sel])
    for k, s in enumerate(new):
        sel = vshard_of(ids, new_V) % new_shards == k
        np.testing.assert_array_equal(s.pull("item", ids[sel]), ref[0].pull("item", ids[sel]))


def test_read_rows_yields_every_row(tmp_path: Path) -> None:
    old = fleet(2, 16)
    train(old, 16)
    final = save_all(old, tmp_path, 1)
    got = {}
    for rows in read_rows(final, "user"):
        for i, id_ in enumerate(rows.ids.tolist()):
            got[id_] = rows.weights[i].tobytes()
    assert got == {k: v[0] for k, v in merged(old, "user").items()}
    with pytest.raises(CheckpointError, match="no table 'nope'"):
        list(read_rows(final, "nope"))


def test_tmp_dir_left_behind_is_ignored(tmp_path: Path) -> None:
    stores = fleet(1, 8)
    train(stores, 8)
    good = save_all(stores, tmp_path, 10)
    crashed = checkpoint_tmp_dir(tmp_path, 20)  # a crash mid-write: shard file, no manifest
    save_shard(stores[0], crashed, 0)
    (tmp_path / "ckpt-30").mkdir()  # a dir without a manifest
    (tmp_path / "ckpt-40").mkdir()
    (tmp_path / "ckpt-40" / "manifest.json").write_text("{not json")
    assert latest_checkpoint(tmp_path) == good
    assert latest_checkpoint(tmp_path / "missing") is None
    fresh = fleet(1, 8)
    load_shard(fresh[0], latest_checkpoint(tmp_path), range(8))
    assert merged(fresh, "user") == merged(stores, "user")


def test_corruption_is_detected_and_named(tmp_path: Path) -> None:
    stores = fleet(2, 8)
    train(stores, 8)
    final = save_all(stores, tmp_path, 2)
    path = shard_path(final, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = fleet(1, 8)
    with pytest.raises(CheckpointError, match=r"shard-1.lmdb: sha256 mismatch"):
        load_shard(fresh[0], final, range(8))
    assert len(fresh[0].all_rows("user")) == 0
    with pytest.raises(CheckpointError, match=r"no manifest"):
        load_shard(fresh[0], tmp_path / "nowhere", range(8))


def test_corrupt_chunk_names_file_and_key(tmp_path: Path) -> None:
    stores = fleet(1, 4)
    train(stores, 4)
    tmp = checkpoint_tmp_dir(tmp_path, 3)
    save_shard(stores[0], tmp, 0)
    env = lmdb.open(str(shard_path(tmp, 0)), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        key = next(k for k, _ in txn.cursor() if bytes(k).startswith(b"t/user/"))
        txn.put(key, b"garbage-bytes-here")
    env.close()
    final = commit_checkpoint(tmp, {})  # manifest hashes the corrupt file: only the chunk check can see it
    with pytest.raises(CheckpointError, match=rf"shard-0.lmdb key '{bytes(key).decode()}': bad chunk magic"):
        load_shard(fleet(1, 4)[0], final, range(4))


def test_mismatched_config_is_refused(tmp_path: Path) -> None:
    stores = fleet(1, 4)
    train(stores, 4)
    final = save_all(stores, tmp_path, 4)
    wrong_dim = [TableConfig(name="user", dim=16, capacity=64), TABLES[1]]
    with pytest.raises(CheckpointError, match=r"table 'user' is dim 8 / rowwise_adagrad in the checkpoint, configured dim 16"):
        load_shard(fleet(1, 4, wrong_dim)[0], final, range(4))
    with pytest.raises(CheckpointError, match=r"checkpoint table 'item' is not configured"):
        load_shard(fleet(1, 4, [TABLES[0]])[0], final, range(4))
    with pytest.raises(CheckpointError, match="already exists"):
        tmp = checkpoint_tmp_dir(tmp_path, 4)
        save_shard(stores[0], tmp, 0)
        commit_checkpoint(tmp, {})
    with pytest.raises(CheckpointError, match="info step 9 does not match dir step 4"):
        commit_checkpoint(tmp, {"step": 9})
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["files"]["shard-0.lmdb"]["bytes"] == shard_path(final, 0).stat().st_size


def test_pack_unpack_keeps_dtype_shape_and_scalars() -> None:
    from ps.checkpoint import pack_arrays, unpack_arrays

    arrays = {"scalar": np.array(3.5, np.float32), "ids": np.arange(5, dtype=np.int64),
              "w": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2], "empty": np.empty((0, 4), np.float32)}
    back = unpack_arrays(pack_arrays(arrays), "mem")
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)
    with pytest.raises(CheckpointError, match="mem: chunk truncated"):
        unpack_arrays(b"MP", "mem")
    with pytest.raises(CheckpointError, match="runs past the chunk end"):
        unpack_arrays(pack_arrays(arrays)[:-8], "mem")


def test_checkpoint_step_reads_committed_names_only(tmp_path: Path) -> None:
    from ps.checkpoint import checkpoint_step
    from ps.errors import CheckpointError

    assert checkpoint_step(tmp_path / "ckpt-63") == 63
    for bad in ("ckpt-63.tmp", "ckpt-", "ckpt-x", "other-3"):
        with pytest.raises(CheckpointError, match="expected ckpt-<step>"):
            checkpoint_step(tmp_path / bad)
