"""A PS recovery whose newest checkpoint is corrupt (issue 10 point 1/2).

A real controller (gRPC, LMDB state) and two real PS shards on 127.0.0.1. Two
committed checkpoint cuts A (older) and B (newest); training goes on after B;
B is corrupted on disk; PS 1 "crashes" (stopped, restarted empty on the same
port, registers with a new pid). The controller must:

* fall back to A: event ``ps_recovery_fallback`` naming both dirs, every shard at
  A's rows, the DDS rolled back to A's cut (not B's);
* with A corrupt too: no shard touched further (all or nothing), and the run
  fails loudly: ``ps_recovery_failed`` (fatal) + ``run_failed`` with the reason.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from controller.ps_recovery import RUN_FAILED
from controller.server import ControllerServer
from ps.checkpoint import shard_path
from ps.coordinator import checkpoint_all
from ps.factory import build_server
from tests.metaps.fleet_data import wait_for
from tests.ps.conftest import start_fleet

from .conftest import TRAIN, client, served_rows

torch.set_num_threads(1)




def _flip(ckpt: Path, shard: int) -> None:
    p = shard_path(ckpt, shard)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _scenario(controller: Callable[..., ControllerServer], tmp_path: Path, corrupt_older: bool) -> dict[str, Any]:
    srv = controller(datasets=(TRAIN,))
    fleet = start_fleet(2, token="test-token")
    try:
        for k, a in enumerate(fleet.addresses):
            srv.register_node("ps", k, a, pid=1000 + k, incarnation_id=f"inc-{1000 + k}")
        w = client(srv, 0)
        leases = w.shards("train", poll_s=0.01)
        ps = fleet.client()
        rng = np.random.default_rng(0)

        def train(n_shards: int) -> None:
            for lease in itertools.islice(leases, n_shards):
                ids = rng.integers(0, 1 << 30, 50)
                ps.push({"user": (ids, rng.standard_normal((50, 8)).astype(np.float32))})
                assert w.report_shard(lease, "done", samples=lease.stop - lease.start).kind == "done"

        def cut(step: int) -> tuple[int, Path]:
            cut_id = srv.checkpoints.open_cut()
            d = checkpoint_all(fleet.addresses, tmp_path / "ckpt", step, rpc_cfg=fleet.rpc)
            srv.checkpoints.commit(cut_id, step, str(d))
            return cut_id, d

        train(2)
        cut_a, dir_a = cut(1)
        rows_a = [served_rows(s) for s in fleet.servers]
        done_a = srv.dds.progress()[0]["shards_done"]
        train(2)
        cut_b, dir_b = cut(2)
        train(1)  # after the newest cut
        live0 = served_rows(fleet.servers[0])
        done_live = srv.dds.progress()[0]["shards_done"]
        assert done_live > done_a
        _flip(dir_b, 0)
        if corrupt_older:
            _flip(dir_a, 1)
        # PS 1 crashes: its agent restarts it empty on the same port; it registers with a new pid
        port = int(fleet.addresses[1].rsplit(":", 1)[1])
        fleet.servers[1].stop(0)
        fleet.servers[1] = build_server(fleet.ps_cfg, fleet.rpc, fleet.tables, 1, wait_timeout_s=10.0)
        fleet.servers[1].start(f"127.0.0.1:{port}")
        srv.register_node("ps", 1, fleet.addresses[1], pid=2001, incarnation_id="inc-2001")
        wait_for(lambda: any(e.kind in ("ps_recovery", "ps_recovery_failed") for e in srv.events.list()),
                 60, "the controller's fleet recovery", 0.1)
        srv.recovery.join(30)
        events = {e.kind: e for e in srv.events.list()}
        return {"srv": srv, "events": events, "dir_a": str(dir_a), "dir_b": str(dir_b), "cut_a": cut_a,
                "cut_b": cut_b, "rows_a": rows_a, "rows_now": [served_rows(s) for s in fleet.servers], "live0": live0,
                "done_a": done_a, "done_live": done_live, "done_now": srv.dds.progress()[0]["shards_done"]}
    finally:
        fleet.stop()


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_good_one(controller: Any, tmp_path: Path) -> None:
    r = _scenario(controller, tmp_path, corrupt_older=False)
    ev = r["events"]
    assert "ps_recovery_failed" not in ev and RUN_FAILED not in ev, ev.get("ps_recovery_failed")
    fb = ev["ps_recovery_fallback"].evidence
    assert fb["newest_dir"] == r["dir_b"] and fb["dir"] == r["dir_a"], fb
    assert "sha256 mismatch" in fb["rejected"][0]["error"], fb
    rec = ev["ps_recovery"].evidence
    assert rec["cut_id"] == r["cut_a"] and rec["dir"] == r["dir_a"] and rec["fallback"] is True
    assert r["rows_now"] == r["rows_a"]  # both shards at A's cut, not B's, not empty
    assert r["done_now"] == r["done_a"] < r["done_live"]  # the DDS rolled back to A's cut


def test_no_good_checkpoint_fails_the_run_and_touches_no_shard(controller: Any, tmp_path: Path) -> None:
    r = _scenario(controller, tmp_path, corrupt_older=True)
    ev = r["events"]
    assert "ps_recovery" not in ev
    failed = ev["ps_recovery_failed"].evidence
    assert failed["fatal"] is True
    reason = ev[RUN_FAILED].evidence["reason"]
    assert "\n" not in reason and r["dir_a"] in reason and r["dir_b"] in reason, reason
    assert "no committed checkpoint could be restored" in reason
    assert r["rows_now"][0] == r["live0"]  # shard 0 kept its live rows: nothing half-restored
    assert r["done_now"] == r["done_live"]  # and the DDS was not rolled back
    assert r["srv"].recovery.failed == reason
