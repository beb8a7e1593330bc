"""Coordinated checkpoint, SIGKILL, restore (same and other shard counts): identical rows and state."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from common.rpc import RpcConfig
from ps.checkpoint import read_manifest
from ps.client import PsClient
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.coordinator import checkpoint_all
from protos import ps_pb2

from .conftest import TOKEN, start_ps_process, start_ps_processes, write_job


def test_checkpoint_kill_restore_n_to_m(ps_fleet, tmp_path) -> None:
    rpc = RpcConfig(token=TOKEN, timeout_s=20.0)
    job2 = write_job(tmp_path, shards=2, dim=8)
    procs = start_ps_processes(job2, 2, tmp_path)
    try:
        client = PsClient([p.address for p in procs], rpc, retry_timeout_s=20)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 1 << 40, 300)
        for _ in range(3):
            client.push({"user": (ids, rng.standard_normal((300, 8)).astype(np.float32)),
                         "item": (ids[:50], rng.standard_normal((50, 8)).astype(np.float32))})
        client.register_dense({"mlp.w": np.arange(6, dtype=np.float32).reshape(2, 3)})
        client.push_dense({"mlp.w": np.ones((2, 3), np.float32)})
        final = checkpoint_all(client.addresses, tmp_path / "ckpt", 7, rpc_cfg=rpc, extra_info={"note": "x"})
        manifest = read_manifest(final)
        assert final.name == "ckpt-7" and manifest["info"]["note"] == "x"
        assert manifest["info"]["dense_names"] == ["mlp.w"]
        r0 = client.pull({"user": ids, "item": ids[:50]})
        d0 = client.pull_dense(["mlp.w"])["mlp.w"]
        g = {"user": (ids, rng.standard_normal((300, 8)).astype(np.float32)),
             "item": (ids[:50], rng.standard_normal((50, 8)).astype(np.float32))}
        client.push(g)  # after the cut: must not be in the checkpoint
        r1 = client.pull({"user": ids, "item": ids[:50]})
        client.close()
    finally:
        for p in procs:
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait(10)
    assert all(p.proc.returncode == -signal.SIGKILL for p in procs)

    def check(addresses: list[str]) -> None:
        c = PsClient(addresses, rpc, retry_timeout_s=20)
        got = c.pull({"user": ids, "item": ids[:50]})
        for t in r0:
            np.testing.assert_array_equal(got[t], r0[t])
        np.testing.assert_array_equal(c.pull_dense(["mlp.w"])["mlp.w"], d0)
        c.push(g)  # the same step again: equal only if the Adagrad state was restored too
        got = c.pull({"user": ids, "item": ids[:50]})
        for t in r1:
            np.testing.assert_allclose(got[t], r1[t], rtol=0, atol=1e-6)
        c.close()

    # 2 -> 1 shard through `metaps ps --restore` (a fresh process).
    job1 = write_job(tmp_path, shards=1, dim=8)
    one = start_ps_process(job1, 0, tmp_path, restore=str(final))
    try:
        check([one.address])
    finally:
        one.proc.send_signal(signal.SIGKILL)
        one.proc.wait(10)

    # 2 -> 3 shards through the Restore RPC.
    opt = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
    tables = [TableConfig(name=n, dim=8, capacity=2048, optimizer=opt) for n in ("user", "item")]
    fleet = ps_fleet(3, tables=tables)
    for s in range(3):
        reply = PsClient(fleet.addresses, rpc).stub(s).Restore(ps_pb2.RestoreRequest(dir=str(final)), timeout=30)
        assert reply.step == 7
    check(fleet.addresses)


def test_pause_holds_pushes_until_resumed(ps_fleet) -> None:
    import threading
    import time

    fleet = ps_fleet(1)
    client = fleet.client()
    stub = client.stub(0)
    stub.PauseWrites(ps_pb2.PauseRequest(paused=True, lease_s=30), timeout=10)
    done = threading.Event()
    t = threading.Thread(target=lambda: (client.push({"user": (np.arange(4), np.ones((4, 8), np.float32))}), done.set()))
    t.start()
    time.sleep(0.5)
    assert not done.is_set()  # held by the pause
    stub.PauseWrites(ps_pb2.PauseRequest(paused=False), timeout=10)
    assert done.wait(10)
    t.join()


def test_checkpoint_rpc_needs_a_directory(ps_fleet) -> None:
    import grpc

    fleet = ps_fleet(1)
    with pytest.raises(grpc.RpcError) as err:
        fleet.client().stub(0).Checkpoint(ps_pb2.CheckpointRequest(dir="", step=1), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs a directory" in err.value.details()
