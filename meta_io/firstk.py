"""The ``first-k`` evaluation layout: strict cold start, every later row scored once.

A new user has only their first few interactions when the model must adapt.
Meta-IO's training layout cuts a task's whole history into support/query
episodes, so a later episode's support is the rows just before its query,
which overstates cold-start quality. Under ``first-k``::

    rows of one task, ordered by (time, input row)   r0 r1 r2 | r3 r4 r5 r6 ...
                                                     support   query (each row once)
                                                     (first K)

* per task key, the first ``K`` rows by time are the support set; every later
  row of the task is a query row, scored exactly once;
* ties on time are broken by the input row number (deterministic);
* a task with ``<= K`` rows has no query row and yields no episode (its rows
  are support only);
* a task with more query rows than an episode holds (``query_slots``) is cut
  into several episodes that share the same support; no query row repeats and
  the support is never duplicated per query row.

Everything is vectorized (one ``np.lexsort`` and cumulative counts), no loop
over rows or tasks.

Example::

    lay = first_k_layout(keys, times, k=5)
    lay.is_support            # bool per input row
    ep = lay.episodes(query_slots=32)
    ep.support                # int64 [E, K]  input rows (-1 = padding)
    ep.query                  # int64 [E, 32] input rows (-1 = padding)
    for mb in first_k_batches(table, schema, k=5, query_slots=32, tasks_per_batch=64): ...
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from meta_io.batch import MetaBatch
from meta_io.schema import Schema
from common.errors import DataError


@dataclass(frozen=True)
class FirstKEpisodes:
    """Episodes of a first-k layout (input row numbers, ``-1`` = padding slot).

    Args:
        support: int64 ``[E, K]`` the task's first K rows, in time order.
        query: int64 ``[E, Q]`` later rows, in time order; each input row appears in one episode at most.
        task: int64 ``[E]`` index into :attr:`FirstKLayout.task_keys`.
    """

    support: np.ndarray
    query: np.ndarray
    task: np.ndarray


@dataclass(frozen=True)
class FirstKLayout:
    """Per-row support/query assignment of the first-k protocol.

    Args:
        k: support rows per task.
        order: int64 ``[N]`` input rows sorted by (task key, time, input row).
        rank: int64 ``[N]`` position of each input row within its task (0 = earliest).
        is_support: bool ``[N]`` rank < k.
        task_keys: int64 ``[T]`` tasks with at least one query row (more than k rows), sorted.
        support: int64 ``[T, k]`` their support rows in time order.
        query_rows: int64 ``[M]`` every query row, grouped by task (in ``task_keys`` order), in time order.
        query_task: int64 ``[M]`` the task index of each query row.
    """

    k: int
    order: np.ndarray
    rank: np.ndarray
    is_support: np.ndarray
    task_keys: np.ndarray
    support: np.ndarray
    query_rows: np.ndarray
    query_task: np.ndarray

    def episodes(self, query_slots: int) -> FirstKEpisodes:
        """Cut each task's query rows into episodes of at most ``query_slots`` rows.

        Args:
            query_slots: query rows per episode (>= 1).
        """
        if query_slots < 1:
            raise DataError(f"first-k: query_slots must be >= 1, got {query_slots}")
        n_tasks = self.task_keys.shape[0]
        if n_tasks == 0:
            return FirstKEpisodes(np.zeros((0, self.k), np.int64), np.zeros((0, query_slots), np.int64),
                                  np.zeros(0, np.int64))
        per_task = np.bincount(self.query_task, minlength=n_tasks)
        starts = np.concatenate([[0], np.cumsum(per_task)[:-1]])
        pos = np.arange(self.query_rows.shape[0]) - starts[self.query_task]  # position within the task
        eps_per_task = -(-per_task // query_slots)
        ep_start = np.concatenate([[0], np.cumsum(eps_per_task)[:-1]])
        n_eps = int(eps_per_task.sum())
        ep = ep_start[self.query_task] + pos // query_slots
        query = np.full((n_eps, query_slots), -1, dtype=np.int64)
        query[ep, pos % query_slots] = self.query_rows
        task = np.repeat(np.arange(n_tasks, dtype=np.int64), eps_per_task)
        return FirstKEpisodes(self.support[task], query, task)


def first_k_layout(keys: np.ndarray, times: np.ndarray, k: int) -> FirstKLayout:
    """Assign every row to support (first ``k`` of its task by time) or query.

    Args:
        keys: int64 ``[N]`` task key per row.
        times: int64 ``[N]`` timestamp per row.
        k: support rows per task (>= 1).

    Raises:
        DataError: ``k < 1`` or ``keys``/``times`` of different lengths.
    """
    if k < 1:
        raise DataError(f"first-k: k must be >= 1, got {k}")
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    times = np.asarray(times, dtype=np.int64).reshape(-1)
    if keys.shape != times.shape:
        raise DataError(f"first-k: {keys.shape[0]} task keys but {times.shape[0]} timestamps")
    n = keys.shape[0]
    rows = np.arange(n, dtype=np.int64)
    order = np.lexsort((rows, times, keys))  # last key is primary: task, then time, then input row
    sk = keys[order]
    new_task = np.ones(n, dtype=bool)
    new_task[1:] = sk[1:] != sk[:-1]
    first = np.flatnonzero(new_task)
    task_of = np.cumsum(new_task) - 1
    rank_sorted = np.arange(n, dtype=np.int64) - first[task_of]
    rank = np.empty(n, dtype=np.int64)
    rank[order] = rank_sorted
    sizes = np.diff(np.concatenate([first, [n]]))
    with_query = np.flatnonzero(sizes > k)
    support = order[first[with_query][:, None] + np.arange(k)[None, :]] if with_query.size else np.zeros((0, k), np.int64)
    q_sel = rank_sorted >= k
    remap = np.full(first.shape[0], -1, dtype=np.int64)
    remap[with_query] = np.arange(with_query.shape[0])
    return FirstKLayout(
        k=k, order=order, rank=rank, is_support=rank < k,
        task_keys=sk[first[with_query]], support=support.astype(np.int64),
        query_rows=order[q_sel], query_task=remap[task_of[q_sel]],
    )


def read_table(path: str | Path, schema: Schema) -> pa.Table:
    """Every row of a Parquet/CSV file or folder, normalized with ``schema`` (input order).

    The evaluation set is held in memory (it is scored once, task by task).
    """
    from meta_io.source import iter_source

    parts = [sb.table for sb in iter_source(path, schema)]
    return pa.concat_tables(parts).combine_chunks() if parts else pa.table({})


def first_k_batches(
    table: pa.Table, schema: Schema, k: int, query_slots: int = 32, tasks_per_batch: int = 64
) -> Iterator[MetaBatch]:
    """Meta batches of the first-k layout of a normalized table (support ``[T, k]``, query ``[T, Q]``).

    Args:
        table: normalized rows (:func:`read_table`).
        schema: its schema (needs ``task_key`` and ``timestamp``).
        k: support rows per task.
        query_slots: query rows per episode.
        tasks_per_batch: episodes per meta batch.

    Raises:
        DataError: the schema has no timestamp column, or bad sizes.
    """
    from meta_io import layout as L
    from meta_io.reader import BatchConverter

    if not schema.timestamp:
        raise DataError("first-k: the schema has no timestamp column; the protocol orders rows by time")
    if tasks_per_batch < 1:
        raise DataError(f"first-k: tasks_per_batch must be >= 1, got {tasks_per_batch}")
    keys = table.column(schema.task_key).to_numpy()
    lay = first_k_layout(keys, table.column(schema.timestamp).to_numpy(), k)
    ep = lay.episodes(query_slots)
    data = table.select([c.name for c in schema.columns])
    n = data.num_rows
    padded = pa.concat_tables([data, L.pad_row(data.schema)]).combine_chunks()  # row n = padding
    conv = BatchConverter(schema)
    cap = k + query_slots
    for lo in range(0, ep.task.shape[0], tasks_per_batch):
        hi = min(lo + tasks_per_batch, ep.task.shape[0])
        slots = np.concatenate([ep.support[lo:hi], ep.query[lo:hi]], axis=1)  # [t, cap]
        t = hi - lo
        if t < tasks_per_batch:  # pad task slots so every batch has the same shape
            slots = np.concatenate([slots, np.full((tasks_per_batch - t, cap), -1, np.int64)])
        flat = slots.reshape(-1)
        real = flat >= 0
        taken = padded.take(pa.array(np.where(real, flat, n)))
        task_keys = np.repeat(np.concatenate([lay.task_keys[ep.task[lo:hi]], np.full(tasks_per_batch - t, -1)]), cap)
        taken = taken.append_column(L.TASK_KEY_COL, pa.array(task_keys.astype(np.int64)))
        taken = taken.append_column(L.MASK_COL, pa.array(real))
        rb = taken.combine_chunks().to_batches()[0]
        yield conv.meta(rb, tasks_per_batch, cap, k)
