"""Training hygiene: validation split + early stopping + best checkpoint, lr schedule, weight decay,
dropout. Real train-local runs (in-process ShardStore, real Meta-IO files, real LMDB checkpoints)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from meta_io.reader import MetaIODataset
from common.errors import ConfigError
from ps.client import PsClient
from workers.config import LrSchedule
from workers.evaluation import score_batches
from workers.hygiene import lr_factor, validation_loss, validation_split
from workers.local import train_local
from workers.row_source import RemoteRowSource
from workers.worker import Worker, build_model

from tests.workers.conftest import make_job

SGD = {"kind": "sgd", "lr": 0.5}


@pytest.mark.parametrize(
    "key, value",
    [("val_fraction", 0.5), ("val_fraction", -0.1), ("early_stop_patience", -1), ("lr_schedule", "step"),
     ("warmup_steps", 0), ("early_stop_metric", "logloss")],
)
def test_train_keys_validated(worker_data, tmp_path: Path, key, value) -> None:
    with pytest.raises(ConfigError, match=rf"train.*{key}"):
        make_job(worker_data["meta"], tmp_path, train={key: value})


def test_lr_factor_shapes() -> None:
    assert [lr_factor(LrSchedule.CONSTANT, s, 4, 10) for s in (0, 5, 9)] == [1.0, 1.0, 1.0]
    assert [lr_factor(LrSchedule.WARMUP, s, 4, 10) for s in (0, 1, 3, 4, 9)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    cos = [lr_factor(LrSchedule.WARMUP_COSINE, s, 2, 12) for s in range(13)]
    assert cos[:3] == [0.5, 1.0, 1.0] and cos[12] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(cos[2:], cos[3:]))  # non-increasing after the warm-up
    assert cos[7] == pytest.approx(0.5)


def _dense(worker: Worker) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in worker.model.named_parameters()}


def test_lr_warmup_scales_the_first_dense_step(worker_data, tmp_path: Path) -> None:
    """Dense SGD, one step: the warm-up's first step is exactly 1/warmup_steps of the constant one."""
    init = {n: p.detach().numpy().copy() for n, p in build_model(
        make_job(worker_data["meta"], tmp_path)).named_parameters()}
    moves = {}
    for sched in ("constant", "warmup"):
        job = make_job(worker_data["meta"], tmp_path / sched, ps={"dense_optimizer": SGD},
                       train={"max_steps": 1, "lr_schedule": sched, "warmup_steps": 4})
        _, w = train_local(job, tmp_path / sched / "run", checkpoint=False)
        moves[sched] = {n: v - init[n] for n, v in _dense(w).items()}
    total = sum(float(np.abs(m).sum()) for m in moves["constant"].values())
    assert total > 0
    for n in init:
        np.testing.assert_allclose(moves["warmup"][n], moves["constant"][n] / 4, rtol=1e-4, atol=1e-7, err_msg=n)


def test_lr_schedule_refused_when_the_ps_runs_the_dense_optimizer(worker_data, ps_servers, tmp_path: Path) -> None:
    job = make_job(worker_data["meta"], tmp_path, train={"lr_schedule": "warmup"})
    client = PsClient(ps_servers(job), job.rpc, worker_id="worker-0", register=True)
    try:
        with pytest.raises(ConfigError, match="lr_schedule"):
            Worker(job, 0, RemoteRowSource(client), run_dir=tmp_path / "dist", world=1)
    finally:
        client.close()


def test_dense_and_embedding_weight_decay_applied(worker_data, tmp_path: Path) -> None:
    """SGD, one step: decay adds exactly -lr * wd * w0 to every dense value and every touched row."""
    wd = 0.1
    out = {}
    for name, decay in (("plain", 0.0), ("decay", wd)):
        opt = {**SGD, "weight_decay": decay}
        job = make_job(worker_data["meta"], tmp_path / name, mode="plain",
                       ps={"dense_optimizer": opt, "table_defaults": {"dim": 8, "capacity": 4096, "optimizer": opt}},
                       train={"max_steps": 1})
        _, w = train_local(job, tmp_path / name / "run", checkpoint=False)
        first, _ = next(w._ranges())  # the batch train-local trained first (its shard order)
        batch = next(iter(w.dataset.read_range(first.file, first.start, first.start + 1)))
        ids = {t: u.numpy() for t, u in batch.unique_ids.items()}
        out[name] = (_dense(w), w.rows.pull(ids), job, ids)
    init_model = build_model(out["plain"][2])
    for n, p in init_model.named_parameters():
        want = out["plain"][0][n] - SGD["lr"] * wd * p.detach().numpy()
        np.testing.assert_allclose(out["decay"][0][n], want, rtol=1e-4, atol=1e-6, err_msg=n)
    from workers.local import local_store

    fresh = local_store(out["plain"][2])
    for t, rows in out["plain"][1].items():
        init = fresh.pull(t, out["plain"][3][t])
        np.testing.assert_allclose(out["decay"][1][t], rows - SGD["lr"] * wd * init, rtol=1e-4, atol=1e-6,
                                   err_msg=f"table {t}")


def test_dropout_trains_but_never_scores(worker_data, tmp_path: Path) -> None:
    job = make_job(worker_data["meta"], tmp_path, model={"dropout": 0.5}, train={"max_steps": 2})
    _, w = train_local(job, tmp_path / "run", checkpoint=False)
    assert w.model.training  # training mode is kept outside scoring
    ds = MetaIODataset(worker_data["meta"])
    batch = next(iter(ds.iter_all()))
    rows = w.rows.pull({t: u.numpy() for t, u in batch.unique_ids.items()})
    a, b = (w.trainer.compute(batch, rows) for _ in range(2))
    assert not math.isclose(float(a.outer_loss), float(b.outer_loss))  # dropout is on in training steps
    s1 = score_batches(w.model, w.rows, ds.read_range(0, 0, 2), w.trainer.inner_loop)
    s2 = score_batches(w.model, w.rows, ds.read_range(0, 0, 2), w.trainer.inner_loop)
    for kind in ("base", "adapted"):
        for head, arrays in s1[kind].items():
            for k, v in arrays.items():
                np.testing.assert_array_equal(v, s2[kind][head][k], err_msg=f"{kind} {head} {k}: dropout on in scoring")
    assert w.model.training


def test_validation_split_is_seeded_and_disjoint(worker_data) -> None:
    ds = MetaIODataset(worker_data["meta"])
    a, b = validation_split(ds, 0.2, 7), validation_split(ds, 0.2, 7)
    assert all(np.array_equal(a[f], b[f]) for f in a)
    for f in range(ds.num_files):
        n = ds.num_batches(f)
        assert 1 <= len(a[f]) < n and len(np.unique(a[f])) == len(a[f]) and a[f].max() < n


def test_early_stopping_keeps_and_restores_the_best_epoch(worker_data, tmp_path: Path) -> None:
    """An overfitting setup (a hot dense Adam on 3k rows, up to 8 epochs) whose validation loss rises after its best epoch.

    Plain layout: the same validation/early-stop/restore code as meta training, at a
    fraction of the step cost (this test ran 85 s on the meta layout)."""
    job = make_job(worker_data["plain"], tmp_path, mode="plain",
                   ps={"dense_optimizer": {"kind": "adam", "lr": 0.03},
                       "table_defaults": {"dim": 8, "capacity": 4096, "optimizer": {"kind": "sgd", "lr": 0.1}}},
                   train={"epochs": 8, "val_fraction": 0.2, "early_stop_patience": 2, "early_stop_metric": "loss"})
    rep, w = train_local(job, tmp_path / "run", checkpoint=False)
    val = rep["validation"]
    losses = val["losses"]
    best = int(np.argmin(losses))
    assert val["best_epoch"] == best and val["best_loss"] == losses[best]
    assert best < len(losses) - 1, f"setup no longer overfits: {losses}"
    # stopped exactly after `patience` epochs without improvement
    assert len(losses) == best + 1 + 2 and val["stopped_early"]
    assert val["metric"] == "loss" and val["best_value"] == losses[best] and val["stop_reason"].startswith("patience")
    assert Path(val["best_checkpoint"]).is_dir()
    # the model and rows now in the worker are the best epoch's: same validation loss
    held = validation_split(w.dataset, 0.2, job.train.seed)
    batches = [(f, int(b)) for f, idx in held.items() for b in idx]
    assert validation_loss(w, batches) == pytest.approx(val["best_loss"], rel=1e-5)
    assert validation_loss(w, batches) != pytest.approx(losses[-1], rel=1e-5)
