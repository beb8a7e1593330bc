"""Fixtures for the PS service tests: real shard servers on 127.0.0.1 random ports.

* ``ps_fleet(n, ...)`` starts ``n`` in-process PsServers (each its own gRPC
  server, ShardStore and Prometheus registry) and stops them at teardown.
* ``ps_job(tmp_path, ...)`` writes a job TOML + schema for ``metaps ps``
  subprocess tests; ``start_ps_process`` runs one and waits for its ready file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from common.rpc import RpcConfig
from ps.client import PsClient
from ps.config import OptimizerConfig, OptimizerKind, PsConfig, TableConfig, TableDefaults
from ps.partition_map import PartitionMap
from ps.factory import build_server
from ps.servicer import PsServer

TOKEN = "test-token"
REPO = Path(__file__).resolve().parents[2]


def sgd_tables(user_dim: int = 8, item_dim: int = 4, capacity: int = 4096, lr: float = 0.5) -> list[TableConfig]:
    """Two SGD tables: updates are additive, so sums of concurrent pushes are checkable."""
    opt = OptimizerConfig(kind=OptimizerKind.SGD, lr=lr)
    return [
        TableConfig(name="user", dim=user_dim, capacity=capacity, optimizer=opt),
        TableConfig(name="item", dim=item_dim, capacity=capacity, optimizer=opt),
    ]


@dataclass
class Fleet:
    """N running shards and what a test needs to talk to them."""

    servers: list[PsServer]
    addresses: list[str]
    rpc: RpcConfig
    ps_cfg: PsConfig
    tables: list[TableConfig]
    clients: list[PsClient] = field(default_factory=list)

    def client(self, **kw: Any) -> PsClient:
        kw.setdefault("retry_timeout_s", 20.0)
        c = PsClient(self.addresses, kw.pop("rpc", self.rpc), **kw)
        self.clients.append(c)
        return c

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.stop(0)


def start_fleet(
    n: int,
    *,
    tables: list[TableConfig] | None = None,
    num_vshards: int = 32,
    token: str = TOKEN,
    rpc: RpcConfig | None = None,
    server_kw: dict[str, Any] | None = None,
    **ps_kw: Any,
) -> Fleet:
    tables = tables if tables is not None else sgd_tables()
    ps_cfg = PsConfig(shards=n, num_vshards=num_vshards, device=os.environ.get("METAPS_PS_DEVICE", "cpu"), **ps_kw)
    rpc = rpc or RpcConfig(token=token, timeout_s=20.0)
    pmap = PartitionMap.initial(n, num_vshards)
    servers = []
    for k in range(n):
        s = build_server(ps_cfg, rpc, tables, k, pmap=pmap, wait_timeout_s=10.0, max_workers=8, **(server_kw or {}))
        servers.append(s)
    addresses = [f"127.0.0.1:{s.start('127.0.0.1:0')}" for s in servers]
    return Fleet(servers, addresses, rpc, ps_cfg, tables)


@pytest.fixture
def ps_fleet() -> Iterator[Callable[..., Fleet]]:
    fleets: list[Fleet] = []

    def start(n: int = 3, **kw: Any) -> Fleet:
        f = start_fleet(n, **kw)
        fleets.append(f)
        return f

    yield start
    for f in fleets:
        f.stop()


# -- subprocess shards (`metaps ps`) ------------------------------------------------------
def write_job(tmp: Path, *, shards: int, dim: int = 8, capacity: int = 2048, optimizer: str = "rowwise_adagrad") -> Path:
    """A minimal job TOML (two tables: user, item) plus its schema file."""
    schema = tmp / "schema.json"
    schema.write_text(json.dumps({
        "version": 1, "task_key": "user_id", "labels": ["click"],
        "columns": [
            {"name": "user_id", "kind": "sparse", "table": "user"},
            {"name": "item_id", "kind": "sparse", "table": "item"},
            {"name": "click", "kind": "label"},
        ],
    }))
    job = tmp / f"job-{shards}.toml"
    job.write_text(
        f"""
[data]
train = "unused"
schema = "{schema}"
[model]
default_dim = {dim}
[ps]
shards = {shards}
num_vshards = 32
device = "cpu"
[ps.table_defaults]
dim = {dim}
capacity = {capacity}
optimizer = {{ kind = "{optimizer}", lr = 0.1 }}
[rpc]
token = "{TOKEN}"
timeout_s = 20.0
[delivery]
out = "unused"
"""
    )
    return job


@dataclass
class PsProcess:
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def _launch(job: Path, shard: int, tmp: Path, port: int, restore: str) -> tuple[subprocess.Popen, Path, Path]:
    ready = tmp / f"ready-{shard}-{time.monotonic_ns()}.json"
    log_path = tmp / f"ps-{shard}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "metaps", "ps", "--config", str(job), "--shard", str(shard),
           "--port", str(port), "--ready-file", str(ready), "--grace", "5",
           "--checkpoint-root", str(tmp)]  # Checkpoint/Restore RPCs may name dirs under tmp only
    if restore:
        cmd += ["--restore", restore]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    return proc, ready, log_path


def _await(proc: subprocess.Popen, ready: Path, log_path: Path, deadline: float) -> PsProcess:
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"metaps ps exited with {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"metaps ps not ready in time:\n{log_path.read_text()}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return PsProcess(proc, int(info["port"]), int(info["metrics_port"]), log_path)


def start_ps_process(job: Path, shard: int, tmp: Path, *, port: int = 0, restore: str = "", timeout: float = 90.0) -> PsProcess:
    """Run ``metaps ps`` for one shard and wait for its ready file."""
    return _await(*_launch(job, shard, tmp, port, restore), time.monotonic() + timeout)


def start_ps_processes(job: Path, shards: int, tmp: Path, *, timeout: float = 120.0) -> list[PsProcess]:
    """Start every shard's process at once (their imports overlap), then wait for all."""
    launched = [_launch(job, k, tmp, 0, "") for k in range(shards)]
    deadline = time.monotonic() + timeout
    return [_await(*item, deadline) for item in launched]
