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


DROP_MODULE = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.heads = list(spec.heads)
        width = sum(spec.features.values()) + len(spec.dense)
        self.mlp = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Dropout(spec.dropout))
        self.out = nn.Linear(16, len(self.heads))

    def forward(self, features, dense):
        z = self.out(self.mlp(torch.cat([*features.values(), dense], dim=-1)))
        return {h: z[..., i] for i, h in enumerate(self.heads)}
"""


def _drop_case(case: str, tmp_path, dropout: float):
    """(kind, extra config) of a dropout case: the zoo's kinds, ESMM's two bottoms, a custom module."""
    if case == "custom":
        (tmp_path / "drop_model.py").write_text(DROP_MODULE)
        return "custom", {"class_path": "drop_model:Model", "class_dir": str(tmp_path), "dropout": dropout}
    kind, _, bottom = case.partition("-")
    return kind, {"dropout": dropout, **({"bottom": bottom} if bottom else {})}


@pytest.mark.parametrize("case", ["dnn", "deepfm", "dcnv2", "esmm-shared", "esmm-mmoe", "custom"])
def test_dropout_is_on_in_training_and_off_in_eval_and_export(case, tmp_path) -> None:
    """``[model] dropout`` in every kind (a custom module reads ``spec.dropout``): two training-mode
    forwards differ; eval mode and the traced export (delivery.dense.trace_dense) give the outputs of
    the same model without dropout (dropout adds no parameter: same init)."""
    from delivery.dense import flat_inputs, trace_dense

    kind, kw = _drop_case(case, tmp_path, 0.5)
    _, model, fb, uniq, rows = _setup(kind, (16,), **kw)
    kind0, kw0 = _drop_case(case, tmp_path, 0.0)
    _, plain, *_ = _setup(kind0, (16,), **kw0)
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.5 for m in model.modules())
    if case != "custom":  # the default builds no dropout module at all: today's numbers unchanged
        assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    model.train()
    a, b = model(fb, rows, uniq), model(fb, rows, uniq)
    assert all(not torch.equal(a[h], b[h]) for h in a), "dropout off in training"
    model.eval()
    plain.eval()
    want = plain.predict(fb, rows, uniq)
    for h, p in model.predict(fb, rows, uniq).items():
        torch.testing.assert_close(p, want[h], rtol=0, atol=0)
    model.train()  # export must switch it off itself
    scripted, spec = trace_dense(model, model.schema, model.dims)
    got = [scripted(*flat_inputs(spec.inputs, fb, uniq, rows)) for _ in range(2)]
    for i, h in enumerate(spec.heads):
        torch.testing.assert_close(got[0][i], want[h], rtol=0, atol=1e-6)
        assert torch.equal(got[0][i], got[1][i])
