"""ShardStore: pull/push semantics, BadRequest cases, admission, eviction, migration, deltas."""

from __future__ import annotations

import threading

import numpy as np
import torch
import pytest

from common.hashing import vshard_of
from ps.config import (
    TABLE_OPTIMIZERS,
    AdmissionConfig,
    EvictionConfig,
    EvictionPolicy,
    InitKind,
    OptimizerConfig,
    OptimizerKind,
    TableConfig,
)
from ps.errors import BadRequest
from ps.shard_store import ShardStore, TableRows

DIM = 8

# fbgemm's CPU backward spins OpenMP threads: on 2 shared cores more than one
# thread made each push ~100x slower here. PS processes run single-threaded too.
torch.set_num_threads(1)


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


def snapshot(s: ShardStore, table: str = "user") -> tuple:
    rows = s.all_rows(table)
    order = np.argsort(rows.ids)
    r = rows.take(order)
    t = s.tables[table]
    return (r.ids.tolist(), r.weights.tobytes(), {k: v.tobytes() for k, v in r.state.items()},
            r.freq.tolist(), r.last_step.tolist(), t.step, dict(t.counters, pulls=0, pull_ids=0))


def test_bad_requests_leave_table_unchanged() -> None:
    s = make_store()
    s.push("user", ids(1, 2, 3), np.ones((3, DIM), np.float32))
    before = snapshot(s)
    cases = [
        (("nope", ids(1), np.ones((1, DIM), np.float32)), r"unknown table 'nope'; this shard has \['user'\]"),
        (("user", ids(1, 2), np.ones((3, DIM), np.float32)), r"grads shape \(3, 8\) does not match ids \[2\] x dim 8"),
        (("user", ids(1), np.ones(DIM + 1, np.float32)), r"expected \(1, 8\) or \(8,\)"),
        (("user", np.array([1.0]), np.ones((1, DIM), np.float32)), r"ids must be int64, got float64"),
        (("user", ids(1), np.ones((1, DIM), np.float16)), r"grads must be float32, got float16"),
        (("user", [1], np.ones((1, DIM), np.float32)), r"ids must be a numpy int64 array, got list"),
        (("user", ids(1, 4, -1), np.ones((3, DIM), np.float32)), r"ids\[2\] is -1"),
    ]
    nan = np.ones((3, DIM), np.float32)
    nan[1, 3] = np.nan
    cases.append((("user", ids(1, 9, 2), nan), r"table 'user': 1 gradient row\(s\) hold NaN/Inf, first at row 1 \(id 9\)"))
    big = np.full((2, DIM), 3e38, np.float32)
    cases.append((("user", ids(5, 5), big), r"summed gradients of 1 id\(s\) overflow to Inf, first id 5"))
    for args, pattern in cases:
        with pytest.raises(BadRequest, match=pattern):
            s.push(*args)
        assert snapshot(s) == before, pattern
    with pytest.raises(BadRequest, match="unknown table"):
        s.pull("nope", ids(1))
    with pytest.raises(BadRequest, match=r"must be 1-D"):
        s.pull("user", np.ones((2, 2), np.int64))
    assert snapshot(s) == before


def test_nonfinite_drop_mode_drops_only_bad_ids() -> None:
    s = make_store(nonfinite_grads="drop")
    g = np.ones((4, DIM), np.float32)
    g[2, 0] = np.inf  # id 1 appears twice; one bad occurrence drops the id
    before = s.pull("user", ids(1, 2, 3))
    r = s.push("user", ids(1, 2, 1, 3), g)
    assert (r.applied, r.nonfinite_dropped) == (2, 1)
    after = s.pull("user", ids(1, 2, 3))
    np.testing.assert_array_equal(after[0], before[0])
    assert not np.allclose(after[1:], before[1:])
    assert s.stats()["tables"]["user"]["nonfinite_dropped"] == 1


def test_flat_grads_accepted() -> None:
    s = make_store()
    r = s.push("user", ids(1, 2), np.ones(2 * DIM, np.float32))
    assert r.applied == 2


@pytest.mark.parametrize("kind", TABLE_OPTIMIZERS)
def test_export_import_drop_round_trip(kind: OptimizerKind) -> None:
    init = InitKind.ZEROS if kind == OptimizerKind.FTRL else InitKind.NORMAL  # ftrl rows start at w = 0
    cfg = TableConfig(name="user", dim=DIM, capacity=64, optimizer=OptimizerConfig(kind=kind), init=init)
    V = 8
    a = make_store(cfg, V=V)
    b = make_store(cfg, shard_id=1, V=V)
    rng = np.random.default_rng(1)
    all_ids = np.arange(40, dtype=np.int64)
    for _ in range(3):
        sel = rng.choice(all_ids, size=25)
        a.push("user", sel, rng.normal(size=(25, DIM)).astype(np.float32))
    moving = [0, 3, 5]
    exported = a.export_vshards(moving)["user"]
    assert len(exported) > 0
    assert np.isin(vshard_of(exported.ids, V), moving).all()
    b.import_rows("user", exported)
    dropped = a.drop_vshards(moving)
    assert dropped == len(exported)
    again = b.export_vshards(moving)["user"]
    o1, o2 = np.argsort(exported.ids), np.argsort(again.ids)
    np.testing.assert_array_equal(exported.ids[o1], again.ids[o2])
    np.testing.assert_array_equal(exported.weights[o1], again.weights[o2])
    for k in exported.state:
        np.testing.assert_array_equal(exported.state[k][o1], again.state[k][o2])
    np.testing.assert_array_equal(exported.freq[o1], again.freq[o2])
    np.testing.assert_array_equal(exported.last_step[o1], again.last_step[o2])
    assert len(a.export_vshards(moving)["user"]) == 0
    # the moved ids keep training on b exactly as they would have on a
    g = np.ones((len(again), DIM), np.float32)
    ref = make_store(cfg, V=V)
    ref.import_rows("user", exported)
    ref.push("user", exported.ids, g)
    b.push("user", exported.ids, g)
    np.testing.assert_array_equal(b.pull("user", exported.ids), ref.pull("user", exported.ids))
    # the rest stayed on a, and a's map no longer knows the moved ids
    assert (a.tables["user"].lookup_rows(exported.ids) == -1).all()


def test_import_bad_rows_leave_table_unchanged() -> None:
    s = make_store()
    s.push("user", ids(1, 2), np.ones((2, DIM), np.float32))
    before = snapshot(s)
    good = s.export_vshards(range(16))["user"]
    bad_state = TableRows(good.ids, good.weights, {"m": good.state["momentum"]}, good.freq, good.last_step)
    with pytest.raises(BadRequest, match=r"optimizer state keys \['m'\] do not match rowwise_adagrad state \['momentum'\]"):
        s.import_rows("user", bad_state)
    with pytest.raises(BadRequest, match=r"rows.weights must be float32 \(2, 8\)"):
        s.import_rows("user", TableRows(good.ids, good.weights[:, :4].copy(), good.state, good.freq, good.last_step))
    with pytest.raises(BadRequest, match="duplicates"):
        s.import_rows("user", TableRows(ids(1, 1), good.weights, good.state, good.freq, good.last_step))
    full = make_store(TableConfig(name="user", dim=DIM, capacity=1, eviction=EvictionConfig(policy=EvictionPolicy.NONE)))
    full.push("user", ids(9), np.ones((1, DIM), np.float32))
    with pytest.raises(BadRequest, match="exceeds capacity 1"):
        full.import_rows("user", good)
    with pytest.raises(BadRequest, match="eviction policy is 'none'"):
        full.import_rows("user", good.take(np.array([0])))
    assert snapshot(s) == before


def test_changed_rows_and_removed_ids_by_version() -> None:
    s = make_store(TableConfig(name="user", dim=DIM, capacity=4, eviction=EvictionConfig(evict_fraction=0.25)))
    g = np.ones((2, DIM), np.float32)
    s.push("user", ids(1, 2), g)
    assert sorted(s.changed_rows("user", 0).ids.tolist()) == [1, 2]
    cut1 = s.bump_version()
    assert cut1 == 1 and s.version == 2
    assert len(s.changed_rows("user", cut1)) == 0
    s.push("user", ids(2, 3), g)
    assert sorted(s.changed_rows("user", cut1).ids.tolist()) == [2, 3]
    cut2 = s.bump_version()
    s.push("user", ids(1, 2, 3), np.ones((3, DIM), np.float32))  # 1, 2, 3 more frequent than 4
    s.push("user", ids(4), g[:1])
    s.push("user", ids(5), g[:1])  # full: LFU evicts id 4
    assert s.removed_ids("user", cut2).tolist() == [4]
    assert s.removed_ids("user", s.bump_version()).tolist() == []
    changed = s.changed_rows("user", cut2)
    assert sorted(changed.ids.tolist()) == [1, 2, 3, 5]


def test_concurrent_pushes_from_threads_lose_nothing() -> None:
    s = make_store(TableConfig(name="user", dim=DIM, capacity=256, optimizer=OptimizerConfig(kind=OptimizerKind.SGD, lr=1.0),
                               init="zeros"))
    n_threads, n_pushes = 4, 25
    all_ids = np.arange(50, dtype=np.int64)

    def worker() -> None:
        for _ in range(n_pushes):
            s.push("user", all_ids, np.ones((50, DIM), np.float32))
            s.pull("user", all_ids)

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(s.pull("user", all_ids), np.full((50, DIM), -float(n_threads * n_pushes), np.float32))


def test_write_lock_blocks_pushes() -> None:
    s = make_store()
    done = threading.Event()

    def pusher() -> None:
        s.push("user", ids(1), np.ones((1, DIM), np.float32))
        done.set()

    with s.write_lock():
        th = threading.Thread(target=pusher)
        th.start()
        assert not done.wait(0.2)
        assert s.tables["user"].size == 0
    th.join(5)
    assert done.is_set() and s.tables["user"].size == 1


def test_stats_and_memory() -> None:
    s = make_store(TableConfig(name="user", dim=DIM, capacity=1000), TableConfig(name="item", dim=16, capacity=10))
    s.push("user", ids(1, 2), np.ones((2, DIM), np.float32))
    s.pull("user", ids(1, 5))
    st = s.stats()["tables"]["user"]
    assert (st["rows"], st["capacity"], st["admissions"], st["pushes"], st["pulls"], st["pull_ids"]) == (2, 1000, 2, 1, 1, 2)
    assert st["fill"] == pytest.approx(0.002)
    t = s.tables["user"]
    assert t.raw_bytes_per_row() == DIM * 4 + 4
    # rows + state + map + metadata: a known, bounded overhead per row of capacity
    assert s.memory_bytes() >= 1000 * (DIM * 4 + 4) + 10 * (16 * 4 + 4)
    assert t.memory_bytes() <= 1000 * (t.raw_bytes_per_row() + 48) + 512


SGD = OptimizerConfig(kind=OptimizerKind.SGD, lr=0.5)


def _resident(s: ShardStore, table: str = "user") -> list[int]:
    return sorted(s.all_rows(table).ids.tolist())


def test_admission_and_eviction_through_store() -> None:
    """min_count admission, then LFU eviction of the least pushed row when the table is full;
    the evicted id reads as its initial row again and comes back as a fresh row, counted."""
    cfg = TableConfig(name="user", dim=DIM, capacity=8, optimizer=SGD, admission=AdmissionConfig(min_count=2),
                      eviction=EvictionConfig(policy=EvictionPolicy.LFU, evict_fraction=0.01))
    s = make_store(cfg)
    init = make_store(cfg).pull("user", ids(*range(1, 10)))  # initial rows: a pure function of (table, id, seed)
    one = lambda *xs: np.ones((len(xs), DIM), np.float32)  # noqa: E731
    assert s.push("user", ids(1), one(1)).unadmitted_dropped == 1
    np.testing.assert_array_equal(s.pull("user", ids(1)), init[:1])  # dropped gradient: row untouched
    assert s.push("user", ids(1), one(1)).admitted == 1
    s.push("user", ids(*range(2, 9)), one(*range(2, 9)))  # first sighting of 2..8: dropped
    res = s.push("user", ids(*range(2, 9)), one(*range(2, 9)))
    assert (res.admitted, res.evicted) == (7, 0)
    assert _resident(s) == list(range(1, 9))  # full
    for _ in range(3):  # ids 1..7 pushed 4 times in all, id 8 once: the least frequent
        s.push("user", ids(*range(1, 8)), one(*range(1, 8)))
    before = s.pull("user", ids(*range(1, 8)))

    s.push("user", ids(9), one(9))  # first sighting: dropped, nothing evicted
    res = s.push("user", ids(9), one(9))
    assert (res.admitted, res.evicted) == (1, 1)
    assert _resident(s) == [1, 2, 3, 4, 5, 6, 7, 9]  # LFU: id 8 went
    assert s.stats()["tables"]["user"]["evictions"] == 1
    np.testing.assert_array_equal(s.pull("user", ids(*range(1, 8))), before)  # the others kept their rows
    np.testing.assert_array_equal(s.pull("user", ids(8)), init[7:8])  # reads as a fresh row again
    np.testing.assert_allclose(s.pull("user", ids(9)), init[8:9] - 0.5, rtol=1e-6)

    # id 8 was sighted twice already, so it is admitted at once; its row restarts from the
    # initial value (one SGD step), not from its trained value; the least pushed row, 9, goes
    res = s.push("user", ids(8), one(8))
    assert (res.admitted, res.evicted) == (1, 1)
    assert _resident(s) == list(range(1, 9))
    np.testing.assert_allclose(s.pull("user", ids(8)), init[7:8] - 0.5, rtol=1e-6)
    assert s.stats()["tables"]["user"]["evictions"] == 2


def test_ttl_eviction_through_store() -> None:
    """TTL: a full table evicts the rows idle for more than ttl_steps table steps, oldest first."""
    cfg = TableConfig(name="user", dim=DIM, capacity=4, optimizer=SGD,
                      eviction=EvictionConfig(policy=EvictionPolicy.TTL, ttl_steps=2, evict_fraction=0.01))
    s = make_store(cfg)
    init = make_store(cfg).pull("user", ids(1, 2, 3, 4, 5, 6))
    one = np.ones((1, DIM), np.float32)
    for i in (1, 2, 3, 4, 1, 2):  # table steps 1..6: last touch 1 -> 5, 2 -> 6, 3 -> 3, 4 -> 4
        s.push("user", ids(i), one)
    res = s.push("user", ids(5), one)  # step 7: idle 3 -> 4, 4 -> 3, 1 -> 2, 2 -> 1; > 2 expired: 3, 4
    assert (res.admitted, res.evicted) == (1, 1)
    assert _resident(s) == [1, 2, 4, 5]  # the oldest expired row, 3
    res = s.push("user", ids(6), one)  # step 8: expired 4 (idle 4) and 1 (idle 3): 4 is older
    assert (res.admitted, res.evicted) == (1, 1)
    assert _resident(s) == [1, 2, 5, 6]
    assert s.stats()["tables"]["user"]["evictions"] == 2
    np.testing.assert_allclose(s.pull("user", ids(1, 2)), init[:2] - 1.0, rtol=1e-6)  # two pushes each, kept
    np.testing.assert_array_equal(s.pull("user", ids(3, 4)), init[2:4])  # evicted: fresh again
    res = s.push("user", ids(3), one)  # back as a fresh row; step 9: 1 (idle 4) is the oldest expired
    assert (res.admitted, res.evicted) == (1, 1)
    assert _resident(s) == [2, 3, 5, 6]
    np.testing.assert_allclose(s.pull("user", ids(3)), init[2:3] - 0.5, rtol=1e-6)


@pytest.mark.filterwarnings("error")
def test_read_only_request_buffers_are_accepted() -> None:
    s = make_store()
    raw_ids = ids(4, 5, 4).tobytes()
    raw_g = np.ones((3, DIM), np.float32).tobytes()
    ro_ids = np.frombuffer(raw_ids, dtype=np.int64)
    ro_g = np.frombuffer(raw_g, dtype=np.float32).reshape(3, DIM)
    assert not ro_ids.flags.writeable
    assert s.push("user", ro_ids, ro_g).applied == 2
    assert s.pull("user", ro_ids).shape == (3, DIM)
