"""The grouped lookup (one pull, one embedding_bag and one row gradient per storage group)
equals the per-table lookup it replaces in plain steps.

The reference is the per-table path (``build_index`` + ``pool`` and ``plain_step``):
the same outputs, dense gradients and row gradients (to float tolerance: the
sums run in another order), for groups in and out of the model's layout order,
several dims, sum and mean pooling, padding, leading shapes [B] and [T, S]; and
the same errors for bad batches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from metaps.core.errors import DataError
from models import ModelConfig, build_model
from models.embedding import pool_grouped
from models.features import GroupedLookup
from models.meta import plain_step, plain_step_grouped
from models.testing import random_features, random_rows, synthetic_schema, unique_ids_of
from meta_io.batch import PlainBatch

torch.set_num_threads(1)


def _model(kind: str, dims: dict[str, int]):
    schema = synthetic_schema(n_sparse=4, n_multi_hot=2, n_text=1, n_tables=3)
    cfg = ModelConfig(kind=kind, hidden=[16], table_dims=dims) if dims else ModelConfig(kind=kind, hidden=[16])
    return schema, build_model(schema, cfg)


GROUPINGS = {
    "one group": lambda tables: [tables],
    "reversed": lambda tables: [tables[::-1]],  # out of layout order: the pooled permutation
    "split": lambda tables: [tables[1::2], tables[0::2]],
}


@pytest.mark.parametrize("kind", ["dnn", "deepfm", "esmm"])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("shape", [(9,), (3, 4)])
def test_grouped_step_equals_per_table_step(kind: str, grouping: str, shape: tuple[int, ...]) -> None:
    schema, model = _model(kind, {})
    g = torch.Generator().manual_seed(1)
    fb = random_features(schema, shape, vocab=15, generator=g)
    uniq = unique_ids_of(schema, fb)
    rows = random_rows(uniq, model.dims, g)
    lookup = GroupedLookup(model.encoder, GROUPINGS[grouping](list(model.tables)))
    idx = lookup.index(fb, uniq)
    group_rows = [torch.cat([rows[t] for t in names]) for names in idx.tables]

    want = model(fb, rows, uniq)
    got = model.outputs(model.encoder.encode_grouped(fb, group_rows, idx, lookup), False)
    for h in want:
        torch.testing.assert_close(got[h], want[h])

    ref_loss, ref_dense, ref_rows = plain_step(model, PlainBatch(fb, uniq), rows)
    loss, dense, group_grads = plain_step_grouped(model, fb, group_rows, idx, lookup)
    torch.testing.assert_close(loss, ref_loss)
    assert dense.keys() == ref_dense.keys()
    for n in dense:
        torch.testing.assert_close(dense[n], ref_dense[n], msg=n)
    per_table = idx.split_rows(group_grads, model.layouts)
    for t in ref_rows:
        torch.testing.assert_close(per_table[t], ref_rows[t], msg=t)
    assert all(p.grad is None for p in model.parameters())  # the model's .grad untouched


def test_mixed_dims_make_groups_per_dim() -> None:
    schema, model = _model("dnn", {"scene": 4, "tag": 4, "token": 12})
    g = torch.Generator().manual_seed(2)
    fb = random_features(schema, (11,), vocab=9, generator=g)
    uniq = unique_ids_of(schema, fb)
    rows = random_rows(uniq, model.dims, g)
    by_dim: dict[int, list[str]] = {}
    for t in model.tables:
        by_dim.setdefault(model.dims[t], []).append(t)
    lookup = GroupedLookup(model.encoder, list(by_dim.values()))
    assert lookup.perm is not None  # the groups interleave the layout order
    idx = lookup.index(fb, uniq)
    group_rows = [torch.cat([rows[t] for t in names]) for names in idx.tables]
    ref_loss, ref_dense, ref_rows = plain_step(model, PlainBatch(fb, uniq), rows)
    loss, dense, grads = plain_step_grouped(model, fb, group_rows, idx, lookup)
    torch.testing.assert_close(loss, ref_loss)
    for t, gr in idx.split_rows(grads, model.layouts).items():
        torch.testing.assert_close(gr, ref_rows[t], msg=t)
    with pytest.raises(DataError, match="mixes dims"):
        GroupedLookup(model.encoder, [list(model.tables)])


def test_pool_backward_is_the_transpose() -> None:
    """The custom backward (an embedding_bag over the output gradient) equals autograd's."""
    schema, model = _model("dnn", {})
    g = torch.Generator().manual_seed(3)
    fb = random_features(schema, (13,), vocab=7, generator=g)
    uniq = unique_ids_of(schema, fb)
    lookup = GroupedLookup(model.encoder, [list(model.tables)])
    idx = lookup.index(fb, uniq)
    n = int(idx.ids[0].numel())
    rows = torch.randn(n, 8, generator=g, requires_grad=True)
    p = idx.pooled[0]
    out = pool_grouped(rows, p, idx.lead)
    go = torch.randn(out.shape, generator=g)
    (got,) = torch.autograd.grad(out, rows, go)
    ref_rows = rows.detach().clone().requires_grad_()
    ref = torch.nn.functional.embedding_bag(p.input, ref_rows, p.offsets, mode="sum", per_sample_weights=p.weights)
    (want,) = torch.autograd.grad(ref.view(out.shape), ref_rows, go)
    torch.testing.assert_close(got, want)


def test_bad_batches_are_named() -> None:
    schema, model = _model("dnn", {})
    g = torch.Generator().manual_seed(4)
    fb = random_features(schema, (6,), vocab=9, generator=g)
    uniq = unique_ids_of(schema, fb)
    lookup = GroupedLookup(model.encoder, [list(model.tables)])
    short = dict(uniq)
    short["tag"] = uniq["tag"][1:]
    with pytest.raises(DataError, match=r"of column 'tags\d' is not in unique_ids\['tag'\]"):
        lookup.index(fb, short)
    flipped = dict(uniq)
    flipped["t1"] = uniq["t1"].flip(0)
    with pytest.raises(DataError, match=r"unique_ids\['t1'\] must be sorted and unique"):
        lookup.index(fb, flipped)
    with pytest.raises(DataError, match="unique_ids has no table 'scene'"):
        lookup.index(fb, {k: v for k, v in uniq.items() if k != "scene"})
    wrong = dataclasses.replace(fb, ids={**fb.ids, "f0": fb.ids["f0"][:3]})
    with pytest.raises(DataError, match="id column 'f0': expected shape"):
        lookup.index(wrong, uniq)
