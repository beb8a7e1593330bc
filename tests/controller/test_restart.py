"""The controller as a real process, SIGKILLed mid-job and restarted on the same state dir."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from controller.client import ControllerClient
from tests.ports import pick_port
from common.rpc import RpcConfig

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "restart-token"


def start(state: Path, port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "tests.controller.proc_controller", str(state), str(port), TOKEN],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_controller_sigkill_and_restart_loses_no_shard(tmp_path: Path) -> None:
    port = pick_port()
    proc = start(tmp_path / "state", port)
    addr = f"127.0.0.1:{port}"
    clients = [ControllerClient(addr, RpcConfig(token=TOKEN, timeout_s=2.0), index=i, retry_s=30) for i in range(3)]
    for c in clients:
        c.register()
    done = [0, 0, 0]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for ds in ("train", "eval"):
                for lease in clients[i].shards(ds, poll_s=0.01):
                    time.sleep(0.005)
                    r = clients[i].report_shard(lease, samples=lease.stop - lease.start)
                    assert r.kind in ("done", "retry"), r
                    done[i] += 1
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        while sum(done) < 25:
            time.sleep(0.01)
        proc.kill()  # SIGKILL: no shutdown path at all
        proc.wait(10)
        killed_at = sum(done)
        time.sleep(0.3)  # workers now retry against a dead port
        proc = start(tmp_path / "state", port)
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert killed_at < sum(done)
        st = clients[0].status()
        assert st["finished"]
        cov = st["coverage"]
        assert cov["complete"], cov["problems"]
        # 40 + 40 batches in shards of 2, 2 epochs, plus 10 eval shards: every one done exactly once
        assert cov["done_entries"] == 90
        assert cov["samples"] - cov["duplicate_samples"] == 2 * 80 + 20
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
