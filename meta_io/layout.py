"""On-disk layout of a Meta-IO dataset: file names, bookkeeping columns, buckets.

A dataset folder after ``metaps meta-io build``::

    DIR/
      manifest.json          written LAST (its presence means "complete")
      index.arrow            one row per record batch (see meta_io.index)
      part-00000.arrow       uncompressed Arrow IPC *file* format,
      part-00001.arrow       many fixed-shape record batches each
      leftover-00000.arrow   meta layout only: rows of 1-row tasks, plain format
      part-00000.ids.arrow   per data file: the sorted unique ids (>= 0) of every
                             id table, one record batch per data batch, tables
                             concatenated (boundaries in the index's ids_offsets;
                             computed offline so the reader does no sort)

Columns of a record batch: every normalized schema column (see
``meta_io.source.normalized_arrow_schema``), then the bookkeeping columns
below. A meta record batch of bucket ``c = S_c + Q_c`` holds ``T`` task slots,
task-major, support slots first (one row per slot)::

    row:       0 .. S_c-1 | S_c .. c-1 | c .. 2c-1 | ...
    __task:    0   ...  0 | 0  ...   0 | 1  ...  1 | ...
    __slot:    0 .. S_c-1 | S_c .. c-1 | 0  .. c-1 | ...
    __is_query F   ...  F | T  ...   T | ...
    __mask:    T T T F F  | T T F      | ...          (False on padding slots)

so a column reshapes to ``[T, c, ...]`` with no copy and splits into
``support = [:, :S_c]`` and ``query = [:, S_c:]``. A plain record batch holds
``rows_per_batch`` shuffled rows plus ``__mask`` (False on the padding rows of
the very last batch).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from meta_io.schema import PAD_ID, Schema

FORMAT_VERSION = 2
"""2: numeric columns packed into one block per dtype (meta_io.packing); the reader also reads 1."""

MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.arrow"
PART_PATTERN = "part-{:05d}.arrow"
LEFTOVER_PATTERN = "leftover-{:05d}.arrow"
STAGING_PREFIX = ".build-"
IDS_SUFFIX = ".ids.arrow"

TASK_COL = "__task"
SLOT_COL = "__slot"
IS_QUERY_COL = "__is_query"
MASK_COL = "__mask"
TASK_KEY_COL = "__task_key"
ROW_COL = "__row"
"""Global input row number; lives in spill files only (deterministic tie-break)."""

META_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    (TASK_COL, pa.int32()),
    (SLOT_COL, pa.int32()),
    (IS_QUERY_COL, pa.bool_()),
    (MASK_COL, pa.bool_()),
    (TASK_KEY_COL, pa.int64()),
)
PLAIN_COLUMNS: tuple[tuple[str, pa.DataType], ...] = ((MASK_COL, pa.bool_()),)


class Layout(str, enum.Enum):
    """How rows are packed into record batches."""

    META = "meta"
    PLAIN = "plain"


class Split(str, enum.Enum):
    """How a task's rows are ordered before the support/query cut."""

    TIME = "time"
    RANDOM = "random"


class BatchKind(str, enum.Enum):
    """What one record batch (one index row) holds."""

    META = "meta"
    PLAIN = "plain"
    LEFTOVER = "leftover"


@dataclass(frozen=True)
class Bucket:
    """One episode size class: ``support`` + ``query`` slots per task.

    Args:
        level: 0 for the full size ``S+Q``, each level halves it.
        support: support slots ``S_c`` per task.
        query: query slots ``Q_c`` per task.

    Example::

        >>> [b.capacity for b in make_buckets(8, 4)]
        [12, 6, 3, 2]
    """

    level: int
    support: int
    query: int

    @property
    def capacity(self) -> int:
        return self.support + self.query

    def tasks_per_batch(self, rows_per_batch: int) -> int:
        """Task slots ``T`` of one record batch (at least 1)."""
        return max(1, rows_per_batch // self.capacity)

    def slots_per_batch(self, rows_per_batch: int) -> int:
        return self.tasks_per_batch(rows_per_batch) * self.capacity


def make_buckets(support: int, query: int, bucketing: bool = True) -> list[Bucket]:
    """Power-of-two size buckets, largest first.

    Level ``k`` has ``S_k = max(1, ceil(S / 2^k))`` and ``Q_k = max(1, ceil(Q / 2^k))``;
    levels stop at ``S_k = Q_k = 1`` (capacity 2). With ``bucketing=False`` only
    level 0 (every episode padded to ``S+Q``).
    """
    if support < 1 or query < 1:
        raise ValueError(f"support and query must be >= 1, got {support}, {query}")
    out = [Bucket(0, support, query)]
    k = 1
    while bucketing and (out[-1].support > 1 or out[-1].query > 1):
        s = max(1, math.ceil(support / 2**k))
        q = max(1, math.ceil(query / 2**k))
        if (s, q) != (out[-1].support, out[-1].query):
            out.append(Bucket(len(out), s, q))
        k += 1
    return out


def meta_arrow_schema(data: pa.Schema) -> pa.Schema:
    """Schema of a meta record batch: the data columns plus bookkeeping."""
    return pa.schema(list(data) + [pa.field(n, t, nullable=False) for n, t in META_COLUMNS])


def plain_arrow_schema(data: pa.Schema) -> pa.Schema:
    """Schema of a plain (or leftover) record batch: the data columns plus ``__mask``."""
    return pa.schema(list(data) + [pa.field(n, t, nullable=False) for n, t in PLAIN_COLUMNS])


def _pad_value(tp: pa.DataType) -> pa.Array:
    """A one-element array holding the padding value of ``tp``."""
    if pa.types.is_fixed_size_list(tp):
        inner = _pad_value(tp.value_type)
        values = pa.concat_arrays([inner] * tp.list_size)
        return pa.FixedSizeListArray.from_arrays(values, type=tp)
    if pa.types.is_integer(tp):
        return pa.array([PAD_ID if pa.types.is_signed_integer(tp) else 0], type=tp)
    if pa.types.is_floating(tp):
        return pa.array([0.0], type=tp)
    if pa.types.is_boolean(tp):
        return pa.array([False], type=tp)
    return pa.nulls(1, type=tp)  # extra columns of other types: carried as null


def pad_row(data: pa.Schema) -> pa.Table:
    """One row of padding values (ids -1, floats 0, flags False) for ``data``.

    Padding slots are filled by ``take``-ing this row, so fixed-width columns
    never get a validity bitmap (and stay zero-copy convertible).
    """
    return pa.table([_pad_value(f.type) for f in data], schema=data)


def row_bytes(data: pa.Schema) -> int:
    """Bytes per row of the fixed-width columns of ``data`` (estimate for others)."""
    total = 0
    for f in data:
        tp, n = f.type, 1
        if pa.types.is_fixed_size_list(tp):
            tp, n = tp.value_type, tp.list_size
        try:
            total += n * max(1, tp.bit_width // 8)
        except ValueError:  # variable width: a guess, refined from real batches
            total += 32
    return total


def ids_file_name(data_file: str) -> str:
    """The unique-ids sidecar of a data file: ``part-00003.arrow`` -> ``part-00003.ids.arrow``."""
    return data_file[: -len(".arrow")] + IDS_SUFFIX


def id_tables(schema: Schema) -> dict[str, list[str]]:
    """Embedding table -> its id columns, in schema order."""
    out: dict[str, list[str]] = {}
    for c in schema.id_columns:
        out.setdefault(c.table_name, []).append(c.name)
    return out


def _id_values(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
    return arr.to_numpy(zero_copy_only=False)


IDS_SCHEMA = pa.schema([pa.field("ids", pa.int64(), nullable=False)])
"""Sidecar record batch: every table's sorted unique ids, concatenated in table
order; the per-table boundaries are the index's ``ids_offsets`` column."""


def unique_ids_batches(
    table: pa.Table, n_batches: int, tables: dict[str, list[str]]
) -> list[tuple[pa.RecordBatch, list[int]]]:
    """Sidecar record batches (and table boundaries) for ``table`` cut into ``n_batches`` equal batches.

    Vectorized over batches: per table one row-wise sort of an
    ``[n_batches, ids per batch]`` matrix, then a compare with the left
    neighbour drops duplicates and the -1 padding.

    Returns:
        per batch: (record batch with one ``ids`` column, offsets of length
        ``len(tables) + 1``: table ``j`` is ``ids[offsets[j]:offsets[j+1]]``).
    """
    vals, counts = [], []
    for cols in tables.values():
        mat = np.concatenate(
            [np.asarray(_id_values(table.column(c))).reshape(n_batches, -1) for c in cols], axis=1
        ).astype(np.int64, copy=False)
        srt = np.sort(mat, axis=1)
        keep = srt >= 0
        keep[:, 1:] &= srt[:, 1:] != srt[:, :-1]
        counts.append(keep.sum(1))
        vals.append((srt, keep))
    counts_m = np.stack(counts, axis=1) if counts else np.zeros((n_batches, 0), np.int64)  # [batches, tables]
    offsets = np.zeros((n_batches, len(tables) + 1), dtype=np.int64)
    np.cumsum(counts_m, axis=1, out=offsets[:, 1:])
    # batch-major, then table order: interleave the per-table kept values
    pieces = [srt[keep] for srt, keep in vals]
    starts = [np.concatenate([[0], np.cumsum(c)]) for c in counts]
    out = []
    for i in range(n_batches):  # per batch (not per row): slices of the kept values
        ids = np.concatenate([p[st[i] : st[i + 1]] for p, st in zip(pieces, starts)]) if pieces else np.empty(0, np.int64)
        out.append((pa.RecordBatch.from_arrays([pa.array(ids, pa.int64())], schema=IDS_SCHEMA), offsets[i].tolist()))
    return out
