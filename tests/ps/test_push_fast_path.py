"""Pushes of unique ids skip the sort and the duplicate sum: same tables as the sorted path.

``EmbeddingTable.push`` detects unique requests without sorting (rows stamped in
``last_step``, put back) and then allocates new rows in id order, as the
``torch.unique`` path does. The reference is the same push sent through that path
(one id repeated with a zero gradient: the sum and the per-row counts are unchanged).
"""

from __future__ import annotations

import numpy as np
import torch

from ps.config import AdmissionConfig, OptimizerConfig, OptimizerKind, TableConfig
from ps.embedding_table import EmbeddingTable

torch.set_num_threads(1)
DIM = 16


def _table(kind: OptimizerKind = OptimizerKind.ROWWISE_ADAGRAD, **kw: object) -> EmbeddingTable:
    cfg = TableConfig(name="t", dim=DIM, capacity=400, optimizer=OptimizerConfig(kind=kind), **kw)  # type: ignore[arg-type]
    return EmbeddingTable(cfg, seed=5)


def _state(t: EmbeddingTable) -> dict[str, np.ndarray]:
    out = {
        "weights": t.weights.numpy().copy(), "row_ids": t.row_ids.copy(), "freq": t.freq.copy(),
        "last_step": t.last_step.copy(), "version": t.row_version.copy(),
    }
    out.update({k: v.numpy().copy() for k, v in t.optimizer.state_tensors().items()})
    return out


def _assert_same(a: EmbeddingTable, b: EmbeddingTable) -> None:
    sa, sb = _state(a), _state(b)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    ca, cb = dict(a.counters), dict(b.counters)
    ca.pop("push_ids"), cb.pop("push_ids")  # ids as sent: the reference sends one more
    assert ca == cb and a.size == b.size


def test_unique_pushes_equal_the_sorted_path() -> None:
    rng = np.random.default_rng(0)
    for kind, extra in ((OptimizerKind.ROWWISE_ADAGRAD, {}), (OptimizerKind.ADAM, {}),
                        (OptimizerKind.SGD, {"admission": AdmissionConfig(min_count=2)})):
        fast, ref = _table(kind, **extra), _table(kind, **extra)
        for step in range(8):
            # unsorted, unique; known and new ids mixed; the table fills and evicts (capacity 400)
            ids = rng.choice(2000, size=120, replace=False).astype(np.int64)
            g = rng.standard_normal((120, DIM)).astype(np.float32)
            r1 = fast.push(ids, g)
            r2 = ref.push(np.concatenate([ids, ids[:1]]), np.concatenate([g, np.zeros((1, DIM), np.float32)]))
            assert r1 == r2, (kind, step)
            _assert_same(fast, ref)


def test_repeated_ids_are_summed_known_or_new() -> None:
    """A repeat among known ids (caught by the row stamp) or among new ids (the sort) is summed."""
    t, ref = _table(), _table()
    base = np.arange(10, 20, dtype=np.int64)
    t.push(base, np.zeros((10, DIM), np.float32))
    ref.push(base, np.zeros((10, DIM), np.float32))
    g = np.ones((4, DIM), np.float32)
    for ids in (np.array([15, 12, 15, 11]), np.array([50, 12, 50, 40])):  # known repeat, then new repeat
        last = t.last_step.copy()
        t.push(ids.astype(np.int64), g)
        uniq, inv = np.unique(ids, return_inverse=True)
        summed = np.zeros((uniq.size, DIM), np.float32)
        np.add.at(summed, inv, g)
        ref.push(uniq.astype(np.int64), summed)
        _assert_same(t, ref)
        untouched = ~np.isin(t.row_ids, ids)
        np.testing.assert_array_equal(t.last_step[untouched], last[untouched])  # the stamp was put back


def test_rows_not_written_keep_their_metadata() -> None:
    """A row whose update would overflow is not written: the uniqueness stamp leaves no trace on it."""
    t = _table()
    ids = np.array([3, 7, 9], dtype=np.int64)
    for _ in range(3):
        t.push(ids, np.zeros((3, DIM), np.float32))
    row3 = int(t.lookup_rows(np.array([3], dtype=np.int64))[0])
    before = int(t.last_step[row3])
    g = np.ones((3, DIM), np.float32)
    g[0] = 3e30  # finite, but g^2 overflows float32: this row's update is screened out
    res = t.push(ids, g)
    assert res.update_nonfinite_dropped == 1 and res.applied == 2
    assert int(t.last_step[row3]) == before
