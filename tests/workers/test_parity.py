"""Distributed training (1 worker, 1 and 2 PS shards, synchronous) equals train-local."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ps.client import PsClient
from workers.local import train_local
from workers.row_source import RemoteRowSource
from workers.worker import Worker

from tests.workers.conftest import make_job


def _all_ids(worker: Worker) -> dict[str, np.ndarray]:
    ids: dict[str, list[np.ndarray]] = {}
    for batch in worker.dataset.iter_all():
        for t, u in batch.unique_ids.items():
            ids.setdefault(t, []).append(u.numpy())
    return {t: np.unique(np.concatenate(v)) for t, v in ids.items()}


@pytest.mark.parametrize("mode,shards", [("meta", 1), ("meta", 2), ("plain", 2)])
def test_distributed_matches_local(worker_data, ps_servers, tmp_path: Path, mode: str, shards: int) -> None:
    job = make_job(worker_data["meta"], tmp_path, mode=mode, shards=shards, train={"max_steps": 12})
    _, local = train_local(job, tmp_path / "local", checkpoint=False)

    addrs = ps_servers(job)
    client = PsClient(addrs, job.rpc, worker_id="worker-0", register=True)
    dist = Worker(job, 0, RemoteRowSource(client), run_dir=tmp_path / "dist", world=1)
    dist.train()
    assert dist.trainer.step_no == local.trainer.step_no == 12

    for (name, a), (_, b) in zip(local.model.named_parameters(), dist.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"dense param {name}")
    ids = _all_ids(local)
    local_rows = local.rows.pull(ids)
    dist_rows = dist.rows.pull(ids)
    for t in ids:
        np.testing.assert_allclose(local_rows[t], dist_rows[t], rtol=1e-5, atol=1e-6, err_msg=f"table {t}")
        # training really moved rows (the comparison is not between two untouched tables)
    moved = [float(np.abs(local_rows[t]).sum()) for t in ids]
    assert sum(moved) > 0
    client.close()
