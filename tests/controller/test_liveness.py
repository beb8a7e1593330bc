"""Worker liveness: a worker holding shards without progress is requeued, recorded and restarted.

Real controller (gRPC on 127.0.0.1, LMDB), real agents supervising real child
processes; the stalled worker is SIGSTOPped (its process lives, nothing moves).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from controller.agent import Agent
from controller.config import AgentConfig, ControllerConfig, DdsConfig, MonitorConfig
from controller.types import DatasetKind, DatasetSpec
from controller.liveness import WorkerLiveness
from tests.controller.conftest import RPC, TOKEN, client

ROOT = Path(__file__).resolve().parents[2]
AGENT = AgentConfig(heartbeat_s=0.2, restart_limit=2, backoff_s=0.1, stop_grace_s=5.0)


def stall_cfg(timeout_s: float, lease_s: float = 60.0) -> ControllerConfig:
    return ControllerConfig(tick_s=0.05, heartbeat_timeout_s=300.0, worker_stall_timeout_s=timeout_s,
                            dds=DdsConfig(batches_per_shard=2, lease_s=lease_s), monitor=MonitorConfig(window_s=0.5),
                            agent=AGENT)


def wait_for(pred, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def events(srv, kind: str, node: str | None = None) -> list:
    return [e for e in srv.events.list() if e.kind == kind and (node is None or e.node == node)]


def pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_sigstopped_worker_is_requeued_recorded_and_restarted(controller, tmp_path: Path) -> None:
    # lease_s > the stall timeout: the DDS would only notice after a minute; liveness must act first
    srv = controller(stall_cfg(3.0), datasets=(DatasetSpec("train", (12, 12), DatasetKind.TRAIN, epochs=2),))
    pidfiles = [tmp_path / f"w{i}.pids" for i in range(2)]
    agents = [Agent(AGENT, "worker", i, srv.address, RPC,
                    [sys.executable, "-m", "tests.controller.proc_trainer", srv.address, TOKEN, str(i),
                     str(pidfiles[i]), "0.1"], env={"PYTHONPATH": str(ROOT)})
              for i in range(2)]
    rcs: dict[int, int] = {}
    threads = [threading.Thread(target=lambda i=i: rcs.__setitem__(i, agents[i].run())) for i in range(2)]
    for t in threads:
        t.start()
    stopped = 0
    try:
        wait_for(lambda: pids(pidfiles[1]) and srv.dds.holders().get(1), what="worker 1 holding a shard")
        stopped = pids(pidfiles[1])[0]
        held = set(srv.dds.holders()[1])
        os.kill(stopped, signal.SIGSTOP)
        wait_for(lambda: events(srv, "worker_stalled", "worker:1"), what="worker_stalled event")
        ev = events(srv, "worker_stalled", "worker:1")[0]
        assert ev.evidence["frozen"] is True and ev.action == "requeue+restart"
        assert held <= set(ev.evidence["shards"]) and held <= set(ev.evidence["requeued"])
        assert "no step for" in ev.evidence["reason"]
        wait_for(lambda: len(pids(pidfiles[1])) == 2, what="the agent restarting worker 1")
        for t in threads:
            t.join(180)
        assert rcs == {0: 0, 1: 0}
        assert agents[1].restarts >= 1
        assert not os.path.exists(f"/proc/{stopped}")  # the agent stopped and reaped the frozen child
        assert srv.dds.finished()
        cov = srv.dds.coverage()
        assert cov.complete, cov.problems
        downs = [e for e in events(srv, "node_down", "worker:1") if "restart command" in e.evidence["reason"]]
        assert downs, "the agent reported the restart"
        assert downs[0].evidence["exit_code"] == -signal.SIGTERM  # SIGCONT let the stopped child act on SIGTERM
    finally:
        for a in agents:
            a.stop()
        if stopped:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for t in threads:
            t.join(30)


def test_idle_worker_without_lease_is_not_flagged(controller) -> None:
    srv = controller(stall_cfg(1.0), datasets=(DatasetSpec("train", (4,), DatasetKind.TRAIN, epochs=1),))
    busy, idle = client(srv, 0), client(srv, 1)
    leases = []
    while (got := busy.get_shard("train")).lease is not None:  # worker 0 takes every shard
        leases.append(got.lease)
    assert idle.get_shard("train").status.name == "WAIT"
    idle.heartbeat(step=5)
    # worker 1 now stays silent (as if SIGSTOPped while waiting for data) far past the timeout,
    # while worker 0 keeps stepping
    t_end = time.monotonic() + 4.0
    while time.monotonic() < t_end:
        busy.report_metrics(batch_times_s=[0.05])
        busy.heartbeat(step=1)
        time.sleep(0.05)
    assert events(srv, "worker_stalled", "worker:1") == []
    # worker 0 goes silent too, holding its shards: it is the one flagged
    wait_for(lambda: events(srv, "worker_stalled", "worker:0"), what="worker 0 flagged")
    assert srv.dds.holders() == {}
    assert events(srv, "worker_stalled", "worker:1") == []
    for lease in leases:
        assert busy.report_shard(lease).kind == "stale"


def test_deadlocked_worker_flagged_only_while_a_peer_moves(controller) -> None:
    """Heartbeats without steps: stalled when a peer progresses; nobody moving is a fleet-wide wait."""
    srv = controller(stall_cfg(1.0), datasets=(DatasetSpec("train", (8,), DatasetKind.TRAIN, epochs=1),))
    a, b = client(srv, 0), client(srv, 1)
    a.get_shard("train"), b.get_shard("train")
    t_end = time.monotonic() + 3.0
    while time.monotonic() < t_end:  # both heartbeat at a constant step: a shared wait (a PS, a pause)
        a.heartbeat(step=3)
        b.heartbeat(step=3)
        time.sleep(0.05)
    assert events(srv, "worker_stalled") == []
    assert len(events(srv, "fleet_stalled")) == 1
    # worker 1 moves again; worker 0 stays stuck while heartbeating -> a deadlock
    for _ in range(400):
        a.heartbeat(step=3)
        b.heartbeat(step=4 + _)
        b.report_metrics(batch_times_s=[0.05])
        if events(srv, "worker_stalled", "worker:0"):
            break
        time.sleep(0.05)
    ev = events(srv, "worker_stalled", "worker:0")
    assert ev and ev[0].evidence["frozen"] is False and "deadlock" in ev[0].evidence["reason"]
    assert events(srv, "worker_stalled", "worker:1") == []
    _, cmds = srv.registry.heartbeat("worker", 0, source="agent")
    assert [c.kind for c in cmds] == ["restart"] and "stalled" in cmds[0].reason


def test_stall_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="worker_stall_timeout_s must be >= 0"):
        ControllerConfig(worker_stall_timeout_s=-1.0).validate()
    with pytest.raises(ValueError, match=r"worker_stall_timeout_s must be > 2 x agent.heartbeat_s"):
        ControllerConfig(worker_stall_timeout_s=3.0, agent=AgentConfig(heartbeat_s=2.0)).validate()
    ControllerConfig(worker_stall_timeout_s=0.0).validate()  # off
    with pytest.raises(ValueError, match="must be > 0"):
        WorkerLiveness(0.0)


def test_workers_that_stop_together_a_few_ms_apart_are_a_shared_wait_not_a_deadlock() -> None:
    """The first of two workers to time out must not be flagged because the other's last
    progress came a few ms later (a PS outage stops both): only a peer that progressed well
    after the worker went quiet makes it a deadlock."""
    clock = [0.0]
    live = WorkerLiveness(1.0, clock=lambda: clock[0])
    live.granted(0, "train:0:0:0-2")
    live.granted(1, "train:0:0:2-4")
    clock[0] = 0.02  # worker 1's last progress comes 20 ms after worker 0's
    live.progress(1)
    stalls, episode = live.stalled({}, {0: 1.0, 1: 1.0}, now=1.01)
    assert stalls == [] and episode  # worker 0 timed out first: a fleet-wide wait
    clock[0] = 1.2  # worker 1 moves again, well after worker 0 went quiet
    live.progress(1)
    stalls, _ = live.stalled({}, {0: 1.25, 1: 1.25}, now=1.25)
    assert [s.worker for s in stalls] == [0] and stalls[0].frozen is False
