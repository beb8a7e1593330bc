"""The ledger's coverage check is exactly-once: a gap *and* a batch done twice are problems.

The entries are written straight into a real LMDB :class:`~controller.state.StateStore`
through :meth:`Ledger.append` (the DDS's own path), so each check sees exactly the
ranges a test names: overlaps the DDS would never hand out are what the ledger must
still catch (a DDS bug, a replay gone wrong).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from controller.ledger import Coverage, EntryKind, Ledger
from controller.state import StateStore
from controller.types import DatasetKind, DatasetSpec

SPEC = DatasetSpec("train", (6, 4), DatasetKind.TRAIN, epochs=2)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    store = StateStore(tmp_path / "state")
    try:
        yield Ledger(store)
    finally:
        store.close()


def _add(ledger: Ledger, file: int, start: int, stop: int, *, epoch: int = 0, kind: EntryKind = EntryKind.DONE,
         dataset: str = "train", worker: int = 0, samples: int | None = None) -> None:
    with ledger._store.begin(write=True) as txn:
        ledger.append(txn, time=0.0, kind=kind, dataset=dataset, epoch=epoch, file=file, start=start, stop=stop,
                      worker=worker, attempt=0, samples=(stop - start) * 10 if samples is None else samples,
                      elapsed_s=0.1)


def _tile(ledger: Ledger, epochs: int = 2) -> None:
    """Every batch of ``epochs`` epochs done exactly once, in two pieces per file."""
    for epoch in range(epochs):
        for f, total in enumerate(SPEC.batches_per_file):
            _add(ledger, f, 0, total // 2, epoch=epoch)
            _add(ledger, f, total // 2, total, epoch=epoch)


def _cov(ledger: Ledger, **kw) -> Coverage:
    return ledger.coverage({"train": SPEC}, **kw)


def test_exact_tiling_is_complete(ledger: Ledger) -> None:
    _tile(ledger)
    cov = _cov(ledger)
    assert cov.complete and cov.problems == [] and cov.state == "complete"
    assert (cov.done_batches, cov.total_batches) == (20, 20) and cov.fraction == 1.0
    assert cov.by_dataset == {"train": [20, 20]}
    assert cov.done_entries == 8 and cov.samples == 200
    assert (cov.duplicate_entries, cov.stale_entries, cov.replayed_entries, cov.duplicate_samples) == (0, 0, 0, 0)


def test_a_batch_done_twice_is_a_problem_even_when_every_batch_is_covered(ledger: Ledger) -> None:
    _tile(ledger)
    _add(ledger, 0, 2, 5, epoch=1, worker=3)  # a second live completion of batches 2..4 of file 0
    cov = _cov(ledger)
    assert not cov.complete and cov.state == "incomplete"
    assert cov.problems == ["dataset train epoch 1 file 0: batches [2, 3) done more than once",
                            "dataset train epoch 1 file 0: batches [3, 5) done more than once"]
    # distinct batches are counted once: the overlap adds nothing to the fraction
    assert (cov.done_batches, cov.total_batches) == (20, 20)


def test_identical_completions_twice_are_a_problem(ledger: Ledger) -> None:
    _tile(ledger, epochs=1)
    for f, total in enumerate(SPEC.batches_per_file):
        _add(ledger, f, 0, total, epoch=1)
    _add(ledger, 1, 0, 4, epoch=1, worker=1)  # the whole of file 1, epoch 1, done a second time
    cov = _cov(ledger)
    assert not cov.complete
    assert cov.problems == ["dataset train epoch 1 file 1: batches [0, 4) done more than once"]


def test_an_overlap_exactly_at_the_range_end_is_named(ledger: Ledger) -> None:
    for epoch in range(2):
        _add(ledger, 0, 0, 6, epoch=epoch)
        _add(ledger, 1, 0, 4, epoch=epoch)
    _add(ledger, 0, 5, 6, epoch=0)  # the last batch of file 0 twice
    cov = _cov(ledger)
    assert cov.problems == ["dataset train epoch 0 file 0: batches [5, 6) done more than once"]
    assert not cov.complete and cov.done_batches == 20


def test_duplicate_and_stale_entries_are_counted_not_problems(ledger: Ledger) -> None:
    _tile(ledger)
    _add(ledger, 0, 0, 3, kind=EntryKind.DUPLICATE, samples=30)
    _add(ledger, 1, 2, 4, kind=EntryKind.STALE, samples=20)
    cov = _cov(ledger)
    assert cov.complete and cov.problems == []  # the DDS already refused them: not live
    assert (cov.duplicate_entries, cov.stale_entries, cov.replayed_entries) == (1, 1, 0)
    assert cov.duplicate_samples == 50 and cov.duplicate_batches == 5
    assert cov.samples == 250 and cov.done_entries == 8


def test_replayed_entries_leave_the_tiling_and_their_redo_is_exactly_once(ledger: Ledger) -> None:
    _tile(ledger, epochs=1)
    cut = ledger.last_seq()
    _add(ledger, 0, 0, 6, epoch=1)
    with ledger._store.begin(write=True) as txn:
        marked = ledger.mark_replayed_after(txn, cut)
    assert [(e.epoch, e.file, e.start, e.stop) for e in marked] == [(1, 0, 0, 6)]
    with ledger._store.begin(write=True) as txn:
        assert ledger.mark_replayed_after(txn, cut) == []  # already replayed: not marked twice
    _add(ledger, 0, 0, 6, epoch=1)  # the redo after the rollback
    _add(ledger, 1, 0, 4, epoch=1)
    cov = _cov(ledger)
    assert cov.complete, cov.problems
    assert cov.replayed_entries == 1 and cov.duplicate_samples == 60 and cov.duplicate_batches == 6
    assert [e.replayed for e in ledger.entries()] == [False] * 4 + [True, False, False]
    assert [e.seq for e in ledger.entries(since=5)] == [5, 6]


def test_gaps_are_problems_only_in_the_checked_epochs(ledger: Ledger) -> None:
    _tile(ledger, epochs=1)
    _add(ledger, 0, 1, 3, epoch=1)  # epoch 1 is still running: its gaps are work to do
    assert _cov(ledger, epochs={"train": 1}).problems == []
    cov = _cov(ledger)
    assert not cov.complete
    assert cov.problems == [
        "dataset train epoch 1 file 0: batches [0, 1) never done",
        "dataset train epoch 1 file 0: batches [3, 6) never done",
        "dataset train epoch 1 file 1: batches [0, 4) never done",
    ]
    assert (cov.done_batches, cov.total_batches) == (12, 20) and cov.fraction == pytest.approx(0.6)


def test_ranges_past_the_file_or_outside_the_dataset_are_problems(ledger: Ledger) -> None:
    _tile(ledger)
    _add(ledger, 1, 4, 5, epoch=0)     # file 1 has 4 batches
    _add(ledger, 2, 0, 1, epoch=0)     # there is no file 2
    _add(ledger, 0, 0, 1, epoch=2)     # there is no epoch 2
    _add(ledger, 0, 0, 1, dataset="other")  # a dataset not asked about: not this check's business
    cov = _cov(ledger)
    assert cov.problems == [
        "dataset train epoch 0 file 1: done up to batch 5, file has 4",
        "dataset train epoch 0 file 2: 1 completions outside the requested epochs/files",
        "dataset train epoch 2 file 0: 1 completions outside the requested epochs/files",
    ]
    assert not cov.complete and cov.done_batches == 20


def test_to_status_reports_the_overlap(ledger: Ledger) -> None:
    _tile(ledger)
    _add(ledger, 0, 0, 1)
    st = _cov(ledger).to_status(max_problems=1)
    assert st["complete"] is False and st["state"] == "incomplete"
    assert st["problems"] == ["dataset train epoch 0 file 0: batches [0, 1) done more than once"]
    assert st["done_batches"] == st["total_batches"] == 20 and st["fraction"] == 1.0
    assert st["by_dataset"] == {"train": [20, 20]} and st["done_entries"] == 9


def test_to_status_is_the_whole_coverage_as_plain_data(ledger: Ledger) -> None:
    spec = DatasetSpec("train", (3,), DatasetKind.TRAIN, epochs=1)
    _add(ledger, 0, 0, 1)
    _add(ledger, 0, 0, 1, kind=EntryKind.DUPLICATE, samples=7)
    _add(ledger, 0, 1, 2, kind=EntryKind.STALE, samples=5)
    _add(ledger, 0, 1, 3, kind=EntryKind.ABANDONED, samples=0)
    cov = ledger.coverage({"train": spec})
    cov.finished, cov.closed = False, {"eval": "max_steps"}
    assert cov.to_status() == {
        "complete": False, "state": "incomplete", "fraction": 0.333333, "done_batches": 1, "total_batches": 3,
        "by_dataset": {"train": [1, 3]}, "finished": False, "closed": {"eval": "max_steps"},
        "problems": ["dataset train epoch 0 file 0: batches [1, 3) never done"], "done_entries": 1,
        "duplicate_entries": 1, "stale_entries": 1, "replayed_entries": 0, "samples": 22,
        "duplicate_samples": 12, "duplicate_batches": 2, "abandoned_entries": 1, "abandoned_batches": 2,
    }


def test_to_status_keeps_the_first_fifty_problems(ledger: Ledger) -> None:
    spec = DatasetSpec("train", (1,) * 60, DatasetKind.TRAIN, epochs=1)
    cov = ledger.coverage({"train": spec})
    assert len(cov.problems) == 60 and cov.fraction == 0.0
    st = cov.to_status()
    assert st["problems"] == cov.problems[:50] and st["fraction"] == 0.0
    assert len(cov.to_status(max_problems=3)["problems"]) == 3
    assert Coverage().to_status()["fraction"] == 1.0  # nothing requested: all of it done


def test_counts_accumulate_and_unchecked_epochs_count_every_file(ledger: Ledger) -> None:
    _tile(ledger, epochs=1)
    _add(ledger, 0, 0, 2, epoch=1)
    _add(ledger, 1, 1, 3, epoch=1)  # epoch 1 still running: both files count towards the fraction
    for _ in range(2):
        _add(ledger, 0, 0, 1, kind=EntryKind.DUPLICATE, samples=10)
    cov = _cov(ledger, epochs={"train": 1})
    assert cov.problems == [] and not cov.complete and cov.finished is False
    assert cov.duplicate_entries == 2 and cov.duplicate_samples == 20 and cov.duplicate_batches == 2
    assert (cov.done_batches, cov.total_batches) == (14, 20)
    assert _cov(ledger, epochs={"eval": 1}).problems == _cov(ledger).problems != []  # not named: every epoch
    assert _cov(ledger, epochs={"eval": 1}).done_batches == 14
    cov.closed = {"train": "max_steps"}
    assert cov.state == "in_progress"  # the DDS has not finished: no verdict yet


def test_a_complete_coverage_is_finished(ledger: Ledger) -> None:
    _tile(ledger)
    cov = _cov(ledger)
    assert cov.complete is True and cov.finished is True and cov.to_status()["finished"] is True


def test_entries_read_inside_a_transaction_are_the_same(ledger: Ledger) -> None:
    _tile(ledger, epochs=1)
    _add(ledger, 0, 0, 1, kind=EntryKind.STALE)
    with ledger._store.begin() as txn:
        inside = list(ledger._iter(txn))
    assert inside == ledger.entries() and [e.seq for e in inside] == list(range(5))
    assert inside[-1].kind is EntryKind.STALE and inside[-1].batches == 1
