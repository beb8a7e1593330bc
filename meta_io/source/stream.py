"""The entry point :func:`iter_source`: check every file, then stream raw batches through the normalizers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from meta_io.schema import Schema
from meta_io.source.columns import _FileState, _normalize
from meta_io.source.files import _is_csv, _open_csv, _open_parquet, check_source
from meta_io.source.normalized import SourceBatch, normalized_arrow_schema
from common.errors import DataError, SchemaError
from common.log import kv

log = logging.getLogger(__name__)


def _raw_parquet(path: Path, names: list[str], batch_rows: int) -> Iterator[tuple[int, pa.Table]]:
    pf = _open_parquet(path)
    row = 0
    it = pf.iter_batches(batch_size=batch_rows, columns=names)
    while True:
        try:
            rb = next(it)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{path}: corrupt Parquet data after row {row}: {exc}") from None
        yield row, pa.Table.from_batches([rb])
        row += rb.num_rows


def _raw_csv(path: Path, names: list[str], batch_rows: int) -> Iterator[tuple[int, pa.Table]]:
    reader = _open_csv(path, names)
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    row = 0
    try:
        while True:
            try:
                rb = next(reader)
            except StopIteration:
                break
            except pa.ArrowException as exc:
                raise DataError(f"{path}: malformed CSV after row {row + pending_rows}: {exc}") from None
            pending.append(rb)
            pending_rows += rb.num_rows
            while pending_rows >= batch_rows:  # re-chunk CSV blocks into batch_rows
                table = pa.Table.from_batches(pending)
                yield row, table.slice(0, batch_rows)
                rest = table.slice(batch_rows)
                row += batch_rows
                pending, pending_rows = rest.to_batches(), rest.num_rows
        if pending_rows:
            yield row, pa.Table.from_batches(pending, schema=pending[0].schema)
    finally:
        reader.close()


def iter_source(
    path: str | Path, schema: Schema, batch_rows: int = 65_536, validate_schema: bool = True
) -> Iterator[SourceBatch]:
    """Stream normalized batches of a Parquet/CSV file or a folder of them.

    Every file's columns are checked before the first batch is yielded, so a
    missing or mistyped column fails before anything is written downstream.

    Args:
        path: a ``.parquet``/``.pq``/``.csv``/``.tsv`` file, or a folder of them
            (read in name order; other files are ignored).
        schema: the columns to read; undeclared columns are ignored.
        batch_rows: at most this many rows per batch (a batch never spans files).
        validate_schema: check ``schema`` as a training schema first (labels
            required); ``metaps predict`` reads a features-only view of a
            validated schema and passes False.

    Yields:
        :class:`SourceBatch` tables typed as :func:`normalized_arrow_schema`.

    Raises:
        DataError: missing input, missing column, wrong type, bad value (the
            message names the file, the column and the row), corrupt file, or
            no rows at all.

    Example::

        >>> batches = list(iter_source(data.out_dir, load_schema(data.schema_path), 1000))
        >>> batches[0].table.schema == normalized_arrow_schema(schema)
        True
    """
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    if validate_schema:
        try:
            schema.validate()
        except ValueError as exc:
            raise SchemaError(f"invalid schema: {exc}") from None
    files = check_source(path, schema)
    out_schema = normalized_arrow_schema(schema)
    names = [c.name for c in schema.columns]
    total = 0
    for f in files:
        st = _FileState(path=f, csv=_is_csv(f))
        raw = _raw_csv(f, names, batch_rows) if st.csv else _raw_parquet(f, names, batch_rows)
        rows = 0
        for first_row, table in raw:
            if table.num_rows == 0:
                continue
            yield SourceBatch(file=f, first_row=first_row, table=_normalize(table, st, schema, out_schema, first_row))
            rows += table.num_rows
        total += rows
        if st.truncated:
            log.warning("lists truncated to max_len", extra=kv(file=str(f), rows_truncated=st.truncated))
        if st.null_ids:
            log.warning("null ids read as missing (-1)", extra=kv(file=str(f), null_rows=st.null_ids))
        if rows == 0:
            log.warning("input file has no rows", extra=kv(file=str(f)))
        log.debug("source file read", extra=kv(file=str(f), rows=rows))
    if total == 0:
        raise DataError(f"{path}: the input has no rows ({len(files)} file{'s' if len(files) != 1 else ''})")
