"""All-reduce dense sync with 2 real worker processes: identical dense parameters at the end.

Two ``metaps worker`` processes (``[train] dense_sync = "allreduce"``, gloo
rendezvous at ``METAPS_ALLREDUCE``) share one PS shard for embedding rows. Their
static shares differ in size, so in the last steps one worker joins the
collective with zero gradients. Each worker reports a digest of its own dense
parameters; they must be equal, differ from the initial parameters, and equal
the dense values rank 0 published into the final checkpoint. The PS runs in sync
mode with SGD rows, so the result must also equal the single-process reference of
``test_parity_multi.py`` (sample-weighted mean dense gradient, one Adam step per
global step; both workers' row gradients at the same parameters).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from meta_io.reader import MetaIODataset
from workers.data_feed import static_ranges
from workers.worker import build_model, dense_digest

from ps.client import PsClient
from tests.workers.conftest import make_job
from tests.workers.test_parity_multi import SGD, compare, reference, trained_ids
from tests.ports import pick_port
from tests.workers.procs import start_worker, wait_exit, write_job


def test_two_allreduce_workers_end_with_identical_dense_params(worker_data, ps_servers, tmp_path: Path) -> None:
    job = make_job(worker_data["meta"], tmp_path, mode="meta", workers=2,
                   ps={"sync": "sync", "table_defaults": {"dim": 8, "capacity": 4096, "optimizer": SGD}},
                   train={"dense_sync": "allreduce", "log_every": 5, "epochs": 1})
    config = write_job(job, tmp_path / "job.toml")
    addrs = ps_servers(job)
    env = {"METAPS_ALLREDUCE": f"127.0.0.1:{pick_port()}"}
    run_dir = tmp_path / "run"
    logs = [tmp_path / f"worker-{r}.log" for r in range(2)]
    procs = [start_worker(config, r, addrs, run_dir, logs[r], env) for r in range(2)]
    try:
        for p, log_path in zip(procs, logs):
            assert wait_exit(p, log_path, timeout_s=240) == 0, log_path.read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    reports = [json.loads((run_dir / "workers" / f"worker-{r}.json").read_text()) for r in range(2)]
    for r, log_path in enumerate(logs):
        assert "joined all-reduce group" in log_path.read_text()

    # The static split is uneven, so one worker idled through some collective steps.
    ds = MetaIODataset(worker_data["meta"])
    shares = [sum(x.batches for x in static_ranges(ds, r, 2)) for r in range(2)]
    assert shares[0] != shares[1], "the data should give the two workers different shares"
    # A step counts for every worker (idle ones join it), so both count max(shares) steps.
    assert reports[0]["steps"] == reports[1]["steps"] == max(shares)
    assert all(rep["samples"] > 0 for rep in reports)

    digests = [rep["dense_sha256"] for rep in reports]
    assert digests[0] == digests[1], "all-reduce workers diverged"
    assert digests[0] != dense_digest(build_model(job)), "dense parameters never moved"

    # Rank 0 published its dense params into the final checkpoint: the same values.
    from ps.checkpoint import load_dense
    from workers.local import local_store

    store = local_store(job)
    model = build_model(job)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(load_dense(store, reports[0]["checkpoint"], names)) == sorted(names)
    values = store.dense.pull(names)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(values[n]).reshape(p.shape)))
    assert dense_digest(model) == digests[0]

    # ... and equal the single-process reference on the same global batches (rows and dense).
    ref_rows, ref_model, ref_steps = reference(job, None, allreduce=True)
    assert ref_steps == reports[0]["steps"]
    ids = trained_ids(job, ref_steps)
    reader = PsClient(addrs, job.rpc)
    try:
        compare(job, ref_rows, ref_model, reader.pull(ids), values, ids)
    finally:
        reader.close()
