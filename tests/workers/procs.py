"""Helpers for worker tests that run real ``metaps`` processes on loopback.

* :func:`write_job` saves a :class:`~metaps.job.JobConfig` as the TOML every process reads.
* :func:`start_worker` runs ``metaps worker`` with its log in a file.
* :func:`wait_for_log` polls a log file for a line (the processes' only shared state with the test).
* :func:`serve_ps_and_controller` starts one PS shard and a controller in this process (gRPC on 127.0.0.1).
* (free ports: :func:`common.metrics.free_port`)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from metaps.job import JobConfig
from common.toml_writer import dumps

REPO = Path(__file__).resolve().parents[2]
TOKEN = "worker-test-token"  # the PS fixtures (conftest.py) and worker processes share it


def write_job(job: JobConfig, path: Path) -> Path:
    """The job as a TOML file (the same sections ``metaps`` processes load)."""
    path.write_text(dumps(job.to_dict()))
    return path


def start_worker(config: Path, rank: int, ps: list[str], run_dir: Path, log_path: Path,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m metaps worker`` as its own process; stdout+stderr go to ``log_path``."""
    cmd = [sys.executable, "-m", "metaps", "worker", "--config", str(config), "--rank", str(rank),
           "--ps", ",".join(ps), "--run-dir", str(run_dir)]
    # job.toml says token = "<redacted>" (the token never reaches a file): hand it over as a launcher does
    full_env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", METAPS_TOKEN=TOKEN, **(env or {}))
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


def wait_for_log(log_path: Path, pattern: str, proc: subprocess.Popen, timeout_s: float) -> re.Match[str]:
    """First match of ``pattern`` in the log; fails if the process exits or time runs out first."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text() if log_path.exists() else ""
        m = rx.search(text)
        if m:
            return m
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before /{pattern}/ appeared:\n{text[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"/{pattern}/ not in the log after {timeout_s}s:\n{text[-4000:]}")
        time.sleep(0.05)


def wait_exit(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> int:
    """Wait for a process; kill it and fail with its log tail on timeout."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"process still running after {timeout_s}s:\n{log_path.read_text()[-4000:]}") from None


def kill_all(procs: Iterable[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """Kill (SIGKILL) and reap every process of ``procs`` still running (a test's teardown)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=timeout_s)


def serve_ps_and_controller(job: JobConfig, state_dir: Path, specs: Sequence[Any], *, batches_per_shard: int,
                            lease_s: float = 300.0, hang_min_s: float = 600.0) -> tuple[Any, list[str], Any]:
    """One PS shard of ``job`` and a controller over ``specs`` (no policy, fast ticks, long node
    timeouts), both serving on 127.0.0.1 in this process; the caller stops them.

    Returns:
        ``(ps server, [its address], controller server)``.
    """
    from controller.config import AgentConfig, ControllerConfig, DdsConfig, PolicyKind
    from controller.server import ControllerServer
    from common.rpc import RpcConfig
    from ps.factory import build_server

    ps = build_server(job.ps, job.rpc, job.table_configs(), 0, wait_timeout_s=600.0)
    addrs = [f"127.0.0.1:{ps.start('127.0.0.1:0')}"]
    cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.NONE, heartbeat_timeout_s=120.0, worker_stall_timeout_s=0.0,
                           dds=DdsConfig(batches_per_shard=batches_per_shard, lease_s=lease_s, hang_min_s=hang_min_s),
                           agent=AgentConfig(heartbeat_s=0.1))
    srv = ControllerServer(cfg, state_dir, list(specs), RpcConfig(token=TOKEN))
    srv.start("127.0.0.1:0")
    return ps, addrs, srv
