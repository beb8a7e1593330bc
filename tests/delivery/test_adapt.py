"""Adaptation ships: a bundle adapts per task exactly like the trainer, and unseen ids read the same rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from delivery.bundle import DeliveryError
from delivery.config import DeliveryConfig
from delivery.job import deliver_once
from delivery.loader import load_bundle
from meta_io.batch import FeatureBatch, PlainBatch
from common.config import to_dict
from models.meta import adapt_and_predict
from models.meta_config import AdaptTarget, MetaConfig
from models.testing import random_features
from tests.delivery.conftest import Fleet, live_features, write_bundle
from workers.evaluation import score_batches

T, S, Q = 6, 5, 7
META = MetaConfig(inner_steps=2, inner_lr=0.05, adapt=AdaptTarget.BOTH)


class FleetRows:
    """The training-time row source over the test fleet (a PS pull: unseen ids read their initial rows)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def pull(self, ids, step=None):
        return {t: self.fleet.pull(t, v) for t, v in ids.items()}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("adapt")
    fleet = Fleet(tiny)
    fleet.train(seed=3, fraction=0.7)
    info = {"schema": tiny.schema.to_dict(), "model": to_dict(tiny.cfg), "step": 5,
            "job": {"meta": to_dict(META), "ps": {"seed": 0}}}
    ckpt = fleet.checkpoint(root / "checkpoints", step=5, info=info)
    deliver_once(DeliveryConfig(out=root / "bundles"), checkpoint=ckpt)
    return fleet, root / "bundles" / "v000001"


@pytest.fixture()
def served(shipped):
    """The shipped bundle, loaded for one test (LMDB allows one open environment per process)."""
    model = load_bundle(shipped[1])
    yield model
    model.close()


def _uniq(tiny, parts: list[FeatureBatch]) -> dict[str, torch.Tensor]:
    per: dict[str, list[torch.Tensor]] = {}
    for c in tiny.schema.id_columns:
        for fb in parts:
            per.setdefault(c.table_name, []).append(fb.ids[c.name].reshape(-1))
    return {t: torch.unique(torch.cat(v)[torch.cat(v) >= 0]) for t, v in per.items()}


def _flat(fb: FeatureBatch) -> FeatureBatch:
    return fb.map(lambda t: t.reshape((-1,) + tuple(t.shape[2:])))


def test_manifest_ships_the_recipe(served) -> None:
    rec = served.manifest.adapt
    assert rec["version"] == 1 and rec["meta_from"] == "checkpoint" and rec["init_from"] == "checkpoint"
    assert rec["meta"]["inner_steps"] == 2 and rec["meta"]["inner_lr"] == 0.05 and rec["meta"]["adapt"] == "both"
    assert rec["unseen"] == "init" and set(rec["init"]) == set(served.dims)
    assert "adapt_params.npz" in served.manifest.files


def test_bundle_adapted_predictions_equal_the_trainers(shipped, served, tiny) -> None:
    fleet = shipped[0]
    g = torch.Generator().manual_seed(11)
    # ids 0..599: about half trained, the rest never seen by the PS (unseen ids on both sides)
    sup = random_features(tiny.schema, (T, S), vocab=600, generator=g, pad_rows=0.2)
    qry = random_features(tiny.schema, (T, Q), vocab=600, generator=g, pad_rows=0.2)
    uniq = _uniq(tiny, [sup, qry])
    rows = {t: torch.from_numpy(fleet.pull(t, u.numpy())) for t, u in uniq.items()}
    want = adapt_and_predict(fleet.trained_model(), sup, qry, rows, uniq, META)
    keys = np.arange(T, dtype=np.int64) * 7919 + 3
    pred = served.adapt(_flat(sup), np.repeat(keys, S), tasks_per_batch=4)  # two vmapped chunks
    got = pred.predict(_flat(qry), np.repeat(keys, Q))
    real = qry.mask.reshape(-1).bool()
    base = served.predict(qry)
    moved = 0.0
    for h in served.heads:
        np.testing.assert_allclose(got[h][real].numpy(), want[h].reshape(-1)[real].numpy(), atol=1e-5, rtol=0)
        moved = max(moved, float((got[h][real] - base[h].reshape(-1)[real]).abs().max()))
    assert moved > 1e-4, "adaptation changed nothing: the test would not see a wrong recipe"
    # rows of a task without support rows are scored by the base model
    other = pred.predict(_flat(qry), np.full(T * Q, 424242, dtype=np.int64))
    for h in served.heads:
        np.testing.assert_allclose(other[h].numpy(), base[h].reshape(-1).numpy(), atol=1e-6)


def test_unseen_id_scores_the_same_in_training_evaluation_and_serving(shipped, served, tiny) -> None:
    fleet = shipped[0]
    fb = random_features(tiny.schema, (16,), vocab=1000, generator=torch.Generator().manual_seed(2), pad_rows=0.0)
    fb.ids.update({k: torch.where(v >= 0, v + 5_000_000, v) for k, v in fb.ids.items()})  # every id unseen
    uniq = _uniq(tiny, [fb])
    assert not any(served.contains(t, u.numpy()).any() for t, u in uniq.items())
    trained = score_batches(fleet.trained_model(), FleetRows(fleet), [PlainBatch(fb, uniq)])["base"]
    before = served.unknown_ids
    served_p = served.predict(fb)
    assert served.unknown_ids - before == sum(int(u.numel()) for u in uniq.values())
    for h in served.heads:
        np.testing.assert_allclose(served_p[h].numpy(), trained[h]["score"], atol=1e-5, rtol=0)


def test_a_bundle_without_a_recipe_cannot_adapt(tmp_path, tiny) -> None:
    (tmp_path / "v000001").mkdir()
    write_bundle(tmp_path / "v000001", tiny, "v000001", {})
    served = load_bundle(tmp_path / "v000001")
    fb = live_features(tiny, {t: np.arange(5) for t in tiny.dims}, rows=4, seed=1)
    with pytest.raises(DeliveryError, match="no adaptation recipe"):
        served.adapt(fb, np.zeros(4, np.int64))


def _keyed(tiny, live, rows: int, seed: int, keys: np.ndarray) -> FeatureBatch:
    fb = live_features(tiny, live, rows=rows, seed=seed)
    fb.ids["user_id"] = torch.from_numpy(keys.astype(np.int64)).reshape(-1, 1)
    return fb


def test_predict_with_support_keeps_columns_and_matches_the_api(shipped, tiny, tmp_path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from metaps.cli import main
    from tests.delivery.conftest import write_parquet

    fleet, path = shipped
    live = {t: fleet.live_ids(t) for t in tiny.dims}
    users = np.array([11, 12, 13, 14], dtype=np.int64)
    rng = np.random.default_rng(1)
    s_keys, d_keys = np.repeat(users[:3], 6), rng.choice(users, 40)  # user 14 has no support
    sup = _keyed(tiny, live, len(s_keys), 21, s_keys)
    dat = _keyed(tiny, live, len(d_keys), 22, d_keys)
    s_lab = {"click": rng.integers(0, 2, len(s_keys)).astype(float)}
    s_lab["conversion"] = s_lab["click"] * rng.integers(0, 2, len(s_keys))
    d_lab = {h: rng.integers(0, 2, len(d_keys)).astype(float) for h in tiny.schema.labels}
    for h, v in s_lab.items():
        sup.labels[h] = torch.from_numpy(v).float()
    s_path = write_parquet(tmp_path / "support.parquet", tiny, sup, s_lab)
    d_path = write_parquet(tmp_path / "day.parquet", tiny, dat, d_lab)
    t = pq.read_table(d_path)
    notes = [f"n{i}" for i in range(t.num_rows)]
    pq.write_table(t.append_column("note", pa.array(notes)), str(d_path))  # not a schema column
    out = tmp_path / "scores.parquet"
    capsys.readouterr()
    assert main(["--json", "predict", "--bundle", str(path), "--support", str(s_path), "--data", str(d_path),
                 "--out", str(out), "--batch-rows", "16", "--keep-columns", "user_id,click,note"]) == 0
    io = capsys.readouterr()
    # off a terminal: progress log lines (the last one at the end), no warning
    assert [ln for ln in io.err.splitlines() if 'msg="progress"' in ln and 'what="rows scored"' in ln]
    assert "warning" not in io.err
    assert json.loads(io.out.strip().splitlines()[-1])["adapted"] is True
    got = pq.read_table(out).to_pydict()
    assert got["user_id"] == d_keys.tolist() and got["click"] == d_lab["click"].tolist() and got["note"] == notes
    served = load_bundle(path)
    try:
        want = served.adapt(sup, s_keys).predict(dat, d_keys)
        base = served.predict(dat)
    finally:
        served.close()
    for h in want:
        np.testing.assert_allclose(got[f"p_{h}"], want[h].numpy(), atol=1e-6)
    no_sup = d_keys == 14
    np.testing.assert_allclose(np.array(got["p_click"])[no_sup], base["click"].numpy()[no_sup], atol=1e-6)
    assert np.abs(np.array(got["p_click"])[~no_sup] - base["click"].numpy()[~no_sup]).max() > 1e-4


def test_predict_warns_when_most_ids_are_unknown(shipped, tiny, tmp_path, capsys) -> None:
    from metaps.cli import main
    from tests.delivery.conftest import write_parquet

    path = shipped[1]
    unseen = {t: np.arange(7_000_000, 7_000_500) for t in tiny.dims}
    fb = live_features(tiny, unseen, rows=30, seed=3)
    d_path = write_parquet(tmp_path / "far.parquet", tiny, fb, {h: np.zeros(30) for h in tiny.schema.labels})
    args = ["--json", "predict", "--bundle", str(path), "--data", str(d_path), "--out", str(tmp_path / "s.parquet")]
    capsys.readouterr()
    assert main(args) == 0
    io = capsys.readouterr()
    assert "warning:" in io.err and "unknown to bundle" in io.err
    assert json.loads(io.out.strip().splitlines()[-1])["unknown_share"] > 0.9
    assert main(args + ["--warn-unknown", "1.0"]) == 0
    assert "warning:" not in capsys.readouterr().err
    assert main(args + ["--warn-unknown", "1.5"]) == 1
    assert "--warn-unknown must be a share in [0, 1]" in capsys.readouterr().err
