"""The run's outcome (controller/run_outcome.py) through real gRPC clients and a real controller.

A failed run tells every live process to stop with ``run_failed`` (so a Kubernetes Job
can fail on the exit code instead of crash-looping to ``backoffLimit``), durably across a
controller restart, and refuses a process that registers into it (the same exit code); a complete run, with ``end_fleet``, stops the PS processes and shuts
the controller down once the stops were handed out.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from controller.client import ControllerClient, ControllerError
from controller.run_outcome import RUN_FAILED
from controller.server import ControllerServer
from controller.types import NODE_FINISHED
from common import exit_codes
from tests.controller.conftest import RPC, TRAIN, client, drain, small_cfg


def _wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _fail_the_run(srv: ControllerServer) -> tuple[str, ControllerClient]:
    """A PS restart with no fleet wired in: the recovery cannot restore anything, the run fails.
    Returns the reason and the PS's current incarnation's client."""
    srv.recovery.settle_s = 0.0
    ControllerClient(srv.address, RPC, role="ps", index=0).register(pid=5, incarnation="a")
    ps = ControllerClient(srv.address, RPC, role="ps", index=0)
    ps.register(pid=5, incarnation="b")
    _wait(lambda: srv.outcome.state()[0].value == "failed", 30, "the run to fail")
    return srv.outcome.state()[1], ps


def _refused(c: ControllerClient, reason: str, **kw: str) -> None:
    """``c`` registering into the failed run is refused: exit code RUN_FAILED, the reason named."""
    with pytest.raises(ControllerError) as refused:
        c.register(**kw)
    assert refused.value.exit_code == exit_codes.RUN_FAILED and reason in str(refused.value), refused.value


def test_a_failed_run_tells_every_live_process_to_stop_with_run_failed(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(ps_fleet=None)
    w0, w1 = client(srv, 0), client(srv, 1)
    reason, ps = _fail_the_run(srv)  # ps: the current PS incarnation (the one that is told)
    assert "ps:0" in reason
    srv.tick()
    for c in (w0, w1, ps):
        cmds = c.heartbeat().commands
        assert [x.kind for x in cmds] == ["stop"], cmds
        assert cmds[0].reason.startswith("run_failed:") and reason in cmds[0].reason
        assert exit_codes.for_stop(cmds[0].reason) == exit_codes.RUN_FAILED
    srv.tick()
    assert all(not c.heartbeat().commands for c in (w0, w1, ps))  # once per incarnation
    # a crash-looping worker comes back as a new incarnation: refused at once, with the same exit code
    again = ControllerClient(srv.address, RPC, role="worker", index=1)
    _refused(again, reason, incarnation="w1-second")
    st = again.status()
    assert (st["run"]["state"], st["run"]["reason"]) == ("failed", reason)
    assert not srv.shutdown_requested.is_set()  # without end_fleet the launcher ends the fleet


def test_the_failure_survives_a_controller_restart(controller, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = controller(ps_fleet=None, state_dir=tmp_path / "s")
    reason, _ = _fail_the_run(srv)
    srv.recovery.join(timeout=30)
    srv.stop(grace=0)
    back = controller(ps_fleet=None, state_dir=tmp_path / "s")
    assert back.outcome.state() == (back.outcome.state()[0].FAILED, reason)
    _refused(ControllerClient(back.address, RPC, role="worker", index=0), reason)


def test_a_complete_run_with_end_fleet_stops_the_ps_and_shuts_down(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(datasets=(TRAIN,), end_fleet=True)
    ps = ControllerClient(srv.address, RPC, role="ps", index=0)
    ps.register(incarnation="ps-a")
    w0, w1 = client(srv, 0), client(srv, 1)
    assert drain(w0, "train") + drain(w1, "train") > 0
    srv.tick()
    assert srv.outcome.state()[0].value == "running"  # data done, workers not finished yet
    assert not ps.heartbeat().commands
    w0.node_down("worker", 0, NODE_FINISHED, 0)
    srv.tick()
    assert srv.outcome.state()[0].value == "running" and not srv.shutdown_requested.is_set()
    w1.node_down("worker", 1, NODE_FINISHED, 0)
    srv.tick()
    assert srv.outcome.state()[0].value == "complete"
    assert not srv.shutdown_requested.is_set()  # the PS has not been handed its stop yet
    cmds = ps.heartbeat().commands
    assert [c.kind for c in cmds] == ["stop"] and exit_codes.for_stop(cmds[0].reason) == exit_codes.OK
    srv.tick()
    assert srv.shutdown_requested.is_set() and srv.outcome.exit_code == exit_codes.OK
    kinds = [e.kind for e in srv.events.list()]
    assert kinds.count("node_finished") == 2 and "run_ended" in kinds and RUN_FAILED not in kinds
    assert {n["state"] for n in w0.status()["nodes"] if n["role"] == "worker"} == {"done"}


def test_without_end_fleet_a_complete_run_sends_no_stop(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(datasets=(TRAIN,))
    ps = ControllerClient(srv.address, RPC, role="ps", index=0)
    ps.register(incarnation="ps-a")
    w0 = client(srv, 0)
    drain(w0, "train")
    w0.node_down("worker", 0, NODE_FINISHED, 0)
    srv.tick()
    assert srv.outcome.state()[0].value == "complete"
    assert not ps.heartbeat().commands and not srv.shutdown_requested.is_set()


def test_a_failed_run_with_end_fleet_exits_run_failed(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(ps_fleet=None, end_fleet=True)
    w0 = client(srv, 0)
    _, ps = _fail_the_run(srv)
    srv.tick()
    assert not srv.shutdown_requested.is_set()
    w0.heartbeat()
    ps.heartbeat()
    srv.tick()
    assert srv.shutdown_requested.is_set() and srv.outcome.exit_code == exit_codes.RUN_FAILED


def test_a_finished_worker_is_done_not_dead_and_frees_nothing_twice(controller) -> None:  # type: ignore[no-untyped-def]
    cfg = small_cfg()
    srv = controller(cfg=cfg, datasets=(TRAIN,))
    w0 = client(srv, 0)
    w0.node_down("worker", 0, NODE_FINISHED, 0)
    info = srv.registry.get("worker", 0)
    assert info.state.value == "done"
    assert not srv.registry.timed_out(0.0)  # a done node is never timed out as dead
    assert [e.kind for e in srv.events.list()] == ["node_finished"]


def test_the_checkpoint_leader_is_the_lowest_live_worker_and_hands_over(controller) -> None:  # type: ignore[no-untyped-def]
    """No worker index has duties another cannot take: the leader is whoever lives lowest."""
    srv = controller(datasets=(TRAIN,))
    w = {k: client(srv, k) for k in (0, 1, 2)}
    assert srv.outcome.leader() == 0
    assert [w[k].heartbeat().leader for k in (0, 1, 2)] == [True, False, False]
    w[0].node_down("worker", 0, "SIGTERM (pod deleted or scaled down)", 143)  # a scale-down took worker 0
    assert srv.outcome.leader() == 1 and w[1].heartbeat().leader and w[0].status()["run"]["leader"] == 1
    assert drain(w[1], "train") + drain(w[2], "train") > 0
    w[2].node_down("worker", 2, NODE_FINISHED, 0)  # a non-leader finishing writes no final checkpoint
    assert not srv.outcome.final_done and not w[1].status()["run"]["final_checkpoint"]
    w[1].node_down("worker", 1, NODE_FINISHED, 0)  # the leader finishing after the data: the final one
    st = w[1].status()["run"]
    assert st["final_checkpoint"] and st["state"] == "complete"  # a scaled-down (dead) worker does not block it
    assert [e.evidence for e in srv.events.list() if e.kind == "final_checkpoint"] == [{"worker": 1}]


def test_a_leader_finishing_before_the_data_is_done_is_no_final_checkpoint(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(datasets=(TRAIN,))
    w0, w1 = client(srv, 0), client(srv, 1)
    w0.node_down("worker", 0, NODE_FINISHED, 0)  # e.g. its step limit, shards left
    assert not srv.outcome.final_done and srv.outcome.leader() == 1
    drain(w1, "train")
    w1.node_down("worker", 1, NODE_FINISHED, 0)
    assert srv.outcome.final_done and srv.outcome.state()[0].value == "complete"


def test_a_finished_workers_unread_command_does_not_hold_the_shutdown(controller) -> None:  # type: ignore[no-untyped-def]
    """A cut queued to a worker just before it finished is never read; the controller shuts down once
    the live PS took its stop, not after ``linger_s`` (60 s: the run-failure-to-Job figure's delay)."""
    srv = controller(datasets=(TRAIN,), end_fleet=True)
    ps = ControllerClient(srv.address, RPC, role="ps", index=0)
    ps.register(incarnation="ps-a")
    w0 = client(srv, 0)
    drain(w0, "train")
    srv.registry.enqueue("worker", 0, "checkpoint", cut_id=7)  # never handed out: the worker leaves
    w0.node_down("worker", 0, NODE_FINISHED, 0)
    srv.tick()
    assert srv.outcome.state()[0].value == "complete" and not srv.shutdown_requested.is_set()
    assert [c.kind for c in ps.heartbeat().commands] == ["stop"]
    srv.tick()
    assert srv.shutdown_requested.is_set() and srv.outcome.exit_code == exit_codes.OK


def test_a_command_queued_after_the_stop_does_not_hold_the_shutdown(controller) -> None:  # type: ignore[no-untyped-def]
    """A failed k8s run's Jobs failed 60 s late: after the stops were handed out, the policy queued
    other commands (a truncate, a clock release) for workers that had obeyed their stop and exited,
    and the controller waited out its linger for them. Only the stops count."""
    srv = controller(ps_fleet=None, end_fleet=True)
    srv.outcome.linger_s = 600.0  # a wait for the linger would time this test out
    w0 = client(srv, 0)
    _, ps = _fail_the_run(srv)
    srv.tick()
    assert [c.kind for c in w0.heartbeat().commands] == ["stop"]
    assert [c.kind for c in ps.heartbeat().commands] == ["stop"]
    srv.registry.enqueue("worker", 0, "truncate", target="process", shard_id="train:0:0:0-4", stop_batch=2)
    srv.tick()  # w0 exited on its stop: the truncate is never handed out
    assert srv.shutdown_requested.is_set() and srv.outcome.exit_code == exit_codes.RUN_FAILED
