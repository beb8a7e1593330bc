"""The periodic job's reuse path (delivery.reuse.ExportCache) builds the bundles a fresh export builds.

A real 2-shard PS fleet is trained in rounds and cut into a delta-checkpoint
chain; one ``PeriodicDelivery`` loop (one process, one cache) delivers each
checkpoint, and ``deliver_once`` without a cache delivers the same checkpoints
into another root. Bundle by bundle the two must be identical: rows written,
removed ids, table counts, and the dense network's predictions -- also when the
dense parameters changed while the cache held the parent's traced network.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from delivery.bundle import REMOVED, read_manifest, read_removed
from delivery.config import DeliveryConfig
from delivery.job import PeriodicDelivery, Status, deliver_once
from delivery.loader import load_bundle
from tests.delivery.conftest import Fleet, TinyModel, live_features
from tests.delivery.test_incremental_delta import bundle_rows, delta_checkpoint


def _predict(root: Path, fb) -> dict[str, torch.Tensor]:
    served = load_bundle(root)
    try:
        return served.predict(fb)
    finally:
        served.close()


def _same_bundle(a: Path, b: Path, dims: dict[str, int]) -> None:
    ma, mb = read_manifest(a), read_manifest(b)
    assert (ma.kind, ma.parent, ma.source["read"], ma.source["dense"]) == \
        (mb.kind, mb.parent, mb.source["read"], mb.source["dense"]), a.name
    assert {t: (i.rows, i.written, i.removed) for t, i in ma.tables.items()} == \
        {t: (i.rows, i.written, i.removed) for t, i in mb.tables.items()}, a.name
    assert ma.dense == mb.dense
    assert ma.adapt == mb.adapt and ma.adapt  # (the recipe comes from the cache after the first)
    assert bundle_rows(a, dims) == bundle_rows(b, dims), a.name
    if ma.kind.value == "delta":
        ra, rb = read_removed(a / REMOVED), read_removed(b / REMOVED)
        assert {t: x.tolist() for t, x in ra.items()} == {t: x.tolist() for t, x in rb.items()}, a.name


@pytest.mark.parametrize("ckpts", ["delta", "full"])
def test_periodic_reuse_path_equals_fresh_exports(tmp_path: Path, tiny: TinyModel, ckpts: str) -> None:
    """Delta checkpoints: only their changes are read; full ones: every row is compared with the
    cached live fingerprints."""
    fleet = Fleet(tiny, capacity=200)
    run = tmp_path / "run"
    reused, fresh = tmp_path / "reused", tmp_path / "fresh"
    loop = PeriodicDelivery(DeliveryConfig(out=reused, incremental=True), run)
    dims = dict(tiny.dims)
    for step, (fraction, new) in {10: (1.0, 0), 20: (0.1, 150), 30: (0.05, 60)}.items():
        fleet.train(seed=step, fraction=fraction, new_ids=new)  # also moves every dense parameter
        if ckpts == "delta":
            ckpt = delta_checkpoint(fleet, run / "checkpoints", step)
        else:
            ckpt = fleet.checkpoint(run / "checkpoints", step)
        got = loop.tick()
        assert got is not None and got.status is Status.PUBLISHED, got
        want = deliver_once(DeliveryConfig(out=fresh, incremental=True), checkpoint=ckpt)
        assert got.version == want.version and got.kind == want.kind
        _same_bundle(reused / got.version, fresh / want.version, dims)
        # served: the chain up to this version predicts exactly as the fresh chain
        fb = live_features(tiny, {t: fleet.live_ids(t) for t in dims}, rows=48, seed=step)
        a, b = _predict(reused, fb), _predict(fresh, fb)
        assert set(a) == set(b)
        for h in b:
            torch.testing.assert_close(a[h], b[h], atol=0, rtol=0)
        served_a, served_b = load_bundle(reused), load_bundle(fresh)
        try:
            for t in dims:
                ever = np.arange(0, fleet.next_id, dtype=np.int64)
                np.testing.assert_array_equal(served_a.contains(t, ever), served_b.contains(t, ever))
                np.testing.assert_array_equal(served_a.lookup(t, ever), served_b.lookup(t, ever))
        finally:
            served_a.close()
            served_b.close()
    assert read_manifest(reused / "v000003").source["read"] == ("changes" if ckpts == "delta" else "all")
    # the second and third deliveries took the parent's network, live ids and model from the cache
    assert loop.cache.hits.get("dense") == 2 and loop.cache.hits.get("live") == 2, loop.cache.hits
    assert loop.cache.hits.get("model") == 2 and loop.cache.misses.get("model") == 1
    assert loop.cache.hits.get("recipe") == 2 and loop.cache.misses.get("recipe") == 1


def test_changed_dense_parameters_are_never_served_from_the_cache(tmp_path: Path, tiny: TinyModel) -> None:
    fleet = Fleet(tiny, capacity=200)
    run, out = tmp_path / "run", tmp_path / "out"
    cfg = DeliveryConfig(out=out, incremental=True)
    fleet.train(seed=1, fraction=1.0)
    deliver_once(cfg, checkpoint=delta_checkpoint(fleet, run / "checkpoints", 10))  # another process: v1
    loop = PeriodicDelivery(cfg, run)
    fleet.train(seed=2, fraction=0.2)
    delta_checkpoint(fleet, run / "checkpoints", 20)
    assert loop.tick() is not None  # v2: the parent's dense.pt loaded from disk, then cached
    assert loop.cache.misses.get("dense") == 1 and not loop.cache.hits.get("dense")
    fb = live_features(tiny, {t: fleet.live_ids(t) for t in tiny.dims}, rows=48, seed=3)
    before = _predict(out, fb)
    # only the dense network moves (no row changes), far enough to change every prediction
    store = fleet.stores[0]
    vals = store.dense.pull(store.dense.names())
    store.dense.set({n: v * -2.0 + 0.3 for n, v in vals.items()})
    ckpt = delta_checkpoint(fleet, run / "checkpoints", 30)
    got_o = loop.tick()
    assert got_o is not None and got_o.kind == "delta"
    assert loop.cache.hits.get("dense") == 1, loop.cache.hits  # v3 took v2's network from the cache
    assert read_manifest(out / "v000003").source["dense"] == "parent's graph"
    deliver_once(DeliveryConfig(out=tmp_path / "traced"), checkpoint=ckpt)  # full: traced afresh
    got, want = _predict(out, fb), _predict(tmp_path / "traced", fb)
    for h in want:
        assert not torch.allclose(before[h], want[h], atol=1e-3), h  # the change is visible
        torch.testing.assert_close(got[h], want[h], atol=1e-6, rtol=0)


@pytest.mark.parametrize("inplace,hint", [(False, False), (True, False), (True, True)])
def test_advance_live_equals_the_chain_rebuilt(inplace: bool, hint: bool) -> None:
    """Replaced, new and removed ids, as ``read_live`` rebuilds them; in place only when asked."""
    from delivery.reuse import advance_live, locate

    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(10_000, 500, replace=False)).astype(np.int64)
    fp = rng.integers(0, 1 << 62, 500).astype(np.uint64)
    gone = np.sort(rng.choice(ids, 40, replace=False))
    kept = np.setdiff1d(ids, gone)
    fresh = np.setdiff1d(np.arange(10_000, 10_060), ids)
    w_ids = np.sort(np.concatenate([rng.choice(kept, 70, replace=False), fresh, [-5]])).astype(np.int64)
    w_fp = rng.integers(0, 1 << 62, w_ids.size).astype(np.uint64)
    parent = {"item": (ids.copy(), fp.copy()), "user": (ids[:3].copy(), fp[:3].copy())}
    at = {"item": locate(ids, w_ids)} if hint else None
    got = advance_live(parent, {"item": (w_ids, w_fp)}, {"item": gone, "user": np.zeros(0, np.int64)},
                       at=at, inplace=inplace)
    want = dict(zip(ids.tolist(), fp.tolist()))
    for i in gone.tolist():
        del want[i]
    want.update(zip(w_ids.tolist(), w_fp.tolist()))
    g_ids, g_fp = got["item"]
    assert g_ids.tolist() == sorted(want) and g_fp.tolist() == [want[i] for i in sorted(want)]
    assert got["user"][0].tolist() == ids[:3].tolist() and got["user"][1].tolist() == fp[:3].tolist()
    # the parent's arrays: untouched unless the caller owns them
    assert (parent["item"][1].tolist() == fp.tolist()) is (not inplace)


def test_a_parent_state_spent_by_an_export_is_refused(tmp_path: Path, tiny: TinyModel) -> None:
    """The cached live ids are advanced in place: the ParentState they came from must not be used again."""
    from delivery.bundle import DeliveryError
    from delivery.export import CheckpointSource, export_bundle, parent_state, read_live
    from delivery.loader import bundle_chain
    from delivery.publish import Publisher
    from delivery.reuse import ExportCache

    fleet = Fleet(tiny, capacity=200)
    run = tmp_path / "run" / "checkpoints"
    fleet.train(seed=1, fraction=1.0)
    base = delta_checkpoint(fleet, run, 10)
    fleet.train(seed=2, fraction=0.3, new_ids=40)
    tip = delta_checkpoint(fleet, run, 20)
    root, cache = tmp_path / "out", ExportCache()
    pub = Publisher(root)
    cfg = DeliveryConfig(out=root, incremental=True)
    staging = pub.staging_dir("v000001")
    export_bundle(CheckpointSource.open(base, cache=cache), staging, "v000001", cfg, None, cache)
    pub.publish(staging, "v000001")
    parent = parent_state(bundle_chain(root / "v000001"), cache)
    assert cache.hits.get("live") == 1
    staging = pub.staging_dir("v000002")
    export_bundle(CheckpointSource.open(tip, cache=cache), staging, "v000002", cfg, parent, cache)
    assert parent.spent == "v000002"
    with pytest.raises(DeliveryError, match="parent state of v000001 was spent by the export of v000002"):
        export_bundle(CheckpointSource.open(tip), pub.staging_dir("v000003"), "v000003", cfg, parent)
    pub.publish(staging, "v000002")
    # what the cache now holds for v2 is what a fresh read of the chain gives
    cached = parent_state(bundle_chain(root / "v000002"), cache)
    fresh = read_live(bundle_chain(root / "v000002"))
    assert cache.hits.get("live") == 2
    assert set(cached.live) == set(fresh)
    for t in fresh:
        assert cached.live[t][0].tolist() == fresh[t][0].tolist()
        assert cached.live[t][1].tolist() == fresh[t][1].tolist()


def test_a_changed_meta_or_ps_config_is_a_new_recipe_not_a_cache_hit(tmp_path: Path, tiny: TinyModel) -> None:
    """The recipe is cached by the text it comes from: another [meta] or [ps] gives another recipe."""
    from delivery.reuse import ExportCache
    from common.config import to_dict

    fleet = Fleet(tiny, capacity=200)
    cache, out = ExportCache(), tmp_path / "out"
    base = {"schema": tiny.schema.to_dict(), "model": to_dict(tiny.cfg)}
    infos = [{"meta": {"inner_lr": 0.1}}, {"meta": {"inner_lr": 0.1}}, {"meta": {"inner_lr": 0.25}},
             {"meta": {"inner_lr": 0.25}, "job": {"ps": {"seed": 11}}}]
    got = []
    for step, extra in enumerate(infos, start=1):
        fleet.train(seed=step, fraction=0.3)
        ck = fleet.checkpoint(tmp_path / "ckpts", step, info={**base, "step": step, **extra})
        deliver_once(DeliveryConfig(out=out, incremental=True), checkpoint=ck, cache=cache)
        m = read_manifest(out / f"v{step:06d}")
        got.append((m.adapt["meta"]["inner_lr"], m.adapt["init_from"], {t: i["seed"] for t, i in m.adapt["init"].items()}))
    assert [g[0] for g in got] == [0.1, 0.1, 0.25, 0.25]
    assert [g[1] for g in got] == ["defaults", "defaults", "defaults", "checkpoint"]
    assert set(got[3][2].values()) == {11} and got[2][2] != got[3][2]
    assert cache.hits.get("recipe") == 1 and cache.misses.get("recipe") == 3
