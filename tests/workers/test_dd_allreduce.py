"""AntDT-DD with real processes: 2 all-reduce workers train the batch sizes the controller sends.

A real controller (gRPC, policy off so the test chooses the plans), one real PS
shard and two ``metaps worker`` processes (gloo). While they train, the
controller sends two batch-size plans (64/32, then 20/76 of a global batch of
96 rows). Checked:

* every step's sizes sum to the global batch (each worker logs what the step's
  collective summed, and the two reports agree step by step);
* each plan took effect at one step on both workers (never a mix);
* worker 1 is slowed 3x by the fault injector: its injected sleep is exactly 2 x its own
  forward/backward time of each step but its first (its warm-up) (a 3x slower worker computes 3x as long on the same
  batch), never scaled by its pull/push time, which is the PS's shared cost; worker 0 never
  sleeps; each step's recorded parts (read, pull, compute, push, sleep, collective waits)
  fit inside its wall time;
* the dense parameters and embedding rows equal a single-process reference that
  trains, step by step, on the union of the two workers' pieces (each worker
  recorded exactly which units it took), to float tolerance: the all-reduce
  average is weighted by samples, and the row gradients are scaled by share and
  summed over the workers before ONE push per row (``workers.dd.combine_row_grads``).
  The tables use every row optimizer the PS offers (``ROW_OPTIMIZERS``: SGD by
  default, Adam, rowwise Adagrad, Adagrad and FTRL on the busiest tables), so
  the check covers the optimizers for which per-worker pushes would not add up.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from controller.config import AgentConfig, ControllerConfig, DdsConfig, PolicyKind
from controller.dds import DatasetSpec
from controller.policy import SetBatchSizes
from controller.server import ControllerServer
from meta_io.reader import MetaIODataset
from meta_io.slicer import concat_batches, slice_batch
from tests.ports import pick_port
from common.rpc import RpcConfig
from ps.client import PsClient
from ps.config import TABLE_OPTIMIZERS
from workers.local import local_store
from workers.row_source import LocalRowSource, RemoteRowSource
from workers.trainer import Trainer, _ids_of
from workers.worker import build_model

from tests.workers.conftest import TOKEN, make_job
from tests.workers.procs import start_worker, wait_exit, write_job

G = 96
PLANS = [{0: 64, 1: 32}, {0: 20, 1: 76}]
SLOW = 3.0  # worker 1's slow fault factor
PARTS = ("read_s", "pull_s", "compute_s", "push_s", "sleep_s", "head_wait_s", "combine_s", "grad_wait_s", "apply_s",
         "shard_report_s", "report_s")
# one table per row optimizer of ps.config.TABLE_OPTIMIZERS (the rest keep the SGD default); shared ids
# in one step (items, scenes, tokens, users whose rows both workers hold) need the combine to be exact
_TABLE = {"dim": 8, "capacity": 4096, "admission": {}, "eviction": {}, "init": "normal", "init_scale": 0.01,
          "grad_clip_norm": 0.0, "grad_clip_value": 0.0}
ROW_OPTIMIZERS = [
    {**_TABLE, "name": "user", "optimizer": {"kind": "adam", "lr": 0.01}},
    {**_TABLE, "name": "item", "optimizer": {"kind": "rowwise_adagrad", "lr": 0.05}},
    {**_TABLE, "name": "scene", "optimizer": {"kind": "adagrad", "lr": 0.05}},
    {**_TABLE, "name": "token", "optimizer": {"kind": "ftrl", "ftrl_alpha": 0.05}, "init": "zeros"},
]


def _wait(cond, what: str, timeout_s: float = 120.0, procs=()) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        for p in procs:
            assert p.poll() is None, f"a worker exited before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_dd_batch_sizes_reach_allreduce_workers_and_match_reference(worker_data, ps_servers, tmp_path: Path) -> None:
    job = make_job(worker_data["plain"], tmp_path, mode="plain", workers=2,
                   train={"dense_sync": "allreduce", "epochs": 2, "log_every": 1},
                   ps={"table_defaults": {"dim": 8, "capacity": 4096, "optimizer": {"kind": "sgd", "lr": 0.05}},
                       "tables": ROW_OPTIMIZERS,
                       # dense SGD on both sides: linear in the gradient, so the dense comparison tests the
                       # weighting and not Adam's normalisation of near-zero gradients (rounding -> lr-sized
                       # steps); the rows use every optimizer (ROW_OPTIMIZERS)
                       "dense_optimizer": {"kind": "sgd", "lr": 0.05}},
                   controller={"policy": "dd", "dd": {"global_batch": G}},
                   faults={"faults": [{"target": "worker", "index": 1, "kind": "slow", "factor": SLOW}]})
    config = write_job(job, tmp_path / "job.toml")
    addrs = ps_servers(job)
    cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.NONE, heartbeat_timeout_s=120.0,
                           dds=DdsConfig(batches_per_shard=1, lease_s=120.0), agent=AgentConfig(heartbeat_s=0.1))
    # 2 epochs of ~31 global steps: the two plans switch within a few steps of being sent
    spec = DatasetSpec.from_meta_io("train", str(worker_data["plain"]), "train", epochs=2)
    srv = ControllerServer(cfg, tmp_path / "ctl", [spec], RpcConfig(token=TOKEN))
    srv.start("127.0.0.1:0")
    env = {"METAPS_ALLREDUCE": f"127.0.0.1:{pick_port()}", "METAPS_CONTROLLER": srv.address}
    run_dir = tmp_path / "run"
    logs = [tmp_path / f"worker-{r}.log" for r in range(2)]
    procs = [start_worker(config, r, addrs, run_dir, logs[r], env) for r in range(2)]
    try:
        def stepped(n: int) -> bool:
            return all(len(re.findall(r"dd step", p.read_text())) >= n for p in logs if p.exists())

        _wait(lambda: all(srv.registry.known("worker", r) for r in range(2)) and stepped(2), "the first steps",
              procs=procs)
        for k, plan in enumerate(PLANS):
            srv.apply([SetBatchSizes("workers", {"test": k}, sizes=plan)])
            _wait(lambda: all(f"size={plan[r]}" in logs[r].read_text() and "batch size switched" in logs[r].read_text()
                              for r in range(2)) and stepped(2), f"plan {k} to switch", procs=procs)
            time.sleep(0.3)
        for p, log_path in zip(procs, logs):
            assert wait_exit(p, log_path, timeout_s=300) == 0, log_path.read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        srv.stop(grace=0)

    reports = [json.loads((run_dir / "workers" / f"worker-{r}.json").read_text()) for r in range(2)]
    recs = [rep["dd_steps"] for rep in reports]
    assert [r["step"] for r in recs[0]] == [r["step"] for r in recs[1]], "both workers count the same steps"
    for a, b in zip(*recs):
        assert a["size_sum"] == b["size_sum"] == G == a["size"] + b["size"], (a, b)
        assert a["plan"] == b["plan"], f"step {a['step']}: workers on different plans"
        assert a["units_sum"] == a["units"] + b["units"] <= G
    pairs = [(a["size"], b["size"]) for a, b in zip(*recs)]
    seen = list(dict.fromkeys(pairs))
    assert seen[:3] == [(48, 48), (64, 32), (20, 76)], seen  # equal split, then each plan in order
    # a step falls short of the global batch only while a worker has no units (the DDS holds the
    # next epoch's shards until this epoch's are done, and the data ends): most steps are full
    full = sum(1 for a, _ in zip(*recs) if a["units_sum"] == G)
    assert full >= 0.6 * len(pairs), (full, len(pairs))
    assert reports[0]["dense_sha256"] == reports[1]["dense_sha256"]

    # -- the slow fault and the step profile ------------------------------------------
    for r, rec in ((r, rec) for r in range(2) for rec in recs[r]):
        assert sum(rec[k] for k in PARTS) <= rec["wall_s"] + 1e-6, (r, rec)
        if r == 0 or rec["units"] == 0:
            assert rec["sleep_s"] == 0.0, rec
    slow = [rec for rec in recs[1] if rec["units"] > 0]
    assert slow and all(rec["compute_s"] > 0 for rec in slow)
    assert slow[0]["sleep_s"] == 0.0, slow[0]  # its first step is its warm-up, not its speed
    for rec in slow[1:]:  # (factor - 1) x its own compute, not x its pull/push (the PS's time)
        assert rec["sleep_s"] == pytest.approx((SLOW - 1) * rec["compute_s"], rel=1e-9), rec

    # -- single-process reference on the same global batches --------------------------
    ds = MetaIODataset(worker_data["plain"])
    tables = ds.converter.tables
    store = local_store(job)
    ref = Trainer(build_model(job), LocalRowSource(store), job.train, job.meta, job.ps.dense_optimizer)
    all_ids: dict[str, list[np.ndarray]] = {}
    for a, b in zip(*recs):
        parts = []
        for f, bno, lo, hi in a["spans"] + b["spans"]:
            parts.append(slice_batch(next(ds.read_range(f, bno, bno + 1)), lo, hi, tables))
        batch = concat_batches(parts)
        ids = _ids_of(batch)
        for t, v in ids.items():
            all_ids.setdefault(t, []).append(v)
        ref.step(batch, ref.rows.pull(ids), 0.0)
    assert ref.step_no == len(pairs)

    client = PsClient(addrs, job.rpc, worker_id="check")
    try:
        remote = RemoteRowSource(client)
        names = [n for n, _ in ref.model.named_parameters()]
        dense = remote.pull_dense(names)  # rank 0 published its dense params with the final checkpoint
        moved = 0.0
        init = build_model(job)
        for (n, p), (_, p0) in zip(ref.model.named_parameters(), init.named_parameters()):
            got = torch.from_numpy(np.asarray(dense[n]).reshape(p.shape))
            torch.testing.assert_close(got, p.detach(), rtol=1e-4, atol=1e-5,
                                       msg=f"dense param {n}: max diff {float((got - p.detach()).abs().max())}")
            moved += float((p.detach() - p0.detach()).abs().sum())
        assert moved > 0, "dense parameters never moved"
        uniq = {t: np.unique(np.concatenate(v)) for t, v in all_ids.items()}
        want, got = ref.rows.pull(uniq), remote.pull(uniq)
        kinds = {t.name: t.optimizer.kind.value for t in job.table_configs()}
        assert {kinds[t] for t in uniq} == {k.value for k in TABLE_OPTIMIZERS}, kinds  # every row optimizer checked
        start = LocalRowSource(local_store(job)).pull(uniq)  # every id's initial row
        for t in uniq:
            np.testing.assert_allclose(got[t], want[t], rtol=1e-4, atol=1e-5, err_msg=f"table {t} ({kinds[t]})")
            moved_rows = float((np.abs(got[t] - start[t]).max(axis=1) > 1e-6).mean())
            assert moved_rows > 0.5, f"table {t} ({kinds[t]}): only {moved_rows:.0%} of its rows moved"
    finally:
        client.close()
