"""``[meta] offset_steps`` / ``offset_prior``: a per-task, per-head logit offset fitted by damped Newton
on the task's support rows after the gradient inner steps (models/meta_offset.py), applied in training
(the meta step's query loss), in evaluation (``adapt_and_predict``) and in a delivered bundle's adaptation.

References are written from the formula: a plain Python loop over tasks, heads and rows with float64
scalars (no vmap, no masks-as-tensors). Real parts only: the project's models, its functional meta step,
and a delivered bundle (LMDB, the test fleet of tests/delivery) adapting against the trainer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.func import functional_call

from delivery.config import DeliveryConfig
from delivery.loader import load_bundle
from meta_io.batch import FeatureBatch, MetaBatch
from common.config import from_mapping, to_dict
from common.errors import ConfigError
from models import ModelConfig, build_model, loss
from models.meta import AdaptTarget, MetaConfig, MetaLearner, _adapt, adapt_and_predict, meta_step
from models.meta_offset import fit_offsets
from models.testing import assert_steps_identical, random_features, random_meta_batch, random_rows, synthetic_schema
from tests.models.test_meta_support_loss import _cold_rows, _learner
from tests.delivery.conftest import Fleet, assert_bundle_adapts_like_the_trainer, tiny  # noqa: F401  (tiny: the session fixture)
from tests.workers.conftest import worker_data  # noqa: F401  (fixture)

TINY = dict(hidden=[8], default_dim=4)


def _model(kind: str = "dnn"):
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=2, vector_dim=4, max_len=3)
    return schema, build_model(schema, ModelConfig(kind=kind, **TINY))


def _batch(schema, model, seed: int, tasks: int = 4, support: int = 6, query: int = 4):
    g = torch.Generator().manual_seed(seed)
    mb = random_meta_batch(schema, tasks=tasks, support=support, query=query, vocab=8, generator=g,
                           pad_rows=0.3, pad_tasks=1)
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    return mb, rows


def ref_offset(z: list[float], y: list[float], m: list[bool], steps: int, lam: float) -> float:
    """The formula, float64 scalars, one row at a time."""
    b = 0.0
    for _ in range(steps):
        g, h = lam * b, lam
        for zi, yi, mi in zip(z, y, m):
            if mi:
                p = 1.0 / (1.0 + math.exp(-(zi + b)))
                g += p - yi
                h += p * (1.0 - p)
        b -= g / h
    return b


def _targets(model, fb: FeatureBatch) -> dict[str, torch.Tensor]:
    return {h.name: h.target(fb) for h in model.heads}


def _ref_offsets_of_task(model, logits: dict[str, torch.Tensor], sup: FeatureBatch, steps: int, lam: float):
    y = _targets(model, sup)
    m = sup.mask.bool().tolist()
    return {h: ref_offset(logits[h].double().tolist(), y[h].double().tolist(), m, steps, lam) for h in logits}


# -- config -----------------------------------------------------------------------------------------
def test_config_is_validated_naming_the_key() -> None:
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="offset_steps"):
            from_mapping(MetaConfig, {"offset_steps": bad}, where="job.toml [meta]")
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ConfigError, match="offset_prior"):
            from_mapping(MetaConfig, {"offset_prior": bad}, where="job.toml [meta]")
    only = from_mapping(MetaConfig, {"offset_steps": 2, "inner_steps": 0}, where="job.toml [meta]")
    assert only.adapts and not MetaConfig(inner_steps=0).adapts and MetaConfig().adapts  # the offset-only recipe
    assert MetaLearner(_model()[1], only).adapts
    cfg = from_mapping(MetaConfig, {"offset_steps": 3, "offset_prior": 4})
    assert cfg.offset_prior == 4.0 and isinstance(cfg.offset_prior, float)
    assert from_mapping(MetaConfig, to_dict(cfg)) == cfg  # the bundle recipe round-trips it
    assert MetaConfig().offset_steps == 0  # off by default


# -- the fit itself ---------------------------------------------------------------------------------
def test_fit_equals_the_formula_and_padding_changes_nothing() -> None:
    _, model = _model()
    g = torch.Generator().manual_seed(0)
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=2, vector_dim=4, max_len=3)
    sup = random_features(schema, (9,), vocab=8, generator=g, pad_rows=0.0)
    sup.mask[[2, 5, 7]] = False
    z = {h.name: torch.randn(9, generator=g) * 2.0 for h in model.heads}
    for steps in (1, 2, 5):
        for lam in (0.5, 2.0, 10.0):
            got = fit_offsets(z, sup, model.heads, steps, lam)
            want = _ref_offsets_of_task(model, z, sup, steps, lam)
            for h in want:
                assert abs(float(got[h]) - want[h]) < 1e-5, (steps, lam, h, float(got[h]), want[h])
    # padding rows: any logits and labels (NaN, inf, out of range) give the same offset, bit for bit
    base = fit_offsets(z, sup, model.heads, 3, 1.0)
    pad = ~sup.mask.bool()
    junk = FeatureBatch(ids=sup.ids, dense=sup.dense, vectors=sup.vectors,
                        labels={k: torch.where(pad, torch.full_like(v, float("nan")), v) for k, v in sup.labels.items()},
                        mask=sup.mask, scenario=sup.scenario, oracle=sup.oracle)
    zj = {h: torch.where(pad, torch.full_like(v, float("inf")), v) for h, v in z.items()}
    other = fit_offsets(zj, junk, model.heads, 3, 1.0)
    assert any(abs(float(base[h])) > 1e-2 for h in base)
    for h in base:
        assert torch.equal(base[h], other[h]), h
    # the real rows alone (no padding slots at all) give the same offset
    keep = sup.mask.bool()
    real = sup.map(lambda t: t[keep])
    alone = fit_offsets({h: v[keep] for h, v in z.items()}, real, model.heads, 3, 1.0)
    for h in base:
        torch.testing.assert_close(alone[h], base[h], rtol=1e-6, atol=1e-7)
    # no real row: b = 0
    none = sup.map(lambda t: t)
    none.mask[:] = False
    assert all(float(v) == 0.0 for v in fit_offsets(z, none, model.heads, 4, 1.0).values())


def test_a_huge_prior_gives_no_offset() -> None:
    """lambda -> inf: b -> 0, in the fit and end to end (adapted predictions equal offset-off ones)."""
    schema, model = _model()
    g = torch.Generator().manual_seed(1)
    sup = random_features(schema, (8,), vocab=8, generator=g, pad_rows=0.2)
    z = {h.name: torch.randn(8, generator=g) * 3.0 for h in model.heads}
    sizes = [max(abs(float(b)) for b in fit_offsets(z, sup, model.heads, 3, lam).values()) for lam in (1.0, 1e3, 1e9)]
    assert sizes[0] > 1e-2 and sizes[1] < 1e-2 and sizes[2] < 1e-8, sizes
    mb, rows = _batch(schema, model, 2)
    base = dict(inner_steps=1, inner_lr=0.2)
    off = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, MetaConfig(**base))
    far = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids,
                            MetaConfig(**base, offset_steps=3, offset_prior=1e9))
    near = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids,
                             MetaConfig(**base, offset_steps=3, offset_prior=1.0))
    for h in off:
        torch.testing.assert_close(far[h], off[h], rtol=0, atol=1e-6)
    assert max(float((near[h] - off[h]).abs().max()) for h in off) > 1e-3


# -- off: the inner loop of before ------------------------------------------------------------------


@pytest.mark.parametrize("learn", ["off", "element"])
def test_off_is_bit_identical_to_the_default(learn) -> None:
    """``offset_steps = 0`` takes exactly the default path whatever ``offset_prior`` (training and evaluation).

    That path equals the previous commit's meta_step / adapt_and_predict bit for bit: checked once
    against ``git archive HEAD~`` (see the commit message); tests/models/test_meta.py's per-task
    reference keeps checking its values.
    """
    schema, model = _model()
    mb, rows = _batch(schema, model, 3)
    for first_order in (True, False):
        base = dict(inner_steps=2, inner_lr=0.2, learn_inner_lr=learn, first_order=first_order)
        a = MetaLearner(model, MetaConfig(**base))
        b = MetaLearner(model, MetaConfig(**base, offset_steps=0, offset_prior=0.01))
        b.load_state_dict(a.state_dict())
        assert_steps_identical(meta_step(model, mb, rows, a), meta_step(model, mb, rows, b))
        pa = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, a)
        pb = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, b)
        for h in pa:
            assert torch.equal(pa[h], pb[h]), h


# -- evaluation: adapt_and_predict ------------------------------------------------------------------
@pytest.mark.parametrize("kind,inner_steps", [("dnn", 1), ("esmm", 1), ("dnn", 0)])
def test_adapted_predictions_add_the_reference_offset(kind, inner_steps) -> None:
    """Per task: sigmoid(adapted query logit + b_ref), b_ref from the formula on the adapted support logits.

    ESMM: the offset is on the loss's CTCVR logit, logit(p_ctcvr) (models/meta_offset.py).
    ``inner_steps = 0``: the offset-only recipe, b_ref on the base model's support logits."""
    schema, model = _model(kind)
    mb, rows = _batch(schema, model, 4)
    cfg = MetaConfig(inner_steps=inner_steps, inner_lr=0.3, offset_steps=2, offset_prior=1.5)
    for vectorize in (True, False):
        import dataclasses

        got = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids,
                                dataclasses.replace(cfg, vectorize=vectorize))
        params = {n: p.detach() for n, p in model.named_parameters()}
        moved = 0.0
        for i in range(mb.task_mask.numel()):
            sup, qry = mb.support.map(lambda t: t[i]), mb.query.map(lambda t: t[i])
            index = model.lookup_index(sup, mb.unique_ids, rows)
            fp, fr, _, _ = _adapt(model, params, rows, sup, index, cfg)
            z_s = functional_call(model, fp, (sup, fr, mb.unique_ids))
            b = _ref_offsets_of_task(model, z_s, sup, cfg.offset_steps, cfg.offset_prior)
            z_q = functional_call(model, fp, (qry, fr, mb.unique_ids))
            real = qry.mask.bool()
            for h in b:
                want = torch.sigmoid(z_q[h].double() + b[h])
                torch.testing.assert_close(got[h][i][real].double(), want[real], rtol=0, atol=1e-5)
                if sup.mask.any():
                    moved = max(moved, abs(b[h]))
        assert moved > 1e-2, "the offsets are all ~0: the test would not see them dropped"


# -- training: the meta step's query loss -----------------------------------------------------------
def reference(model, mb: MetaBatch, rows, cfg: MetaConfig):
    """Per-task autograd with explicit fast weights (tests/models/test_meta.py), plus the offset from
    the formula (float64 per row; differentiated through unless first order)."""
    P = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    R = {t: r.detach().clone().requires_grad_() for t, r in rows.items()}
    real = [i for i in range(mb.task_mask.numel()) if mb.task_mask[i] and mb.query.mask[i].any()]
    total = torch.zeros((), dtype=torch.float64)
    for i in real:
        sup, qry = mb.support.map(lambda t: t[i]), mb.query.map(lambda t: t[i])
        fp, fr = dict(P), dict(R)
        for _ in range(cfg.inner_steps):
            l_s = loss(functional_call(model, fp, (sup, fr, mb.unique_ids)), sup, model.heads)[0]
            names, inputs = list(fp) + list(fr), [fp[n] for n in fp] + [fr[t] for t in fr]
            gs = torch.autograd.grad(l_s, inputs, create_graph=not cfg.first_order, materialize_grads=True)
            new = {n: x - cfg.inner_lr * gr for n, x, gr in zip(names, inputs, gs)}
            fp, fr = {n: new[n] for n in fp}, {t: new[t] for t in fr}
        z_s = functional_call(model, fp, (sup, fr, mb.unique_ids))
        y = _targets(model, sup)
        z_q = functional_call(model, fp, (qry, fr, mb.unique_ids))
        yq = _targets(model, qry)
        for h in model.heads:
            zs = z_s[h.name].double()
            if cfg.first_order:
                zs = zs.detach()
            b = torch.zeros((), dtype=torch.float64)
            for _ in range(cfg.offset_steps):
                g, hess = cfg.offset_prior * b, torch.full((), cfg.offset_prior, dtype=torch.float64)
                for r in range(zs.shape[0]):
                    if sup.mask[r]:
                        p = torch.sigmoid(zs[r] + b)
                        g = g + p - float(y[h.name][r])
                        hess = hess + p * (1 - p)
                b = b - g / hess
            rows_q = [r for r in range(z_q[h.name].shape[0]) if qry.mask[r]]
            bce = sum(torch.nn.functional.binary_cross_entropy_with_logits(
                z_q[h.name][r].double() + b, torch.tensor(float(yq[h.name][r]), dtype=torch.float64)) for r in rows_q)
            total = total + bce / len(rows_q)
    total = total / max(len(real), 1)
    grads = torch.autograd.grad(total, list(P.values()) + list(R.values()), materialize_grads=True)
    return total.detach(), dict(zip(P, grads[: len(P)])), dict(zip(R, grads[len(P):]))


@pytest.mark.parametrize("first_order,inner_steps", [(True, 1), (False, 1), (True, 0), (False, 0)])
def test_meta_step_trains_on_the_offset_query_loss(first_order, inner_steps) -> None:
    """``inner_steps = 0``: the offset-only recipe (no gradient step, the offset on the base's support logits)."""
    schema, model = _model()
    mb, rows = _batch(schema, model, 5)
    mb.query.mask[1] = False  # a real task without query rows: weight 0
    cfg = MetaConfig(inner_steps=inner_steps, inner_lr=0.3, first_order=first_order, adapt=AdaptTarget.BOTH,
                     offset_steps=2, offset_prior=1.5)
    res = meta_step(model, mb, rows, cfg)
    want_loss, want_dense, want_rows = reference(model, mb, rows, cfg)
    torch.testing.assert_close(res.outer_loss.double(), want_loss, rtol=1e-5, atol=1e-6)
    for got, want in ((res.dense_grads, want_dense), (res.row_grads, want_rows)):
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k].double(), want[k].double(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    off = meta_step(model, mb, rows, MetaConfig(inner_steps=inner_steps, inner_lr=0.3, first_order=first_order))
    assert abs(float(off.outer_loss) - float(res.outer_loss)) > 1e-3, "the offset changed nothing"
    # vmap == loop
    import dataclasses

    loop = meta_step(model, mb, rows, dataclasses.replace(cfg, vectorize=False))
    torch.testing.assert_close(loop.outer_loss, res.outer_loss)


def test_meta_emb_cold_start_loss_gets_the_offset_too() -> None:
    """MetaEmb's simulated cold start adapts again from generated rows; its query loss carries that
    adaptation's offset. Cold weight 1: the outer loss is that term alone."""
    schema, model = _model()
    mb, rows = _batch(schema, model, 6)
    init = _cold_rows(model, mb, rows)
    kw = dict(inner_steps=1, inner_lr=0.3, meta_emb=True, meta_emb_tables=["user"], meta_emb_cold_weight=1.0)
    off = meta_step(model, mb, rows, _learner(model, init, **kw))
    on = meta_step(model, mb, rows, _learner(model, init, **kw, offset_steps=2, offset_prior=1.0))
    far = meta_step(model, mb, rows, _learner(model, init, **kw, offset_steps=2, offset_prior=1e9))
    assert abs(float(on.outer_loss) - float(off.outer_loss)) > 1e-3, "the cold-start term ignored the offset"
    torch.testing.assert_close(far.outer_loss, off.outer_loss, rtol=0, atol=1e-6)


# -- a delivered bundle adapts like the trainer -----------------------------------------------------
META = MetaConfig(inner_steps=1, inner_lr=0.05, adapt=AdaptTarget.BOTH, offset_steps=2, offset_prior=1.0)


def test_a_bundle_adapts_like_the_trainer_with_the_offset(tmp_path, tiny) -> None:  # noqa: F811
    fleet = Fleet(tiny)
    fleet.train(seed=3, fraction=0.7)
    rec = assert_bundle_adapts_like_the_trainer(
        tiny, fleet, tmp_path, META, MetaConfig(inner_steps=1, inner_lr=0.05, adapt=AdaptTarget.BOTH), 1e-3, "the offset")
    assert rec["offset_steps"] == 2 and rec["offset_prior"] == 1.0


# -- the trainer end to end: train-local, checkpoint, metaps evaluate, a bundle from the checkpoint ----
def test_trained_with_the_offset_evaluate_and_bundle_agree(worker_data, tmp_path) -> None:  # noqa: F811
    """A real train-local job with the offset on: ``metaps evaluate`` on its checkpoint equals the
    training-time evaluation (1e-6), a bundle exported from the checkpoint adapts like the trainer (1e-5),
    ``--offset-steps 0`` changes the adapted score and ``--inner-steps 0`` scores the base only."""
    import json

    from delivery.adapt import AdaptingModel
    from delivery.export import CheckpointSource, export_bundle
    from meta_io.reader import MetaIODataset
    from metaps.cli import main
    from tests.models.conftest import assert_evaluate_matches_training
    from tests.workers.conftest import make_job
    from workers.local import train_local

    job = make_job(worker_data["meta"], tmp_path, meta={"inner_lr": 0.1, "offset_steps": 2, "offset_prior": 1.0},
                   train={"max_steps": 6})
    _, local = train_local(job, tmp_path / "local", checkpoint=False)
    learner = local.trainer.learner
    assert learner.cfg.offset_steps == 2
    ckpt = local.checkpoint()
    assert_evaluate_matches_training(ckpt, worker_data["meta"], tmp_path / "eval.json", local.model, local.rows,
                                     local.trainer.inner_loop)
    on = json.loads((tmp_path / "eval.json").read_text())
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(worker_data["meta"]), "--protocol", "episodes",
                 "--offset-steps", "0", "--out", str(tmp_path / "off.json")]) == 0
    off = json.loads((tmp_path / "off.json").read_text())
    assert off["meta"]["offset_steps"] == 0 and on["meta"]["offset_steps"] == 2
    assert abs(off["adapted"]["click"]["logloss"] - on["adapted"]["click"]["logloss"]) > 1e-4
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(worker_data["meta"]), "--protocol", "episodes",
                 "--inner-steps", "0", "--out", str(tmp_path / "base.json")]) == 0
    assert not json.loads((tmp_path / "base.json").read_text()).get("adapted")

    staging = tmp_path / "bundle" / "v000001"
    staging.mkdir(parents=True)
    export_bundle(CheckpointSource.open(ckpt), staging, "v000001", DeliveryConfig(out=str(tmp_path / "bundle")))
    served = AdaptingModel(load_bundle(staging))
    try:
        assert served.cfg.offset_steps == 2 and served.cfg.offset_prior == 1.0
        mb = next(iter(MetaIODataset(worker_data["meta"]).iter_all()))
        rows = {t: torch.from_numpy(r) for t, r in local.rows.pull({t: u.numpy() for t, u in mb.unique_ids.items()}).items()}
        want = adapt_and_predict(local.model, mb.support, mb.query, rows, mb.unique_ids, local.trainer.inner_loop)
        got = served.adapted_probs(mb.support, mb.query)
        real = mb.query.mask.bool()
        for h in want:
            np.testing.assert_allclose(got[h][real].numpy(), want[h][real].numpy(), atol=1e-5, rtol=0, err_msg=h)
    finally:
        served.serving.close()


def test_evaluate_protocol_scores_the_offset_only_recipe() -> None:
    """``inner_steps = 0, offset_steps > 0`` adapts (``MetaConfig.adapts``): evaluate_protocol reports adapted
    scores, differing from the base; no inner step and no offset: base only."""
    from workers.eval_protocols import FixedRows, evaluate_protocol

    schema, model = _model()
    mb, rows = _batch(schema, model, 7, tasks=6, support=8, query=8)
    src = FixedRows({t: (mb.unique_ids[t].numpy(), rows[t].numpy()) for t in rows},
                    {t: (lambda ids, d=model.dims[t]: np.zeros((len(ids), d), np.float32)) for t in rows})
    only = evaluate_protocol(model, src, [mb], MetaConfig(inner_steps=0, offset_steps=2, offset_prior=1.0))
    assert only.get("adapted") and only["adapted"]["click"]["logloss"] != only["base"]["click"]["logloss"]
    assert not evaluate_protocol(model, src, [mb], MetaConfig(inner_steps=0)).get("adapted")
