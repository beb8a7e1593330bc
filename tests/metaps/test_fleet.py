"""metaps.fleet: process groups, stop escalation, nothing left behind, early failure on ready waits."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from metaps.fleet import Fleet, FleetError, tail

# A leader that ignores SIGTERM and has a child of its own (like an agent with a stuck child).
STUBBORN = ["bash", "-c", 'trap "" TERM; sleep 300 & echo child $!; wait']
POLITE = ["bash", "-c", 'trap "exit 0" TERM; sleep 300 & wait']


def test_stop_escalates_to_the_whole_group(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "logs")
    m = fleet.start("stubborn", STUBBORN, role="worker")
    time.sleep(0.3)
    assert len(fleet.alive_pids()) == 2  # bash + its sleep, one process group
    t0 = time.monotonic()
    codes = fleet.stop(["stubborn"], grace_s=0.5)
    assert time.monotonic() - t0 < 10
    assert codes["stubborn"] == -signal.SIGKILL
    assert fleet.alive_pids() == []
    assert m.stopped_by_us
    assert "child" in (tmp_path / "logs" / "stubborn.log").read_text()


def test_polite_members_exit_on_sigterm_and_stop_all_orders_roles(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "logs")
    for name, role in (("controller", "controller"), ("ps-0", "ps"), ("worker-0", "worker")):
        fleet.start(name, POLITE, role=role)
    time.sleep(0.3)
    fleet.stop_all(grace_s=5.0)
    assert fleet.exited() == {"controller": 0, "ps-0": 0, "worker-0": 0}
    assert fleet.alive_pids() == []


def test_wait_file_fails_early_with_the_log_tail(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "logs")
    m = fleet.start("dies", ["bash", "-c", "echo boom-reason >&2; exit 3"])
    with pytest.raises(FleetError, match=r"(?s)exited with code 3.*boom-reason"):
        fleet.wait_file(tmp_path / "never", m, timeout_s=30)


def test_wait_file_times_out_and_honours_stop(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "logs")
    m = fleet.start("sleeper", POLITE)
    with pytest.raises(FleetError, match="did not write"):
        fleet.wait_file(tmp_path / "never", m, timeout_s=0.3)
    with pytest.raises(FleetError, match="stopped while waiting"):
        fleet.wait_file(tmp_path / "never", m, timeout_s=30, stop=lambda: True)
    (tmp_path / "ready").write_text("{}")
    fleet.wait_file(tmp_path / "ready", m, timeout_s=1)
    fleet.kill_all()
    m.proc.wait(5)
    assert fleet.alive_pids() == []


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "logs")
    fleet.start("a", POLITE)
    try:
        with pytest.raises(FleetError, match="already started"):
            fleet.start("a", POLITE)
    finally:
        fleet.stop(["a"], grace_s=5)


def test_tail(tmp_path: Path) -> None:
    p = tmp_path / "x.log"
    p.write_text("".join(f"line {i}\n" for i in range(100)))
    assert tail(p, 3) == "line 97\nline 98\nline 99"
    assert tail(tmp_path / "missing") == ""


def test_last_error_names_the_cause_a_role_printed(tmp_path: Path) -> None:
    from metaps.fleet import last_error

    log_path = tmp_path / "worker-0.log"
    log_path.write_text(
        "2026 INFO workers.worker msg=step\n"
        "Traceback (most recent call last):\n"
        "ps.coordinator.CheckpointCoordinationError: checkpoint of step 9 failed: RESOURCE_EXHAUSTED: no space\n"
        "metaps worker: error: checkpoint of step 17 failed: RESOURCE_EXHAUSTED: Checkpoint: no space to write\n"
        "2026 ERROR controller.agent msg=\"restart limit reached; giving up\" node=worker:0\n")
    assert last_error(log_path) == ("metaps worker: error: checkpoint of step 17 failed: RESOURCE_EXHAUSTED: "
                                    "Checkpoint: no space to write")
    log_path.write_text("2026 INFO all fine\n")
    assert last_error(log_path) == ""
    assert last_error(tmp_path / "missing.log") == ""
