"""A restore is all or nothing (issue 10 point 1).

Real in-process shard servers on 127.0.0.1 and real committed checkpoints. A
corrupt checkpoint (a flipped byte in a shard file, a manifest checksum that
does not match, a chunk whose rows have the wrong dim, a dense chunk missing)
makes the restore raise a one-line CheckpointError naming file/key, and the
shard keeps exactly what it had: rows with optimizer state, dense params and
partition map (full exports compared before/after). A good checkpoint still
restores, adopting the checkpoint's map.
"""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path
from typing import Any, Callable

import grpc
import lmdb
import numpy as np
import pytest
import torch

from ps.checkpoint import _sha256, pack_arrays, shard_path, unpack_arrays
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.coordinator import checkpoint_all, restore_shard_checkpoint
from ps.errors import CheckpointError
from ps.partition_map import PartitionMap
from ps.servicer import PsServer
from protos import ps_pb2

from .conftest import Fleet

torch.set_num_threads(1)

OPT = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
TABLES = [TableConfig(name="user", dim=8, capacity=1024, optimizer=OPT),
          TableConfig(name="item", dim=4, capacity=1024, optimizer=OPT)]
V = 32


def export(server: PsServer) -> dict[str, Any]:
    """Everything a restore may change, as comparable bytes."""
    out: dict[str, Any] = {"map": server.pmap.to_dict(), "version": server.store.version}
    for name in server.store.tables:
        r = server.store.all_rows(name)
        order = np.argsort(r.ids)
        out[name] = (r.ids[order].tobytes(), r.weights[order].tobytes(),
                     {k: v[order].tobytes() for k, v in sorted(r.state.items())},
                     r.freq[order].tobytes(), r.last_step[order].tobytes())
    out["dense"] = {k: {a: b.tobytes() for a, b in sorted(e.items())}
                    for k, e in sorted(server.store.dense.state().items())}
    return out


def _push(fleet: Fleet, seed: int) -> None:
    c = fleet.client()
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1 << 40, 200)
    c.push({"user": (ids, rng.standard_normal((200, 8)).astype(np.float32)),
            "item": (ids[:60], rng.standard_normal((60, 4)).astype(np.float32))})
    c.push_dense({"mlp.w": np.full((2, 3), 0.25 * (seed + 1), np.float32)})


@pytest.fixture
def setup(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> tuple[Fleet, Path]:
    """Two shards; a checkpoint taken under map version 3; the live shards then moved on
    (more pushes, map back at version 0, a dense param registered after the cut)."""
    fleet = ps_fleet(2, tables=TABLES, num_vshards=V)
    c = fleet.client()
    c.register_dense({"mlp.w": np.arange(6, dtype=np.float32).reshape(2, 3), "mlp.b": np.ones(3, np.float32)})
    _push(fleet, 0)
    v3 = PartitionMap(3, 2, PartitionMap.initial(2, V).owners)
    for s in fleet.servers:
        s.adopt_map(v3)
    final = checkpoint_all(fleet.addresses, tmp_path / "ckpt", 5, rpc_cfg=fleet.rpc)
    for s in fleet.servers:
        s.adopt_map(PartitionMap.initial(2, V))
    _push(fleet, 1)
    c.register_dense({"late.w": np.full(4, 7.0, np.float32)})
    return fleet, final


def _copy(final: Path, tmp: Path, name: str) -> Path:
    d = tmp / name / final.name
    shutil.copytree(final, d)
    return d


def _rehash(ckpt: Path, rel: str) -> None:
    """Make the manifest agree with a file rewritten on purpose (only the content check can see it)."""
    mpath = ckpt / "manifest.json"
    man = json.loads(mpath.read_text())
    p = ckpt / rel
    man["files"][rel] = {"sha256": _sha256(p), "bytes": p.stat().st_size}
    mpath.write_text(json.dumps(man))


def _flip_byte(ckpt: Path) -> str:
    p = shard_path(ckpt, 0)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    return r"shard-0.lmdb: sha256 mismatch"


def _manifest_checksum(ckpt: Path) -> str:
    mpath = ckpt / "manifest.json"
    man = json.loads(mpath.read_text())
    man["files"]["shard-1.lmdb"]["sha256"] = "0" * 64
    mpath.write_text(json.dumps(man))
    return r"shard-1.lmdb: sha256 mismatch \(manifest 0000"


def _chunk_wrong_dim(ckpt: Path) -> str:
    """The *last* user chunk shard 0 reads gets rows of dim 4 (table dim 8): earlier chunks import fine."""
    p = shard_path(ckpt, 0)
    env = lmdb.open(str(p), subdir=False, lock=False)
    owned = PartitionMap.initial(2, V).vshards_of(0).tolist()
    with env.begin(write=True) as txn:
        key = next(f"t/user/{v}" for v in reversed(owned) if txn.get(f"t/user/{v}".encode()) is not None)
        arrays = unpack_arrays(txn.get(key.encode()), key)
        arrays["weights"] = np.ascontiguousarray(arrays["weights"][:, :4])
        txn.put(key.encode(), pack_arrays(arrays))
    env.close()
    _rehash(ckpt, "shard-0.lmdb")
    return rf"shard-0.lmdb key '{key}': table 'user': rows.weights must be float32 \(\d+, 8\), got float32 \(\d+, 4\)"


def _dense_missing(ckpt: Path) -> str:
    mpath = ckpt / "manifest.json"
    man = json.loads(mpath.read_text())
    # a dense name the shard owns under 2 shards, with no chunk in any file
    from ps.partition_map import dense_owner

    ghost = next(f"ghost.{i}" for i in range(100) if dense_owner(f"ghost.{i}", 2) == 0)
    man["info"]["dense_names"] = [*man["info"]["dense_names"], ghost]
    mpath.write_text(json.dumps(man))  # (the manifest is not in its own file list)
    return rf"dense param\(s\) \['{ghost}'\] listed in manifest key 'info.dense_names'"


@pytest.mark.parametrize("corrupt", [_flip_byte, _manifest_checksum, _chunk_wrong_dim, _dense_missing],
                         ids=["flipped-byte", "manifest-checksum", "chunk-wrong-dim", "dense-missing"])
def test_a_corrupt_checkpoint_leaves_the_shard_exactly_as_it_was(setup: tuple[Fleet, Path], tmp_path: Path,
                                                                 corrupt: Callable[[Path], str]) -> None:
    fleet, final = setup
    bad = _copy(final, tmp_path, corrupt.__name__)
    pattern = corrupt(bad)
    server = fleet.servers[0]
    before = export(server)
    assert len(before["user"][0]) > 0 and before["map"]["version"] == 0
    with pytest.raises(CheckpointError, match=pattern) as err:
        restore_shard_checkpoint(server, bad)
    assert "\n" not in str(err.value)
    after = export(server)
    assert after == before
    # and through the Restore RPC: DATA_LOSS with the same one-line reason, still nothing changed
    with pytest.raises(grpc.RpcError) as rpc_err:
        fleet.client().stub(0).Restore(ps_pb2.RestoreRequest(dir=str(bad)), timeout=30)
    assert rpc_err.value.code() == grpc.StatusCode.DATA_LOSS, rpc_err.value
    assert export(server) == before
    # the shard still serves: a pull routed with its (unchanged) map works
    assert fleet.client().pull({"user": np.array([1, 2], np.int64)})["user"].shape == (2, 8)


def test_a_good_checkpoint_restores_rows_dense_and_map(setup: tuple[Fleet, Path], ps_fleet: Callable[..., Fleet]) -> None:
    fleet, final = setup
    # what the checkpoint holds, read back by restoring onto a fresh fleet of the same shape
    ref = ps_fleet(2, tables=TABLES, num_vshards=V)
    for k in range(2):
        restore_shard_checkpoint(ref.servers[k], final)
    for k, server in enumerate(fleet.servers):
        before = export(server)
        rows, step = restore_shard_checkpoint(server, final)
        got, want = export(server), export(ref.servers[k])
        assert step == 5 and rows > 0 and got != before
        assert got["map"]["version"] == 3  # the checkpoint's map is adopted
        for t in ("user", "item"):
            assert got[t] == want[t]
        ckpt_dense = {n: e for n, e in got["dense"].items() if n != "late.w"}
        assert ckpt_dense == want["dense"]
        # a dense param registered after the cut survives the restore (workers still pull it)
        assert ("late.w" in got["dense"]) == ("late.w" in before["dense"])
    assert fleet.client().pull_dense(["mlp.w", "late.w"])["late.w"].tolist() == [7.0] * 4


def test_a_pristine_shard_restores_in_place(setup: tuple[Fleet, Path], ps_fleet: Callable[..., Fleet]) -> None:
    """A shard that never stored anything (just started, or restarted awaiting recovery) is filled
    in place: no second store aside (at 50M rows that would be 2 x 15 GB), and the same rows,
    dense params and map as the build-aside restore of a shard that held data."""
    fleet, final = setup
    fresh = ps_fleet(2, tables=TABLES, num_vshards=V)
    for k in range(2):
        store = fresh.servers[k].store
        assert store.pristine() and not fleet.servers[k].store.pristine()
        restore_shard_checkpoint(fresh.servers[k], final)
        assert fresh.servers[k].store is store  # filled in place
        assert not store.pristine()
        restore_shard_checkpoint(fleet.servers[k], final)  # holds data: built aside, swapped
        got, want = export(fresh.servers[k]), export(fleet.servers[k])
        assert got["map"] == want["map"]  # (versions continue each store's own: not compared)
        for t in ("user", "item"):
            assert got[t] == want[t] and len(got[t][0]) > 0
        assert got["dense"] == {n: e for n, e in want["dense"].items() if n != "late.w"}


@pytest.mark.parametrize("corrupt", [_chunk_wrong_dim, _dense_missing], ids=["chunk-wrong-dim", "dense-missing"])
def test_a_failed_in_place_restore_leaves_the_shard_empty(setup: tuple[Fleet, Path], ps_fleet: Callable[..., Fleet],
                                                          tmp_path: Path, corrupt: Callable[[Path], str]) -> None:
    """Both corruptions fail after rows were imported (a late chunk; the dense check after every
    row): the pristine shard is cleared back to empty, as it was, still serves, and a good
    checkpoint then restores into it."""
    _, final = setup
    fresh = ps_fleet(2, tables=TABLES, num_vshards=V)
    server = fresh.servers[0]
    before = export(server)
    old_tables = [weakref.ref(t) for t in server.store.tables.values()]
    bad = _copy(final, tmp_path, corrupt.__name__)
    pattern = corrupt(bad)
    with pytest.raises(CheckpointError, match=pattern):
        restore_shard_checkpoint(server, bad)
    assert export(server) == before
    assert server.store.pristine()
    assert all(r() is None for r in old_tables)  # the half-filled tables are gone, their memory freed
    assert fresh.client().pull({"user": np.array([1, 2], np.int64)})["user"].shape == (2, 8)
    rows, step = restore_shard_checkpoint(server, final)
    assert rows > 0 and step == 5 and len(export(server)["user"][0]) > 0
