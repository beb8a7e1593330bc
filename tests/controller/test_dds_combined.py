"""Report + lease in one GetShard (``GetShardRequest.done``): same ledger as two RPCs, old clients work.

Real ControllerServer on 127.0.0.1, real LMDB; the crash case (controller SIGKILLed between the
commit and the reply) is in ``test_dds_combined_crash.py``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest

from controller.client import ControllerError, DoneReport
from controller.config import ControllerConfig, DdsConfig, MonitorConfig
from controller.server import ControllerServer
from controller.types import DatasetKind, DatasetSpec, GetStatus, ShardLease
from protos import controller_pb2 as pb
from protos import controller_pb2_grpc
from common.rpc import make_channel
from tests.controller.conftest import RPC, client, drain

# worker 1 takes shards of 2 batches: the base shards of 4 get split (SPLIT records, TODO heads)
CFG = ControllerConfig(tick_s=0.05, heartbeat_timeout_s=60.0,
                       dds=DdsConfig(batches_per_shard=4, lease_s=60.0, worker_batches_per_shard={"1": 2}),
                       monitor=MonitorConfig(window_s=0.2))
DATA = (DatasetSpec("train", (10, 7), DatasetKind.TRAIN, epochs=2), DatasetSpec("eval", (6,), DatasetKind.EVAL))


def _script(srv: ControllerServer, combined: bool) -> list[str]:
    """Two workers walk both datasets with a failure, a lost lease (node down) and a
    duplicate report; ``combined`` reports through the next GetShard, else ReportShard.
    Returns the reports' kinds in order."""
    cs = [client(srv, i) for i in range(2)]
    kinds: list[str] = []
    held: dict[int, ShardLease | None] = {0: None, 1: None}
    pending: dict[int, DoneReport | None] = {0: None, 1: None}

    def step(i: int, dataset: str) -> GetStatus:
        done = pending[i]
        pending[i] = None
        if combined:
            reply = cs[i].lease(dataset, done)
            if reply.report is not None:
                kinds.append(reply.report.kind)
            got = reply.got
        else:
            if done is not None:
                kinds.append(cs[i].report_shard(done.lease, done.status, done.samples, done.elapsed_s).kind)
            got = cs[i].get_shard(dataset)
        held[i] = got.lease
        return got.status

    n = 0
    for dataset in ("train", "eval"):
        while True:
            statuses = []
            for i in (0, 1):
                statuses.append(step(i, dataset))
                lease = held[i]
                if lease is None:
                    continue
                n += 1
                if n == 3:  # a failure: requeued at the head
                    pending[i] = DoneReport(lease, "failed", error="boom")
                elif n == 6:  # worker 1 loses its lease (its process died); its late report is stale
                    cs[0].node_down("worker", i, "test")
                    pending[i] = DoneReport(lease, "done", samples=lease.batches, elapsed_s=0.01)
                else:
                    pending[i] = DoneReport(lease, "done", samples=lease.batches, elapsed_s=0.01)
                if n == 8:  # reported on its own first: the pending report of it is then a `retry`
                    assert cs[i].report_shard(lease, "done", samples=lease.batches).kind == "done"
                    kinds.append("direct")
            if all(s is GetStatus.DONE for s in statuses) and not any(pending.values()):
                break
            if all(s is not GetStatus.SHARD for s in statuses) and not any(pending.values()):
                # WAIT with nothing pending cannot happen in this single-threaded script
                assert all(s is GetStatus.DONE for s in statuses), statuses
    for c in cs:
        c.close()
    return kinds


def _ledger(srv: ControllerServer) -> list[tuple[Any, ...]]:
    return [(e.seq, e.kind, e.dataset, e.epoch, e.file, e.start, e.stop, e.worker, e.attempt, e.samples,
             e.elapsed_s, e.replayed) for e in srv.dds.ledger.entries()]


def _records(srv: ControllerServer) -> list[dict[str, Any]]:
    out = []
    for _, body in srv.store.items("shards"):
        body = dict(body)
        body.pop("granted_with", None)  # the combined path's retry memo
        out.append(body)
    return out


def test_combined_report_and_lease_gives_the_same_ledger_as_two_rpcs(
        controller: Callable[..., ControllerServer], tmp_path: Path) -> None:
    two = controller(CFG, DATA, state_dir=tmp_path / "two")
    one = controller(CFG, DATA, state_dir=tmp_path / "one")
    kinds_two = _script(two, combined=False)
    kinds_one = _script(one, combined=True)
    assert kinds_one == kinds_two
    assert {"done", "requeued", "stale", "retry"} <= set(kinds_one), kinds_one
    assert _ledger(one) == _ledger(two)
    assert _records(one) == _records(two)
    for srv in (one, two):
        cov = srv.dds.coverage()
        assert cov.complete, cov
    assert asdict(one.dds.coverage()) == asdict(two.dds.coverage())


def test_refused_combined_report_leases_nothing(controller: Callable[..., ControllerServer]) -> None:
    srv = controller(CFG, DATA)
    c = client(srv, 0)
    lease = c.get_shard("train").lease
    assert lease is not None
    bad = ShardLease("train:0:9:0-4", "train", 0, 9, 0, 4, 1, 60.0)
    with pytest.raises(ControllerError, match=r"NOT_FOUND.*unknown shard train:0:9:0-4"):
        c.lease("train", DoneReport(bad, samples=4))
    with pytest.raises(ControllerError, match=r"NOT_FOUND.*unknown dataset 'nope'"):
        c.lease("nope", DoneReport(lease, samples=4))
    st = srv.dds.progress()[1]
    assert (st["dataset"], st["shards_doing"], st["shards_done"]) == ("train", 1, 0)  # nothing changed
    assert srv.dds.ledger.entries() == []
    # a done report for another worker is refused naming both
    raw = controller_pb2_grpc.ControllerStub(make_channel(srv.address, RPC))
    req = pb.GetShardRequest(worker=0, dataset="train", done=pb.ReportShardRequest(
        worker=1, shard_id=lease.shard_id, attempt=lease.attempt, status="done", samples=4))
    with pytest.raises(grpc.RpcError) as err:
        raw.GetShard(req, timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "done.worker must be the requesting worker 0, got 1" in (err.value.details() or "")
    assert srv.dds.progress()[1]["shards_doing"] == 1


def test_old_style_clients_still_work_next_to_combined_ones(controller: Callable[..., ControllerServer]) -> None:
    """A worker on GetShard + ReportShard (an old worker) and one on the combined request share a run."""
    srv = controller(CFG, DATA)
    old, new = client(srv, 0), client(srv, 1)
    n_old = n_new = 0
    for dataset in ("train", "eval"):
        done: DoneReport | None = None
        while True:
            got = old.get_shard(dataset)
            if got.lease is not None:
                assert old.report_shard(got.lease, "done", samples=got.lease.batches).kind == "done"
                n_old += 1
            reply = new.lease(dataset, done)
            if done is not None:
                assert reply.report is not None and reply.report.kind == "done", reply
            done = None
            if reply.got.lease is not None:
                done = DoneReport(reply.got.lease, samples=reply.got.lease.batches)
                n_new += 1
            if got.status is GetStatus.DONE and reply.got.status is GetStatus.DONE:
                break
    assert n_old > 0 and n_new > 0
    cov = srv.dds.coverage()
    assert cov.complete and cov.duplicate_entries == 0 and cov.stale_entries == 0, cov
    assert cov.done_entries == n_old + n_new


def test_deferred_report_rides_on_the_next_get_shard(controller: Callable[..., ControllerServer]) -> None:
    """What workers/worker.py does: defer_report, then get_shard carries it; flush_reports sends a leftover."""
    srv = controller(CFG, DATA)
    c = client(srv, 0)
    n = 0
    for lease in c.shards("train", poll_s=0.01):
        c.defer_report(lease, samples=lease.batches, elapsed_s=0.01)
        n += 1
        if n == 3:
            break
    assert len(srv.dds.ledger.entries()) == 2  # the third waits for a get_shard that did not come
    assert c.flush_reports() is not None
    assert [e.kind.value for e in srv.dds.ledger.entries()] == ["done"] * 3
    assert c.flush_reports() is None
    assert drain(c, "train") > 0 and drain(c, "eval") > 0
    assert srv.dds.coverage().complete


def test_async_calls_run_in_order_on_the_sender_thread(controller: Callable[..., ControllerServer]) -> None:
    """lease_async / report_shard_async / report_metrics(wait=False) run on the client's one
    sender thread (no grpc future per call): results arrive, refusals raise from result()."""
    srv = controller(CFG, DATA)
    c = client(srv, 0)
    first = c.lease_async("train").result().got.lease
    assert first is not None
    c.report_metrics(batch_times_s=[0.125], samples_per_s=8.0, wait=False)
    reply = c.lease_async("train", DoneReport(first, samples=first.batches)).result()
    assert reply.report is not None and reply.report.kind == "done" and reply.got.lease is not None
    assert c.report_shard_async(reply.got.lease, "done", samples=4).result().kind == "done"
    bad = ShardLease("train:0:9:0-4", "train", 0, 9, 0, 4, 1, 60.0)
    with pytest.raises(ControllerError, match="unknown shard train:0:9:0-4"):
        c.report_shard_async(bad, "done").result()
    # the fire-and-forget metrics reached the Monitor (poll its windows; no fixed sleep)
    deadline = time.monotonic() + 60
    seen = False
    while not seen and time.monotonic() < deadline:
        seen = any(w.worker_batch_time.get(0) == 0.125 for w in srv.monitor.snapshot().windows)
        time.sleep(0.05)
    assert seen, "report_metrics(wait=False) never reached the controller"
    c.close()
