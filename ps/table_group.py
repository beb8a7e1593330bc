"""A step of many tables as one lookup, one gather and one fused update.

A :class:`TableGroup` holds the tables of one :class:`ps.table_storage.GroupStorage`
(same dim, optimizer and clipping; :mod:`ps.grouping`). A pull or a push names
its ids table by table, concatenated in storage order, with a count per table
(0 for a table not in the request)::

    counts  [3, 0, 2]                 (user, item, tag)
    ids     [u1 u2 u3 | t1 t2]        int64 [N], each table's ids unique
      | one fbgemm hash-map lookup over every table's slots (per-table slot offsets)
      v
    rows    local row + the table's base = storage row (-1: unknown)
      pull: one gather of the storage's weights (unknown ids: their initial rows, per table)
      push: new ids get rows table by table (admission, eviction, init: only tables that have any),
            then one clip, one optimizer update and one metadata write over all rows

Every table's counters, step, admission, eviction and delivery versions are
kept as its own push would keep them: a group push leaves the tables exactly as
``EmbeddingTable.push`` called table by table does (tests/ps/test_table_group.py
checks weights, optimizer state and metadata for every optimizer kind). Rare
inputs take that per-table path itself: a non-finite gradient (its
``nonfinite_grads`` rules), or, on an ``untrusted`` push, ids repeated inside a
table (they are summed there).

One lookup per step: a pull remembers its lookup (counts, ids, storage rows and the group's id-map
generation, ``GroupStorage.map_generation``); the next push of exactly those ids uses those rows
when no id map of the group changed in between (an insert, an eviction, a removal, a rebuild
moves the generation on), else looks up again. A fleet step's push of batch t follows its pull
of batch t (the message before), so a 1-worker fleet and the in-process loop look up once.

``trusted`` callers (an in-process worker: its ids come from the Meta-IO
reader's sorted unique ids and its gradients from its own backward) skip the
duplicate check; the gradients' finiteness is checked once for the whole step
either way. The wire path (``ps/servicer.py``) keeps every check of its own and
calls with ``trusted=False``.

Thread safety: callers hold :attr:`TableGroup.lock` (the storage's, shared by
its tables).

Example::

    g = TableGroup([TableConfig("user", capacity=100), TableConfig("tag", capacity=100)], seed=0)
    counts = np.array([2, 1]); ids = torch.tensor([3, 7, 9])
    g.push(counts, ids, torch.ones(3, 16), trusted=True)
    g.pull(counts, ids)          # float32 [3, 16]
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

from common.log import kv
from ps import intra_op
from ps.config import NonfiniteMode, TableConfig
from ps.embedding_table import EmbeddingTable, PushResult
from ps.initializer import TablesInitializer
from ps.optimizers import clip_rows_mask
from ps.table_storage import GroupStorage

__all__ = ["TableGroup"]

log = logging.getLogger(__name__)

_I32_MAX = np.iinfo(np.int32).max


class TableGroup:
    """The tables of one storage and their batched pull and push.

    Args:
        cfgs: the tables (validated by their EmbeddingTable), one storage key.
        seed: job seed (initial rows, admission).
        device: "cpu" or "cuda".
    """

    def __init__(self, cfgs: Sequence[TableConfig], *, seed: int = 0, device: str = "cpu") -> None:
        for c in cfgs:
            c.validate()
        self.storage = GroupStorage(cfgs, device)
        self.tables: list[EmbeddingTable] = [
            EmbeddingTable(c, seed=seed, device=device, storage=self.storage, index=i) for i, c in enumerate(cfgs)
        ]
        self.names: tuple[str, ...] = tuple(c.name for c in cfgs)
        self.lock = self.storage.lock
        self.dim = self.storage.dim
        self.device = self.storage.device
        self._bases = torch.from_numpy(self.storage.bases[:-1].copy())
        self._table_ids = torch.arange(len(self.tables), dtype=torch.int64)
        self._init = TablesInitializer([t.init for t in self.tables])
        self._init.warm()  # the initializer's tables: built now (once per process), not in the first pull
        self._memo: tuple[np.ndarray, torch.Tensor, torch.Tensor, int] | None = None
        """The last pull's (counts, ids, storage rows, map generation): its push reuses the rows."""

    # -- lookup ---------------------------------------------------------------------
    def _offsets(self, counts: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

    def lookup(self, counts: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
        """Storage rows of ``ids`` (-1 where an id has no row): one hash-map lookup for every table.

        Args:
            counts: int64 [tables]: how many of ``ids`` belong to each table, in storage order.
            ids: int64 [N] CPU, table by table.
        """
        n = int(ids.numel())
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        counts_t = torch.from_numpy(counts)
        if len(intra_op.spans(n)) > 1:  # [ps] intra_op_threads: each table's lookup span by span
            parts, lo = [], 0
            for t, c in zip(self.tables, counts.tolist()):
                if c:
                    parts.append(t._lookup(ids[lo : lo + c]))
                    lo += c
            local = torch.cat(parts)
        else:
            local = torch.ops.fbgemm.pruned_hashmap_lookup(
                ids, self._offsets(counts), self.storage.map_slots, self.storage.map_offsets
            ).clamp_(min=-1)  # tombstones (-2) read as unknown
        base = torch.repeat_interleave(self._bases, counts_t, output_size=n)
        if int(local.min()) >= 0:
            return local.add_(base)
        return torch.where(local >= 0, local + base, local)

    def _owners(self, counts: np.ndarray, n: int) -> torch.Tensor:
        """int64 [n]: the table (index in the group) of each id of a request."""
        return torch.repeat_interleave(self._table_ids, torch.from_numpy(counts), output_size=n)

    def _spans(self, counts: np.ndarray) -> list[tuple[int, int, int]]:
        """(table index, start, stop) of every table present in a request."""
        out, lo = [], 0
        for i, c in enumerate(counts.tolist()):
            if c:
                out.append((i, lo, lo + c))
                lo += c
        return out

    # -- pull -----------------------------------------------------------------------
    def pull(self, counts: np.ndarray, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, dim] rows of ``ids`` (CPU); unknown ids read as their initial rows.

        Args:
            counts: int64 [tables] ids per table, storage order (0: the table is not in the request).
            ids: int64 [N] CPU, table by table; ids -1 must have been refused by the caller.
            out: float32 [N, dim] CPU, contiguous, to write the rows into (returned); None: a new tensor.
        """
        n = int(ids.numel())
        spans = self._spans(counts)
        for i, lo, hi in spans:
            c = self.tables[i].counters
            c["pulls"] += 1
            c["pull_ids"] += hi - lo
        if out is None:
            out = torch.empty((n, self.dim), dtype=torch.float32)
        if n == 0:
            return out
        rows = self.lookup(counts, ids)
        self._memo = (counts.copy(), ids.clone(), rows, int(self.storage.map_generation[0]))
        if int(rows.min()) >= 0:  # every id known (the common case)
            self._gather(rows, out)
            return out
        known = rows >= 0
        if bool(known.any()):
            kn = known.nonzero().squeeze(1)
            out.index_copy_(0, kn, self._gather(rows.index_select(0, kn)))
        unknown = np.flatnonzero((~known).numpy())  # their initial rows, every table in one call
        owner = self._owners(counts, n).numpy()[unknown]
        out[torch.from_numpy(unknown)] = torch.from_numpy(self._init(owner, ids.numpy()[unknown]))
        return out

    def _pulled_rows(self, counts: np.ndarray, ids: torch.Tensor) -> torch.Tensor | None:
        """The rows the last pull looked up for exactly these ``counts`` and ``ids``, when no id map of
        the group changed since (its generation is the same); None otherwise. Used once: a fleet
        step pulls a batch's ids, then pushes their gradients (one lookup instead of two)."""
        memo, self._memo = self._memo, None
        if memo is None or memo[3] != int(self.storage.map_generation[0]):
            return None
        m_counts, m_ids, rows, _ = memo
        if not (np.array_equal(m_counts, counts) and torch.equal(m_ids, ids)):
            return None
        return rows

    def _gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Weights of storage ``rows`` (CPU float32), span by span under ``[ps] intra_op_threads``."""
        w = self.storage.weights
        if self.device.type != "cpu":
            got = w.index_select(0, rows.to(self.device)).cpu()
            if out is None:
                return got
            out.copy_(got)
            return out
        if out is None:
            out = torch.empty((int(rows.numel()), self.dim), dtype=torch.float32)
        intra_op.run(int(rows.numel()), lambda lo, hi: torch.index_select(w, 0, rows[lo:hi], out=out[lo:hi]))
        return out

    # -- push -----------------------------------------------------------------------
    def push(self, counts: np.ndarray, ids: torch.Tensor, grads: torch.Tensor, *, trusted: bool,
             nonfinite: NonfiniteMode = NonfiniteMode.REJECT) -> list[PushResult]:
        """Apply ``grads`` float32 [N, dim] to ``ids``: what each table's push would do, in one pass.

        Args:
            counts: int64 [tables] ids per table, storage order.
            ids: int64 [N] CPU, table by table, no -1.
            grads: float32 [N, dim] CPU (rows of different requests must not share memory with the store).
            trusted: the caller guarantees each table's ids unique (an in-process worker); False: checked,
                and a table whose ids repeat is pushed on its own (duplicates summed).
            nonfinite: the shard's ``nonfinite_grads`` mode (applies when a gradient is NaN/Inf).

        Returns:
            one PushResult per table of the request (tables with count 0 left out), in storage order.

        Raises:
            BadRequest: a NaN/Inf gradient under "reject" (the table's own message); no table
                of the request is changed then.
        """
        spans = self._spans(counts)
        n = int(ids.numel())
        if n == 0:
            return [PushResult() for _ in spans]
        lo_g, hi_g = torch.aminmax(grads)
        if not (bool(torch.isfinite(lo_g)) and bool(torch.isfinite(hi_g))):
            return self._push_each(spans, ids, grads, nonfinite)
        gmax = float(torch.maximum(-lo_g, hi_g))
        rows = self._pulled_rows(counts, ids)
        if rows is None:
            rows = self.lookup(counts, ids)
        new_pos: dict[int, np.ndarray | None] = {}
        if not trusted:
            found = self._unique_request(spans, ids, rows)
            if found is None:  # some table's ids repeat: its push sums them
                return self._push_each(spans, ids, grads, nonfinite)
            new_pos = found
        results = [PushResult() for _ in spans]
        for i, lo, hi in spans:
            t = self.tables[i]
            t.step += 1
            t.counters["pushes"] += 1
            t.counters["push_ids"] += hi - lo
        if int(rows.min()) < 0:
            self._insert(spans, ids, rows, results, new_pos)
        live = rows >= 0
        all_live = bool(live.all())
        g = grads
        tid: torch.Tensor | None = None
        if not all_live:
            tid = self._owners(counts, n)[live]
            rows, g = rows[live], g[live]
        cfg = self.tables[0].cfg
        clipped_rows: torch.Tensor | None = None
        if rows.numel():
            g, clipped_rows = clip_rows_mask(g, cfg.grad_clip_norm, cfg.grad_clip_value)
        ok = None
        if rows.numel():
            known_max = gmax if g is grads else None  # filtered or clipped: not grads' max
            ok = self.storage.optimizer.apply(rows.to(self.device), g.to(self.device), grad_absmax=known_max)
        if tid is None and (ok is not None or clipped_rows is not None):
            tid = self._owners(counts, n)
        if clipped_rows is not None and bool(clipped_rows.any()):
            assert tid is not None
            per = torch.bincount(tid[clipped_rows], minlength=len(self.tables)).tolist()
            for i, _, _ in spans:
                self.tables[i].counters["grad_clipped"] += per[i]
        if ok is not None and not bool(ok.all()):
            assert tid is not None
            ok = ok.cpu()
            bad = torch.bincount(tid[~ok], minlength=len(self.tables)).tolist()
            for k, (i, _, _) in enumerate(spans):
                if bad[i]:
                    self._count_update_dropped(self.tables[i], results[k], bad[i], rows, ok, tid, i)
            rows, tid = rows[ok], tid[ok]
        if tid is None:
            for k, (i, lo, hi) in enumerate(spans):
                results[k].applied = hi - lo
        else:
            per = torch.bincount(tid, minlength=len(self.tables)).tolist()
            for k, (i, _, _) in enumerate(spans):
                results[k].applied = per[i]
        if rows.numel():
            self._stamp(rows.numpy(), spans, tid, counts)
        return results

    def _count_update_dropped(self, t: EmbeddingTable, res: PushResult, n_bad: int, rows: torch.Tensor,
                              ok: torch.Tensor, tid: torch.Tensor, i: int) -> None:
        """Count (and log, at powers of two) the rows of table ``t`` whose update would be NaN/Inf."""
        res.update_nonfinite_dropped = n_bad
        if t._count_rare("update_nonfinite_dropped", n_bad):
            first_row = int(rows[(~ok) & (tid == i)][0]) - t.base
            log.warning(
                "updates that would be NaN/Inf not written",
                extra=kv(table=t.name, rows=n_bad, first_id=int(t.row_ids[first_row]),
                         total=t.counters["update_nonfinite_dropped"]),
            )

    def _stamp(self, rows: np.ndarray, spans: list[tuple[int, int, int]], tid: torch.Tensor | None,
               counts: np.ndarray) -> None:
        """Metadata of the updated storage ``rows``: push count +1 (saturating), each table's step, the version."""
        st = self.storage
        f = st.freq[rows]
        f += f < _I32_MAX  # +1 saturating at int32's max, in int32 (no int64 copies)
        st.freq[rows] = f
        steps = np.array([t.step for t in self.tables], dtype=np.int32)
        versions = {self.tables[i].current_version for i, _, _ in spans}
        if len({int(steps[i]) for i, _, _ in spans}) == 1:
            st.last_step[rows] = steps[spans[0][0]]
        elif tid is None:
            st.last_step[rows] = np.repeat(steps, counts)
        else:
            st.last_step[rows] = steps[tid.numpy()]
        if len(versions) == 1:
            st.row_version[rows] = versions.pop()
        else:
            vers = np.array([t.current_version for t in self.tables], dtype=np.int32)
            st.row_version[rows] = np.repeat(vers, counts) if tid is None else vers[tid.numpy()]

    def _insert(self, spans: list[tuple[int, int, int]], ids: torch.Tensor, rows: torch.Tensor,
                results: list[PushResult], new_pos: dict[int, np.ndarray | None]) -> None:
        """Rows for the unknown ids (``rows`` updated in place, storage rows).

        Tables admitting at once with room to spare (the usual case) are served together:
        each takes its rows off its free list, then one initial-rows call, one weights
        write, one optimizer reset, one metadata write and one multi-table id-map insert
        for all of them. A table with an admission rule or too few free rows (eviction)
        goes through its own ``insert_new``. Either way every table ends as its own push
        would leave it (rows from its free list in id order, the same values).
        """
        r = rows.numpy()
        batch: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # (table, first position, positions, local rows)
        starts = np.fromiter((lo for _, lo, _ in spans), dtype=np.int64, count=len(spans))
        has_new = np.add.reduceat(r < 0, starts) > 0  # one pass: which tables have unknown ids
        for k in np.flatnonzero(has_new).tolist():
            i, lo, hi = spans[k]
            part = r[lo:hi]
            t = self.tables[i]
            pos = new_pos.get(i)
            if pos is None:
                pos = np.flatnonzero(part < 0)  # increasing, and the ids are sorted: id order
            if not t.cfg.admission.immediate or pos.size > t.n_free:
                local = torch.where(rows[lo:hi] >= 0, rows[lo:hi] - t.base, rows[lo:hi])
                t.insert_new(ids[lo:hi], local, results[k], new_pos.get(i))
                rows[lo:hi] = torch.where(local >= 0, local + t.base, local)
                continue
            m = int(pos.size)
            local_rows = t.take_free_rows(m)
            t.id_map.reserve(m)
            results[k].admitted = m
            t.counters["admissions"] += m
            batch.append((i, lo, pos, local_rows))
        if batch:
            self._alloc_many(batch, ids.numpy(), r)

    def _alloc_many(self, batch: list[tuple[int, int, np.ndarray, np.ndarray]], ids: np.ndarray, r: np.ndarray) -> None:
        """Initial rows, optimizer state, metadata and id-map entries of new ids of several tables at once.

        Args:
            batch: per table (in group order): its index, its first position in the request, the
                positions (in its span, id order) of its new ids, and the rows taken for them.
            ids: the request's ids.
            r: the request's storage rows, written at the new ids' positions.
        """
        st = self.storage
        at = np.concatenate([lo + pos for _, lo, pos, _ in batch])
        new_ids = ids[at]
        owner = np.concatenate([np.full(pos.size, i, dtype=np.int64) for i, _, pos, _ in batch])
        local = np.concatenate([lr for _, _, _, lr in batch])
        g = local + st.bases[:-1][owner]
        vals = torch.from_numpy(self._init(owner, new_ids))
        lo_v, hi_v = torch.aminmax(vals)
        g_t = torch.from_numpy(g).to(self.device)
        st.weights.index_copy_(0, g_t, vals.to(self.device))
        st.optimizer.reset_rows(g_t)
        st.optimizer.rows_initialized(g_t, max(-float(lo_v), float(hi_v)))
        st.row_ids[g] = new_ids
        st.freq[g] = 0
        st.last_step[g] = np.array([t.step for t in self.tables], dtype=np.int32)[owner]
        st.row_version[g] = np.array([t.current_version for t in self.tables], dtype=np.int32)[owner]
        counts = np.zeros(len(self.tables), dtype=np.int64)
        for i, _, pos, _ in batch:
            counts[i] = pos.size
        st.map_generation[0] += 1
        torch.ops.fbgemm.pruned_hashmap_insert(torch.from_numpy(new_ids), torch.from_numpy(local), self._offsets(counts),
                                               st.map_slots, st.map_offsets)
        r[at] = g

    def _unique_request(self, spans: list[tuple[int, int, int]], ids: torch.Tensor,
                        rows: torch.Tensor) -> dict[int, np.ndarray | None] | None:
        """Whether every table's ids are unique (known ids: their storage rows; unknown: sorted).

        Returns None when some table's ids repeat, else table index -> the positions of its
        unknown ids in ascending id order (``EmbeddingTable.insert_new``'s ``new_pos``).
        """
        r = rows.numpy()
        known = r >= 0
        n_known = int(np.count_nonzero(known))
        if n_known > 1:  # rows of different tables differ: unique known ids <=> unique storage rows
            kr = r if n_known == r.size else r[known]
            last = self.storage.last_step
            saved = last[kr]
            pos = np.arange(n_known, dtype=np.int32)
            last[kr] = pos
            dup = not np.array_equal(last[kr], pos)
            last[kr] = saved  # duplicates saved the same value: restored exactly
            if dup:
                return None
        out: dict[int, np.ndarray | None] = {}
        if n_known == r.size:
            return out
        ids_np = ids.numpy()
        # One pass over every table's unknown ids: when each table's run is strictly increasing (a
        # reader's unique ids are sorted), they are unique and already in insertion order.
        miss_all = np.flatnonzero(~known)
        starts = np.fromiter((lo for _, lo, _ in spans), dtype=np.int64, count=len(spans))
        owner = np.searchsorted(starts, miss_all, side="right") - 1
        new_ids = ids_np[miss_all]
        same = owner[1:] == owner[:-1]
        if bool((new_ids[1:][same] > new_ids[:-1][same]).all()):
            cuts = np.flatnonzero(~same) + 1
            for k, run in zip(owner[np.concatenate(([0], cuts))].tolist(), np.split(miss_all, cuts)):
                i, lo, _ = spans[k]
                out[i] = run - lo
            return out
        for i, lo, hi in spans:  # some table's unknown ids are out of order (or repeat): table by table
            miss = np.flatnonzero(~known[lo:hi])
            if not miss.size:
                continue
            new_ids = ids_np[lo:hi][miss]
            if new_ids.size > 1 and not bool((new_ids[1:] > new_ids[:-1]).all()):
                order = np.argsort(new_ids)
                srt = new_ids[order]
                if bool((srt[1:] == srt[:-1]).any()):
                    return None
                miss = miss[order]
            out[i] = miss
        return out

    def _push_each(self, spans: list[tuple[int, int, int]], ids: torch.Tensor, grads: torch.Tensor,
                   nonfinite: NonfiniteMode) -> list[PushResult]:
        """The per-table path (non-finite gradients, repeated ids): each table's own push, in order.

        Under "reject", a table with a NaN/Inf gradient is found first and its push raises
        before any table of the request is changed.
        """
        ids_np, g_np = ids.numpy(), grads.numpy()
        if NonfiniteMode(nonfinite) == NonfiniteMode.REJECT:
            for i, lo, hi in spans:
                if not bool(torch.isfinite(grads[lo:hi]).all()):
                    self.tables[i].push(ids_np[lo:hi], g_np[lo:hi], nonfinite)  # raises; the table is unchanged
        return [self.tables[i].push(ids_np[lo:hi], g_np[lo:hi], nonfinite) for i, lo, hi in spans]
