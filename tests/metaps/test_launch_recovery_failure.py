"""The bug of issue 10, end to end: a real ``metaps launch`` whose committed checkpoints
are corrupt when a PS is SIGKILLed.

The PS agent restarts the shard empty; the controller's recovery finds no
checkpoint every shard accepts, so it fails the run (``run_failed``). The
launcher must stop the fleet and exit 1 with the reason in report.json and the
summary -- not "succeeded", not "coverage complete" -- and write no final
checkpoint of the inconsistent fleet.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from ps.checkpoint import shard_files
from tests.metaps.fleet_data import (fleet_pids, finish_launch, kill_leftovers, make_data, start_launch, wait_for,
                                     write_job_file)


def _committed(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.name.startswith("ckpt-") and not p.name.endswith(".tmp")
            and (p / "manifest.json").exists()]


def _corrupt(ckpt: Path) -> None:
    for p in shard_files(ckpt):
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))


@pytest.mark.timeout(600)
def test_failed_ps_recovery_fails_the_launch_loudly(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1, train={"epochs": 50},
                         # the worker only has to be running: slowed 3x it burns a third of the CPU
                         faults={"faults": [{"target": "worker", "index": 0, "kind": "slow", "factor": 3.0}]},
                         controller={"checkpoint_interval_s": 2.0,
                                     "agent": {"heartbeat_s": 0.5, "restart_limit": 3, "backoff_s": 0.2,
                                               "stop_grace_s": 5.0}})
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    log = tmp_path / "launcher.log"
    proc = start_launch(["--config", str(cfg), "--run-dir", str(run), "--no-progress"], log)
    corrupted: set[Path] = set()
    stop = threading.Event()

    def corrupt_every_committed() -> None:  # also any committed between the kill and the recovery
        while not stop.wait(0.02):
            for p in _committed(ckpts):
                if p not in corrupted:
                    try:
                        _corrupt(p)
                    except OSError:
                        continue
                    corrupted.add(p)

    try:
        wait_for(lambda: _committed(ckpts) or proc.poll() is not None, 400, "a committed checkpoint")
        assert proc.poll() is None, f"the launch ended (exit {proc.returncode}) before a checkpoint committed"
        t = threading.Thread(target=corrupt_every_committed, daemon=True)
        t.start()
        wait_for(lambda: set(_committed(ckpts)) <= corrupted, 30, "the checkpoints corrupted", 0.05)
        pid = json.loads((run / "ps" / "ps-0.ready").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        out = finish_launch(proc, log, 300)
        left = fleet_pids(str(run))
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(str(run))
    assert proc.returncode == 1, out[-5000:]
    assert left == []
    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "failed" and rep["exit_code"] == 1
    assert "PS recovery after the restart of ps:0 failed" in rep["reason"], rep["reason"]
    assert "no committed checkpoint could be restored" in rep["reason"] and "sha256 mismatch" in rep["reason"]
    kinds = [e["kind"] for e in rep["controller"]["events"]]
    assert "run_failed" in kinds and "ps_recovery_failed" in kinds and "ps_recovery" not in kinds, kinds
    assert rep["checkpoint"] == ""  # no final checkpoint of a fleet in no consistent state
    assert not rep["controller"]["coverage"]["complete"]
    assert rep["coverage_summary"].endswith(f"(stopped: {rep['reason']})"), rep["coverage_summary"]
    assert "run failed" in out and "PS recovery after the restart of ps:0 failed" in out, out[-3000:]
    assert "run succeeded" not in out
