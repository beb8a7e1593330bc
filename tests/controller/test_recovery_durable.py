"""PS recovery survives a controller SIGKILL at any of its steps (issue 27 item 1).

A real controller process (``proc_recovery_controller``: gRPC, LMDB state) and two
real PS shards on 127.0.0.1 (gRPC servers in this process, so the test can read their
rows and their pause). One committed cut; three shards trained after it; PS 1
restarts empty (awaiting recovery) and registers a new incarnation. The controller
dies (``os._exit(137)``) when its recovery reaches the chosen step -- a state-triggered
hook, after that step's record is durable, no wall clock -- and is started again on
the same state dir. Judged by state: every shard holds the cut's rows, the restarted
shard serves again, no shard is paused, the DDS was rolled back exactly once (one
``rollback`` event; the three shards trained after the cut are TODO again and their
ledger entries replayed) and the rest of the run completes.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from controller.client import ControllerClient
from common.rpc import RpcConfig
from ps.coordinator import checkpoint_all
from ps.factory import build_server
from tests.controller.conftest import served_rows
from tests.metaps.fleet_data import wait_for
from tests.ports import pick_port
from tests.ps.conftest import start_fleet

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "durable-token"
HB = 10.0  # the controller's node timeout: the recovery pause's lease


class Ctl:
    """One controller process; its output goes to a file printed when the test fails."""

    def __init__(self, state: Path, port: int, crash_at: str, log: Path) -> None:
        self.log = log
        self.out = open(log, "w")
        self.p = subprocess.Popen([sys.executable, "-m", "tests.controller.proc_recovery_controller", str(state),
                                   str(port), TOKEN, crash_at, str(HB)], cwd=ROOT, stdout=self.out,
                                  stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: "ready" in log.read_text() or self.p.poll() is not None, 60, "the controller to start", 0.05)
        assert self.p.poll() is None, log.read_text()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        self.out.close()


def _scenario(tmp_path: Path, crash_at: str) -> None:
    fleet = start_fleet(2, token=TOKEN)
    port = pick_port()
    addr = f"127.0.0.1:{port}"
    rpc = RpcConfig(token=TOKEN, timeout_s=5.0)
    ctls: list[Ctl] = []
    try:
        ctls.append(Ctl(tmp_path / "state", port, crash_at, tmp_path / "ctl-1.log"))
        links = [ControllerClient(addr, rpc, role="ps", index=k, retry_s=60) for k in range(2)]
        for k, c in enumerate(links):
            c.register(address=fleet.addresses[k], incarnation=f"ps{k}-first")
        w = ControllerClient(addr, rpc, role="worker", index=0, retry_s=60)
        w.register(incarnation="worker0")
        ps = fleet.client()
        rng = np.random.default_rng(0)
        leases = w.shards("train", poll_s=0.01)

        def train(n: int | None) -> int:
            k = 0
            for lease in itertools.islice(leases, n):
                ids = rng.integers(0, 1 << 30, 40)
                ps.push({"user": (ids, rng.standard_normal((40, 8)).astype(np.float32))})
                assert w.report_shard(lease, "done", samples=lease.stop - lease.start).kind == "done"
                k += 1
            return k

        def train_status() -> dict[str, Any]:
            st = w.status(events_since=0)
            return {"done": st["datasets"][0]["shards_done"], "events": [e["kind"] for e in st["events"]],
                    "coverage": st["coverage"], "run": st["run"], "finished": st["finished"]}

        train(3)
        cut_id = w.request_cut("test")
        ckpt = checkpoint_all(fleet.addresses, tmp_path / "ckpt", 1, rpc_cfg=fleet.rpc)
        w.checkpoint_done(cut_id, 1, str(ckpt))
        rows_cut = [served_rows(s) for s in fleet.servers]
        done_cut = train_status()["done"]
        train(3)  # updates the restore will erase: these shards must be replayed
        assert train_status()["done"] == done_cut + 3
        assert [served_rows(s) for s in fleet.servers] != rows_cut

        # PS 1 crashes; its agent starts it again, empty, awaiting the recovery
        port1 = int(fleet.addresses[1].rsplit(":", 1)[1])
        fleet.servers[1].stop(0)
        fleet.servers[1] = build_server(fleet.ps_cfg, fleet.rpc, fleet.tables, 1, wait_timeout_s=10.0)
        fleet.servers[1].mark_awaiting_recovery("test: a restarted process")
        fleet.servers[1].start(f"127.0.0.1:{port1}")
        links[1].register(address=fleet.addresses[1], incarnation="ps1-second")

        # the controller dies at the chosen recovery step
        assert ctls[0].p.wait(60) == 137, ctls[0].log.read_text()
        # a dead controller's pause is bounded by its node timeout (it ends by itself)
        left = [s._gate._paused_until - time.monotonic() for s in fleet.servers]
        assert max(left) <= HB + 0.5, left

        ctls.append(Ctl(tmp_path / "state", port, "", tmp_path / "ctl-2.log"))
        wait_for(lambda: "ps_recovery" in train_status()["events"], 60, "the resumed recovery", 0.1)
        st = train_status()
        assert st["events"].count("ps_recovery") == 1, st["events"]
        assert "ps_recovery_failed" not in st["events"] and st["run"]["state"] == "running", st
        assert st["events"].count("rollback") == 1, st["events"]  # the DDS rolled back exactly once
        assert st["done"] == done_cut, st  # the three shards trained after the cut are TODO again
        assert st["coverage"]["replayed_entries"] == 3, st["coverage"]
        assert [served_rows(s) for s in fleet.servers] == rows_cut  # every shard at the cut, the restarted one too
        assert not fleet.servers[1].awaiting_recovery
        assert not any(s._gate.paused for s in fleet.servers)

        assert train(None) == 8 - done_cut  # the replayed shards are handed out again; the run completes
        st = train_status()
        assert st["finished"] and st["coverage"]["state"] == "complete", st
    except BaseException:
        for c in ctls:
            c.out.flush()
            print(f"---- {c.log.name}\n{c.log.read_text()[-20000:]}")
        raise
    finally:
        for c in ctls:
            c.stop()
        fleet.stop()


@pytest.mark.parametrize("crash_at", [
    "pause",        # recorded, no shard paused yet
    "restored:0",   # the restarted shard (1) not restored yet
    "restored:1",   # every shard restored, the DDS not rolled back yet (the erased updates)
    "rolled_back",  # rolled back, the shards still paused
])
def test_recovery_resumes_after_controller_sigkill(tmp_path: Path, crash_at: str) -> None:
    _scenario(tmp_path, crash_at)


def test_no_final_checkpoint_while_a_recovery_is_pending(controller: Any) -> None:
    """A recorded, unfinished recovery (its rollback will requeue shards) keeps the run
    unfinished: GetShard says WAIT, not DONE (workers stay to replay), status is not
    finished, and the leader's finish does not count as the final checkpoint -- which
    would carry a step label newer than the restored rows."""
    from controller.ps_recovery import RECORD_KEY

    from .conftest import TRAIN, client, drain

    srv = controller(datasets=(TRAIN,), ps_fleet=None)
    w = client(srv, 0)
    assert drain(w, "train") > 0 and w.get_shard("train").status.value == "done"
    srv.recovery.note("ps:1", 2)  # durable; no run started here
    assert w.get_shard("train").status.value == "wait"
    assert w.status()["finished"] is False
    srv.outcome.worker_finished(0)
    assert not srv.outcome.final_done
    with srv.store.begin(write=True) as txn:  # stand-in for the end of the recovery
        txn.delete(RECORD_KEY.encode(), db=srv.store.db("meta"))
    assert w.get_shard("train").status.value == "done" and w.status()["finished"] is True
