"""metaps.fleet starts members safely from a process that talks gRPC, and they die with the launcher.

- The launcher runs gRPC clients in several threads while it (re)starts agents. A
  ``preexec_fn`` made ``subprocess`` fork for real, gRPC's fork handlers restarted
  a poller in the child, and the child aborted (SIGABRT) before ``exec`` about once
  in 30-40 starts (grpc/grpc#43055): a restarted agent "died (signal 6)". Here
  200 members start while two threads keep calling a real gRPC server on
  127.0.0.1; every one must run and exit 0.
- A SIGKILLed launcher still takes its members with it (``PR_SET_PDEATHSIG``, set by
  ``setpriv`` exec'ing the member instead of a ``preexec_fn``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from metaps.fleet import Fleet
from tests.metaps.fleet_data import fleet_pids


def test_members_start_cleanly_while_threads_call_grpc(tmp_path: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stop = threading.Event()
    calls = [0, 0]

    def busy(i: int) -> None:
        while not stop.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            calls[i] += 1

    threads = [threading.Thread(target=busy, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    fleet = Fleet(tmp_path / "logs")
    codes: dict[str, int] = {}
    try:
        while min(calls) == 0:  # both threads are inside gRPC before the first start
            time.sleep(0.01)
        for i in range(200):
            m = fleet.start(f"m{i}", ["true"], role="worker", index=i)
            codes[m.name] = m.proc.wait(timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        channel.close()
        server.stop(None)
        fleet.stop_all(grace_s=1.0)
    bad = {name: rc for name, rc in codes.items() if rc != 0}
    assert not bad, f"members that did not run (negative = killed by that signal): {bad}"
    assert min(calls) > 0


LAUNCHER = """
import sys, time
from pathlib import Path
from metaps.fleet import Fleet
fleet = Fleet(Path(sys.argv[1]))
m = fleet.start("sleeper", [sys.executable, "-c", "import time; time.sleep(300)", sys.argv[1]], role="worker")
print(m.pid, flush=True)
time.sleep(300)
"""


def test_members_are_told_to_stop_when_the_launcher_is_sigkilled(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "logs")], stdout=subprocess.PIPE,
                                text=True, env=env)
    marker = str(tmp_path / "logs")  # on the member's command line: fleet_pids finds it while it lives
    member = 0
    try:
        assert launcher.stdout is not None
        member = int(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        # exec'd: argv[0] is the member's python, no longer setpriv (whose argv also holds the marker)
        while Path(f"/proc/{member}/cmdline").read_bytes().split(b"\0")[0].decode() != sys.executable:
            assert time.monotonic() < deadline, "the member never exec'd its command"
            time.sleep(0.05)
        launcher.kill()
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 60
        while member in fleet_pids(marker):
            assert time.monotonic() < deadline, f"member {member} outlived its SIGKILLed launcher by 60 s"
            time.sleep(0.05)
    finally:
        launcher.kill()
        launcher.wait(timeout=60)
        if member in fleet_pids(marker):
            os.killpg(member, signal.SIGKILL)
