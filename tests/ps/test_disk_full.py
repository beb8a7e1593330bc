"""A full disk during a checkpoint (issue 27 item 3): one clear line, no ``ckpt-*.tmp`` left,
the shards keep serving, the committed checkpoints are untouched, the next checkpoint works.

The full disk is a write-path fault (``ps.checkpoint.write_fault`` raising
``OSError(ENOSPC)`` at the write point) for the fleet and the single-process paths, and a
real tmpfs too small for the checkpoint (in a private mount namespace: ``unshare -rm``;
skipped where that is not allowed).
"""

from __future__ import annotations

import errno
import os
import sys
import textwrap
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from ps.checkpoint import latest_checkpoint, write_fault
from ps.config import TableConfig
from ps.coordinator import CheckpointCoordinationError, checkpoint_all, checkpoint_local
from ps.shard_store import ShardStore
from protos import ps_pb2

from tests.tmpfs import run_on_tmpfs

from .conftest import Fleet

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]


def _full_at(where: str, code: int = errno.ENOSPC) -> Callable[[Path, str, bytes], bytes]:
    """A fault raising a full disk when ``where`` is written (shard 1's first user chunk, the plan, the manifest)."""

    def hook(path: Path, key: str, data: bytes) -> bytes:
        hit = {"chunk": path.name == "shard-1.lmdb" and key.startswith("t/user/"),
               "plan": key == "plan.json", "manifest": key == "manifest.json"}[where]
        if hit:
            raise OSError(code, os.strerror(code), str(path))
        return data

    return hook


def _push(fleet: Fleet, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1 << 40, 50)
    c = fleet.client()
    try:
        c.push({"user": (ids, rng.standard_normal((50, 8)).astype(np.float32))})
        return c.pull({"user": ids})
    finally:
        c.close()


@pytest.mark.parametrize("where", ["chunk", "plan", "manifest"])
def test_fleet_checkpoint_on_a_full_disk_fails_cleanly(ps_fleet: Callable[..., Fleet], tmp_path: Path,
                                                       where: str) -> None:
    fleet = ps_fleet(2)
    root = tmp_path / "ckpt"
    _push(fleet, 0)
    good = checkpoint_all(fleet.addresses, root, 5, rpc_cfg=fleet.rpc)
    _push(fleet, 1)
    with write_fault(_full_at(where)), pytest.raises(CheckpointCoordinationError) as err:
        checkpoint_all(fleet.addresses, root, 6, rpc_cfg=fleet.rpc)
    msg = str(err.value)
    assert "\n" not in msg and "no space left on device" in msg and "nothing committed" in msg, msg
    if where == "chunk":
        assert "RESOURCE_EXHAUSTED" in msg and "ckpt-6.tmp/shard-1.lmdb" in msg, msg
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-5"]  # no ckpt-6.tmp, no ckpt-6
    assert latest_checkpoint(root) == good
    # the fleet goes on: not paused, pushes apply, and the next checkpoint commits
    pulled = _push(fleet, 2)
    assert all(np.isfinite(v).all() for v in pulled.values())
    assert checkpoint_all(fleet.addresses, root, 6, rpc_cfg=fleet.rpc).name == "ckpt-6"
    c = fleet.client()
    try:  # the committed one restores as before
        for k in range(2):
            assert c.stub(k).Restore(ps_pb2.RestoreRequest(dir=str(good)), timeout=30).step == 5
    finally:
        c.close()


def _store(rows: int = 300, dim: int = 8) -> ShardStore:
    s = ShardStore([TableConfig(name="user", dim=dim, capacity=max(1024, 2 * rows))], shard_id=0, num_vshards=8, seed=1)
    rng = np.random.default_rng(0)
    ids = np.arange(rows, dtype=np.int64)
    s.push("user", ids, rng.standard_normal((rows, dim)).astype(np.float32))
    return s


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_local_checkpoint_on_a_full_disk_leaves_nothing(tmp_path: Path, code: int) -> None:
    """The in-process worker's path (``LocalRowSource.checkpoint``): the error a periodic cut
    skips (CheckpointCoordinationError), one line, no tmp dir; the next checkpoint works."""
    store = _store()
    root = tmp_path / "ckpt"
    before = store.all_rows("user")
    with write_fault(lambda p, k, d: _full_at("chunk", code)(p.with_name("shard-1.lmdb"), k, d)), \
            pytest.raises(CheckpointCoordinationError) as err:
        checkpoint_local(store, root, 3, {"step": 3})
    msg = str(err.value)
    assert "\n" not in msg and "no space left on device" in msg and errno.errorcode[code] in msg, msg
    assert list(root.iterdir()) == []
    after = store.all_rows("user")
    assert np.array_equal(after.ids, before.ids) and np.array_equal(after.weights, before.weights)
    assert checkpoint_local(store, root, 3, {"step": 3}).name == "ckpt-3"


_REAL_FULL = textwrap.dedent("""
    import sys, numpy as np, torch
    torch.set_num_threads(1)
    from pathlib import Path
    from ps.config import TableConfig
    from ps.coordinator import CheckpointCoordinationError, checkpoint_local
    from ps.shard_store import ShardStore
    root = Path(sys.argv[1])
    s = ShardStore([TableConfig(name="user", dim=16, capacity=16384)], shard_id=0, num_vshards=8, seed=1)
    ids = np.arange(12000, dtype=np.int64)
    s.push("user", ids, np.ones((12000, 16), np.float32))
    try:
        checkpoint_local(s, root / "ckpt", 7, {"step": 7})
        print("COMMITTED")
    except CheckpointCoordinationError as exc:
        print("ERROR", exc)
    print("LEFT", sorted(p.name for p in (root / "ckpt").iterdir()) if (root / "ckpt").exists() else [])
""")


def test_a_real_full_disk(tmp_path: Path) -> None:
    """A 512 KiB tmpfs, a ~1.2 MiB checkpoint: LMDB reports the full disk as an I/O error; it is named as one."""
    mnt = tmp_path / "mnt"
    script = tmp_path / "full.py"
    script.write_text(_REAL_FULL)
    r = run_on_tmpfs(mnt, "512k", [sys.executable, str(script), str(mnt)], cwd=ROOT, timeout=120,
                     env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = r.stdout
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "COMMITTED" not in out, out
    err = next(line for line in out.splitlines() if line.startswith("ERROR"))
    assert "no space left on device" in err and "ckpt-7.tmp/shard-0.lmdb" in err and " 0 bytes free" in err, err
    assert "LEFT []" in out, out  # no ckpt-7.tmp, no partial shard file
