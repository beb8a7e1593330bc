"""`metaps predict` on serving data: labels optional, evaluation only when present, atomic output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delivery.loader import load_bundle
from metaps.cli import main
from common.evaluation import auc
from tests.delivery.conftest import live_features, write_parquet


@pytest.fixture()
def bundle(tmp_path, history) -> Path:
    out = tmp_path / "bundles"
    assert main(["deliver", "--no-gate", "--checkpoint", str(history.ckpts[30]), "--out", str(out)]) == 0
    return out


def drop(path: Path, columns: list[str]) -> Path:
    t = pq.read_table(path)
    pq.write_table(t.drop_columns(columns), str(path))
    return path


def test_predict_scores_unlabeled_data(tmp_path, bundle, history, tiny, capsys) -> None:
    fb = live_features(tiny, history.live[30], rows=40, seed=5)
    data = write_parquet(tmp_path / "day.parquet", tiny, fb, {h: np.zeros(40) for h in tiny.schema.labels})
    drop(data, list(tiny.schema.labels))
    capsys.readouterr()
    out = tmp_path / "s.parquet"
    assert main(["--json", "predict", "--bundle", str(bundle), "--data", str(data), "--out", str(out), "--batch-rows",
                 "16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # no evaluation without labels
    assert json.loads(lines[0]) == {"bundle": "v000001", "rows": 40, "out": str(out), "unknown_ids": 0,
                                   "unknown_share": 0.0, "adapted": False, "recipe": "", "recipe_from": ""}
    scores = pq.read_table(out).to_pydict()
    want = load_bundle(bundle).predict(fb)
    assert scores["row"] == list(range(40))
    for h in tiny.schema.labels:
        np.testing.assert_allclose(scores[f"p_{h}"], want[h].numpy(), atol=1e-6)


def test_predict_evaluates_the_labels_that_are_present(tmp_path, bundle, history, tiny, capsys) -> None:
    fb = live_features(tiny, history.live[30], rows=60, seed=6)
    rng = np.random.default_rng(0)
    labels = {h: rng.integers(0, 2, 60).astype(np.float32) for h in tiny.schema.labels}
    first, second = tiny.schema.labels[0], tiny.schema.labels[1]
    data = drop(write_parquet(tmp_path / "day.parquet", tiny, fb, labels), [second])
    capsys.readouterr()
    out = tmp_path / "s.parquet"
    assert main(["--json", "predict", "--bundle", str(bundle), "--data", str(data), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1  # --json: one object, the evaluation inside it
    res = json.loads(printed[0])
    assert res["rows"] == 60
    assert res["eval"]["labels"] == [first]
    scores = pq.read_table(out).column(f"p_{first}").to_numpy()
    assert res["eval"]["auc"][first] == pytest.approx(auc(labels[first], scores), abs=1e-4)


def test_failed_predict_leaves_no_file_at_out(tmp_path, bundle, history, tiny, capsys) -> None:
    folder = tmp_path / "day"
    folder.mkdir()
    fb = live_features(tiny, history.live[30], rows=40, seed=7)
    write_parquet(folder / "a.parquet", tiny, fb, {h: np.zeros(40) for h in tiny.schema.labels})
    # the second file (read after the first one's batches were scored and written) has a bad value
    bad = write_parquet(folder / "b.parquet", tiny, fb, {h: np.zeros(40) for h in tiny.schema.labels})
    t = pq.read_table(bad)
    dense = tiny.schema.dense_columns[0].name
    vals = t.column(dense).to_numpy().copy()
    vals[3] = np.nan
    pq.write_table(t.set_column(t.schema.get_field_index(dense), dense, pa.array(vals)), str(bad))
    out = tmp_path / "s.parquet"
    capsys.readouterr()
    assert main(["predict", "--bundle", str(bundle), "--data", str(folder), "--out", str(out),
                 "--batch-rows", "8"]) == 1
    err = capsys.readouterr().err
    assert "b.parquet" in err and dense in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundles", "day"]  # no temporary file either
    # a previous output is kept as it was
    out.write_bytes(b"previous")
    assert main(["predict", "--bundle", str(bundle), "--data", str(folder), "--out", str(out)]) == 1
    assert out.read_bytes() == b"previous"
    # a missing feature column: named, and nothing written
    drop(folder / "b.parquet", [tiny.schema.id_columns[1].name])
    out.unlink()
    assert main(["predict", "--bundle", str(bundle), "--data", str(folder), "--out", str(out)]) == 1
    assert tiny.schema.id_columns[1].name in capsys.readouterr().err
    assert not out.exists()
