"""A group push / pull of many tables leaves every table as its own push / pull would.

The reference is today's path: each table standing alone (its own storage) and
``EmbeddingTable.push`` / ``pull`` called table by table with the same ids and
gradients. The grouped store (``ShardStore.push_many`` / ``push_group``: one
lookup, one update over one shared storage) must end with the same weights,
optimizer state, row metadata, counters and push results, for every optimizer
kind, while tables fill, admit late, evict, clip, screen updates, and see
repeated ids (untrusted wire requests) and NaN/Inf gradients.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ps.config import (
    AdmissionConfig, EvictionConfig, EvictionPolicy, InitKind, NonfiniteMode, OptimizerConfig, OptimizerKind,
    TableConfig,
)
from ps.embedding_table import EmbeddingTable
from ps.errors import BadRequest
from ps.grouping import group_tables
from ps.shard_store import ShardStore

torch.set_num_threads(1)
DIM = 8
KINDS = [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAGRAD, OptimizerKind.SGD, OptimizerKind.ADAM,
         OptimizerKind.FTRL]


def _cfgs(kind: OptimizerKind, **kw: object) -> list[TableConfig]:
    opt = OptimizerConfig(kind=kind, lr=0.05, weight_decay=0.01 if kind == OptimizerKind.ADAM else 0.0)
    init = {"init": InitKind.ZEROS} if kind == OptimizerKind.FTRL else {}
    base = dict(dim=DIM, optimizer=opt, **init, **kw)
    return [
        TableConfig(name="a", capacity=64, **base),  # type: ignore[arg-type]
        TableConfig(name="b", capacity=40, admission=AdmissionConfig(min_count=2), **base),  # type: ignore[arg-type]
        TableConfig(name="c", capacity=30, eviction=EvictionConfig(policy=EvictionPolicy.TTL, ttl_steps=2),  # type: ignore[arg-type]
                    **base),
    ]


def _state(t: EmbeddingTable) -> dict[str, np.ndarray]:
    used = t.used_rows()
    rows = t.export_rows(used)
    order = np.argsort(rows.ids)
    out = {"ids": rows.ids[order], "weights": rows.weights[order], "freq": rows.freq[order],
           "last_step": rows.last_step[order], "version": t.row_version[used][order],
           "layout": t.row_ids.copy()}  # which row holds which id: the same placement as alone
    out.update({f"state/{k}": v[order] for k, v in rows.state.items()})
    return out


def _assert_same(store: ShardStore, ref: dict[str, EmbeddingTable]) -> None:
    for name, r in ref.items():
        t = store.tables[name]
        sa, sb = _state(t), _state(r)
        for k in sb:
            np.testing.assert_array_equal(sa[k], sb[k], err_msg=f"{name}: {k}")
        assert t.counters == r.counters, name
        assert (t.step, t.size) == (r.step, r.size), name


def _steps(rng: np.random.Generator, n_steps: int, tables: list[str], unique: bool = True):
    """Random pushes; ``unique=False``: every other step repeats ids, the others are unique but unsorted."""
    for step in range(n_steps):
        items = []
        for name in tables:
            n = int(rng.integers(0, 40))
            if unique:
                ids = np.sort(rng.choice(150, size=n, replace=False)).astype(np.int64)
            elif step % 2:
                ids = rng.choice(150, size=n, replace=False).astype(np.int64)
            else:
                ids = rng.integers(0, 150, size=n).astype(np.int64)
            g = (rng.standard_normal((n, DIM)) * rng.choice([0.1, 1.0, 30.0])).astype(np.float32)
            items.append((name, ids, g))
        yield items


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("api", ["push_many", "push_group"])
def test_group_push_equals_table_by_table(kind: OptimizerKind, api: str) -> None:
    cfgs = _cfgs(kind, grad_clip_norm=5.0)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    assert len(store.groups) == 1 and store.groups[0].names == ("a", "b", "c")
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    rng = np.random.default_rng(7)
    gi = store.group_of(("a", "b", "c"))
    for items in _steps(rng, 25, ["a", "b", "c"]):
        want = [ref[t].push(ids, g) for t, ids, g in items]
        if api == "push_many":
            got = store.push_many(items)
        else:
            counts = np.array([ids.size for _, ids, _ in items], dtype=np.int64)
            flat_ids = torch.from_numpy(np.concatenate([ids for _, ids, _ in items]))
            flat_g = torch.from_numpy(np.concatenate([g for _, _, g in items]))
            got = store.push_group(gi, counts, flat_ids, flat_g)
            want = [w for w, (_, ids, _) in zip(want, items) if ids.size]  # absent tables: no result
        assert got == want
        _assert_same(store, ref)
    # something happened on every path: late admission, eviction, clipping
    total = {k: sum(t.counters[k] for t in ref.values()) for k in ("unadmitted_dropped", "evictions", "grad_clipped")}
    assert all(v > 0 for v in total.values()), total


@pytest.mark.parametrize("kind", [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM], ids=lambda k: k.value)
@pytest.mark.parametrize("between", [False, True], ids=["pull-push", "pull-other-push"])
def test_push_reuses_its_pulls_lookup_only_while_the_maps_are_unchanged(
        kind: OptimizerKind, between: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet step pulls a batch then pushes its gradients: the push reuses the pull's lookup (one
    hash-map lookup per group per step). Another push in between (new ids inserted, rows evicted,
    ids admitted late; table by table, so only the maps' generation tells) changes the maps: the
    push looks up again. Either way every table ends as
    its own pushes and pulls leave it."""
    from ps.table_group import TableGroup

    lookups = [0]
    real = TableGroup.lookup

    def counted(self: TableGroup, counts: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
        lookups[0] += 1
        return real(self, counts, ids)

    monkeypatch.setattr(TableGroup, "lookup", counted)
    cfgs = _cfgs(kind)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    rng = np.random.default_rng(5)
    batches = list(_steps(rng, 30, ["a", "b", "c"]))
    reused = relooked = 0
    for k, items in enumerate(batches):
        items = [it for it in items if it[1].size]
        if not items:
            continue
        got_rows = store.pull_many([(t, ids) for t, ids, _ in items])
        for (t, ids, _), rows in zip(items, got_rows):
            np.testing.assert_array_equal(rows, ref[t].pull(ids))
        if between:  # another worker's push of other ids, table by table (it leaves the group's memo alone)
            for t, ids, g in batches[(k + 7) % len(batches)]:
                assert store.push(t, ids, g) == ref[t].push(ids, g)
        before = lookups[0]
        assert store.push_many(items) == [ref[t].push(ids, g) for t, ids, g in items]
        if lookups[0] == before:
            reused += 1
        else:
            relooked += 1
        _assert_same(store, ref)
    total = {k: sum(t.counters[k] for t in ref.values()) for k in ("unadmitted_dropped", "evictions", "admissions")}
    assert all(v > 0 for v in total.values()), total
    if between:
        assert relooked > 0  # the other push changed a map
    else:
        assert relooked == 0 and reused > 0


@pytest.mark.parametrize("kind", [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM], ids=lambda k: k.value)
def test_untrusted_repeats_and_out_of_order_ids_are_summed(kind: OptimizerKind) -> None:
    """Wire requests may repeat ids inside a table (summed) and send them unsorted."""
    cfgs = _cfgs(kind)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    rng = np.random.default_rng(11)
    for items in _steps(rng, 20, ["a", "b", "c"], unique=False):
        assert store.push_many(items) == [ref[t].push(ids, g) for t, ids, g in items]
        _assert_same(store, ref)


def test_nonfinite_reject_changes_no_table_and_drop_drops() -> None:
    cfgs = _cfgs(OptimizerKind.ROWWISE_ADAGRAD)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    ids = np.arange(5, dtype=np.int64)
    ok = np.ones((5, DIM), np.float32)
    bad = ok.copy()
    bad[2, 1] = np.nan
    for t in ref.values():
        t.push(ids, ok)
    store.push_many([(t, ids, ok) for t in ref])
    with pytest.raises(BadRequest, match="table 'c'.*NaN/Inf"):
        store.push_many([("a", ids, ok), ("b", ids, ok), ("c", ids, bad)])
    _assert_same(store, ref)  # 'a' and 'b' untouched too

    drop = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3, nonfinite_grads="drop")
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    got = drop.push_many([("a", ids, bad), ("c", ids, ok)])
    assert got == [ref["a"].push(ids, bad, NonfiniteMode.DROP), ref["c"].push(ids, ok, NonfiniteMode.DROP)]
    assert got[0].nonfinite_dropped == 1
    _assert_same(drop, {k: ref[k] for k in ("a", "c")})


def test_update_screening_counts_per_table() -> None:
    """A finite but huge gradient whose update would overflow is not written, in its own table only."""
    cfgs = _cfgs(OptimizerKind.SGD)
    cfgs = [dataclasses.replace(c, optimizer=dataclasses.replace(c.optimizer, lr=1.0)) for c in cfgs]
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    ids = np.arange(4, dtype=np.int64)
    for scale in (1.0, 3e38, 3e38):
        g = np.full((4, DIM), scale, np.float32)
        small = np.full((4, DIM), 0.5, np.float32)
        items = [("a", ids, small), ("c", ids, g)]
        assert store.push_many(items) == [ref[t].push(i, gg) for t, i, gg in items]
        _assert_same(store, {k: ref[k] for k in ("a", "c")})
    assert store.tables["c"].counters["update_nonfinite_dropped"] > 0
    assert store.tables["a"].counters["update_nonfinite_dropped"] == 0


@pytest.mark.parametrize("fp16", [False, True])
def test_pull_many_equals_pull(fp16: bool) -> None:
    cfgs = _cfgs(OptimizerKind.ROWWISE_ADAGRAD)
    store = ShardStore(cfgs, shard_id=0, num_vshards=8, seed=3)
    ref = {c.name: EmbeddingTable(c, seed=3) for c in cfgs}
    rng = np.random.default_rng(5)
    for items in _steps(rng, 6, ["a", "b", "c"]):
        store.push_many(items)
        for t, ids, g in items:
            ref[t].push(ids, g)
    big = np.full((1, DIM), 1e6, np.float32)
    store.tables["b"].import_rows(ref["b"].export_rows(ref["b"].used_rows()))  # same rows, plus:
    for t in (store.tables["b"], ref["b"]):
        t.weights[0] = torch.from_numpy(big[0])
    queries = [("a", rng.integers(0, 300, size=50).astype(np.int64)), ("b", np.empty(0, np.int64)),
               ("c", rng.integers(0, 300, size=17).astype(np.int64))]
    want = [ref[t].pull(ids, fp16=fp16) for t, ids in queries]
    outs = [np.empty((ids.size, DIM), np.float32) for _, ids in queries]
    got = store.pull_many(queries, fp16=fp16, outs=outs)
    for w, g, o in zip(want, got, outs):
        np.testing.assert_array_equal(g, w)
        assert g is o
    # every known row (b's row 0 is huge), unknown ids' initial rows; counters as table by table
    hot = ("b", np.array([int(store.tables["b"].row_ids[0])], np.int64))
    np.testing.assert_array_equal(store.pull_many([hot], fp16=fp16)[0], ref["b"].pull(hot[1], fp16=fp16))
    for name in ref:
        assert store.tables[name].counters == ref[name].counters, name


def test_groups_follow_storage_keys() -> None:
    a = TableConfig(name="a", dim=8)
    b = TableConfig(name="b", dim=16)
    c = TableConfig(name="c", dim=8, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM))
    d = TableConfig(name="d", dim=8, capacity=10)  # capacity and admission do not split a group
    specs = group_tables([a, b, c, d])
    assert [s.names for s in specs] == [("a", "d"), ("b",), ("c",)]
    store = ShardStore([a, b, c, d], shard_id=0, num_vshards=4, seed=0)
    assert list(store.tables) == ["a", "b", "c", "d"]
    assert [g.names for g in store.groups] == [s.names for s in specs]
    # out of storage order or a table twice: the table-by-table path, same answers
    ids = np.array([1, 2], np.int64)
    grads = np.ones((2, 8), np.float32)
    store.push_many([("d", ids, grads), ("a", ids, grads)])
    assert store.tables["a"].size == store.tables["d"].size == 2
    with pytest.raises(ValueError, match="no storage group"):
        store.group_of(("d", "a"))
