"""The completion ledger: one LMDB entry per shard completion report.

Every ``done`` report leaves an entry (worker, shard, attempt, samples, time).
The first accepted completion of a shard is ``done``; any later completion of
the same range is a ``duplicate`` (its samples were trained twice), and a
completion from a worker that had already lost its lease is ``stale`` (also
duplicated samples). A rollback to a checkpoint cut marks the ``done`` entries
after the cut ``replayed``: their samples will be trained again.

A lease taken from a holder that may already have pushed some of its batches (the
worker died or registered again, its lease expired or looked hung, it reported the
shard failed, a rollback returned it) leaves an ``abandoned`` entry for the lease's
range: updates of those batches may be in the model, and the shard is trained again
by whoever leases it next. Training is at-least-once there, and the ledger says so:
an ``abandoned`` entry is an upper bound (the holder pushed at most its batches, once).
When the same holder (worker and attempt) reports the lease after all, its ``stale``
report replaces the ``abandoned`` entry (:meth:`Ledger.supersede`), so one lease is
counted once. Per row, the updates in the final model are therefore at least the
live ``done`` entries' batches holding it and at most those plus every other entry's.

Coverage is checkable from the ledger alone: for every dataset and every
requested epoch, the live (not replayed) ``done`` entries must tile every file's
batch range exactly once. Only then is it ``complete``; otherwise it says what
fraction of the requested batches is covered (a run stopped mid-epoch is never
complete, whatever the epochs before it look like).

Example::

    report = ledger.coverage({"train": spec})
    assert report.complete, report.problems
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

import lmdb

from controller.state import StateStore, dumps, key_seq, loads, seq_key
from controller.types import DatasetSpec


class EntryKind(str, enum.Enum):
    DONE = "done"            # first accepted completion of the shard
    DUPLICATE = "duplicate"  # shard already done by another attempt
    STALE = "stale"          # the reporter had lost its lease
    ABANDONED = "abandoned"  # a lease taken from its holder mid-way: its updates may be in the model


@dataclass(frozen=True)
class LedgerEntry:
    """One completion report as stored."""

    seq: int
    time: float
    kind: EntryKind
    dataset: str
    epoch: int
    file: int
    start: int
    stop: int
    worker: int
    attempt: int
    samples: int
    elapsed_s: float
    replayed: bool = False

    @property
    def batches(self) -> int:
        return self.stop - self.start


@dataclass
class Coverage:
    """Result of :meth:`Ledger.coverage`.

    Attributes:
        complete: every batch of every *requested* epoch of every dataset done exactly
            once (live entries). A run stopped mid-epoch is never complete.
        problems: human-readable gaps and overlaps (dataset, epoch, file, range) in the
            epochs checked (a gap in an epoch still running is not a problem).
        done_batches / total_batches: distinct batches covered by live ``done`` entries
            over every requested epoch, and how many there are; ``fraction`` = their ratio.
        by_dataset: name -> [done_batches, total_batches].
        finished: the DDS had handed out and collected every shard (set by the DDS;
            the ledger alone sets it to ``complete``).
        done_entries / duplicate_entries / stale_entries / replayed_entries / abandoned_entries: counts.
        duplicate_samples: samples trained more than once (duplicate + stale + replayed).
        duplicate_batches: their batches.
        abandoned_batches: batches of leases taken from holders that may have pushed them
            (at most this many batches' updates were applied a second time; at-least-once).
        closed: dataset -> why the DDS stopped handing it out before it was done (a request,
            e.g. every worker reached ``[train] max_steps``); set by the DDS.
    """

    complete: bool = True
    problems: list[str] = field(default_factory=list)
    done_entries: int = 0
    duplicate_entries: int = 0
    stale_entries: int = 0
    replayed_entries: int = 0
    abandoned_entries: int = 0
    abandoned_batches: int = 0
    samples: int = 0
    duplicate_samples: int = 0
    duplicate_batches: int = 0
    done_batches: int = 0
    total_batches: int = 0
    by_dataset: dict[str, list[int]] = field(default_factory=dict)
    finished: bool = True
    closed: dict[str, str] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        """Covered share of the requested batches (1.0 when nothing was requested)."""
        return self.done_batches / self.total_batches if self.total_batches else 1.0

    @property
    def state(self) -> str:
        """``complete``; ``in_progress`` (the DDS still hands out shards, no problem so far);
        ``partial_by_request`` (a dataset was closed on request, e.g. the step limit); else
        ``incomplete``."""
        if self.complete:
            return "complete"
        if self.closed and self.finished:
            return "partial_by_request"
        return "in_progress" if not self.finished and not self.problems else "incomplete"

    def to_status(self, max_problems: int = 50) -> dict[str, Any]:
        """Plain data for the controller's status / the run report."""
        return {"complete": self.complete, "state": self.state, "fraction": round(self.fraction, 6),
                "done_batches": self.done_batches, "total_batches": self.total_batches,
                "by_dataset": {k: list(v) for k, v in self.by_dataset.items()}, "finished": self.finished,
                "closed": dict(self.closed),
                "problems": self.problems[:max_problems], "done_entries": self.done_entries,
                "duplicate_entries": self.duplicate_entries, "stale_entries": self.stale_entries,
                "replayed_entries": self.replayed_entries, "samples": self.samples,
                "duplicate_samples": self.duplicate_samples, "duplicate_batches": self.duplicate_batches,
                "abandoned_entries": self.abandoned_entries, "abandoned_batches": self.abandoned_batches}


class Ledger:
    """Append-only completion ledger in the controller's LMDB.

    Args:
        store: the controller's :class:`~controller.state.StateStore`.
    """

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._db = store.db("ledger")

    def append(self, txn: lmdb.Transaction, **fields: Any) -> LedgerEntry:
        """Add an entry inside ``txn`` (the transition's own transaction)."""
        seq = self._store.next_seq(txn, "ledger")
        entry = LedgerEntry(seq=seq, **fields)
        txn.put(seq_key(seq), dumps(_to_json(entry)), db=self._db)
        return entry

    def last_seq(self) -> int:
        """Sequence number of the newest entry, -1 when empty."""
        with self._store.begin() as txn:
            return self._store.next_seq(txn, "ledger") - 1

    def entries(self, since: int = 0) -> list[LedgerEntry]:
        return [e for e in self._iter() if e.seq >= since]

    def _iter(self, txn: lmdb.Transaction | None = None) -> Iterable[LedgerEntry]:
        if txn is None:
            for _, body in self._store.items("ledger"):
                yield _from_json(body)
            return
        cur = txn.cursor(self._db)
        if cur.first():
            for _, v in cur:
                yield _from_json(loads(v))

    def supersede(self, txn: lmdb.Transaction, seq: int, kind: EntryKind, **fields: Any) -> LedgerEntry | None:
        """Replace entry ``seq`` (an ``abandoned`` one) by ``kind`` with ``fields``, in place.

        Returns the new entry, or None when ``seq`` is not an ``abandoned`` entry (then
        nothing changes and the caller appends as usual).
        """
        raw = txn.get(seq_key(seq), db=self._db)
        if raw is None:
            return None
        old = _from_json(loads(raw))
        if old.kind is not EntryKind.ABANDONED:
            return None
        entry = LedgerEntry(**{**_to_json(old), **fields, "seq": seq, "kind": kind})
        txn.put(seq_key(seq), dumps(_to_json(entry)), db=self._db)
        return entry

    def mark_replayed_after(self, txn: lmdb.Transaction, seq: int) -> list[LedgerEntry]:
        """Mark live ``done`` entries newer than ``seq`` replayed; return them (pre-mark)."""
        marked = []
        cur = txn.cursor(self._db)
        if cur.set_range(seq_key(seq + 1)):
            for k, v in list(cur):
                e = _from_json(loads(v))
                if e.kind is EntryKind.DONE and not e.replayed:
                    marked.append(e)
                    txn.put(bytes(k), dumps({**_to_json(e), "replayed": True}), db=self._db)
        return marked

    def coverage(self, specs: Mapping[str, DatasetSpec], epochs: Mapping[str, int] | None = None) -> Coverage:
        """Check that live ``done`` entries tile every batch exactly once.

        Args:
            specs: datasets to check, by name; every one of their epochs is requested.
            epochs: how many epochs of each dataset to check for gaps (default: all);
                later epochs count towards ``fraction`` but a gap there is work still
                to do, not a problem. ``complete`` needs every requested epoch done.
        """
        cov = Coverage()
        ranges: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        for e in self._iter():
            cov.samples += e.samples
            if e.kind is EntryKind.DONE and not e.replayed:
                cov.done_entries += 1
                ranges.setdefault((e.dataset, e.epoch, e.file), []).append((e.start, e.stop))
                continue
            if e.kind is EntryKind.ABANDONED:
                cov.abandoned_entries += 1
                cov.abandoned_batches += e.batches
                continue
            if e.kind is EntryKind.DONE:
                cov.replayed_entries += 1
            elif e.kind is EntryKind.DUPLICATE:
                cov.duplicate_entries += 1
            else:
                cov.stale_entries += 1
            cov.duplicate_samples += e.samples
            cov.duplicate_batches += e.batches
        checked: dict[str, int] = {}
        for name, spec in specs.items():
            n_epochs = spec.epochs if epochs is None else min(spec.epochs, epochs.get(name, spec.epochs))
            checked[name] = n_epochs
            done_ds = 0
            for epoch in range(spec.epochs):  # every requested epoch counts towards the fraction
                for f, total in enumerate(spec.batches_per_file):
                    got = sorted(ranges.pop((name, epoch, f), []))
                    pos = 0
                    covered = 0
                    for start, stop in got:
                        lo, hi = max(start, pos, 0), min(stop, total)
                        covered += max(0, hi - lo)
                        if epoch < n_epochs:
                            if start > pos:
                                cov.problems.append(f"dataset {name} epoch {epoch} file {f}: batches [{pos}, {start}) never done")
                            elif start < pos:
                                cov.problems.append(f"dataset {name} epoch {epoch} file {f}: batches [{start}, {min(pos, stop)}) done more than once")
                        pos = max(pos, stop)
                    done_ds += covered
                    if epoch >= n_epochs:  # still running: gaps are work to do, not problems
                        continue
                    if pos < total:
                        cov.problems.append(f"dataset {name} epoch {epoch} file {f}: batches [{pos}, {total}) never done")
                    elif pos > total:
                        cov.problems.append(f"dataset {name} epoch {epoch} file {f}: done up to batch {pos}, file has {total}")
            cov.by_dataset[name] = [done_ds, spec.total_batches * spec.epochs]
            cov.done_batches += done_ds
            cov.total_batches += spec.total_batches * spec.epochs
        for (name, epoch, f), got in sorted(ranges.items()):
            if name in checked:  # an epoch or file the dataset does not have
                cov.problems.append(f"dataset {name} epoch {epoch} file {f}: {len(got)} completions outside the requested epochs/files")
        cov.complete = not cov.problems and cov.done_batches == cov.total_batches
        cov.finished = cov.complete
        return cov


_FIELDS = tuple(f.name for f in fields(LedgerEntry))


def _to_json(e: LedgerEntry) -> dict[str, Any]:
    # flat fields: a plain getattr per field, not asdict's recursive deep copy (the DDS's
    # hottest serialization, once per shard report); same JSON as before
    d = {name: getattr(e, name) for name in _FIELDS}
    d["kind"] = e.kind.value
    return d


def _from_json(d: dict[str, Any]) -> LedgerEntry:
    return LedgerEntry(**{**d, "kind": EntryKind(d["kind"])})


__all__ = ["Coverage", "EntryKind", "Ledger", "LedgerEntry", "key_seq"]
