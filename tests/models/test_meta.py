"""Meta step against a plain per-task autograd reference; vmap == loop; plain step."""

import itertools
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from meta_io.batch import MetaBatch
from common.config import from_mapping
from common.errors import ConfigError
from models import ModelConfig, build_model, loss
from models.meta import AdaptTarget, MetaConfig, adapt_and_predict, assign_grads, meta_step, plain_step
from models.testing import random_meta_batch, random_plain_batch, random_rows, synthetic_schema

TINY = dict(hidden=[8], expert_hidden=[8], n_experts=2, default_dim=4, cross_layers=1)


def _setup(kind: str = "dnn", seed: int = 0, tasks: int = 4, pad_tasks: int = 1):
    g = torch.Generator().manual_seed(seed)
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=1, n_dense=2, vector_dim=4, max_len=3)
    model = build_model(schema, ModelConfig(kind=kind, **TINY))
    mb = random_meta_batch(schema, tasks=tasks, support=5, query=4, vocab=8, generator=g, pad_tasks=pad_tasks)
    if tasks > 1:
        mb.query.mask[1] = False  # a real task slot with no real query rows: weight 0, no NaN
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    return model, mb, rows


def reference(model, mb: MetaBatch, rows, cfg: MetaConfig):
    """Per-task autograd with explicit fast-weight copies (no torch.func transforms).

    Rates per group: the dense parameters step at ``inner_lr``, the rows at ``inner_lr_rows`` (``inner_lr``
    when 0); ``inner_clip`` > 0: each group's update ``rate * g`` times ``min(1, clip / ||update||)``."""
    P = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    R = {t: r.detach().clone().requires_grad_() for t, r in rows.items()}
    real = [i for i in range(mb.task_mask.numel()) if mb.task_mask[i] and mb.query.mask[i].any()]
    total = torch.zeros(())
    for i in real:
        sup = mb.support.map(lambda t: t[i])
        qry = mb.query.map(lambda t: t[i])
        fp, fr = dict(P), dict(R)
        for _ in range(cfg.inner_steps):
            out = functional_call(model, fp, (sup, fr, mb.unique_ids))
            l_s = loss(out, sup, model.heads)[0]
            names = (list(fp) if cfg.adapts_dense else []) + (list(fr) if cfg.adapts_rows else [])
            inputs = ([fp[n] for n in fp] if cfg.adapts_dense else []) + ([fr[t] for t in fr] if cfg.adapts_rows else [])
            gs = torch.autograd.grad(l_s, inputs, create_graph=not cfg.first_order, materialize_grads=True)
            rows_lr = cfg.inner_lr_rows if cfg.inner_lr_rows > 0 else cfg.inner_lr
            upd = {n: (rows_lr if n in fr else cfg.inner_lr) * g for n, g in zip(names, gs)}
            if cfg.inner_clip > 0:
                for group in ([n for n in upd if n in fp], [n for n in upd if n in fr]):
                    if group:
                        norm = torch.sqrt(sum((upd[n] ** 2).sum() for n in group))
                        scale = torch.clamp(cfg.inner_clip / norm, max=1.0)
                        upd.update({n: scale * upd[n] for n in group})
            new = {n: x - upd[n] for n, x in zip(names, inputs)}
            if cfg.adapts_dense:
                fp = {n: new[n] for n in fp}
            if cfg.adapts_rows:
                fr = {t: new[t] for t in fr}
        total = total + loss(functional_call(model, fp, (qry, fr, mb.unique_ids)), qry, model.heads)[0]
    total = total / max(len(real), 1)
    grads = torch.autograd.grad(total, list(P.values()) + list(R.values()), materialize_grads=True)
    return total.detach(), dict(zip(P, grads[: len(P)])), dict(zip(R, grads[len(P):]))


def _close(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize(
    "first_order, steps, adapt",
    list(itertools.product([True, False], [1, 2], list(AdaptTarget))),
)
def test_meta_grads_equal_per_task_autograd_reference(first_order, steps, adapt) -> None:
    model, mb, rows = _setup("dnn")
    # The loop runs on the 2-step cases only (vmap == loop; keeps the suite fast).
    for vectorize in (True, False) if steps == 2 else (True,):
        cfg = MetaConfig(inner_steps=steps, inner_lr=0.3, first_order=first_order, adapt=adapt, vectorize=vectorize)
        res = meta_step(model, mb, rows, cfg)
        want_loss, want_dense, want_rows = reference(model, mb, rows, cfg)
        torch.testing.assert_close(res.outer_loss, want_loss)
        _close(res.dense_grads, want_dense)
        _close(res.row_grads, want_rows)
        assert res.metrics["tasks"] == 2.0  # 4 slots: 1 padding task, 1 with an empty query


@pytest.mark.parametrize("first_order, clip, adapt", [(True, 0.0, "both"), (False, 0.0, "both"), (True, 0.05, "both"),
                                                     (False, 0.05, "both"), (False, 0.05, "rows")])
def test_inner_rates_per_group_and_clip_equal_the_reference(first_order, clip, adapt) -> None:
    """``inner_lr_rows`` steps the rows, ``inner_lr`` the dense parameters; ``inner_clip`` bounds each group's
    update norm; vmap, loop and the autograd reference agree, first and second order."""
    model, mb, rows = _setup("dnn")
    base = dict(inner_steps=2, inner_lr=0.3, inner_lr_rows=1.7, first_order=first_order, adapt=adapt, inner_clip=clip)
    want_loss, want_dense, want_rows = reference(model, mb, rows, MetaConfig(**base))
    for vectorize in (True, False):
        res = meta_step(model, mb, rows, MetaConfig(**base, vectorize=vectorize))
        torch.testing.assert_close(res.outer_loss, want_loss)
        _close(res.dense_grads, want_dense)
        _close(res.row_grads, want_rows)
    # the knobs matter here: one rate for both groups, or no clip, gives another loss (a binding clip keeps
    # only each group's direction: then the rates do not matter)
    if not clip:
        same = reference(model, mb, rows, MetaConfig(**{**base, "inner_lr_rows": 0.0}))[0]
        assert abs(float(same - want_loss)) > 1e-4
    else:
        assert abs(float(reference(model, mb, rows, MetaConfig(**{**base, "inner_clip": 0.0}))[0] - want_loss)) > 1e-4


@pytest.mark.parametrize("kind, bottom", [("deepfm", "shared"), ("dcnv2", "shared"), ("esmm", "shared"), ("esmm", "mmoe"),
                                         ("custom", "shared")])
def test_vmap_equals_loop_and_reference_for_every_model(kind, bottom) -> None:
    """... the custom one being docs/examples/two_tower.py, on a schema with the item table it declares."""
    g = torch.Generator().manual_seed(1)
    if kind == "custom":
        from meta_io.synth.generator import GeneratorConfig, generator_schema

        schema = generator_schema(GeneratorConfig(rows=10, n_user_features=1, n_item_features=1, n_context_features=0,
                                                  n_multi_hot=1, n_dense=1, image_dim=4, text_max_len=3))
        examples = str(Path(__file__).resolve().parents[2] / "docs" / "examples")
        cfg = ModelConfig(kind="custom", class_path="two_tower:TwoTower", class_dir=examples, hidden=[8], default_dim=4)
    else:
        schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=1, vector_dim=4, max_len=3)
        cfg = ModelConfig(kind=kind, bottom=bottom, **TINY)
    model = build_model(schema, cfg)
    mb = random_meta_batch(schema, tasks=3, support=4, query=4, vocab=6, generator=g)
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    cfg = MetaConfig(inner_steps=2, inner_lr=0.2, first_order=False, adapt=AdaptTarget.BOTH)
    vec = meta_step(model, mb, rows, cfg)
    loop = meta_step(model, mb, rows, MetaConfig(2, 0.2, False, AdaptTarget.BOTH, vectorize=False))
    _, want_dense, want_rows = reference(model, mb, rows, cfg)
    for res in (vec, loop):
        _close(res.dense_grads, want_dense)
        _close(res.row_grads, want_rows)
    assert vec.metrics == pytest.approx(loop.metrics, rel=1e-5)


def test_first_order_row_grads_only_reach_query_rows() -> None:
    model, mb, rows = _setup("dnn", tasks=3, pad_tasks=0)
    mb.query.mask[1] = True
    used_by_query = {}
    for t in model.tables:
        cols = [c.name for c in model.schema.id_columns if c.table_name == t]
        q_ids = torch.cat([mb.query.ids[c][mb.query.mask].reshape(-1) for c in cols])
        used_by_query[t] = torch.isin(mb.unique_ids[t], q_ids)
    fo = meta_step(model, mb, rows, MetaConfig(inner_steps=1, first_order=True, adapt=AdaptTarget.ROWS))
    so = meta_step(model, mb, rows, MetaConfig(inner_steps=1, first_order=False, adapt=AdaptTarget.ROWS))
    support_only = 0
    for t in model.tables:
        touched = fo.row_grads[t].abs().sum(-1) > 0
        assert not (touched & ~used_by_query[t]).any(), f"table {t}: FO gradient on rows the query never used"
        support_only += int(((so.row_grads[t].abs().sum(-1) > 0) & ~used_by_query[t]).sum())
    assert support_only > 0, "second order should reach rows used only by the support set"


def test_meta_step_does_not_touch_the_model() -> None:
    model, mb, rows = _setup("esmm")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = meta_step(model, mb, rows, MetaConfig(inner_steps=2, first_order=False))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
    assert not res.outer_loss.requires_grad
    assert res.metrics["support_loss_after"] < res.metrics["support_loss_before"]
    assign_grads(model, res.dense_grads)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, res.dense_grads[n])


def test_zero_inner_steps_is_plain_training_on_the_query() -> None:
    model, mb, rows = _setup("dnn", tasks=1, pad_tasks=0)
    mb.query.mask[0, 0] = True
    res = meta_step(model, mb, rows, MetaConfig(inner_steps=0))
    assert res.metrics["support_loss_before"] == res.metrics["support_loss_after"]
    P = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    R = {t: r.clone().requires_grad_() for t, r in rows.items()}
    qry = mb.query.map(lambda t: t[0])
    total = loss(functional_call(model, P, (qry, R, mb.unique_ids)), qry, model.heads)[0]
    total.backward()
    _close(res.dense_grads, {n: p.grad for n, p in P.items()})
    _close(res.row_grads, {t: r.grad for t, r in R.items()})


@pytest.mark.parametrize("kind", ["dnn", "esmm"])
def test_plain_step_equals_eager_backward(kind) -> None:
    g = torch.Generator().manual_seed(3)
    schema = synthetic_schema()
    model = build_model(schema, ModelConfig(kind=kind, **TINY))
    pb = random_plain_batch(schema, 12, generator=g)
    rows = random_rows(pb.unique_ids, model.dims, g)
    total, dense_grads, row_grads = plain_step(model, pb, rows)
    R = {t: r.clone().requires_grad_() for t, r in rows.items()}
    want, _ = loss(model(pb.features, R, pb.unique_ids), pb.features, model.heads)
    want.backward()
    torch.testing.assert_close(total, want.detach())
    _close(dense_grads, {n: p.grad for n, p in model.named_parameters()})
    _close(row_grads, {t: r.grad for t, r in R.items()})


def test_adapt_and_predict() -> None:
    model, mb, rows = _setup("esmm", pad_tasks=0)
    cfg = MetaConfig(inner_steps=2, inner_lr=0.5)
    vec = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, cfg)
    loop = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, MetaConfig(2, 0.5, vectorize=False))
    assert set(vec) == {"click", "conversion"}
    for k in vec:
        assert vec[k].shape == (4, 4) and not vec[k].requires_grad
        torch.testing.assert_close(vec[k], loop[k])
    assert (vec["conversion"] <= vec["click"]).all()
    none = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, MetaConfig(inner_steps=0))
    torch.testing.assert_close(none["click"], model.predict(mb.query, rows, mb.unique_ids)["click"])
    assert not torch.allclose(none["click"], vec["click"])


def test_meta_config_validation() -> None:
    with pytest.raises(ValueError, match="inner_steps"):
        MetaConfig(inner_steps=-1)
    with pytest.raises(ValueError, match="inner_lr"):
        MetaConfig(inner_lr=0.0)
    assert MetaConfig(adapt="rows").adapt is AdaptTarget.ROWS
    cfg = from_mapping(MetaConfig, {"inner_steps": 2, "adapt": "dense", "first_order": False}, prefix="meta")
    assert cfg == MetaConfig(inner_steps=2, adapt=AdaptTarget.DENSE, first_order=False)
    with pytest.raises(ConfigError, match="meta.adapt"):
        from_mapping(MetaConfig, {"adapt": "everything"}, prefix="meta")


# -- learning sanity ----------------------------------------------------------
def _bias_tasks(tasks: int, n: int, item_effect: torch.Tensor, g: torch.Generator) -> MetaBatch:
    """Tasks whose click rate is sigmoid(item effect + task bias), bias = +-2.5 per task."""
    from meta_io.batch import FeatureBatch

    bias = (torch.randint(0, 2, (tasks, 1), generator=g) * 2 - 1) * 2.5

    def half() -> FeatureBatch:
        ids = torch.randint(0, item_effect.numel(), (tasks, n), generator=g)
        y = (torch.rand(tasks, n, generator=g) < torch.sigmoid(item_effect[ids] + bias)).float()
        return FeatureBatch(
            ids={"item": ids[..., None]}, dense=torch.zeros(tasks, n, 0), vectors={}, labels={"click": y},
            mask=torch.ones(tasks, n, dtype=torch.bool), scenario=torch.zeros(tasks, n, dtype=torch.long),
        )

    return MetaBatch(support=half(), query=half(), task_keys=torch.arange(tasks),
                     task_mask=torch.ones(tasks, dtype=torch.bool), unique_ids={"item": torch.arange(item_effect.numel())})


def test_meta_training_beats_no_adaptation_on_held_out_tasks() -> None:
    from meta_io.batch import FeatureBatch, PlainBatch
    from meta_io.schema import ColumnKind, ColumnSpec, Schema

    schema = Schema(
        columns=[ColumnSpec("user_id", ColumnKind.EXTRA), ColumnSpec("item", ColumnKind.SPARSE),
                 ColumnSpec("click", ColumnKind.LABEL)],
        task_key="user_id", labels=["click"],
    )
    item_effect = torch.randn(16, generator=torch.Generator().manual_seed(0))
    cfg = MetaConfig(inner_steps=1, inner_lr=1.0, adapt=AdaptTarget.DENSE)

    def train(meta: bool):
        model = build_model(schema, ModelConfig(hidden=[8], default_dim=4))
        table = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)) * 0.1  # the "PS"
        opt = torch.optim.Adam(model.parameters(), lr=0.03)
        g = torch.Generator().manual_seed(2)
        for _ in range(60):
            mb = _bias_tasks(12, 8, item_effect, g)
            if meta:
                res = meta_step(model, mb, {"item": table}, cfg)
                dense_grads, row_grads = res.dense_grads, res.row_grads
            else:  # plain training on the same rows, tasks pooled
                flat = mb.query.map(lambda t: t.flatten(0, 1))
                _, dense_grads, row_grads = plain_step(model, PlainBatch(flat, mb.unique_ids), {"item": table})
            assign_grads(model, dense_grads)
            opt.step()
            table = table - 0.3 * row_grads["item"]
        return model, table

    held_out = _bias_tasks(64, 8, item_effect, torch.Generator().manual_seed(99))

    def query_loss(model, table, cfg: MetaConfig) -> float:
        p = adapt_and_predict(model, held_out.support, held_out.query, {"item": table}, held_out.unique_ids, cfg)
        return torch.nn.functional.binary_cross_entropy(p["click"], held_out.query.labels["click"]).item()

    meta_model, meta_table = train(meta=True)
    plain_model, plain_table = train(meta=False)
    adapted = query_loss(meta_model, meta_table, cfg)
    no_adaptation = query_loss(plain_model, plain_table, MetaConfig(inner_steps=0))
    plain_then_adapted = query_loss(plain_model, plain_table, cfg)
    assert adapted < no_adaptation - 0.2, (adapted, no_adaptation)
    assert adapted < plain_then_adapted, (adapted, plain_then_adapted)


def test_table_with_no_ids_in_the_batch() -> None:
    """An all-padding list column leaves its table empty: [0, D] rows, zero pooled vectors."""
    model, mb, rows = _setup("dnn", tasks=3, pad_tasks=0)
    for fb in (mb.support, mb.query):
        fb.ids["tags0"].fill_(-1)
    mb.unique_ids["tag"] = torch.zeros(0, dtype=torch.long)
    rows = dict(rows, tag=torch.zeros(0, model.dims["tag"]))
    cfg = MetaConfig(inner_steps=1, first_order=False)
    res = meta_step(model, mb, rows, cfg)
    _, want_dense, want_rows = reference(model, mb, rows, cfg)
    _close(res.dense_grads, want_dense)
    _close(res.row_grads, want_rows)
    assert res.row_grads["tag"].shape == (0, model.dims["tag"])


# -- stability: [meta] inner_clip, divergence reported ------------------------------------------------
def _six_tasks():
    g = torch.Generator().manual_seed(0)
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=2, vector_dim=4, max_len=3)
    model = build_model(schema, ModelConfig(kind="dnn", hidden=[8], default_dim=4))
    mb = random_meta_batch(schema, tasks=6, support=8, query=4, vocab=8, generator=g, pad_tasks=0)
    return model, mb, random_rows(mb.unique_ids, model.dims, g, scale=0.5)


def test_a_clipped_inner_loop_stays_finite_where_the_plain_one_blows_up(caplog) -> None:
    """5 steps at rate 20: unclipped, the support loss explodes or goes NaN and those tasks are reported
    diverged (adapt_tasks, meta_step's ``inner_diverged``, the learner's windowed warning); clipped at 0.5,
    every task's support loss is finite and lower than before."""
    import logging

    from models.meta import MetaLearner, adapt_tasks
    from models.meta_learner import DivergenceWatch

    model, mb, rows = _six_tasks()
    wild = MetaConfig(inner_steps=5, inner_lr=20.0)
    tame = MetaConfig(inner_steps=5, inner_lr=20.0, inner_clip=0.5)
    blown = adapt_tasks(model, mb.support, mb.query, rows, mb.unique_ids, wild)
    bad = ~torch.isfinite(blown.support_loss_after) | (blown.support_loss_after > 10 * blown.support_loss_before)
    assert int(bad.sum()) >= 2 and blown.diverged_share >= 2 / 6
    assert torch.equal(blown.diverged, bad | (blown.support_loss_after > blown.support_loss_before))
    ok = adapt_tasks(model, mb.support, mb.query, rows, mb.unique_ids, tame)
    assert torch.isfinite(ok.support_loss_after).all() and (ok.support_loss_after < ok.support_loss_before).all()
    assert ok.diverged_share == 0.0 and all(torch.isfinite(p).all() for p in ok.probs.values())
    # training: the metric, and one warning per window of diagnosed steps above the share
    for cfg, share, warns in ((wild, blown.diverged_share, 1), (tame, 0.0, 0)):
        learner = MetaLearner(model, cfg)
        learner.divergence = DivergenceWatch(window=2, share=0.1)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="models.meta_learner"):
            for _ in range(2):
                res = meta_step(model, mb, rows, learner)
                assert res.metrics["inner_diverged"] == pytest.approx(share)
            meta_step(model, mb, rows, learner, diagnostics=False)  # not diagnosed: not counted
        assert sum("inner step diverged" in r.getMessage() for r in caplog.records) == warns
        assert learner.divergence.warnings == warns and learner.divergence.total_tasks == 12.0
    # no gradient step (the offset-only recipe): nothing can diverge
    only = adapt_tasks(model, mb.support, mb.query, rows, mb.unique_ids, MetaConfig(inner_steps=0, offset_steps=2))
    assert not only.diverged.any()


def test_adapt_tasks_logits_are_the_probabilities_and_the_offsets_inputs() -> None:
    """``adapt_tasks(logits=True)``: sigmoid(query logits) = adapt_and_predict's probabilities; with an offset,
    sigmoid(query logits + fit_offsets(support logits)) = them; the support logits give support_loss_after."""
    from models.meta import adapt_tasks
    from models.meta_offset import fit_offsets

    model, mb, rows = _setup("esmm", pad_tasks=0)
    for cfg in (MetaConfig(inner_steps=2, inner_lr=0.5), MetaConfig(inner_steps=1, offset_steps=2, offset_prior=1.0)):
        out = adapt_tasks(model, mb.support, mb.query, rows, mb.unique_ids, cfg, logits=True)
        want = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, cfg)
        for t in range(mb.task_mask.numel()):
            sup = mb.support.map(lambda x: x[t])
            zs = {h: v[t] for h, v in out.support_logits.items()}
            b = fit_offsets(zs, sup, model.heads, cfg.offset_steps, cfg.offset_prior) if cfg.offset_steps else {}
            for h in want:
                torch.testing.assert_close(torch.sigmoid(out.query_logits[h][t] + b.get(h, 0.0)), want[h][t])
                torch.testing.assert_close(out.probs[h][t], want[h][t])
            torch.testing.assert_close(loss(zs, sup, model.heads)[0], out.support_loss_after[t])
