"""A task key of kind ``key`` is not a model feature: no embedding table, no input field; it still trains.

The generator's own data, with ``user_id`` re-declared from ``sparse`` (key and feature)
to ``key`` (grouping only), is built into Meta-IO and trained in meta mode with
``train_local`` (real fbgemm store, real files).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meta_io.build import MetaIOBuildConfig, build
from meta_io.reader import MetaIODataset
from meta_io.schema import ColumnKind, Schema, load_schema
from meta_io.synth import GeneratorConfig, generate
from models.config import ModelConfig
from models.factory import build_model


def as_key(schema: Schema, name: str) -> Schema:
    """``schema`` with column ``name`` declared ``key`` (grouping only, no table)."""
    cols = [dataclasses.replace(c, kind=ColumnKind.KEY, table="") if c.name == name else c for c in schema.columns]
    out = dataclasses.replace(schema, columns=cols)
    out.validate()
    return out


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("keygen")
    return generate(root / "raw", GeneratorConfig(rows=1500, users=150, items=100, seed=5, n_files=1,
                                                  row_group_rows=1000), progress=False)


def test_a_key_task_key_creates_no_table_and_no_field(gen) -> None:
    sparse = load_schema(gen.schema_path)
    keyed = as_key(sparse, "user_id")
    assert "user" in sparse.tables and "user" not in keyed.tables
    cfg = ModelConfig(kind="dnn", default_dim=8, hidden=[16, 8])
    with_user, without = build_model(sparse, cfg), build_model(keyed, cfg)
    assert "user" in with_user.dims and "user" not in without.dims
    assert without.encoder.flat_dim == with_user.encoder.flat_dim - with_user.dims["user"]
    assert without.encoder.n_fields == with_user.encoder.n_fields - 1


def test_meta_training_grouped_by_a_key_that_is_not_a_feature(gen, tmp_path: Path) -> None:
    from tests.workers.conftest import make_job
    from workers.local import train_local

    keyed = as_key(load_schema(gen.schema_path), "user_id")
    keyed.save(tmp_path / "schema.json")
    cfg = MetaIOBuildConfig(support=4, query=4, rows_per_batch=64)
    meta = build(gen.out_dir, tmp_path / "schema.json", tmp_path / "meta", cfg).out_dir
    plain_sparse = build(gen.out_dir, gen.schema_path, tmp_path / "sparse", cfg).out_dir
    # the same tasks as when user_id is a feature (the same int64 keys)
    keys = sorted(int(k) for b in MetaIODataset(meta).iter_all() if hasattr(b, "task_keys")
                  for k, m in zip(b.task_keys, b.task_mask) if m)
    keys_sparse = sorted(int(k) for b in MetaIODataset(plain_sparse).iter_all() if hasattr(b, "task_keys")
                         for k, m in zip(b.task_keys, b.task_mask) if m)
    assert keys and keys == keys_sparse
    job = make_job(meta, tmp_path, eval_path=meta, train={"max_steps": 6}, meta={"inner_steps": 1, "inner_lr": 0.1})
    sparse_tables = load_schema(gen.schema_path).tables
    assert [t.name for t in job.table_configs()] == [t for t in sparse_tables if t != "user"]
    report, worker = train_local(job, tmp_path / "run")
    assert sorted(worker.rows.store.tables) == sorted(t.name for t in job.table_configs())  # no "user" table
    assert report["eval"]["adapted"]["click"]["rows"] > 0 and report["eval"]["base"]["click"]["rows"] > 0
    _predict_keeps_the_raw_key(Path(report["checkpoint"]), gen, keyed, tmp_path)


def _predict_keeps_the_raw_key(ckpt: Path, gen, keyed: Schema, tmp_path: Path) -> None:
    """The bundle of that run: ``predict --support`` groups by the key column (not a feature, here
    given as strings: no table ever sees it) and ``--keep-columns`` writes the raw string key."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from delivery.config import DeliveryConfig
    from delivery.job import deliver_once
    from delivery.predict import predict_to_parquet

    deliver_once(DeliveryConfig(out=tmp_path / "bundles"), checkpoint=ckpt)
    raw = pq.read_table(gen.files[0]).slice(0, 400)
    raw = raw.set_column(raw.schema.get_field_index("user_id"), "user_id",
                         pc.binary_join_element_wise("u-", pc.cast(raw.column("user_id"), pa.string()), ""))
    support, data = tmp_path / "support.parquet", tmp_path / "data.parquet"
    pq.write_table(raw.slice(0, 200), support)
    pq.write_table(raw.slice(200), data)
    res = predict_to_parquet(tmp_path / "bundles", data, tmp_path / "p.parquet", batch_rows=64,
                             support=support, keep_columns=["user_id"])
    out = pq.read_table(tmp_path / "p.parquet")
    assert res.adapted and res.rows == 200
    assert out.column("user_id").to_pylist() == raw.slice(200).column("user_id").to_pylist()
    base = predict_to_parquet(tmp_path / "bundles", data, tmp_path / "b.parquet", batch_rows=64)
    assert not base.adapted
    moved = np.abs(out.column("p_click").to_numpy() - pq.read_table(tmp_path / "b.parquet").column("p_click").to_numpy())
    assert moved.max() > 0, "adapting per (string) key changed no score"
