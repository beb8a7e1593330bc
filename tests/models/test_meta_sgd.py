"""Meta-SGD (learned inner rates) and multi-step inner loops against unrolled autograd."""

import itertools

import pytest
import torch
from torch.func import functional_call

from common.config import from_mapping
from common.errors import ConfigError
from models import ModelConfig, build_model, loss
from models.meta import AdaptTarget, InnerLr, MetaConfig, MetaLearner, adapt_and_predict, meta_step
from models.meta_learner import PREFIX
from models.testing import random_meta_batch, random_rows, synthetic_schema

TINY = dict(hidden=[8], default_dim=4)


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=2, vector_dim=4, max_len=3)
    model = build_model(schema, ModelConfig(kind="dnn", **TINY))
    mb = random_meta_batch(schema, tasks=3, support=5, query=4, vocab=8, generator=g, pad_tasks=1)
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    return model, mb, rows


def _perturb(learner: MetaLearner, seed: int = 1) -> None:
    """Distinct rates per tensor / element, so a rate applied to the wrong tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def unrolled(model, mb, rows, learner: MetaLearner):
    """Explicit per-task unrolled SGD with per-tensor rates exp(log_rate); plain autograd."""
    cfg = learner.cfg
    P = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    R = {t: r.detach().clone().requires_grad_() for t, r in rows.items()}
    M = {n: p.detach().clone().requires_grad_() for n, p in learner.named_parameters()}
    rate_d = {n: M[f"dense_log_lr.{i}"].exp() for i, n in enumerate(learner.dense_names)} if learner.learned else {}
    rate_r = {t: M[f"rows_log_lr.{i}"].exp() for i, t in enumerate(learner.tables)} if learner.learned else {}
    real = [i for i in range(mb.task_mask.numel()) if mb.task_mask[i] and mb.query.mask[i].any()]
    total = torch.zeros(())
    for i in real:
        sup, qry = mb.support.map(lambda t: t[i]), mb.query.map(lambda t: t[i])
        fp, fr = dict(P), dict(R)
        for _ in range(cfg.inner_steps):
            l_s = loss(functional_call(model, fp, (sup, fr, mb.unique_ids)), sup, model.heads)[0]
            dn = list(fp) if cfg.adapts_dense else []
            rn = list(fr) if cfg.adapts_rows else []
            gs = torch.autograd.grad(l_s, [fp[n] for n in dn] + [fr[t] for t in rn],
                                     create_graph=not cfg.first_order, materialize_grads=True)
            rows_lr = cfg.inner_lr_rows or cfg.inner_lr  # [meta] inner_lr_rows (0: inner_lr)
            ud = {n: rate_d.get(n, cfg.inner_lr) * gr for n, gr in zip(dn, gs[: len(dn)])}
            ur = {t: rate_r.get(t, rows_lr) * gr for t, gr in zip(rn, gs[len(dn):])}
            for u in (ud, ur):  # [meta] inner_clip: each group's update norm at most clip
                if cfg.inner_clip > 0 and u:
                    norm = torch.sqrt(sum((v ** 2).sum() for v in u.values()))
                    u.update({k: v * torch.clamp(cfg.inner_clip / norm, max=1.0) for k, v in u.items()})
            fp.update({n: fp[n] - v for n, v in ud.items()})
            fr.update({t: fr[t] - v for t, v in ur.items()})
        total = total + loss(functional_call(model, fp, (qry, fr, mb.unique_ids)), qry, model.heads)[0]
    total = total / max(len(real), 1)
    inputs = list(P.values()) + list(R.values()) + list(M.values())
    grads = torch.autograd.grad(total, inputs, materialize_grads=True)
    dense = dict(zip(P, grads[: len(P)]))
    dense.update({PREFIX + n: gr for n, gr in zip(M, grads[len(P) + len(R):])})
    return total.detach(), dense, dict(zip(R, grads[len(P): len(P) + len(R)]))


def _close(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize(
    "mode, steps, first_order",
    [(InnerLr.OFF, 3, True), (InnerLr.OFF, 5, True)]
    + list(itertools.product([InnerLr.TENSOR, InnerLr.ELEMENT], [1, 3], [True, False])),
)
def test_inner_steps_equal_unrolled_sgd_with_learned_rates(mode, steps, first_order) -> None:
    _check_unrolled(mode, steps, first_order)


@pytest.mark.parametrize("mode, first_order, clip", [(InnerLr.OFF, True, 0.0), (InnerLr.TENSOR, True, 0.0),
                                                     (InnerLr.ELEMENT, False, 0.05), (InnerLr.TENSOR, False, 0.05)])
def test_rows_rate_and_clip_with_learned_rates(mode, first_order, clip) -> None:
    """``inner_lr_rows`` (the rows' fixed rate, or each table's learned rate's start) and ``inner_clip``."""
    _check_unrolled(mode, 2, first_order, inner_lr_rows=1.3, inner_clip=clip, perturb=False)


def _check_unrolled(mode, steps, first_order, perturb: bool = True, **kw) -> None:
    model, mb, rows = _setup()
    learner = MetaLearner(model, MetaConfig(inner_steps=steps, inner_lr=0.2, first_order=first_order,
                                            learn_inner_lr=mode, **kw))
    if perturb:
        _perturb(learner)
    res = meta_step(model, mb, rows, learner)
    want_loss, want_dense, want_rows = unrolled(model, mb, rows, learner)
    torch.testing.assert_close(res.outer_loss, want_loss)
    _close(res.dense_grads, want_dense)
    _close(res.row_grads, want_rows)
    if mode != InnerLr.OFF:
        # the rates get a real outer gradient, even first-order (d x_K / d rate = -grad)
        rate_grads = [res.dense_grads[PREFIX + n] for n, _ in learner.named_parameters()]
        assert rate_grads and all(torch.isfinite(g).all() for g in rate_grads)
        assert sum(float(g.abs().sum()) for g in rate_grads) > 0


def test_rate_shapes_and_adapt_target() -> None:
    model, _, _ = _setup()
    el = MetaLearner(model, MetaConfig(learn_inner_lr="element", adapt=AdaptTarget.ROWS))
    assert len(el.dense_log_lr) == 0 and [tuple(p.shape) for p in el.rows_log_lr] == [(model.dims[t],) for t in el.tables]
    te = MetaLearner(model, MetaConfig(learn_inner_lr="tensor", adapt=AdaptTarget.DENSE))
    assert len(te.rows_log_lr) == 0 and all(p.shape == () for p in te.dense_log_lr)
    assert len(te.dense_log_lr) == len(list(model.parameters()))
    rows_rate = MetaLearner(model, MetaConfig(learn_inner_lr="tensor", inner_lr=0.2, inner_lr_rows=0.7)).inner_recipe()
    assert all(float(v) == pytest.approx(0.7) for v in rows_rate["rows_lr"].values()) and rows_rate["rows_lr"]
    assert all(float(v) == pytest.approx(0.2) for v in rows_rate["dense_lr"].values())
    assert rows_rate["inner_lr_rows"] == 0.7 and rows_rate["inner_clip"] == 0.0
    off = MetaLearner(model, MetaConfig(inner_steps=3, inner_lr=0.2))
    assert not off.learned and list(off.parameters()) == []
    assert (off.inner_steps, off.inner_lr) == (3, 0.2)  # read like a MetaConfig (metaps evaluate, bench)


def test_rates_stay_positive_and_learn_under_outer_training() -> None:
    """A few outer SGD steps on the log-rates: the rates move, and stay positive even when pushed hard."""
    model, mb, rows = _setup()
    learner = MetaLearner(model, MetaConfig(inner_steps=1, inner_lr=0.1, learn_inner_lr="element"))
    before = {k: v.clone() for k, v in learner.inner_recipe()["rows_lr"].items()}
    opt = torch.optim.SGD(learner.parameters(), lr=50.0)  # absurdly large: log-params still give rates > 0
    for _ in range(5):
        res = meta_step(model, mb, rows, learner)
        for n, p in learner.named_parameters():
            p.grad = res.dense_grads[PREFIX + n]
        opt.step()
    recipe = learner.inner_recipe()
    assert recipe["learn_inner_lr"] == "element" and recipe["inner_steps"] == 1
    moved = False
    for part in ("dense_lr", "rows_lr"):
        for v in recipe[part].values():
            assert torch.isfinite(v).all() and (v > 0).all()
    for t, v in recipe["rows_lr"].items():
        moved |= not torch.allclose(v, before[t])
    assert moved


def test_adapt_and_predict_uses_the_learned_rates() -> None:
    model, mb, rows = _setup()
    cfg = MetaConfig(inner_steps=2, inner_lr=0.3, learn_inner_lr="tensor")
    learner = MetaLearner(model, cfg)
    same = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, learner)
    fixed = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, MetaConfig(inner_steps=2, inner_lr=0.3))
    for h in same:  # rates initialised to inner_lr: identical predictions
        torch.testing.assert_close(same[h], fixed[h])
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(1.0)  # every rate x e
    moved = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, learner)
    assert any(not torch.allclose(moved[h], fixed[h]) for h in moved)


def test_load_dense_round_trip_and_clear_errors() -> None:
    model, _, _ = _setup()
    a = MetaLearner(model, MetaConfig(learn_inner_lr="element"))
    _perturb(a)
    values = {n: p.detach().numpy().copy() for n, p in a.store_named_parameters()}
    b = MetaLearner(model, MetaConfig(learn_inner_lr="element"))
    b.load_dense(values)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q)
    c = MetaLearner(model, MetaConfig(learn_inner_lr="element"))
    keep = {n: p.clone() for n, p in c.named_parameters()}
    broken = dict(values)
    broken.pop(next(iter(broken)))
    with pytest.raises(ConfigError, match="learn_inner_lr"):
        c.load_dense(broken)
    wrong = dict(values)
    last = list(wrong)[-1]
    wrong[last] = wrong[last][:1]
    with pytest.raises(ConfigError, match="expected"):
        c.load_dense(wrong)
    for n, p in c.named_parameters():  # a failed load changes nothing
        torch.testing.assert_close(p, keep[n])


def test_learn_inner_lr_key_validated() -> None:
    assert from_mapping(MetaConfig, {"learn_inner_lr": "tensor"}, prefix="meta").learn_inner_lr is InnerLr.TENSOR
    with pytest.raises(ConfigError, match="meta.learn_inner_lr"):
        from_mapping(MetaConfig, {"learn_inner_lr": "per-row"}, prefix="meta")
