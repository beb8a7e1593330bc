"""Pass 1: stream the input, check it, and partition rows by ``hash(task_key) % P`` into spill files.

Progress: ``on_rows(done, total)`` after each source batch, rows read so far out of the
input's rows as :func:`meta_io.source.count_rows` gives them before reading (Parquet
footers; a CSV's one-column scan); the last call is ``(rows, rows)``. The callback only
gets numbers: the caller decides how (and whether) to show them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from meta_io import layout as L
from meta_io.build.config import MetaIOBuildConfig
from meta_io.layout import Layout, Split
from meta_io.schema import Schema
from common.errors import DataError
from common.hashing import mix64
from common.log import kv

log = logging.getLogger(__name__)


_WORKING_SET_FACTOR = 4.0
"""Pass 2 holds a partition, its sorted copy and the padded output at once."""


def _conform(table: pa.Table, data_schema: pa.Schema, where: str) -> pa.Table:
    """Select and check the normalized columns (guards the iter_source contract)."""
    missing = [n for n in data_schema.names if n not in table.column_names]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing} (expected {data_schema.names})")
    table = table.select(data_schema.names)
    for f in data_schema:
        got = table.schema.field(f.name).type
        if got != f.type:
            raise DataError(f"{where}: column '{f.name}': expected type {f.type}, got {got}")
    return table


def _check_no_nulls(table: pa.Table, column: str, where: str, first_row: int, what: str) -> None:
    col = table.column(column)
    if col.null_count:
        bad = int(np.argmax(pc.is_null(col).to_numpy(zero_copy_only=False)))
        raise DataError(f"{where}: column '{column}' ({what}) is null at row {first_row + bad}")


@dataclass
class _Spill:
    paths: list[Path]
    input_rows: int
    bytes_per_row: float
    seconds: float


def _pass1(
    input_path: Path,
    schema: Schema,
    data_schema: pa.Schema,
    cfg: MetaIOBuildConfig,
    key: str,
    spill_dir: Path,
    on_rows: Callable[[int, int], None] | None = None,
) -> _Spill:
    """Partition the input into spill files.

    Args:
        input_path: the input file or folder.
        schema: its schema.
        data_schema: the normalized Arrow schema of the rows.
        cfg: the build config (partitions, memory budget, seed, layout, split).
        key: the task key column.
        spill_dir: where the spill files go.
        on_rows: told ``(rows read so far, input rows)`` after each batch (None: nothing told).
    """
    from meta_io import source

    t0 = time.perf_counter()
    it = iter(source.iter_source(input_path, schema, cfg.source_batch_rows))
    first = next(it, None)
    if first is None:
        raise DataError(f"{input_path}: input has no rows")
    est_rows = int(source.count_rows(input_path, schema))
    bytes_per_row = max(float(L.row_bytes(data_schema)), first.table.nbytes / max(1, first.table.num_rows)) + 8
    budget = cfg.memory_budget_mb * 2**20
    if cfg.partitions:
        P = cfg.partitions
    else:
        P = int(min(cfg.max_partitions, max(1, math.ceil(est_rows * bytes_per_row * _WORKING_SET_FACTOR / budget))))
    log.info("pass 1: partitioning", extra=kv(input=input_path, est_rows=est_rows, partitions=P,
                                               bytes_per_row=round(bytes_per_row)))
    if on_rows is not None:
        on_rows(0, est_rows)
    spill_schema = data_schema.append(pa.field(L.ROW_COL, pa.int64(), nullable=False))
    paths = [spill_dir / f"spill-{p:05d}.arrow" for p in range(P)]
    sinks: list[tuple[pa.NativeFile, ipc.RecordBatchFileWriter] | None] = [None] * P
    row0 = 0
    time_split = cfg.layout == Layout.META and cfg.split == Split.TIME
    try:
        for sb in _chain(first, it):
            where = f"{sb.file}"
            table = _conform(sb.table, data_schema, where)
            n = table.num_rows
            if n == 0:
                continue
            rows = np.arange(row0, row0 + n, dtype=np.int64)
            row0 += n
            if cfg.layout == Layout.META:
                _check_no_nulls(table, key, where, sb.first_row, "task key")
                if time_split:
                    _check_no_nulls(table, schema.timestamp, where, sb.first_row, "timestamp")
                h = mix64(table.column(key).to_numpy(zero_copy_only=False), cfg.seed)
            else:
                h = mix64(rows, cfg.seed)
            part = (h % np.uint64(P)).astype(np.int64)
            table = table.append_column(spill_schema.field(L.ROW_COL), pa.array(rows))
            counts = np.bincount(part, minlength=P)
            if P > 1:
                table = table.take(pa.array(np.argsort(part, kind="stable")))
            off = 0
            for p in np.flatnonzero(counts).tolist():
                entry = sinks[p]
                if entry is None:
                    sink = pa.OSFile(str(paths[p]), "wb")
                    entry = (sink, ipc.new_file(sink, spill_schema))
                    sinks[p] = entry
                entry[1].write_table(table.slice(off, int(counts[p])))
                off += int(counts[p])
            if on_rows is not None:
                on_rows(row0, max(est_rows, row0))
    finally:
        for s in sinks:
            if s is not None:
                s[1].close()
                s[0].close()
    if row0 == 0:
        raise DataError(f"{input_path}: input has no rows")
    if on_rows is not None:
        on_rows(row0, row0)
    dt = time.perf_counter() - t0
    log.info("pass 1 done", extra=kv(rows=row0, seconds=round(dt, 2), rows_per_s=int(row0 / max(dt, 1e-9))))
    return _Spill([p for p, s in zip(paths, sinks) if s is not None], row0, bytes_per_row, dt)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def _read_spill(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return ipc.open_file(src).read_all()
