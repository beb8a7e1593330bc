"""A PS recovery whose newest checkpoint is corrupt *inside* (issue 27 item 3).

As tests/controller/test_recovery_fallback.py (a real controller, two real PS shards on
127.0.0.1, cuts A then B, PS 1 restarted empty), but B's damage is one the manifest's
whole-file sha256 cannot see:

* a weight changed on the write path, after the chunk was serialized and before LMDB
  stored it (``ps.checkpoint.write_fault``), so the sha256 is taken over the damage;
* an LMDB page of B's file made invalid and the manifest re-sealed over it.

The shards refuse B with DATA_LOSS (a chunk checksum; LMDB's own error), and the
controller's existing fallback restores A: every shard serves A's rows, the DDS is
rolled back to A's cut.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from controller.ps_recovery import RUN_FAILED
from controller.server import ControllerServer
from ps.checkpoint import _sha256, shard_path, verify_checkpoint, write_fault
from ps.coordinator import checkpoint_all
from ps.factory import build_server
from tests.metaps.fleet_data import wait_for
from tests.ps.conftest import start_fleet
from tests.ps.test_restore_verify import _flip_weight, _Once

from .conftest import TRAIN, client, served_rows

torch.set_num_threads(1)




def _bad_lmdb_page(ckpt: Path) -> None:
    p = shard_path(ckpt, 0)
    data = bytearray(p.read_bytes())
    leaves = [pg for pg in range(2, len(data) // 4096) if struct.unpack_from("<H", data, pg * 4096 + 10)[0] == 0x02]
    struct.pack_into("<H", data, leaves[-1] * 4096 + 10, 0x40)
    p.write_bytes(bytes(data))
    mpath = ckpt / "manifest.json"
    man = json.loads(mpath.read_text())
    man["files"][p.name] = {"sha256": _sha256(p), "bytes": p.stat().st_size}
    mpath.write_text(json.dumps(man))


@pytest.mark.parametrize("damage", ["weight_changed_on_write", "lmdb_page"])
def test_newest_checkpoint_with_a_bad_chunk_falls_back(controller: Callable[..., ControllerServer], tmp_path: Path,
                                                       damage: str) -> None:
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

        def cut(step: int, hook: Any = None) -> tuple[int, Path]:
            cut_id = srv.checkpoints.open_cut()
            if hook is None:
                d = checkpoint_all(fleet.addresses, tmp_path / "ckpt", step, rpc_cfg=fleet.rpc)
            else:
                with write_fault(hook):
                    d = checkpoint_all(fleet.addresses, tmp_path / "ckpt", step, rpc_cfg=fleet.rpc)
            srv.checkpoints.commit(cut_id, step, str(d))
            return cut_id, d

        train(2)
        cut_a, dir_a = cut(1)
        rows_a = [served_rows(s) for s in fleet.servers]
        done_a = srv.dds.progress()[0]["shards_done"]
        train(2)
        hook = _Once(_flip_weight) if damage == "weight_changed_on_write" else None
        _cut_b, dir_b = cut(2, hook)
        if damage == "lmdb_page":
            _bad_lmdb_page(dir_b)
        verify_checkpoint(dir_b)  # the whole-file checksums pass: only the content checks can see it
        train(1)
        assert srv.dds.progress()[0]["shards_done"] > done_a
        port = int(fleet.addresses[1].rsplit(":", 1)[1])
        fleet.servers[1].stop(0)
        fleet.servers[1] = build_server(fleet.ps_cfg, fleet.rpc, fleet.tables, 1, wait_timeout_s=10.0)
        fleet.servers[1].start(f"127.0.0.1:{port}")
        srv.register_node("ps", 1, fleet.addresses[1], pid=2001, incarnation_id="inc-2001")
        wait_for(lambda: any(e.kind in ("ps_recovery", "ps_recovery_failed") for e in srv.events.list()),
                 60, "the controller's fleet recovery", 0.1)
        srv.recovery.join(30)
        ev = {e.kind: e for e in srv.events.list()}
        rows_now = [served_rows(s) for s in fleet.servers]
        done_now = srv.dds.progress()[0]["shards_done"]
    finally:
        fleet.stop()
    assert "ps_recovery_failed" not in ev and RUN_FAILED not in ev, ev.get("ps_recovery_failed")
    fb = ev["ps_recovery_fallback"].evidence
    assert fb["newest_dir"] == str(dir_b) and fb["dir"] == str(dir_a), fb
    error = fb["rejected"][0]["error"]
    want = "array 'weights' checksum mismatch" if damage == "weight_changed_on_write" else "LMDB error CorruptedError"
    assert want in error and f"{dir_b.name}/shard-0.lmdb key '" in error, error
    rec = ev["ps_recovery"].evidence
    assert rec["cut_id"] == cut_a and rec["dir"] == str(dir_a) and rec["fallback"] is True
    assert rows_now == rows_a  # both shards serve A's rows: not B's damaged ones, not empty
    assert done_now == done_a  # the DDS rolled back to A's cut
