"""The DDS tail fix with real processes: a slow worker's long last lease is split for an idle one.

A real controller (gRPC, ND policy off so only the tail fix acts), one real PS shard and two
``metaps worker`` processes; worker 0 is slowed 4x by the fault injector (basis step) and shards are long
(3 shards of ~32 batches: worker 0 holds one while worker 1 trains the other two, so it
always has most of its lease left when worker 1 runs out). Once TODO is empty, worker 1 waits; the controller tells worker 0 to stop its
lease after the batch it is on, worker 0 reports the part it trained, and worker 1 trains the
rest. Exactly once: the ledger tiles every batch once with no duplicate or stale entry, and the
two workers together trained exactly the dataset's rows. With ``tail_split_min_batches = 0``
(the mutation this test was checked against) no lease is split.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.config import AgentConfig, ControllerConfig, DdsConfig, PolicyKind
from controller.dds import DatasetSpec
from controller.server import ControllerServer
from meta_io.build import MetaIOBuildConfig, build
from meta_io.layout import Layout
from meta_io.synth import GeneratorConfig, generate
from common.rpc import RpcConfig
from ps.factory import build_server

from tests.workers.conftest import TOKEN, make_job
from tests.workers.procs import kill_all, start_worker, wait_exit, write_job

ROWS = 3000


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tail-data")
    gen = generate(root / "raw", GeneratorConfig(rows=ROWS, users=300, items=200, seed=7, n_files=1,
                                                 row_group_rows=1000), progress=False)
    return build(gen.out_dir, gen.schema_path, root / "plain",
                 MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=32)).out_dir  # 94 batches


def test_slow_workers_last_lease_is_split_for_the_idle_worker_exactly_once(data: Path, tmp_path: Path) -> None:
    job = make_job(data, tmp_path, mode="plain", workers=2, train={"epochs": 1, "log_every": 1},
                   # staleness effectively unbounded: the fast worker runs free (E1's second case)
                   ps={"sync": "async", "max_staleness": 1_000_000, "clock_lease_s": 0.0},
                   # basis "step": 4x its whole step; the default (compute) scales forward/backward
                   # only, a small part of a plain step, so worker 0 could finish its lease as soon as
                   # worker 1 ran out of shards (no tail to split: a flake under load)
                   faults={"faults": [{"target": "worker", "index": 0, "kind": "slow", "factor": 4.0,
                                       "basis": "step"}]})
    config = write_job(job, tmp_path / "job.toml")
    ps = build_server(job.ps, job.rpc, job.table_configs(), 0, wait_timeout_s=600.0)
    addrs = [f"127.0.0.1:{ps.start('127.0.0.1:0')}"]
    cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.NONE, heartbeat_timeout_s=120.0, worker_stall_timeout_s=0.0,
                           dds=DdsConfig(batches_per_shard=32, lease_s=300.0, hang_min_s=600.0,
                                         tail_split_min_batches=2),
                           agent=AgentConfig(heartbeat_s=0.1))
    spec = DatasetSpec.from_meta_io("train", str(data), "train", epochs=1)
    srv = ControllerServer(cfg, tmp_path / "ctl", [spec], RpcConfig(token=TOKEN))
    srv.start("127.0.0.1:0")
    run_dir = tmp_path / "run"
    logs = [tmp_path / f"worker-{r}.log" for r in range(2)]
    procs = [start_worker(config, r, addrs, run_dir, logs[r], {"METAPS_CONTROLLER": srv.address}) for r in range(2)]
    try:
        for p, log_path in zip(procs, logs):
            assert wait_exit(p, log_path, timeout_s=400) == 0, log_path.read_text()[-4000:]
        events = [(e.node, e.kind, e.evidence) for e in srv.events.list()]
        cov = srv.dds.coverage()
    finally:
        kill_all(procs)
        srv.stop(grace=0)
        ps.stop(0)
    splits = [ev for node, kind, ev in events if kind == "tail_split_done"]
    assert splits, f"no lease was split; events: {[(n, k) for n, k, _ in events]}"
    assert all(node == "worker:0" for node, kind, _ in events if kind == "tail_split_done")
    assert cov.complete and cov.duplicate_entries == 0 and cov.stale_entries == 0, (cov, events)
    reports = [json.loads((run_dir / "workers" / f"worker-{r}.json").read_text()) for r in range(2)]
    assert sum(r["samples"] for r in reports) == ROWS, [r["samples"] for r in reports]  # each row trained once
    assert "lease truncated" in logs[0].read_text()
