"""Lookup + pooling over gathered rows: equals a naive per-row loop, checks inputs."""

import pytest
import torch
from torch.func import vmap

from meta_io.schema import PAD_ID, Pooling
from common.errors import DataError
from models.embedding import TableLayout, build_index, pool
from models.testing import random_features, random_rows, synthetic_schema, unique_ids_of


def _layouts(schema, dim=8):
    return [
        TableLayout.from_columns(t, dim, [c for c in schema.id_columns if c.table_name == t]) for t in schema.tables
    ]


def _naive(schema, fb, uniq, rows, table, dim):
    """Per-row, per-id Python reference of pooled [*L, C, dim] for one table."""
    cols = [c for c in schema.id_columns if c.table_name == table]
    lead = tuple(fb.shape)
    out = torch.zeros(lead + (len(cols), dim))
    pos_of = {int(u): i for i, u in enumerate(uniq[table])}
    for ci, c in enumerate(cols):
        ids = fb.ids[c.name].reshape(-1, fb.ids[c.name].shape[-1])
        flat = out[..., ci, :].reshape(-1, dim)
        for r in range(ids.shape[0]):
            vecs = [rows[table][pos_of[int(i)]] for i in ids[r] if int(i) != PAD_ID]
            if vecs:
                v = torch.stack(vecs).sum(0)
                if c.pooling == Pooling.MEAN:
                    v = v / len(vecs)
                flat[r] = v
        out[..., ci, :] = flat.reshape(lead + (dim,))
    return out


@pytest.mark.parametrize("shape", [(7,), (3, 5)])
def test_lookup_equals_naive_reference(shape) -> None:
    g = torch.Generator().manual_seed(0)
    schema = synthetic_schema(n_sparse=3, n_multi_hot=2, n_text=1, n_tables=2)
    fb = random_features(schema, shape, vocab=12, generator=g)
    uniq = unique_ids_of(schema, fb)
    rows = random_rows(uniq, {t: 8 for t in uniq}, g)
    idx = build_index(_layouts(schema), fb, uniq, rows)
    for t in schema.tables:
        got = pool(rows[t], idx[t])
        torch.testing.assert_close(got, _naive(schema, fb, uniq, rows, t, 8))


def test_gradient_w_r_t_rows_counts_every_use() -> None:
    g = torch.Generator().manual_seed(1)
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_tables=1)
    fb = random_features(schema, (6,), vocab=5, generator=g)
    uniq = unique_ids_of(schema, fb)
    rows = {t: r.requires_grad_() for t, r in random_rows(uniq, {t: 4 for t in uniq}, g).items()}
    idx = build_index(_layouts(schema, 4), fb, uniq, rows)
    pool(rows["t0"], idx["t0"]).sum().backward()
    # Sparse columns f0, f1 share table t0 with sum-weight 1 per use: grad row = uses * ones.
    ids = torch.cat([fb.ids["f0"].reshape(-1), fb.ids["f1"].reshape(-1)])
    uses = torch.stack([(ids == u).sum() for u in uniq["t0"]]).float()
    torch.testing.assert_close(rows["t0"].grad, uses[:, None].expand(-1, 4))


def test_pool_works_under_vmap_with_per_task_rows() -> None:
    g = torch.Generator().manual_seed(2)
    schema = synthetic_schema(n_sparse=1, n_multi_hot=1, n_text=0)
    fb = random_features(schema, (3, 4), vocab=6, generator=g)
    uniq = unique_ids_of(schema, fb)
    idx = build_index(_layouts(schema, 4), fb, uniq)
    per_task = torch.randn(3, uniq["tag"].numel(), 4, generator=g)
    got = vmap(pool)(per_task, idx["tag"])
    want = torch.stack([pool(per_task[i], type(idx["tag"])(*(x[i] for x in idx["tag"]))) for i in range(3)])
    torch.testing.assert_close(got, want)


def test_missing_id_names_column_and_table() -> None:
    g = torch.Generator().manual_seed(3)
    schema = synthetic_schema(n_sparse=1, n_multi_hot=0, n_text=0)
    fb = random_features(schema, (4,), vocab=6, generator=g)
    uniq = unique_ids_of(schema, fb)
    uniq["t0"] = uniq["t0"][1:]  # drop the smallest id
    with pytest.raises(DataError, match=r"column 'f0' is not in unique_ids\['t0'\]"):
        build_index(_layouts(schema), fb, uniq)


def test_bad_rows_and_tables_are_clear_errors() -> None:
    g = torch.Generator().manual_seed(4)
    schema = synthetic_schema(n_sparse=1, n_multi_hot=0, n_text=0)
    fb = random_features(schema, (4,), vocab=6, generator=g)
    uniq = unique_ids_of(schema, fb)
    rows = random_rows(uniq, {t: 8 for t in uniq}, g)
    lays = _layouts(schema)
    with pytest.raises(DataError, match="rows has no table 't0'"):
        build_index(lays, fb, uniq, {k: v for k, v in rows.items() if k != "t0"})
    with pytest.raises(DataError, match="unique_ids has no table 'user'"):
        build_index(lays, fb, {k: v for k, v in uniq.items() if k != "user"}, rows)
    bad = dict(rows, t0=torch.zeros(rows["t0"].shape[0], 12))
    with pytest.raises(DataError, match=r"rows\['t0'\]: expected shape \[\d+, 8\].*got \[\d+, 12\]"):
        build_index(lays, fb, uniq, bad)
    with pytest.raises(DataError, match=r"rows\['t0'\]: expected float32, got torch.float16"):
        build_index(lays, fb, uniq, dict(rows, t0=rows["t0"].half()))
    with pytest.raises(DataError, match="sorted"):
        build_index(lays, fb, dict(uniq, t0=uniq["t0"].flip(0)), rows)
    fb.ids.pop("f0")
    with pytest.raises(DataError, match="no id column 'f0'"):
        build_index(lays, fb, uniq, rows)
