"""The fast insert path of new ids equals the plain per-step semantics.

The insert path (issue 15, point 2) computes initial rows as gathers from
constant tables and skips re-checks the push already did. These tests hold it
to a plain transcription, written here as the reference: the initializer's
formula evaluated on whole arrays (same values bit for bit), and the old
``_alloc`` (same rows, same ids admitted and evicted, same optimizer state and
bounds). The distribution properties of the initial values are tested in
tests/ps/test_initializer.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import pytest

from common.hashing import hash_strings, mix64
from ps.config import (
    AdmissionConfig,
    EvictionConfig,
    EvictionPolicy,
    InitKind,
    OptimizerConfig,
    OptimizerKind,
    TABLE_OPTIMIZERS,
    TableConfig,
)
from ps.embedding_table import EmbeddingTable, PushResult
from ps.admission import Admission
from ps.id_map import IdMap
from ps.initializer import RowInitializer, _normal_tables, _uniform_tables

torch.set_num_threads(1)


def ref_init(table: str, dim: int, kind: InitKind, scale: float, seed: int, ids: np.ndarray) -> np.ndarray:
    """The initializer's formula (ps/initializer.py docstring) on whole arrays, from its inputs only.

    ``key = mix64(id, mix64(fnv(table)) ^ seed)``; per 64 columns c, ``h = key`` (c = 0) or ``mix64(key + c)``,
    ``i1, i2, i3`` = its bits 0-15, 16-31, 32-47; normal ``(N1[i1] m + N2[i2] m) + N3[i3] m``, m = f32(scale / sqrt 3),
    uniform ``((((U1[i1] + U2[i2] + U3[i3]) mod 2^32 >> 9) + 0.5) * 2^-22 - 1) * f32(scale)``.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if kind == InitKind.ZEROS or scale == 0.0:
        return np.zeros((ids.size, dim), dtype=np.float32)
    salt = int(mix64(np.uint64(int(hash_strings(__import__("pyarrow").array([table]))[0])))) ^ (seed % 2**64)
    key = mix64(ids, salt=salt)
    chunks = []
    for c in range((dim + 63) // 64):
        w = min(64, dim - 64 * c)
        with np.errstate(over="ignore"):
            h = mix64(key + np.uint64(c)) if c > 0 else key
        i1 = (h % np.uint64(1 << 16)).astype(np.int64)
        i2 = ((h // np.uint64(1 << 16)) % np.uint64(1 << 16)).astype(np.int64)
        i3 = ((h // np.uint64(1 << 32)) % np.uint64(1 << 16)).astype(np.int64)
        if kind == InitKind.NORMAL:
            m = np.float32(scale / math.sqrt(3.0))
            n1, n2, n3 = _normal_tables()
            v = (n1[i1, :w] * m + n2[i2, :w] * m) + n3[i3, :w] * m
        else:
            u1, u2, u3 = _uniform_tables()
            s = (u1[i1, :w].astype(np.uint64) + u2[i2, :w] + u3[i3, :w]) % np.uint64(1 << 32)
            k = (s // np.uint64(512)).astype(np.float32)
            v = ((k + np.float32(0.5)) * np.float32(2.0**-22) - np.float32(1.0)) * np.float32(scale)
        chunks.append(v.astype(np.float32))
    return np.concatenate(chunks, axis=1) if chunks else np.zeros((ids.size, 0), np.float32)


def ref_rows(init: RowInitializer, ids: np.ndarray) -> np.ndarray:
    """Reference initial rows of ``init``'s table (the transcription above)."""
    return ref_init(init.table, init.dim, init.kind, init.scale, init.seed, ids)


class OldAllocTable(EmbeddingTable):
    """EmbeddingTable with the old insertion stage (torch masks, admission called even when
    immediate) and the old ``_alloc``: reference initializer, scatters, checked map insert,
    rows_written."""

    def insert_new(
        self, uniq: torch.Tensor, rows: torch.Tensor, res: PushResult, new_pos_np: np.ndarray | None = None
    ) -> None:
        # (a push of unique ids passes their unknown positions in id order: the old order)
        new_pos = torch.nonzero(rows < 0).reshape(-1) if new_pos_np is None else torch.from_numpy(new_pos_np)
        if new_pos.numel():
            new_ids = uniq[new_pos].numpy()
            admitted = self.admission.observe(new_ids)
            res.unadmitted_dropped = int((~admitted).sum())
            adm_pos = new_pos[torch.from_numpy(admitted)]
            k = int(adm_pos.numel())
            if k > self._n_free:
                existing = rows[rows >= 0].numpy()
                res.evicted = self._evict(k - self._n_free, protect=existing)
            take = min(k, self._n_free)
            res.full_dropped = k - take
            if take:
                got_pos = adm_pos[:take]
                new_rows = self._alloc(uniq[got_pos].numpy())
                rows[got_pos] = torch.from_numpy(new_rows)
            res.admitted = take
            self.counters["unadmitted_dropped"] += res.unadmitted_dropped
            self.counters["full_dropped"] += res.full_dropped
            self.counters["admissions"] += take

    def _alloc(self, ids: np.ndarray, init_values: bool = True) -> np.ndarray:
        k = ids.shape[0]
        rows = self._free[self._n_free - k : self._n_free][::-1].astype(np.int64)
        self._n_free -= k
        rows_t = torch.from_numpy(rows)
        if init_values:
            self.weights[rows_t] = torch.from_numpy(ref_rows(self.init, ids))
            self.optimizer.reset_rows(rows_t)
            self.optimizer.rows_written(rows_t)
        self.row_ids[rows] = ids
        self.freq[rows] = 0
        self.last_step[rows] = self.step
        self.row_version[rows] = self.current_version
        self.id_map.insert(ids, rows_t)
        return rows


@pytest.mark.parametrize("kind", [InitKind.NORMAL, InitKind.UNIFORM])
@pytest.mark.parametrize("dim", [1, 3, 64, 65, 300, 20000])
def test_initial_rows_bit_identical_to_formula(kind: InitKind, dim: int) -> None:
    rng = np.random.default_rng(dim)
    extremes = np.array([0, 1, -2, 2**63 - 1, -(2**63), 12345], dtype=np.int64)
    ids = np.concatenate([extremes, rng.integers(-(2**63), 2**63 - 1, size=max(8, 200_000 // dim), dtype=np.int64)])
    for seed, scale in ((0, 0.01), (2**40 + 3, 1.7)):
        init = RowInitializer("user", dim, kind, scale, seed)
        got, want = init(ids), ref_rows(init, ids)
        assert got.dtype == np.float32 and got.shape == (ids.size, dim)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{kind} dim {dim} seed {seed}"
        assert np.array_equal(init(ids[:1]).view(np.uint32), want[:1].view(np.uint32))  # a batch of one row: same row


def _stream_tables(opt: OptimizerKind, **kw) -> tuple[EmbeddingTable, EmbeddingTable]:
    cfg = TableConfig(
        name="t",
        dim=8,
        capacity=300,
        optimizer=OptimizerConfig(kind=opt, lr=0.05),
        init=InitKind.ZEROS if opt == OptimizerKind.FTRL else InitKind.NORMAL,
        **kw,
    )
    return EmbeddingTable(cfg, seed=5), OldAllocTable(cfg, seed=5)


@pytest.mark.parametrize("opt", TABLE_OPTIMIZERS)  # every kind a table takes (adamw is dense-only)
def test_stream_of_new_ids_matches_old_insert_path(opt: OptimizerKind) -> None:
    """Admission (min_count 2), LFU eviction beyond capacity, repeats and new ids mixed."""
    new, old = _stream_tables(
        opt,
        admission=AdmissionConfig(min_count=2),
        eviction=EvictionConfig(policy=EvictionPolicy.LFU, evict_fraction=0.1),
    )
    rng = np.random.default_rng(0)
    for step in range(40):
        ids = np.concatenate([rng.integers(0, 200, 60), rng.integers(step * 50, step * 50 + 120, 80)])
        g = rng.normal(size=(ids.size, 8)).astype(np.float32)
        r_new, r_old = new.push(ids, g), old.push(ids, g)
        assert r_new == r_old, f"step {step}"
    assert new.counters == old.counters
    assert new.counters["evictions"] > 0 and new.counters["unadmitted_dropped"] > 0  # both paths exercised
    np.testing.assert_array_equal(new.row_ids, old.row_ids)
    np.testing.assert_array_equal(new.freq, old.freq)
    np.testing.assert_array_equal(new.last_step, old.last_step)
    np.testing.assert_array_equal(new.row_version, old.row_version)
    assert torch.equal(new.weights, old.weights)
    for k, t in new.optimizer.state_tensors().items():
        assert torch.equal(t, old.optimizer.state_tensors()[k]), k
    for attr in ("bound_w", "bound_m"):
        assert getattr(new.optimizer, attr, None) == getattr(old.optimizer, attr, None), attr
    assert new.id_map.size == old.id_map.size == new.size
    ids_n, rows_n = new.id_map.items()
    ids_o, rows_o = old.id_map.items()
    assert dict(zip(ids_n.tolist(), rows_n.tolist())) == dict(zip(ids_o.tolist(), rows_o.tolist()))
    probe = np.arange(0, 2200, dtype=np.int64)  # known, evicted and never-seen ids
    np.testing.assert_array_equal(new.pull(probe), old.pull(probe))


@pytest.mark.parametrize(
    "admission, policy",
    [(AdmissionConfig(), EvictionPolicy.LFU), (AdmissionConfig(min_count=2), EvictionPolicy.NONE),
     (AdmissionConfig(), EvictionPolicy.NONE)],
    ids=["immediate-lfu", "mincount-none", "immediate-none"],
)
def test_all_new_pushes_past_capacity_match_old_insert_path(admission: AdmissionConfig, policy: EvictionPolicy) -> None:
    """Pushes of only new ids beyond capacity: immediate admission (no sketch), eviction or
    ``full_dropped`` (policy none: some admitted ids get no row), same results as the old path."""
    new, old = _stream_tables(
        OptimizerKind.ROWWISE_ADAGRAD, admission=admission, eviction=EvictionConfig(policy=policy, evict_fraction=0.1)
    )
    rng = np.random.default_rng(6)
    for step in range(12):
        ids = np.concatenate([rng.integers(step * 60, step * 60 + 140, 120), rng.integers(0, 50, 10 * (step % 2))])
        g = rng.normal(size=(ids.size, 8)).astype(np.float32)
        assert new.push(ids, g) == old.push(ids, g), f"step {step}"
    assert new.counters == old.counters
    dropped = new.counters["evictions"] if policy == EvictionPolicy.LFU else new.counters["full_dropped"]
    assert dropped > 0 and new.size == 300
    assert torch.equal(new.weights, old.weights)
    np.testing.assert_array_equal(new.row_ids, old.row_ids)
    np.testing.assert_array_equal(new.row_version, old.row_version)
    probe = np.arange(0, 1200, dtype=np.int64)
    np.testing.assert_array_equal(new.lookup_rows(probe), old.lookup_rows(probe))
    np.testing.assert_array_equal(new.pull(probe), old.pull(probe))


def test_fill_from_empty_matches_old_insert_path() -> None:
    """All-new pushes (the fill of a table), rowwise adagrad: same rows and bounds."""
    new, old = _stream_tables(OptimizerKind.ROWWISE_ADAGRAD)
    rng = np.random.default_rng(1)
    ids = rng.permutation(300).astype(np.int64) * 1_000_003 - 7
    for lo in range(0, 300, 64):
        part = ids[lo : lo + 64]
        g = rng.normal(size=(part.size, 8)).astype(np.float32)
        assert new.push(part, g) == old.push(part, g)
    assert new.size == old.size == 300
    assert torch.equal(new.weights, old.weights)
    assert new.optimizer.bound_w == old.optimizer.bound_w and new.optimizer.bound_m == old.optimizer.bound_m
    np.testing.assert_array_equal(new.lookup_rows(ids), old.lookup_rows(ids))


def test_id_map_known_new_insert_equals_checked_insert() -> None:
    a, b = IdMap(1000), IdMap(1000)
    rng = np.random.default_rng(2)
    ids = rng.choice(10**9, size=900, replace=False).astype(np.int64)
    rows = rng.permutation(900).astype(np.int64)
    for lo in range(0, 900, 100):
        a.insert(ids[lo : lo + 100], rows[lo : lo + 100], known_new=True)
        b.insert(ids[lo : lo + 100], rows[lo : lo + 100])
    assert a.size == b.size == 900
    probe = np.concatenate([ids, np.arange(50, dtype=np.int64)])
    assert torch.equal(a.lookup(probe), b.lookup(probe))
    with pytest.raises(ValueError, match="exceed capacity"):
        a.insert(np.arange(10**10, 10**10 + 101, dtype=np.int64), np.arange(101, dtype=np.int64), known_new=True)
    assert a.size == 900


@pytest.mark.parametrize("opt", [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAGRAD, OptimizerKind.SGD])
def test_import_bounds_match_rows_written(opt: OptimizerKind) -> None:
    """Imports bound the fused kinds' magnitudes from the imported values, as re-reading the rows did."""
    new, old = _stream_tables(opt)
    rng = np.random.default_rng(3)
    ids = rng.choice(10**9, size=200, replace=False).astype(np.int64)
    rows = new.export_rows(np.empty(0, np.int64))
    spec = new.optimizer.state_spec(8)
    state = {k: (np.abs(rng.normal(size=(200, *shape))) * 50).astype(dt) for k, (shape, dt) in spec.items()}
    rows = type(rows)(ids=ids, weights=(rng.normal(size=(200, 8)) * 30).astype(np.float32), state=state)
    new.import_rows(rows)
    old.import_rows(rows)
    r = torch.from_numpy(old.lookup_rows(ids))
    old.optimizer.bound_w = old.optimizer.bound_m = 0.0
    old.optimizer.rows_written(r)  # the old hook: re-read the stored rows
    assert new.optimizer.bound_w == old.optimizer.bound_w == float(np.abs(rows.weights).max())
    if spec:
        assert new.optimizer.bound_m == old.optimizer.bound_m == float(np.abs(state["momentum"]).max())
    dup = type(rows)(ids=np.array([5, 6, 5], np.int64), weights=np.zeros((3, 8), np.float32),
                     state={k: np.zeros((3, *shape), dt) for k, (shape, dt) in spec.items()})
    with pytest.raises(Exception, match="duplicates"):
        new.import_rows(dup)


def test_big_table_on_hugepages_behaves_like_4k_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table past hugepages.MIN_BYTES gets fresh 2 MiB-aligned storage; pushes and pulls are unchanged."""
    from ps import hugepages

    monkeypatch.setattr(hugepages, "MIN_BYTES", 1 << 19)  # small test table: weights 9 MB, momentum 560 KB, map 3.4 MB
    cfg = TableConfig(name="t", dim=16, capacity=140_000, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD))
    huge = EmbeddingTable(cfg, seed=1)
    monkeypatch.setattr(hugepages, "ENABLED", False)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 1 << 40)
    plain = EmbeddingTable(cfg, seed=1)
    assert huge.weights.data_ptr() % hugepages.HUGE == 0
    assert huge.weights.data_ptr() == huge.tbe.weights_host.data_ptr()
    assert huge.optimizer.state_tensors()["momentum"].data_ptr() == huge.tbe.momentum1_host.data_ptr()
    assert huge.id_map._table.data_ptr() % hugepages.HUGE == 0 and (huge.row_ids == -1).all()
    rng = np.random.default_rng(4)
    for _ in range(5):
        ids = rng.integers(0, 60_000, 3000).astype(np.int64)
        g = rng.normal(size=(3000, 16)).astype(np.float32)
        assert huge.push(ids, g) == plain.push(ids, g)
    probe = np.arange(60_000, dtype=np.int64)
    np.testing.assert_array_equal(huge.pull(probe), plain.pull(probe))
    r = torch.from_numpy(huge.lookup_rows(probe[huge.lookup_rows(probe) >= 0]))
    assert torch.equal(huge.optimizer.state_tensors()["momentum"][r], plain.optimizer.state_tensors()["momentum"][r])


def _ref_observe(adm: Admission, cells: np.ndarray, sightings: list[int], ids: np.ndarray) -> np.ndarray:
    """One push's sightings, one id at a time: est = min over the id's cells before the push,
    + 1; every cell hit becomes the max of itself and the est of each id hitting it; admitted
    when est >= min_count; cells halved every 10 x width sightings."""
    w = adm.width
    before = cells.copy()
    est = []
    for x in ids.tolist():
        h = int(mix64(np.array([x], dtype=np.int64), salt=0x243F6A8885A308D3)[0])
        a, b = h & 0xFFFFFFFF, (h >> 32) | 1
        cols = [(((a + d * b) & 0xFFFFFFFF) * w) >> 32 for d in range(4)]
        e = min(int(before[d, c]) for d, c in enumerate(cols)) + 1
        for d, c in enumerate(cols):
            cells[d, c] = max(int(cells[d, c]), e)
        est.append(e)
    sightings[0] += len(ids)
    if sightings[0] >= 10 * w:
        cells >>= 1
        sightings[0] = 0
        sightings[1] += 1
    return np.array(est) >= adm.cfg.min_count


def test_admission_batch_update_equals_per_id_reference() -> None:
    """Many ids per cell (width 1024, 3000 ids per push), repeats across pushes, aging."""
    adm = Admission(AdmissionConfig(min_count=3), capacity=10, seed=0)
    assert adm.width == 1024
    cells = np.zeros((4, 1024), np.int32)
    sightings = [0, 0]  # since the last aging, agings
    rng = np.random.default_rng(7)
    admitted_total = 0
    for step in range(6):
        ids = np.unique(rng.integers(0, 6000, 3000)).astype(np.int64)
        got = adm.observe(ids)
        want = _ref_observe(adm, cells, sightings, ids)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        np.testing.assert_array_equal(adm.state()["cells"], cells, err_msg=f"step {step}")
        admitted_total += int(got.sum())
    assert admitted_total > 0 and sightings[1] == 1  # both paths: admitted some, aged once


def test_admission_never_undercounts_and_spreads_cells() -> None:
    adm = Admission(AdmissionConfig(min_count=1000), capacity=5000, seed=1)
    rng = np.random.default_rng(8)
    true = np.zeros(20000, np.int64)
    for _ in range(8):  # 8 x ~6K sightings < 10 x width: no aging
        ids = np.unique(rng.integers(0, 20000, 7000)).astype(np.int64)
        adm.observe(ids)
        true[ids] += 1
    assert (adm.count(np.arange(20000, dtype=np.int64)) >= true).all()
    flat = adm._flat_cells(np.arange(100_000, dtype=np.int64))
    rows, cols = np.divmod(flat, adm.width)
    np.testing.assert_array_equal(rows, np.broadcast_to(np.arange(4)[:, None], rows.shape))  # one cell per row
    per_cell = np.bincount(cols[0], minlength=adm.width)
    assert per_cell.min() > 0 and per_cell.max() < 3 * 100_000 / adm.width  # ~uniform over the width
    assert np.mean(cols[0] == cols[1]) < 0.01  # the rows' cells are not the same column


def test_admission_probability_rule_is_deterministic() -> None:
    ids = np.arange(10_000, dtype=np.int64)
    a = Admission(AdmissionConfig(probability=0.3), capacity=1000, seed=4).observe(ids)
    b = Admission(AdmissionConfig(probability=0.3), capacity=1000, seed=4).observe(ids)
    c = Admission(AdmissionConfig(probability=0.3), capacity=1000, seed=5).observe(ids)
    np.testing.assert_array_equal(a, b)
    assert abs(a.mean() - 0.3) < 0.03 and (a != c).any()


def test_negative_ids_are_rows_like_any_other(tmp_path: Path) -> None:
    """Only id -1 is refused; a row holding a negative id is a used row: listed, counted as
    changed, evictable, checkpointed and restored (they used to be treated as free rows:
    invisible to saves and never evicted)."""
    from ps.checkpoint import load_shard
    from ps.shard_store import ShardStore
    from tests.ps.test_checkpoint import save_all

    cfg = TableConfig(name="user", dim=8, capacity=64,
                      eviction=EvictionConfig(policy=EvictionPolicy.LFU, evict_fraction=0.1))
    s = ShardStore([cfg], shard_id=0, num_vshards=16, seed=3)
    neg = -np.arange(2, 52, dtype=np.int64) * 1_000_003
    s.push("user", neg, np.ones((50, 8), np.float32))
    t = s.tables["user"]
    assert t.size == 50 and t.used_rows().size == 50
    assert len(s.all_rows("user")) == 50 and len(s.changed_rows("user", 0)) == 50
    assert s.dirty_count("user", 0) == 50 and int(s.vshard_row_counts()["user"].sum()) == 50
    restored = ShardStore([cfg], shard_id=0, num_vshards=16, seed=3)
    load_shard(restored, save_all([s], tmp_path, 1), range(16))
    np.testing.assert_array_equal(restored.pull("user", neg), s.pull("user", neg))
    assert (restored.tables["user"].lookup_rows(neg) >= 0).all()
    more = -np.arange(60, 100, dtype=np.int64)  # past capacity: rows holding negative ids are evicted
    r = s.push("user", more, np.ones((40, 8), np.float32))
    assert r.evicted > 0 and r.full_dropped == 0 and r.admitted == 40
