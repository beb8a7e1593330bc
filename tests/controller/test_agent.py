"""The agent with real child processes and a real controller."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from controller.agent import Agent, proc_usage
from controller.config import AgentConfig
from tests.controller.conftest import RPC, TOKEN, client

ROOT = Path(__file__).resolve().parents[2]

CRASH = "import sys, time; open(sys.argv[1], 'a').write(f'{time.time()}\\n'); sys.exit(3)"
SLEEPER = (
    "import os, signal, sys, time\n"
    "out = sys.argv[1]\n"
    "def bye(*_):\n"
    "    open(out, 'a').write(f'bye {os.getpid()}\\n'); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "open(out, 'a').write(f'start {os.getpid()}\\n')\n"
    "while True: time.sleep(0.05)\n"
)


def lines(p: Path) -> list[str]:
    return p.read_text().splitlines() if p.exists() else []


def wait_for(pred, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_crashing_child_restarted_with_backoff_up_to_the_limit(controller, tmp_path: Path) -> None:
    srv = controller()
    w = client(srv, 1)
    held = w.get_shard("train").lease.shard_id
    starts = tmp_path / "starts"
    agent = Agent(AgentConfig(heartbeat_s=0.1, restart_limit=2, backoff_s=0.1, backoff_max_s=1.0), "worker", 1,
                  srv.address, RPC, [sys.executable, "-c", CRASH, str(starts)])
    assert agent.run() == 1  # gave up
    t = [float(x) for x in lines(starts)]
    assert len(t) == 3  # first start + restart_limit restarts
    assert t[1] - t[0] >= 0.1 and t[2] - t[1] >= 0.2  # exponential backoff
    downs = [e for e in srv.events.list() if e.kind == "node_down" and e.node == "worker:1"]
    assert [d.evidence["exit_code"] for d in downs] == [3, 3, 3, 3]
    assert downs[0].evidence["requeued"] == [held]  # reported at once: its shard went back to TODO
    assert "gave up after 3 crashes" in downs[-1].evidence["reason"]
    assert srv.dds.holders() == {}


def test_restart_command_restarts_the_child(controller, tmp_path: Path) -> None:
    srv = controller()
    out = tmp_path / "child.log"
    agent = Agent(AgentConfig(heartbeat_s=0.1, stop_grace_s=5.0), "worker", 2, srv.address, RPC,
                  [sys.executable, "-c", SLEEPER, str(out)])
    rc: list[int] = []
    th = threading.Thread(target=lambda: rc.append(agent.run()))
    th.start()
    try:
        wait_for(lambda: len(lines(out)) == 1)
        first = int(lines(out)[0].split()[1])
        wait_for(lambda: srv.registry.get("worker", 2).rss_bytes > 0)  # /proc usage in heartbeats
        srv.registry.enqueue("worker", 2, "restart", target="agent", reason="test")
        wait_for(lambda: len([l for l in lines(out) if l.startswith("start")]) == 2)
        assert lines(out)[1] == f"bye {first}"  # the old child was stopped cleanly first
        assert agent.restarts == 1
        wait_for(lambda: srv.registry.get("worker", 2).restarts == 1)
    finally:
        agent.stop()
        th.join(20)
    assert rc == [0]
    assert lines(out)[-1].startswith("bye ")
    down = [e for e in srv.events.list() if e.kind == "node_down"]
    assert down and down[0].evidence["reason"] == "restart command from the controller"


def test_sigterm_stops_agent_and_child_cleanly(controller, tmp_path: Path) -> None:
    srv = controller()
    out = tmp_path / "child.log"
    proc = subprocess.Popen([sys.executable, "-m", "tests.controller.proc_agent", srv.address, TOKEN, "3",
                             sys.executable, "-c", SLEEPER, str(out)], cwd=ROOT)
    try:
        wait_for(lambda: len(lines(out)) == 1)
        pid = int(lines(out)[0].split()[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert lines(out)[-1] == f"bye {pid}"
        assert proc_usage(pid) == (0.0, 0.0)  # gone
    finally:
        proc.kill()
        proc.wait(10)


def test_drain_command_stops_without_restart(controller, tmp_path: Path) -> None:
    srv = controller()
    out = tmp_path / "child.log"
    agent = Agent(AgentConfig(heartbeat_s=0.1), "ps", 0, srv.address, RPC, [sys.executable, "-c", SLEEPER, str(out)])
    rc: list[int] = []
    th = threading.Thread(target=lambda: rc.append(agent.run()))
    th.start()
    wait_for(lambda: len(lines(out)) == 1)
    srv.registry.enqueue("ps", 0, "drain", target="agent", reason="test")
    th.join(20)
    assert rc == [0] and lines(out)[-1].startswith("bye ") and len(lines(out)) == 2
