"""Sync PS mode with unequal shares: a worker out of data leaves the clocks at once (issue 10, point 2).

Two workers (threads, each with its own gRPC client) on a 2-shard sync fleet.
worker-1's share ends after 2 steps (``max_steps``); it then stays alive, as it
would while evaluating, waiting for the job or writing the final checkpoint.
worker-0 trains its whole share with a short wait limit (5 s). Before the fix
worker-1 left the step clocks only when its client closed, so worker-0 stalled
at the next barrier and failed with PsStalenessTimeout.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ps.client import PsClient
from workers.row_source import RemoteRowSource
from workers.worker import Worker

from tests.workers.conftest import make_job

SGD = {"kind": "sgd", "lr": 0.05}


def test_sync_workers_with_unequal_shares_finish_without_barrier_timeouts(worker_data, ps_servers, tmp_path: Path) -> None:
    ps = {"sync": "sync", "dense_optimizer": SGD, "table_defaults": {"dim": 8, "capacity": 4096, "optimizer": SGD}}
    long_job = make_job(worker_data["meta"], tmp_path, mode="meta", shards=2, workers=2, ps=ps,
                        train={"max_steps": 8})
    short_job = make_job(worker_data["meta"], tmp_path, mode="meta", shards=2, workers=2, ps=ps,
                         train={"max_steps": 2})
    addrs = ps_servers(long_job)
    clients = [PsClient(addrs, long_job.rpc, worker_id=f"worker-{r}", register=True, wait_timeout_s=5.0)
               for r in range(2)]
    workers = [Worker(job, r, RemoteRowSource(c), run_dir=tmp_path / "dist", world=2, barrier=c.barrier)
               for r, (job, c) in enumerate(zip([long_job, short_job], clients))]
    errors: list[BaseException] = []
    linger = threading.Event()

    def run(w: Worker, stay: bool) -> None:
        try:
            w.train()
            if stay:
                linger.wait(120)  # alive after training (eval, final checkpoint), client still open
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w, r == 1)) for r, w in enumerate(workers)]
    for th in threads:
        th.start()
    threads[0].join(timeout=300)
    linger.set()
    threads[1].join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a worker did not finish"
    assert not errors, errors
    assert [w.trainer.step_no for w in workers] == [8, 2]
    for st in clients[0].stats():  # both left once done: nobody holds anybody back
        assert st["clocks"] == {}, st["clocks"]
    for c in clients:
        c.close()


def test_trainer_resumes_from_the_ps_clock_in_its_units(worker_data, ps_servers, tmp_path: Path) -> None:
    """A restarted worker's trainer numbers steps from the PS clock (half-steps in sync mode), never backwards."""
    job = make_job(worker_data["meta"], tmp_path, mode="meta", shards=1, workers=2,
                   ps={"sync": "sync", "table_defaults": {"dim": 8, "capacity": 4096}})
    addrs = ps_servers(job)
    old = PsClient(addrs, job.rpc, worker_id="worker-1", register=True)
    old.barrier(0)
    old.barrier(1)
    old.barrier(2)  # the crashed process had finished step 0 and arrived at step 1's first barrier
    new = PsClient(addrs, job.rpc, worker_id="worker-1", register=True)
    assert new.registered_clock == 3
    w = Worker(job, 1, RemoteRowSource(new), run_dir=tmp_path / "dist", world=2, barrier=new.barrier)
    w.trainer.resume(new.registered_clock)
    assert w.trainer.step_no == 1 and w.trainer.clock() == 2  # redo step 1 (its barriers are idempotent)
    w.trainer.resume(0)
    assert w.trainer.step_no == 1
    old.close()
    new.close()
