"""Overlap mode keeps exact one-step staleness: distributed == train-local with ``overlap = true``.

In-process, the local row source pulls batch t+1's rows before step t's push
(its ``pull_async`` runs at once), so its rows are exactly one step stale. The
distributed worker's pull of batch t+1 runs in the background, after the push
of step t-1 and while step t computes: the same rows. So the two must agree to
float tolerance, like the serial parity test, even though pushes and pulls
overlap on real gRPC.
"""

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


@pytest.mark.parametrize("mode", ["plain", "meta"])
def test_overlapped_distributed_matches_overlapped_local(worker_data, ps_servers, tmp_path: Path, mode: str) -> None:
    job = make_job(worker_data["meta"], tmp_path, mode=mode, shards=2, train={"max_steps": 10, "overlap": True})
    _, local = train_local(job, tmp_path / "local", checkpoint=False)
    serial_job = make_job(worker_data["meta"], tmp_path, mode=mode, shards=2, train={"max_steps": 10, "overlap": False})
    _, serial = train_local(serial_job, tmp_path / "serial", checkpoint=False)

    addrs = ps_servers(job)
    client = PsClient(addrs, job.rpc, worker_id="worker-0", register=True)
    dist = Worker(job, 0, RemoteRowSource(client), run_dir=tmp_path / "dist", world=1)
    dist.train()
    assert dist.trainer.step_no == local.trainer.step_no == 10

    stale_differs = False
    for (name, a), (_, b), (_, c) in zip(local.model.named_parameters(), dist.model.named_parameters(),
                                         serial.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"dense param {name}")
        stale_differs |= not torch.allclose(a, c, rtol=1e-5, atol=1e-6)
    # The comparison has teeth: one-step-stale rows give a different result than fresh ones.
    assert stale_differs, "overlap made no difference: the test cannot tell stale from fresh rows"
    ids = {t: np.unique(np.concatenate([b.unique_ids[t].numpy() for b in local.dataset.iter_all()]))
           for t in next(iter(local.dataset.iter_all())).unique_ids}
    local_rows, dist_rows = local.rows.pull(ids), dist.rows.pull(ids)
    for t in ids:
        np.testing.assert_allclose(local_rows[t], dist_rows[t], rtol=1e-5, atol=1e-6, err_msg=f"table {t}")
    client.close()
