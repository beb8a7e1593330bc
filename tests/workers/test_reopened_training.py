"""Training reopened after a worker finished it (a PS recovery's rollback): the worker trains again.

A PS recovery rolls the DDS back to its cut: shards done after it return to TODO, also when
training was already finished and the workers had moved on to evaluation or were waiting for
the run's end. Before this was handled the run hung: no worker took the returned shards
(``bench.chaos --quick``: ``corrupt_ckpt_kill_ps`` struck after training, timed out at 240 s).

A real controller (gRPC) and PS shard in this process, one ``metaps worker`` process. The
test holds a shard of a second eval dataset the worker never scores, so the worker, done with
train and eval, waits in ``finish_run``; it then rolls the DDS back to a cut taken before any
training (the rollback a recovery performs; the PS rows are not restored, so the rows double
count: this test judges the data's accounting and the run's end, not the model). Judged on the
ledger: every train batch is done again after the rollback, every eval shard scored after the
retraining, coverage complete, and the worker exits 0 with the final checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from controller.client import ControllerClient
from controller.dds import DatasetSpec
from controller.types import DatasetKind, GetStatus
from meta_io.build import MetaIOBuildConfig, build
from meta_io.layout import Layout
from meta_io.synth import GeneratorConfig, generate
from common.rpc import RpcConfig

from tests.workers.conftest import TOKEN, make_job
from tests.workers.procs import kill_all, serve_ps_and_controller, start_worker, wait_exit, write_job


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reopen-data")
    out = {}
    for name, seed in (("train", 5), ("eval", 6)):
        gen = generate(root / f"raw-{name}", GeneratorConfig(rows=1200, users=150, items=100, seed=seed, n_files=1,
                                                             row_group_rows=1200), progress=False)
        out[name] = build(gen.out_dir, gen.schema_path, root / name,
                          MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=128)).out_dir
    return out


def _status(c: ControllerClient) -> dict[str, dict]:
    return {d["dataset"]: d for d in c.status(brief=True)["datasets"]}


def _wait(pred, what: str, proc, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached (worker rc {proc.poll()}); worker log:\n"
                                 + log.read_text()[-4000:])
        time.sleep(0.05)


def test_a_rollback_after_training_finished_is_trained_again_and_the_run_ends(data, tmp_path: Path) -> None:
    job = make_job(data["train"], tmp_path, mode="plain", eval_path=data["eval"], train={"epochs": 1})
    config = write_job(job, tmp_path / "job.toml")
    specs = [DatasetSpec.from_meta_io("train", str(data["train"]), "train"),
             DatasetSpec.from_meta_io("eval", str(data["eval"]), "eval"),
             DatasetSpec.from_meta_io("held", str(data["eval"]), DatasetKind.EVAL)]  # the test's: never scored
    ps, addrs, srv = serve_ps_and_controller(job, tmp_path / "ctl", specs, batches_per_shard=2)
    me = ControllerClient(srv.address, RpcConfig(token=TOKEN, timeout_s=5.0), role="worker", index=7)
    me.register()
    before = srv.dds.snapshot()  # the cut: nothing trained yet
    log = tmp_path / "worker-0.log"
    proc = start_worker(config, 0, addrs, tmp_path / "run", log, {"METAPS_CONTROLLER": srv.address})
    try:
        _wait(lambda: _status(me)["train"]["finished"], "training finished", proc, log)
        held = me.get_shard("held")
        assert held.status is GetStatus.SHARD, held  # training is finished: an eval-kind lease is granted
        _wait(lambda: _status(me)["eval"]["finished"], "eval finished", proc, log)
        time.sleep(0.5)  # the worker is in finish_run now: the run waits for the held shard
        assert proc.poll() is None and not me.status(brief=True)["finished"]
        t_rollback = time.time()
        returned = srv.dds.rollback_to(before)
        n_train = sum(1 for r in returned if r.startswith("train:"))
        assert n_train == _status(me)["train"]["shards_total"] > 0, returned
        _wait(lambda: _status(me)["train"]["finished"] and _status(me)["eval"]["finished"],
              "trained and scored again", proc, log)
        for lease in me.shards("held", poll_s=0.05):  # the held lease went back to TODO: finish it now
            me.report_shard(lease, "done")
        assert wait_exit(proc, log, timeout_s=120) == 0, log.read_text()[-4000:]
        cov = srv.dds.coverage()
        entries = list(srv.dds.ledger.entries())
    finally:
        kill_all([proc])
        me.close()
        srv.stop(grace=0)
        ps.stop(0)
    assert cov.complete, cov.problems
    done = [e for e in entries if e.kind.value == "done"]
    replayed = [e for e in done if e.dataset == "train" and e.replayed]
    live = [e for e in done if e.dataset == "train" and not e.replayed]
    # the first pass is replayed, the second covers every train batch again, after the rollback
    assert len(replayed) == n_train
    assert sum(e.batches for e in live) == srv.dds.specs["train"].total_batches
    assert all(e.time >= t_rollback for e in live)
    scored = [e for e in done if e.dataset == "eval" and not e.replayed]
    assert scored and all(e.time >= max(e2.time for e2 in live) for e in scored), \
        "an eval shard was scored before the retraining ended"
    text = log.read_text()
    assert "training reopened; training again" in text and "checkpoint written" in text
