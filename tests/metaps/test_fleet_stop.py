"""Fleet stop: a leader that exits politely on SIGTERM leaves no child behind.

The child is heavy on purpose (hundreds of MiB touched, many threads): SIGKILL is
asynchronous and such a process takes a while to be torn down, which is the window
in which a stop that only *sends* SIGKILL to the group returns with the child alive
(``assert [6103] == []`` on a loaded CI machine).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from metaps.fleet import Fleet

CHILD = (
    "import threading, time\n"
    "b = bytearray(256 << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "[threading.Thread(target=time.sleep, args=(300,), daemon=True).start() for _ in range(64)]\n"
    "print('ready', flush=True)\n"
    "time.sleep(300)\n"
)
# bash exits 0 on SIGTERM without stopping its child (like an agent that leaves its worker behind)
POLITE_WITH_CHILD = ["bash", "-c", f'trap "exit 0" TERM; {sys.executable} -c "$0" & wait', CHILD]


def test_polite_leader_with_a_heavy_child_leaves_nothing_behind(tmp_path: Path) -> None:
    for i in range(3):
        fleet = Fleet(tmp_path / f"logs-{i}")
        m = fleet.start("worker-0", POLITE_WITH_CHILD, role="worker")
        deadline = time.monotonic() + 120
        while "ready" not in m.log_path.read_text():
            assert time.monotonic() < deadline, "child did not start"
            assert m.poll() is None, m.log_path.read_text()
            time.sleep(0.05)
        assert len(fleet.alive_pids()) == 2
        codes = fleet.stop(["worker-0"], grace_s=10.0)
        assert codes == {"worker-0": 0}  # the leader itself exited politely
        assert fleet.alive_pids() == []  # ... and its child is gone when stop() returns


def test_kill_all_returns_once_the_groups_are_empty(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "logs")
    m = fleet.start("worker-0", POLITE_WITH_CHILD, role="worker")
    deadline = time.monotonic() + 120
    while "ready" not in m.log_path.read_text():
        assert time.monotonic() < deadline, "child did not start"
        time.sleep(0.05)
    fleet.kill_all()
    assert fleet.alive_pids() == []
