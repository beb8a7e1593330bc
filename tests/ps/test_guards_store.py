"""Guards of the grouped store that no other test caught (issue 37 item 9).

Each test below was written against a bug planted by hand in ``ps/table_group.py`` (one
at a time); the rest of the store's tests passed with each of them:

* the trusted in-process push (``ShardStore.push_group``, what ``workers.row_source``
  calls) skipping the NaN/Inf check: a NaN gradient then reaches the optimizer and
  is dropped with a warning as an "update that would be NaN/Inf" instead of being
  refused under ``nonfinite_grads = "reject"`` (or counted as ``nonfinite_dropped``
  under "drop");
* the multi-table lookup under ``[ps] intra_op_threads > 1`` not advancing its
  offset: every table after the first looked up the first table's ids;
* the batched insertion (``TableGroup._alloc_many``) resetting the optimizer state
  of wrong rows (local rows instead of storage rows): invisible at step 0 (every
  state is zero) or for the group's first table (base 0), so the tests here insert
  into a later table, at a later step, into rows freed earlier (stale state).

The reference is each table standing alone (its own storage), pushed table by table.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
import torch

from ps import intra_op
from ps.config import InitKind, NonfiniteMode, OptimizerConfig, OptimizerKind, TableConfig
from ps.embedding_table import EmbeddingTable
from ps.errors import BadRequest
from ps.shard_store import ShardStore

torch.set_num_threads(1)
DIM = 8


def _cfgs(kind: OptimizerKind, capacity: int = 64) -> list[TableConfig]:
    opt = OptimizerConfig(kind=kind, lr=0.05)
    init = {"init": InitKind.ZEROS} if kind == OptimizerKind.FTRL else {}  # FTRL: w = 0 at the start
    return [TableConfig(name=n, dim=DIM, capacity=capacity, optimizer=opt, **init) for n in ("a", "b", "c")]  # type: ignore[arg-type]


def _state(t: EmbeddingTable) -> dict[str, np.ndarray]:
    """A table's rows by id: weights, optimizer state, metadata, and which row holds which id."""
    used = t.used_rows()
    rows = t.export_rows(used)
    order = np.argsort(rows.ids)
    out = {"ids": rows.ids[order], "weights": rows.weights[order], "freq": rows.freq[order],
           "last_step": rows.last_step[order], "version": t.row_version[used][order], "layout": t.row_ids.copy()}
    out.update({f"state/{k}": v[order] for k, v in rows.state.items()})
    return out


def _assert_same(store: ShardStore, ref: dict[str, EmbeddingTable]) -> None:
    for name, r in ref.items():
        t = store.tables[name]
        got, want = _state(t), _state(r)
        assert sorted(got) == sorted(want), name
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"table {name}: {k}")
        assert t.counters == r.counters, name
        assert (t.step, t.size) == (r.step, r.size), name


def _flat(items: list[tuple[str, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    counts = np.array([ids.size for _, ids, _ in items], dtype=np.int64)
    ids = torch.from_numpy(np.concatenate([ids for _, ids, _ in items]))
    g = torch.from_numpy(np.concatenate([g for _, _, g in items]))
    return counts, ids, g


def _grads(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, DIM)).astype(np.float32)


# -- the trusted push checks finiteness ---------------------------------------------------------
@pytest.mark.parametrize("bad_value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("kind", [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM], ids=lambda k: k.value)
def test_trusted_group_push_refuses_a_nonfinite_gradient_and_changes_nothing(
        kind: OptimizerKind, bad_value: float) -> None:
    """The in-process worker's push (``push_group``, trusted) under "reject": a NaN/Inf gradient is
    refused naming its table, and no table of the request changes (not one row silently dropped)."""
    cfgs = _cfgs(kind)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    gi = store.group_of(("a", "b", "c"))
    rng = np.random.default_rng(1)
    ids = np.arange(0, 20, 2, dtype=np.int64)
    warm = [(n, ids, _grads(rng, ids.size)) for n in ("a", "b", "c")]
    assert store.push_group(gi, *_flat(warm)) == [ref[n].push(i, g) for n, i, g in warm]
    new = np.arange(1, 30, 3, dtype=np.int64)  # known and new ids: the insertion must not run either
    items = [(n, np.union1d(ids[:4], new), _grads(rng, 4 + new.size)) for n in ("a", "b", "c")]
    items[1][2][5, 3] = bad_value
    counts, flat_ids, flat_g = _flat(items)
    with pytest.raises(BadRequest, match=r"table 'b'.*NaN/Inf.*push rejected"):
        store.push_group(gi, counts, flat_ids, flat_g)
    _assert_same(store, ref)  # 'a' (before 'b') and 'c' untouched too
    assert all(t.counters["update_nonfinite_dropped"] == 0 for t in store.tables.values())


@pytest.mark.parametrize("kind", [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM], ids=lambda k: k.value)
def test_trusted_group_push_under_drop_counts_the_nonfinite_gradients_as_its_tables_would(
        kind: OptimizerKind) -> None:
    """Under "drop" the NaN rows are dropped before the update and counted as ``nonfinite_dropped``
    (what each table's own push does), the other rows applied."""
    cfgs = _cfgs(kind)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3, nonfinite_grads="drop")
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    gi = store.group_of(("a", "b", "c"))
    rng = np.random.default_rng(2)
    for step in range(3):
        items = [(n, np.sort(rng.choice(40, size=12, replace=False)).astype(np.int64), _grads(rng, 12))
                 for n in ("a", "b", "c")]
        if step:
            items[0][2][3, 0] = np.nan
            items[2][2][7] = -np.inf
        got = store.push_group(gi, *_flat(items))
        assert got == [ref[n].push(i, g, NonfiniteMode.DROP) for n, i, g in items]
        if step:
            assert (got[0].nonfinite_dropped, got[2].nonfinite_dropped) == (1, 1)
            assert all(r.update_nonfinite_dropped == 0 for r in got)
        _assert_same(store, ref)


# -- the grouped lookup split over threads --------------------------------------------------------
@pytest.fixture
def two_threads() -> Iterator[None]:
    intra_op.set_threads(2)
    yield
    intra_op.set_threads(1)


N_SPLIT = intra_op.MIN_ROWS_PER_THREAD + 1000  # per table; a group request of 3 tables is split at 2 threads


def test_grouped_pull_and_push_split_over_threads_equal_table_by_table(two_threads: None) -> None:
    """``[ps] intra_op_threads = 2``: a pull and a push of three tables in one group request (large
    enough to be split) give each table its own rows and ids, as each table alone does."""
    cfgs = _cfgs(OptimizerKind.ROWWISE_ADAGRAD, capacity=2 * N_SPLIT)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    gi = store.group_of(("a", "b", "c"))
    rng = np.random.default_rng(4)
    # disjoint id ranges per table: a table reading another's ids finds none of its own
    first = {n: (np.arange(N_SPLIT, dtype=np.int64) * 3 + k * 10**7) for k, n in enumerate(("a", "b", "c"))}
    assert len(intra_op.spans(3 * N_SPLIT)) == 2
    for step in range(3):
        items = []
        for n, base in first.items():
            ids = np.sort(np.concatenate([base[step * 500:][: N_SPLIT - 300],  # known after step 0
                                          base[-1] + 1 + np.arange(300, dtype=np.int64) + step * 300]))  # new
            items.append((n, ids, _grads(rng, ids.size)))
        counts, flat_ids, flat_g = _flat(items)
        pulled = store.pull_group(gi, counts, flat_ids)
        for (n, ids, _), rows in zip(items, torch.split(pulled, counts.tolist())):
            np.testing.assert_array_equal(rows.numpy(), ref[n].pull(ids), err_msg=f"pull of table {n}, step {step}")
        assert store.push_group(gi, counts, flat_ids, flat_g) == [ref[n].push(i, g) for n, i, g in items]
        _assert_same(store, ref)
    # the pull-free path (a fresh lookup, not the pull's) and the wire's untrusted push, split too
    items = [(n, base[100:3100].copy(), _grads(rng, 3000)) for n, base in first.items()]
    counts, flat_ids, flat_g = _flat(items)
    assert len(intra_op.spans(int(counts.sum()))) == 2
    assert store.push_group(gi, counts, flat_ids, flat_g, trusted=False) == [ref[n].push(i, g) for n, i, g in items]
    _assert_same(store, ref)


# -- the batched insertion resets the new rows' optimizer state -----------------------------------
@pytest.mark.parametrize("kind", [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAGRAD, OptimizerKind.ADAM,
                                  OptimizerKind.FTRL], ids=lambda k: k.value)
@pytest.mark.parametrize("api", ["push_group", "push_many"])
def test_batched_insertion_at_a_later_step_resets_exactly_the_new_rows(kind: OptimizerKind, api: str) -> None:
    """New ids of several tables inserted together (one optimizer reset over the group's storage) at a
    later step, into tables past the first (base > 0), onto rows freed earlier that still hold an
    old id's optimizer state: exactly those rows start fresh, every other row keeps its state."""
    cfgs = _cfgs(kind, capacity=32)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    gi = store.group_of(("a", "b", "c"))
    assert [t.base for t in store.groups[gi].tables] == [0, 32, 64]
    rng = np.random.default_rng(6)
    inserted: list[int] = []

    def push(items: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        before = sum(t.counters["admissions"] for t in store.tables.values())
        want = [ref[n].push(i, g) for n, i, g in items]
        if api == "push_many":
            got = store.push_many(items)
        else:
            got = store.push_group(gi, *_flat(items))
            want = [w for w, (_, i, _) in zip(want, items) if i.size]
        assert got == want
        inserted.append(sum(t.counters["admissions"] for t in store.tables.values()) - before)
        _assert_same(store, ref)

    # step 1 and 2: every table fills 20 rows and their optimizer state moves off zero
    for _ in range(2):
        push([(n, np.arange(20, dtype=np.int64), _grads(rng, 20)) for n in ("a", "b", "c")])
    # rows freed (as a migration drops them): their optimizer state stays until they are reused
    for n in ("b", "c"):
        for t in (store.tables[n], ref[n]):
            assert t.drop_rows(t.lookup_rows(np.arange(4, 10, dtype=np.int64))) == 6
    _assert_same(store, ref)
    # step 3: new ids in b and c only (a, base 0, has none), known ids beside them
    push([("a", np.arange(20, dtype=np.int64), _grads(rng, 20)),
          ("b", np.arange(100, 110, dtype=np.int64), _grads(rng, 10)),
          ("c", np.concatenate([np.arange(10, 14), np.arange(200, 208)]).astype(np.int64), _grads(rng, 12))])
    # step 4: new ids in every table, again onto freed rows
    for n in ("b", "c"):
        for t in (store.tables[n], ref[n]):
            t.drop_rows(t.lookup_rows(np.arange(14, 18, dtype=np.int64)))
    push([(n, np.arange(300, 303, dtype=np.int64), _grads(rng, 3)) for n in ("a", "b", "c")])
    # the same ids pushed again: every new row's state started where a fresh table's does
    push([(n, np.concatenate([np.arange(100, 110), np.arange(200, 208), np.arange(300, 303)]).astype(np.int64),
           _grads(rng, 21)) for n in ("a", "b", "c")])
    assert inserted[2:4] == [10 + 8, 9], inserted  # the steps above did insert, several tables at once
