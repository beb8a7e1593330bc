"""Row chunks of delta checkpoint files: runs of vshards, and the per-vshard layout of before.

A delta shard file stores its changed rows in a few chunks of consecutive vshards
(meta ``row_chunks = "runs"``; one chunk per table for a small delta) instead of one
chunk per vshard, so a reader decodes a handful of chunks. Delta files written before
(one chunk per vshard, no ``row_chunks``) must still restore, N->M too, and read the same.
Real ShardStores, real LMDB files, real commits.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest

import ps.checkpoint as ckpt
from common.hashing import vshard_of
from ps.checkpoint import MANIFEST, pack_arrays, read_changes, read_manifest, shard_files, unpack_arrays
from ps.errors import CheckpointError
from tests.ps.test_incremental_ckpt import DIMS, V, checkpoint, fleet, restore, state, train


def chunk_keys(path: Path, table: str) -> list[str]:
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            prefix = f"t/{table}/".encode()
            return [bytes(k).decode() for k, _v in txn.cursor() if bytes(k).startswith(prefix)]
    finally:
        env.close()


def to_legacy_layout(ckpt_dir: Path) -> None:
    """Rewrite a delta checkpoint's shard files as written before runs existed: one chunk
    ``t/<table>/<vshard>`` per vshard (rows in their stored order), no ``row_chunks`` in
    meta; the manifest's sha256/sizes updated (a valid checkpoint of the old layout)."""
    man = json.loads((ckpt_dir / MANIFEST).read_text())
    for path in shard_files(ckpt_dir):
        env = lmdb.open(str(path), subdir=False, lock=False, map_size=1 << 30)
        with env.begin(write=True) as txn:
            meta = json.loads(bytes(txn.get(b"meta")))
            assert meta.pop("row_chunks") == "runs"
            nv = int(meta["num_vshards"])
            for table in meta["tables"]:
                parts = []
                for key in chunk_keys_txn(txn, table):
                    parts.append(unpack_arrays(txn.get(key.encode()), key))
                    txn.delete(key.encode())
                if not parts:
                    continue
                rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
                vs = vshard_of(rows["ids"], nv)
                for v in np.unique(vs).tolist():
                    sel = np.flatnonzero(vs == v)
                    txn.put(f"t/{table}/{v}".encode(), pack_arrays({k: a[sel] for k, a in rows.items()}))
            txn.put(b"meta", json.dumps(meta).encode())
        env.close()
        man["files"][path.name] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                   "bytes": path.stat().st_size}
    (ckpt_dir / MANIFEST).write_text(json.dumps(man, indent=1, sort_keys=True))


def chunk_keys_txn(txn: lmdb.Transaction, table: str) -> list[str]:
    prefix = f"t/{table}/".encode()
    return [bytes(k).decode() for k in txn.cursor().iternext(keys=True, values=False) if bytes(k).startswith(prefix)]


def _chain(root: Path) -> tuple[list, Path, Path]:
    """A 2-shard fleet's base + 2 deltas under ``root/chain`` and a full checkpoint of the same moment."""
    stores = fleet(2)
    train(stores, seed=1)
    checkpoint(stores, root / "chain", 1, full_every=8)
    for step in (2, 3):
        train(stores, seed=step, id_range=(0, 600), n=300)  # evictions too
        tip = checkpoint(stores, root / "chain", step, full_every=8)
    full = checkpoint(stores, root / "full", 3, full_every=1)
    return stores, tip, full


def test_a_small_delta_holds_one_chunk_per_table_per_file(tmp_path: Path) -> None:
    stores, tip, _full = _chain(tmp_path)
    assert read_manifest(tip)["kind"] == "delta"
    for path in shard_files(tip):
        for table in DIMS:
            keys = chunk_keys(path, table)
            assert len(keys) == 1, (path, table, keys)  # (a chunk per vshard before: up to 8 here)
            rows, _ = read_changes(tip, table)
            assert len(np.unique(vshard_of(rows.ids, V))) > 1  # the run spans several vshards


@pytest.mark.parametrize("chunk_bytes", [1, 600])  # one vshard per run / a few vshards per run
def test_runs_split_by_size_restore_like_a_full_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           chunk_bytes: int) -> None:
    monkeypatch.setattr(ckpt, "DELTA_CHUNK_BYTES", chunk_bytes)
    stores, tip, full = _chain(tmp_path)
    assert max(len(chunk_keys(p, "user")) for p in shard_files(tip)) > 1
    for path in shard_files(tip):  # chunk t/<table>/<v> holds vshards v .. next chunk's v - 1 (meta row_chunks)
        env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
        with env.begin() as txn:
            for table in DIMS:
                firsts = sorted(int(k.rsplit("/", 1)[1]) for k in chunk_keys_txn(txn, table))
                for lo, hi in zip(firsts, firsts[1:] + [V]):
                    ids = unpack_arrays(txn.get(f"t/{table}/{lo}".encode()), "chunk")["ids"]
                    vs = vshard_of(ids, V)
                    assert lo <= vs.min() and vs.max() < hi, (path, table, lo, hi)
        env.close()
    want = state(stores)
    for shards, nv in ((2, V), (3, V), (3, 8)):
        got = state(restore(tip, shards, nv))
        assert got == state(restore(full, shards, nv))
        if nv == V:
            assert got == want


@pytest.mark.parametrize("shards,nv", [(2, V), (3, V), (3, 8)])
def test_delta_files_of_the_per_vshard_layout_still_restore_and_read(tmp_path: Path, shards: int, nv: int) -> None:
    stores, tip, full = _chain(tmp_path)
    before = {t: read_changes(tip, t) for t in DIMS}
    legacy = tmp_path / "legacy"
    shutil.copytree(tip.parent, legacy)
    for d in sorted(legacy.iterdir()):
        if read_manifest(d).get("kind") == "delta":
            to_legacy_layout(d)
    ltip = legacy / tip.name
    assert max(len(chunk_keys(p, "user")) for p in shard_files(ltip)) > 1
    assert state(restore(ltip, shards, nv)) == state(restore(full, shards, nv))
    for t in DIMS:
        rows, gone = read_changes(ltip, t)
        o, p = np.argsort(rows.ids), np.argsort(before[t][0].ids)
        assert rows.ids[o].tobytes() == before[t][0].ids[p].tobytes()
        assert rows.weights[o].tobytes() == before[t][0].weights[p].tobytes()
        assert gone.tolist() == before[t][1].tolist()


def test_an_unknown_row_chunk_layout_is_refused_by_name(tmp_path: Path) -> None:
    _stores, tip, _full = _chain(tmp_path)
    path = shard_files(tip)[0]
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        meta = json.loads(bytes(txn.get(b"meta")))
        meta["row_chunks"] = "zigzag"
        txn.put(b"meta", json.dumps(meta).encode())
    env.close()
    with pytest.raises(CheckpointError, match="shard-0.lmdb key 'meta': row_chunks 'zigzag'"):
        read_changes(tip, "user")
    target = fleet(1)[0]
    with pytest.raises(CheckpointError, match="row_chunks 'zigzag'"):
        ckpt.load_shard(target, tip, range(V), verify=False)
