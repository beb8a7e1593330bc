"""IdMap on fbgemm's pruned hash map: insert/lookup/remove, tombstone rebuilds, errors."""

from __future__ import annotations

import numpy as np
import pytest

from ps.id_map import IdMap


def test_insert_lookup_overwrite_and_unknown() -> None:
    m = IdMap(capacity=8)
    m.insert(np.array([5, 7, 1 << 60, -3], np.int64), np.array([0, 1, 2, 3], np.int64))
    got = m.lookup(np.array([7, 5, 9, 1 << 60, -3], np.int64)).numpy()
    assert got.tolist() == [1, 0, -1, 2, 3]
    m.insert(np.array([5], np.int64), np.array([6], np.int64))
    assert m.lookup(np.array([5], np.int64)).tolist() == [6]
    assert m.size == 4
    ids, rows = m.items()
    assert dict(zip(ids.tolist(), rows.tolist())) == {5: 6, 7: 1, 1 << 60: 2, -3: 3}


def test_remove_then_reinsert_and_rebuild_keeps_entries() -> None:
    cap = 64
    m = IdMap(capacity=cap)
    rng = np.random.default_rng(0)
    live: dict[int, int] = {}
    next_id = 0
    for _ in range(40):  # churn far past the slot count: tombstones must get rebuilt away
        k = int(rng.integers(1, 20))
        room = cap - len(live)
        if room < k:
            victims = np.array(list(live)[: k - room], np.int64)
            assert m.remove(victims) == len(victims)
            for v in victims.tolist():
                del live[v]
        new = np.arange(next_id, next_id + k, dtype=np.int64)
        next_id += k
        rows = rng.integers(0, 1000, size=k).astype(np.int64)
        m.insert(new, rows)
        live.update(zip(new.tolist(), rows.tolist()))
        assert m.size == len(live)
    assert m.rebuilds > 0
    q = np.arange(next_id, dtype=np.int64)
    want = np.array([live.get(i, -1) for i in q.tolist()])
    np.testing.assert_array_equal(m.lookup(q).numpy(), want)


def test_errors_leave_map_unchanged() -> None:
    m = IdMap(capacity=2)
    m.insert(np.array([1], np.int64), np.array([0], np.int64))
    with pytest.raises(ValueError, match="exceed capacity 2"):
        m.insert(np.array([2, 3], np.int64), np.array([1, 2], np.int64))
    with pytest.raises(ValueError, match="-1 is reserved"):
        m.insert(np.array([-1], np.int64), np.array([1], np.int64))
    with pytest.raises(ValueError, match="unique"):
        m.insert(np.array([4, 4], np.int64), np.array([1, 1], np.int64))
    with pytest.raises(ValueError, match="int64"):
        m.lookup(np.array([1], np.int32))
    assert m.size == 1
    assert m.lookup(np.array([1, 2, 3, 4], np.int64)).tolist() == [0, -1, -1, -1]
