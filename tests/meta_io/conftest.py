"""Shared fixtures for meta_io tests: tiny generated data and tiny user data.

Fixtures:
    tiny_gen_config   GeneratorConfig for ~3k rows in 2 files (row groups of 1000)
    generated         GeneratedData of that config (session-scoped, generated once)
    generated_schema  the Schema loaded back from generated.schema_path
    example_schema_path / example_schema
                      configs/schema_example.toml (a hand-written user schema)
    user_parquet      a folder with 2 Parquet files matching the example schema
                      (string ids, list<string> tags, list<int> tokens, vector, timestamp[ms])
    user_csv          a folder with 2 CSV files with the same rows, as text

``user_parquet`` and ``user_csv`` hold the same rows (``USER_ROWS`` per file),
so both normalize to equal tables. Helpers :func:`user_rows`,
:func:`write_user_parquet` and :func:`write_user_csv` let a test write variants.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meta_io.build import MetaIOBuildConfig, build
from meta_io.synth import GeneratedData, GeneratorConfig, generate
from meta_io.schema import Schema, load_schema

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SCHEMA = REPO / "configs" / "schema_example.toml"
USER_ROWS = 40
TS0 = 1_700_000_000  # seconds


@pytest.fixture(scope="session")
def tiny_gen_config() -> GeneratorConfig:
    return GeneratorConfig(rows=3000, users=300, items=200, seed=7, n_files=2, row_group_rows=1000)


@pytest.fixture(scope="session")
def generated(tmp_path_factory: pytest.TempPathFactory, tiny_gen_config: GeneratorConfig) -> GeneratedData:
    """Tiny AntM2C-like data; read-only (copy it before modifying)."""
    return generate(tmp_path_factory.mktemp("generated"), tiny_gen_config, progress=False)


@pytest.fixture(scope="session")
def generated_schema(generated: GeneratedData) -> Schema:
    return load_schema(generated.schema_path)


@pytest.fixture(scope="session")
def example_schema_path() -> Path:
    return EXAMPLE_SCHEMA


@pytest.fixture(scope="session")
def example_schema() -> Schema:
    return load_schema(EXAMPLE_SCHEMA)


def user_rows(n: int = USER_ROWS, seed: int = 0, first_ts: int = TS0) -> dict[str, list]:
    """Rows for the example schema as Python lists (one list per column)."""
    rng = np.random.default_rng(seed)
    users = [f"u{int(i)}" for i in rng.integers(0, 8, size=n)]
    vocab = ["red", "blue", "sale", "new", "kids", "sport"]
    tags = [[vocab[int(j)] for j in rng.integers(0, len(vocab), size=int(k))] for k in rng.integers(0, 7, size=n)]
    query = [[int(t) for t in rng.integers(0, 500, size=int(k))] for k in rng.integers(1, 11, size=n)]
    emb = rng.normal(size=(n, 4)).astype(np.float32)
    clicked = rng.integers(0, 2, size=n)
    bought = clicked * rng.integers(0, 2, size=n)
    return {
        "uid": users,
        "item": [int(i) for i in rng.integers(0, 1000, size=n)],
        "channel": [["feed", "search", "push"][int(i)] for i in rng.integers(0, 3, size=n)],
        "tags": tags,
        "query": query,
        "emb": [list(map(float, r)) for r in emb],
        "price": [float(np.float32(p)) for p in rng.gamma(2.0, 10.0, size=n)],
        "ts": [first_ts + int(t) for t in np.sort(rng.integers(0, 86_400, size=n))],
        "clicked": [int(c) for c in clicked],
        "bought": [int(b) for b in bought],
        "note": [f"r{i}" for i in range(n)],
        "unused": [0] * n,  # not in the schema: must be ignored
    }


def user_table(rows: dict[str, list]) -> pa.Table:
    """Parquet-typed table of ``rows`` (timestamps as timestamp[ms])."""
    return pa.table(
        {
            "uid": pa.array(rows["uid"], pa.string()),
            "item": pa.array(rows["item"], pa.int32()),
            "channel": pa.array(rows["channel"], pa.string()),
            "tags": pa.array(rows["tags"], pa.list_(pa.string())),
            "query": pa.array(rows["query"], pa.list_(pa.int64())),
            "emb": pa.array(rows["emb"], pa.list_(pa.float32())),
            "price": pa.array(rows["price"], pa.float64()),
            "ts": pa.array([t * 1000 for t in rows["ts"]], pa.timestamp("ms")),
            "clicked": pa.array(rows["clicked"], pa.int64()),
            "bought": pa.array([bool(b) for b in rows["bought"]], pa.bool_()),
            "note": pa.array(rows["note"], pa.string()),
            "unused": pa.array(rows["unused"], pa.int64()),
        }
    )


def write_user_parquet(path: Path, rows: dict[str, list], row_group_size: int = 16) -> Path:
    pq.write_table(user_table(rows), path, row_group_size=row_group_size)
    return path


def _csv_cell(value) -> str:
    if isinstance(value, list):
        return " ".join(repr(v) if isinstance(v, float) else str(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_user_csv(path: Path, rows: dict[str, list]) -> Path:
    """CSV text: lists as space-separated tokens, timestamps as int seconds."""
    names = list(rows)
    n = len(rows[names[0]])
    lines = [",".join(names)]
    for i in range(n):  # test data writer, not a hot path
        lines.append(",".join(f'"{_csv_cell(rows[c][i])}"' for c in names))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def user_parquet(tmp_path: Path) -> Path:
    d = tmp_path / "user_parquet"
    d.mkdir()
    write_user_parquet(d / "day-0.parquet", user_rows(seed=0))
    write_user_parquet(d / "day-1.parquet", user_rows(seed=1, first_ts=TS0 + 86_400))
    return d


@pytest.fixture()
def user_csv(tmp_path: Path) -> Path:
    d = tmp_path / "user_csv"
    d.mkdir()
    write_user_csv(d / "day-0.csv", user_rows(seed=0))
    write_user_csv(d / "day-1.csv", user_rows(seed=1, first_ts=TS0 + 86_400))
    return d


SMALL_SUPPORT, SMALL_QUERY, SMALL_ROWS_PER_BATCH = 8, 4, 96
"""The small Meta-IO build the reader and integrity tests share (each module builds its own)."""


@pytest.fixture(scope="module")
def built(generated: GeneratedData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Meta-IO dataset built from ``generated`` in several small files, once per test module."""
    out = tmp_path_factory.mktemp("metaio") / "ds"
    build(generated.out_dir, generated.schema_path, out,
          MetaIOBuildConfig(support=SMALL_SUPPORT, query=SMALL_QUERY, rows_per_batch=SMALL_ROWS_PER_BATCH,
                            max_file_mb=0.5))
    return out


@pytest.fixture()
def copy(built: Path, tmp_path: Path) -> Path:
    """A private copy of ``built`` that a test may damage."""
    dst = tmp_path / "ds"
    shutil.copytree(built, dst)
    return dst
