"""The batch index of a Meta-IO dataset (``index.arrow``): one row per record batch.

Layout (an uncompressed Arrow IPC file, one record batch)::

    file      string  "part-00003.arrow" or "leftover-00000.arrow"
    file_no   int32   position of the file among its kind's files
    batch     int32   record batch number inside the file
    kind      string  "meta" | "plain" | "leftover"
    capacity  int32   slots per task c = S_c + Q_c (0 for plain/leftover)
    support   int32   S_c (0 for plain/leftover)
    query     int32   Q_c (0 for plain/leftover)
    task_slots int32  T: task slots in the batch (0 for plain/leftover)
    n_tasks   int32   real tasks (episodes) in the batch
    n_slots   int64   rows of the record batch (T*c, or rows_per_batch)
    n_rows    int64   real rows (mask True)
    n_support_rows, n_query_rows  int64
    padded_slots int64  n_slots - n_rows
    ids_offsets list<int64>  table j's unique ids are ids[o[j]:o[j+1]] of the
                      batch's record batch in the ``*.ids.arrow`` sidecar
    byte_offset, byte_length int64, crc32 int64      the batch's bytes in its file and
    ids_byte_offset, ids_byte_length, ids_crc32      their CRC-32 (same for the sidecar);
                      see meta_io.integrity. Absent in datasets built before
                      checksums (still readable, with a warning).

The controller hands out data shards as ``(file_no, start, stop)`` ranges of
record batches; the index lets it (and the reader) know each batch's shape
without opening the data files.

Example::

    >>> idx = BatchIndex.read("DIR/index.arrow")
    >>> idx.batches_in(0)          # record batches of part-00000.arrow
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from meta_io.layout import BatchKind
from common.errors import DataError

INDEX_SCHEMA = pa.schema(
    [
        ("file", pa.string()),
        ("file_no", pa.int32()),
        ("batch", pa.int32()),
        ("kind", pa.string()),
        ("capacity", pa.int32()),
        ("support", pa.int32()),
        ("query", pa.int32()),
        ("task_slots", pa.int32()),
        ("n_tasks", pa.int32()),
        ("n_slots", pa.int64()),
        ("n_rows", pa.int64()),
        ("n_support_rows", pa.int64()),
        ("n_query_rows", pa.int64()),
        ("padded_slots", pa.int64()),
        ("ids_offsets", pa.list_(pa.int64())),
    ]
)
CHECKSUM_COLUMNS = ("byte_offset", "byte_length", "crc32", "ids_byte_offset", "ids_byte_length", "ids_crc32")
"""Index columns of the per-batch checksums (optional: older datasets lack them)."""
INDEX_SCHEMA_WITH_CHECKSUMS = pa.schema(list(INDEX_SCHEMA) + [(n, pa.int64()) for n in CHECKSUM_COLUMNS])


@dataclass(frozen=True)
class BatchEntry:
    """One index row: the shape and content counts of one record batch."""

    file: str
    file_no: int
    batch: int
    kind: BatchKind
    capacity: int
    support: int
    query: int
    task_slots: int
    n_tasks: int
    n_slots: int
    n_rows: int
    n_support_rows: int
    n_query_rows: int
    ids_offsets: tuple[int, ...] = ()
    byte_offset: int = -1
    byte_length: int = 0
    crc32: int = -1
    ids_byte_offset: int = -1
    ids_byte_length: int = 0
    ids_crc32: int = -1

    @property
    def padded_slots(self) -> int:
        return self.n_slots - self.n_rows


class IndexBuilder:
    """Collects :class:`BatchEntry` rows (one per written record batch)."""

    def __init__(self) -> None:
        self.entries: list[BatchEntry] = []

    def add(self, entry: BatchEntry) -> None:
        self.entries.append(entry)

    def to_table(self) -> pa.Table:
        cols: dict[str, list[Any]] = {f.name: [] for f in INDEX_SCHEMA_WITH_CHECKSUMS}
        for e in self.entries:
            for name in cols:
                if name == "padded_slots":
                    cols[name].append(e.padded_slots)
                elif name == "kind":
                    cols[name].append(e.kind.value)
                elif name == "ids_offsets":
                    cols[name].append(list(e.ids_offsets))
                else:
                    cols[name].append(getattr(e, name))
        return pa.table(cols, schema=INDEX_SCHEMA_WITH_CHECKSUMS)

    def write(self, path: str | Path) -> None:
        table = self.to_table()
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)


class BatchIndex:
    """The read side of ``index.arrow``: numpy columns plus lookups.

    Args:
        table: the index table (see the module docstring for its columns).
        where: file name used in error messages.
    """

    def __init__(self, table: pa.Table, where: str = INDEX_SCHEMA.names[0]) -> None:
        missing = [n for n in INDEX_SCHEMA.names if n not in table.column_names]
        if missing:
            raise DataError(f"{where}: index is missing columns {missing}")
        self.has_checksums = all(n in table.column_names for n in CHECKSUM_COLUMNS)
        names = INDEX_SCHEMA_WITH_CHECKSUMS.names if self.has_checksums else INDEX_SCHEMA.names
        self.table = table.select(names)
        self.where = where
        self.cols: dict[str, np.ndarray] = {
            n: self.table.column(n).to_numpy(zero_copy_only=False) for n in names if n != "ids_offsets"
        }
        # every batch has len(tables)+1 offsets: a dense [batches, tables+1] matrix
        offs = self.table.column("ids_offsets").combine_chunks()
        width = (len(offs.values) // len(offs)) if len(offs) else 0
        self.ids_offsets = offs.values.to_numpy(zero_copy_only=False).reshape(len(offs), width)
        self.kind = self.cols["kind"].astype(str)
        self.file = self.cols["file"].astype(str)

    @classmethod
    def read(cls, path: str | Path) -> "BatchIndex":
        """Read ``index.arrow``; a missing or corrupt file is a DataError naming it."""
        path = Path(path)
        if not path.exists():
            raise DataError(f"{path}: index file not found (incomplete or not a Meta-IO dataset)")
        try:
            with pa.memory_map(str(path)) as src:
                table = ipc.open_file(src).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{path}: corrupt index file: {exc}") from None
        return cls(table, where=str(path))

    def __len__(self) -> int:
        return self.table.num_rows

    def rows_of(self, kind: BatchKind | str, file_no: int | None = None) -> np.ndarray:
        """Index positions of the batches of ``kind`` (optionally of one file), in order."""
        kind = BatchKind(kind).value
        sel = self.kind == kind
        if file_no is not None:
            sel &= self.cols["file_no"] == file_no
        pos = np.flatnonzero(sel)
        order = np.lexsort((self.cols["batch"][pos], self.cols["file_no"][pos]))
        return pos[order]

    def files_of(self, kind: BatchKind | str) -> list[str]:
        """File names of ``kind``, ordered by file number."""
        pos = self.rows_of(kind)
        names: dict[int, str] = {}
        for no, name in zip(self.cols["file_no"][pos].tolist(), self.file[pos].tolist()):
            names.setdefault(no, name)
        return [names[k] for k in sorted(names)]

    def entry(self, pos: int) -> BatchEntry:
        c = self.cols
        return BatchEntry(
            file=str(self.file[pos]),
            file_no=int(c["file_no"][pos]),
            batch=int(c["batch"][pos]),
            kind=BatchKind(str(self.kind[pos])),
            capacity=int(c["capacity"][pos]),
            support=int(c["support"][pos]),
            query=int(c["query"][pos]),
            task_slots=int(c["task_slots"][pos]),
            n_tasks=int(c["n_tasks"][pos]),
            n_slots=int(c["n_slots"][pos]),
            n_rows=int(c["n_rows"][pos]),
            n_support_rows=int(c["n_support_rows"][pos]),
            n_query_rows=int(c["n_query_rows"][pos]),
            ids_offsets=tuple(self.ids_offsets[pos].tolist()),
            **({n: int(c[n][pos]) for n in CHECKSUM_COLUMNS} if self.has_checksums else {}),
        )

    def sum(self, column: str, kind: BatchKind | str | None = None) -> int:
        vals = self.cols[column]
        if kind is not None:
            vals = vals[self.kind == BatchKind(kind).value]
        return int(vals.sum())
