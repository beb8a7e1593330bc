"""Early stopping on a validation set of its own (``[data] validation``): the later rows of a
time split, so the epoch kept is the one that scores the future best (issue 29 item 5).

A real ``train-local`` (``workers.local.train_local``) over the past of 3k generated rows, built
as a meta layout; validation on the future's Meta-IO set. Judged on what trained and what the
restored model scores: every train batch trains (none is held out), and the recorded best AUC
is the restored model's adapted AUC on every batch of the validation set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meta_io.build import MetaIOBuildConfig, build
from meta_io.holdout import split_by_time
from meta_io.layout import Layout
from meta_io.reader import MetaIODataset
from meta_io.schema import load_schema
from common.errors import ConfigError, MetapsError
from common.evaluation import auc
from workers.local import train_local

from tests.workers.conftest import make_job


@pytest.fixture(scope="module")
def time_data(worker_data, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("time-split")
    split = split_by_time(worker_data["raw"], load_schema(worker_data["schema"]), root / "split", fraction=0.25)
    cfg = MetaIOBuildConfig(support=4, query=4, rows_per_batch=64)
    return {"train": build(split.train_dir, split.schema_path, root / "past", cfg).out_dir,
            "validation": build(split.holdout_dir, split.schema_path, root / "future", cfg).out_dir,
            "plain_validation": build(split.holdout_dir, split.schema_path, root / "future-plain",
                                      MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=64)).out_dir}


def test_validation_on_the_future_set_trains_every_batch_and_keeps_the_best(time_data, tmp_path: Path) -> None:
    from workers.evaluation import score_batches

    job = make_job(time_data["train"], tmp_path, data={"validation": str(time_data["validation"])},
                   train={"epochs": 3, "early_stop_patience": 0})
    rep, w = train_local(job, tmp_path / "run", checkpoint=False)
    val = rep["validation"]
    train_batches = MetaIODataset(time_data["train"]).total_batches
    # no batch of the train set was held out: every epoch trained all of them
    assert val["steps"] == [train_batches * (e + 1) for e in range(3)], (val["steps"], train_batches)
    assert val["best_epoch"] == int(np.argmax(val["aucs"])) and val["stop_reason"] == "epochs: all 3 epochs ran"
    # the restored model's adapted AUC on the whole future set is the recorded best
    vds = MetaIODataset(time_data["validation"])
    reads = (b for f in range(vds.num_files) for b in vds.read_range(f, 0, vds.num_batches(f)))
    scores = score_batches(w.model, w.rows, reads, w.trainer.inner_loop, adapt=True)
    heads = {h: float(auc(a["target"].astype(np.float64), a["score"].astype(np.float64)))
             for h, a in scores["adapted"].items()}
    assert set(heads) == {"click", "conversion"}
    assert float(np.mean(list(heads.values()))) == pytest.approx(val["best_auc"], abs=1e-9)
    for h, a in heads.items():
        assert a == pytest.approx(val["head_aucs"][val["best_epoch"]][h], abs=1e-9)


def test_validation_and_val_fraction_together_are_refused(time_data, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.validation and train.val_fraction both"):
        make_job(time_data["train"], tmp_path, data={"validation": str(time_data["validation"])},
                 train={"val_fraction": 0.2})


def test_preflight_names_a_missing_or_mislaid_validation_set(time_data, tmp_path: Path) -> None:
    from metaps.preflight import PreflightError, preflight

    missing = make_job(time_data["train"], tmp_path, data={"validation": str(tmp_path / "nope")})
    with pytest.raises(PreflightError, match=r"data.validation = .*nope: no such directory"):
        preflight(missing, build_model=False)
    plain = make_job(time_data["train"], tmp_path, data={"validation": str(time_data["plain_validation"])})
    with pytest.raises(MetapsError, match=r"data.validation = .*layout 'plain', but data.train is 'meta'"):
        preflight(plain, build_model=False)
