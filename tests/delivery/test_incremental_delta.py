"""Incremental bundles from delta checkpoints read only the changed data (issue 15 point 4).

One real 2-shard PS fleet is trained in three rounds; after each round two
checkpoints are cut at the same moment: a full one (root ``full``) and one of
a delta chain (root ``delta``, ``full_every=8``: full, delta, delta). The
incremental deliveries of both chains must be identical bundle by bundle
(rows written, removed ids, row counts, served values), and those of the
delta chain must come from the delta files alone (the base is not read).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from delivery.bundle import EMBEDDINGS, REMOVED, EmbeddingReader, read_manifest, read_removed
from delivery.config import DeliveryConfig
from delivery.job import deliver_once
from delivery.loader import load_bundle
from common.config import to_dict
from models.testing import random_features
from tests.delivery.conftest import Fleet, TinyModel


def delta_checkpoint(fleet: Fleet, root: Path, step: int) -> Path:
    from ps.checkpoint import begin_checkpoint, commit_checkpoint, save_shard

    tmp, _plan = begin_checkpoint(root, step, full_every=8)
    for i, store in enumerate(fleet.stores):
        save_shard(store, tmp, i)
    info = {"schema": fleet.tiny.schema.to_dict(), "model": to_dict(fleet.tiny.cfg), "step": step,
            "data_range": ["2026-01-01", "2026-01-02"], "metrics": {"train_loss": 0.5}}
    return commit_checkpoint(tmp, info)


def bundle_rows(version_dir: Path, dims: dict[str, int]) -> dict[str, tuple[bytes, bytes]]:
    """(ids, row bytes) written into one bundle, per table."""
    m = read_manifest(version_dir)
    r = EmbeddingReader(version_dir / EMBEDDINGS, dims, m.dtype)
    try:
        out = {}
        for t in dims:
            ids, rows = r.scan(t, m.tables[t].written)
            out[t] = (np.asarray(ids).tobytes(), np.asarray(rows).tobytes())
        return out
    finally:
        r.close()


def test_incremental_from_deltas_equals_incremental_from_full_checkpoints(tmp_path: Path, tiny: TinyModel) -> None:
    from ps.checkpoint import read_manifest as ckpt_manifest
    from ps.checkpoint import shard_files

    fleet = Fleet(tiny, capacity=200)
    full, delta = {}, {}
    for step, (fraction, new) in {10: (1.0, 0), 20: (0.1, 150), 30: (0.05, 60)}.items():
        fleet.train(seed=step, fraction=fraction, new_ids=new)
        full[step] = fleet.checkpoint(tmp_path / "full", step)
        delta[step] = delta_checkpoint(fleet, tmp_path / "delta", step)
    assert [ckpt_manifest(delta[s])["kind"] for s in (10, 20, 30)] == ["full", "delta", "delta"]

    out_f, out_d = tmp_path / "out_full", tmp_path / "out_delta"
    deliver_once(DeliveryConfig(out=out_f, incremental=True), checkpoint=full[10])
    deliver_once(DeliveryConfig(out=out_d, incremental=True), checkpoint=delta[10])
    for f in shard_files(delta[10]):  # the base is not read again: later deltas come from the delta files
        f.write_bytes(b"\0" * f.stat().st_size)
    for s in (20, 30):
        assert deliver_once(DeliveryConfig(out=out_f, incremental=True), checkpoint=full[s]).kind == "delta"
        assert deliver_once(DeliveryConfig(out=out_d, incremental=True), checkpoint=delta[s]).kind == "delta"
    # a delivery that skips ckpt-20 combines the two deltas (newest row wins, removals net of re-adds)
    skip_f, skip_d = tmp_path / "skip_full", tmp_path / "skip_delta"
    for out, ck in ((skip_f, full), (skip_d, delta)):
        shutil.copytree(out_f if out is skip_f else out_d, out)
        for v in ("v000002", "v000003"):
            shutil.rmtree(out / v)
        (out / "LATEST").write_text("v000001\n")
        assert deliver_once(DeliveryConfig(out=out, incremental=True), checkpoint=ck[30]).kind == "delta"
    ms = read_manifest(skip_d / "v000002")
    assert ms.source["read"] == "changes"
    assert {t: (i.rows, i.written, i.removed) for t, i in ms.tables.items()} == \
        {t: (i.rows, i.written, i.removed) for t, i in read_manifest(skip_f / "v000002").tables.items()}
    assert bundle_rows(skip_d / "v000002", dict(tiny.dims)) == bundle_rows(skip_f / "v000002", dict(tiny.dims))
    assert {t: a.tolist() for t, a in read_removed(skip_d / "v000002" / REMOVED).items()} == \
        {t: a.tolist() for t, a in read_removed(skip_f / "v000002" / REMOVED).items()}

    dims = dict(tiny.dims)
    removed_total = 0
    for v in ("v000001", "v000002", "v000003"):
        mf, md = read_manifest(out_f / v), read_manifest(out_d / v)
        assert md.source["read"] == ("all" if v == "v000001" else "changes")
        assert md.source["dense"] == ("traced" if v == "v000001" else "parent's graph")
        assert mf.source["read"] == "all"
        assert {t: (i.rows, i.written, i.removed) for t, i in md.tables.items()} == \
            {t: (i.rows, i.written, i.removed) for t, i in mf.tables.items()}, v
        assert md.row_watermark == mf.row_watermark
        assert bundle_rows(out_d / v, dims) == bundle_rows(out_f / v, dims), v
        if v != "v000001":
            rf, rd = read_removed(out_f / v / REMOVED), read_removed(out_d / v / REMOVED)
            assert {t: a.tolist() for t, a in rd.items()} == {t: a.tolist() for t, a in rf.items()}, v
            removed_total += sum(i.removed for i in md.tables.values())
    assert removed_total > 0  # evictions between the rounds
    # the delta bundles reuse the parent's traced dense network with the new parameters: same predictions
    # as a full bundle of the same checkpoint (traced afresh)
    deliver_once(DeliveryConfig(out=tmp_path / "fresh"), checkpoint=full[30])
    fb = random_features(tiny.schema, (32,), vocab=10_000, generator=torch.Generator().manual_seed(5))
    for c in tiny.schema.id_columns:
        live = torch.from_numpy(fleet.live_ids(c.table_name))
        fb.ids[c.name] = torch.where(fb.ids[c.name] >= 0, live[fb.ids[c.name] % live.numel()], fb.ids[c.name])
    got, want = load_bundle(out_d).predict(fb), load_bundle(tmp_path / "fresh").predict(fb)
    assert set(got) == set(want)
    for h in want:
        torch.testing.assert_close(got[h], want[h], atol=1e-6, rtol=0)
    served_f, served_d = load_bundle(out_f), load_bundle(out_d)
    for t in dims:
        ever = np.arange(0, fleet.next_id, dtype=np.int64)
        np.testing.assert_array_equal(served_d.contains(t, ever), served_f.contains(t, ever))
        np.testing.assert_array_equal(served_d.lookup(t, ever), served_f.lookup(t, ever))
        np.testing.assert_array_equal(served_d.contains(t, ever), np.isin(ever, fleet.live_ids(t)))
