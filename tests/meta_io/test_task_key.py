"""The task key apart from features: a ``key`` column groups rows into tasks without being a feature.

Real Parquet/CSV files, a real Meta-IO build, split-holdout and the first-k layout:

* a string key of kind ``key`` builds exactly the episodes of the equivalent integer key;
* the same data grouped by a ``key`` or a ``sparse`` column gives the same tasks, but only
  the ``sparse`` one is an embedding table;
* the task key of Meta-IO, first-k, split-holdout and evaluation batches is the key column;
* a missing key column, a null key and a task key of another kind are clear errors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meta_io import layout as L
from meta_io.build import MetaIOBuildConfig, build
from meta_io.holdout import read_task_keys, split_by_task
from meta_io.reader import MetaIODataset
from meta_io.schema import ColumnKind, ColumnSpec, Schema, load_schema, schema_from_dict
from meta_io.source import iter_source
from common.errors import DataError, SchemaError
from common.hashing import hash_strings

N = 90
USERS = 9


def _rows(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = rng.integers(0, USERS, size=N)
    return {
        "uid": np.array([f"user-{int(i)}" for i in k], dtype=object),
        "uid_int": k.astype(np.int64) * 1000 + 7,  # the same grouping, as integers
        "item": rng.integers(0, 50, size=N).astype(np.int64),
        "price": rng.gamma(2.0, 3.0, size=N),
        "ts": 1_700_000_000 + rng.integers(0, 40, size=N).astype(np.int64),  # many ties on time
        "click": rng.integers(0, 2, size=N).astype(np.int64),
        "rid": np.arange(N, dtype=np.int64),  # unique per row: a fingerprint for the tests
    }


def _schema(task_key: str, uid_kind: ColumnKind = ColumnKind.KEY) -> Schema:
    uid = ColumnSpec("uid", uid_kind, table="user" if uid_kind == ColumnKind.SPARSE else "")
    s = Schema(
        columns=[uid, ColumnSpec("uid_int", ColumnKind.KEY), ColumnSpec("item", ColumnKind.SPARSE, table="item"),
                 ColumnSpec("price", ColumnKind.DENSE), ColumnSpec("ts", ColumnKind.TIMESTAMP),
                 ColumnSpec("click", ColumnKind.LABEL), ColumnSpec("rid", ColumnKind.DENSE)],
        task_key=task_key, labels=["click"], timestamp="ts",
    )
    s.validate()
    return s


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same rows as two Parquet files (string uid) and as one CSV file."""
    root = tmp_path_factory.mktemp("taskkey")
    rows = _rows()
    table = pa.table({k: pa.array(list(v) if v.dtype == object else v) for k, v in rows.items()})
    (root / "pq").mkdir()
    pq.write_table(table.slice(0, 50), root / "pq" / "a.parquet")
    pq.write_table(table.slice(50), root / "pq" / "b.parquet")
    (root / "csv").mkdir()
    lines = [",".join(rows)] + [",".join(str(rows[c][i]) for c in rows) for i in range(N)]
    (root / "csv" / "a.csv").write_text("\n".join(lines) + "\n")
    return {"root": root, "parquet": root / "pq", "csv": root / "csv"}


def _episodes(out: Path) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(task key, support row ids in slot order, query row ids in slot order) per real episode."""
    ds = MetaIODataset(out)
    eps = []
    for mb in ds.iter_all():
        if not hasattr(mb, "support"):
            continue
        dense_s, dense_q = mb.support.dense[..., 1], mb.query.dense[..., 1]  # rid is the 2nd dense column
        for t in range(mb.task_keys.shape[0]):  # test code: a loop over task slots is fine
            if not bool(mb.task_mask[t]):
                continue
            sup = tuple(int(x) for x, m in zip(dense_s[t], mb.support.mask[t]) if m)
            qry = tuple(int(x) for x, m in zip(dense_q[t], mb.query.mask[t]) if m)
            eps.append((int(mb.task_keys[t]), sup, qry))
    return eps


def _leftover_rids(out: Path) -> list[int]:
    ds = MetaIODataset(out)
    return sorted(int(x) for b in ds.leftover() for x, m in zip(b.features.dense[..., 1], b.features.mask) if m)


CFG = MetaIOBuildConfig(support=3, query=2, rows_per_batch=20)


def test_string_key_builds_the_episodes_of_the_equivalent_integer_key(data, tmp_path: Path) -> None:
    by_str = build(data["parquet"], _schema("uid"), tmp_path / "str", CFG).out_dir
    by_int = build(data["parquet"], _schema("uid_int"), tmp_path / "int", CFG).out_dir
    es, ei = _episodes(by_str), _episodes(by_int)
    assert es and len(es) == len(ei)
    # the same episodes (rows, support/query cut, slot order); only the key values differ
    assert sorted(e[1:] for e in es) == sorted(e[1:] for e in ei)
    assert _leftover_rids(by_str) == _leftover_rids(by_int)
    # the string key is hashed like a string id; the integer key is kept
    rows = _rows()
    uid_of = dict(zip(rows["rid"].tolist(), rows["uid"].tolist()))
    want = {int(h) for h in hash_strings(pa.array(sorted(set(rows["uid"].tolist()))))}
    assert {e[0] for e in es} <= want
    for key, sup, _ in es:
        assert int(hash_strings(pa.array([uid_of[sup[0]]]))[0]) == key
    int_of = dict(zip(rows["rid"].tolist(), rows["uid_int"].tolist()))
    assert all(int_of[sup[0]] == key for key, sup, _ in ei)
    # a key column is no id table: nothing of it in the manifest's tables or the ids sidecars
    assert load_schema_tables(by_str) == ["item"]


def load_schema_tables(out: Path) -> list[str]:
    return MetaIODataset(out).schema.tables


def test_csv_and_parquet_string_keys_agree_and_key_equals_sparse(data, tmp_path: Path) -> None:
    pq_eps = _episodes(build(data["parquet"], _schema("uid"), tmp_path / "p", CFG).out_dir)
    csv_eps = _episodes(build(data["csv"], _schema("uid"), tmp_path / "c", CFG).out_dir)
    assert sorted(pq_eps) == sorted(csv_eps)
    # grouped by the same column declared sparse (a feature): the very same tasks and keys
    sparse = build(data["parquet"], _schema("uid", ColumnKind.SPARSE), tmp_path / "s", CFG).out_dir
    assert sorted(_episodes(sparse)) == sorted(pq_eps)
    assert MetaIODataset(sparse).schema.tables == ["user", "item"]


def test_key_errors_name_the_problem(data, tmp_path: Path) -> None:
    # a task key of another kind: a one-line error naming the column, its kind and the allowed kinds
    d = _schema("uid").to_dict()
    d["columns"][0]["kind"] = "extra"
    with pytest.raises(SchemaError, match=r"task key 'uid' is a column of kind 'extra'.*'key'.*'sparse'"):
        schema_from_dict(d)
    with pytest.raises(SchemaError, match=r"task key 'price' is a column of kind 'dense'"):
        build(data["parquet"], _schema("uid"), tmp_path / "o", MetaIOBuildConfig(task_key="price"))
    with pytest.raises(SchemaError, match="task key 'nope' is not a column"):
        build(data["parquet"], _schema("uid"), tmp_path / "o", MetaIOBuildConfig(task_key="nope"))
    # the key column missing from a file
    (tmp_path / "miss").mkdir()
    pq.write_table(pq.read_table(data["parquet"] / "a.parquet").drop(["uid"]), tmp_path / "miss" / "m.parquet")
    with pytest.raises(DataError, match=r"m\.parquet: missing column \['uid'\]"):
        build(tmp_path / "miss", _schema("uid"), tmp_path / "o", CFG)
    # a null key: file, column and row; also in CSV (an empty cell)
    t = pq.read_table(data["parquet"] / "a.parquet")
    uid = t.column("uid").to_pylist()
    uid[17] = None
    (tmp_path / "null").mkdir()
    pq.write_table(t.set_column(0, "uid", pa.array(uid, pa.string())), tmp_path / "null" / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet: column 'uid' \(key\): row 17: null task key"):
        build(tmp_path / "null", _schema("uid"), tmp_path / "o", CFG)
    text = (data["csv"] / "a.csv").read_text().splitlines()
    cells = text[4].split(",")
    cells[1] = ""  # uid_int of data row 3
    text[4] = ",".join(cells)
    (tmp_path / "nullcsv").mkdir()
    (tmp_path / "nullcsv" / "n.csv").write_text("\n".join(text) + "\n")
    with pytest.raises(DataError, match=r"n\.csv: column 'uid_int' \(key\): row 3: null task key"):
        build(tmp_path / "nullcsv", _schema("uid_int"), tmp_path / "o", CFG)
    # a key column that is not the task key still needs a value on every row
    with pytest.raises(DataError, match=r"column 'uid_int' \(key\): row 3: null key"):
        build(tmp_path / "nullcsv", _schema("uid"), tmp_path / "o", CFG)
    assert not (tmp_path / "o").exists()


def test_split_holdout_by_a_string_key(data, tmp_path: Path) -> None:
    schema = _schema("uid")
    a = split_by_task(data["parquet"], schema, tmp_path / "a", fraction=0.4, seed=2)
    assert 0 < a.holdout_tasks < USERS and a.train_rows + a.holdout_rows == N
    split_schema = load_schema(a.schema_path)
    assert split_schema.column("uid").kind == ColumnKind.KEY

    def rids(path: Path) -> set[int]:
        return {int(x) for sb in iter_source(path, split_schema) for x in sb.table.column("rid").to_pylist()}

    held = rids(a.holdout_dir)
    rows = _rows()
    held_users = sorted({u for u, r in zip(rows["uid"].tolist(), rows["rid"].tolist()) if r in held})
    assert len(held_users) == a.holdout_tasks
    # the keys file split-holdout writes holds the imported (hashed) keys ...
    written = read_task_keys(a.holdout_dir.parent / "holdout_keys.txt")
    assert written.tolist() == sorted(int(h) for h in hash_strings(pa.array(held_users)))
    b = split_by_task(data["parquet"], schema, tmp_path / "b", keys=written)
    assert rids(b.holdout_dir) == held
    # ... and a keys file of the raw string keys reproduces the same split
    (tmp_path / "raw.txt").write_text("\n".join(held_users) + "\n")
    c = split_by_task(data["parquet"], schema, tmp_path / "c", keys=read_task_keys(tmp_path / "raw.txt"))
    assert rids(c.holdout_dir) == held and rids(c.train_dir) == set(range(N)) - held
    # the split output groups alike: building it by the key gives the same episodes as the raw input's tasks
    eps = _episodes(build(a.holdout_dir, split_schema, tmp_path / "m", CFG).out_dir)
    assert {r for e in eps for r in e[1] + e[2]} <= held


def test_first_k_and_evaluation_batches_carry_the_key_column(data) -> None:
    from meta_io.firstk import first_k_batches, read_table
    from workers.eval_protocols import _row_keys, protocol_batches

    schema = _schema("uid")
    table = read_table(data["parquet"], schema)
    hashed = hash_strings(pa.array(_rows()["uid"].tolist()))
    assert table.column("uid").to_numpy().tolist() == hashed.tolist()
    keys = set()
    for mb in first_k_batches(table, schema, k=2, query_slots=4, tasks_per_batch=4):
        keys |= {int(k) for k, m in zip(mb.task_keys, mb.task_mask) if m}
        assert "uid" not in mb.support.ids  # not a feature
    assert keys and keys <= set(hashed.tolist())
    # plain rows of Parquet/CSV are grouped by the key column for per-task GAUC
    got = np.concatenate([_row_keys(b, schema.task_key) for b in protocol_batches("plain", data["parquet"], schema)])
    assert got.tolist() == hashed.tolist()


def test_plain_evaluation_of_a_meta_io_dataset_keys_every_row(data, tmp_path: Path) -> None:
    """Support, query and leftover (one-row task) rows all get their key column's value."""
    from workers.eval_protocols import _row_keys, protocol_batches

    schema = _schema("uid")
    rows = _rows()
    one = rows["uid"][0]
    keep = np.array([u != one for u in rows["uid"].tolist()])
    keep[0] = True  # user `one` keeps a single row: a leftover task
    (tmp_path / "lo").mkdir()
    table = pa.table({k: pa.array(list(v[keep]) if v.dtype == object else v[keep]) for k, v in rows.items()})
    pq.write_table(table, tmp_path / "lo" / "x.parquet")
    out = build(tmp_path / "lo", schema, tmp_path / "m2", CFG).out_dir
    assert MetaIODataset(out).manifest["totals"]["leftover_rows"] >= 1
    got = np.concatenate([_row_keys(b, schema.task_key) for b in protocol_batches("plain", out, schema)])
    want = hash_strings(pa.array(rows["uid"][keep].tolist()))
    assert sorted(got.tolist()) == sorted(want.tolist())


def test_schema_kind_key_round_trips_and_validates(tmp_path: Path) -> None:
    s = _schema("uid")
    s.save(tmp_path / "s.json")
    back = load_schema(tmp_path / "s.json")
    assert back == s and back.column("uid").kind == ColumnKind.KEY
    assert [c.name for c in back.id_columns] == ["item"] and back.tables == ["item"]
    bad = dataclasses.replace(s.columns[0], table="user")
    with pytest.raises(ValueError, match=r"column 'uid' \(key\) cannot have a table"):
        bad.validate()
