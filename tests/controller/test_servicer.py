"""The controller over real gRPC on 127.0.0.1: dispatch, failures, auth, bad input, status."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from controller.client import ControllerClient, ControllerError
from controller.config import ControllerConfig, DdsConfig, MonitorConfig
from controller.types import DatasetKind, DatasetSpec, GetStatus
from common.rpc import RpcConfig
from tests.controller.conftest import EVAL, RPC, TOKEN, TRAIN, client, drain, small_cfg

ROOT = Path(__file__).resolve().parents[2]


def test_dispatch_and_completion_over_grpc(controller) -> None:
    srv = controller()
    clients = [client(srv, i) for i in range(3)]
    counts = [0, 0, 0]

    def work(i: int) -> None:
        counts[i] = drain(clients[i], "train")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(counts) == 14  # (3 + 2 + 2) shards x 2 epochs
    assert drain(clients[0], "eval") == 2
    st = clients[0].status()
    assert st["finished"] and st["coverage"]["complete"] and st["coverage"]["done_entries"] == 16
    assert {d["dataset"]: d["batches_done"] for d in st["datasets"]} == {"train": 25, "eval": 6}
    assert sorted(e["kind"] for e in st["events"]) == ["epoch_done"] * 3


def test_worker_process_killed_mid_shard_is_requeued(controller) -> None:
    srv = controller(ControllerConfig(tick_s=0.05, heartbeat_timeout_s=1.0, dds=DdsConfig(batches_per_shard=4)))
    proc = subprocess.Popen([sys.executable, "-m", "tests.controller.proc_worker", srv.address, TOKEN, "7", "train"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        held = proc.stdout.readline().strip()
        assert held.startswith("train:0:")
        assert srv.dds.holders() == {7: [held]}
        proc.kill()  # SIGKILL mid-shard: no report, no goodbye
        proc.wait(10)
        deadline = time.monotonic() + 10
        while srv.dds.holders() and time.monotonic() < deadline:  # heartbeat timeout -> requeue
            time.sleep(0.05)
        assert srv.dds.holders() == {}
    finally:
        proc.kill()
        proc.stdout.close()
    c = client(srv, 0)
    drain(c, "train")
    drain(c, "eval")
    st = c.status()
    assert st["coverage"]["complete"] and st["coverage"]["duplicate_entries"] == 0
    down = [e for e in st["events"] if e["kind"] == "node_down"]
    assert down[0]["node"] == "worker:7" and down[0]["evidence"]["requeued"] == [held]


def test_duplicate_completion_reports_are_harmless(controller) -> None:
    srv = controller(datasets=(EVAL, DatasetSpec("more-eval", (5,), DatasetKind.EVAL, epochs=1)))
    c = client(srv, 0)
    lease = c.get_shard("eval").lease
    assert c.report_shard(lease, samples=4).kind == "done"
    again = [c.report_shard(lease, samples=4) for _ in range(3)]
    assert all(r.kind == "retry" and r.duplicate for r in again)
    assert drain(c, "eval") == 1
    cov = c.status()["coverage"]
    # eval is covered, the other dataset not started: honest coverage says in progress, not complete
    assert cov["by_dataset"]["eval"] == [6, 6] and cov["state"] == "in_progress" and not cov["complete"]
    assert cov["done_entries"] == 2 and cov["duplicate_samples"] == 0
    drain(c, "more-eval")
    assert c.status()["coverage"]["complete"]


def test_hung_worker_lease_expires(controller) -> None:
    srv = controller(small_cfg(lease_s=0.3))
    hung, other = client(srv, 1), client(srv, 2)
    drain(other, "train")  # eval is leased once training is finished (it scores the final model)
    lease = hung.get_shard("eval").lease  # then never heartbeats again
    time.sleep(0.6)
    got = other.get_shard("eval").lease
    assert got.shard_id == lease.shard_id and got.attempt == 2
    assert other.report_shard(got).kind == "done"
    late = hung.report_shard(lease)
    assert late.kind == "duplicate" and not late.accepted
    drain(other, "eval")  # complete means every dataset's every epoch
    st = other.status()
    assert st["coverage"]["complete"] and st["coverage"]["duplicate_entries"] == 1
    assert any(e["kind"] == "lease_expired" and e["node"] == "worker:1" for e in st["events"])


def test_node_failure_requeues_shards_in_every_dataset(controller) -> None:
    srv = controller(datasets=(TRAIN, DatasetSpec("train-b", (6,), DatasetKind.TRAIN, epochs=1)))  # two open at once
    w = client(srv, 4)
    held = {w.get_shard("train").lease.shard_id, w.get_shard("train-b").lease.shard_id, w.get_shard("train").lease.shard_id}
    agent = client(srv, 4, source="agent")
    requeued = agent.node_down("worker", 4, "child exited with code 137", 137)
    assert set(requeued) == held
    assert srv.dds.holders() == {}
    c = client(srv, 0)
    drain(c, "train")
    drain(c, "train-b")
    assert c.status()["coverage"]["complete"]


def test_auth_refused_without_token(controller) -> None:
    srv = controller()
    anon = ControllerClient(srv.address, RpcConfig(token="", timeout_s=5.0), index=0, retry_s=0)
    with pytest.raises(ControllerError) as err:
        anon.register()
    assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
    wrong = ControllerClient(srv.address, RpcConfig(token="wrong"), index=0, retry_s=0)
    with pytest.raises(ControllerError) as err:
        wrong.get_shard("train")
    assert err.value.code is grpc.StatusCode.UNAUTHENTICATED


def test_bad_input_gets_a_clear_status_and_loses_nothing(controller) -> None:
    srv = controller()
    c = client(srv, 0)
    lease = c.get_shard("train").lease
    stranger = client(srv, 9, register=False)
    with pytest.raises(ControllerError, match="worker 9 is not registered") as err:
        stranger.report_shard(lease)
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    with pytest.raises(ControllerError, match="unknown dataset 'nope'") as err:
        c.get_shard("nope")
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    bogus = type(lease)("train:0:0:1-3", "train", 0, 0, 1, 3, 1, 1.0)
    with pytest.raises(ControllerError, match="unknown shard train:0:0:1-3") as err:
        c.report_shard(bogus)
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    with pytest.raises(ControllerError, match="malformed shard id") as err:
        c.report_shard(type(lease)("x", "train", 0, 0, 0, 1, 1, 1.0))
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ControllerError, match="status must be 'done' or 'failed'") as err:
        c.report_shard(lease, status="finished")
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ControllerError, match="unknown role 'trainer'"):
        ControllerClient(srv.address, RPC, role="trainer", index=0, retry_s=0).register()
    with pytest.raises(ControllerError, match="checkpoint cut 42 was never opened"):
        c.checkpoint_done(42, 100, "/tmp/x")
    assert srv.dds.holders() == {0: [lease.shard_id]}
    assert c.report_shard(lease).kind == "done"


def test_checkpoint_trigger_commit_and_rollback(controller) -> None:
    srv = controller(ControllerConfig(tick_s=0.05, checkpoint_interval_s=0.2, dds=DdsConfig(batches_per_shard=4)))
    c = client(srv, 0)
    for _ in range(2):
        c.report_shard(c.get_shard("train").lease)
    deadline = time.monotonic() + 10
    cmd = None
    while cmd is None and time.monotonic() < deadline:
        cmd = next((x for x in c.heartbeat().commands if x.kind == "checkpoint"), None)
        time.sleep(0.05)
    assert cmd is not None and cmd.cut_id >= 1
    c.checkpoint_done(cmd.cut_id, step=20, directory="ckpt-20")
    done_after = [c.get_shard("train").lease for _ in range(2)]
    for l in done_after:
        c.report_shard(l)
    cut = next(x for x in c.status()["checkpoints"] if x["cut_id"] == cmd.cut_id)
    assert cut["state"] == "committed" and cut["step"] == 20 and cut["dir"] == "ckpt-20"
    returned = srv.checkpoints.rollback_to(cmd.cut_id)
    assert {l.shard_id for l in done_after} <= set(returned)
    drain(c, "train")
    drain(c, "eval")  # complete means every dataset's every epoch
    cov = c.status()["coverage"]
    assert cov["complete"] and cov["replayed_entries"] >= 2


def test_status_lists_nodes_and_heartbeat_renews(controller) -> None:
    srv = controller(small_cfg(lease_s=0.4))
    c = client(srv, 3)
    lease = c.get_shard("train").lease
    for _ in range(8):  # 0.8 s > lease, kept alive by heartbeats
        reply = c.heartbeat(step=5, metrics={"loss": 0.5})
        assert reply.known
        time.sleep(0.1)
    assert c.report_shard(lease).kind == "done"
    node = next(n for n in c.status()["nodes"] if n["index"] == 3)
    assert node["state"] == "alive" and node["step"] == 5 and node["role"] == "worker"


def test_brief_status_is_progress_and_run_only_without_a_ledger_scan(controller) -> None:
    """A worker waiting for the run's end polls GetStatus(brief): the datasets' progress, finished and
    the run, as in the full reply, and neither the coverage (a scan of the whole ledger under the DDS
    lock), nor nodes, events or cuts."""
    srv = controller(small_cfg())
    c = client(srv, 0)
    lease = c.get_shard("train").lease
    assert c.report_shard(lease).kind == "done"
    full, brief = c.status(), c.status(brief=True)
    assert full["coverage"] and full["nodes"]
    assert brief["datasets"] == full["datasets"] and brief["finished"] == full["finished"]
    assert brief["run"] == full["run"]
    assert brief["coverage"] == {} and brief["nodes"] == [] and brief["events"] == [] and brief["checkpoints"] == []
    scans = []
    real = srv.dds.coverage
    srv.dds.coverage = lambda: scans.append(1) or real()  # type: ignore[method-assign]
    c.status(brief=True)
    assert scans == []
    c.status()
    assert scans == [1]
