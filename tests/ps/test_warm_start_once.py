"""``metaps ps --restore-latest WARM``: the warm start of a new run applies only while the run has
no checkpoint of its own. A shard process replaced mid-run must not serve yesterday's model
(the controller's recovery restores this run's latest cut instead).

Real ``metaps ps`` processes, real checkpoints, judged on the rows the shard serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common.rpc import RpcConfig
from ps.client import PsClient
from ps.coordinator import checkpoint_all

from .conftest import REPO, TOKEN, start_ps_process, write_job


def _start(job: Path, tmp: Path, *extra: str) -> tuple[subprocess.Popen, Path, int]:  # type: ignore[type-arg]
    ready, log = tmp / f"ready-{time.monotonic_ns()}", tmp / f"ps-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "metaps", "ps", "--config", str(job), "--shard", "0", "--port", "0",
           "--ready-file", str(ready), "--grace", "5", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, log, int(json.loads(ready.read_text())["port"])


def _stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    proc.terminate()
    proc.wait(60)


def test_the_warm_start_is_not_reapplied_once_the_run_has_its_own_checkpoint(tmp_path: Path) -> None:
    rpc = RpcConfig(token=TOKEN, timeout_s=20.0)
    job = write_job(tmp_path, shards=1)
    ids = np.arange(1, 41, dtype=np.int64)
    warm, own = tmp_path / "yesterday" / "checkpoints", tmp_path / "today" / "checkpoints"
    # yesterday's model: 40 user rows, checkpointed
    first = start_ps_process(job, 0, tmp_path)
    try:
        with PsClient([first.address], rpc, retry_timeout_s=20) as c:
            c.push({"user": (ids, np.ones((40, 8), np.float32))})
            checkpoint_all([first.address], warm, 3, rpc_cfg=rpc)
    finally:
        _stop(first.proc)
    args = ("--restore-latest", str(warm), "--checkpoint-root", str(own))
    # today's run starts warm: it serves yesterday's rows, then checkpoints its own
    proc, log, port = _start(job, tmp_path, *args)
    try:
        with PsClient([f"127.0.0.1:{port}"], rpc, retry_timeout_s=20) as c:
            assert c.stats()[0]["store"]["tables"]["user"]["rows"] == 40
            checkpoint_all([f"127.0.0.1:{port}"], own, 9, rpc_cfg=rpc)
    finally:
        _stop(proc)
    # the same shard replaced mid-run, same arguments: not restarted from yesterday's model
    proc, log, port = _start(job, tmp_path, *args)
    try:
        with PsClient([f"127.0.0.1:{port}"], rpc, retry_timeout_s=20) as c:
            assert c.stats()[0]["store"]["tables"]["user"]["rows"] == 0
        assert "warm start not re-applied: the run has checkpoints of its own" in log.read_text()
    finally:
        _stop(proc)
