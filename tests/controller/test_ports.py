"""The controller's PS ports (controller/ports.py): the fleet is wired in, never imported.

A controller built without a PsFleet cannot restore the fleet after a PS restart; that
must fail the run loudly (``ps_recovery_failed`` fatal + ``run_failed`` naming the cause),
not leave the restarted shard empty while training goes on. The recovery with the real
fleet (ps.fleet_admin.GrpcPsFleet) is covered by test_ps_recovery / test_recovery_fallback.
"""

from __future__ import annotations

import time
from typing import Callable

from controller.ps_recovery import RUN_FAILED
from controller.server import ControllerServer


def test_a_ps_restart_without_a_wired_fleet_fails_the_run_saying_so(
        controller: Callable[..., ControllerServer]) -> None:
    srv = controller(ps_fleet=None)
    srv.recovery.settle_s = 0.0
    srv.register_node("ps", 0, "127.0.0.1:1", pid=100, incarnation_id="inc-100")
    srv.register_node("ps", 0, "127.0.0.1:1", pid=101, incarnation_id="inc-101")  # the same shard back: a new process
    deadline = time.monotonic() + 60
    while not any(e.kind == RUN_FAILED for e in srv.events.list()):
        assert time.monotonic() < deadline, [(e.kind, e.evidence) for e in srv.events.list()]
        time.sleep(0.05)
    events = {e.kind: e for e in srv.events.list()}
    assert "ps_recovery" not in events
    assert events["ps_recovery_failed"].evidence["fatal"] is True
    reason = events[RUN_FAILED].evidence["reason"]
    assert "ps:0" in reason and "no PS fleet is wired into the controller" in reason, reason
    assert "\n" not in reason
