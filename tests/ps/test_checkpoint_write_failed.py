"""A checkpoint whose files cannot be written (issue 37 item 7), on real in-process shards over gRPC.

* A write failure on any side (a shard's file, the coordinator's plan or manifest) is a
  :class:`~ps.coordinator.CheckpointWriteFailed` naming the uncommitted ``ckpt-<step>`` and the
  cause: deterministic, so a run's final checkpoint fails the run once instead of a restart
  retrying it. A shard that is gone is not one (a recovery may still save the run).
* The coordinator removes the tmp dir only once every shard answered: a shard still writing
  when another failed no longer finds its directory removed under it, and nothing is left.
* A shard asked to write into a tmp dir that does not exist (an aborted attempt removed it)
  refuses instead of making it again (which left ``ckpt-<step>.tmp`` behind).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
import numpy as np
import pytest

from ps.checkpoint import write_fault
from ps.coordinator import CheckpointCoordinationError, CheckpointWriteFailed, checkpoint_all
from ps.types import CHECKPOINT_NOT_WRITTEN, ERROR_KEY
from protos import ps_pb2

from .conftest import Fleet


def _push(fleet: Fleet) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1 << 40, 200)
    c = fleet.client()
    c.push({"user": (ids, rng.standard_normal((200, 8)).astype(np.float32))})


def _enospc(path: Path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["shard", "plan", "manifest"])
def test_a_write_failure_is_checkpoint_write_failed(ps_fleet: Callable[..., Fleet], tmp_path: Path,
                                                    where: str) -> None:
    fleet = ps_fleet(2)
    _push(fleet)
    root = tmp_path / "ckpt"

    def full(path: Path, key: str, data: bytes) -> bytes:
        if {"shard": path.name == "shard-1.lmdb", "plan": key == "plan.json", "manifest": key == "manifest.json"}[where]:
            raise _enospc(path)
        return data

    with write_fault(full), pytest.raises(CheckpointWriteFailed) as err:
        checkpoint_all(fleet.addresses, root, 4, rpc_cfg=fleet.rpc)
    assert err.value.path == root / "ckpt-4"
    assert "no space left on device" in err.value.cause and "\n" not in str(err.value), str(err.value)
    if where == "shard":
        assert err.value.cause.startswith("RESOURCE_EXHAUSTED: ") and "ckpt-4.tmp/shard-1.lmdb" in err.value.cause
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("code", [errno.EROFS, errno.EIO, errno.EACCES])
def test_any_os_error_on_a_shard_file_is_a_write_failure(ps_fleet: Callable[..., Fleet], tmp_path: Path,
                                                        code: int) -> None:
    fleet = ps_fleet(2)
    _push(fleet)
    root = tmp_path / "ckpt"

    def refuse(path: Path, key: str, data: bytes) -> bytes:
        if path.name == "shard-0.lmdb":
            raise OSError(code, os.strerror(code), str(path))
        return data

    with write_fault(refuse), pytest.raises(CheckpointWriteFailed) as err:
        checkpoint_all(fleet.addresses, root, 5, rpc_cfg=fleet.rpc)
    cause = err.value.cause
    assert cause.startswith("FAILED_PRECONDITION: ") and "ckpt-5.tmp/shard-0.lmdb: I/O error" in cause, cause
    assert os.strerror(code) in cause, cause
    assert list(root.iterdir()) == []


def test_a_shard_that_is_gone_is_no_write_failure(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(2)
    fleet.servers[1].stop(0)
    with pytest.raises(CheckpointCoordinationError) as err:
        checkpoint_all(fleet.addresses, tmp_path / "ckpt", 4, rpc_cfg=fleet.rpc)
    assert not isinstance(err.value, CheckpointWriteFailed), str(err.value)
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_the_tmp_dir_goes_only_once_every_shard_answered(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(2)
    _push(fleet)
    root = tmp_path / "ckpt"
    tmp = root / "ckpt-4.tmp"
    in_1, failed_0 = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def fault(path: Path, key: str, data: bytes) -> bytes:
        if path.name == "shard-0.lmdb":
            assert in_1.wait(30)  # shard 1 is writing
            failed_0.set()
            raise _enospc(path)
        if path.name == "shard-1.lmdb" and "tmp_removed" not in seen:
            in_1.set()
            assert failed_0.wait(30)
            # shard 0 failed while this shard still writes: the coordinator must not remove the
            # tmp dir now (an abort too early left a partial file or the dir behind)
            deadline = time.monotonic() + 1.5
            while tmp.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            seen["tmp_removed"] = not tmp.exists()
        return data

    with write_fault(fault), pytest.raises(CheckpointWriteFailed) as err:
        checkpoint_all(fleet.addresses, root, 4, rpc_cfg=fleet.rpc)
    assert "shard-0.lmdb: no space left on device" in err.value.cause, err.value.cause
    assert seen == {"tmp_removed": False}
    assert list(root.iterdir()) == []


def test_a_shard_does_not_make_a_removed_tmp_dir_again(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(1)
    _push(fleet)
    gone = tmp_path / "ckpt" / "ckpt-9.tmp"
    gone.parent.mkdir()
    stub = fleet.client().stub(0)
    with pytest.raises(grpc.RpcError) as err:
        stub.Checkpoint(ps_pb2.CheckpointRequest(dir=str(gone), step=9), timeout=30)
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert dict(err.value.trailing_metadata() or ()).get(ERROR_KEY) == CHECKPOINT_NOT_WRITTEN
    assert "no such checkpoint directory" in (err.value.details() or "")
    assert not gone.exists()
