"""All-reduce workers under a controller: a worker the DDS tells to WAIT keeps joining the steps.

Every all-reduce step is a collective. At an epoch's tail one worker trains the last shard while
the other has no lease (the DDS answers WAIT: the shard may come back). That worker used to
block asking for a lease, so the trainer's next collective waited for it, and nothing moved
until the DDS's hang rule took the lease away (``hang_min_s``: minutes), after which the shard
was trained twice (a stale report). Now a waiting worker joins each step with zero gradients
and asks the DDS again every 0.2 s.

A real controller (gRPC, no policy) and PS shard in this process, two ``metaps worker``
processes with ``dense_sync = "allreduce"``; 5 shards for 2 workers, so one waits at the tail;
the hang rule is set to 10 minutes, far past the test's limit. Judged on the ledger: coverage
complete, no hang or lease-expiry event, no stale or duplicate entry, and both workers end at
the same step count (every collective counted by both).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.dds import DatasetSpec
from meta_io.build import MetaIOBuildConfig, build
from meta_io.layout import Layout
from meta_io.synth import GeneratorConfig, generate

from tests.ports import pick_port
from tests.workers.conftest import make_job
from tests.workers.procs import kill_all, serve_ps_and_controller, start_worker, wait_exit, write_job


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ar-wait-data")
    gen = generate(root / "raw", GeneratorConfig(rows=1280, users=160, items=100, seed=9, n_files=1,
                                                 row_group_rows=1280), progress=False)
    return build(gen.out_dir, gen.schema_path, root / "plain",
                 MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=128)).out_dir  # 10 batches


def test_a_waiting_allreduce_worker_joins_the_steps_and_nothing_stalls(data: Path, tmp_path: Path) -> None:
    job = make_job(data, tmp_path, mode="plain", workers=2, train={"epochs": 1, "dense_sync": "allreduce",
                                                                   "log_every": 1})
    config = write_job(job, tmp_path / "job.toml")
    ps, addrs, srv = serve_ps_and_controller(job, tmp_path / "ctl", [DatasetSpec.from_meta_io("train", str(data), "train")],
                                             batches_per_shard=2, lease_s=600.0)
    run_dir = tmp_path / "run"
    env = {"METAPS_CONTROLLER": srv.address, "METAPS_ALLREDUCE": f"127.0.0.1:{pick_port()}"}
    logs = [tmp_path / f"worker-{r}.log" for r in range(2)]
    procs = [start_worker(config, r, addrs, run_dir, logs[r], env) for r in range(2)]
    try:
        for p, log_path in zip(procs, logs):  # a stall would last until the 10-minute hang rule
            assert wait_exit(p, log_path, timeout_s=150) == 0, log_path.read_text()[-4000:]
        events = [(e.node, e.kind) for e in srv.events.list()]
        cov = srv.dds.coverage()
    finally:
        kill_all(procs)
        srv.stop(grace=0)
        ps.stop(0)
    assert not [e for e in events if e[1] in ("hang", "lease_expired")], events
    assert cov.complete and cov.stale_entries == 0 and cov.duplicate_entries == 0, (cov, events)
    reports = [json.loads((run_dir / "workers" / f"worker-{r}.json").read_text()) for r in range(2)]
    assert reports[0]["steps"] == reports[1]["steps"] > 0
    assert sum(r["samples"] for r in reports) == 1280  # every row trained once
    assert {r["shards"] for r in reports} == {2, 3}, [r["shards"] for r in reports]  # one worker waited at the tail
