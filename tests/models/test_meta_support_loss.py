"""``[meta] support_loss_weight``: the outer objective adds ``w x`` the base model's own loss on
each task's support rows (unadapted, the pulled rows), weighted over tasks like the query loss.

References are eager autograd (no torch.func): the query part is tests/models/test_meta.py's
per-task reference; the support part is an explicit per-task forward of the base model.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.func import functional_call

from meta_io.batch import MetaBatch
from common.config import from_mapping
from common.errors import ConfigError
from models import ModelConfig, build_model, loss
from models.meta import AdaptTarget, InnerLr, MetaConfig, MetaLearner, meta_step
from models.meta_learner import PREFIX
from models.testing import assert_steps_identical, random_meta_batch, random_rows, synthetic_schema
from ps.config import InitKind
from ps.initializer import RowInitializer

from tests.models.test_meta import reference as query_reference

TINY = dict(hidden=[8], default_dim=4)


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=2, vector_dim=4, max_len=3)
    model = build_model(schema, ModelConfig(kind="dnn", **TINY))
    mb = random_meta_batch(schema, tasks=4, support=5, query=4, vocab=8, generator=g, pad_tasks=1)
    mb.query.mask[1] = False  # a real task with no query rows: weight 0 for its support term too
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    return model, mb, rows


def support_reference(model, mb: MetaBatch, rows) -> tuple[torch.Tensor, dict, dict]:
    """Mean over weighted tasks of the base model's support loss, and its gradients (eager)."""
    P = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    R = {t: r.detach().clone().requires_grad_() for t, r in rows.items()}
    real = [i for i in range(mb.task_mask.numel()) if mb.task_mask[i] and mb.query.mask[i].any()]
    total = torch.zeros(())
    for i in real:
        sup = mb.support.map(lambda t: t[i])
        total = total + loss(functional_call(model, P, (sup, R, mb.unique_ids)), sup, model.heads)[0]
    total = total / max(len(real), 1)
    grads = torch.autograd.grad(total, list(P.values()) + list(R.values()), materialize_grads=True)
    return total.detach(), dict(zip(P, grads[: len(P)])), dict(zip(R, grads[len(P):]))


def _close(a: dict, b: dict, names: str) -> None:
    assert set(a) == set(b), names
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{names} {k}: {m}")


def _learner(model, init, **kw) -> MetaLearner:
    ln = MetaLearner(model, MetaConfig(**kw))
    ln.set_init_rows(init)
    with torch.no_grad():  # a generator that generates something, distinct rates; the same every call
        for p in ln.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    return ln


def _cold_rows(model, mb, rows):
    """Half of the user ids get their PS initial row (unseen, for MetaEmb); returns the initializers."""
    init = {t: RowInitializer(t, d, InitKind.NORMAL, 0.01, 7) for t, d in model.dims.items()}
    uid = mb.unique_ids["user"]
    rows["user"][: uid.shape[0] // 2] = torch.from_numpy(init["user"](uid[: uid.shape[0] // 2].numpy()))
    return init


def test_weight_zero_is_bit_identical_to_the_default() -> None:
    """An explicit 0.0 takes exactly the default path (no extra term, no extra forward).

    That path equals the pre-support_loss_weight meta_step bit for bit: checked once against
    the previous commit's models/meta.py on 38 configurations (see the commit message); the
    per-task reference of tests/models/test_meta.py keeps checking its values.
    """
    model, mb, rows = _setup()
    for first_order in (True, False):
        a = meta_step(model, mb, rows, MetaConfig(inner_steps=2, inner_lr=0.3, first_order=first_order))
        b = meta_step(model, mb, rows, MetaConfig(inner_steps=2, inner_lr=0.3, first_order=first_order,
                                                  support_loss_weight=0.0))
        assert_steps_identical(a, b)
    # every inner-loop option at once: learned rates, MetaEmb with its cold-start blend
    init = _cold_rows(model, mb, rows)
    kw = dict(inner_steps=1, inner_lr=0.1, learn_inner_lr=InnerLr.ELEMENT, meta_emb=True, meta_emb_tables=["user"],
              meta_emb_cold_weight=0.3)
    assert_steps_identical(meta_step(model, mb, rows, _learner(model, init, **kw)),
               meta_step(model, mb, rows, _learner(model, init, **kw, support_loss_weight=0.0)))


@pytest.mark.parametrize(
    "first_order, steps, adapt, vectorize",
    [(fo, s, ad, True) for fo, s, ad in itertools.product([True, False], [0, 1, 2], list(AdaptTarget))]
    + [(True, 1, AdaptTarget.BOTH, False), (False, 2, AdaptTarget.BOTH, False)],
)
def test_gradients_equal_query_plus_weighted_support_reference(first_order, steps, adapt, vectorize) -> None:
    model, mb, rows = _setup()
    w = 0.7
    cfg = MetaConfig(inner_steps=steps, inner_lr=0.3, first_order=first_order, adapt=adapt, vectorize=vectorize,
                     support_loss_weight=w)
    res = meta_step(model, mb, rows, cfg)
    q_loss, q_dense, q_rows = query_reference(model, mb, rows, cfg)
    s_loss, s_dense, s_rows = support_reference(model, mb, rows)
    torch.testing.assert_close(res.outer_loss, q_loss + w * s_loss)
    _close(res.dense_grads, {k: q_dense[k] + w * s_dense[k] for k in q_dense}, "dense")
    _close(res.row_grads, {k: q_rows[k] + w * s_rows[k] for k in q_rows}, "rows")
    # the metrics keep their meaning: the query loss alone, and the support loss before adaptation
    assert res.metrics["query_loss"] == pytest.approx(float(q_loss), rel=1e-5)
    assert res.metrics["support_loss_before"] == pytest.approx(float(s_loss), rel=1e-5)
    assert res.metrics["tasks"] == 2.0


def test_the_support_term_changes_the_gradients() -> None:
    """Guards the test above against a reference that would also pass with the term dropped."""
    model, mb, rows = _setup()
    a = meta_step(model, mb, rows, MetaConfig(inner_steps=1, inner_lr=0.3))
    b = meta_step(model, mb, rows, MetaConfig(inner_steps=1, inner_lr=0.3, support_loss_weight=1.0))
    _, s_dense, _ = support_reference(model, mb, rows)
    assert any(float(s_dense[k].abs().max()) > 1e-4 for k in s_dense)
    _close({k: b.dense_grads[k] - a.dense_grads[k] for k in s_dense}, s_dense, "w=1 minus w=0")


@pytest.mark.parametrize("learn", [InnerLr.TENSOR, InnerLr.ELEMENT])
@pytest.mark.parametrize("first_order", [True, False])
def test_learned_rates_the_term_adds_only_the_base_support_gradient(learn, first_order) -> None:
    model, mb, rows = _setup()
    w = 1.5
    base = dict(inner_steps=2, inner_lr=0.2, first_order=first_order, learn_inner_lr=learn)
    lr0 = MetaLearner(model, MetaConfig(**base))
    lrw = MetaLearner(model, MetaConfig(**base, support_loss_weight=w))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distinct rates, the same in both learners
        for p0, pw in zip(lr0.parameters(), lrw.parameters()):
            p0.add_(torch.randn(p0.shape, generator=g) * 0.3)
            pw.copy_(p0)
    a, b = meta_step(model, mb, rows, lr0), meta_step(model, mb, rows, lrw)
    s_loss, s_dense, s_rows = support_reference(model, mb, rows)
    torch.testing.assert_close(b.outer_loss, a.outer_loss + w * s_loss)
    _close({k: b.dense_grads[k] - a.dense_grads[k] for k in a.dense_grads},
           {**{k: w * v for k, v in s_dense.items()},
            **{k: torch.zeros_like(v) for k, v in a.dense_grads.items() if k.startswith(PREFIX)}}, "dense")
    _close({k: b.row_grads[k] - a.row_grads[k] for k in a.row_grads}, {k: w * v for k, v in s_rows.items()}, "rows")


def test_meta_emb_the_support_term_uses_the_pulled_rows_not_generated_ones() -> None:
    """With MetaEmb the base is the model as served without adaptation: the pulled rows."""
    model, mb, rows = _setup()
    init = _cold_rows(model, mb, rows)
    w = 0.5
    learners = [_learner(model, init, inner_steps=1, inner_lr=0.1, meta_emb=True, meta_emb_tables=["user"],
                         meta_emb_cold_weight=0.3, support_loss_weight=weight) for weight in (0.0, w)]
    a, b = (meta_step(model, mb, rows, ln) for ln in learners)
    s_loss, s_dense, s_rows = support_reference(model, mb, rows)
    torch.testing.assert_close(b.outer_loss, a.outer_loss + w * s_loss)
    _close({k: b.dense_grads[k] - a.dense_grads[k] for k in a.dense_grads},
           {**{k: w * v for k, v in s_dense.items()},
            **{k: torch.zeros_like(v) for k, v in a.dense_grads.items() if k.startswith(PREFIX)}}, "dense")
    _close({k: b.row_grads[k] - a.row_grads[k] for k in a.row_grads}, {k: w * v for k, v in s_rows.items()}, "rows")


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "1", True])
def test_bad_weight_is_a_config_error_naming_the_key(bad) -> None:
    with pytest.raises(ConfigError, match="support_loss_weight"):
        from_mapping(MetaConfig, {"support_loss_weight": bad}, where="job.toml")
    assert from_mapping(MetaConfig, {"support_loss_weight": 2}, where="job.toml").support_loss_weight == 2.0
