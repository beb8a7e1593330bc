"""``metaps launch`` supervises its agents: a SIGKILLed agent is restarted with a true reason.

A real fleet (controller, 1 PS, 2 workers under their agents, gRPC on 127.0.0.1).
Worker 1's agent is SIGKILLed mid-training: its orphaned worker is stopped with
it, the controller is told (the shards are requeued), a fresh agent starts a fresh
worker, and the run completes with full coverage; the report says what happened.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from common.toml_writer import write
from tests.metaps.fleet_data import (fleet_pids, finish_launch, job_mapping, make_data, reaping, start_launch,
                                     wait_for)



def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _agent_pid(run: Path, role: str, index: int) -> int | None:
    for pid in fleet_pids(str(run)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in cmd]
        if "agent" in args and args[args.index("--role") + 1] == role and args[args.index("--index") + 1] == str(index):
            return pid
    return None


@pytest.mark.timeout(600)
def test_sigkilled_agent_is_restarted_and_the_run_completes(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    job = job_mapping(data, tmp_path, workers=2, ps=1, train={"epochs": 3},
                      faults={"faults": [{"target": "worker", "index": 1, "kind": "slow", "factor": 3.0}]})
    # near-async PS, as configs/main_job.toml (AntDT-ND): a killed worker's step clock stays on the PS until its
    # new incarnation catches up (ps/staleness.py registers max(old, new)); under a bound of a few steps worker 0
    # would wait on it past its pull deadline. That coupling is the PS's, not the agents'.
    job["ps"]["max_staleness"] = 1000
    cfg = write(tmp_path / "job.toml", job)
    run = tmp_path / "run"
    log = tmp_path / "launcher.log"
    # a quiet console (--log-level WARNING) keeps the per-process log files at INFO: the waits below read
    # the workers' INFO lines from them
    proc = start_launch(["--config", str(cfg), "--run-dir", str(run), "--no-progress", "--log-level", "WARNING"], log)
    with reaping(proc, run):
        wait_for(lambda: 'msg="step"' in _read(run / "logs" / "worker-1.log"), 400, "worker 1's first step")
        pid = _agent_pid(run, "worker", 1)
        assert pid is not None and proc.poll() is None
        os.kill(pid, signal.SIGKILL)
        out = finish_launch(proc, log, 500)
        left = fleet_pids(str(run))
    assert proc.returncode == 0, out[-5000:]
    assert left == [], f"fleet processes left running: {left}"
    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "succeeded", rep["reason"]
    assert "agent for worker-1 died (signal 9); restarted" in rep["notes"]
    assert "restart limit" not in json.dumps(rep["notes"])
    downs = [e for e in rep["controller"]["events"] if e["kind"] == "node_down" and e["node"] == "worker:1"]
    assert any("agent for worker-1 died (signal 9)" in e["evidence"]["reason"] for e in downs), (
        [(e["node"], e["kind"]) for e in rep["controller"]["events"]], out[-4000:])
    assert rep["controller"]["coverage"]["complete"], rep["controller"]["coverage"]["problems"]
    assert _read(run / "logs" / "worker-1.log").count('msg="child started"') >= 2  # a fresh agent, a fresh worker
