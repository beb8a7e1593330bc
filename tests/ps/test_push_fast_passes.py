"""The push's passes cut (pull8): same counts and bounds as before.

* the finite check's ``aminmax`` gives the fused optimizer its ``max |g|`` only when
  the gradients reach it unchanged: when admission drops some rows, the growth bound
  comes from the rows written (as before), not from a dropped row's larger gradient;
* under weight decay the bound comes from the decayed gradients, not the raw ones;
* the per-row push count (``freq``) is incremented in int32 and still saturates at
  int32's max.
"""

from __future__ import annotations

import numpy as np
import torch

from ps.config import AdmissionConfig, OptimizerConfig, OptimizerKind, TableConfig
from ps.embedding_table import EmbeddingTable

torch.set_num_threads(1)
DIM = 8


def _table(**kw: object) -> EmbeddingTable:
    cfg = TableConfig(name="t", dim=DIM, capacity=64, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD),
                      **kw)  # type: ignore[arg-type]
    return EmbeddingTable(cfg, seed=1)


def test_growth_bound_uses_the_rows_written_when_admission_drops_some() -> None:
    t = _table(admission=AdmissionConfig(min_count=2))
    zeros = np.zeros((2, DIM), np.float32)
    t.push(np.array([1, 3], np.int64), zeros)  # first sight of both: none admitted yet
    bound_m = t.optimizer.bound_m
    g = np.full((3, DIM), 0.5, np.float32)
    g[1] = 1000.0  # id 5: first sight, not admitted, its gradient dropped
    res = t.push(np.array([1, 5, 2], np.int64), g)
    assert res.applied == 1  # id 1 only (id 2 and 5 seen once)
    # the bound grew by what id 1's gradient can add (0.5^2 per element), not by id 5's 1000^2
    assert t.optimizer.bound_m == bound_m + 0.5 * 0.5 * DIM


def test_push_count_saturates_at_int32_max() -> None:
    t = _table()
    ids = np.array([7, 8], np.int64)
    t.push(ids, np.zeros((2, DIM), np.float32))
    rows = t.lookup_rows(ids)
    top = np.iinfo(np.int32).max
    t.freq[rows[0]] = top - 1
    for _ in range(2):
        t.push(ids, np.zeros((2, DIM), np.float32))
    assert t.freq.dtype == np.int32
    assert int(t.freq[rows[0]]) == top and int(t.freq[rows[1]]) == 3


def test_growth_bound_uses_the_decayed_gradients_under_weight_decay() -> None:
    cfg = TableConfig(name="t", dim=DIM, capacity=64,
                      optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, weight_decay=1.0))
    t = EmbeddingTable(cfg, seed=1)
    ids = np.array([4], np.int64)
    t.push(ids, np.zeros((1, DIM), np.float32))
    w = t.weights[int(t.lookup_rows(ids)[0])].clone()
    bound_m = t.optimizer.bound_m
    t.push(ids, np.zeros((1, DIM), np.float32))  # raw max |g| 0; decayed: g + 1.0 * w = w
    gmax = float(w.abs().max())
    assert gmax > 0 and t.optimizer.bound_m == bound_m + gmax * gmax * DIM
