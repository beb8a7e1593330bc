"""The controller acting on a real PS fleet: `metaps ps --controller` processes, real gRPC.

A PS slowed by an injected per-request latency (``[[faults.faults]] target = "ps"``)
reports its own request latency; the ND policy flags it and the controller's
MigrationPsMover, built over the addresses the PS processes registered, moves
vshards away while a client keeps pushing SGD updates: none is lost.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from controller.config import ControllerConfig, MonitorConfig, NdConfig, PolicyKind
from controller.ps_mover import MigrationPsMover
from ps.client import PsClient
from ps.fleet_admin import GrpcPsFleet
from tests.controller.conftest import RPC
from tests.ps.conftest import start_ps_processes, write_job

LR = 0.1


def slow_ps_job(tmp: Path, latency_s: float) -> Path:
    """Two SGD shards (32 vshards, 16 each); PS 1 slowed by ``latency_s`` per request."""
    job = write_job(tmp, shards=2, optimizer="sgd")
    job.write_text(job.read_text() + f"""
[controller.monitor]
window_s = 0.3
[[faults.faults]]
target = "ps"
index = 1
kind = "latency"
latency_s = {latency_s}
""")
    return job


def test_slow_ps_process_gets_vshards_moved_with_no_update_lost(controller, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.ND, monitor=MonitorConfig(window_s=0.3, consecutive=2),
                           nd=NdConfig(move_vshards=6, cooldown_windows=1000))
    srv = controller(cfg)
    srv.ps_mover = MigrationPsMover(srv.ps_addresses, GrpcPsFleet(RPC))  # what `metaps controller` does
    monkeypatch.setenv("METAPS_CONTROLLER", srv.address)   # what `metaps agent` gives its child
    procs = start_ps_processes(slow_ps_job(tmp_path, latency_s=0.03), 2, tmp_path)
    try:
        addresses = [p.address for p in procs]
        assert srv.ps_addresses() == addresses  # registered by the PS processes themselves
        ids = np.arange(400, dtype=np.int64)
        c0 = PsClient(addresses, RPC, retry_timeout_s=20.0)
        before = c0.pull({"user": ids})["user"]
        stop = threading.Event()
        pushed = [0, 0]
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                with PsClient(addresses, RPC, retry_timeout_s=20.0, backoff_s=0.01, max_backoff_s=0.1) as c:
                    while not stop.is_set():
                        c.push({"user": (ids, np.ones((ids.size, 8), np.float32))})
                        pushed[k] += 1
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        try:
            while not any(e.kind in ("move_vshards_done", "move_vshards_failed") for e in srv.events.list()):
                assert time.monotonic() < deadline, [(e.kind, e.evidence) for e in srv.events.list()]
                time.sleep(0.05)
            time.sleep(0.3)  # pushes keep flowing on the new map
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not errors, errors
        kinds = [e.kind for e in srv.events.list()]
        assert "move_vshards_done" in kinds, [(e.kind, e.evidence) for e in srv.events.list()]
        ev = next(e for e in srv.events.list() if e.kind == "move_vshards")
        assert (ev.node, ev.evidence["src"], ev.evidence["dst"], ev.action) == ("ps:1", 1, 0, "move_vshards")
        assert ev.evidence["latency"] >= 0.03 > ev.evidence["dst_latency"]  # the PS's own measurement
        slow = next(e for e in srv.events.list() if e.kind == "slow_detected")
        assert slow.node == "ps:1"
        pmap = c0.refresh_map()
        assert len(pmap.vshards_of(1)) == 16 - 6 and len(pmap.vshards_of(0)) == 16 + 6
        after = c0.pull({"user": ids})["user"]
        assert sum(pushed) > 0
        np.testing.assert_allclose(after, before - LR * sum(pushed), rtol=1e-5, atol=1e-5)  # every push counted
        c0.close()
    finally:
        for p in procs:
            p.proc.terminate()
        for p in procs:
            p.proc.wait(15)
