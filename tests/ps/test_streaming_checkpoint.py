"""Streaming checkpoint save: one vshard chunk at a time, several LMDB transactions, same file contents."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

import ps.checkpoint as ckpt
from common.hashing import vshard_of
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.shard_store import ShardStore

torch.set_num_threads(1)
V = 16


def _store(capacity: int = 400) -> ShardStore:
    cfgs = [
        TableConfig(name="user", dim=4, capacity=capacity, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD)),
        TableConfig(name="item", dim=8, capacity=capacity, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM)),
    ]
    return ShardStore(cfgs, shard_id=0, num_vshards=V, seed=3)


def _filled() -> ShardStore:
    s = _store()
    rng = np.random.default_rng(0)
    for name, dim in (("user", 4), ("item", 8)):
        ids = rng.choice(10**12, size=300, replace=False).astype(np.int64)
        s.push(name, ids, rng.normal(size=(300, dim)).astype(np.float32))
        s.tables[name].drop_rows(np.arange(0, 300, 7))  # free rows in the middle
    s.dense.register("bias", np.arange(5, dtype=np.float32))
    return s


def test_vshard_chunks_cover_every_row_once_in_row_order() -> None:
    s = _filled()
    for name, t in s.tables.items():
        seen = []
        prev = -1
        for v, rows in s.vshard_chunks(name):
            assert v > prev  # ascending, one chunk per vshard
            prev = v
            assert (vshard_of(rows.ids, V) == v).all()
            r = t.lookup_rows(rows.ids)
            assert (np.diff(r) > 0).all()  # row order inside a chunk
            np.testing.assert_array_equal(rows.weights, t.weights[torch.from_numpy(r)].numpy())
            seen.append(rows.ids)
        got = np.sort(np.concatenate(seen))
        np.testing.assert_array_equal(got, np.sort(t.row_ids[t.row_ids >= 0]))
    assert list(_store().vshard_chunks("user")) == []


@pytest.mark.parametrize("txn_bytes", [1, 1 << 30])
def test_streamed_save_restores_equal_across_transactions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, txn_bytes: int
) -> None:
    monkeypatch.setattr(ckpt, "_TXN_BYTES", txn_bytes)  # 1: a commit after every chunk
    s = _filled()
    tmp = ckpt.checkpoint_tmp_dir(tmp_path, step=1)
    summary = ckpt.save_shard(s, tmp, shard_id=0)
    assert summary["rows"] == {name: t.size for name, t in s.tables.items()}
    final = ckpt.commit_checkpoint(tmp, {"step": 1})
    env = lmdb.open(str(ckpt.shard_path(final, 0)), subdir=False, lock=False, readonly=True)
    with env.begin() as txn:
        keys = [bytes(k).decode() for k, _ in txn.cursor()]
    env.close()
    for name, t in s.tables.items():
        want = {f"t/{name}/{v}" for v in np.unique(vshard_of(t.row_ids[t.row_ids >= 0], V)).tolist()}
        assert {k for k in keys if k.startswith(f"t/{name}/")} == want
    fresh = _store()
    ckpt.load_shard(fresh, final, range(V))
    for name, t in s.tables.items():
        a, b = s.all_rows(name), fresh.all_rows(name)
        oa, ob = np.argsort(a.ids), np.argsort(b.ids)
        np.testing.assert_array_equal(a.ids[oa], b.ids[ob])
        np.testing.assert_array_equal(a.weights[oa], b.weights[ob])
        for k in a.state:
            np.testing.assert_array_equal(a.state[k][oa], b.state[k][ob])
        np.testing.assert_array_equal(a.freq[oa], b.freq[ob])
    assert ckpt.load_dense(fresh, final) == ["bias"]
    np.testing.assert_array_equal(fresh.dense.pull(["bias"])["bias"], np.arange(5, dtype=np.float32))
