"""``metaps evaluate``: a checkpoint scored under episodes equals the training-time evaluation; first-k, plain, GAUC."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from meta_io.build import MetaIOBuildConfig, build
from meta_io.firstk import first_k_layout, read_table
from meta_io.schema import load_schema
from metaps.cli import main
from common.evaluation import auc
from workers.eval_protocols import gauc
from workers.local import train_local

from tests.workers.conftest import make_job


@pytest.fixture(scope="module")
def eval_set(worker_data, tmp_path_factory) -> dict[str, Path]:
    """The first of the training data's two raw files (1.5k rows), as Parquet and built as Meta-IO.

    Every check below compares two evaluations of the same rows (or counts them), so half
    the rows test the same; each of the ~6 evaluations of the module costs half as much.
    """
    root = tmp_path_factory.mktemp("evalproto-half")
    raw = root / "raw"
    raw.mkdir()
    first = min(worker_data["raw"].glob("*.parquet"))
    shutil.copy(first, raw / first.name)
    shutil.copy(worker_data["schema"], raw / "schema.json")
    meta = build(raw, raw / "schema.json", root / "meta", MetaIOBuildConfig(support=4, query=4, rows_per_batch=64)).out_dir
    return {"raw": raw, "meta": meta}


@pytest.fixture(scope="module")
def trained(worker_data, eval_set, tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("evalproto")
    # few steps: many eval ids were never trained (they read their initial rows on both sides)
    job = make_job(worker_data["meta"], tmp, eval_path=eval_set["meta"], train={"max_steps": 12},
                   meta={"inner_steps": 2, "inner_lr": 0.2})
    report, _ = train_local(job, tmp / "run")
    return report, Path(report["checkpoint"])


def _evaluate(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["evaluate", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def episodes(trained, eval_set, tmp_path_factory) -> tuple[dict, Path]:
    """``metaps evaluate --checkpoint ... --protocol episodes --out``: (stdout JSON, the --out file)."""
    out = tmp_path_factory.mktemp("episodes") / "report.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["evaluate", "--checkpoint", str(trained[1]), "--data", str(eval_set["meta"]),
                     "--protocol", "episodes", "--out", str(out)]) == 0
    return json.loads(buf.getvalue().strip().splitlines()[-1]), out


def test_checkpoint_episodes_equal_the_training_time_evaluation(trained, episodes, eval_set, capsys) -> None:
    report, ckpt = trained
    got, out = episodes
    assert json.loads(out.read_text()) == got
    want = report["eval"]
    assert got["meta"]["inner_steps"] == 2 and got["meta"]["inner_lr"] == 0.2  # the checkpoint's [meta]
    for kind in ("base", "adapted"):
        for head, m in want[kind].items():
            assert got[kind][head]["rows"] == m["rows"]
            assert abs(got[kind][head]["auc"] - m["auc"]) < 1e-6, (kind, head)
            assert abs(got[kind][head]["logloss"] - m["logloss"]) < 1e-6, (kind, head)
            assert "gauc" in got[kind][head] and "norm_auc" in got[kind][head]
    assert got["gain"]["click"]["auc"] == pytest.approx(got["adapted"]["click"]["auc"] - got["base"]["click"]["auc"])
    # overriding the inner loop changes the adapted score, never the base one
    other = _evaluate(capsys, "--checkpoint", str(ckpt), "--data", str(eval_set["meta"]),
                      "--protocol", "episodes", "--inner-steps", "0")
    assert "adapted" not in other and other["base"]["click"]["auc"] == got["base"]["click"]["auc"]


def test_first_k_scores_every_later_row_once_and_plain_every_row(trained, worker_data, eval_set, capsys) -> None:
    _, ckpt = trained
    schema = load_schema(worker_data["schema"])
    table = read_table(eval_set["raw"], schema)
    lay = first_k_layout(table.column(schema.task_key).to_numpy(), table.column(schema.timestamp).to_numpy(), 3)
    fk = _evaluate(capsys, "--checkpoint", str(ckpt), "--data", str(eval_set["raw"]), "--protocol", "first-k",
                   "--k", "3", "--query-slots", "8")
    assert fk["k"] == 3 and fk["rows"] == lay.query_rows.shape[0] == fk["adapted"]["click"]["rows"]
    assert fk["tasks"] == lay.task_keys.shape[0]
    plain = _evaluate(capsys, "--checkpoint", str(ckpt), "--data", str(eval_set["raw"]), "--protocol", "plain")
    assert plain["rows"] == table.num_rows and "adapted" not in plain
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(worker_data["meta"]), "--protocol", "first-k"]) == 1
    assert "first-k reads Parquet/CSV rows" in capsys.readouterr().err


def test_gauc_is_the_row_weighted_mean_of_task_aucs() -> None:
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 30, 2000)
    y = (rng.random(2000) < 0.3).astype(np.float64)
    s = rng.random(2000) + 0.3 * y
    total = weight = 0.0
    for k in np.unique(keys):
        sel = keys == k
        if 0 < y[sel].sum() < sel.sum():
            total += auc(y[sel], s[sel]) * sel.sum()
            weight += sel.sum()
    assert gauc(keys, y, s) == pytest.approx(total / weight, abs=1e-12)
    assert np.isnan(gauc(np.zeros(4, np.int64), np.ones(4), np.arange(4.0)))


def test_bundle_evaluates_like_its_checkpoint(trained, episodes, eval_set, tmp_path, capsys) -> None:
    _, ckpt = trained
    assert main(["deliver", "--no-gate", "--checkpoint", str(ckpt), "--out", str(tmp_path / "b")]) == 0
    args = ["--data", str(eval_set["meta"]), "--protocol", "episodes"]
    from_ckpt = episodes[0]
    from_bundle = _evaluate(capsys, "--bundle", str(tmp_path / "b"), *args)
    assert from_bundle["source"]["version"] == "v000001"
    for kind in ("base", "adapted"):
        for head, m in from_ckpt[kind].items():
            assert abs(from_bundle[kind][head]["auc"] - m["auc"]) < 1e-6, (kind, head)
            assert abs(from_bundle[kind][head]["gauc"] - m["gauc"]) < 1e-6, (kind, head)
