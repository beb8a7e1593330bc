"""Step clocks of restarted, late and vanished workers (issue 10 leftovers, point 1).

* A restarted worker process re-registers and gets its old clock back
  (``RegisterWorkerResponse.clock``), so it resumes its numbering and the others
  are not held back until it re-does steps it already did.
* A joiner with no clock enters at the slowest clock present (never drags the
  fleet back; in sync mode it is counted from the next barrier).
* A worker that vanished without leaving (SIGKILLed, never restarted) stops
  blocking the others once its clock lease (``[ps] clock_lease_s``) runs out;
  the expiry is counted in Stats; when it comes back its requests are refused
  with ``clock_expired`` and the client rejoins and resends.

Unit tests use a fake time source (no sleeps); the fleet tests run real worker
processes against real gRPC shards on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ps.client import PsClient
from ps.config import PsConfig
from ps.staleness import ClockExpired, StepClock
from tests.ps.conftest import REPO, start_fleet


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# -- StepClock semantics ---------------------------------------------------------------------
def test_re_registration_resumes_the_old_clock_and_joiners_start_at_the_slowest() -> None:
    clock = StepClock(max_staleness=4)
    assert clock.join("w0") == 0 and clock.join("w1") == 0
    for s in range(10):
        clock.advance("w0", s)
    for s in range(7):
        clock.advance("w1", s)
    # w1's process restarts and registers from 0: it keeps (and is told) its clock 7
    assert clock.join("w1", 0) == 7
    assert clock.check_pull("w0", 10) is None  # 10 <= 7 + 4: w0 not held back
    # a new worker (scale-up) starts at the slowest clock present, not at 0
    assert clock.join("w2", 0) == 7
    assert clock.min_clock() == 7
    # a worker that left (idle on the data queue) rejoins at no less than the slowest clock
    clock.leave("w1")
    clock.advance("w2", 8)
    assert clock.join("w1", 3) == 9  # min(w0: 10, w2: 9)


def test_an_unrenewed_clock_expires_and_its_worker_must_rejoin() -> None:
    now = FakeTime()
    clock = StepClock(max_staleness=2, lease_s=10.0, now=now)
    clock.join("w0")
    clock.join("dead")
    clock.advance("w0", 4)  # w0 completed 5 steps, 'dead' none
    assert clock.check_pull("w0", 5) is not None  # 5 > 0 + 2: held back by 'dead'
    now.t += 9.0
    clock.touch("w0")
    assert clock.check_pull("w0", 5) is not None  # 'dead' still within its lease
    now.t += 2.0  # 'dead' silent for 11 s > 10 s; w0 renewed 2 s ago
    assert clock.check_pull("w0", 5) is None
    assert clock.snapshot() == {"w0": 5} and clock.expired() == {"dead": 0} and clock.expired_total == 1
    # it comes back: any request with a step is refused until it re-registers ...
    with pytest.raises(ClockExpired, match="'dead'.*expired after 10s"):
        clock.touch("dead")
    with pytest.raises(ClockExpired):
        clock.arrive("dead", 0)
    # ... and it rejoins at the slowest clock present, without holding w0 back
    assert clock.join("dead", 0) == 5
    assert clock.expired() == {} and clock.check_pull("w0", 7) is None


def test_lease_zero_never_expires() -> None:
    now = FakeTime()
    clock = StepClock(max_staleness=0, lease_s=0.0, now=now)
    clock.join("w0")
    clock.join("w1")
    clock.advance("w0", 0)
    now.t += 1e6
    assert clock.arrive("w0", 0) is not None and clock.expired_total == 0


def test_clock_lease_config_is_validated() -> None:
    PsConfig(clock_lease_s=0.0).validate()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clock_lease_s"):
            PsConfig(clock_lease_s=bad).validate()


# -- real worker processes against a real fleet ----------------------------------------------
_WORKER = """
import sys, time, numpy as np
from common.rpc import RpcConfig
from ps.client import PsClient
addrs, token, wid, steps = sys.argv[1].split(","), sys.argv[2], sys.argv[3], int(sys.argv[4])
c = PsClient(addrs, RpcConfig(token=token, timeout_s=20.0), worker_id=wid, register=True, wait_timeout_s=120.0)
print("REGISTERED", c.registered_clock, flush=True)
ids = np.arange(4, dtype=np.int64)
for s in range(c.registered_clock, c.registered_clock + steps):
    c.pull({"user": ids}, step=s)
    c.push({"user": (ids, np.zeros((4, 8), np.float32))}, step=s)
print("STEPPED", c.registered_clock + steps, flush=True)
time.sleep(3600)  # vanish without leaving: the test SIGKILLs this process
"""


def _worker_proc(addrs: list[str], wid: str, steps: int, tmp: Path) -> tuple[subprocess.Popen, int]:
    """Run a worker process that registers, does ``steps`` steps, then idles; returns (proc, registered clock)."""
    out = tmp / f"{wid}-{os.getpid()}-{len(list(tmp.iterdir()))}.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, ",".join(addrs), "test-token", wid, str(steps)],
                            cwd=REPO, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT)
    import time

    deadline = time.monotonic() + 120
    while True:
        text = out.read_text()
        if "STEPPED" in text:
            return proc, int(text.split("REGISTERED ", 1)[1].split()[0])
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"worker process {wid} did not step:\n{text[-3000:]}")
        time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_restarted_worker_resumes_its_clock_and_does_not_block_the_others(tmp_path: Path) -> None:
    fleet = start_fleet(2, token="test-token", max_staleness=4, clock_lease_s=600.0)
    try:
        ids = np.arange(8, dtype=np.int64)
        w1, clock = _worker_proc(fleet.addresses, "worker-1", 6, tmp_path)
        assert clock == 0
        fast = fleet.client(worker_id="worker-0", register=True, wait_timeout_s=5.0)
        assert fast.registered_clock == 6  # joined late: at the slowest clock present
        for s in range(6, 11):  # worker-0 runs ahead up to the bound (worker-1 at 6: steps <= 10)
            fast.pull({"user": ids}, step=s)
            fast.push({"user": (ids, np.zeros((8, 8), np.float32))}, step=s)
        _kill(w1)  # crash; its agent restarts it: a fresh process registering from step 0
        w1b, clock = _worker_proc(fleet.addresses, "worker-1", 1, tmp_path)
        try:
            assert clock == 6  # resumed from its clock on the PS, not from 0
            # worker-0 pulls step 11 at once: 11 <= worker-1's 7 + 4. Numbering from 0 again, the
            # new process would hold worker-1's clock at 6 for 7 steps and worker-0 would time out
            fast.pull({"user": ids}, step=11)
            assert all(st["clocks"]["worker-1"] == 7 for st in fast.stats())
        finally:
            _kill(w1b)
        fast.close()
    finally:
        fleet.stop()


def test_a_vanished_worker_stops_blocking_after_its_lease_and_rejoins_when_back(tmp_path: Path) -> None:
    lease = 1.0
    fleet = start_fleet(2, token="test-token", max_staleness=2, clock_lease_s=lease)
    try:
        # worker-0's wait is far longer than the lease: it must get through because the
        # lease ends worker-1's hold, not because its own wait ran out
        ids = np.arange(8, dtype=np.int64)
        w1, _ = _worker_proc(fleet.addresses, "worker-1", 1, tmp_path)
        _kill(w1)  # dies for good without leaving (agent gave up / Job scaled down)
        fast = fleet.client(worker_id="worker-0", register=True, wait_timeout_s=120.0)
        for s in range(8):  # far past worker-1's clock 1 + 2
            fast.pull({"user": ids}, step=s)
            fast.push({"user": (ids, np.zeros((8, 8), np.float32))}, step=s)
        stats = fast.stats()
        assert all(st["clocks_expired"] >= 1 and st["expired_workers"].get("worker-1") == 1 for st in stats), stats
        assert all("worker-1" not in st["clocks"] for st in stats)
        # worker-1 comes back under the same id without re-registering first: refused with
        # clock_expired, the client rejoins (at the slowest clock present) and resends
        back = PsClient(fleet.addresses, fleet.rpc, worker_id="worker-1", wait_timeout_s=120.0)
        back.push({"user": (ids, np.zeros((8, 8), np.float32))}, step=1)
        assert back.rejoins == 2  # one per shard
        stats = fast.stats()
        assert all("worker-1" in st["clocks"] and "worker-1" not in st["expired_workers"] for st in stats), stats
        back.close()
        fast.close()
    finally:
        fleet.stop()
