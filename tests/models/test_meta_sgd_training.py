"""Meta-SGD in the step engine: the rates train like dense params, land in checkpoints, and a
distributed worker (real gRPC PS on loopback) learns exactly what train-local learns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from delivery.adapt import AdaptingModel
from delivery.config import DeliveryConfig
from delivery.export import CheckpointSource, export_bundle
from delivery.loader import load_bundle
from meta_io.reader import MetaIODataset
from models.meta import MetaLearner, adapt_and_predict
from ps.client import PsClient
from workers.local import train_local
from workers.row_source import RemoteRowSource
from workers.worker import Worker

from tests.workers.conftest import make_job, ps_servers, worker_data  # noqa: F401  (fixtures)


@pytest.mark.parametrize("mode", ["element"])
def test_learned_rates_train_checkpoint_and_match_distributed(worker_data, ps_servers, tmp_path: Path, mode) -> None:  # noqa: F811
    job = make_job(worker_data["meta"], tmp_path, meta={"inner_lr": 0.1, "learn_inner_lr": mode},
                   train={"max_steps": 8})
    _, local = train_local(job, tmp_path / "local", checkpoint=False)
    learner = local.trainer.learner
    assert isinstance(learner, MetaLearner) and learner.learned
    recipe = learner.inner_recipe()
    moved = 0
    for part in ("dense_lr", "rows_lr"):
        for name, v in recipe[part].items():
            assert (v > 0).all(), f"{part} {name}: a rate <= 0"
            moved += int(not torch.allclose(v, torch.full_like(v, 0.1)))
    assert moved > 0, "no learned rate moved from inner_lr"

    ckpt = local.checkpoint()
    src = CheckpointSource.open(ckpt)
    names = [n for n, _ in learner.store_named_parameters()]
    restored = MetaLearner(local.model, job.meta)
    restored.load_dense(src.dense(names))
    for (n, a), (_, b) in zip(learner.named_parameters(), restored.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"checkpointed rate {n}")

    # a bundle ships the learned rates and adapts with them, as the trainer does
    staging = tmp_path / "bundle" / "v000001"
    staging.mkdir(parents=True)
    export_bundle(src, staging, "v000001", DeliveryConfig(out=str(tmp_path / "bundle")))
    served = AdaptingModel(load_bundle(staging))
    for part in ("dense_lr", "rows_lr"):
        for n, v in recipe[part].items():
            torch.testing.assert_close(served.learner.inner_recipe()[part][n], v, msg=f"bundle {part} {n}")
    mb = next(iter(MetaIODataset(worker_data["meta"]).iter_all()))
    rows = {t: torch.from_numpy(r) for t, r in local.rows.pull({t: u.numpy() for t, u in mb.unique_ids.items()}).items()}
    want = adapt_and_predict(local.model, mb.support, mb.query, rows, mb.unique_ids, learner)
    got = served.adapted_probs(mb.support, mb.query)
    real = mb.query.mask.bool()
    for h in want:
        np.testing.assert_allclose(got[h][real].numpy(), want[h][real].numpy(), atol=1e-5, rtol=0, err_msg=h)

    # metaps evaluate on the checkpoint adapts with the learned rates too (episodes == training-time eval)
    from tests.models.conftest import assert_evaluate_matches_training

    assert_evaluate_matches_training(ckpt, worker_data["meta"], tmp_path / "eval.json", local.model, local.rows,
                                     learner)

    addrs = ps_servers(job)
    client = PsClient(addrs, job.rpc, worker_id="worker-0", register=True)
    try:
        dist = Worker(job, 0, RemoteRowSource(client), run_dir=tmp_path / "dist", world=1)
        dist.train()
        assert dist.trainer.step_no == 8
        for (n, a), (_, b) in zip(learner.named_parameters(), dist.trainer.learner.named_parameters()):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"distributed rate {n}")
    finally:
        client.close()
