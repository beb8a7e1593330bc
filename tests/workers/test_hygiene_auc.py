"""Early stopping on the validation AUC (``[train] early_stop_metric``, default ``auc``), and its
record in the run's report.json (issue 29 item 5).

A real ``train-local`` run directory (``metaps.roles.local_run.run_local``: preflight, job.toml,
checkpoints, report.json) over the 3k-row plain layout with a hot dense Adam that overfits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metaps.roles.local_run import run_local
from workers.hygiene import mean_auc, validation_auc, validation_loss, validation_split
from workers.local import train_local

from tests.workers.conftest import make_job

OVERFIT: dict[str, Any] = {"dense_optimizer": {"kind": "adam", "lr": 0.03},
                           "table_defaults": {"dim": 8, "capacity": 4096, "optimizer": {"kind": "sgd", "lr": 0.1}}}
"""``[ps]`` of a setup that overfits the 3k rows within a few epochs (a hot dense Adam)."""


def test_auc_is_the_default_metric_and_report_json_keeps_the_record(worker_data, tmp_path: Path) -> None:
    job = make_job(worker_data["plain"], tmp_path, mode="plain", ps=OVERFIT,
                   train={"epochs": 8, "val_fraction": 0.2, "early_stop_patience": 2})
    assert job.train.early_stop_metric.value == "auc"
    rep, run_dir = run_local(job, str(tmp_path / "run"), plots=False)
    on_disk = json.loads((run_dir / "report.json").read_text())
    val = on_disk["validation"]
    assert val == rep["worker"]["validation"]
    aucs, losses = val["aucs"], val["losses"]
    assert val["metric"] == "auc" and len(aucs) == len(losses) == len(val["head_aucs"]) == len(val["steps"])
    assert all(set(h) == {"click", "conversion"} for h in val["head_aucs"])
    for mean, heads in zip(aucs, val["head_aucs"]):
        assert mean == pytest.approx(np.mean(list(heads.values())))
    best = int(np.argmax(aucs))
    assert val["best_epoch"] == best and val["best_value"] == aucs[best] == val["best_auc"]
    assert val["best_loss"] == losses[best]
    assert best < len(aucs) - 1, f"setup no longer overfits: {aucs}"
    # stopped exactly `patience` epochs after the best AUC, and says so
    assert len(aucs) == best + 1 + 2 and val["stopped_early"]
    assert val["stop_reason"].startswith("patience: 2 epochs without a higher validation auc")
    assert Path(val["best_checkpoint"]).is_dir()


def test_stopping_on_auc_keeps_the_best_auc_epoch(worker_data, tmp_path: Path) -> None:
    """A hotter dense Adam (lr 0.1): the validation loss turns up at epoch 3, the AUC only after
    epoch 3 (measured: losses 0.627 0.583 0.581 0.592 ..., AUCs 0.664 0.748 0.781 0.791 0.780 ...).
    Stopping on the AUC keeps epoch 3, where the loss would have kept epoch 2; the restored
    model scores the kept epoch's validation AUC and loss."""
    hot = {**OVERFIT, "dense_optimizer": {"kind": "adam", "lr": 0.1}}
    job = make_job(worker_data["plain"], tmp_path, mode="plain", ps=hot,
                   train={"epochs": 8, "val_fraction": 0.2, "early_stop_patience": 2, "early_stop_metric": "auc"})
    rep, w = train_local(job, tmp_path / "run", checkpoint=False)
    val = rep["validation"]
    assert val["best_epoch"] == int(np.argmax(val["aucs"])) and len(val["aucs"]) == val["best_epoch"] + 1 + 2
    held = validation_split(w.dataset, 0.2, job.train.seed)
    batches = [(f, int(b)) for f, idx in held.items() for b in idx]
    assert mean_auc(validation_auc(w, batches)) == pytest.approx(val["best_auc"], abs=1e-9)
    assert validation_loss(w, batches) == pytest.approx(val["best_loss"], rel=1e-5)
    assert int(np.argmin(val["losses"])) < val["best_epoch"], "the loss would have stopped at the same epoch"
    assert all(math.isfinite(a) for a in val["aucs"])


def test_meta_mode_validates_on_the_adapted_auc(worker_data, tmp_path: Path) -> None:
    """Meta layout: the held-out batches are whole tasks; their AUC is after adaptation, as their loss is."""
    from common.evaluation import auc
    from workers.evaluation import score_batches

    job = make_job(worker_data["meta"], tmp_path, train={"epochs": 2, "val_fraction": 0.2, "early_stop_patience": 0})
    rep, w = train_local(job, tmp_path / "run", checkpoint=False)
    val = rep["validation"]
    assert val["metric"] == "auc" and len(val["aucs"]) == 2 and val["stop_reason"] == "epochs: all 2 epochs ran"
    assert val["best_epoch"] == int(np.argmax(val["aucs"]))
    held = validation_split(w.dataset, 0.2, job.train.seed)
    batches = [(f, int(b)) for f, idx in held.items() for b in idx]
    got = validation_auc(w, batches)
    assert mean_auc(got) == pytest.approx(val["best_auc"], abs=1e-9)
    reads = (x for f, b in batches for x in w.dataset.read_range(f, b, b + 1))
    scores = score_batches(w.model, w.rows, reads, w.trainer.inner_loop, adapt=True)
    for head, a in scores["adapted"].items():
        assert got[head] == pytest.approx(auc(a["target"].astype(np.float64), a["score"].astype(np.float64)), abs=1e-12)
    base = {h: auc(a["target"].astype(np.float64), a["score"].astype(np.float64)) for h, a in scores["base"].items()}
    assert base != pytest.approx(got, abs=1e-9), "adaptation changed nothing: the test cannot tell base from adapted"
