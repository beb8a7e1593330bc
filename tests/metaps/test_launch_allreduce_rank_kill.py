"""An all-reduce rank killed mid-run: the re-formed group keeps the dense model.

``[train] dense_sync = "allreduce"``: the dense parameters live in the workers, in step by a
collective every step. When one rank dies, gloo fails its peers, every worker exits and its
agent restarts it, and the group forms again. Each new incarnation used to start from its
freshly built model: the dense weights went back to the initial ones while the ledger said
every batch was trained. Now rank 0 publishes the group's dense copy on the PS every
``dense_publish_steps`` (and before every checkpoint) and a re-formed group goes on from it.

Judged on the model: two real ``metaps launch`` fleets (1 PS, 2 all-reduce workers) on the
same data, one fault-free (the reference) and one whose worker 1 is SIGKILLed after shards
were done (a state, not a time). Both must succeed with complete coverage, and the faulty
run's final dense weights must be near the reference's: much nearer than the reference is to
the initial weights (a reset group ends about as far as the training it redid).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.metaps.fleet_data import (finish_launch, kill_leftovers, make_data, role_pid, start_launch,
                                     train_shards_done, wait_for, write_job_file)

SECTIONS = dict(
    train={"dense_sync": "allreduce", "epochs": 2, "dense_publish_steps": 1, "log_every": 1},
    controller={"checkpoint_interval_s": 0.0, "dds": {"batches_per_shard": 2},
                "agent": {"heartbeat_s": 0.5, "restart_limit": 2, "backoff_s": 0.2, "stop_grace_s": 5.0}},
    # slowed: the faulty run is still going when the strike comes
    faults={"faults": [{"target": "worker", "index": 0, "kind": "slow", "factor": 3.0},
                       {"target": "worker", "index": 1, "kind": "slow", "factor": 3.0}]},
)


def _final_dense(job, report: dict, names: list[str]) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def, type-arg]
    from ps.checkpoint import load_dense
    from workers.local import local_store

    store = local_store(job)
    assert sorted(load_dense(store, report["checkpoint"], names)) == sorted(names), report["checkpoint"]
    return store.dense.pull(names)


def _start(tmp: Path, name: str, data: dict[str, Path]) -> tuple[subprocess.Popen[bytes], Path, Path]:
    cfg = write_job_file(tmp / f"{name}.toml", data, workers=2, ps=1, **SECTIONS)
    run, log = tmp / name, tmp / f"{name}-launcher.log"
    return start_launch(["--no-progress", "--config", str(cfg), "--run-dir", str(run)], log), run, log


def _finish(proc: subprocess.Popen[bytes], run: Path, log: Path) -> dict:  # type: ignore[type-arg]
    out = finish_launch(proc, log, 400)
    assert proc.returncode == 0, out[-4000:]
    return json.loads((run / "report.json").read_text())


@pytest.mark.timeout(900)
def test_a_killed_allreduce_rank_keeps_the_dense_model(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    # the fault-free reference and the faulty fleet run side by side (same data, same job)
    started = [_start(tmp_path, name, data) for name in ("reference", "faulty")]
    try:
        proc, run, _ = started[1]
        # most shards done (2-batch shards, 17 batches, 2 epochs: 18 shards), then kill rank 1
        wait_for(lambda: train_shards_done(run / "controller") >= 13 or proc.poll() is not None, 300,
                 "13 train shards done")
        assert proc.poll() is None, "the run ended before the strike"
        pid = role_pid(str(run), "worker", "--rank", 1)
        assert pid is not None, "worker 1 not found"
        os.kill(pid, signal.SIGKILL)
        ref, got = (_finish(*s) for s in started)
    finally:
        for p, r, _ in started:
            if p.poll() is None:
                p.kill()
                p.wait()
            kill_leftovers(str(r))
    for rep in (ref, got):
        assert rep["status"] == "succeeded" and rep["controller"]["coverage"]["complete"], rep["controller"]["coverage"]
    # the strike happened: worker 1 had a second incarnation
    restarts = {n["index"]: n["restarts"] for n in got["controller"]["nodes"] if n["role"] == "worker"}
    assert restarts[1] >= 1, restarts
    # its leases in flight are ledgered abandoned (their updates may be in the model twice)
    assert got["controller"]["coverage"]["abandoned_entries"] >= 1, got["controller"]["coverage"]
    from metaps.job import load_job
    from workers.worker import build_model

    job = load_job(tmp_path / "reference.toml")
    init = {n: p.detach().numpy() for n, p in build_model(job).named_parameters()}
    names = sorted(init)
    a, b = _final_dense(job, ref, names), _final_dense(job, got, names)

    def dist(x: dict[str, np.ndarray], y: dict[str, np.ndarray]) -> float:
        return float(np.sqrt(sum(float(((x[n].reshape(-1) - y[n].reshape(-1)) ** 2).sum()) for n in names)))

    trained, off = dist(a, init), dist(b, a)
    assert trained > 0.05, trained
    print(f"off {off:.4f} trained {trained:.4f}")
    assert off < 0.3 * trained, (f"faulty run's dense weights {off:.4f} from the reference's; the reference "
                                 f"moved {trained:.4f} from the initial weights")
