"""DDS state machine on a real LMDB: dispatch, splits, failures, leases, rollback, restart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from controller.config import DdsConfig
from controller.dds import DynamicDataSharding
from controller.state import EventLog, StateStore
from controller.types import (DatasetKind, DatasetSpec, DdsError, GetStatus, StateMismatch, UnknownDataset,
                              UnknownShard)

TRAIN = DatasetSpec("train", (10, 7, 8), DatasetKind.TRAIN, epochs=2)
EVAL = DatasetSpec("eval", (6,), DatasetKind.EVAL, epochs=1)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(tmp: Path, cfg: DdsConfig | None = None, datasets=(TRAIN, EVAL), clock=None):
    store = StateStore(tmp / "state")
    events = EventLog(store)
    dds = DynamicDataSharding(store, cfg or DdsConfig(batches_per_shard=4), datasets, events,
                              **({"clock": clock} if clock else {}))
    return store, events, dds


def finish(dds: DynamicDataSharding, dataset: str, worker: int = 0) -> list[str]:
    done = []
    while (got := dds.get_shard(worker, dataset)).status is GetStatus.SHARD:
        assert dds.report(worker, got.lease.shard_id, got.lease.attempt, "done", samples=got.lease.batches).kind == "done"
        done.append(got.lease.shard_id)
    assert got.status is GetStatus.DONE
    return done


def test_dispatch_and_completion_exact_counts(tmp_path: Path) -> None:
    _, events, dds = make(tmp_path)
    per_epoch = sum(math.ceil(n / 4) for n in TRAIN.batches_per_file)  # 3 + 2 + 2
    train = finish(dds, "train")
    assert len(train) == 2 * per_epoch == 14
    assert len(set(train)) == 14
    assert len(finish(dds, "eval")) == 2
    cov = dds.coverage()
    assert cov.complete, cov.problems
    assert cov.done_entries == 16 and cov.duplicate_entries == 0 and cov.samples == 2 * 25 + 6
    assert dds.finished()
    assert [e.kind for e in events.list()].count("epoch_done") == 3


def test_wait_while_every_remaining_shard_is_leased(tmp_path: Path) -> None:
    _, _, dds = make(tmp_path, datasets=(EVAL,))
    a, b = dds.get_shard(0, "eval"), dds.get_shard(1, "eval")
    assert a.status is b.status is GetStatus.SHARD
    assert dds.get_shard(2, "eval").status is GetStatus.WAIT
    dds.report(0, a.lease.shard_id, a.lease.attempt, "done")
    assert dds.get_shard(2, "eval").status is GetStatus.WAIT  # b may still come back
    dds.requeue_worker(1, "died")
    again = dds.get_shard(2, "eval")
    assert again.lease.shard_id == b.lease.shard_id and again.lease.attempt == 2
    dds.report(2, again.lease.shard_id, again.lease.attempt, "done")
    assert dds.get_shard(2, "eval").status is GetStatus.DONE


def test_epochs_are_shuffled_with_the_seed(tmp_path: Path) -> None:
    _, _, d1 = make(tmp_path / "a", DdsConfig(batches_per_shard=1, seed=7), datasets=(DatasetSpec("x", (40,), epochs=2),))
    _, _, d2 = make(tmp_path / "b", DdsConfig(batches_per_shard=1, seed=7), datasets=(DatasetSpec("x", (40,), epochs=2),))
    o1, o2 = finish(d1, "x"), finish(d2, "x")
    assert o1 == o2
    starts0 = [s.split(":")[3] for s in o1[:40]]
    starts1 = [s.split(":")[3] for s in o1[40:]]
    assert starts0 != starts1 and sorted(starts0) == sorted(starts1)


def test_failing_shard_is_never_dropped(tmp_path: Path) -> None:
    _, events, dds = make(tmp_path, DdsConfig(batches_per_shard=4, warn_failures=2), datasets=(EVAL,))
    first = dds.get_shard(0, "eval").lease
    for i in range(5):
        got = dds.get_shard(0, "eval").lease if i else first
        assert got.shard_id == first.shard_id and got.attempt == i + 1  # back at the HEAD of TODO
        r = dds.report(0, got.shard_id, got.attempt, "failed", error="bad batch")
        assert r.kind == "requeued"
    failing = events.list(kind="shard_failing")
    assert len(failing) == 4 and failing[-1].evidence["failures"] == 5
    finish(dds, "eval")
    assert dds.coverage().complete


def test_slow_worker_gets_smaller_shards_remainder_at_head(tmp_path: Path) -> None:
    _, _, dds = make(tmp_path, DdsConfig(batches_per_shard=8, slow_shrink=4), datasets=(DatasetSpec("x", (16,)),))
    dds.set_slow(3, True)
    assert dds.shard_size(3) == 2
    small = dds.get_shard(3, "x").lease
    assert small.batches == 2
    nxt = dds.get_shard(0, "x").lease  # the remainder [start+2, stop) is at the head
    assert (nxt.file, nxt.start, nxt.stop) == (small.file, small.stop, small.start + 8)
    dds.report(3, small.shard_id, small.attempt, "done")
    dds.report(0, nxt.shard_id, nxt.attempt, "done")
    finish(dds, "x")
    cov = dds.coverage()
    assert cov.complete, cov.problems
    dds.set_slow(3, False)
    assert dds.shard_size(3) == 8


def test_lease_expiry_and_hang_requeue(tmp_path: Path) -> None:
    clock = Clock()
    _, events, dds = make(tmp_path, DdsConfig(batches_per_shard=2, lease_s=10, hang_factor=3, hang_min_s=5),
                          datasets=(DatasetSpec("x", (8,)),), clock=clock)
    a = dds.get_shard(0, "x").lease
    clock.t += 2
    dds.report(0, a.shard_id, a.attempt, "done", elapsed_s=2.0)  # 1 s/batch -> hang limit max(5, 3*1*2)=6
    hung = dds.get_shard(1, "x").lease
    quiet = dds.get_shard(2, "x").lease
    clock.t += 5
    dds.renew(1)  # worker 1 heartbeats but makes no progress
    assert dds.expire() == []
    clock.t += 6  # worker 2 silent for 11 s > lease; worker 1 held its shard 11 s > hang limit
    assert sorted(dds.expire()) == sorted([hung.shard_id, quiet.shard_id])
    kinds = sorted(e.kind for e in events.list() if e.node.startswith("worker:"))
    assert kinds == ["hang", "lease_expired"]
    late = dds.report(2, quiet.shard_id, quiet.attempt, "done")
    assert late.kind == "stale" and not late.accepted
    finish(dds, "x", worker=5)
    cov = dds.coverage()
    assert cov.complete and cov.stale_entries == 1


def test_duplicate_reports_are_idempotent(tmp_path: Path) -> None:
    _, _, dds = make(tmp_path, datasets=(EVAL,))
    a = dds.get_shard(0, "eval").lease
    assert dds.report(0, a.shard_id, a.attempt, "done", samples=4).kind == "done"
    for _ in range(3):
        r = dds.report(0, a.shard_id, a.attempt, "done", samples=4)
        assert (r.kind, r.duplicate) == ("retry", True)
    finish(dds, "eval")
    cov = dds.coverage()
    assert cov.complete and cov.done_entries == 2 and cov.duplicate_entries == 0


def test_rollback_to_cut_requeues_shards_done_after_it(tmp_path: Path) -> None:
    store, events, dds = make(tmp_path, datasets=(TRAIN,))
    before = [dds.get_shard(0, "train").lease for _ in range(3)]
    for l in before:
        dds.report(0, l.shard_id, l.attempt, "done")
    cut = dds.snapshot()
    after = []
    for _ in range(6):  # crosses into epoch 1 (7 shards per epoch)
        l = dds.get_shard(0, "train").lease
        dds.report(0, l.shard_id, l.attempt, "done")
        after.append(l.shard_id)
    held = dds.get_shard(1, "train").lease  # DOING in epoch 1
    held2 = dds.get_shard(2, "train").lease
    assert held.epoch == held2.epoch == 1
    returned = dds.rollback_to(cut)
    assert sorted(returned) == sorted(s for s in after if s.split(":")[1] == "0")
    prog = dds.progress()[0]
    assert prog["epoch"] == 0 and prog["shards_done"] == 3 and prog["shards_todo"] == 4
    # a worker that held an epoch-1 shard across the recovery reports it: "stale" (a replay), not an
    # error that would kill the worker (seen in tests/controller/test_ps_recovery.py)
    r = dds.report(1, held.shard_id, held.attempt, "done", samples=held.batches)
    assert (r.accepted, r.duplicate, r.kind) == (False, False, "stale") and "discarded by a rollback" in r.message
    # an epoch no rollback discarded, or a range that epoch never had, is still unknown
    with pytest.raises(UnknownShard):
        dds.report(1, "train:2:0:0-4", 1, "done")
    with pytest.raises(UnknownShard):
        dds.report(1, "train:1:0:8-99", 1, "done")
    store.close()  # the rollback's mark survives a controller restart
    store, events, dds = make(tmp_path, datasets=(TRAIN,))
    assert dds.report(2, held2.shard_id, held2.attempt, "done").kind == "stale"
    finish(dds, "train")
    cov = dds.coverage()
    assert cov.complete, cov.problems
    assert cov.replayed_entries == 6 and cov.stale_entries == 2
    assert events.list(kind="rollback")[0].evidence["replayed_entries"] == 6


def test_state_survives_reopen_and_rejects_other_datasets(tmp_path: Path) -> None:
    store, _, dds = make(tmp_path)
    a = dds.get_shard(0, "train").lease
    b = dds.get_shard(1, "train").lease
    dds.report(0, a.shard_id, a.attempt, "done")
    store.close()
    store2, _, dds2 = make(tmp_path)
    prog = {p["dataset"]: p for p in dds2.progress()}["train"]
    assert (prog["shards_done"], prog["shards_doing"]) == (1, 1)
    assert dds2.holders() == {1: [b.shard_id]}
    store2.close()
    other = DatasetSpec("train", (10, 7, 9), DatasetKind.TRAIN, epochs=2)
    with pytest.raises(StateMismatch, match=r"dataset train: .*batches_per_file.*\[10, 7, 8\].*\[10, 7, 9\]"):
        make(tmp_path, datasets=(other,))
    store3, _, dds3 = make(tmp_path)  # nothing was lost by the refused start
    assert dds3.holders() == {1: [b.shard_id]}
    store3.close()


def test_bad_input_names_the_problem(tmp_path: Path) -> None:
    _, _, dds = make(tmp_path)
    with pytest.raises(UnknownDataset, match="unknown dataset 'nope'.*known: \\['eval', 'train'\\]"):
        dds.get_shard(0, "nope")
    with pytest.raises(UnknownShard, match="unknown shard train:0:0:3-5"):
        dds.report(0, "train:0:0:3-5", 1, "done")
    with pytest.raises(DdsError, match="malformed shard id 'garbage'"):
        dds.report(0, "garbage", 1, "done")
    a = dds.get_shard(0, "train").lease
    with pytest.raises(DdsError, match="status must be 'done' or 'failed', got 'ok'"):
        dds.report(0, a.shard_id, a.attempt, "ok")
    with pytest.raises(DdsError, match="worker index must be an int >= 0, got -1"):
        dds.get_shard(-1, "train")
    with pytest.raises(DdsError, match=r"dataset name must match .*got 'bad name'"):
        make(tmp_path / "x", datasets=(DatasetSpec("bad name", (3,)),))
    assert dds.holders() == {0: [a.shard_id]}  # refused input changed nothing


def test_eval_is_leased_only_once_training_is_finished_and_again_after_a_rollback(tmp_path: Path) -> None:
    """Eval scores the final model: its shards wait while a train dataset is open, also when a
    rollback (a PS recovery) reopens a finished one; the eval shards it returned are scored again."""
    _, _, dds = make(tmp_path, DdsConfig(batches_per_shard=4))
    assert dds.get_shard(0, "eval").status is GetStatus.WAIT  # training not finished
    first = dds.get_shard(0, "train").lease
    dds.report(0, first.shard_id, first.attempt, "done")
    cut = dds.snapshot()
    finish(dds, "train")
    ev = dds.get_shard(0, "eval").lease
    dds.report(0, ev.shard_id, ev.attempt, "done")
    returned = dds.rollback_to(cut)
    assert ev.shard_id in returned and any(r.startswith("train:") for r in returned)
    assert dds.get_shard(1, "eval").status is GetStatus.WAIT  # training reopened: eval waits again
    finish(dds, "train")
    assert finish(dds, "eval")  # the returned eval shards are leased again, now
    cov = dds.coverage()
    assert cov.complete and dds.finished(), cov.problems
