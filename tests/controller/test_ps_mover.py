"""ND moves vshards away from a slow PS through the real ps.migration, losing no update."""

from __future__ import annotations

import threading
import time

import numpy as np

from controller.config import ControllerConfig, MonitorConfig, NdConfig, PolicyKind
from controller.ps_mover import MigrationPsMover
from ps.fleet_admin import GrpcPsFleet
from tests.controller.conftest import client
from tests.ps.conftest import start_fleet


def test_slow_ps_gets_vshards_moved_with_no_update_lost(controller) -> None:
    fleet = start_fleet(2, num_vshards=16)
    try:
        mover = MigrationPsMover(fleet.addresses, GrpcPsFleet(fleet.rpc))
        cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.ND, monitor=MonitorConfig(window_s=0.15, consecutive=2),
                               nd=NdConfig(move_vshards=4, cooldown_windows=1000))
        srv = controller(cfg, ps_mover=mover)
        ids = np.arange(300, dtype=np.int64)
        before = fleet.client().pull({"user": ids})["user"]
        stop = threading.Event()
        pushed = [0]
        errors: list[BaseException] = []

        def work() -> None:
            try:
                c = fleet.client(backoff_s=0.01, max_backoff_s=0.1)
                while not stop.is_set():
                    c.push({"user": (ids, np.ones((ids.size, 8), np.float32))})
                    pushed[0] += 1
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=work)
        t.start()
        ps = [client(srv, i, role="ps") for i in range(2)]
        deadline = time.monotonic() + 30
        try:
            while not any(e.kind == "move_vshards_done" for e in srv.events.list()):
                assert time.monotonic() < deadline, [e.kind for e in srv.events.list()]
                for i, p in enumerate(ps):  # PS 1 reports 5x the latency of PS 0
                    p.report_metrics(request_latency_s=0.002 if i == 0 else 0.01)
                time.sleep(0.03)
        finally:
            stop.set()
            t.join(30)
        assert not errors, errors
        assert mover.reports and mover.reports[0].rows > 0
        owners = fleet.client().pmap
        assert len(owners.vshards_of(1)) == 8 - 4 and len(owners.vshards_of(0)) == 8 + 4
        after = fleet.client().pull({"user": ids})["user"]
        np.testing.assert_allclose(after, before - 0.5 * pushed[0], rtol=1e-5)  # SGD lr 0.5: every push counted
        ev = next(e for e in srv.events.list() if e.kind == "move_vshards")
        assert ev.evidence["src"] == 1 and ev.evidence["dst"] == 0 and ev.action == "move_vshards"
    finally:
        fleet.stop()
