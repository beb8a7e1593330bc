"""Paths that arrive over the wire stay under the configured checkpoint root.

Checkpoint/Restore on a real PS (gRPC on 127.0.0.1) and CheckpointDone on a real
controller: a path outside the root, with ``..``, or through a symlink that escapes
the root is refused (PERMISSION_DENIED, naming path and root) and changes nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest

from controller.client import ControllerError
from common.paths import PathNotAllowed, confine
from common.rpc import make_channel
from protos import ps_pb2, ps_pb2_grpc
from ps.coordinator import checkpoint_all
from tests.controller.conftest import client as ctl_client
from tests.controller.conftest import controller  # noqa: F401 -- the fixture


def test_confine_accepts_inside_and_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    (tmp_path / "ck2").mkdir()
    (root / "link").symlink_to(tmp_path / "ck2")
    assert confine(root / "ckpt-1", root) == (root / "ckpt-1").resolve()
    assert confine(str(root / "a" / "b"), root) == (root / "a" / "b").resolve()
    for bad, why in ((tmp_path / "ck2" / "x", "outside"), (root / ".." / "ck2", "'..'"), (root / "link" / "x", "outside"),
                     (root, "outside"), ("", "empty"), ("/etc/passwd", "outside")):
        with pytest.raises(PathNotAllowed, match=why) as err:
            confine(bad, root)
        assert str(root.resolve()) in str(err.value)


@pytest.fixture
def confined_ps(ps_fleet, tmp_path: Path):
    fleet = ps_fleet(1)
    root = tmp_path / "checkpoints"
    root.mkdir()
    fleet.servers[0].checkpoint_root = str(root)
    channel = make_channel(fleet.addresses[0], fleet.rpc)
    yield fleet, root, ps_pb2_grpc.ParameterServerStub(channel)
    channel.close()


def _denied(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=20)
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    return err.value


def test_ps_checkpoint_outside_the_root_is_refused_and_writes_nothing(confined_ps, tmp_path: Path) -> None:
    fleet, root, stub = confined_ps
    c = fleet.client()
    ids = np.arange(20, dtype=np.int64)
    c.push({"user": (ids, np.ones((20, 8), np.float32))})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "escape").symlink_to(elsewhere)
    for bad in (tmp_path / "outside" / "ckpt-1", root / ".." / "dotdot" / "ckpt-1", root / "escape" / "ckpt-1"):
        err = _denied(stub.Checkpoint, ps_pb2.CheckpointRequest(dir=str(bad), step=1))
        assert str(bad) in err.details() and str(root) in err.details()
    assert not (tmp_path / "outside").exists() and not (tmp_path / "dotdot").exists()
    assert list(elsewhere.iterdir()) == []
    # inside the root it works (the coordinator's <root>/ckpt-<step>.tmp)
    final = checkpoint_all(fleet.addresses, root, 3, rpc_cfg=fleet.rpc)
    assert final.parent == root and (final / "manifest.json").is_file()


def test_ps_restore_outside_the_root_is_refused_and_changes_nothing(confined_ps, tmp_path: Path) -> None:
    fleet, root, stub = confined_ps
    c = fleet.client()
    ids = np.arange(20, dtype=np.int64)
    c.push({"user": (ids, np.ones((20, 8), np.float32))})
    final = checkpoint_all(fleet.addresses, root, 1, rpc_cfg=fleet.rpc)
    outside = tmp_path / "stolen" / "ckpt-1"
    shutil.copytree(final, outside)  # a valid checkpoint, but not under the root
    (root / "escape").symlink_to(outside)
    c.push({"user": (ids, np.ones((20, 8), np.float32))})  # rows now differ from the checkpoint's
    before = c.pull({"user": ids})["user"]
    for bad in (outside, root / ".." / "stolen" / "ckpt-1", root / "escape"):
        err = _denied(stub.Restore, ps_pb2.RestoreRequest(dir=str(bad)))
        assert str(root) in err.details()
    np.testing.assert_array_equal(c.pull({"user": ids})["user"], before)
    assert stub.Restore(ps_pb2.RestoreRequest(dir=str(final)), timeout=20).rows == 20


def test_controller_checkpoint_done_outside_the_root_is_refused(controller, tmp_path: Path) -> None:
    srv = controller()
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "escape").symlink_to(tmp_path)
    srv.checkpoint_root = str(root)
    c = ctl_client(srv, 0)
    cut = srv.checkpoints.open_cut()
    for bad in ("/etc", str(root / ".." / "ckpt-5"), str(root / "escape" / "ckpt-5")):
        with pytest.raises(ControllerError) as err:
            c.checkpoint_done(cut, 5, bad)
        assert err.value.code is grpc.StatusCode.PERMISSION_DENIED, err.value
        assert str(root) in str(err.value)
    with pytest.raises(ControllerError) as err:  # no directory at all: refused before the root check
        c.checkpoint_done(cut, 5, "")
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert next(x for x in srv.checkpoints.cuts() if x["cut_id"] == cut)["state"] == "pending"
    c.checkpoint_done(cut, 5, str(root / "ckpt-5"))
    body = next(x for x in srv.checkpoints.cuts() if x["cut_id"] == cut)
    assert body["state"] == "committed" and body["dir"] == str(root / "ckpt-5")
