"""Shared pieces of the delivery tests: a tiny real model, and bundles written with the real writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from delivery.bundle import (
    DENSE, EMBEDDINGS, REMOVED, BundleKind, BundleManifest, EmbeddingWriter, TableInfo, checksum_files,
    table_prefix, write_manifest, write_removed,
)
from delivery.config import RowDtype
from delivery.dense import save_scripted, trace_dense
from meta_io.schema import Schema
from common.config import to_dict
from common.hashing import vshard_of
from models.config import ModelConfig
from models.factory import build_model
from models.testing import synthetic_schema

torch.set_num_threads(1)


class TinyModel:
    """A real DeepFM on a small synthetic schema, traced once per test session."""

    def __init__(self) -> None:
        self.schema: Schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=2, vector_dim=4)
        self.cfg = ModelConfig(kind="deepfm", hidden=[16, 8], default_dim=8)
        self.model = build_model(self.schema, self.cfg)
        self.dims = dict(self.model.dims)
        self.scripted, self.spec = trace_dense(self.model, self.schema, self.dims)


@pytest.fixture(scope="session")
def tiny() -> TinyModel:
    return TinyModel()


def write_bundle(
    staging: Path,
    tiny: TinyModel,
    version: str,
    rows: dict[str, tuple[np.ndarray, np.ndarray]],
    *,
    parent: str | None = None,
    base: str = "",
    removed: dict[str, np.ndarray] | None = None,
    live: dict[str, int] | None = None,
    dtype: RowDtype = RowDtype.FP32,
    watermark: int = 0,
) -> BundleManifest:
    """A bundle in ``staging`` written with the real writer (rows: table -> (sorted ids, rows))."""
    w = EmbeddingWriter(staging / EMBEDDINGS, dtype, map_size_gb=1)
    tables = {}
    for t in sorted(tiny.dims, key=table_prefix):
        ids, r = rows.get(t, (np.zeros(0, np.int64), np.zeros((0, tiny.dims[t]), np.float32)))
        w.write_table(t, ids, r)
        gone = (removed or {}).get(t, np.zeros(0, np.int64))
        tables[t] = TableInfo(dim=tiny.dims[t], rows=(live or {}).get(t, len(ids)), written=len(ids), removed=len(gone))
    w.close()
    if parent is not None:
        write_removed(staging / REMOVED, removed or {})
    save_scripted(tiny.scripted, str(staging / DENSE))
    m = BundleManifest(
        version=version, kind=BundleKind.DELTA if parent else BundleKind.FULL, parent=parent,
        base=base or version, created="2026-01-01T00:00:00+00:00",
        source={"checkpoint": f"/nowhere/{version}", "step": watermark, "row_watermark": watermark},
        schema=tiny.schema.to_dict(), model=to_dict(tiny.cfg), dtype=dtype, tables=tables,
        dense=tiny.spec.to_dict(), files=checksum_files(staging),
    )
    write_manifest(staging, m)
    return m


def random_rows(tiny: TinyModel, n: int, seed: int, id_space: int = 1000) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for t, dim in tiny.dims.items():
        ids = np.sort(rng.choice(id_space, n, replace=False)).astype(np.int64)
        out[t] = (ids, rng.normal(size=(n, dim)).astype(np.float32))
    return out


class Fleet:
    """Two real PS ShardStores (ids routed by vshard) holding the tiny model's tables and dense params.

    Example::

        fleet = Fleet(tiny)
        fleet.train(seed=1, fraction=1.0)
        ckpt = fleet.checkpoint(tmp_path / "run" / "checkpoints", step=10)
    """

    def __init__(self, tiny: TinyModel, capacity: int = 400, vocab: int = 300, tables: list[str] | None = None) -> None:
        from ps.config import TableConfig
        from ps.shard_store import ShardStore

        self.tiny = tiny
        self.vocab = vocab
        names = tables if tables is not None else list(tiny.dims)
        cfgs = [TableConfig(name=t, dim=tiny.dims[t], capacity=capacity) for t in names]
        self.stores = [ShardStore(cfgs, shard_id=i, num_vshards=8, seed=0) for i in range(2)]
        model = build_model(tiny.schema, tiny.cfg)
        for n, p in model.named_parameters():
            self.stores[0].dense.register(n, p.detach().numpy().copy())
        self.next_id = vocab

    def _shard(self, ids: np.ndarray) -> np.ndarray:
        return vshard_of(ids, 8) % 2

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray) -> None:
        sh = self._shard(ids)
        for i, store in enumerate(self.stores):
            sel = sh == i
            if sel.any():
                store.push(table, ids[sel], grads[sel])

    def pull(self, table: str, ids: np.ndarray) -> np.ndarray:
        out = np.zeros((len(ids), self.tiny.dims[table]), np.float32)
        sh = self._shard(ids)
        for i, store in enumerate(self.stores):
            sel = sh == i
            if sel.any():
                out[sel] = store.pull(table, ids[sel])
        return out

    def train(self, seed: int, fraction: float, new_ids: int = 0) -> None:
        """Push random gradients to ``fraction`` of ids 0..vocab-1, plus ``new_ids`` fresh ids per table."""
        rng = np.random.default_rng(seed)
        for t, dim in self.tiny.dims.items():
            if t not in self.stores[0].tables:
                continue
            ids = np.flatnonzero(rng.random(self.vocab) < fraction).astype(np.int64)
            fresh = np.arange(self.next_id, self.next_id + new_ids, dtype=np.int64)
            ids = np.concatenate([ids, fresh])
            if ids.size:
                self.push(t, ids, rng.normal(size=(ids.size, dim)).astype(np.float32))
        self.next_id += new_ids
        names = self.stores[0].dense.names()
        vals = self.stores[0].dense.pull(names)
        self.stores[0].dense.set({n: v + rng.normal(scale=0.05, size=v.shape).astype(np.float32) for n, v in vals.items()})

    def checkpoint(self, root: Path, step: int, info: dict | None = None) -> Path:
        from ps.checkpoint import checkpoint_tmp_dir, commit_checkpoint, save_shard

        tmp = checkpoint_tmp_dir(root, step)
        for i, store in enumerate(self.stores):
            save_shard(store, tmp, i)
        if info is None:
            info = {"schema": self.tiny.schema.to_dict(), "model": to_dict(self.tiny.cfg), "step": step,
                    "data_range": ["2026-01-01", "2026-01-02"], "metrics": {"train_loss": 0.5}}
        return commit_checkpoint(tmp, info)

    def trained_model(self) -> torch.nn.Module:
        """The model the trainer would serve: built from config, dense params pulled from the PS."""
        model = build_model(self.tiny.schema, self.tiny.cfg)
        vals = self.stores[0].dense.pull([n for n, _ in model.named_parameters()])
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.from_numpy(vals[n]).reshape(p.shape))
        return model.eval()

    def live_ids(self, table: str) -> np.ndarray:
        return np.sort(np.concatenate([s.all_rows(table).ids for s in self.stores]))


class History:
    """One fleet trained in three rounds, checkpointed after each (built once per session).

    ckpt-10: ids 0..299 of every table trained.
    ckpt-20: ~10% of them touched again + 150 new ids per table; capacity evicts some (removed ids).
    ckpt-30: ~5% touched + 60 new ids; the fleet's state afterwards equals ckpt-30.
    """

    def __init__(self, root: Path, tiny: TinyModel) -> None:
        self.root = root
        self.fleet = Fleet(tiny, capacity=200)
        self.ckpts: dict[int, Path] = {}
        self.live: dict[int, dict[str, np.ndarray]] = {}
        for step, (fraction, new) in {10: (1.0, 0), 20: (0.1, 150), 30: (0.05, 60)}.items():
            self.fleet.train(seed=step, fraction=fraction, new_ids=new)
            self.ckpts[step] = self.fleet.checkpoint(root / "checkpoints", step)
            self.live[step] = {t: self.fleet.live_ids(t) for t in tiny.dims}


@pytest.fixture(scope="session")
def history(tmp_path_factory: pytest.TempPathFactory, tiny: TinyModel) -> History:
    return History(tmp_path_factory.mktemp("history"), tiny)


def live_features(tiny: TinyModel, live: dict[str, np.ndarray], rows: int, seed: int):
    """A FeatureBatch (no padding rows) whose ids all exist in ``live`` (table -> ids)."""
    from models.testing import random_features

    fb = random_features(tiny.schema, (rows,), vocab=1 << 20, generator=torch.Generator().manual_seed(seed), pad_rows=0.0)
    for c in tiny.schema.id_columns:
        ids = torch.from_numpy(live[c.table_name])
        v = fb.ids[c.name]
        fb.ids[c.name] = torch.where(v >= 0, ids[v % ids.numel()], v)
    return fb


def write_parquet(path: Path, tiny: TinyModel, fb, labels: dict[str, np.ndarray]) -> Path:
    """``fb`` as a Parquet file in the schema's source format (lists unpadded) with ``labels``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from meta_io.schema import LIST_KINDS

    cols = {}
    for c in tiny.schema.id_columns:
        ids = fb.ids[c.name].numpy()
        if c.kind in LIST_KINDS:
            valid = ids >= 0
            offsets = np.concatenate([[0], np.cumsum(valid.sum(1))]).astype(np.int32)
            cols[c.name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids[valid]))
        else:
            cols[c.name] = pa.array(ids[:, 0])
    for c in tiny.schema.vector_columns:
        v = fb.vectors[c.name].numpy().astype(np.float32)
        cols[c.name] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
    for i, c in enumerate(tiny.schema.dense_columns):
        cols[c.name] = pa.array(fb.dense[:, i].numpy())
    for lab in tiny.schema.labels:
        cols[lab] = pa.array(labels[lab].astype(np.float32))
    pq.write_table(pa.table(cols), str(path))
    return path


def assert_bundle_adapts_like_the_trainer(tiny: TinyModel, fleet: Fleet, tmp_path: Path, meta, other, min_diff: float,
                                          what: str) -> dict:
    """Deliver ``fleet``'s checkpoint trained under ``meta``; its bundle's adapted predictions must equal
    :func:`models.meta.adapt_and_predict` under ``meta`` (1e-5) and differ from those under ``other`` by more
    than ``min_diff`` somewhere (else the check could not see a bundle ignoring ``what``).

    Returns:
        the bundle's stored ``[meta]`` recipe (for the caller's own key checks).
    """
    from delivery.config import DeliveryConfig
    from delivery.job import deliver_once
    from delivery.loader import load_bundle
    from models.meta import adapt_and_predict
    from models.testing import random_features

    info = {"schema": tiny.schema.to_dict(), "model": to_dict(tiny.cfg), "step": 5,
            "job": {"meta": to_dict(meta), "ps": {"seed": 0}}}
    ckpt = fleet.checkpoint(tmp_path / "checkpoints", step=5, info=info)
    deliver_once(DeliveryConfig(out=tmp_path / "bundles"), checkpoint=ckpt)
    served = load_bundle(tmp_path / "bundles" / "v000001")

    def flat(fb):
        return fb.map(lambda t: t.reshape((-1,) + tuple(t.shape[2:])))

    try:
        T, K, Q = 5, 6, 4  # some support slots padded: steps of different sizes per task
        g = torch.Generator().manual_seed(11)
        sup = random_features(tiny.schema, (T, K), vocab=600, generator=g, pad_rows=0.3)
        qry = random_features(tiny.schema, (T, Q), vocab=600, generator=g, pad_rows=0.2)
        uniq: dict[str, torch.Tensor] = {}
        for c in tiny.schema.id_columns:
            v = torch.cat([sup.ids[c.name].reshape(-1), qry.ids[c.name].reshape(-1)])
            uniq[c.table_name] = torch.unique(torch.cat([uniq.get(c.table_name, torch.zeros(0, dtype=torch.long)),
                                                         v[v >= 0]]))
        rows = {t: torch.from_numpy(fleet.pull(t, u.numpy())) for t, u in uniq.items()}
        want = adapt_and_predict(fleet.trained_model(), sup, qry, rows, uniq, meta)
        alt = adapt_and_predict(fleet.trained_model(), sup, qry, rows, uniq, other)
        keys = np.arange(T, dtype=np.int64) * 7919 + 3
        pred = served.adapt(flat(sup), np.repeat(keys, K), tasks_per_batch=2)
        got = pred.predict(flat(qry), np.repeat(keys, Q))
        real = qry.mask.reshape(-1).bool()
        differs = 0.0
        for h in served.heads:
            np.testing.assert_allclose(got[h][real].numpy(), want[h].reshape(-1)[real].numpy(), atol=1e-5, rtol=0)
            differs = max(differs, float((want[h] - alt[h]).reshape(-1)[real].abs().max()))
        assert differs > min_diff, f"{what} changed nothing: the test would not see a bundle ignoring it"
        return dict(served.manifest.adapt["meta"])
    finally:
        served.close()
