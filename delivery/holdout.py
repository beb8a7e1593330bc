"""The gate's holdout, read once per delivery and shared by everything that scores it.

One delivery scores its holdout up to three times: the staged bundle's AUC, the published
bundle's AUC (when its manifest has no figure for the same rows) and the adaptation choice's
first-k episodes (:mod:`delivery.adapt_select`). :class:`Holdout` reads the data the first
time a consumer asks for rows and keeps what it read, so later consumers read nothing::

    Parquet/CSV   iter_source(batch_rows) -> normalized tables (kept)
                      |-- feature_batches(): the tables' rows in batch_rows batches (the AUC)
                      '-- first_k(k, ...): the tables concatenated -> meta_io.firstk episodes
    Meta-IO dir   the dataset's batches as read (kept)
                      |-- feature_batches(): support and query halves, then leftover rows
                      '-- episodes: its meta batches

A consumer that stops early (``holdout_rows``) leaves the rest unread until another consumer
needs it. Memory: the rows read so far (first-k needs every row: it orders each user's rows
by time), as :func:`meta_io.firstk.read_table` held them before.

Example::

    h = Holdout("holdout.parquet", served.schema)
    auc, rows = evaluate(served, h)                       # reads the file
    protocol, episodes = validation_episodes(h, served.schema, k=8)   # reads nothing
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from delivery.bundle import DeliveryError
from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from meta_io.schema import Schema


class Holdout:
    """A holdout (Parquet/CSV file or folder, or a Meta-IO dataset dir) read at most once.

    Args:
        path: the holdout.
        schema: the bundle's schema (Parquet/CSV rows are read and normalized with it).
        batch_rows: rows per feature batch (and per source read) of Parquet/CSV.

    Raises:
        DeliveryError: the path does not exist.
    """

    def __init__(self, path: str | Path, schema: Schema, batch_rows: int = 4096) -> None:
        from meta_io.layout import INDEX_NAME, MANIFEST_NAME

        p = Path(path)
        if not p.exists():
            raise DeliveryError(f"{p}: holdout not found")
        self.path = p
        self.schema = schema
        self.batch_rows = batch_rows
        self.is_meta_io = p.is_dir() and (p / MANIFEST_NAME).is_file() and (p / INDEX_NAME).is_file()
        self._dataset: Any = None
        self._source: Iterator[Any] | None = None
        self._read: list[Any] = []
        self._complete = False
        self._table: pa.Table | None = None

    def __str__(self) -> str:
        return str(self.path)

    # -- reading (once) ---------------------------------------------------------------
    def dataset(self) -> Any:
        """The Meta-IO dataset (:class:`meta_io.reader.MetaIODataset`; a Meta-IO holdout only)."""
        if self._dataset is None:
            from meta_io.reader import MetaIODataset

            self._dataset = MetaIODataset(self.path)
        return self._dataset

    def _open(self) -> Iterator[Any]:
        if self.is_meta_io:
            ds = self.dataset()
            yield from ds.iter_all()
            yield from ds.leftover()
            return
        from meta_io.source import iter_source

        for sb in iter_source(self.path, self.schema, self.batch_rows):
            yield sb.table

    def _items(self) -> Iterator[Any]:
        """What was read so far, then read on (each item is read from the source once)."""
        i = 0
        while True:
            if i < len(self._read):
                yield self._read[i]
                i += 1
                continue
            if self._complete:
                return
            if self._source is None:
                self._source = self._open()
            try:
                item = next(self._source)
            except StopIteration:
                self._complete = True
                return
            self._read.append(item)

    # -- views --------------------------------------------------------------------------
    def feature_batches(self) -> Iterator[FeatureBatch]:
        """Every real row as feature batches (what the gate's AUC scores; as :func:`delivery.gate.holdout_batches`)."""
        if self.is_meta_io:
            for b in self._items():
                if isinstance(b, MetaBatch):
                    yield b.support
                    yield b.query
                else:
                    yield b.features
            return
        from meta_io.layout import MASK_COL
        from meta_io.reader import BatchConverter

        conv = BatchConverter(self.schema)
        for tab in self._items():
            tab = tab.append_column(MASK_COL, pa.array(np.ones(tab.num_rows, dtype=bool)))
            for rb in tab.to_batches(max_chunksize=self.batch_rows):
                yield conv.plain(rb).features

    def meta_batches(self) -> Iterator[MetaBatch]:
        """A Meta-IO holdout's meta batches (its episodes), in file then batch order."""
        for b in self._items():
            if isinstance(b, PlainBatch):  # the leftover rows come after every meta batch
                return
            if isinstance(b, MetaBatch):
                yield b

    def table(self) -> pa.Table:
        """Every row of a Parquet/CSV holdout, normalized, in input order (:func:`meta_io.firstk.read_table`)."""
        if self._table is None:
            parts = list(self._items())
            self._table = pa.concat_tables(parts).combine_chunks() if parts else pa.table({})
        return self._table
