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
from delivery.dense import DenseSpec, save_scripted, trace_dense
from meta_io.schema import Schema
from metaps.config import to_dict
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
