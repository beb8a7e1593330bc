"""Synthetic schemas and batches for model tests and benchmarks.

Builds exactly the :mod:`meta_io.batch` structures the reader yields, from
random ids and values, so model code can be tested without the data pipeline.

Example::

    schema = synthetic_schema(n_sparse=3, n_multi_hot=1, n_text=1, n_dense=2, vector_dim=4)
    mb = random_meta_batch(schema, tasks=4, support=8, query=8, generator=torch.Generator().manual_seed(0))
    rows = random_rows(mb.unique_ids, ModelConfig().embedding_dims(schema.tables))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from torch import Tensor

from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from meta_io.schema import PAD_ID, ColumnKind, ColumnSpec, Pooling, Schema

if TYPE_CHECKING:
    from models.meta import MetaStepResult


def synthetic_schema(
    n_sparse: int = 3,
    n_multi_hot: int = 1,
    n_text: int = 1,
    n_dense: int = 2,
    vector_dim: int = 4,
    labels: tuple[str, ...] = ("click", "conversion"),
    n_tables: int | None = None,
    max_len: int = 4,
) -> Schema:
    """An AntM2C-like schema: a user id (task key), a scenario id, more id columns.

    ``n_tables`` caps the number of tables the extra sparse columns spread over
    (several columns sharing a table, as item ids in two roles do).
    """
    cols = [
        ColumnSpec("user_id", ColumnKind.SPARSE, table="user"),
        ColumnSpec("scene", ColumnKind.SPARSE, table="scene"),
    ]
    for i in range(n_sparse):
        table = f"t{i % n_tables}" if n_tables else f"t{i}"
        cols.append(ColumnSpec(f"f{i}", ColumnKind.SPARSE, table=table))
    for i in range(n_multi_hot):
        pooling = Pooling.MEAN if i % 2 == 0 else Pooling.SUM
        cols.append(ColumnSpec(f"tags{i}", ColumnKind.MULTI_HOT, table="tag", max_len=max_len, pooling=pooling))
    for i in range(n_text):
        cols.append(ColumnSpec(f"text{i}", ColumnKind.TEXT, table="token", max_len=2 * max_len))
    if vector_dim:
        cols.append(ColumnSpec("image", ColumnKind.VECTOR, dim=vector_dim))
    for i in range(n_dense):
        cols.append(ColumnSpec(f"d{i}", ColumnKind.DENSE))
    for lab in labels:
        cols.append(ColumnSpec(lab, ColumnKind.LABEL))
    return Schema(columns=cols, task_key="user_id", labels=list(labels), scenario="scene")


def random_features(
    schema: Schema,
    shape: tuple[int, ...],
    vocab: int = 50,
    generator: torch.Generator | None = None,
    pad_rows: float = 0.2,
) -> FeatureBatch:
    """Random features of leading shape ``shape``; about ``pad_rows`` of rows are padding.

    Lists get a random length (possibly 0) padded with -1; labels are 0/1 with
    conversion only on clicked rows; padding rows carry random garbage labels so
    a test notices if they leak into a loss.
    """
    g = generator
    ids: dict[str, Tensor] = {}
    for c in schema.id_columns:
        m = max(c.max_len, 1)
        x = torch.randint(0, vocab, shape + (m,), generator=g)
        if m > 1:
            length = torch.randint(0, m + 1, shape + (1,), generator=g)
            x = torch.where(torch.arange(m) < length, x, torch.full_like(x, PAD_ID))
        ids[c.name] = x
    dense = torch.randn(shape + (len(schema.dense_columns),), generator=g) * 5.0
    vectors = {c.name: torch.randn(shape + (c.dim,), generator=g) for c in schema.vector_columns}
    click = (torch.rand(shape, generator=g) < 0.4).float()
    labels = {schema.labels[0]: click}
    for lab in schema.labels[1:]:
        labels[lab] = click * (torch.rand(shape, generator=g) < 0.5).float()
    mask = torch.rand(shape, generator=g) >= pad_rows
    if mask.numel():
        mask.view(-1)[0] = True  # never an all-padding batch by accident
    scenario = ids["scene"][..., 0].clone() if "scene" in ids else torch.zeros(shape, dtype=torch.long)
    return FeatureBatch(ids=ids, dense=dense, vectors=vectors, labels=labels, mask=mask, scenario=scenario)


def unique_ids_of(schema: Schema, *batches: FeatureBatch) -> dict[str, Tensor]:
    """table -> sorted unique ids (>= 0) over every id column of the batches."""
    out: dict[str, Tensor] = {}
    for t in schema.tables:
        parts = [fb.ids[c.name].reshape(-1) for fb in batches for c in schema.id_columns if c.table_name == t]
        ids = torch.cat(parts)
        out[t] = torch.unique(ids[ids >= 0])
    return out


def random_rows(unique_ids: dict[str, Tensor], dims: dict[str, int], generator: torch.Generator | None = None,
                scale: float = 0.1) -> dict[str, Tensor]:
    """table -> random float32 rows ``[U_t, dims[t]]``."""
    return {t: torch.randn(u.numel(), dims[t], generator=generator) * scale for t, u in unique_ids.items()}


def random_plain_batch(schema: Schema, batch: int, vocab: int = 50, generator: torch.Generator | None = None,
                       pad_rows: float = 0.2) -> PlainBatch:
    fb = random_features(schema, (batch,), vocab, generator, pad_rows)
    return PlainBatch(features=fb, unique_ids=unique_ids_of(schema, fb))


def random_meta_batch(
    schema: Schema,
    tasks: int,
    support: int,
    query: int,
    vocab: int = 50,
    generator: torch.Generator | None = None,
    pad_rows: float = 0.2,
    pad_tasks: int = 0,
) -> MetaBatch:
    """T tasks of S support / Q query slots; the last ``pad_tasks`` task slots are padding."""
    sup = random_features(schema, (tasks, support), vocab, generator, pad_rows)
    qry = random_features(schema, (tasks, query), vocab, generator, pad_rows)
    task_mask = torch.arange(tasks) < tasks - pad_tasks
    return MetaBatch(
        support=sup,
        query=qry,
        task_keys=torch.arange(tasks, dtype=torch.long),
        task_mask=task_mask,
        unique_ids=unique_ids_of(schema, sup, qry),
    )


def assert_steps_identical(a: "MetaStepResult", b: "MetaStepResult") -> None:
    """Two meta steps gave the same loss, metrics and gradients, bit for bit (same names too).

    Args:
        a: one :func:`models.meta.meta_step` result.
        b: the other.
    """
    assert torch.equal(a.outer_loss, b.outer_loss)
    assert a.metrics == b.metrics
    for what, x, y in (("dense", a.dense_grads, b.dense_grads), ("rows", a.row_grads, b.row_grads)):
        assert set(x) == set(y), (what, sorted(x), sorted(y))
        for k in x:
            assert torch.equal(x[k], y[k]), (what, k)


def split_group_rows(rows: Sequence[Tensor], counts: Sequence[np.ndarray],
                     tables: Sequence[tuple[str, ...]]) -> dict[str, Tensor]:
    """table -> its ``[U_t, D]`` rows: views of the per-group tensors of a grouped index
    (``GroupedIndex`` / ``MetaGroupedIndex`` ``counts`` and ``tables``), the per-table form."""
    out: dict[str, Tensor] = {}
    for g_rows, cnt, names in zip(rows, counts, tables):
        out.update(zip(names, torch.split(g_rows, cnt.tolist())))
    return out
