"""EmbeddingTable: initial values, admission, eviction, bounded memory, removal log."""

from __future__ import annotations

import numpy as np
import torch
import pytest

from ps.config import (
    AdmissionConfig,
    EvictionConfig,
    EvictionPolicy,
    InitKind,
    OptimizerConfig,
    OptimizerKind,
    TableConfig,
)
from ps.embedding_table import EmbeddingTable
from ps.errors import BadRequest

DIM = 4

# fbgemm's CPU backward spins OpenMP threads: on 2 shared cores more than one
# thread made each push ~100x slower here. PS processes run single-threaded too.
torch.set_num_threads(1)


def table(capacity: int = 32, seed: int = 0, **kw) -> EmbeddingTable:
    return EmbeddingTable(TableConfig(name="t", dim=DIM, capacity=capacity, **kw), seed=seed)


def i64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def grads(n: int, v: float = 1.0) -> np.ndarray:
    return np.full((n, DIM), v, dtype=np.float32)


def test_initial_values_independent_of_shard_capacity_and_admission() -> None:
    ids = np.array([0, 1, 2, 10**12, -5], dtype=np.int64)
    a = table(capacity=8).pull(ids)
    b_table = table(capacity=1000)
    b_table.push(ids[::-1].copy(), grads(5, 0.0))  # admitted into different rows, zero gradient
    np.testing.assert_allclose(b_table.pull(ids), a, atol=1e-7)
    assert len(np.unique(a[:, 0])) == 5  # distinct ids, distinct rows
    c = table(seed=1).pull(ids)
    assert not np.allclose(a, c)  # the job seed matters
    other = EmbeddingTable(TableConfig(name="other", dim=DIM, capacity=8), seed=0).pull(ids)
    assert not np.allclose(a, other)  # so does the table name
    u = table(init=InitKind.UNIFORM, init_scale=0.5).pull(np.arange(1000, dtype=np.int64))
    assert -0.5 <= u.min() and u.max() <= 0.5
    assert (table(init=InitKind.ZEROS).pull(ids) == 0).all()


def test_admission_min_count() -> None:
    t = table(admission=AdmissionConfig(min_count=3))
    init = t.pull(i64(7))
    for expect_admitted in (0, 0, 1):
        r = t.push(i64(7, 7), grads(2))  # duplicates in one push count once
        assert r.admitted == expect_admitted
        assert r.unadmitted_dropped == 1 - expect_admitted
    assert t.size == 1
    assert not np.allclose(t.pull(i64(7)), init)
    assert t.counters["unadmitted_dropped"] == 2


def test_unadmitted_reads_initial_value_and_grad_is_dropped() -> None:
    t = table(admission=AdmissionConfig(min_count=100))
    init = t.pull(i64(1, 2))
    r = t.push(i64(1, 2), grads(2))
    assert (r.applied, r.unadmitted_dropped, t.size) == (0, 2, 0)
    np.testing.assert_array_equal(t.pull(i64(1, 2)), init)


def test_admission_probability_is_deterministic_and_near_p() -> None:
    ids = np.arange(4000, dtype=np.int64)
    outcomes = []
    for _ in range(2):
        t = table(capacity=5000, admission=AdmissionConfig(probability=0.25))
        r = t.push(ids, np.zeros((ids.size, DIM), np.float32))
        outcomes.append(np.sort(t.export_rows(t.used_rows()).ids))
        assert r.admitted + r.unadmitted_dropped == ids.size
        assert 0.2 < r.admitted / ids.size < 0.3
    np.testing.assert_array_equal(outcomes[0], outcomes[1])
    # a second sighting gives the rest another chance
    t.push(ids, np.zeros((ids.size, DIM), np.float32))
    assert t.size > outcomes[1].size


def test_lfu_eviction_keeps_frequent_rows_and_stays_within_capacity() -> None:
    t = table(capacity=8, eviction=EvictionConfig(policy=EvictionPolicy.LFU, evict_fraction=0.25))
    hot = i64(100, 101, 102)
    for _ in range(3):
        t.push(hot, grads(3))
    r = t.push(i64(1, 2, 3, 4, 5), grads(5))  # fills the table
    assert (r.evicted, t.size) == (0, 8)
    r = t.push(i64(6, 7), grads(2))  # full: evict 2 least frequent (cold ids)
    assert r.evicted == 2 and r.admitted == 2 and t.size == 8
    present = set(t.export_rows(t.used_rows()).ids.tolist())
    assert {100, 101, 102, 6, 7} <= present
    assert len(present & {1, 2, 3, 4, 5}) == 3
    assert t.counters["evictions"] == 2
    # evicted ids read as their initial value again, and are in the removal log
    gone = sorted({1, 2, 3, 4, 5} - present)
    np.testing.assert_array_equal(t.pull(np.array(gone, np.int64)), table(capacity=8).pull(np.array(gone, np.int64)))
    np.testing.assert_array_equal(t.removed_ids(0), gone)


def test_ttl_eviction_takes_expired_rows_first() -> None:
    t = table(capacity=4, eviction=EvictionConfig(policy=EvictionPolicy.TTL, ttl_steps=2, evict_fraction=0.5))
    t.push(i64(1, 2), grads(2))  # step 1
    t.push(i64(3), grads(1))  # step 2
    t.push(i64(4), grads(1))  # step 3
    t.push(i64(3, 4), grads(2))  # step 4: rows of 1, 2 are idle for 3 > 2 steps
    r = t.push(i64(5), grads(1))  # step 5: full, evict expired 1 and 2 (fraction 0.5 = 2 rows)
    assert r.evicted == 2
    assert set(t.export_rows(t.used_rows()).ids.tolist()) == {3, 4, 5}


def test_eviction_none_drops_new_ids_when_full() -> None:
    t = table(capacity=2, eviction=EvictionConfig(policy=EvictionPolicy.NONE))
    t.push(i64(1, 2), grads(2))
    before = t.pull(i64(1, 2, 3))
    r = t.push(i64(1, 3), grads(2))
    assert (r.applied, r.full_dropped, r.evicted) == (1, 1, 0)
    after = t.pull(i64(1, 2, 3))
    assert not np.allclose(after[0], before[0])
    np.testing.assert_array_equal(after[1:], before[1:])


def test_memory_bounded_when_distinct_ids_exceed_capacity() -> None:
    cap = 64
    t = table(capacity=cap, admission=AdmissionConfig(min_count=2),
              optimizer=OptimizerConfig(kind=OptimizerKind.ADAGRAD))
    mem0 = t.memory_bytes()
    rng = np.random.default_rng(0)
    for step in range(60):
        ids = np.unique(rng.integers(0, 5000, size=48)).astype(np.int64)
        t.push(ids, np.ones((ids.size, DIM), np.float32))
        assert t.size <= cap
        assert t.id_map.size == t.size
    assert t.counters["evictions"] > 0 and t.counters["admissions"] > cap
    assert t.memory_bytes() == mem0  # every structure is preallocated and bounded
    # map and row metadata agree
    used = t.used_rows()
    np.testing.assert_array_equal(t.lookup_rows(t.row_ids[used]), used)


def test_push_in_one_request_more_new_ids_than_capacity() -> None:
    t = table(capacity=4)
    r = t.push(np.arange(10, dtype=np.int64), grads(10))
    assert r.admitted == 4 and r.full_dropped == 6 and t.size == 4


def test_bad_requests_name_the_problem() -> None:
    t = table()
    with pytest.raises(BadRequest, match=r"table 't': ids must be int64, got int32"):
        t.push(np.array([1], np.int32), grads(1))
    with pytest.raises(BadRequest, match=r"grads shape \(2, 4\) does not match ids \[1\] x dim 4"):
        t.push(i64(1), grads(2))
    with pytest.raises(BadRequest, match=r"grads must be float32, got float64"):
        t.push(i64(1), np.ones((1, DIM)))
    with pytest.raises(BadRequest, match=r"ids\[1\] is -1"):
        t.pull(i64(3, -1))
    assert t.size == 0 and t.step == 0


def test_removal_log_is_bounded_and_says_when_it_forgot(monkeypatch: pytest.MonkeyPatch) -> None:
    import ps.embedding_table as et

    monkeypatch.setattr(et, "_REMOVED_LOG_MIN", 8)  # bound = max(4 * capacity, 8) = 16 ids
    t = table(capacity=4, eviction=EvictionConfig(evict_fraction=0.25))
    for v in range(30):
        t.current_version = v + 1
        t.push(i64(1000 + v), grads(1))
    assert t._removed_n <= 16
    assert t.counters["evictions"] == 26
    # version k (k >= 5) evicted id 1000 + k - 5, the least used and oldest row
    np.testing.assert_array_equal(t.removed_ids(25), np.arange(1021, 1026, dtype=np.int64))
    with pytest.raises(BadRequest, match=r"removals before version \d+ were forgotten"):
        t.removed_ids(0)
