"""Variable-size batches from a Meta-IO read stream: exactly ``n`` units per take.

The reader yields whole record batches of a fixed shape. AntDT-DD gives every
all-reduce worker its own batch size, so a worker needs ``n`` *units* per step,
where a unit is a task slot (meta layout) or a row slot (plain layout), and
``n`` changes when the controller re-balances. :class:`BatchSlicer` serves
that from a stream of data ranges (DDS leases), cutting across record-batch and
range boundaries::

    range A: |rb0 (8 units)|rb1 (8)|     range B: |rb0 (8)| ...
    take(5)  -> rb0[0:5]                          (a view: no copy)
    take(6)  -> rb0[5:8] + rb1[0:3]               (only these 6 units are copied)
    take(10) -> rb1[3:8] + B.rb0[0:5]             (range A is reported finished)

A piece inside one record batch is a strided view of the memory-mapped file
(tensor slicing along the task/row axis); only a take that spans pieces
concatenates, and it copies just the units it returns, never a whole record
batch. No per-row Python: per take there is one slice per piece and one
``torch.cat`` per tensor.

Padding slots (the last batch of a file) count as units; they carry
``mask = False`` and so no samples: the all-reduce weighs workers by samples.

Example::

    slicer = BatchSlicer(dataset, iter([(BatchRange(0, 0, 4), lease)]))
    got = slicer.take(24)
    got.batch, got.units, got.finished, got.spans
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from meta_io.prefetch import prefetch

Batch = MetaBatch | PlainBatch


class Range(Protocol):
    """A data range: record batches ``[start, stop)`` of data file ``file``."""

    file: int
    start: int
    stop: int


@dataclass(frozen=True)
class Span:
    """Units ``[lo, hi)`` of record batch ``batch`` of data file ``file`` (what a take read)."""

    file: int
    batch: int
    lo: int
    hi: int

    def to_list(self) -> list[int]:
        return [self.file, self.batch, self.lo, self.hi]


@dataclass
class Take:
    """One take: the batch (None when no unit was available), its unit count, and where it came from.

    Attributes:
        finished: tokens of the ranges whose last unit is in this take (report them done
            after the step that trains on it).
        exhausted: the range source said there is nothing more (this take may still hold units).
    """

    batch: Batch | None
    units: int
    spans: list[Span] = field(default_factory=list)
    finished: list[Any] = field(default_factory=list)
    exhausted: bool = False


def units_of(batch: Batch) -> int:
    """Task slots (meta) or row slots (plain) of a batch, padding included."""
    if isinstance(batch, MetaBatch):
        return int(batch.task_mask.shape[0])
    return int(batch.features.mask.shape[0])


def _slice_fb(fb: FeatureBatch, lo: int, hi: int) -> FeatureBatch:
    return fb.map(lambda t: t[lo:hi])


def slice_batch(batch: Batch, lo: int, hi: int, tables: dict[str, list[str]]) -> Batch:
    """Units ``[lo, hi)`` of a batch as views (no copy); unique ids are recomputed for the slice.

    Args:
        tables: table -> its id columns (``BatchConverter.tables``).
    """
    if lo == 0 and hi == units_of(batch):
        return batch
    if isinstance(batch, MetaBatch):
        sup, qry = _slice_fb(batch.support, lo, hi), _slice_fb(batch.query, lo, hi)
        return MetaBatch(support=sup, query=qry, task_keys=batch.task_keys[lo:hi],
                         task_mask=batch.task_mask[lo:hi], unique_ids=unique_ids([sup, qry], tables))
    fb = _slice_fb(batch.features, lo, hi)
    return PlainBatch(features=fb, unique_ids=unique_ids([fb], tables))


def unique_ids(fbs: list[FeatureBatch], tables: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """table -> sorted unique ids (>= 0) over every id column of that table in ``fbs``."""
    out = {}
    for table, cols in tables.items():
        flat = torch.cat([fb.ids[c].reshape(-1) for fb in fbs for c in cols])
        u = torch.unique(flat, sorted=True)
        out[table] = u[int(torch.searchsorted(u, 0)):]  # sorted: drop the -1 padding prefix
    return out


def concat_batches(parts: list[Batch]) -> Batch:
    """Concatenate batches along the task/row axis (copies exactly their units).

    Meta pieces from record batches of different size buckets (support / query
    capacity) are padded to the largest: padded slots have ``mask = False`` and id -1,
    exactly like the padding the build writes.
    """
    if len(parts) == 1:
        return parts[0]

    def cat_fb(fbs: list[FeatureBatch]) -> FeatureBatch:
        f0 = fbs[0]
        slots = max(f.mask.shape[1] for f in fbs) if f0.mask.dim() > 1 else 0

        def c(get: Any, fill: float | bool = 0) -> torch.Tensor:
            ts = [get(f) for f in fbs]
            if slots:  # meta pieces of different size buckets: pad the slot axis (masked out)
                ts = [t if t.shape[1] == slots else
                      torch.cat([t, torch.full((t.shape[0], slots - t.shape[1], *t.shape[2:]), fill, dtype=t.dtype)], 1)
                      for t in ts]
            return torch.cat(ts, dim=0)

        return FeatureBatch(
            ids={k: c(lambda f, k=k: f.ids[k], -1) for k in f0.ids},
            dense=c(lambda f: f.dense),
            vectors={k: c(lambda f, k=k: f.vectors[k]) for k in f0.vectors},
            labels={k: c(lambda f, k=k: f.labels[k]) for k in f0.labels},
            mask=c(lambda f: f.mask, False),
            scenario=c(lambda f: f.scenario),
            oracle={k: c(lambda f, k=k: f.oracle[k]) for k in f0.oracle},
        )

    def uniq(tables: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {t: torch.unique(torch.cat([u[t] for u in tables]), sorted=True) for t in tables[0]}

    if isinstance(parts[0], MetaBatch):
        metas = [p for p in parts if isinstance(p, MetaBatch)]
        return MetaBatch(support=cat_fb([p.support for p in metas]), query=cat_fb([p.query for p in metas]),
                         task_keys=torch.cat([p.task_keys for p in metas]),
                         task_mask=torch.cat([p.task_mask for p in metas]),
                         unique_ids=uniq([p.unique_ids for p in metas]))
    plains = [p for p in parts if isinstance(p, PlainBatch)]
    return PlainBatch(features=cat_fb([p.features for p in plains]), unique_ids=uniq([p.unique_ids for p in plains]))


class BatchSlicer:
    """Takes of exactly ``n`` units from a stream of data ranges (see the module docstring).

    Args:
        dataset: a :class:`~meta_io.reader.MetaIODataset`.
        ranges: a callable returning the next ``(range, token)``, or ``None`` when there is
            nothing to read right now, or raising ``StopIteration`` when there never will be
            (e.g. the DDS says DONE). ``token`` (a lease) comes back in ``Take.finished``.
        prefetch_depth: record batches read ahead per range on a background thread.
    """

    def __init__(self, dataset: Any, ranges: Any, prefetch_depth: int = 2) -> None:
        self.dataset = dataset
        self._next_range = ranges
        self._depth = prefetch_depth
        self._tables: dict[str, list[str]] = dataset.converter.tables
        self._it: Iterator[Batch] | None = None
        self._range: Any = None
        self._token: Any = None
        self._batch_no = 0
        self._cur: Batch | None = None
        self._pos = 0
        self.exhausted = False

    def _advance(self) -> bool:
        """Make ``_cur`` a record batch with units left; False when none is available now."""
        while self._cur is None or self._pos >= units_of(self._cur):
            if self._it is not None:
                nxt = next(self._it, None)
                if nxt is not None:
                    if self._cur is not None:
                        self._batch_no += 1
                    self._cur, self._pos = nxt, 0
                    continue
                self._it = None
                self._cur = None
            if self.exhausted:
                return False
            try:
                got = self._next_range()
            except StopIteration:
                self.exhausted = True
                return False
            if got is None:
                return False
            self._range, self._token = got
            self._batch_no = self._range.start
            self._cur = None
            self._it = prefetch(self.dataset.read_range(self._range.file, self._range.start, self._range.stop),
                                depth=self._depth)
        return True

    def _close(self) -> None:
        it, self._it, self._cur = self._it, None, None
        close = getattr(it, "close", None)
        if close is not None:
            close()  # stops and joins the range's prefetch thread

    def close(self) -> None:
        """Stop reading (joins the prefetch thread of the current range)."""
        self._close()

    def _range_done(self) -> bool:
        """The current piece ended its record batch and the range has no record batch after it."""
        return self._cur is not None and self._pos >= units_of(self._cur) and self._batch_no == self._range.stop - 1

    def take(self, n: int) -> Take:
        """Up to ``n`` units: exactly ``n`` unless the ranges ran out (for now, or for good).

        Args:
            n: units wanted, >= 0.
        """
        if n < 0:
            raise ValueError(f"take: n must be >= 0, got {n}")
        parts: list[Batch] = []
        spans: list[Span] = []
        finished: list[Any] = []
        got = 0
        while got < n and self._advance():
            assert self._cur is not None
            have = units_of(self._cur) - self._pos
            k = min(have, n - got)
            parts.append(slice_batch(self._cur, self._pos, self._pos + k, self._tables))
            spans.append(Span(self._range.file, self._batch_no, self._pos, self._pos + k))
            self._pos += k
            got += k
            if self._range_done():
                finished.append(self._token)
                self._close()
        batch = concat_batches(parts) if parts else None
        return Take(batch, got, spans, finished, self.exhausted and self._cur is None)
