"""Everything one PS shard stores: its embedding tables and its dense parameters.

The gRPC service (ps/servicer.py) calls these methods from several threads. Each
table has its own lock, so pulls and pushes of different tables run
concurrently; :meth:`ShardStore.write_lock` holds every lock at once for a
consistent checkpoint cut or a migration freeze.

Versions (incremental delivery)::

    version 1 --- pushes stamp rows 1 ---  bump_version() -> 1
    version 2 --- pushes stamp rows 2 ---  bump_version() -> 2 ...

``bump_version()`` closes the current version and returns it; a delivery that
ran ``v = bump_version()`` then later ``changed_rows(t, since_version=v)`` gets
every row changed after its cut (rows changed during the export may come twice,
never zero times).

Example::

    store = ShardStore([TableConfig(name="user", dim=8, capacity=1000)], shard_id=0,
                       num_vshards=16, seed=0)
    store.push("user", np.array([1, 1, 2]), np.ones((3, 8), np.float32))
    store.pull("user", np.array([2, 1]))          # float32 [2, 8]
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from common.hashing import vshard_of
from common.log import kv
from ps.config import NonfiniteMode, OptimizerConfig, TableConfig
from ps.dense_store import DenseStore
from ps.embedding_table import EmbeddingTable, PushResult, TableRows, check_ids
from ps.errors import BadRequest
from ps.grouping import group_tables
from ps.table_group import TableGroup

__all__ = ["ShardStore", "TableRows", "PushResult", "resolve_device"]

log = logging.getLogger(__name__)

_MAX_CUTS = 64
"""Checkpoint cuts a store remembers (:meth:`ShardStore.record_cut`)."""


def _joined(parts: Sequence[np.ndarray]) -> np.ndarray | None:
    """One view over ``parts`` when they lie back to back in one buffer (C-contiguous, one dtype and
    row shape: the tables of a frame), else None. No copy.

    Args:
        parts: arrays in order, each non-empty.
    """
    if not parts:
        return None
    first = parts[0]
    if len(parts) == 1:
        return first if first.flags.c_contiguous else None
    tail = first.shape[1:]
    at = first.__array_interface__["data"][0]
    n = 0
    for a in parts:
        if a.dtype != first.dtype or a.shape[1:] != tail or not a.flags.c_contiguous or a.__array_interface__["data"][0] != at:
            return None
        at += a.nbytes
        n += a.shape[0]
    return np.lib.stride_tricks.as_strided(first, shape=(n, *tail), strides=first.strides,
                                           writeable=bool(first.flags.writeable))


def _one_array(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``parts`` concatenated into one writable C-contiguous array: one writable part as it is,
    parts back to back in one buffer (a frame's tables, read-only) with one copy, else one concatenation."""
    if len(parts) == 1 and parts[0].flags.writeable and parts[0].flags.c_contiguous:
        return parts[0]
    run = _joined(parts)
    return np.concatenate(parts) if run is None else run.copy()


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when available else 'cpu'; 'cuda' without a GPU is an error."""
    d = getattr(device, "value", device)
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d == "cuda" and not torch.cuda.is_available():
        raise ValueError("ps device 'cuda' requested but torch.cuda.is_available() is False")
    if d not in ("cpu", "cuda"):
        raise ValueError(f"ps device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return d


class ShardStore:
    """All tables of one PS shard plus its dense store.

    Args:
        tables: resolved table configs (``PsConfig.table_configs(names)``).
        shard_id: this shard's index (for logs and checkpoints).
        num_vshards: V of ``vshard = mix64(id) % V``.
        seed: job seed (initial rows, admission).
        device: "cpu", "cuda" or "auto".
        nonfinite_grads: "reject" (raise BadRequest) or "drop" (drop those ids, counted).
        dense_optimizer: optimizer of dense parameters (default Adam, lr 1e-3).
    """

    def __init__(
        self,
        tables: list[TableConfig],
        *,
        shard_id: int,
        num_vshards: int,
        seed: int,
        device: str = "cpu",
        nonfinite_grads: str = "reject",
        dense_optimizer: OptimizerConfig | None = None,
    ) -> None:
        if num_vshards < 1:
            raise ValueError(f"num_vshards must be >= 1, got {num_vshards}")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        self.shard_id = int(shard_id)
        self.num_vshards = int(num_vshards)
        self.seed = int(seed)
        self.device = resolve_device(device)
        self.nonfinite_grads = NonfiniteMode(getattr(nonfinite_grads, "value", nonfinite_grads))
        self.groups: list[TableGroup] = []
        self._where: dict[str, tuple[int, int]] = {}
        """Table name -> (its group, its index in the group)."""
        self.tables: dict[str, EmbeddingTable] = {}
        self._build_tables(tables)
        self.dense = DenseStore(dense_optimizer)
        self._version = 1
        self._cuts: dict[str, int] = {}
        log.info(
            "shard store ready",
            extra=kv(shard=self.shard_id, tables=",".join(names), device=self.device, bytes=self.memory_bytes()),
        )

    def empty_like(self) -> "ShardStore":
        """A new, empty store with this one's tables, layout, device and optimizers.

        A restore fills it aside and swaps it in only when everything loaded
        (all or nothing); its open version continues this store's, so an
        incremental delivery sees every restored row as changed.
        """
        fresh = ShardStore(
            [t.cfg for t in self.tables.values()],
            shard_id=self.shard_id,
            num_vshards=self.num_vshards,
            seed=self.seed,
            device=self.device,
            nonfinite_grads=self.nonfinite_grads.value,
            dense_optimizer=self.dense.cfg,
        )
        fresh._open_version(self._version)
        return fresh

    def _build_tables(self, cfgs: list[TableConfig]) -> None:
        """One :class:`TableGroup` per storage group (``ps.grouping``); ``tables`` keeps ``cfgs``' order."""
        by_name = {c.name: c for c in cfgs}
        self.groups = [TableGroup([by_name[n] for n in spec.names], seed=self.seed, device=self.device)
                       for spec in group_tables(cfgs)]
        self._where = {t.name: (gi, ti) for gi, g in enumerate(self.groups) for ti, t in enumerate(g.tables)}
        self.tables = {c.name: self.groups[self._where[c.name][0]].tables[self._where[c.name][1]] for c in cfgs}

    def _open_version(self, version: int) -> None:
        self._version = int(version)
        self._cuts = {}  # a restore registers the checkpoint it loaded (ps.checkpoint.load_shard)
        for t in self.tables.values():
            t.current_version = self._version

    def pristine(self) -> bool:
        """Whether nothing was ever stored here: no row, push, removal, dense param or checkpoint cut.

        Such a store (a shard just started: before its start-up restore, or awaiting recovery with none) has
        nothing a failed restore could lose, so a restore may fill it in place
        instead of building a second store aside (which doubles the memory: at 50M
        rows of dim 64, 2 x 15 GB). See :meth:`clear`.
        """
        return (not self._cuts and not self.dense.names()
                and all(t.pristine() for t in self.tables.values()))

    def clear(self, version: int) -> None:
        """Make this store empty again, as :meth:`empty_like` would build it, at ``version``.

        For a restore into a pristine store that failed part-way: every table is
        dropped before any is rebuilt, so two copies of a table never exist at
        once. The caller holds the shard's exclusive gate (no request runs).

        Args:
            version: the open version to continue (the store's before the restore).
        """
        cfgs = [t.cfg for t in self.tables.values()]
        self.tables, self.groups, self._where = {}, [], {}
        gc.collect()  # the tables' storage goes now, before the new tables allocate theirs
        self._build_tables(cfgs)
        self.dense = DenseStore(self.dense.cfg)
        self._open_version(version)
        log.info("shard store cleared", extra=kv(shard=self.shard_id, version=self._version))

    # -- helpers -------------------------------------------------------------------
    def table(self, name: str) -> EmbeddingTable:
        """The named table (BadRequest naming the known tables otherwise)."""
        t = self.tables.get(name)
        if t is None:
            raise BadRequest(f"unknown table '{name}'; this shard has {sorted(self.tables)}")
        return t

    @contextlib.contextmanager
    def write_lock(self) -> Iterator[None]:
        """Hold every table lock and the dense lock: no pull/push/import runs meanwhile."""
        with contextlib.ExitStack() as stack:
            for g in self.groups:  # one lock per storage group, in group order
                stack.enter_context(g.lock)
            stack.enter_context(self.dense.lock)
            yield

    @property
    def version(self) -> int:
        """The current (open) version that changes are stamped with."""
        return self._version

    # -- data path -----------------------------------------------------------------
    def pull(self, table: str, ids: np.ndarray, fp16: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` (int64 [n], any order, duplicates ok) as float32 [n, dim].

        Ids without a row (not admitted yet, or evicted) read as their initial value.
        With ``fp16`` (rows bound for an fp16 wire) values beyond +-65504 saturate
        to +-65504, counted in the table's ``fp16_saturated`` stat. With ``out``
        (writable C-contiguous float32 [n, dim], e.g. a reply buffer) the rows are
        gathered straight into it and it is returned.
        """
        t = self.table(table)
        with t.lock:
            return t.pull(ids, fp16=fp16, out=out)

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray) -> PushResult:
        """Apply gradients float32 [n, dim] to ``ids`` int64 [n]; duplicates are summed.

        Raises:
            BadRequest: unknown table, wrong dtype/shape, NaN/Inf under "reject".
                The table is unchanged then.
        """
        t = self.table(table)
        with t.lock:
            return t.push(ids, grads, self.nonfinite_grads)

    # -- a step's tables at once ---------------------------------------------------
    def _plan(self, names: Sequence[str]) -> list[tuple[int, list[int]]] | None:
        """Request positions per group when every group's tables come in storage order
        (the one-lookup path), else None (a table repeats, or comes out of order)."""
        seen: dict[int, list[int]] = {}
        last: dict[int, int] = {}
        for k, name in enumerate(names):
            where = self._where.get(name)
            if where is None:
                self.table(name)  # raises BadRequest naming the known tables
                return None
            gi, ti = where
            if last.get(gi, -1) >= ti:
                return None
            last[gi] = ti
            seen.setdefault(gi, []).append(k)
        return list(seen.items())

    def pull_many(self, items: Sequence[tuple[str, np.ndarray]], *, fp16: bool = False,
                  outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Rows of several tables (``(table, ids)`` each, as :meth:`pull` takes them): one id-map
        lookup and one gather per storage group instead of one per table.

        Args:
            items: (table, int64 [n] ids) per table; each table once.
            fp16: the rows go on an fp16 wire (saturated and counted as :meth:`pull` does).
            outs: per item, a writable C-contiguous float32 [n, dim] to write the rows into.

        Returns:
            per item, float32 [n, dim] (``outs[k]`` when given).

        Raises:
            BadRequest: an unknown table, or ids that :func:`check_ids` refuses (nothing read).
        """
        plan = self._plan([t for t, _ in items])
        if plan is None:  # a table twice, or out of storage order: table by table
            return [self.pull(t, ids, fp16=fp16, out=None if outs is None else outs[k])
                    for k, (t, ids) in enumerate(items)]
        result: list[np.ndarray] = [np.empty(0)] * len(items)
        for gi, ks in plan:
            g = self.groups[gi]
            counts = np.zeros(len(g.tables), dtype=np.int64)
            present = []
            for k in ks:
                t, ids = items[k]
                table = g.tables[self._where[t][1]]
                if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1:
                    check_ids(t, ids)  # raises, naming what is wrong
                if outs is not None:
                    table.check_pull_out(outs[k], ids.shape[0])
                if ids.shape[0] == 0:  # counted as a pull, as pull() counts it; nothing to read
                    with g.lock:
                        table.counters["pulls"] += 1
                    result[k] = outs[k] if outs is not None else np.empty((0, g.dim), dtype=np.float32)
                    continue
                counts[self._where[t][1]] = ids.shape[0]
                present.append(k)
            if not present:
                continue
            ks = present
            flat = _one_array([items[k][1] for k in ks])
            if bool((flat == -1).any()):
                for k in ks:
                    check_ids(items[k][0], items[k][1])  # raises for the first table holding -1
            out_run = _joined([outs[k] for k in ks]) if outs is not None else None
            dst = torch.from_numpy(out_run) if out_run is not None and out_run.flags.writeable else None
            with g.lock:
                rows = g.pull(counts, torch.from_numpy(flat), dst).numpy()
            lo = 0
            for k in ks:
                n = items[k][1].shape[0]
                span = rows[lo : lo + n]
                lo += n
                if outs is not None:
                    if dst is None:
                        outs[k][...] = span
                    span = outs[k]
                if fp16:
                    with g.lock:
                        g.tables[self._where[items[k][0]][1]].saturate_fp16(span)
                result[k] = span
        return result

    def push_many(self, items: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> list[PushResult]:
        """Gradients of several tables (``(table, ids, grads)`` each, as :meth:`push` takes them):
        one lookup, one fused update and one metadata write per storage group.

        Every item is validated before any is applied; the group applies what each table's
        :meth:`push` would (duplicates summed, ``nonfinite_grads`` honoured).

        Returns:
            per item, its PushResult.

        Raises:
            BadRequest: unknown table, wrong dtype/shape, NaN/Inf under "reject" (nothing applied).
        """
        plan = self._plan([t for t, _, _ in items])
        if plan is None:
            checked = [(t, *self.table(t).check_push(ids, grads)) for t, ids, grads in items]
            return [self.push(t, ids, g) for t, ids, g in checked]
        result: list[PushResult] = [PushResult() for _ in items]
        staged: list[tuple[TableGroup, np.ndarray, list[int], torch.Tensor, torch.Tensor]] = []
        for gi, ks in plan:  # every item checked (all groups) before any group is pushed
            g = self.groups[gi]
            counts = np.zeros(len(g.tables), dtype=np.int64)
            present, ids_parts, g_parts = [], [], []
            for k in ks:
                t, ids, grads = items[k]
                ti = self._where[t][1]
                ids, gr = g.tables[ti].check_push(ids, grads, pad=False)  # -1: once per group, below
                if ids.shape[0] == 0:  # as push(): nothing applied, nothing counted
                    continue
                present.append(k)
                ids_parts.append(ids)
                g_parts.append(gr)
                counts[ti] = ids.shape[0]
            if not present:
                continue
            flat_ids = _one_array(ids_parts)
            if bool((flat_ids == -1).any()):
                for k, ids in zip(present, ids_parts):
                    check_ids(items[k][0], ids)  # raises for the first table holding -1
            staged.append((g, counts, present, torch.from_numpy(flat_ids), torch.from_numpy(_one_array(g_parts))))
        for g, counts, ks, flat_ids_t, flat_g in staged:
            with g.lock:
                res = g.push(counts, flat_ids_t, flat_g, trusted=False, nonfinite=self.nonfinite_grads)
            for k, r in zip(ks, res):
                result[k] = r
        return result

    def group_of(self, names: Sequence[str]) -> int:
        """The index of the storage group whose tables are exactly ``names`` (in storage order).

        Raises:
            ValueError: no group holds exactly these tables in this order.
        """
        gi = self._where.get(names[0], (-1, 0))[0] if names else -1
        if gi < 0 or self.groups[gi].names != tuple(names):
            raise ValueError(f"no storage group holds exactly the tables {list(names)}; groups: "
                             f"{[list(g.names) for g in self.groups]}")
        return gi

    def pull_group(self, group: int, counts: np.ndarray, ids: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """In-process pull of one storage group: float32 [N, dim] rows of ``ids`` (trusted caller).

        Args:
            group: the group's index (:meth:`group_of`).
            counts: int64 [tables of the group]: ids per table, storage order.
            ids: int64 [N] CPU, table by table, no -1 (e.g. a Meta-IO batch's unique ids).
            out: float32 [N, dim] to write into (returned).
        """
        g = self.groups[group]
        with g.lock:
            return g.pull(counts, ids, out)

    def push_group(self, group: int, counts: np.ndarray, ids: torch.Tensor, grads: torch.Tensor, *,
                   trusted: bool = True) -> list[PushResult]:
        """Push of one storage group (trusted: each table's ids unique, as the reader's are).

        The gradients' finiteness is checked once (NaN/Inf: the store's ``nonfinite_grads`` rules).

        Args:
            group: the group's index (:meth:`group_of`).
            counts: int64 [tables of the group]: ids per table, storage order.
            ids: int64 [N] CPU, table by table, >= 0 (unique within each table when ``trusted``).
            grads: float32 [N, dim] CPU.
            trusted: False for a remote caller (a StepFrame): repeated ids of a table are found
                and summed, as :meth:`push` does.

        Returns:
            one PushResult per table with ids (count > 0), in storage order.
        """
        g = self.groups[group]
        with g.lock:
            return g.push(counts, ids, grads, trusted=trusted, nonfinite=self.nonfinite_grads)

    # -- migration -----------------------------------------------------------------
    def _vshard_rows(self, t: EmbeddingTable, vshards: Sequence[int]) -> np.ndarray:
        used = t.used_rows()
        if used.size == 0:
            return used
        vs = vshard_of(t.row_ids[used], self.num_vshards)
        return used[np.isin(vs, np.asarray(list(vshards), dtype=np.int64))]

    def export_vshards(self, vshards: Sequence[int]) -> dict[str, TableRows]:
        """Rows (with optimizer state and metadata) whose vshard is in ``vshards``, per table."""
        out: dict[str, TableRows] = {}
        for name, t in self.tables.items():
            with t.lock:
                out[name] = t.export_rows(self._vshard_rows(t, vshards))
        return out

    def import_rows(self, table: str, rows: TableRows) -> None:
        """Insert or overwrite rows + optimizer state + metadata (BadRequest leaves the table unchanged)."""
        t = self.table(table)
        with t.lock:
            evicted = t.import_rows(rows)
        log.info("imported rows", extra=kv(shard=self.shard_id, table=table, rows=len(rows), evicted=evicted))

    def drop_vshards(self, vshards: Sequence[int]) -> int:
        """Remove every row of ``vshards`` from every table; returns rows removed."""
        total = 0
        for t in self.tables.values():
            with t.lock:
                total += t.drop_rows(self._vshard_rows(t, vshards))
        log.info("dropped vshards", extra=kv(shard=self.shard_id, vshards=len(list(vshards)), rows=total))
        return total

    def vshard_row_counts(self) -> dict[str, np.ndarray]:
        """Rows per vshard per table (int64 [num_vshards]): load picture for the coordinator."""
        out = {}
        for name, t in self.tables.items():
            with t.lock:
                used = t.used_rows()
                out[name] = np.bincount(vshard_of(t.row_ids[used], self.num_vshards), minlength=self.num_vshards)
        return out

    # -- incremental delivery ------------------------------------------------------
    def bump_version(self) -> int:
        """Close the current version and return it; later changes get the next one."""
        with self.write_lock():
            closed = self._version
            self._version += 1
            for t in self.tables.values():
                t.current_version = self._version
            return closed

    # -- incremental checkpoints -------------------------------------------------
    def record_cut(self, ckpt_id: str, version: int) -> None:
        """Remember that checkpoint ``ckpt_id`` captured this store's rows up to ``version``.

        A later delta over that checkpoint writes the rows stamped after ``version``
        (``row_version > version``: the dirty rows) and the removals logged after it.
        Nothing is cleared here: a cut that is never committed is never named as a
        parent, so the rows it captured stay dirty for the next delta. The last
        ``_MAX_CUTS`` cuts are kept.

        Args:
            ckpt_id: the checkpoint's unique id (its plan's ``ckpt_id``).
            version: the closed version at the cut (``bump_version()`` under the write lock).
        """
        self._cuts.pop(ckpt_id, None)
        self._cuts[ckpt_id] = int(version)
        while len(self._cuts) > _MAX_CUTS:
            self._cuts.pop(next(iter(self._cuts)))

    def cut_version(self, ckpt_id: str) -> int | None:
        """The version recorded by :meth:`record_cut` for ``ckpt_id`` (None when unknown here)."""
        return self._cuts.get(ckpt_id)

    def dirty_count(self, table: str, since_version: int) -> int:
        """Rows of ``table`` changed at versions > ``since_version`` (vectorized count)."""
        t = self.table(table)
        with t.lock:
            return int(np.count_nonzero((t.row_ids != -1) & (t.row_version > since_version)))

    def remove_ids(self, table: str, ids: np.ndarray) -> int:
        """Remove the rows of ``ids`` that exist (replaying a delta checkpoint's removals).

        Not logged as evictions (like migration drops). Returns rows removed.
        """
        t = self.table(table)
        with t.lock:
            rows = t.lookup_rows(np.asarray(ids, dtype=np.int64))
            return t.drop_rows(rows[rows >= 0])

    def changed_rows(self, table: str, since_version: int) -> TableRows:
        """Rows changed at versions > since_version (all rows for since_version=0)."""
        t = self.table(table)
        with t.lock:
            return t.changed_rows(since_version)

    def removed_ids(self, table: str, since_version: int) -> np.ndarray:
        """Ids evicted at versions > since_version that have no row now."""
        t = self.table(table)
        with t.lock:
            return t.removed_ids(since_version)

    # -- all rows (checkpoints) ----------------------------------------------------
    def vshard_chunks(self, table: str, since_version: int | None = None) -> Iterator[tuple[int, TableRows]]:
        """Rows of ``table`` one vshard at a time (ascending vshard, rows in row order), each a copy.

        For streaming checkpoints: the caller holds :meth:`write_lock` for a
        consistent cut. Extra memory is one chunk plus a vshard index of the
        capacity (int16 when ``num_vshards`` fits, ~2 B/row) and its sort order
        (8 B per used row), never a copy of the table.

        Args:
            table: the table name (BadRequest when unknown).
            since_version: only rows changed at versions > this (a delta checkpoint's
                dirty rows); None = every row.
        """
        t = self.table(table)
        vs = self._vshard_index(t, since_version=since_version)
        if t.size == 0:
            return
        order = np.argsort(vs, kind="stable")  # radix sort for int16: O(C); skipped rows (-1) first
        n_skip = int(np.count_nonzero(vs < 0))
        order = order[n_skip:]
        if order.size == 0:
            return
        vs_sorted = vs[order]
        cuts = np.flatnonzero(vs_sorted[1:] != vs_sorted[:-1]) + 1
        del vs
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [order.size]])
        for lo, hi in zip(starts.tolist(), ends.tolist()):
            yield int(vs_sorted[lo]), t.export_rows(order[lo:hi])

    def _vshard_index(self, t: EmbeddingTable, block: int = 1 << 22, since_version: int | None = None) -> np.ndarray:
        """vshard of every row of ``t`` (-1 for free rows, and for clean rows when
        ``since_version`` is given), computed block by block."""
        dt = np.int16 if self.num_vshards < (1 << 15) else np.int32
        vs = np.full(t.capacity, -1, dtype=dt)
        for lo in range(0, t.capacity, block):
            ids = t.row_ids[lo : lo + block]
            keep = ids != -1  # -1 = free row (negative ids are ids)
            if since_version is not None:
                keep &= t.row_version[lo : lo + block] > since_version
            used = np.flatnonzero(keep)
            if used.size:
                vs[lo + used] = vshard_of(ids[used], self.num_vshards).astype(dt)
        return vs

    def all_rows(self, table: str) -> TableRows:
        t = self.table(table)
        with t.lock:
            return t.export_rows(t.used_rows())

    # -- introspection -------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes allocated by all tables (rows, state, map, metadata) and dense params."""
        return int(sum(t.memory_bytes() for t in self.tables.values()) + self.dense.memory_bytes())

    def stats(self) -> dict[str, Any]:
        """Per table: rows, capacity, fill, admissions, evictions, drops, pulls, pushes, bytes (a JSON document)."""
        tables: dict[str, dict[str, int | float | str]] = {}
        for name, t in self.tables.items():
            with t.lock:
                tables[name] = t.stats()
        return {
            "shard": self.shard_id,
            "version": self._version,
            "device": self.device,
            "tables": tables,
            "dense_params": len(self.dense.names()),
            "bytes": self.memory_bytes(),
        }


def check_table_ids(table: str, ids: np.ndarray) -> np.ndarray:
    """Validate ids for ``table`` (re-exported for the service's early checks)."""
    return check_ids(table, ids)
