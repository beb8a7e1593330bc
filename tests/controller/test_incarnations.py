"""Process identity: restarts are told apart by a random incarnation id, never by the pid.

A pod recreated by a drain, an eviction or a rolling update starts in a fresh PID
namespace and gets the same small pid as the process it replaces. These tests register
through real gRPC clients against a real controller, with the pid held equal, and
check what the controller's state and event log hold.
"""

from __future__ import annotations

import grpc
import pytest

from controller.client import ControllerClient, ControllerError, incarnation_id
from tests.controller.conftest import RPC


def _ps(srv, index: int = 0) -> ControllerClient:  # type: ignore[no-untyped-def]
    return ControllerClient(srv.address, RPC, role="ps", index=index)


def test_a_replaced_ps_with_the_same_pid_is_a_restart_and_starts_a_recovery(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(ps_fleet=None)  # no fleet: the recovery then fails the run, which the log shows
    srv.recovery.settle_s = 0.0
    old = _ps(srv).register(address="10.0.0.5:5000", pid=5, incarnation="pod-a")
    assert not old.restarted
    new = _ps(srv).register(address="10.0.0.9:5000", pid=5, incarnation="pod-b")  # same pid, fresh namespace
    assert new.restarted and new.incarnation == old.incarnation + 1
    restarted = [e for e in srv.events.list() if e.kind == "ps_restarted"]
    assert len(restarted) == 1
    ev = restarted[0].evidence
    assert (ev["incarnation_id"], ev["previous_incarnation_id"], ev["pid"], ev["previous_pid"]) == (
        "pod-b", "pod-a", 5, 5)
    srv.recovery.join(timeout=30)
    assert srv.recovery.runs == 1 or srv.recovery.failed  # a recovery ran (and, with no fleet, failed loudly)
    info = srv.registry.get("ps", 0)
    assert (info.incarnation_id, info.address) == ("pod-b", "10.0.0.9:5000")


def test_the_same_process_registering_again_is_no_restart(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(ps_fleet=None)
    first = _ps(srv).register(address="10.0.0.5:5000", pid=7, incarnation="pod-a")
    again = _ps(srv).register(address="10.0.0.5:5000", pid=7, incarnation="pod-a")  # its link after a controller restart
    assert not first.restarted and not again.restarted
    assert not [e for e in srv.events.list() if e.kind == "ps_restarted"]
    assert not srv.recovery.busy()


def test_a_new_pid_under_the_same_incarnation_is_no_restart_either(controller) -> None:  # type: ignore[no-untyped-def]
    """The pid is evidence only: it decides nothing in either direction."""
    srv = controller(ps_fleet=None)
    _ps(srv).register(pid=100, incarnation="x")
    assert not _ps(srv).register(pid=200, incarnation="x").restarted
    assert not [e for e in srv.events.list() if e.kind == "ps_restarted"]


def test_a_superseded_process_is_fenced_off_by_its_heartbeat(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(ps_fleet=None)
    stale = ControllerClient(srv.address, RPC, role="worker", index=0)
    stale.register(pid=5, incarnation="old")
    ControllerClient(srv.address, RPC, role="worker", index=0).register(pid=5, incarnation="new")
    before = srv.registry.get("worker", 0).last_process_heartbeat
    reply = stale.heartbeat(step=999)
    assert [c.kind for c in reply.commands] == ["stop"]
    assert reply.commands[0].reason.startswith("superseded:") and "new" in reply.commands[0].reason
    info = srv.registry.get("worker", 0)
    assert info.incarnation_id == "new" and info.step != 999 and info.last_process_heartbeat == before
    # the current incarnation's heartbeat is served as usual
    cur = ControllerClient(srv.address, RPC, role="worker", index=0)
    cur.register(pid=5, incarnation="new")
    assert [c.kind for c in cur.heartbeat(step=3).commands] == []
    assert srv.registry.get("worker", 0).step == 3


def test_a_process_registration_without_an_incarnation_id_is_refused(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(ps_fleet=None)
    with pytest.raises(ControllerError) as err:
        _ps(srv).register(pid=5, incarnation="")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "incarnation_id" in err.value.details
    assert not srv.registry.known("ps", 0)


def test_the_incarnation_id_is_one_per_process_start() -> None:
    import multiprocessing as mp

    mine = incarnation_id()
    assert mine == incarnation_id() and len(mine) == 16
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        child = pool.apply(incarnation_id)
    assert child != mine
