"""Pass 2: sort each spill partition, plan episodes and pack them (meta format) or shuffle rows (plain format).

Progress: ``on_rows(done, total)`` once before the first partition (``done`` 0) and after
each partition, rows of the partitions finished out of the input's rows (partitions
differ in size, so rows, not partition counts, give the time left); the last call is
``(rows, rows)``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa

from meta_io import layout as L
from meta_io.build.config import MetaIOBuildConfig
from meta_io.build.packers import _BucketPacker, _PlainPacker
from meta_io.build.pass1 import _Spill, _read_spill
from meta_io.build.plan import plan_episodes
from meta_io.build.writers import _RollingWriter
from meta_io.layout import BatchKind, Split
from meta_io.schema import Schema
from common.hashing import mix64
from common.log import kv

log = logging.getLogger(__name__)


_RANDOM_SPLIT_SALT = 0x5EED_5B11_7000_0001


_PLAIN_SHUFFLE_SALT = 0x5EED_5B11_7000_0002


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
    on_rows: Callable[[int, int], None] | None = None,
) -> tuple[_Stats, list[_BucketPacker], _PlainPacker]:
    """Pack every spill partition into episodes (``on_rows``: see the module docstring)."""
    buckets = L.make_buckets(cfg.support, cfg.query, cfg.bucketing)
    packers = [_BucketPacker(b, cfg.rows_per_batch, data_schema, parts) for b in buckets]
    left = _PlainPacker(cfg.rows_per_batch, data_schema, leftover, BatchKind.LEFTOVER)
    stats = _Stats()
    n_parts = len(spill.paths)
    done = 0
    if on_rows is not None:
        on_rows(0, spill.input_rows)
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
        done += n
        if on_rows is not None:
            on_rows(done, max(done, spill.input_rows))
    for packer in packers:
        packer.flush()
    left.flush()
    return stats, packers, left


def _pass2_plain(
    spill: _Spill, schema: Schema, data_schema: pa.Schema, cfg: MetaIOBuildConfig, parts: _RollingWriter,
    on_rows: Callable[[int, int], None] | None = None,
) -> tuple[_Stats, _PlainPacker]:
    """Shuffle every spill partition's rows into plain batches (``on_rows``: see the module docstring)."""
    packer = _PlainPacker(cfg.rows_per_batch, data_schema, parts, BatchKind.PLAIN)
    stats = _Stats()
    n_parts = len(spill.paths)
    done = 0
    if on_rows is not None:
        on_rows(0, spill.input_rows)
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
        done += st.num_rows
        if on_rows is not None:
            on_rows(done, max(done, spill.input_rows))
    packer.flush()
    return stats, packer
