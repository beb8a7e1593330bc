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

from common.errors import ConfigError, DataError
from models import ModelConfig, build_model
from models.embedding import pool_grouped
from models.features import GroupedLookup
from models.meta import AdaptTarget, InnerLr, InnerReduction, MetaConfig, meta_step, plain_step, plain_step_grouped
from models.testing import (
    random_features, random_meta_batch, random_rows, split_group_rows, synthetic_schema, unique_ids_of,
)
from meta_io.batch import PlainBatch

torch.set_num_threads(1)


def _model(kind: str, dims: dict[str, int]):
    schema = synthetic_schema(n_sparse=4, n_multi_hot=2, n_text=1, n_tables=3)
    cfg = ModelConfig(kind=kind, hidden=[16], table_dims=dims) if dims else ModelConfig(kind=kind, hidden=[16])
    return schema, build_model(schema, cfg)


def _batch(seed: int, shape: tuple[int, ...], vocab: int, dims: dict[str, int] | None = None):
    """A dnn model and one batch of its features with their unique ids."""
    schema, model = _model("dnn", dims or {})
    g = torch.Generator().manual_seed(seed)
    fb = random_features(schema, shape, vocab=vocab, generator=g)
    return model, fb, unique_ids_of(schema, fb), g


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
    per_table = split_group_rows(group_grads, idx.counts, idx.tables)
    assert per_table.keys() == ref_rows.keys()
    for t in ref_rows:
        torch.testing.assert_close(per_table[t], ref_rows[t], msg=t)
    assert all(p.grad is None for p in model.parameters())  # the model's .grad untouched


def test_mixed_dims_make_groups_per_dim() -> None:
    model, fb, uniq, g = _batch(2, (11,), vocab=9, dims={"scene": 4, "tag": 4, "token": 12})
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
    per_table = split_group_rows(grads, idx.counts, idx.tables)
    assert per_table.keys() == ref_rows.keys()
    for t, gr in per_table.items():
        torch.testing.assert_close(gr, ref_rows[t], msg=t)
    with pytest.raises(DataError, match="mixes dims"):
        GroupedLookup(model.encoder, [list(model.tables)])


def test_pool_backward_is_the_transpose() -> None:
    """The custom backward (an embedding_bag over the output gradient) equals autograd's."""
    model, fb, uniq, g = _batch(3, (13,), vocab=7)
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
    model, fb, uniq, _ = _batch(4, (6,), vocab=9)
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


# -- meta steps on rows per storage group -------------------------------------------------------
META_CASES = {
    "fo both 1 step": dict(),
    "second order rows 2 steps": dict(first_order=False, adapt=AdaptTarget.ROWS, inner_steps=2),
    "dense only": dict(adapt=AdaptTarget.DENSE),
    "support weight + offsets": dict(support_loss_weight=0.5, offset_steps=2),
    "sum per support": dict(inner_loss_reduction=InnerReduction.SUM_PER_SUPPORT, inner_support_size=4),
    "loop, no vmap": dict(vectorize=False),
    "no adaptation": dict(inner_steps=0),
    "offset only": dict(inner_steps=0, offset_steps=2),
    "rows rate + clip, second order": dict(first_order=False, inner_steps=2, inner_lr_rows=1.5, inner_clip=0.1),
}


def _meta_case(grouping: str, **cfg: object):
    schema, model = _model("dnn", {})
    g = torch.Generator().manual_seed(5)
    batch = random_meta_batch(schema, tasks=5, support=4, query=3, vocab=12, generator=g, pad_tasks=1)
    rows = random_rows(batch.unique_ids, model.dims, g)
    lookup = GroupedLookup(model.encoder, GROUPINGS[grouping](list(model.tables)))
    idx = lookup.meta_index(batch.support, batch.query, batch.unique_ids)
    group_rows = {k: torch.cat([rows[t] for t in names]) for k, names in zip(idx.keys, idx.tables)}
    return model, batch, rows, idx, group_rows, MetaConfig(**cfg)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(META_CASES))
@pytest.mark.parametrize("grouping", ["one group", "split"])
def test_grouped_meta_step_equals_per_table_meta_step(case: str, grouping: str) -> None:
    model, batch, rows, idx, group_rows, cfg = _meta_case(grouping, **META_CASES[case])
    ref = meta_step(model, batch, rows, cfg)
    got = meta_step(model, batch, group_rows, cfg, grouped=idx)
    torch.testing.assert_close(got.outer_loss, ref.outer_loss)
    assert got.metrics.keys() == ref.metrics.keys()
    for k in ref.metrics:
        assert got.metrics[k] == pytest.approx(ref.metrics[k], rel=1e-5, abs=1e-6), k
    for n in ref.dense_grads:
        torch.testing.assert_close(got.dense_grads[n], ref.dense_grads[n], msg=n)
    split = split_group_rows([got.row_grads[k] for k in idx.keys], idx.counts, idx.tables)
    assert split.keys() == ref.row_grads.keys()
    for t in ref.row_grads:
        torch.testing.assert_close(split[t], ref.row_grads[t], msg=t)


def test_diagnostics_off_leaves_out_only_the_after_metrics() -> None:
    model, batch, rows, idx, group_rows, cfg = _meta_case("one group")
    full = meta_step(model, batch, group_rows, cfg, grouped=idx)
    lean = meta_step(model, batch, group_rows, cfg, grouped=idx, diagnostics=False)
    after = ("support_loss_after", "inner_diverged")
    assert all(k in full.metrics and k not in lean.metrics for k in after)
    assert {k: v for k, v in full.metrics.items() if k not in after} == lean.metrics
    torch.testing.assert_close(lean.outer_loss, full.outer_loss)
    for k in full.row_grads:
        torch.testing.assert_close(lean.row_grads[k], full.row_grads[k])


def test_grouped_meta_refuses_per_table_settings() -> None:
    model, batch, rows, idx, group_rows, _ = _meta_case("one group")
    with pytest.raises(ConfigError, match="grouped meta step"):
        meta_step(model, batch, group_rows, MetaConfig(learn_inner_lr=InnerLr.TENSOR), grouped=idx)
