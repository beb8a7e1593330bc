"""Every model of the zoo: shapes, masking, gradients, determinism, input errors."""

import pytest
import torch

from common.errors import DataError
from models import ModelConfig, build_model, loss
from models.testing import random_features, random_rows, synthetic_schema, unique_ids_of

KINDS = ["dnn", "deepfm", "dcnv2", "esmm"]
SMALL = dict(hidden=[16, 8], expert_hidden=[8], n_experts=3, table_dims={"tag": 8})


def _cfg(kind: str, **kw) -> ModelConfig:
    return ModelConfig(kind=kind, **{**SMALL, **kw})


def _setup(kind: str, shape, seed: int = 0, **kw):
    g = torch.Generator().manual_seed(seed)
    schema = synthetic_schema()
    model = build_model(schema, _cfg(kind, **kw))
    fb = random_features(schema, shape, generator=g)
    uniq = unique_ids_of(schema, fb)
    rows = random_rows(uniq, model.dims, g)
    return schema, model, fb, uniq, rows


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(6,), (3, 5)])
def test_forward_shapes_for_any_leading_shape(kind, shape) -> None:
    schema, model, fb, uniq, rows = _setup(kind, shape)
    out = model(fb, rows, uniq)
    assert set(out) == set(schema.labels)
    for v in out.values():
        assert v.shape == shape and torch.isfinite(v).all()
    probs = model.predict(fb, rows, uniq)
    for v in probs.values():
        assert v.shape == shape and ((v >= 0) & (v <= 1)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_computed_independently(kind) -> None:
    """A [T, S] batch gives the same outputs as each row alone (no batch statistics)."""
    _, model, fb, uniq, rows = _setup(kind, (2, 3))
    out = model(fb, rows, uniq)
    one = model(fb.map(lambda t: t[1, 2:3]), rows, uniq)
    for k in out:
        torch.testing.assert_close(out[k][1, 2:3], one[k])


@pytest.mark.parametrize("kind", KINDS)
def test_masked_rows_do_not_change_the_loss(kind) -> None:
    _, model, fb, uniq, rows = _setup(kind, (12,))
    assert (~fb.mask).any(), "the test batch needs padding rows"
    total, per_head = loss(model(fb, rows, uniq), fb, model.heads)
    # Scramble everything on padding rows (features and labels): the loss must not move.
    g = torch.Generator().manual_seed(9)
    pad = ~fb.mask
    fb2 = fb.map(lambda t: t.clone())
    fb2.dense[pad] = torch.randn(int(pad.sum()), fb2.dense.shape[-1], generator=g) * 100
    for name, v in fb2.vectors.items():
        v[pad] = torch.randn(int(pad.sum()), v.shape[-1], generator=g)
    for name, y in fb2.labels.items():
        y[pad] = 1.0 - y[pad]
    total2, per_head2 = loss(model(fb2, rows, uniq), fb2, model.heads)
    torch.testing.assert_close(total, total2)
    for k in per_head:
        torch.testing.assert_close(per_head[k], per_head2[k])
    # And the loss is the mean over real rows: dropping the padding rows gives the same value.
    real = fb.map(lambda t: t[fb.mask])
    total3, _ = loss(model(real, rows, uniq), real, model.heads)
    torch.testing.assert_close(total, total3)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_rows_and_every_dense_parameter(kind) -> None:
    _, model, fb, uniq, rows = _setup(kind, (16,))
    rows = {t: r.requires_grad_() for t, r in rows.items()}
    total, _ = loss(model(fb, rows, uniq), fb, model.heads)
    total.backward()
    for t, r in rows.items():
        assert r.grad is not None and r.grad.abs().sum() > 0, f"no gradient for rows of table '{t}'"
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient for parameter '{name}'"


@pytest.mark.parametrize("kind", KINDS)
def test_init_is_deterministic_and_leaves_global_rng_alone(kind) -> None:
    schema = synthetic_schema()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(schema, _cfg(kind))
    after = torch.rand(1)
    b = build_model(schema, _cfg(kind))
    c = build_model(schema, _cfg(kind, seed=1))
    assert torch.equal(before, after)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), n
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_dims_follow_config() -> None:
    schema = synthetic_schema()
    model = build_model(schema, _cfg("dnn", default_dim=8, table_dims={"tag": 16}))
    assert model.dims == {t: (16 if t == "tag" else 8) for t in schema.tables}
    assert model.tables == schema.tables


def test_dcn_low_rank_and_deepfm_mixed_dims_run() -> None:
    for kind, kw in [("dcnv2", {"cross_rank": 4, "cross_layers": 3}), ("deepfm", {"table_dims": {"tag": 8, "token": 32}})]:
        _, model, fb, uniq, rows = _setup(kind, (5,), **kw)
        assert model(fb, rows, uniq)["click"].shape == (5,)


def test_bad_inputs_name_the_column() -> None:
    _, model, fb, uniq, rows = _setup("dnn", (4,))
    bad = fb.map(lambda t: t)
    bad.dense = bad.dense[..., :1]
    with pytest.raises(DataError, match=r"dense features \['d0', 'd1'\]: expected shape \[4, 2\], got \[4, 1\]"):
        model(bad, rows, uniq)
    bad = fb.map(lambda t: t)
    bad.vectors = {"image": bad.vectors["image"][..., :2]}
    with pytest.raises(DataError, match=r"vector column 'image': expected shape \[4, 4\], got \[4, 2\]"):
        model(bad, rows, uniq)
    with pytest.raises(DataError, match=r"rows\['tag'\]: expected shape \[\d+, 8\]"):
        model(fb, dict(rows, tag=torch.zeros(uniq["tag"].numel(), 16)), uniq)
