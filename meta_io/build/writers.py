"""Rolling Arrow IPC writers: one open ``part-*``/``leftover-*`` file at a time, rolled at a size cap."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from meta_io import layout as L
from meta_io.index import BatchEntry, IndexBuilder
from meta_io.integrity import file_checksums
from meta_io.packing import Packing


class _RollingWriter:
    """Writes record batches to ``pattern``-named IPC files, rolling at a size cap.

    Next to each data file it writes the unique-ids sidecar (``*.ids.arrow``):
    one record batch per data batch, so the reader does no sort at read time.
    With ``packing`` (format 2) the numeric columns are stored as one block per
    dtype (see :mod:`meta_io.packing`); ``schema`` is the logical schema.
    """

    def __init__(
        self,
        folder: Path,
        pattern: str,
        schema: pa.Schema,
        max_bytes: int,
        index: IndexBuilder,
        tables: dict[str, list[str]],
        packing: Packing | None = None,
    ) -> None:
        self.folder = folder
        self.pattern = pattern
        self.packing = packing
        self.schema = packing.stored_schema(schema) if packing is not None else schema
        self.max_bytes = max_bytes
        self.index = index
        self.tables = tables
        self.files: list[dict[str, Any]] = []
        self._open: list[tuple[pa.NativeFile, ipc.RecordBatchFileWriter]] = []
        self._batch = 0
        # per open file: index positions of its batches, their byte ranges in the data and ids files
        self._pos: list[int] = []
        self._ranges: list[tuple[int, int]] = []
        self._ids_ranges: list[tuple[int, int]] = []

    def write_table(self, table: pa.Table, per: int, entries: list[dict[str, Any]]) -> None:
        """Write ``table`` as ``len(entries)`` record batches of ``per`` rows each."""
        n = len(entries)
        table = table.combine_chunks()
        ids = L.unique_ids_batches(table, n, self.tables)
        if self.packing is not None:  # once per emission, vectorized per column
            table = self.packing.pack(table)
        for i in range(n):
            self.write(_one_batch(table.slice(i * per, per)), dict(entries[i], ids_offsets=tuple(ids[i][1])), ids[i][0])

    def write(self, rb: pa.RecordBatch, entry: dict[str, Any], ids: pa.RecordBatch) -> None:
        if not self._open:
            name = self.pattern.format(len(self.files))
            for fname, schema in ((name, self.schema), (L.ids_file_name(name), L.IDS_SCHEMA)):
                sink = pa.OSFile(str(self.folder / fname), "wb")
                self._open.append((sink, ipc.new_file(sink, schema)))
            self.files.append({"name": name, "batches": 0, "bytes": 0, "ids": L.ids_file_name(name), "ids_bytes": 0})
            self._batch = 0
        for (sink, writer), batch, ranges in ((self._open[0], rb, self._ranges), (self._open[1], ids, self._ids_ranges)):
            start = sink.tell()
            writer.write_batch(batch)
            ranges.append((start, sink.tell() - start))
        cur = self.files[-1]
        self._pos.append(len(self.index.entries))
        self.index.add(BatchEntry(file=cur["name"], file_no=len(self.files) - 1, batch=self._batch, **entry))
        self._batch += 1
        cur["batches"] = self._batch
        if self._open[0][0].tell() >= self.max_bytes:
            self._close_file()

    def _close_file(self) -> None:
        for sink, writer in self._open:
            writer.close()
            sink.close()
        if self._open:
            cur = self.files[-1]
            cur["bytes"] = (self.folder / cur["name"]).stat().st_size
            cur["ids_bytes"] = (self.folder / cur["ids"]).stat().st_size
            self._checksum(cur)
        self._open = []

    def _checksum(self, cur: dict[str, Any]) -> None:
        """Read the closed file back: crc32 per batch into its index rows, frame crc32 into ``cur``."""
        crcs, cur["frame_crc32"] = file_checksums(self.folder / cur["name"], self._ranges)
        ids_crcs, cur["ids_frame_crc32"] = file_checksums(self.folder / cur["ids"], self._ids_ranges)
        entries = self.index.entries
        for k, pos in enumerate(self._pos):  # per record batch
            entries[pos] = dataclasses.replace(
                entries[pos], byte_offset=self._ranges[k][0], byte_length=self._ranges[k][1], crc32=crcs[k],
                ids_byte_offset=self._ids_ranges[k][0], ids_byte_length=self._ids_ranges[k][1], ids_crc32=ids_crcs[k])
        self._pos, self._ranges, self._ids_ranges = [], [], []

    def close(self) -> list[dict[str, Any]]:
        self._close_file()
        return self.files


def _one_batch(table: pa.Table) -> pa.RecordBatch:
    """The single record batch of a table (combining chunks if needed)."""
    batches = table.combine_chunks().to_batches()
    if len(batches) == 1:
        return batches[0]
    return pa.RecordBatch.from_arrays(
        [pa.concat_arrays([b.column(i) for b in batches]) for i in range(table.num_columns)], schema=table.schema
    )
