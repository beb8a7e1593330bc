"""Held-out split by task: disjoint tasks, every row exactly once, re-readable, deterministic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from meta_io.build import MetaIOBuildConfig, build
from meta_io.holdout import holdout_mask, split_by_task
from meta_io.reader import MetaIODataset
from meta_io.schema import load_schema
from meta_io.source import iter_source
from common.errors import DataError


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


def _split_cli(*args: str) -> int:
    from metaps.cli import main

    return main(["meta-io", "split-holdout", *args])


def test_seeded_fraction_and_keys_file_reproduce_a_split(generated, tmp_path: Path, capsys) -> None:
    src = ["--input", str(generated.out_dir), "--schema", str(generated.schema_path)]
    assert _split_cli(*src, "--out", str(tmp_path / "a"), "--fraction", "0.3", "--seed", "5") == 0
    assert _split_cli(*src, "--out", str(tmp_path / "b"), "--fraction", "0.3", "--seed", "5") == 0
    assert _split_cli(*src, "--out", str(tmp_path / "c"), "--fraction", "0.3", "--seed", "6") == 0
    keys_a = (tmp_path / "a" / "holdout_keys.txt").read_text()
    assert keys_a == (tmp_path / "b" / "holdout_keys.txt").read_text()  # same seed: same split
    assert keys_a != (tmp_path / "c" / "holdout_keys.txt").read_text()  # the seed matters
    # an external split (here: a's key list, shuffled, with a blank line) is reproduced exactly
    ext = [ln for ln in keys_a.splitlines()]
    np.random.default_rng(0).shuffle(ext)
    (tmp_path / "ext.txt").write_text("\n".join(ext[:3] + [""] + ext[3:]) + "\n")
    assert _split_cli(*src, "--out", str(tmp_path / "d"), "--keys", str(tmp_path / "ext.txt")) == 0
    schema = load_schema(tmp_path / "a" / "schema.json")
    assert sorted(_rows(tmp_path / "d" / "holdout", schema)) == sorted(_rows(tmp_path / "a" / "holdout", schema))
    assert sorted(_rows(tmp_path / "d" / "train", schema)) == sorted(_rows(tmp_path / "a" / "train", schema))
    with pytest.raises(SystemExit):  # --keys and --fraction are exclusive
        _split_cli(*src, "--out", str(tmp_path / "e"), "--keys", str(tmp_path / "ext.txt"), "--fraction", "0.2")


def test_keys_file_of_raw_string_keys(user_parquet, example_schema, tmp_path: Path) -> None:
    from common.hashing import hash_strings

    from meta_io.holdout import read_task_keys

    (tmp_path / "keys.txt").write_text("u1\nu3\n")
    keys = read_task_keys(tmp_path / "keys.txt")
    res = split_by_task(user_parquet, example_schema, tmp_path / "s", keys=keys)
    want = set(hash_strings(pa.array(["u1", "u3"])).tolist())
    hold = {k for sb in iter_source(res.holdout_dir, load_schema(res.schema_path))
            for k in sb.table.column("uid").to_pylist()}
    train = {k for sb in iter_source(res.train_dir, load_schema(res.schema_path))
             for k in sb.table.column("uid").to_pylist()}
    assert hold == want and not (train & want)
    (tmp_path / "none.txt").write_text("nobody\n")
    with pytest.raises(DataError, match="none of the 1 given task keys"):
        split_by_task(user_parquet, example_schema, tmp_path / "s2", keys=read_task_keys(tmp_path / "none.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(DataError, match="names no key"):
        read_task_keys(tmp_path / "empty.txt")
