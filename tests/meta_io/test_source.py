"""meta_io.source: user Parquet/CSV import, normalization rules and every bad-input error."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meta_io.schema import PAD_ID, ColumnKind, ColumnSpec, Schema
from meta_io.source import count_rows, iter_source, normalized_arrow_schema
from common.errors import DataError, SchemaError
from common.hashing import hash_strings

from .conftest import USER_ROWS, user_rows, user_table, write_user_csv, write_user_parquet


def read_all(path: Path, schema: Schema, batch_rows: int = 16) -> pa.Table:
    return pa.concat_tables([b.table for b in iter_source(path, schema, batch_rows=batch_rows)])


def with_column(table: pa.Table, name: str, arr: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, arr)


def write(tmp_path: Path, table: pa.Table, name: str = "bad.parquet") -> Path:
    path = tmp_path / name
    pq.write_table(table, path, row_group_size=16)
    return path


# -- good input ---------------------------------------------------------------------


def test_parquet_and_csv_normalize_to_the_same_table(user_parquet: Path, user_csv: Path, example_schema: Schema) -> None:
    a = read_all(user_parquet, example_schema)
    b = read_all(user_csv, example_schema)
    assert a.schema == normalized_arrow_schema(example_schema)
    assert a.column_names == [c.name for c in example_schema.columns]  # "unused" is dropped
    assert a.num_rows == b.num_rows == 2 * USER_ROWS
    for name in a.column_names:
        assert a.column(name).equals(b.column(name)), name


def test_normalization_rules(user_parquet: Path, example_schema: Schema) -> None:
    rows = user_rows(seed=0)
    t = read_all(user_parquet / "day-0.parquet", example_schema)
    # string ids hashed, int ids kept
    assert t.column("uid").to_numpy().tolist() == hash_strings(pa.array(rows["uid"])).tolist()
    assert t.column("item").to_numpy().tolist() == rows["item"]
    # multi-hot: hashed tokens, -1 padded to max_len 4, truncated beyond
    tags = np.stack(t.column("tags").to_numpy(zero_copy_only=False))
    assert tags.shape == (USER_ROWS, 4)
    for i in (0, 1, 5):
        want = hash_strings(pa.array(rows["tags"][i][:4], pa.string())).tolist()
        assert tags[i].tolist() == want + [PAD_ID] * (4 - len(want))
    empty = [i for i, tg in enumerate(rows["tags"]) if not tg]
    assert empty and (tags[empty] == PAD_ID).all()
    # text: int tokens kept, truncated to 8
    query = np.stack(t.column("query").to_numpy(zero_copy_only=False))
    long_rows = [i for i, q in enumerate(rows["query"]) if len(q) > 8]
    assert long_rows
    for i in long_rows[:3] + [0]:
        q = rows["query"][i][:8]
        assert query[i].tolist() == q + [PAD_ID] * (8 - len(q))
    # vector, dense, labels, timestamp (ms -> s), extra
    emb = np.stack(t.column("emb").to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(emb, np.asarray(rows["emb"], dtype=np.float32))
    assert t.column("price").type == pa.float32()
    assert t.column("bought").to_numpy().tolist() == [float(x) for x in rows["bought"]]
    assert t.column("ts").to_numpy().tolist() == rows["ts"]
    assert t.column("note").to_pylist() == rows["note"]


def test_batches_stream_per_file_with_row_offsets(user_parquet: Path, user_csv: Path, example_schema: Schema) -> None:
    for folder, suffix in ((user_parquet, "parquet"), (user_csv, "csv")):
        got = [(b.file.name, b.first_row, b.num_rows) for b in iter_source(folder, example_schema, batch_rows=15)]
        assert got == [
            (f"day-0.{suffix}", 0, 15), (f"day-0.{suffix}", 15, 15), (f"day-0.{suffix}", 30, 10),
            (f"day-1.{suffix}", 0, 15), (f"day-1.{suffix}", 15, 15), (f"day-1.{suffix}", 30, 10),
        ]
        assert count_rows(folder, example_schema) == 2 * USER_ROWS


def test_truncation_logged_once_per_file(user_parquet: Path, example_schema: Schema, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="meta_io.source"):
        read_all(user_parquet, example_schema, batch_rows=8)
    recs = [r for r in caplog.records if r.getMessage() == "lists truncated to max_len"]
    assert len(recs) == 2  # one per file, not per batch
    assert "query" in recs[0].kv["rows_truncated"] and "day-0.parquet" in recs[0].kv["file"]


def test_other_accepted_encodings(tmp_path: Path, example_schema: Schema) -> None:
    """Dictionary strings, token strings in Parquet, ISO times in CSV, null lists, null feature ids."""
    rows = user_rows(n=6, seed=2)
    base = user_table(rows)
    t = with_column(base, "channel", pa.array(rows["channel"]).dictionary_encode())
    t = with_column(t, "query", pa.array([" ".join(map(str, q)) for q in rows["query"]]))
    t = with_column(t, "tags", pa.array([tg or None for tg in rows["tags"]], pa.list_(pa.string())))
    t = with_column(t, "item", pa.array([None] + rows["item"][1:], pa.int64()))
    got = read_all(write(tmp_path, t, "enc.parquet"), example_schema)
    ref = read_all(write(tmp_path, base, "ref.parquet"), example_schema)
    assert got.column("channel").equals(ref.column("channel"))
    assert got.column("query").equals(ref.column("query"))
    assert got.column("tags").equals(ref.column("tags"))
    assert got.column("item").to_pylist() == [PAD_ID] + rows["item"][1:]  # null feature id = missing

    csv_rows = dict(rows)
    csv_rows["ts"] = ["2023-11-14 22:13:20", "2023-11-14T22:13:21Z", "2023-11-14T22:13:22", "2023-11-14 22:13:23",
                      "2023-11-14 22:13:24", "2023-11-14 22:13:25"]
    got_csv = read_all(write_user_csv(tmp_path / "iso.csv", csv_rows), example_schema)
    assert got_csv.column("ts").to_pylist() == [1_700_000_000 + i for i in range(6)]


def test_generated_data_reads_through_source(generated, generated_schema: Schema) -> None:
    t = read_all(generated.out_dir, generated_schema, batch_rows=1000)
    assert t.num_rows == generated.rows
    assert t.schema == normalized_arrow_schema(generated_schema)
    raw = pq.read_table(generated.files[0])
    n = raw.num_rows
    assert t.column("click").to_numpy()[:n].tolist() == raw.column("click").to_numpy().astype(np.float32).tolist()


# -- bad input --------------------------------------------------------------------------


def test_missing_column_names_file_and_lists_columns(tmp_path: Path, example_schema: Schema) -> None:
    path = write(tmp_path, user_table(user_rows()).drop_columns(["price"]))
    with pytest.raises(DataError) as exc:
        next(iter_source(path, example_schema))
    msg = str(exc.value)
    assert str(path) in msg and "missing column ['price']" in msg and "'uid'" in msg and "'emb'" in msg
    csv = write_user_csv(tmp_path / "nocol.csv", {k: v for k, v in user_rows().items() if k != "clicked"})
    with pytest.raises(DataError, match=r"nocol\.csv: missing column \['clicked'\].*the file has \['uid'"):
        count_rows(csv, example_schema)


def test_bad_column_fails_before_any_batch(tmp_path: Path, example_schema: Schema) -> None:
    """Files are checked up front: nothing is yielded (and so nothing written downstream)."""
    write_user_parquet(tmp_path / "a.parquet", user_rows())
    write(tmp_path, user_table(user_rows()).drop_columns(["emb"]), "b.parquet")
    it = iter_source(tmp_path, example_schema)
    with pytest.raises(DataError, match=r"b\.parquet: missing column \['emb'\]"):
        next(it)


@pytest.mark.parametrize(
    "column, arr, expected",
    [
        ("price", pa.array(["1.5"] * USER_ROWS), r"column 'price' \(dense\): expected a number, got string"),
        ("emb", pa.array([1.0] * USER_ROWS), r"column 'emb' \(vector\): expected a list of floats, got double"),
        ("uid", pa.array([1.5] * USER_ROWS), r"column 'uid' \(sparse\): expected an integer or string id, got double"),
        ("ts", pa.array(["x"] * USER_ROWS), r"column 'ts' \(timestamp\): expected .*got string"),
        ("clicked", pa.array(["1"] * USER_ROWS), r"column 'clicked' \(label\): expected 0/1 .*got string"),
    ],
)
def test_wrong_type_expected_vs_got(tmp_path: Path, example_schema: Schema, column: str, arr: pa.Array, expected: str) -> None:
    path = write(tmp_path, with_column(user_table(user_rows()), column, arr))
    with pytest.raises(DataError, match=expected) as exc:
        next(iter_source(path, example_schema))
    assert str(path) in str(exc.value)


def test_nan_null_and_non_binary_labels(tmp_path: Path, example_schema: Schema) -> None:
    rows = user_rows()
    base = user_table(rows)
    clicked = np.array(rows["clicked"], dtype=np.float64)
    clicked[20] = np.nan
    path = write(tmp_path, with_column(base, "clicked", pa.array(clicked)), "nan.parquet")
    with pytest.raises(DataError, match=r"nan\.parquet: column 'clicked' \(label\): row 20: expected a 0/1 label, got nan"):
        read_all(path, example_schema, batch_rows=16)  # row 20 is in the second batch
    vals = [float(x) for x in rows["clicked"]]
    vals[3] = 2.0
    path = write(tmp_path, with_column(base, "clicked", pa.array(vals)), "two.parquet")
    with pytest.raises(DataError, match=r"two\.parquet: column 'clicked' \(label\): row 3: .*got 2\.0"):
        read_all(path, example_schema)
    nulls = list(rows["bought"])
    nulls[7] = None
    nulls[9] = None
    path = write(tmp_path, with_column(base, "bought", pa.array(nulls, pa.int64())), "null.parquet")
    with pytest.raises(DataError, match=r"null\.parquet: column 'bought' \(label\): row 7: missing value \(null\) \(and 1 more in rows 0-15\)"):
        read_all(path, example_schema)
    csv_rows = dict(rows)
    csv_rows["clicked"] = list(rows["clicked"])
    csv_rows["clicked"][33] = "NaN"
    csv = write_user_csv(tmp_path / "nan.csv", csv_rows)
    with pytest.raises(DataError, match=r"nan\.csv: column 'clicked' \(label\): row 33: expected a 0/1 label, got nan"):
        read_all(csv, example_schema)


@pytest.mark.parametrize(("name", "problem"), [
    ("emb", r"null vector \(and 1 more in rows 0-15\) \(expected 4 floats\)"),
    ("ts", r"missing time \(null\) \(and 1 more in rows 0-15\)"),
    ("price", r"missing value \(null\) \(and 1 more in rows 0-15\)"),
])
def test_null_cells_name_the_first_row_and_the_rest(tmp_path: Path, example_schema: Schema, name: str, problem: str) -> None:
    table = user_table(user_rows())
    values = table.column(name).to_pylist()
    values[3] = values[9] = None
    path = write(tmp_path, with_column(table, name, pa.array(values, table.schema.field(name).type)), "n.parquet")
    with pytest.raises(DataError, match=rf"n\.parquet: column '{name}' \(\w+\): row 3: {problem}$"):
        read_all(path, example_schema)


def test_oracle_values_must_be_probabilities(tmp_path: Path, example_schema: Schema) -> None:
    schema = dataclasses.replace(
        example_schema, columns=[*example_schema.columns, ColumnSpec("p_click", ColumnKind.ORACLE)],
        oracle={"clicked": "p_click"},
    )
    rows = user_rows()
    p = np.linspace(0.0, 1.0, len(rows["clicked"]))
    good = write(tmp_path, user_table(rows).append_column("p_click", pa.array(p)), "good.parquet")
    np.testing.assert_allclose(read_all(good, schema).column("p_click").to_numpy(), p.astype(np.float32))
    p[7] = 1.5
    bad = write(tmp_path, user_table(rows).append_column("p_click", pa.array(p)), "o.parquet")
    with pytest.raises(DataError, match=r"o\.parquet: column 'p_click' \(oracle\): row 7: expected a probability in \[0, 1\], got 1\.5"):
        read_all(bad, schema)


def test_bad_dense_values(tmp_path: Path, example_schema: Schema) -> None:
    rows = user_rows()
    price = list(rows["price"])
    price[5] = None
    path = write(tmp_path, with_column(user_table(rows), "price", pa.array(price)), "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: column 'price' \(dense\): row 5: missing value \(null\)"):
        read_all(path, example_schema)
    price[5] = float("inf")
    path = write(tmp_path, with_column(user_table(rows), "price", pa.array(price)), "inf.parquet")
    with pytest.raises(DataError, match=r"column 'price' \(dense\): row 5: expected a finite number, got inf"):
        read_all(path, example_schema)
    csv_rows = dict(rows)
    csv_rows["price"] = list(rows["price"])
    csv_rows["price"][11] = "cheap"
    csv = write_user_csv(tmp_path / "p.csv", csv_rows)
    with pytest.raises(DataError, match=r"p\.csv: column 'price' \(dense\): row 11: expected a number, got 'cheap'"):
        read_all(csv, example_schema)


def test_vector_wrong_length(tmp_path: Path, example_schema: Schema) -> None:
    rows = user_rows()
    emb = [list(r) for r in rows["emb"]]
    emb[18] = emb[18][:3]
    path = write(tmp_path, with_column(user_table(rows), "emb", pa.array(emb, pa.list_(pa.float32()))), "v.parquet")
    with pytest.raises(DataError, match=r"v\.parquet: column 'emb' \(vector\): row 18: expected 4 values, got 3"):
        read_all(path, example_schema)
    # a schema that does not match the data: every row is "wrong"
    cols = [dataclasses.replace(c, dim=5) if c.name == "emb" else c for c in example_schema.columns]
    schema5 = dataclasses.replace(example_schema, columns=cols)
    good = write_user_parquet(tmp_path / "good.parquet", rows)
    with pytest.raises(DataError, match=r"good\.parquet: column 'emb' \(vector\): row 0: expected 5 values, got 4 \(and 15 more in rows 0-15\)"):
        read_all(good, schema5)
    csv_rows = dict(rows)
    csv_rows["emb"] = [list(r) for r in rows["emb"]]
    csv_rows["emb"][2] = csv_rows["emb"][2] + [1.0]
    with pytest.raises(DataError, match=r"v\.csv: column 'emb' \(vector\): row 2: expected 4 values, got 5"):
        read_all(write_user_csv(tmp_path / "v.csv", csv_rows), example_schema)


def test_bad_ids(tmp_path: Path, example_schema: Schema) -> None:
    rows = user_rows()
    items = list(rows["item"])
    items[26] = -1
    path = write(tmp_path, with_column(user_table(rows), "item", pa.array(items, pa.int64())), "neg.parquet")
    with pytest.raises(DataError, match=r"neg\.parquet: column 'item' \(sparse\): row 26: negative id -1"):
        read_all(path, example_schema)
    items[26] = 2**64 - 1
    path = write(tmp_path, with_column(user_table(rows), "item", pa.array(items[:26] + [2**64 - 1] + items[27:], pa.uint64())), "big.parquet")
    with pytest.raises(DataError, match=r"row 26: id 18446744073709551615 does not fit in int64; set hash = true"):
        read_all(path, example_schema)
    users = list(rows["uid"])
    users[4] = None
    path = write(tmp_path, with_column(user_table(rows), "uid", pa.array(users)), "nokey.parquet")
    with pytest.raises(DataError, match=r"nokey\.parquet: column 'uid' \(sparse\): row 4: null task key"):
        read_all(path, example_schema)
    query = [list(q) for q in rows["query"]]
    query[9] = [1, None, 3]
    path = write(tmp_path, with_column(user_table(rows), "query", pa.array(query, pa.list_(pa.int64()))), "nullel.parquet")
    with pytest.raises(DataError, match=r"column 'query' \(text\): row 9: null element inside a list"):
        read_all(path, example_schema)
    query[9] = [1, -5]
    path = write(tmp_path, with_column(user_table(rows), "query", pa.array(query, pa.list_(pa.int64()))), "negel.parquet")
    with pytest.raises(DataError, match=r"column 'query' \(text\): row 9: negative id -5"):
        read_all(path, example_schema)


def test_csv_integer_ids_then_a_string(tmp_path: Path, example_schema: Schema) -> None:
    rows = user_rows()
    rows["item"] = [str(i) for i in rows["item"]]
    rows["item"][25] = "abc"
    csv = write_user_csv(tmp_path / "ids.csv", rows)
    with pytest.raises(DataError, match=r"ids\.csv: column 'item' \(sparse\): row 25: expected an integer id .*got 'abc'; set hash = true"):
        read_all(csv, example_schema, batch_rows=10)
    # the same file with hash = true on the column imports, hashing every value
    cols = [dataclasses.replace(c, hash=True) if c.name == "item" else c for c in example_schema.columns]
    t = read_all(csv, dataclasses.replace(example_schema, columns=cols), batch_rows=10)
    assert t.column("item").to_numpy().tolist() == hash_strings(pa.array(rows["item"])).tolist()
    # strings in the first batch: the whole file's column is hashed
    rows["item"][0] = "first"
    t = read_all(write_user_csv(tmp_path / "s.csv", rows), example_schema, batch_rows=10)
    assert t.column("item").to_numpy().tolist() == hash_strings(pa.array(rows["item"])).tolist()


def test_bad_csv_time(tmp_path: Path, example_schema: Schema) -> None:
    rows = user_rows()
    rows["ts"] = [str(t) for t in rows["ts"]]
    rows["ts"][12] = "yesterday"
    with pytest.raises(DataError, match=r"t\.csv: column 'ts' \(timestamp\): row 12: expected int seconds like row 0, got 'yesterday'"):
        read_all(write_user_csv(tmp_path / "t.csv", rows), example_schema)


def test_empty_inputs(tmp_path: Path, example_schema: Schema) -> None:
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (empty_dir / "README.txt").write_text("not data")
    with pytest.raises(DataError, match=r"empty: no input files .*found \['README.txt'\]"):
        next(iter_source(empty_dir, example_schema))
    with pytest.raises(DataError, match="input not found"):
        next(iter_source(tmp_path / "nope", example_schema))
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(DataError, match=r"x\.json: unknown input format '\.json'"):
        next(iter_source(tmp_path / "x.json", example_schema))
    zero = tmp_path / "zero.csv"
    zero.write_text("")
    with pytest.raises(DataError, match=r"zero\.csv: empty CSV file \(no header line\)"):
        next(iter_source(zero, example_schema))
    header_only = tmp_path / "header.csv"
    header_only.write_text(",".join(user_rows(n=1)) + "\n")
    with pytest.raises(DataError, match=r"header\.csv: the input has no rows \(1 file\)"):
        next(iter_source(header_only, example_schema))
    no_rows = write(tmp_path, user_table(user_rows(n=1)).slice(0, 0), "none.parquet")
    with pytest.raises(DataError, match="the input has no rows"):
        list(iter_source(no_rows, example_schema))


def test_corrupt_and_truncated_parquet(tmp_path: Path, example_schema: Schema) -> None:
    good = write_user_parquet(tmp_path / "good.parquet", user_rows())
    data = good.read_bytes()
    trunc = tmp_path / "trunc.parquet"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"trunc\.parquet: not a readable Parquet file \(corrupt or truncated\?\)"):
        next(iter_source(trunc, example_schema))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1" + b"\x00" * 100)
    with pytest.raises(DataError, match=r"junk\.parquet: not a readable Parquet file"):
        count_rows(junk, example_schema)
    # data pages overwritten, footer intact: the error names the file
    broken = bytearray(data)
    broken[8:2000] = b"\xff" * (2000 - 8)
    bad = tmp_path / "pages.parquet"
    bad.write_bytes(bytes(broken))
    with pytest.raises(DataError, match=r"pages\.parquet"):
        read_all(bad, example_schema)


def test_invalid_schema_is_a_schema_error(user_parquet: Path, example_schema: Schema) -> None:
    bad = dataclasses.replace(example_schema, task_key="nobody")
    with pytest.raises(SchemaError, match="task_key 'nobody' is not a declared column"):
        next(iter_source(user_parquet, bad))


def test_extra_and_tsv(tmp_path: Path) -> None:
    schema = Schema(
        columns=[
            ColumnSpec("u", ColumnKind.SPARSE),
            ColumnSpec("y", ColumnKind.LABEL),
            ColumnSpec("meta", ColumnKind.EXTRA),
        ],
        task_key="u",
        labels=["y"],
    )
    (tmp_path / "a.tsv").write_text("u\ty\tmeta\n1\t0\tx\n2\t1\t\n")
    t = read_all(tmp_path / "a.tsv", schema)
    assert t.to_pylist() == [{"u": 1, "y": 0.0, "meta": "x"}, {"u": 2, "y": 1.0, "meta": None}]
    pq.write_table(pa.table({"u": [3], "y": [True], "meta": [7]}), tmp_path / "b.parquet")
    assert read_all(tmp_path / "b.parquet", schema).to_pylist() == [{"u": 3, "y": 1.0, "meta": "7"}]


def test_parquet_time_types(tmp_path: Path) -> None:
    schema = Schema(
        columns=[ColumnSpec("u", ColumnKind.SPARSE), ColumnSpec("y", ColumnKind.LABEL), ColumnSpec("t", ColumnKind.TIMESTAMP)],
        task_key="u",
        labels=["y"],
        timestamp="t",
    )
    cases = {
        "tz.parquet": pa.array([1_700_000_000_500_000, -1_500_000], pa.timestamp("us", tz="Asia/Shanghai")),
        "date.parquet": pa.array([19_675, -1], pa.date32()),
        "int.parquet": pa.array([1_700_000_000, -2], pa.int32()),
    }
    want = {
        "tz.parquet": [1_700_000_000, -2],  # floor toward the past, UTC seconds
        "date.parquet": [19_675 * 86_400, -86_400],
        "int.parquet": [1_700_000_000, -2],
    }
    for name, arr in cases.items():
        pq.write_table(pa.table({"u": [1, 2], "y": [0, 1], "t": arr}), tmp_path / name)
        assert read_all(tmp_path / name, schema).column("t").to_pylist() == want[name], name


def test_csv_decision_waits_for_a_batch_with_values(tmp_path: Path, example_schema: Schema) -> None:
    """An all-empty first batch does not lock an id column into integer mode."""
    rows = user_rows()
    rows["query"] = [[] for _ in range(10)] + [["tok", "7"] for _ in range(USER_ROWS - 10)]
    t = read_all(write_user_csv(tmp_path / "late.csv", rows), example_schema, batch_rows=10)
    query = np.stack(t.column("query").to_numpy(zero_copy_only=False))
    assert (query[:10] == PAD_ID).all()
    assert query[10, :2].tolist() == hash_strings(pa.array(["tok", "7"])).tolist()  # whole file hashed
