"""Packers: scatter planned rows into fixed-shape bucket batches (meta format) or plain batches."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from meta_io import layout as L
from meta_io.build.writers import _RollingWriter
from meta_io.layout import BatchKind, Bucket


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
