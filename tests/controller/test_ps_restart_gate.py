"""A restarted PS is not checkpointed before it is recovered; a restart before any cut fails the run.

Issue 10 leftovers, points 3 and 4.

* A real controller, PS shard 0 in-process and PS shard 1 as a real ``metaps ps``
  process supervised by a real :class:`controller.agent.Agent`. After cut A is
  committed, shard 1's process is SIGKILLed; its agent restarts it
  (``METAPS_RESTARTS=1``). The test holds the controller's fleet lock so the
  recovery cannot restore yet: meanwhile the restarted shard refuses Checkpoint
  (FAILED_PRECONDITION, awaiting recovery) and data RPCs (UNAVAILABLE), and the
  coordinator commits nothing. Once the recovery has restored the fleet, the next
  checkpoint commits. Before the fix the cut in the window committed the empty
  shard (a silent loss at the next restore).
* A PS restart with no committed cut fails the run (``ps_recovery_failed`` fatal
  + ``run_failed`` with the reason) instead of carrying on with the shard's rows lost.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controller.agent import Agent
from controller.config import AgentConfig
from controller.ps_recovery import RUN_FAILED
from metaps.job import load_job
from tests.ports import pick_port
from common.rpc import RpcConfig
from ps.checkpoint import latest_checkpoint
from ps.client import PsClient, PsUnavailableError
from ps.coordinator import CheckpointCoordinationError, checkpoint_all
from ps.partition_map import PartitionMap
from ps.factory import build_server
from tests.metaps.fleet_data import wait_for
from tests.ps.conftest import REPO, write_job
from tests.ps.conftest import TOKEN as PS_TOKEN

from .conftest import TRAIN

import sys


def _ready(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_restarted_ps_refuses_checkpoints_until_recovered(controller: Any, tmp_path: Path) -> None:
    assert PS_TOKEN == "test-token"
    srv = controller(datasets=(TRAIN,))
    job_path = write_job(tmp_path, shards=2)
    job = load_job(str(job_path))
    rpc = RpcConfig(token=PS_TOKEN, timeout_s=20.0)
    pmap = PartitionMap.initial(2, job.ps.num_vshards)
    ps0 = build_server(job.ps, rpc, job.table_configs(), 0, pmap=pmap, wait_timeout_s=10.0)
    addr0 = f"127.0.0.1:{ps0.start('127.0.0.1:0')}"
    srv.register_node("ps", 0, addr0, pid=10_000, incarnation_id="inc-10000")
    port1 = pick_port()
    ready = tmp_path / "ready-1.json"
    root = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "metaps", "ps", "--config", str(job_path), "--shard", "1", "--port", str(port1),
           "--ready-file", str(ready), "--grace", "2", "--checkpoint-root", str(tmp_path)]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    agent = Agent(AgentConfig(heartbeat_s=0.3, restart_limit=2, backoff_s=0.2, stop_grace_s=5.0), "ps", 1,
                  srv.address, rpc, child_cmd=cmd, env=env)
    runner = threading.Thread(target=agent.run, daemon=True)
    runner.start()
    addrs = [addr0, f"127.0.0.1:{port1}"]
    try:
        wait_for(lambda: _ready(ready) is not None, 120, "PS 1 ready", 0.1)
        first_pid = _ready(ready)["pid"]
        wait_for(lambda: srv.registry.known("ps", 1) and srv.registry.get("ps", 1).address, 60, "PS 1 registered", 0.1)
        ps = PsClient(addrs, rpc, retry_timeout_s=2.0)
        ids = np.arange(64, dtype=np.int64)
        ps.push({"user": (ids, np.ones((64, 8), np.float32))})
        cut_a = srv.checkpoints.open_cut()
        dir_a = checkpoint_all(addrs, root, 1, rpc_cfg=rpc)
        srv.checkpoints.commit(cut_a, 1, str(dir_a))

        with srv.fleet_lock:  # the recovery waits here: the window between restart and recovery
            ready.unlink()
            os.kill(first_pid, signal.SIGKILL)
            wait_for(lambda: (_ready(ready) or {}).get("pid") not in (None, first_pid), 120, "PS 1 restarted", 0.1)
            wait_for(lambda: srv.registry.get("ps", 1).pid != first_pid, 60, "PS 1 re-registered", 0.1)
            with pytest.raises(CheckpointCoordinationError, match="FAILED_PRECONDITION.*awaits recovery"):
                checkpoint_all(addrs, root, 2, rpc_cfg=rpc)
            assert latest_checkpoint(root) == dir_a  # nothing committed meanwhile
            assert not (root / "ckpt-2").exists()
            with pytest.raises(PsUnavailableError):  # data RPCs wait for the recovery (clients retry)
                ps.pull({"user": ids})
        wait_for(lambda: any(e.kind == "ps_recovery" for e in srv.events.list()), 120, "the fleet recovery", 0.1)
        kinds = [e.kind for e in srv.events.list()]
        assert "ps_recovery_failed" not in kinds and RUN_FAILED not in kinds, kinds
        rows = ps.pull({"user": ids})["user"]  # shard 1 serves again, at cut A
        assert np.isfinite(rows).all()
        dir_b = checkpoint_all(addrs, root, 3, rpc_cfg=rpc)  # the next cut after the recovery commits
        assert latest_checkpoint(root) == dir_b
        ps.close()
    finally:
        agent.stop()
        runner.join(30)
        ps0.stop(0)


def test_ps_restart_before_any_committed_cut_fails_the_run(controller: Any, tmp_path: Path) -> None:
    from tests.ps.conftest import start_fleet

    srv = controller(datasets=(TRAIN,))
    fleet = start_fleet(2, token="test-token")
    try:
        for k, a in enumerate(fleet.addresses):
            srv.register_node("ps", k, a, pid=1000 + k, incarnation_id=f"inc-{1000 + k}")
        srv.checkpoints.open_cut()  # a cut in progress, never committed
        srv.register_node("ps", 1, fleet.addresses[1], pid=2001, incarnation_id="inc-2001")  # PS 1's process came back
        wait_for(lambda: any(e.kind == RUN_FAILED for e in srv.events.list()), 60, "run_failed", 0.1)
        srv.recovery.join(30)
        events = {e.kind: e for e in srv.events.list()}
        assert "ps_recovery" not in events
        assert events["ps_recovery_failed"].evidence["fatal"] is True
        reason = events[RUN_FAILED].evidence["reason"]
        assert "no committed checkpoint cut" in reason and "\n" not in reason, reason
        assert all(c.get("state") != "pending" for c in srv.checkpoints.cuts())  # the open cut was aborted
    finally:
        fleet.stop()
