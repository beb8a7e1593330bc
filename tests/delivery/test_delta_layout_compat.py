"""Delta checkpoints written before runs of vshards (one chunk per vshard) still deliver.

One real 2-shard PS fleet, a delta chain (full, delta, delta); a copy of the chain is
rewritten into the per-vshard layout of before (``tests.ps.test_delta_layout``). Incremental
deliveries of both chains must read only the delta files and give identical bundles.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from delivery.bundle import REMOVED, read_manifest, read_removed
from delivery.config import DeliveryConfig
from delivery.job import deliver_once
from ps.checkpoint import read_manifest as ckpt_manifest
from tests.delivery.conftest import Fleet, TinyModel
from tests.delivery.test_incremental_delta import bundle_rows, delta_checkpoint
from tests.ps.test_delta_layout import chunk_keys, to_legacy_layout


def test_a_chain_of_per_vshard_delta_files_delivers_the_same_bundles(tmp_path: Path, tiny: TinyModel) -> None:
    from ps.checkpoint import shard_files

    fleet = Fleet(tiny, capacity=200)
    ckpts = {}
    for step, (fraction, new) in {10: (1.0, 0), 20: (0.1, 150), 30: (0.05, 60)}.items():
        fleet.train(seed=step, fraction=fraction, new_ids=new)
        ckpts[step] = delta_checkpoint(fleet, tmp_path / "new" / "checkpoints", step)
    legacy = tmp_path / "old" / "checkpoints"
    shutil.copytree(tmp_path / "new" / "checkpoints", legacy)
    for step in (20, 30):
        to_legacy_layout(legacy / ckpts[step].name)
    assert max(len(chunk_keys(p, t)) for p in shard_files(legacy / ckpts[30].name) for t in tiny.dims) > 1
    dims = dict(tiny.dims)
    for step in (10, 20, 30):
        outs = []
        for which in ("new", "old"):
            ck = tmp_path / which / "checkpoints" / ckpts[step].name
            assert ckpt_manifest(ck)["kind"] == ("full" if step == 10 else "delta")
            got = deliver_once(DeliveryConfig(out=tmp_path / f"out_{which}", incremental=True), checkpoint=ck)
            outs.append(tmp_path / f"out_{which}" / str(got.version))
        a, b = outs
        ma, mb = read_manifest(a), read_manifest(b)
        assert mb.source["read"] == ("all" if step == 10 else "changes")
        assert {t: (i.rows, i.written, i.removed) for t, i in ma.tables.items()} == \
            {t: (i.rows, i.written, i.removed) for t, i in mb.tables.items()}, step
        assert bundle_rows(a, dims) == bundle_rows(b, dims), step
        if step != 10:
            assert {t: x.tolist() for t, x in read_removed(a / REMOVED).items()} == \
                {t: x.tolist() for t, x in read_removed(b / REMOVED).items()}, step
