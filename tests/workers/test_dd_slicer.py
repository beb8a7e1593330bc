"""meta_io.slicer.BatchSlicer: exactly n units per take across record-batch and range boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meta_io.batch import MetaBatch
from meta_io.reader import MetaIODataset
from meta_io.slicer import BatchSlicer, units_of
from workers.data_feed import BatchRange


def _ranges(ds: MetaIODataset, per: int) -> list[BatchRange]:
    out = []
    for f in range(ds.num_files):
        for s in range(0, ds.num_batches(f), per):
            out.append(BatchRange(f, s, min(s + per, ds.num_batches(f))))
    return out


def _units(batch) -> list[tuple]:
    """Per unit (task or row): its real slots' labels and ids, padding dropped (size buckets differ).

    Each tensor is turned into lists once (a few tensor ops per unit cost ~6 CPU-s on this data).
    """
    fbs = [batch.support, batch.query] if isinstance(batch, MetaBatch) else [batch.features]
    n = len(fbs[0].mask)
    parts = []  # per feature batch: per unit, its label tuple then one id tuple per id column (sorted)
    for fb in fbs:
        masks = fb.mask.reshape(n, -1).tolist()  # [unit][slot]; a plain row is one slot
        slots = len(masks[0]) if n else 0
        cols = [fb.labels["click"].reshape(n, -1).tolist()] + [fb.ids[c].reshape(n, slots, -1).tolist()
                                                               for c in sorted(fb.ids)]
        per_unit = []
        for u in range(n):
            m = masks[u]
            key = [tuple(v for v, keep in zip(cols[0][u], m) if keep)]
            key += [tuple(x for row, keep in zip(col[u], m) if keep for x in row) for col in cols[1:]]
            per_unit.append(key)
        parts.append(per_unit)
    return [tuple(k for part in parts for k in part[u]) for u in range(n)]


def _ids(batch) -> dict[str, torch.Tensor]:
    fbs = [batch.support, batch.query] if isinstance(batch, MetaBatch) else [batch.features]
    return {k: torch.cat([fb.ids[k].reshape(-1) for fb in fbs]) for k in fbs[0].ids}


@pytest.mark.parametrize("layout", ["plain", "meta"])
def test_takes_cover_the_stream_exactly(worker_data, layout: str) -> None:
    ds = MetaIODataset(worker_data[layout])
    ranges = _ranges(ds, 3)
    queue = [(r, i) for i, r in enumerate(ranges)]

    def nxt():
        if not queue:
            raise StopIteration
        return queue.pop(0)

    whole = [b for r in ranges for b in ds.read_range(r.file, r.start, r.stop)]
    total = sum(units_of(b) for b in whole)
    slicer = BatchSlicer(ds, nxt)
    sizes = [5, 37, 1, 64, 100, 13]
    takes, finished = [], []
    k = 0
    while True:
        n = sizes[k % len(sizes)]
        t = slicer.take(n)
        k += 1
        if t.batch is None:
            assert t.units == 0 and t.exhausted
            break
        assert t.units == units_of(t.batch)
        assert t.units == n or slicer.exhausted, (t.units, n)
        assert sum(s.hi - s.lo for s in t.spans) == t.units
        # unique ids of the take are exactly those of its id columns
        for table, cols in ds.converter.tables.items():
            flat = torch.cat([_ids(t.batch)[c].reshape(-1) for c in cols])
            u = torch.unique(flat)
            assert torch.equal(t.batch.unique_ids[table], u[u >= 0]), table
        takes.append(t)
        finished += t.finished
    assert sum(t.units for t in takes) == total
    assert finished == list(range(len(ranges))), "every range reported finished once, in order"
    # the concatenation of the takes is the stream, unit for unit
    want = [u for b in whole for u in _units(b)]
    assert [u for t in takes for u in _units(t.batch)] == want
    # spans name the units they hold: rebuild the stream from the spans alone (each record batch
    # read fresh from the file once, its units listed once: many spans fall in the same batch)
    per_batch: dict[tuple[int, int], list[tuple]] = {}
    rebuilt = []
    for t in takes:
        for f, b, lo, hi in (s.to_list() for s in t.spans):
            if (f, b) not in per_batch:
                per_batch[(f, b)] = _units(next(ds.read_range(f, b, b + 1)))
            rebuilt += per_batch[(f, b)][lo:hi]
    assert rebuilt == want


def test_a_take_inside_one_record_batch_is_a_view(worker_data) -> None:
    ds = MetaIODataset(worker_data["plain"])
    rb = next(ds.read_range(0, 0, 1))
    slicer = BatchSlicer(ds, iter([(BatchRange(0, 0, 1), "lease")]).__next__)
    t = slicer.take(10)
    t2 = slicer.take(10)
    lab = t2.batch.features.labels["click"]
    base = rb.features.labels["click"]
    # same mapped memory, 10 rows in (a row of the packed float block, format 2): no copy
    assert lab.data_ptr() == base.data_ptr() + 10 * base.stride(0) * base.element_size()
    assert torch.equal(lab, base[10:20])
    slicer.close()


def test_negative_take_is_refused(worker_data: dict[str, Path]) -> None:
    ds = MetaIODataset(worker_data["plain"])
    with pytest.raises(ValueError, match="n must be >= 0"):
        BatchSlicer(ds, lambda: None).take(-1)
