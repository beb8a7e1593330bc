"""MetaEmb cold-id initialization: exactly the unseen ids' rows are generated, the generator
is meta-trained by the outer loop, and a bundle adapts exactly as the trainer evaluates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from models import ModelConfig, build_model
from models.meta import MetaConfig, MetaLearner, adapt_and_predict, meta_step
from models.meta_emb import unseen_mask
from models.meta_learner import PREFIX
from models.testing import random_meta_batch, random_rows, synthetic_schema
from ps.config import InitKind
from ps.initializer import RowInitializer

from tests.models.conftest import assert_evaluate_matches_training
from tests.workers.conftest import make_job, worker_data  # noqa: F401  (fixtures)


def _setup(steps: int = 0, cold_weight: float = 0.0, first_order: bool = True, seed: int = 0, labels: bool = False):
    g = torch.Generator().manual_seed(seed)
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=2, vector_dim=4, max_len=3)
    model = build_model(schema, ModelConfig(kind="dnn", hidden=[8], default_dim=4))
    mb = random_meta_batch(schema, tasks=4, support=5, query=4, vocab=8, generator=g, pad_tasks=1)
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    cfg = MetaConfig(inner_steps=steps, inner_lr=0.1, first_order=first_order, meta_emb=True,
                     meta_emb_tables=["user"], meta_emb_cold_weight=cold_weight, meta_emb_labels=labels)
    learner = MetaLearner(model, cfg)
    init = {t: RowInitializer(t, d, InitKind.NORMAL, 0.01, 7) for t, d in model.dims.items()}
    learner.set_init_rows(init)
    with torch.no_grad():  # a generator that generates something (it starts at zero)
        for p in learner.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model, mb, rows, learner, init


def _make_unseen(rows, mb, init, which: slice) -> torch.Tensor:
    """Give the ``which`` user ids their initial row (never trained); returns the bool mask."""
    uid = mb.unique_ids["user"]
    ref = torch.from_numpy(init["user"](uid.numpy()))
    mask = torch.zeros(uid.shape[0], dtype=torch.bool)
    mask[which] = True
    rows["user"][mask] = ref[mask]
    return mask


def test_unseen_rule_is_row_equals_init() -> None:
    init = RowInitializer("user", 4, InitKind.NORMAL, 0.01, 0)
    ids = torch.tensor([3, 5, 9, 11])
    rows = torch.from_numpy(init(ids.numpy())).clone()
    rows[1] += 0.05  # trained once
    rows[2] = rows[2].half().float()  # float16 wire rounding: still the init row
    assert unseen_mask(rows, ids, init).tolist() == [True, False, True, True]


@pytest.mark.parametrize("labels", [False, True])
def test_generated_rows_replace_exactly_the_unseen_rows(labels: bool) -> None:
    """Row-by-row reference: per task, every unseen user id present gets W mean(x over its support rows) + b,
    every other row is left as pulled; with 0 inner steps the predictions must equal the model on those rows.
    With ``meta_emb_labels`` x also holds each head's support label."""
    model, mb, rows, learner, init = _setup(steps=0, labels=labels)
    unseen = _make_unseen(rows, mb, init, slice(0, None, 2))
    assert torch.equal(learner.unseen(rows, mb.unique_ids)["user"], unseen)
    got = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, learner)

    uid = mb.unique_ids["user"]
    W, b = learner.meta_emb_w[0].detach(), learner.meta_emb_b[0].detach()
    others = [i for i, lay in enumerate(model.layouts) if lay.table != "user"]
    n_replaced = 0
    for t in range(mb.task_mask.shape[0]):
        sup, qry = mb.support.map(lambda x: x[t]), mb.query.map(lambda x: x[t])
        enc = model.encoder(sup, rows, model.lookup_index(sup, mb.unique_ids, rows))
        heads = [h.name for h in model.heads] if labels else []
        x = torch.cat([enc.pooled[i].flatten(-2) for i in others] + [enc.dense]
                      + [sup.labels[h][:, None] for h in heads], -1)
        task_rows = {k: v.clone() for k, v in rows.items()}
        ids_here = torch.cat([sup.ids["user_id"][sup.mask.bool()].reshape(-1), qry.ids["user_id"][qry.mask.bool()]
                              .reshape(-1)]).unique()
        for u in ids_here.tolist():
            pos = int(torch.searchsorted(uid, u))
            if not unseen[pos]:
                continue
            held = (sup.ids["user_id"].reshape(sup.mask.shape[0], -1) == u).any(-1) & sup.mask.bool()
            mean = x[held].mean(0) if held.any() else torch.zeros(x.shape[-1])
            task_rows["user"][pos] = W @ mean + b
            n_replaced += 1
        want = model.predict(qry, task_rows, mb.unique_ids)
        real = qry.mask.bool()
        for h in want:
            torch.testing.assert_close(got[h][t][real], want[h][real], rtol=1e-5, atol=1e-6, msg=f"task {t} {h}")
    assert n_replaced >= 2


def test_generator_receives_outer_gradients_only_through_unseen_rows() -> None:
    names = [PREFIX + "meta_emb_w.0", PREFIX + "meta_emb_b.0"]
    model, mb, rows, learner, init = _setup(steps=1, cold_weight=0.0, first_order=False)
    warm = meta_step(model, mb, rows, learner)  # no unseen id, no simulated cold start: no signal
    for n in names:
        assert torch.count_nonzero(warm.dense_grads[n]) == 0, n
    _make_unseen(rows, mb, init, slice(None))
    res = meta_step(model, mb, rows, learner)
    for n in names:
        assert torch.count_nonzero(res.dense_grads[n]) > 0, n
    # the gradient is the outer loss's (central finite difference along the bias gradient)
    d = res.dense_grads[names[1]]
    eps = 1e-3
    losses = []
    for sign in (1.0, -1.0):
        with torch.no_grad():
            learner.meta_emb_b[0].add_(sign * eps * d / d.norm())
        losses.append(float(meta_step(model, mb, rows, learner).outer_loss))
        with torch.no_grad():
            learner.meta_emb_b[0].sub_(sign * eps * d / d.norm())
    fd = (losses[0] - losses[1]) / (2 * eps)
    assert fd == pytest.approx(float(d.norm()), rel=0.02)
    # the simulated cold start trains it from warm ids too
    model, mb, rows, learner, _ = _setup(steps=1, cold_weight=0.5)
    assert torch.count_nonzero(meta_step(model, mb, rows, learner).dense_grads[names[0]]) > 0


def test_meta_emb_config_errors() -> None:
    schema = synthetic_schema(n_sparse=1, n_multi_hot=0, n_text=0, n_dense=1, vector_dim=4, max_len=3)
    model = build_model(schema, ModelConfig(kind="dnn", hidden=[8], default_dim=4))
    with pytest.raises(ValueError, match="meta_emb_tables"):
        MetaConfig(meta_emb=True)
    with pytest.raises(ValueError, match="meta_emb_cold_weight"):
        MetaConfig(meta_emb=True, meta_emb_tables=["user"], meta_emb_cold_weight=1.5)
    with pytest.raises(ConfigError, match=r"meta_emb_tables: \['nope'\]"):
        MetaLearner(model, MetaConfig(meta_emb=True, meta_emb_tables=["nope"]))
    g = torch.Generator().manual_seed(0)
    mb = random_meta_batch(schema, tasks=2, support=3, query=3, vocab=8, generator=g)
    rows = random_rows(mb.unique_ids, model.dims, g)
    with pytest.raises(ConfigError, match="unseen-id rule"):  # a bare [meta] config cannot decide unseen ids
        adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids,
                          MetaConfig(meta_emb=True, meta_emb_tables=["user"]))


def test_trained_generator_ships_and_bundle_adapts_like_the_trainer(worker_data, tmp_path: Path) -> None:  # noqa: F811
    from delivery.adapt import AdaptingModel
    from delivery.config import DeliveryConfig
    from delivery.export import CheckpointSource, export_bundle
    from delivery.loader import load_bundle
    from meta_io.reader import MetaIODataset
    from workers.local import train_local

    job = make_job(worker_data["meta"], tmp_path, meta={"inner_lr": 0.1, "learn_inner_lr": "tensor", "meta_emb": True,
                                                        "meta_emb_tables": ["user"]}, train={"max_steps": 8})
    _, local = train_local(job, tmp_path / "local", checkpoint=False)
    learner = local.trainer.learner
    assert learner.meta_emb and torch.count_nonzero(learner.meta_emb_w[0]) > 0, "the generator was not trained"
    ckpt = local.checkpoint()
    staging = tmp_path / "bundle" / "v000001"
    staging.mkdir(parents=True)
    export_bundle(CheckpointSource.open(ckpt), staging, "v000001", DeliveryConfig(out=str(tmp_path / "bundle")))
    served = AdaptingModel(load_bundle(staging))
    for (n, a), (_, b) in zip(learner.named_parameters(), served.learner.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"bundle {n}")

    checked = mixed = 0
    for mb in MetaIODataset(worker_data["meta"]).iter_all():
        rows = {t: torch.from_numpy(r) for t, r in local.rows.pull({t: u.numpy() for t, u in mb.unique_ids.items()}).items()}
        unseen = learner.unseen(rows, mb.unique_ids)["user"]
        mixed += int(bool(unseen.any()) and not bool(unseen.all()))
        want = adapt_and_predict(local.model, mb.support, mb.query, rows, mb.unique_ids, learner)
        got = served.adapted_probs(mb.support, mb.query)
        real = mb.query.mask.bool()
        for h in want:
            np.testing.assert_allclose(got[h][real].numpy(), want[h][real].numpy(), atol=1e-5, rtol=0, err_msg=h)
        checked += 1
        if checked >= 12 and mixed:
            break
    assert mixed, "no batch had both trained and unseen users"

    # metaps evaluate on the checkpoint applies the generator too (episodes == training-time eval)
    assert_evaluate_matches_training(ckpt, worker_data["meta"], tmp_path / "eval.json", local.model, local.rows,
                                     learner)
