"""ShardStore: pull/push semantics, BadRequest cases, admission, eviction, migration, deltas."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from metaps.hashing import vshard_of
from ps.config import (
    AdmissionConfig,
    EvictionConfig,
    EvictionPolicy,
    OptimizerConfig,
    OptimizerKind,
    TableConfig,
)
from ps.errors import BadRequest
from ps.shard_store import ShardStore, TableRows

DIM = 8


def make_store(*tables: TableConfig, shard_id: int = 0, V: int = 16, **kw) -> ShardStore:
    if not tables:
        tables = (TableConfig(name="user", dim=DIM, capacity=64),)
    return ShardStore(list(tables), shard_id=shard_id, num_vshards=V, seed=7, **kw)


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_pull_push_rowwise_adagrad_exact_duplicates() -> None:
    s = make_store()
    before = s.pull("user", ids(1, 2))
    g = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM) / 10
    res = s.push("user", ids(1, 2, 1), g)
    assert (res.applied, res.admitted) == (2, 2)
    agg = np.stack([g[0] + g[2], g[1]])
    m = (agg**2).mean(axis=1, keepdims=True)
    want = before - 0.05 * agg / (np.sqrt(m) + 1e-8)
    got = s.pull("user", ids(2, 1, 1))
    np.testing.assert_allclose(got, want[[1, 0, 0]], rtol=1e-5, atol=1e-6)
