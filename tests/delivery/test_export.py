"""Export from real PS checkpoints: parity with the trainer, exact deltas, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from delivery.bundle import DeliveryError, read_manifest
from delivery.config import DeliveryConfig, RowDtype
from delivery.export import CheckpointSource, resolve_checkpoint, warm_start_checkpoint
from delivery.job import deliver_once
from delivery.loader import load_bundle
from models.testing import random_features
from tests.delivery.conftest import Fleet


def test_bundle_predictions_equal_the_trainers(tmp_path, history, tiny):
    out = deliver_once(DeliveryConfig(out=tmp_path / "out"), checkpoint=history.ckpts[30])
    served = load_bundle(tmp_path / "out")
    assert served.version == out.version == "v000001"
    trainer = history.fleet.trained_model()
    vocab = int(min(len(v) for v in history.live[30].values()))
    # ids that live in every table (ids 0.. of the fleet after evictions vary; use live ids)
    fb = random_features(tiny.schema, (64,), vocab=10_000, generator=torch.Generator().manual_seed(5))
    for c in tiny.schema.id_columns:
        live = torch.from_numpy(history.live[30][c.table_name])
        ids = fb.ids[c.name]
        fb.ids[c.name] = torch.where(ids >= 0, live[ids % live.numel()], ids)
    got = served.predict(fb)
    uniq = {}
    for c in tiny.schema.id_columns:
        v = fb.ids[c.name].reshape(-1)
        uniq[c.table_name] = torch.unique(torch.cat([uniq.get(c.table_name, v[:0]), v[v >= 0]]))
    rows = {t: torch.from_numpy(history.fleet.pull(t, u.numpy())) for t, u in uniq.items()}
    want = trainer.predict(fb, rows, uniq)
    assert served.unknown_ids == 0 and vocab > 0
    for h in want:
        assert float((got[h] - want[h]).abs().max()) <= 1e-5, h
    # and the rows themselves are the PS's rows, bit for bit
    for t, u in uniq.items():
        np.testing.assert_array_equal(served.lookup(t, u.numpy()), rows[t].numpy())
    m = read_manifest(tmp_path / "out" / "v000001")
    assert m.source_step == 30 and m.data_range == ["2026-01-01", "2026-01-02"]
    assert m.metrics == {"train_loss": 0.5}
    assert {t: i.rows for t, i in m.tables.items()} == {t: len(v) for t, v in history.live[30].items()}


@pytest.mark.parametrize("dtype", [RowDtype.FP32, RowDtype.FP16])
def test_base_plus_delta_chain_equals_a_full_export(tmp_path, history, tiny, dtype):
    inc = DeliveryConfig(out=tmp_path / "inc", incremental=True, dtype=dtype)
    kinds = [deliver_once(inc, checkpoint=history.ckpts[s]).kind for s in (10, 20, 30)]
    assert kinds == ["full", "delta", "delta"]
    deliver_once(DeliveryConfig(out=tmp_path / "full", dtype=dtype), checkpoint=history.ckpts[30])
    chain, full = load_bundle(tmp_path / "inc"), load_bundle(tmp_path / "full")
    assert [link.manifest.version for link in chain.links] == ["v000003", "v000002", "v000001"]
    m2 = read_manifest(tmp_path / "inc" / "v000002")
    removed_total = 0
    for t in tiny.dims:
        ever = np.unique(np.concatenate([history.live[s][t] for s in (10, 20, 30)]))
        now = history.live[30][t]
        np.testing.assert_array_equal(chain.contains(t, ever), np.isin(ever, now))
        np.testing.assert_array_equal(chain.lookup(t, ever), full.lookup(t, ever))
        gone = np.setdiff1d(history.live[20][t], now)
        assert not chain.contains(t, gone).any()
        removed_total += m2.tables[t].removed
        # a delta carries only what changed: far fewer rows than the table
        assert m2.tables[t].written < m2.tables[t].rows
    assert removed_total > 0  # capacity eviction removed ids between ckpt-10 and ckpt-20


def test_unchanged_checkpoint_gives_an_empty_delta(tmp_path, history):
    cfg = DeliveryConfig(out=tmp_path / "out", incremental=True)
    deliver_once(cfg, checkpoint=history.ckpts[20])
    assert deliver_once(cfg, checkpoint=history.ckpts[20]).status.value == "up_to_date"
    o = deliver_once(cfg, checkpoint=history.ckpts[20], force=True)
    m = read_manifest(tmp_path / "out" / o.version)
    assert o.kind == "delta" and all(i.written == 0 and i.removed == 0 for i in m.tables.values())


def test_max_chain_forces_a_full_bundle(tmp_path, history):
    cfg = DeliveryConfig(out=tmp_path / "out", incremental=True, max_chain=1)
    kinds = [deliver_once(cfg, checkpoint=history.ckpts[s]).kind for s in (10, 20, 30)]
    assert kinds == ["full", "delta", "full"]


def test_missing_checkpoint_and_empty_run_are_clear_errors(tmp_path):
    cfg = DeliveryConfig(out=tmp_path / "out")
    with pytest.raises(DeliveryError, match=r"nope: checkpoint directory not found"):
        deliver_once(cfg, checkpoint=tmp_path / "nope")
    (tmp_path / "run").mkdir()
    with pytest.raises(DeliveryError, match=r"run has no committed checkpoint"):
        deliver_once(cfg, run=tmp_path / "run")
    with pytest.raises(DeliveryError, match=r"run directory not found"):
        resolve_checkpoint(run=tmp_path / "ghost")


def test_checkpoint_without_schema_or_model_info_is_refused(tmp_path, history):
    ckpt = tmp_path / "ckpt-30"
    shutil.copytree(history.ckpts[30], ckpt)
    man = json.loads((ckpt / "manifest.json").read_text())
    del man["info"]["model"]
    (ckpt / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(DeliveryError, match=r"ckpt-30: checkpoint manifest has no \['model'\] info"):
        deliver_once(DeliveryConfig(out=tmp_path / "out"), checkpoint=ckpt)
    assert not (tmp_path / "out" / "LATEST").exists()


def test_corrupt_checkpoint_file_is_refused(tmp_path, history):
    ckpt = tmp_path / "ckpt-30"
    shutil.copytree(history.ckpts[30], ckpt)
    shard = ckpt / "shard-1.lmdb"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x55
    shard.write_bytes(bytes(data))
    with pytest.raises(DeliveryError, match=r"shard-1.lmdb: sha256 mismatch"):
        CheckpointSource.open(ckpt)


def test_checkpoint_missing_a_model_table_names_it(tmp_path, tiny):
    fleet = Fleet(tiny, tables=[t for t in tiny.dims if t != "tag"])
    fleet.train(seed=1, fraction=0.5)
    ckpt = fleet.checkpoint(tmp_path / "checkpoints", 5)
    out = tmp_path / "out"
    with pytest.raises(DeliveryError, match=r"checkpoint has no table 'tag'"):
        deliver_once(DeliveryConfig(out=out), checkpoint=ckpt)
    assert not (out / "LATEST").exists() and not any(p.name.startswith(".v") for p in out.iterdir())


def test_failed_delivery_keeps_the_published_version(tmp_path, history):
    out = tmp_path / "out"
    deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10])
    ckpt = tmp_path / "ckpt-30"
    shutil.copytree(history.ckpts[30], ckpt)
    man = json.loads((ckpt / "manifest.json").read_text())
    man["info"]["model"]["default_dim"] = 12
    (ckpt / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(DeliveryError, match=r"table '\w+': model expects dim 12, checkpoint has dim 8"):
        deliver_once(DeliveryConfig(out=out), checkpoint=ckpt)
    assert load_bundle(out).version == "v000001"


def test_warm_start_checkpoint_accepts_run_or_checkpoint(history):
    run = history.root  # holds checkpoints/ckpt-10, -20, -30
    assert warm_start_checkpoint(run) == history.ckpts[30]
    assert warm_start_checkpoint(run / "checkpoints") == history.ckpts[30]
    assert warm_start_checkpoint(history.ckpts[20]) == history.ckpts[20]
    with pytest.raises(DeliveryError, match="run directory not found"):
        warm_start_checkpoint(run / "missing")
