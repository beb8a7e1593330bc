"""New ids on reused rows: the insert path's consecutive-rows shortcut resets optimizer state.

``EmbeddingTable._alloc`` writes the initial weights, optimizer state and metadata of
a consecutive run of free rows as slices (one fill instead of a scatter). A fresh
table's state already holds the initial values, so only rows that were used,
released and then handed out again as a run show whether the reset happened: here
rows 4..7 are dropped in descending order (so the free list pops them as 4, 5, 6, 7)
and taken by new ids. Their weights and state must equal what a table that never used
those rows gives the same ids.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.config import TABLE_OPTIMIZERS, InitKind, OptimizerConfig, OptimizerKind, TableConfig
from ps.embedding_table import EmbeddingTable

torch.set_num_threads(1)

DIM = 8


def _table(opt: OptimizerKind) -> EmbeddingTable:
    init = InitKind.ZEROS if opt == OptimizerKind.FTRL else InitKind.NORMAL  # ftrl rows start at w = 0
    cfg = TableConfig(name="t", dim=DIM, capacity=8, optimizer=OptimizerConfig(kind=opt), init=init)
    return EmbeddingTable(cfg, seed=3)


@pytest.mark.parametrize("opt", TABLE_OPTIMIZERS)  # every kind a table takes (adamw is dense-only)
def test_reused_consecutive_rows_get_initial_state(opt: OptimizerKind) -> None:
    rng = np.random.default_rng(0)
    g_old = (rng.normal(size=(8, DIM)) * 5).astype(np.float32)
    g_new = rng.normal(size=(4, DIM)).astype(np.float32)
    new_ids = np.array([100, 101, 102, 103], dtype=np.int64)

    used = _table(opt)
    for _ in range(3):  # move the state of every row away from its initial value
        used.push(np.arange(8, dtype=np.int64), g_old)
    before = {k: t[4:8].clone() for k, t in used.optimizer.state_tensors().items()}
    assert used.drop_rows(np.array([7, 6, 5, 4], dtype=np.int64)) == 4
    used.push(new_ids, g_new)
    np.testing.assert_array_equal(used.lookup_rows(new_ids), [4, 5, 6, 7])  # a consecutive run: the slice path

    fresh = _table(opt)
    for _ in range(3):
        fresh.push(np.arange(4, dtype=np.int64), g_old[:4])
    fresh.push(new_ids, g_new)
    np.testing.assert_array_equal(fresh.lookup_rows(new_ids), [4, 5, 6, 7])

    assert torch.equal(used.weights[4:8], fresh.weights[4:8])
    for k, t in used.optimizer.state_tensors().items():
        assert torch.equal(t[4:8], fresh.optimizer.state_tensors()[k][4:8]), k
        if opt != OptimizerKind.SGD:
            assert not torch.equal(before[k], t[4:8]), k  # the old state was really there to reset
    np.testing.assert_array_equal(used.pull(new_ids), fresh.pull(new_ids))
    np.testing.assert_array_equal(used.freq[4:8], fresh.freq[4:8])
