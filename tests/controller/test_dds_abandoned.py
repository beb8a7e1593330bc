"""Leases taken from their holders mid-way are ledgered ``abandoned`` (at-least-once, said so).

A worker that dies, re-registers, lets its lease expire, reports the shard failed, or holds it
across a rollback may already have pushed some of the shard's batches into the PS; the shard is
trained again by whoever leases it next. The ledger must say so (an ``abandoned`` entry for the
lease's range: an upper bound of the updates applied twice), and count one lease once: the
holder's own late report replaces the entry, also after a controller restart. Real LMDB.
"""

from __future__ import annotations

from pathlib import Path

from controller.config import DdsConfig
from controller.dds import DynamicDataSharding
from controller.ledger import EntryKind
from controller.state import EventLog, StateStore
from controller.types import DatasetKind, DatasetSpec, GetStatus
from tests.controller.test_dds import Clock

TRAIN = DatasetSpec("train", (8, 4), DatasetKind.TRAIN, epochs=1)
EVAL = DatasetSpec("eval", (4,), DatasetKind.EVAL, epochs=1)


def make(tmp: Path, clock: Clock | None = None, datasets=(TRAIN,)) -> tuple[StateStore, DynamicDataSharding]:
    store = StateStore(tmp / "state")
    dds = DynamicDataSharding(store, DdsConfig(batches_per_shard=4, lease_s=30.0), datasets, EventLog(store),
                              clock=clock or Clock())
    return store, dds


def finish(dds: DynamicDataSharding, worker: int, dataset: str = "train") -> None:
    while (got := dds.get_shard(worker, dataset)).status is GetStatus.SHARD:
        assert dds.report(worker, got.lease.shard_id, got.lease.attempt, "done", samples=4).kind == "done"
    assert got.status is GetStatus.DONE


def kinds(dds: DynamicDataSharding) -> list[tuple[str, str, int, int]]:
    return [(e.kind.value, f"{e.file}:{e.start}-{e.stop}", e.worker, e.attempt) for e in dds.ledger.entries()]


def test_a_dead_workers_lease_is_abandoned_with_its_range(tmp_path: Path) -> None:
    store, dds = make(tmp_path)
    lease = dds.get_shard(0, "train").lease
    assert dds.requeue_worker(0, "re-registered") == [lease.shard_id]
    finish(dds, 1)
    cov = dds.coverage()
    assert cov.complete, cov.problems
    assert (cov.abandoned_entries, cov.abandoned_batches) == (1, lease.batches), cov
    ab = [e for e in dds.ledger.entries() if e.kind is EntryKind.ABANDONED]
    assert [(e.worker, e.attempt, e.file, e.start, e.stop, e.samples) for e in ab] == \
        [(0, lease.attempt, lease.file, lease.start, lease.stop, 0)]
    store.close()


def test_expired_lease_then_the_holders_late_report_counts_once(tmp_path: Path) -> None:
    clock = Clock()
    store, dds = make(tmp_path, clock)
    lease = dds.get_shard(0, "train").lease
    clock.t += 31.0  # no heartbeat: the lease runs out
    assert dds.expire() == [lease.shard_id]
    store.close()  # the abandoned entry and its key survive a controller restart
    store, dds = make(tmp_path, clock)
    assert dds.coverage().abandoned_entries == 1
    # the frozen holder wakes up and reports the whole shard: one stale entry, not two
    late = dds.report(0, lease.shard_id, lease.attempt, "done", samples=4)
    assert late.kind == "stale"
    cov = dds.coverage()
    assert (cov.abandoned_entries, cov.stale_entries, cov.duplicate_samples) == (0, 1, 4), cov
    assert kinds(dds)[0] == ("stale", f"{lease.file}:{lease.start}-{lease.stop}", 0, lease.attempt)
    # another worker trains it; the holder's report again is a duplicate entry of its own
    finish(dds, 1)
    assert dds.report(0, lease.shard_id, lease.attempt, "done", samples=4).kind == "duplicate"
    cov = dds.coverage()
    assert cov.complete and (cov.stale_entries, cov.duplicate_entries, cov.abandoned_entries) == (1, 1, 0), cov
    store.close()


def test_a_late_report_after_the_shard_was_redone_replaces_the_abandoned_entry(tmp_path: Path) -> None:
    store, dds = make(tmp_path)
    lease = dds.get_shard(0, "train").lease
    dds.requeue_worker(0, "heartbeat timeout")
    finish(dds, 1)
    r = dds.report(0, lease.shard_id, lease.attempt, "done", samples=4)
    assert r.kind == "duplicate"
    cov = dds.coverage()
    assert (cov.abandoned_entries, cov.duplicate_entries) == (0, 1), cov
    store.close()


def test_failed_report_and_rollback_abandon_train_leases_but_not_eval_ones(tmp_path: Path) -> None:
    store, dds = make(tmp_path, datasets=(TRAIN, EVAL))
    a = dds.get_shard(0, "train").lease
    assert dds.report(0, a.shard_id, a.attempt, "failed", error="boom").kind == "requeued"
    cut = dds.snapshot()
    b = dds.get_shard(1, "train").lease  # held across the rollback: its holder trains on
    dds.rollback_to(cut)
    ev = dds.get_shard(2, "eval")
    assert ev.status is GetStatus.WAIT  # eval waits for training
    cov = dds.coverage()
    assert cov.abandoned_entries == 2 and cov.abandoned_batches == a.batches + b.batches, cov
    assert [k[0] for k in kinds(dds)] == ["abandoned", "abandoned"]
    # the holder across the rollback reports: its entry becomes stale
    assert dds.report(1, b.shard_id, b.attempt, "done", samples=4).kind == "stale"
    finish(dds, 3)
    lease = dds.get_shard(2, "eval").lease
    dds.requeue_worker(2, "dead")  # an eval lease updates nothing: no entry
    cov = dds.coverage()
    assert (cov.abandoned_entries, cov.stale_entries) == (1, 1), cov
    assert lease.dataset == "eval"
    store.close()
