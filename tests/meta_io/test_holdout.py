"""Held-out split by task: disjoint tasks, every row exactly once, re-readable, deterministic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meta_io.build import MetaIOBuildConfig, build
from meta_io.holdout import holdout_mask, split_by_task
from meta_io.reader import MetaIODataset
from meta_io.schema import load_schema
from meta_io.source import iter_source
from metaps.core.errors import DataError


def _rows(path: Path, schema) -> list[tuple[int, int, int]]:
    out = []
    for sb in iter_source(path, schema):
        t = sb.table
        out.extend(zip(t.column(schema.task_key).to_pylist(), t.column(schema.timestamp).to_pylist(),
                       t.column("item_id").to_pylist()))
    return out


def test_split_is_by_task_and_loses_nothing(generated, generated_schema, tmp_path: Path) -> None:
    res = split_by_task(generated.out_dir, generated_schema, tmp_path / "split", fraction=0.2, seed=1)
    assert res.train_rows + res.holdout_rows == generated.rows
    assert res.holdout_tasks > 0
    split_schema = load_schema(res.schema_path)
    train = _rows(res.train_dir, split_schema)
    hold = _rows(res.holdout_dir, split_schema)
    assert sorted(train + hold) == sorted(_rows(generated.out_dir, generated_schema))
    assert not ({r[0] for r in train} & {r[0] for r in hold}), "a task is on both sides"
    # multi-hot lists survive the round trip (padding removed, re-padded identically by iter_source)
    mh = [c.name for c in generated_schema.columns if c.kind.value == "multi_hot"][0]

    def lists(path: Path, schema) -> list[tuple]:
        out = []
        for sb in iter_source(path, schema):
            t = sb.table
            out.extend(zip(t.column(schema.task_key).to_pylist(), t.column(schema.timestamp).to_pylist(),
                           t.column("item_id").to_pylist(), map(tuple, t.column(mh).to_pylist())))
        return sorted(out)

    assert sorted(lists(res.train_dir, split_schema) + lists(res.holdout_dir, split_schema)) == lists(
        generated.out_dir, generated_schema
    )


def test_split_builds_into_meta_io(generated, generated_schema, tmp_path: Path) -> None:
    res = split_by_task(generated.out_dir, generated_schema, tmp_path / "split", fraction=0.25)
    ds = build(res.holdout_dir, res.schema_path, tmp_path / "ho", MetaIOBuildConfig(support=4, query=4, rows_per_batch=64))
    totals = ds.manifest["totals"]
    assert totals["input_rows"] == res.holdout_rows
    assert MetaIODataset(ds.out_dir).total_batches > 0


def test_mask_is_deterministic_and_near_fraction() -> None:
    keys = np.arange(100_000, dtype=np.int64)
    m1, m2 = holdout_mask(keys, 0.1, seed=3), holdout_mask(keys, 0.1, seed=3)
    assert np.array_equal(m1, m2)
    assert 0.09 < m1.mean() < 0.11
    assert not np.array_equal(m1, holdout_mask(keys, 0.1, seed=4))
    with pytest.raises(ValueError, match="fraction"):
        holdout_mask(keys, 1.5)


def test_refuses_non_empty_output(generated, generated_schema, tmp_path: Path) -> None:
    (tmp_path / "split" / "train").mkdir(parents=True)
    (tmp_path / "split" / "train" / "x.parquet").write_text("keep me")
    with pytest.raises(DataError, match="not empty"):
        split_by_task(generated.out_dir, generated_schema, tmp_path / "split", fraction=0.2)
    assert (tmp_path / "split" / "train" / "x.parquet").read_text() == "keep me"
