"""Adaptation ships: a bundle adapts per task exactly like the trainer, and unseen ids read the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from delivery.bundle import DeliveryError
from delivery.config import DeliveryConfig
from delivery.job import deliver_once
from delivery.loader import load_bundle
from meta_io.batch import FeatureBatch, PlainBatch
from metaps.core.config import to_dict
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
    return fleet, load_bundle(root / "bundles")


def _uniq(tiny, parts: list[FeatureBatch]) -> dict[str, torch.Tensor]:
    per: dict[str, list[torch.Tensor]] = {}
    for c in tiny.schema.id_columns:
        for fb in parts:
            per.setdefault(c.table_name, []).append(fb.ids[c.name].reshape(-1))
    return {t: torch.unique(torch.cat(v)[torch.cat(v) >= 0]) for t, v in per.items()}


def _flat(fb: FeatureBatch) -> FeatureBatch:
    return fb.map(lambda t: t.reshape((-1,) + tuple(t.shape[2:])))


def test_manifest_ships_the_recipe(shipped) -> None:
    _, served = shipped
    rec = served.manifest.adapt
    assert rec["version"] == 1 and rec["meta_from"] == "checkpoint" and rec["init_from"] == "checkpoint"
    assert rec["meta"]["inner_steps"] == 2 and rec["meta"]["inner_lr"] == 0.05 and rec["meta"]["adapt"] == "both"
    assert rec["unseen"] == "init" and set(rec["init"]) == set(served.dims)
    assert "adapt_params.npz" in served.manifest.files


def test_bundle_adapted_predictions_equal_the_trainers(shipped, tiny) -> None:
    fleet, served = shipped
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


def test_unseen_id_scores_the_same_in_training_evaluation_and_serving(shipped, tiny) -> None:
    fleet, served = shipped
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
