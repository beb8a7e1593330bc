"""A fleet across "hosts" with the scripts of ``scripts/``: every role on its own address.

Where the machine allows it (root, ``ip`` present, ``ip netns add`` works) each role runs
in its own network namespace, joined by veth pairs to a bridge in a hub namespace::

    ns ctl 10.213.0.1 (controller, run-report) -+
    ns ps  10.213.0.2 (launch_ps.sh)            +-- bridge (ns hub)
    ns wk  10.213.0.3 (launch_workers.sh)       -+

Otherwise the roles bind distinct loopback addresses (controller 127.0.0.2, PS
127.0.0.3). Either way: the controller, the scripts' agents, gRPC between them, the
run-report helper; then a check that nothing of the fleet is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.ports import pick_port
from tests.deploy.podsim import netns_available as podsim_netns_available
from metaps.plots import PLOTS
from tests.metaps.fleet_data import (
    fleet_pids,
    kill_leftovers,
    make_data,
    wait_for,
    write_job_file,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_available() -> bool:
    """A namespace can be created here (tests.deploy.podsim's probe), unless loopback is forced."""
    return not os.environ.get("METAPS_TEST_FORCE_LOOPBACK") and podsim_netns_available(need_unshare=False)


@dataclass
class Topology:
    """Where each role runs: its address and the command prefix that puts it there."""

    kind: str
    hosts: dict[str, str]
    prefixes: dict[str, list[str]] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)

    def prefix(self, role: str) -> list[str]:
        return self.prefixes.get(role, [])

    def cleanup(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)


def make_netns_topology() -> Topology:
    tag = str(os.getpid() % 10000)
    hub = f"mps{tag}hub"
    topo = Topology("netns", {}, namespaces=[hub])
    try:
        _ip("netns", "add", hub)
        _ip("-n", hub, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, role in enumerate(("ctl", "ps", "wk")):
            ns, a, b, addr = f"mps{tag}{role}", f"vm{tag}{i}a", f"vm{tag}{i}b", f"10.213.0.{i + 1}"
            _ip("netns", "add", ns)
            topo.namespaces.append(ns)
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", hub)
            _ip("link", "set", b, "netns", ns)
            _ip("-n", hub, "link", "set", a, "master", "br0")
            _ip("-n", hub, "link", "set", a, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", b)
            _ip("-n", ns, "link", "set", b, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            topo.hosts[role] = addr
            topo.prefixes[role] = ["ip", "netns", "exec", ns]
    except BaseException:
        topo.cleanup()
        raise
    return topo


@pytest.fixture
def topology() -> Iterator[Topology]:
    if netns_available():
        topo = make_netns_topology()
    else:  # no namespaces here: distinct loopback addresses instead
        topo = Topology("loopback", {"ctl": "127.0.0.2", "ps": "127.0.0.3", "wk": "127.0.0.4"})
    try:
        yield topo
    finally:
        topo.cleanup()


def _port(topo: Topology, role: str) -> int:
    # a fresh namespace has every port free; on loopback pick one free on that address
    return 7000 + os.getpid() % 1000 if topo.kind == "netns" else pick_port(topo.hosts[role])


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.mark.timeout(900)
def test_fleet_across_hosts_with_the_scripts(topology: Topology, tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    env = {**os.environ, "METAPS_T0": repr(time.time()), "PYTHONPATH": str(REPO), "METAPS_PYTHON": sys.executable}
    py = [sys.executable, "-m", "metaps"]
    ctl_addr = f"{topology.hosts['ctl']}:{_port(topology, 'ctl')}"
    ps_port, ps_mport = _port(topology, "ps"), _port(topology, "ps") + 1
    controller = None
    try:
        with (run / "logs" / "controller.log").open("wb") as out:
            controller = subprocess.Popen(
                topology.prefix("ctl") + py + ["controller", "--config", str(cfg), "--address", ctl_addr,
                                                "--state-dir", str(run / "controller")],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: (run / "controller" / "address").exists() or controller.poll() is not None, 300,
                 "the controller's address file")
        assert controller.poll() is None, (run / "logs" / "controller.log").read_text()[-3000:]

        ps = subprocess.run(
            topology.prefix("ps") + [str(SCRIPTS / "launch_ps.sh"), "--config", str(cfg), "--controller", ctl_addr,
                                     "--run-dir", str(run), "--shards", "0", "--host", topology.hosts["ps"],
                                     "--port-base", str(ps_port), "--metrics-port-base", str(ps_mport),
                                     "--wait", "300"],
            cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=400)
        assert ps.returncode == 0, ps.stdout + ps.stderr + _tail(run / "logs" / "ps-0.log")
        ps_addrs = ps.stdout.strip().splitlines()[-1].removeprefix("PS=")
        assert ps_addrs == f"{topology.hosts['ps']}:{ps_port}"
        ready = json.loads((run / "ps" / "ps-0.ready").read_text())
        assert (ready["port"], ready["metrics_port"]) == (ps_port, ps_mport)
        # the PS is bound to its own address only
        if topology.kind == "netns":  # (TCP connects prove nothing here: a sandbox proxy may accept any)
            ns = {os.readlink(f"/proc/{p}/ns/net") for p in (os.getpid(), controller.pid, ready["pid"])}
            assert len(ns) == 3, f"controller and PS should each have their own network namespace: {ns}"
        else:
            assert _connects(topology.hosts["ps"], ps_port)
            assert not _connects("127.0.0.1", ps_port), "the PS listens beyond its own address"

        wk = subprocess.run(
            topology.prefix("wk") + [str(SCRIPTS / "launch_workers.sh"), "--config", str(cfg), "--controller",
                                     ctl_addr, "--ps", ps_addrs, "--run-dir", str(run), "--ranks", "0",
                                     "--metrics-port-base", str(_port(topology, "wk") + 2), "--wait"],
            cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=500)
        assert wk.returncode == 0, wk.stdout + wk.stderr + _tail(run / "logs" / "worker-0.log")
        assert not list((run / "pids").glob("worker-*.pid"))

        rep_proc = subprocess.run(
            topology.prefix("ctl") + py + ["run-report", "--run-dir", str(run), "--config", str(cfg),
                                           "--controller", ctl_addr, "--ps", ps_addrs],
            cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=300)
        assert rep_proc.returncode == 0, rep_proc.stdout[-3000:] + rep_proc.stderr[-3000:]

        stop = subprocess.run([str(SCRIPTS / "launch_ps.sh"), "--stop", "--run-dir", str(run)],
                              cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        controller.send_signal(signal.SIGTERM)
        assert controller.wait(60) == 0
        wait_for(lambda: not fleet_pids(str(run)), 30, "the fleet to exit")
    finally:
        if controller is not None and controller.poll() is None:
            os.killpg(controller.pid, signal.SIGKILL)
            controller.wait()
        left = kill_leftovers(str(run))
    assert left == [], f"processes left running: {left}"

    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "succeeded", rep["reason"]
    assert rep["controller"]["coverage"]["complete"], rep["controller"]["coverage"]
    nodes = {(n["role"], n["index"]) for n in rep["controller"]["nodes"]}
    assert {("ps", 0), ("worker", 0)} <= nodes  # agents on other addresses reached the controller
    assert rep["workers"][0]["steps"] > 0 and rep["workers"][0]["source"] == "report"
    assert len(rep["ps"]) == 1 and rep["ps"][0]["shard"] == 0
    assert rep["metrics_ports"] == {"ps-0": ps_mport}
    assert rep["checkpoint"] and Path(rep["checkpoint"]).is_dir()
    assert {e["worker"] for e in rep["shards"]} == {0}
    for name in PLOTS:
        assert (run / "plots" / name).is_file()


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path} missing)"
