"""The DDS tail fix on a real LMDB: a lease stopped early, its rest handed to a waiting worker,
exactly once, across controller restarts (``[controller.dds] tail_split_min_batches``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import DdsConfig
from controller.dds import DynamicDataSharding, ShardState
from controller.state import EventLog, StateStore
from controller.types import DatasetKind, DatasetSpec, DdsError, GetStatus

ONE = DatasetSpec("train", (12,), DatasetKind.TRAIN, epochs=1)  # one shard of 12 batches


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(tmp: Path, min_batches: int = 2, clock: Clock | None = None,
         spec: DatasetSpec = ONE) -> tuple[StateStore, DynamicDataSharding]:
    store = StateStore(tmp / "state")
    return store, DynamicDataSharding(store, DdsConfig(batches_per_shard=12, tail_split_min_batches=min_batches),
                                      [spec], EventLog(store), clock or Clock())


def _slow_holds_fast_waits(dds: DynamicDataSharding):
    lease = dds.get_shard(0, "train").lease  # the slow worker 0 takes the only shard
    assert dds.get_shard(1, "train").status is GetStatus.WAIT  # the fast worker 1 waits
    dds.note_progress(0, lease.shard_id, 3)  # worker 0 has started batches 0-2 (2 is in progress)
    return lease


def test_a_waiting_worker_gets_the_tail_of_a_long_lease_exactly_once(tmp_path: Path) -> None:
    _, dds = make(tmp_path)
    lease = _slow_holds_fast_waits(dds)
    assert dds.tail_split() == [(0, lease.shard_id, 3)]  # stop after the batch in progress
    assert dds.tail_split() == [(0, lease.shard_id, 3)]  # asked again (idempotent), no second cut
    assert dds.get_shard(1, "train").status is GetStatus.WAIT  # nothing requeued before the holder reports
    rep = dds.report(0, lease.shard_id, lease.attempt, "done", samples=4, stop=4)
    assert rep.accepted and rep.kind == "done"
    # the same report again (reply lost) is a retry, not a second ledger entry
    assert dds.report(0, lease.shard_id, lease.attempt, "done", samples=4, stop=4).kind == "retry"
    tail = dds.get_shard(1, "train").lease
    assert (tail.start, tail.stop) == (4, 12)
    assert dds.report(1, tail.shard_id, tail.attempt, "done", samples=8).kind == "done"
    cov = dds.coverage()
    assert cov.complete and cov.done_entries == 2 and cov.duplicate_entries == 0 and cov.stale_entries == 0, cov
    assert dds.finished()


def test_holder_past_the_cut_reports_where_it_stopped_or_the_whole_shard(tmp_path: Path) -> None:
    _, dds = make(tmp_path)
    lease = _slow_holds_fast_waits(dds)
    dds.tail_split()
    # it had trained further than the controller knew: it stops at 6, not 4
    assert dds.report(0, lease.shard_id, lease.attempt, "done", samples=6, stop=6).kind == "done"
    tail = dds.get_shard(1, "train").lease
    assert (tail.start, tail.stop) == (6, 12)
    dds.report(1, tail.shard_id, tail.attempt, "done", samples=6)
    assert dds.coverage().complete

    _, dds2 = make(tmp_path / "b")
    lease = _slow_holds_fast_waits(dds2)
    dds2.tail_split()
    # the command never reached it: the whole shard, as usual
    assert dds2.report(0, lease.shard_id, lease.attempt, "done", samples=12).kind == "done"
    assert dds2.finished() and dds2.coverage().complete


def test_partial_reports_that_were_not_asked_for_or_out_of_range_change_nothing(tmp_path: Path) -> None:
    store, dds = make(tmp_path)
    lease = dds.get_shard(0, "train").lease
    with pytest.raises(DdsError, match=r"worker 0: shard train:0:0:0-12 reported done up to batch 5, but it was never asked"):
        dds.report(0, lease.shard_id, lease.attempt, "done", stop=5)
    dds.note_progress(0, lease.shard_id, 3)
    assert dds.get_shard(1, "train").status is GetStatus.WAIT
    dds.tail_split()
    with pytest.raises(DdsError, match=r"stopped at batch 13, expected a batch in \(0, 12\]"):
        dds.report(0, lease.shard_id, lease.attempt, "done", stop=13)
    with pytest.raises(DdsError, match=r"stop must be a batch index >= 0"):
        dds.report(0, lease.shard_id, lease.attempt, "done", stop=-1)
    assert dds.holders() == {0: [lease.shard_id]} and dds.coverage().done_entries == 0


def test_no_split_when_off_or_too_little_is_left_or_nobody_waits(tmp_path: Path) -> None:
    _, off = make(tmp_path / "off", min_batches=0)
    _slow_holds_fast_waits(off)
    assert off.tail_split() == []
    _, short = make(tmp_path / "short", min_batches=2)
    lease = short.get_shard(0, "train").lease
    assert short.get_shard(1, "train").status is GetStatus.WAIT
    short.note_progress(0, lease.shard_id, 11)  # 12 - 11 = 1 batch not started
    assert short.tail_split() == []
    _, idle = make(tmp_path / "idle")
    lease = idle.get_shard(0, "train").lease
    idle.note_progress(0, lease.shard_id, 3)  # nobody asked for work
    assert idle.tail_split() == []


def test_controller_restart_mid_truncation_keeps_exactly_once(tmp_path: Path) -> None:
    store, dds = make(tmp_path)
    lease = _slow_holds_fast_waits(dds)
    dds.tail_split()
    store.close()  # the controller dies after the cut was recorded, before the holder reported
    store, dds = make(tmp_path)
    rec = dds._live["train"].records[lease.shard_id]
    assert rec.state is ShardState.DOING and rec.stop_at == 3  # durable
    assert dds.tail_split() == [(0, lease.shard_id, 3)]  # re-sent by the new controller
    assert dds.report(0, lease.shard_id, lease.attempt, "done", samples=4, stop=4).kind == "done"
    store.close()  # dies again right after the partial report committed
    store, dds = make(tmp_path)
    assert dds.report(0, lease.shard_id, lease.attempt, "done", samples=4, stop=4).kind == "retry"
    tail = dds.get_shard(1, "train").lease
    assert (tail.start, tail.stop) == (4, 12)  # the tail is at the head of TODO after the restart
    dds.report(1, tail.shard_id, tail.attempt, "done", samples=8)
    cov = dds.coverage()
    assert cov.complete and cov.done_entries == 2 and cov.duplicate_entries == 0 and cov.stale_entries == 0, cov
    store.close()


def test_a_lease_lost_during_truncation_goes_back_whole(tmp_path: Path) -> None:
    _, dds = make(tmp_path)
    lease = _slow_holds_fast_waits(dds)
    dds.tail_split()
    assert dds.requeue_worker(0, "died") == [lease.shard_id]
    again = dds.get_shard(1, "train").lease
    assert (again.start, again.stop) == (0, 12)
    # the dead holder's late partial report is stale: nothing counted twice
    assert dds.report(0, lease.shard_id, lease.attempt, "done", samples=4, stop=4).kind == "stale"
    dds.report(1, again.shard_id, again.attempt, "done", samples=12)
    cov = dds.coverage()
    assert cov.complete and cov.done_entries == 1, cov


def test_the_truncated_holder_does_not_take_its_own_tail_back_while_another_waits(tmp_path: Path) -> None:
    _, dds = make(tmp_path)
    lease = _slow_holds_fast_waits(dds)
    dds.tail_split()
    # the holder's report rides on its next lease request (one transaction): it must not get the tail
    rep, got = dds.report_and_get(0, "train", lease.shard_id, lease.attempt, "done", samples=4, stop=4)
    assert rep.kind == "done" and got.status is GetStatus.WAIT
    tail = dds.get_shard(1, "train").lease
    assert (tail.start, tail.stop) == (4, 12)


def test_a_slower_waiter_does_not_split_a_faster_holders_lease(tmp_path: Path) -> None:
    clock = Clock()
    two = DatasetSpec("train", (12, 12), DatasetKind.TRAIN, epochs=1)
    _, dds = make(tmp_path, clock=clock, spec=two)
    a = dds.get_shard(0, "train").lease
    b = dds.get_shard(1, "train").lease
    clock.t += 10.0
    dds.report(1, b.shard_id, b.attempt, "done", samples=12, elapsed_s=10.0)  # worker 1: ~0.8 s per batch
    assert dds.get_shard(1, "train").status is GetStatus.WAIT
    dds.note_progress(0, a.shard_id, 8)  # worker 0: 8 batches in 10 s, 1.25 s per batch: not 1.5x slower
    assert dds.tail_split() == []
    dds.note_progress(0, a.shard_id, 3)  # as if 3 batches in 10 s: 3.3 s per batch, 4x slower
    assert dds.tail_split() == [(0, a.shard_id, 3)]
