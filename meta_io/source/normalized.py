"""The normalized form every consumer reads: :class:`SourceBatch` and its Arrow types per column kind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from meta_io.schema import LIST_KINDS, ColumnKind, ColumnSpec, Schema


@dataclass
class SourceBatch:
    """Up to ``batch_rows`` normalized rows of one input file.

    Args:
        file: the input file the rows come from.
        first_row: 0-based index of the first row within that file.
        table: the rows, typed as :func:`normalized_arrow_schema`.
    """

    file: Path
    first_row: int
    table: pa.Table

    @property
    def num_rows(self) -> int:
        return self.table.num_rows


def normalized_type(col: ColumnSpec) -> pa.DataType:
    """The Arrow type a column has after :func:`iter_source`."""
    if col.kind in (ColumnKind.SPARSE, ColumnKind.KEY, ColumnKind.TIMESTAMP):
        return pa.int64()
    if col.kind in LIST_KINDS:
        return pa.list_(pa.int64(), col.max_len)
    if col.kind == ColumnKind.VECTOR:
        return pa.list_(pa.float32(), col.dim)
    if col.kind in (ColumnKind.DENSE, ColumnKind.LABEL, ColumnKind.ORACLE):
        return pa.float32()
    return pa.string()  # extra


def normalized_arrow_schema(schema: Schema) -> pa.Schema:
    """Arrow schema of every :class:`SourceBatch` table for ``schema``.

    Example::

        >>> normalized_arrow_schema(schema).field("tags").type
        FixedSizeListType(fixed_size_list<item: int64>[4])
    """
    return pa.schema([pa.field(c.name, normalized_type(c)) for c in schema.columns])
