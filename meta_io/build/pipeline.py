"""Offline Meta-IO build: group rows by task, split support/query, pack fixed shapes.

``metaps meta-io build`` turns training logs (anything :func:`meta_io.source.iter_source`
reads) into a folder of uncompressed Arrow IPC files whose record batches are
whole tasks of a fixed shape, plus ``index.arrow`` and ``manifest.json`` (see
:mod:`meta_io.layout`). Training then reads tasks with no grouping or shuffling.

Two passes, out of core (input may be larger than memory)::

    pass 1  iter_source --> hash(task_key) % P --> P spill files (Arrow IPC, uncompressed)
    pass 2  for each spill file (fits the memory budget):
              one lexsort by (hash(task_key), timestamp | seeded random, input row)
              one take
              task boundaries (np.diff), episodes, slots, buckets  (numpy arithmetic)
              one take per bucket scatters rows into fixed-shape slots
            --> part-*.arrow, leftover-*.arrow (+ index rows)

Episode rule (documented in docs/design/meta_io.md and tested): a task with
``n >= 2`` rows (in split order) is cut into ``E = ceil(n / (S+Q))`` episodes;
row ``r`` goes to episode ``r*E // n``. An episode of ``n_e`` rows gets
``n_q = clamp(floor(n_e*Q/(S+Q) + 1/2), 1, n_e-1)`` query rows (its last rows)
and ``n_s = n_e - n_q`` support rows, so ``n_s <= S`` and ``n_q <= Q``. A task
with one row goes to the leftover (plain-format) files. No row is dropped.

Example::

    cfg = MetaIOBuildConfig(support=8, query=4, split=Split.TIME)
    result = build("data/", "data/schema.json", "metaio/", cfg)
    result.manifest["totals"]["episodes"]
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from meta_io import layout as L
from meta_io.index import BatchEntry, IndexBuilder
from meta_io.integrity import MANIFEST_VALUE as CHECKSUMS_MANIFEST
from meta_io.integrity import file_checksums
from meta_io.layout import BatchKind, Bucket, Layout, Split
from meta_io.schema import Schema, load_schema
from metaps.atomic_write import write_json_atomic
from metaps.config import to_dict
from metaps.errors import ConfigError, DataError, SchemaError
from metaps.hashing import mix64
from metaps.log import kv

log = logging.getLogger(__name__)

_RANDOM_SPLIT_SALT = 0x5EED_5B11_7000_0001
_PLAIN_SHUFFLE_SALT = 0x5EED_5B11_7000_0002
_WORKING_SET_FACTOR = 4.0
"""Pass 2 holds a partition, its sorted copy and the padded output at once."""


@dataclass(frozen=True)
class MetaIOBuildConfig:
    """How ``metaps meta-io build`` lays data out.

    Args:
        layout: ``meta`` (tasks with support/query) or ``plain`` (shuffled rows).
        support: support slots S per task episode (largest bucket).
        query: query slots Q per task episode (largest bucket).
        split: ``time`` (support precedes query in time) or ``random`` (seeded).
        seed: seeds the task order, the random split and the plain shuffle.
        task_key: grouping column ('' = the schema's ``task_key``).
        rows_per_batch: slots per record batch (meta: T = rows_per_batch // c
            tasks of bucket capacity c; plain: rows per batch).
        bucketing: use power-of-two size buckets (False: pad every episode to S+Q).
        memory_budget_mb: pass 2 keeps one partition of about this size in memory.
        partitions: spill partitions (0 = from the budget and the input size).
        max_partitions: cap on automatic partitions (open files in pass 1).
        max_file_mb: start a new part file after this many MiB.
        source_batch_rows: rows per batch requested from ``iter_source``.
        overwrite: replace a dataset already in the output folder.

    Example::

        >>> MetaIOBuildConfig(support=8, query=4, rows_per_batch=768).validate()
    """

    layout: Layout = Layout.META
    support: int = 8
    query: int = 4
    split: Split = Split.TIME
    seed: int = 0
    task_key: str = ""
    rows_per_batch: int = 768
    bucketing: bool = True
    memory_budget_mb: float = 512.0
    partitions: int = 0
    max_partitions: int = 256
    max_file_mb: float = 64.0
    source_batch_rows: int = 65_536
    overwrite: bool = False

    def validate(self) -> None:
        if self.support < 1 or self.query < 1:
            raise ValueError(f"support and query must be >= 1, got support={self.support} query={self.query}")
        if self.layout == Layout.META and self.rows_per_batch < self.support + self.query:
            raise ValueError(
                f"rows_per_batch must be >= support+query={self.support + self.query}, got {self.rows_per_batch}"
            )
        if self.rows_per_batch < 1:
            raise ValueError(f"rows_per_batch must be >= 1, got {self.rows_per_batch}")
        if not self.memory_budget_mb > 0:
            raise ValueError(f"memory_budget_mb must be > 0, got {self.memory_budget_mb}")
        if self.partitions < 0:
            raise ValueError(f"partitions must be >= 0 (0 = automatic), got {self.partitions}")
        if not 1 <= self.max_partitions <= 4096:
            raise ValueError(f"max_partitions must be in [1, 4096], got {self.max_partitions}")
        if not self.max_file_mb > 0:
            raise ValueError(f"max_file_mb must be > 0, got {self.max_file_mb}")
        if self.source_batch_rows < 1:
            raise ValueError(f"source_batch_rows must be >= 1, got {self.source_batch_rows}")


@dataclass(frozen=True)
class BuildResult:
    """What a build wrote: the dataset folder and its manifest (as written)."""

    out_dir: Path
    manifest: dict[str, Any]


# --------------------------------------------------------------------------- episodes


@dataclass(frozen=True)
class EpisodePlan:
    """Where every row of a run of whole tasks goes (rows task-major, split order).

    Per row (length N): ``episode``, ``pos`` (position in its episode),
    ``is_query``, ``slot`` (slot within its bucket's task layout).
    Per episode (length E): ``task``, ``n_rows``, ``n_support``, ``n_query``, ``level``
    (index into the bucket list).
    """

    episode: np.ndarray
    pos: np.ndarray
    is_query: np.ndarray
    slot: np.ndarray
    task: np.ndarray
    n_rows: np.ndarray
    n_support: np.ndarray
    n_query: np.ndarray
    level: np.ndarray


def plan_episodes(task_rows: np.ndarray, support: int, query: int, buckets: list[Bucket]) -> EpisodePlan:
    """Apply the episode rule to tasks of ``task_rows`` rows each (all >= 2).

    Vectorized: no loop over rows or tasks (only over the few buckets).

    Args:
        task_rows: int array, rows per task, tasks in output order.
        support: S. query: Q. buckets: from :func:`meta_io.layout.make_buckets`.

    Example::

        >>> p = plan_episodes(np.array([5, 13]), 8, 4, make_buckets(8, 4))
        >>> p.n_rows.tolist(), p.n_query.tolist()
        ([5, 6, 7], [2, 2, 2])
    """
    n = np.asarray(task_rows, dtype=np.int64)
    if n.size and int(n.min()) < 2:
        raise ValueError("plan_episodes needs tasks of >= 2 rows (1-row tasks are leftover)")
    width = support + query
    n_tasks = n.size
    total = int(n.sum())
    episodes_per_task = -(-n // width)
    task_of_row = np.repeat(np.arange(n_tasks, dtype=np.int64), n)
    task_first_row = np.cumsum(n) - n
    r = np.arange(total, dtype=np.int64) - task_first_row[task_of_row]
    ep_in_task = r * episodes_per_task[task_of_row] // n[task_of_row]
    first_ep = np.cumsum(episodes_per_task) - episodes_per_task
    episode = first_ep[task_of_row] + ep_in_task
    n_eps = int(episodes_per_task.sum())
    n_e = np.bincount(episode, minlength=n_eps).astype(np.int64)
    # round half up, in integers: floor(n_e*Q/(S+Q) + 1/2)
    n_q = np.clip((2 * n_e * query + width) // (2 * width), 1, n_e - 1)
    n_s = n_e - n_q
    ep_first_row = np.cumsum(n_e) - n_e
    pos = np.arange(total, dtype=np.int64) - ep_first_row[episode]
    is_query = pos >= n_s[episode]
    # smallest bucket that fits: buckets shrink monotonically, so count the fits
    fits = np.zeros(n_eps, dtype=np.int64)
    for b in buckets:
        fits += (n_s <= b.support) & (n_q <= b.query)
    level = fits - 1
    bucket_support = np.array([b.support for b in buckets], dtype=np.int64)
    row_level = level[episode]
    slot = np.where(is_query, bucket_support[row_level] + pos - n_s[episode], pos)
    return EpisodePlan(
        episode=episode,
        pos=pos,
        is_query=is_query,
        slot=slot,
        task=np.repeat(np.arange(n_tasks, dtype=np.int64), episodes_per_task),
        n_rows=n_e,
        n_support=n_s,
        n_query=n_q,
        level=level,
    )


# --------------------------------------------------------------------------- writers


class _RollingWriter:
    """Writes record batches to ``pattern``-named IPC files, rolling at a size cap.

    Next to each data file it writes the unique-ids sidecar (``*.ids.arrow``):
    one record batch per data batch, so the reader does no sort at read time.
    """

    def __init__(
        self,
        folder: Path,
        pattern: str,
        schema: pa.Schema,
        max_bytes: int,
        index: IndexBuilder,
        tables: dict[str, list[str]],
    ) -> None:
        self.folder = folder
        self.pattern = pattern
        self.schema = schema
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


class _BucketPacker:
    """Accumulates episodes of one bucket and emits full fixed-shape batches.

    Episodes left over after a partition (fewer than T) wait for the next one;
    :meth:`flush` pads the very last batch with empty task slots.
    """

    def __init__(self, bucket: Bucket, rows_per_batch: int, data_schema: pa.Schema, out: _RollingWriter) -> None:
        self.bucket = bucket
        self.T = bucket.tasks_per_batch(rows_per_batch)
        self.c = bucket.capacity
        self.data_schema = data_schema
        self.pad = L.pad_row(data_schema)
        self.out = out
        self._empty()
        self.batches = self.episodes = self.rows = 0

    def _empty(self) -> None:
        self.p_table = self.pad.slice(0, 0)
        self.p_slot = np.empty(0, np.int64)
        self.p_ord = np.empty(0, np.int64)
        self.p_keys = np.empty(0, np.int64)

    def add(self, table: pa.Table, slot: np.ndarray, ep_ord: np.ndarray, ep_keys: np.ndarray) -> None:
        """Add rows (``ep_ord`` = episode ordinal 0.. within this call) of ``len(ep_keys)`` episodes."""
        base = self.p_keys.size
        self.p_table = pa.concat_tables([self.p_table, table])
        self.p_slot = np.concatenate([self.p_slot, slot])
        self.p_ord = np.concatenate([self.p_ord, ep_ord + base])
        self.p_keys = np.concatenate([self.p_keys, ep_keys])
        full = self.p_keys.size // self.T
        if full:
            self._emit(full)

    def flush(self) -> None:
        if self.p_keys.size:
            self._emit(1)

    def _emit(self, n_batches: int) -> None:
        T, c, S = self.T, self.c, self.bucket.support
        n_eps = min(self.p_keys.size, n_batches * T)
        take_rows = self.p_ord < n_eps
        n_take = int(take_rows.sum())
        # rows are episode-ordered, so the emitted ones are a prefix
        rows = self.p_table.slice(0, n_take)
        slots = n_batches * T * c
        src = np.full(slots, n_take, dtype=np.int64)  # n_take = the pad row
        src[self.p_ord[:n_take] * c + self.p_slot[:n_take]] = np.arange(n_take, dtype=np.int64)
        data = pa.concat_tables([rows, self.pad]).take(pa.array(src))
        slot_ids = np.arange(slots, dtype=np.int64)
        in_task = slot_ids % c
        mask = src != n_take
        is_query = in_task >= S
        keys = np.full(n_batches * T, -1, dtype=np.int64)
        keys[:n_eps] = self.p_keys[:n_eps]
        full = data
        for name, arr in (
            (L.TASK_COL, ((slot_ids // c) % T).astype(np.int32)),
            (L.SLOT_COL, in_task.astype(np.int32)),
            (L.IS_QUERY_COL, is_query),
            (L.MASK_COL, mask),
            (L.TASK_KEY_COL, np.repeat(keys, c)),
        ):
            full = full.append_column(pa.field(name, pa.from_numpy_dtype(arr.dtype), nullable=False), pa.array(arr))
        per = T * c
        m = mask.reshape(n_batches, per)
        q = is_query.reshape(n_batches, per)
        n_rows = m.sum(1)
        n_query = (m & q).sum(1)
        n_tasks = np.bincount(np.arange(n_eps) // T, minlength=n_batches)
        entries = [
            dict(
                kind=BatchKind.META,
                capacity=c,
                support=S,
                query=self.bucket.query,
                task_slots=T,
                n_tasks=int(n_tasks[i]),
                n_slots=per,
                n_rows=int(n_rows[i]),
                n_support_rows=int(n_rows[i] - n_query[i]),
                n_query_rows=int(n_query[i]),
            )
            for i in range(n_batches)
        ]
        self.out.write_table(full, per, entries)
        self.batches += n_batches
        self.episodes += n_eps
        self.rows += n_take
        self.p_table = self.p_table.slice(n_take)
        self.p_slot = self.p_slot[n_take:]
        self.p_ord = self.p_ord[n_take:] - n_eps
        self.p_keys = self.p_keys[n_eps:]


class _PlainPacker:
    """Accumulates rows and emits fixed-size plain batches (the last one padded)."""

    def __init__(self, rows_per_batch: int, data_schema: pa.Schema, out: _RollingWriter, kind: BatchKind) -> None:
        self.B = rows_per_batch
        self.pad = L.pad_row(data_schema)
        self.out = out
        self.kind = kind
        self.pending = self.pad.slice(0, 0)
        self.batches = self.rows = 0

    def add(self, table: pa.Table) -> None:
        self.pending = pa.concat_tables([self.pending, table])
        full = self.pending.num_rows // self.B
        if full:
            self._emit(self.pending.slice(0, full * self.B), full * self.B)
            self.pending = self.pending.slice(full * self.B)

    def flush(self) -> None:
        n = self.pending.num_rows
        if n:
            src = np.full(self.B, n, dtype=np.int64)
            src[:n] = np.arange(n)
            self._emit(pa.concat_tables([self.pending, self.pad]).take(pa.array(src)), n)
            self.pending = self.pad.slice(0, 0)

    def _emit(self, table: pa.Table, n_real: int) -> None:
        mask = np.arange(table.num_rows) < n_real
        table = table.append_column(pa.field(L.MASK_COL, pa.bool_(), nullable=False), pa.array(mask))
        n = table.num_rows // self.B
        real = mask.reshape(n, self.B).sum(1)
        entries = [
            dict(kind=self.kind, capacity=0, support=0, query=0, task_slots=0, n_tasks=0,
                 n_slots=self.B, n_rows=int(real[i]), n_support_rows=0, n_query_rows=0)
            for i in range(n)
        ]
        self.out.write_table(table, self.B, entries)
        self.batches += n
        self.rows += n_real


# --------------------------------------------------------------------------- passes


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
) -> _Spill:
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
                if sinks[p] is None:
                    sink = pa.OSFile(str(paths[p]), "wb")
                    sinks[p] = (sink, ipc.new_file(sink, spill_schema))
                sinks[p][1].write_table(table.slice(off, int(counts[p])))
                off += int(counts[p])
    finally:
        for s in sinks:
            if s is not None:
                s[1].close()
                s[0].close()
    if row0 == 0:
        raise DataError(f"{input_path}: input has no rows")
    dt = time.perf_counter() - t0
    log.info("pass 1 done", extra=kv(rows=row0, seconds=round(dt, 2), rows_per_s=int(row0 / max(dt, 1e-9))))
    return _Spill([p for p, s in zip(paths, sinks) if s is not None], row0, bytes_per_row, dt)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def _read_spill(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return ipc.open_file(src).read_all()


@dataclass
class _Stats:
    support_rows: int = 0
    query_rows: int = 0
    leftover_rows: int = 0
    plain_rows: int = 0
    tasks: int = 0
    leftover_tasks: int = 0
    missing_key_rows: int = 0
    episodes: int = 0
    scenario: dict[str, int] = field(default_factory=dict)

    def count_scenarios(self, values: np.ndarray) -> None:
        if values.size == 0 or len(self.scenario) > 10_000:
            return
        u, c = np.unique(values, return_counts=True)
        for k, v in zip(u.tolist(), c.tolist()):
            self.scenario[str(k)] = self.scenario.get(str(k), 0) + int(v)


def _scenario_values(table: pa.Table, schema: Schema) -> np.ndarray | None:
    if not schema.scenario:
        return None
    col = table.column(schema.scenario)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        return None
    return col.to_numpy(zero_copy_only=False)


def _pass2_meta(
    spill: _Spill,
    schema: Schema,
    data_schema: pa.Schema,
    cfg: MetaIOBuildConfig,
    key: str,
    parts: _RollingWriter,
    leftover: _RollingWriter,
) -> tuple[_Stats, list[_BucketPacker], _PlainPacker]:
    buckets = L.make_buckets(cfg.support, cfg.query, cfg.bucketing)
    packers = [_BucketPacker(b, cfg.rows_per_batch, data_schema, parts) for b in buckets]
    left = _PlainPacker(cfg.rows_per_batch, data_schema, leftover, BatchKind.LEFTOVER)
    stats = _Stats()
    n_parts = len(spill.paths)
    for p, path in enumerate(spill.paths):
        t0 = time.perf_counter()
        t = _read_spill(path)
        keys = t.column(key).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        hk = mix64(keys, cfg.seed)
        rowid = t.column(L.ROW_COL).to_numpy(zero_copy_only=False)
        if cfg.split == Split.TIME:
            ts = t.column(schema.timestamp).to_numpy(zero_copy_only=False)
            order = np.lexsort((rowid, ts, hk))
        else:
            order = np.lexsort((mix64(rowid, cfg.seed ^ _RANDOM_SPLIT_SALT), hk))
        st = t.drop_columns([L.ROW_COL]).take(pa.array(order))
        del t
        hk_s, keys_s = hk[order], keys[order]
        n = hk_s.size
        starts = np.flatnonzero(np.concatenate([[True], hk_s[1:] != hk_s[:-1]]))
        sizes = np.diff(np.append(starts, n))
        # 1-row tasks, and rows whose task key is missing (-1: a null id), cannot
        # form support+query: they go to the leftover plain files
        missing = keys_s[starts] < 0
        single = (sizes == 1) | missing
        stats.missing_key_rows += int(sizes[missing].sum())
        row_single = np.repeat(single, sizes)
        if single.any():
            left_rows = np.flatnonzero(row_single)
            left.add(st.take(pa.array(left_rows)))
            stats.leftover_rows += left_rows.size
            stats.leftover_tasks += int(single.sum())
        multi_rows = np.flatnonzero(~row_single)
        if multi_rows.size:
            mt = st.take(pa.array(multi_rows)) if single.any() else st
            sizes_m = sizes[~single]
            task_keys = keys_s[starts[~single]]
            plan = plan_episodes(sizes_m, cfg.support, cfg.query, buckets)
            stats.tasks += sizes_m.size
            stats.episodes += plan.n_rows.size
            stats.query_rows += int(plan.n_query.sum())
            stats.support_rows += int(plan.n_support.sum())
            row_level = plan.level[plan.episode]
            for lv, packer in enumerate(packers):
                eps = np.flatnonzero(plan.level == lv)
                if eps.size == 0:
                    continue
                rows = np.flatnonzero(row_level == lv)
                ordinal = np.full(plan.n_rows.size, -1, dtype=np.int64)
                ordinal[eps] = np.arange(eps.size)
                packer.add(
                    mt.take(pa.array(rows)),
                    plan.slot[rows],
                    ordinal[plan.episode[rows]],
                    task_keys[plan.task[eps]],
                )
        sv = _scenario_values(st, schema)
        if sv is not None:
            stats.count_scenarios(sv)
        path.unlink()
        dt = time.perf_counter() - t0
        log.info(
            "pass 2: partition done",
            extra=kv(partition=f"{p + 1}/{n_parts}", rows=n, tasks=starts.size, seconds=round(dt, 3),
                     rows_per_s=int(n / max(dt, 1e-9))),
        )
    for packer in packers:
        packer.flush()
    left.flush()
    return stats, packers, left


def _pass2_plain(
    spill: _Spill, schema: Schema, data_schema: pa.Schema, cfg: MetaIOBuildConfig, parts: _RollingWriter
) -> tuple[_Stats, _PlainPacker]:
    packer = _PlainPacker(cfg.rows_per_batch, data_schema, parts, BatchKind.PLAIN)
    stats = _Stats()
    n_parts = len(spill.paths)
    for p, path in enumerate(spill.paths):
        t0 = time.perf_counter()
        t = _read_spill(path)
        rowid = t.column(L.ROW_COL).to_numpy(zero_copy_only=False)
        order = np.argsort(mix64(rowid, cfg.seed ^ _PLAIN_SHUFFLE_SALT), kind="stable")
        st = t.drop_columns([L.ROW_COL]).take(pa.array(order))
        del t
        packer.add(st)
        stats.plain_rows += st.num_rows
        sv = _scenario_values(st, schema)
        if sv is not None:
            stats.count_scenarios(sv)
        path.unlink()
        dt = time.perf_counter() - t0
        log.info("pass 2: partition done", extra=kv(partition=f"{p + 1}/{n_parts}", rows=st.num_rows,
                                                     seconds=round(dt, 3), rows_per_s=int(st.num_rows / max(dt, 1e-9))))
    packer.flush()
    return stats, packer


# --------------------------------------------------------------------------- entry point


def dataset_files(folder: Path) -> list[Path]:
    """Files of a Meta-IO dataset present in ``folder`` (manifest, index, parts, leftovers)."""
    out = [folder / L.MANIFEST_NAME, folder / L.INDEX_NAME]
    out += sorted(folder.glob("part-*.arrow")) + sorted(folder.glob("leftover-*.arrow"))
    return [p for p in out if p.exists()]


def _resolve(schema: Schema | str | Path, cfg: MetaIOBuildConfig) -> tuple[Schema, str, pa.Schema]:
    from meta_io import source

    if not isinstance(schema, Schema):
        schema = load_schema(schema)
    key = cfg.task_key or schema.task_key
    names = [c.name for c in schema.columns]
    data_schema = source.normalized_arrow_schema(schema)
    if cfg.layout == Layout.META:
        if key not in names:
            raise SchemaError(f"task key '{key}' is not a column of the schema; columns: {names}")
        tp = data_schema.field(key).type
        if not pa.types.is_integer(tp):
            raise SchemaError(f"task key '{key}' must be an id column (int64 after import), got {tp}")
        if cfg.split == Split.TIME and not schema.timestamp:
            raise ConfigError("split 'time' needs a timestamp column, but the schema declares none "
                              "(set \"timestamp\" in the schema or use --split random)")
    return schema, key, data_schema


def build(
    input_path: str | Path,
    schema: Schema | str | Path,
    out_dir: str | Path,
    config: MetaIOBuildConfig = MetaIOBuildConfig(),
) -> BuildResult:
    """Build a Meta-IO dataset from ``input_path`` into ``out_dir``.

    Args:
        input_path: a Parquet file or folder (anything ``iter_source`` reads).
        schema: a :class:`Schema` or the path of a schema file.
        out_dir: the dataset folder (created; must not hold a dataset unless
            ``config.overwrite``).
        config: layout, S/Q, split, seed, batch shape, memory budget.

    Returns:
        The folder and the manifest written last into it.

    Raises:
        DataError: bad or empty input, or an existing dataset without overwrite.
        SchemaError / ConfigError: a task key or split the schema cannot serve.

    Example::

        >>> r = build("gen/", "gen/schema.json", "metaio/", MetaIOBuildConfig(support=8, query=4))
        >>> r.manifest["totals"]["input_rows"]
    """
    config.validate()
    t_start = time.perf_counter()
    input_path, out = Path(input_path), Path(out_dir)
    schema, key, data_schema = _resolve(schema, config)
    existing = dataset_files(out) if out.exists() else []
    if existing and not config.overwrite:
        raise DataError(f"{out}: already holds a Meta-IO dataset ({existing[0].name}); pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    # Build beside the output (same file system), never inside it: a failed build
    # leaves no output folder behind (nor parent folders it had to create).
    created_root = _first_missing(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}{L.STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    spill_dir = staging / "spill"
    spill_dir.mkdir(parents=True)
    ok = False
    try:
        spill = _pass1(input_path, schema, data_schema, config, key, spill_dir)
        index = IndexBuilder()
        max_bytes = int(config.max_file_mb * 2**20)
        tables = L.id_tables(schema)
        t2 = time.perf_counter()
        if config.layout == Layout.META:
            parts = _RollingWriter(staging, L.PART_PATTERN, L.meta_arrow_schema(data_schema), max_bytes, index,
                                   tables)
            left_w = _RollingWriter(staging, L.LEFTOVER_PATTERN, L.plain_arrow_schema(data_schema), max_bytes, index,
                                   tables)
            stats, packers, left = _pass2_meta(spill, schema, data_schema, config, key, parts, left_w)
            files, left_files = parts.close(), left_w.close()
        else:
            parts = _RollingWriter(staging, L.PART_PATTERN, L.plain_arrow_schema(data_schema), max_bytes, index,
                                   tables)
            stats, plain = _pass2_plain(spill, schema, data_schema, config, parts)
            files, left_files, packers = parts.close(), [], []
        pass2_s = time.perf_counter() - t2
        index.write(staging / L.INDEX_NAME)
        placed = stats.support_rows + stats.query_rows + stats.leftover_rows + stats.plain_rows
        if placed != spill.input_rows:  # an internal invariant, never expected to fire
            raise DataError(f"{input_path}: placed {placed} rows but read {spill.input_rows}")
        manifest = _manifest(config, schema, key, data_schema, input_path, spill, stats, packers, files,
                             left_files, index, time.perf_counter() - t_start, pass2_s)
        manifest.update(_index_checksum(staging / L.INDEX_NAME))
        shutil.rmtree(spill_dir, ignore_errors=True)
        if out.exists():  # an empty folder, or a dataset being overwritten
            _publish(staging, out, files + left_files, manifest, config.overwrite)
        else:
            write_json_atomic(staging / L.MANIFEST_NAME, manifest, indent=2)
            os.rename(staging, out)
        ok = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not ok and created_root is not None:
            shutil.rmtree(created_root, ignore_errors=True)
    log.info("build done", extra=kv(out=out, **{k: manifest["totals"][k] for k in ("input_rows", "batches", "files")}))
    return BuildResult(out, manifest)


def _first_missing(path: Path) -> Path | None:
    """The outermost ancestor-or-self of ``path`` that does not exist (None: it exists)."""
    missing = None
    p = path.absolute()
    while not p.exists():
        missing, p = p, p.parent
    return missing


def _index_checksum(path: Path) -> dict[str, Any]:
    """Manifest keys that protect ``index.arrow`` and announce the per-batch checksums."""
    return {"checksums": CHECKSUMS_MANIFEST, "index_bytes": path.stat().st_size,
            "index_crc32": zlib.crc32(path.read_bytes()) & 0xFFFFFFFF}


def _manifest(
    cfg: MetaIOBuildConfig,
    schema: Schema,
    key: str,
    data_schema: pa.Schema,
    input_path: Path,
    spill: _Spill,
    stats: _Stats,
    packers: list[_BucketPacker],
    files: list[dict[str, Any]],
    left_files: list[dict[str, Any]],
    index: IndexBuilder,
    seconds: float,
    pass2_s: float,
) -> dict[str, Any]:
    meta_entries = [e for e in index.entries if e.kind == BatchKind.META]
    slots = sum(e.n_slots for e in meta_entries)
    meta_rows = stats.support_rows + stats.query_rows
    buckets = []
    for pk in packers:
        b = pk.bucket
        buckets.append(dict(level=b.level, capacity=b.capacity, support=b.support, query=b.query,
                            tasks_per_batch=pk.T, slots_per_batch=pk.T * pk.c, batches=pk.batches,
                            episodes=pk.episodes, rows=pk.rows))
    totals: dict[str, Any] = dict(
        input_rows=spill.input_rows,
        support_rows=stats.support_rows,
        query_rows=stats.query_rows,
        leftover_rows=stats.leftover_rows,
        plain_rows=stats.plain_rows,
        tasks=stats.tasks,
        leftover_tasks=stats.leftover_tasks,
        missing_key_rows=stats.missing_key_rows,
        episodes=stats.episodes,
        batches=len(index.entries),
        meta_batches=len(meta_entries),
        files=len(files),
        leftover_files=len(left_files),
        bytes=sum(f["bytes"] + f["ids_bytes"] for f in files + left_files),
        build_seconds=round(seconds, 3),
        pass1_seconds=round(spill.seconds, 3),
        pass2_seconds=round(pass2_s, 3),
        rows_per_s=int(spill.input_rows / max(seconds, 1e-9)),
        partitions=len(spill.paths),
    )
    if cfg.layout == Layout.META:
        width = cfg.support + cfg.query
        t0 = max(1, cfg.rows_per_batch // width)
        unbucketed_slots = -(-stats.episodes // t0) * t0 * width
        totals["slots"] = slots
        totals["fill_ratio"] = round(meta_rows / slots, 4) if slots else 0.0
        totals["fill_ratio_without_buckets"] = round(meta_rows / unbucketed_slots, 4) if unbucketed_slots else 0.0
        # the same, ignoring the empty task slots of each bucket's last batch
        ep_slots = sum(pk.episodes * pk.c for pk in packers)
        totals["episode_fill_ratio"] = round(meta_rows / ep_slots, 4) if ep_slots else 0.0
        totals["episode_fill_ratio_without_buckets"] = (
            round(meta_rows / (stats.episodes * width), 4) if stats.episodes else 0.0
        )
    else:
        plain_slots = sum(e.n_slots for e in index.entries)
        totals["slots"] = plain_slots
        totals["fill_ratio"] = round(stats.plain_rows / plain_slots, 4) if plain_slots else 0.0
    return {
        "format": "metaio",
        "format_version": L.FORMAT_VERSION,
        "layout": cfg.layout.value,
        "support": cfg.support,
        "query": cfg.query,
        "split": cfg.split.value,
        "seed": cfg.seed,
        "task_key": key,
        "rows_per_batch": cfg.rows_per_batch,
        "bucketing": cfg.bucketing,
        "config": to_dict(cfg),
        "input": str(input_path),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "schema": schema.to_dict(),
        "columns": data_schema.names,
        "buckets": buckets,
        "files": files,
        "leftover_files": left_files,
        "totals": totals,
        "scenario_rows": dict(sorted(stats.scenario.items(), key=lambda kv_: _num_key(kv_[0]))),
    }


def _num_key(s: str) -> tuple[int, float | str]:
    try:
        return (0, float(s))
    except ValueError:
        return (1, s)


def _publish(staging: Path, out: Path, files: list[dict[str, Any]], manifest: dict[str, Any], overwrite: bool) -> None:
    """Move the staged dataset into ``out``; the manifest goes last, atomically.

    An old dataset (``overwrite``) loses its manifest first, so a crash in the
    middle leaves a folder that never looks complete.
    """
    if overwrite:
        old_manifest = out / L.MANIFEST_NAME
        if old_manifest.exists():
            old_manifest.unlink()
        for p in dataset_files(out):
            p.unlink()
    for f in files:
        os.replace(staging / f["name"], out / f["name"])
        os.replace(staging / f["ids"], out / f["ids"])
    os.replace(staging / L.INDEX_NAME, out / L.INDEX_NAME)
    write_json_atomic(out / L.MANIFEST_NAME, manifest, indent=2)
