"""Shared fixtures: real controllers on 127.0.0.1 random ports, real LMDB in tmp dirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from controller.client import ControllerClient
from controller.config import ControllerConfig, DdsConfig, MonitorConfig
from controller.types import DatasetKind, DatasetSpec
from controller.server import ControllerServer
from common.rpc import RpcConfig
from ps.fleet_admin import GrpcPsFleet

TOKEN = "test-token"
RPC = RpcConfig(token=TOKEN, timeout_s=5.0)


def small_cfg(**dds: Any) -> ControllerConfig:
    return ControllerConfig(tick_s=0.05, heartbeat_timeout_s=30.0,
                            dds=DdsConfig(**{"batches_per_shard": 4, **dds}),
                            monitor=MonitorConfig(window_s=0.2))


TRAIN = DatasetSpec("train", (10, 7, 8), DatasetKind.TRAIN, epochs=2)
EVAL = DatasetSpec("eval", (6,), DatasetKind.EVAL, epochs=1)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Callable[..., ControllerServer]]:
    """Factory: start a ControllerServer (stopped at teardown), with the gRPC PS fleet wired in as
    ``metaps controller`` does (pass ``ps_fleet=None`` for a controller without one)."""
    started: list[ControllerServer] = []

    def make(cfg: ControllerConfig | None = None, datasets: Sequence[DatasetSpec] = (TRAIN, EVAL),
             state_dir: Path | None = None, **kw: Any) -> ControllerServer:
        kw.setdefault("ps_fleet", GrpcPsFleet(RPC))
        srv = ControllerServer(cfg or small_cfg(), state_dir or tmp_path / "state", datasets, RPC, **kw)
        srv.start("127.0.0.1:0")
        started.append(srv)
        return srv

    yield make
    for srv in started:
        if srv._server is not None:
            srv.stop(grace=0)


def client(srv: ControllerServer, index: int = 0, role: str = "worker", register: bool = True,
           **kw: Any) -> ControllerClient:
    c = ControllerClient(srv.address, RPC, role=role, index=index, **kw)
    if register:
        c.register()
    return c


def drain(c: ControllerClient, dataset: str) -> int:
    """Process every shard of ``dataset`` with this client; return how many."""
    n = 0
    for lease in c.shards(dataset, poll_s=0.01):
        r = c.report_shard(lease, "done", samples=lease.stop - lease.start)
        assert r.kind == "done", r
        n += 1
    return n


def served_rows(server: Any) -> dict[str, bytes]:
    """What a PS shard (an in-process ``PsServer``) holds: every table's ids and weights, by id."""
    import numpy as np  # noqa: PLC0415 (the tests that compare rows need it)

    out = {}
    for name in server.store.tables:
        r = server.store.all_rows(name)
        order = np.argsort(r.ids)
        out[name] = r.ids[order].tobytes() + r.weights[order].tobytes()
    return out
