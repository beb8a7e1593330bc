"""One embedding table of one PS shard: fbgemm TBE rows + id map + metadata.

Layout (C = capacity rows, D = dim)::

    TBE weights      float32 [C, D]     SplitTableBatchedEmbeddingBagsCodegen
                                         (HOST/CPU, or DEVICE/CUDA)
    optimizer state  see ps.optimizers  (rows aligned with the weights)
    IdMap            id -> row          fbgemm pruned hash map, 1.5 C slots
    row_ids          int64 [C]          id held by each row, -1 = free
    freq             int32 [C]          pushes that touched the row (LFU)
    last_step        int32 [C]          table step of the last touching push (TTL)
    version          int32 [C]          store version of the last change (deltas)
    free             int32 [C]          stack of free rows (free[:n_free])
    Admission        count-min sketch   bounded; only when admission is not immediate

A push (ids may repeat) runs: validate -> sum duplicates (a request of unique
ids, detected without a sort, skips the sort and the sum) -> NaN/Inf check ->
look up rows -> admission of unknown ids -> evict if full -> init new rows ->
gradient clip (``grad_clip_value`` / ``grad_clip_norm``, per row) ->
fused/torch optimizer on the touched rows (rows whose update would be NaN/Inf
are left unchanged and counted, see ps.optimizers) -> metadata.

Stored weights and optimizer state are always finite: pushes screen their
updates, imports refuse NaN/Inf. A pull for an fp16 wire (``pull(ids,
fp16=True)``) saturates values beyond the fp16 range to +-65504 and counts
them (``fp16_saturated``): fp16 has no finite value above 65504, and an Inf
on the wire would poison the worker's forward pass. Everything is vectorized
(torch / numpy / fbgemm ops); nothing loops per id in Python.

Thread safety: the table itself is not locked; :class:`ps.shard_store.ShardStore`
holds ``table.lock`` around every call.

Example::

    t = EmbeddingTable(TableConfig(name="user", dim=8, capacity=100), seed=0)
    t.push(np.array([3, 3, 5]), np.ones((3, 8), np.float32))
    t.pull(np.array([3, 9]))      # row of 3 (updated), initial value of 9
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from common.log import kv
from ps import intra_op
from ps.admission import Admission
from ps.config import NonfiniteMode, TableConfig
from ps.errors import BadRequest
from ps.eviction import pick_victims
from ps.id_map import IdMap
from ps.initializer import RowInitializer
from ps.optimizers import clip_rows
from ps.rows import TableRows as TableRows  # re-exported: the rows this table imports and exports
from ps.table_storage import GroupStorage

log = logging.getLogger(__name__)

_REMOVED_LOG_MIN = 1 << 16
FREE = -1
"""``row_ids`` of a free row (id -1 is refused; every other int64, negative too, is an id)."""
FP16_MAX = 65504.0
"""Largest finite float16; pulls for an fp16 wire saturate to +-FP16_MAX."""


@dataclass
class PushResult:
    """What one push did (counts of unique ids, after summing duplicates).

    Args:
        applied: ids whose rows were updated.
        unadmitted_dropped: ids not (yet) admitted; their gradients were dropped.
        nonfinite_dropped: ids dropped because their gradient held NaN/Inf ("drop" mode).
        update_nonfinite_dropped: rows not updated because the update would have made
            their weight or optimizer state NaN/Inf (finite but huge gradients); the
            rows keep their previous value. Counted in every ``nonfinite_grads`` mode.
        evicted: rows evicted to make room.
        admitted: ids that got a new row in this push.
        full_dropped: admitted ids dropped because the table was full and nothing
            could be evicted (eviction policy "none", or all rows in this push).
    """

    applied: int = 0
    unadmitted_dropped: int = 0
    nonfinite_dropped: int = 0
    evicted: int = 0
    admitted: int = 0
    full_dropped: int = 0
    update_nonfinite_dropped: int = 0

    def add(self, other: "PushResult") -> "PushResult":
        return PushResult(**{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__})


def check_ids(table: str, ids: object, what: str = "ids", pad: bool = True) -> np.ndarray:
    """Validate an id array: numpy int64, 1-D, no -1. Returns it (raises BadRequest).

    Args:
        table: the table's name (for the message).
        ids: what the caller sent.
        what: the field's name (for the message).
        pad: also refuse id -1 (False: the caller scans a whole request for -1 once, and calls
            again with True for the table that holds one, for its message).
    """
    if not isinstance(ids, np.ndarray):
        raise BadRequest(f"table '{table}': {what} must be a numpy int64 array, got {type(ids).__name__}")
    if ids.dtype != np.int64:
        raise BadRequest(f"table '{table}': {what} must be int64, got {ids.dtype}")
    if ids.ndim != 1:
        raise BadRequest(f"table '{table}': {what} must be 1-D, got shape {ids.shape}")
    if pad and ids.size and bool((ids == -1).any()):
        pos = int(np.argmax(ids == -1))
        raise BadRequest(f"table '{table}': {what}[{pos}] is -1 (the padding id is not a real id)")
    return ids


class EmbeddingTable:
    """One table of one shard (see the module docstring).

    Args:
        cfg: the table's config.
        seed: job seed (initial rows, admission).
        device: "cpu" or "cuda".
        storage: the group storage holding this table's rows (``ps.table_group``); None: a
            storage of its own (base row 0).
        index: this table's position in ``storage``.
    """

    def __init__(self, cfg: TableConfig, *, seed: int = 0, device: str = "cpu", storage: GroupStorage | None = None,
                 index: int = 0) -> None:
        cfg.validate()
        if storage is None:
            storage, index = GroupStorage([cfg], device), 0
        elif storage.cfgs[index] != cfg:
            raise ValueError(f"table '{cfg.name}' is not table {index} of its storage "
                             f"({storage.cfgs[index].name!r} is)")
        span = storage.span(index)
        self.cfg = cfg
        self.name = cfg.name
        self.dim = cfg.dim
        self.capacity = cfg.capacity
        self.seed = int(seed)
        self.device = torch.device(device)
        self.storage = storage
        """The storage this table's rows live in (shared with its group, ``ps.table_storage``)."""
        self.index = index
        self.base = span.base
        """This table's first row in the storage: the optimizer, which owns every row of it, takes ``base + row``."""
        self.lock = storage.lock  # one lock per storage: its tables share the optimizer
        self.tbe = storage.tbe
        self.weights: torch.Tensor = span.weights  # [capacity, dim] view of the storage's weights
        self.optimizer = storage.optimizer
        self.id_map = IdMap(cfg.capacity, slots=span.map_slots, generation=storage.map_generation)
        self.init = RowInitializer(cfg.name, cfg.dim, cfg.init, cfg.init_scale, self.seed)
        self.admission = Admission(cfg.admission, cfg.capacity, self.seed)
        c = cfg.capacity
        # per-row metadata (written at random rows by every push): views of the storage's arrays
        self.row_ids = span.row_ids
        self.freq = span.freq
        self.last_step = span.last_step
        self.row_version = span.row_version
        self._free = np.arange(c - 1, -1, -1, dtype=np.int32)  # pop from the end: rows 0, 1, 2, ...
        self._n_free = c
        self.step = 0
        self.current_version = 1
        self._removed: list[tuple[int, np.ndarray]] = []
        self._removed_n = 0
        self._removed_floor = 0  # removals at versions <= floor were forgotten
        self.counters = {
            "admissions": 0,
            "evictions": 0,
            "unadmitted_dropped": 0,
            "nonfinite_dropped": 0,
            "update_nonfinite_dropped": 0,
            "grad_clipped": 0,
            "fp16_saturated": 0,
            "full_dropped": 0,
            "pulls": 0,
            "pull_ids": 0,
            "pushes": 0,
            "push_ids": 0,
        }

    def _count_rare(self, counter: str, n: int) -> bool:
        """Add ``n`` to a counter; True when the total reached a new power of two (log then, not always)."""
        old = self.counters[counter]
        self.counters[counter] = old + n
        return n > 0 and (old + n).bit_length() > old.bit_length()

    def global_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Storage rows of this table's ``rows`` (what the shared optimizer takes): ``base + rows``.

        Args:
            rows: int64 table rows, >= 0.
        """
        return rows if self.base == 0 else rows + self.base

    # -- sizes ---------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Rows in use."""
        return self.capacity - self._n_free

    def memory_bytes(self) -> int:
        """Bytes allocated for this table (rows, optimizer state, map, metadata, sketch)."""
        w = self.weights.numel() * self.weights.element_size()
        meta = self.row_ids.nbytes + self.freq.nbytes + self.last_step.nbytes + self.row_version.nbytes
        state = sum(t[0:1].numel() * t.element_size() for t in self.optimizer.state_tensors().values()) * self.capacity
        return int(w + state + self.id_map.memory_bytes() + meta + self._free.nbytes + self.admission.memory_bytes())

    def raw_bytes_per_row(self) -> int:
        """Bytes of one row's weights + optimizer state (the 'raw' payload)."""
        return int(
            self.dim * 4
            + sum(t[0:1].numel() * t.element_size() for t in self.optimizer.state_tensors().values())
        )

    # -- reads ---------------------------------------------------------------------
    def lookup_rows(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id (-1 when the id has no row)."""
        return self.id_map.lookup(ids).numpy()

    def pull(self, ids: np.ndarray, fp16: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """float32 [n, dim] rows of ``ids`` (duplicates ok); unknown ids read as their initial value.

        Args:
            ids: int64 [n].
            fp16: the rows go on an fp16 wire: values beyond +-65504 (no finite
                float16 holds them) are saturated to +-65504, counted in the
                ``fp16_saturated`` counter (values, not rows).
            out: float32 [n, dim] C-contiguous to write the rows into (e.g. a reply
                buffer, ``ps.reply_buffer``); returned. None: a new array.
        """
        out = self._pull(ids, out)
        if fp16:
            self.saturate_fp16(out)
        return out

    def saturate_fp16(self, rows: np.ndarray) -> None:
        """Clamp ``rows`` (float32, pulled for an fp16 wire) to +-65504 in place, counting the values changed."""
        if not rows.size:
            return
        t = torch.from_numpy(rows)
        lo, hi = torch.aminmax(t)
        if float(hi) > FP16_MAX or float(lo) < -FP16_MAX:
            over = int((t.abs() > FP16_MAX).sum())
            t.clamp_(-FP16_MAX, FP16_MAX)
            if self._count_rare("fp16_saturated", over):
                log.warning(
                    "pulled values beyond the fp16 range saturated",
                    extra=kv(table=self.name, values=over, total=self.counters["fp16_saturated"],
                             max_abs=max(float(hi), -float(lo)), limit=FP16_MAX),
                )

    def check_pull_out(self, out: np.ndarray, n: int) -> None:
        """Refuse (BadRequest) a pull output that is not writable C-contiguous float32 [n, dim]."""
        if (out.shape != (n, self.dim) or out.dtype != np.float32 or not out.flags.c_contiguous
                or not out.flags.writeable):
            raise BadRequest(f"table '{self.name}': pull output must be writable C-contiguous float32 "
                             f"({n}, {self.dim}), got {out.dtype} {out.shape}")

    def _pull(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        check_ids(self.name, ids)
        n = ids.shape[0]
        if out is not None:
            self.check_pull_out(out, n)
        self.counters["pulls"] += 1
        self.counters["pull_ids"] += n
        if n == 0:
            return np.empty((0, self.dim), dtype=np.float32) if out is None else out
        if self.device.type == "cpu" and len(intra_op.spans(n)) > 1:
            # [ps] intra_op_threads: the same work span by span on several threads
            buf = np.empty((n, self.dim), dtype=np.float32) if out is None else out
            intra_op.run(n, lambda lo, hi: self._pull_rows(ids[lo:hi], buf[lo:hi]))
            return buf
        return self._pull_rows(ids, out)

    def _pull_rows(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The rows of ``ids`` (checked, no -1): known ones gathered, unknown ones initial.

        Args:
            ids: int64 [k].
            out: float32 [k, dim] C-contiguous (a span of the reply), or None for a new array.
        """
        rows = self.id_map.lookup(ids, checked=True)
        if int(rows.min()) >= 0:  # every id known (the common case): one reduction, no mask
            return self._gather(rows, out)
        known = rows >= 0
        n_known = int(known.sum())
        if out is None:
            out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        kn = known.numpy()
        if n_known:
            out[kn] = self._gather(rows[known])
        out[~kn] = self.init(ids[~kn])
        return out

    def _gather(self, rows: torch.Tensor, out: np.ndarray | None = None) -> np.ndarray:
        """The rows' weights; with ``out`` (float32 [k, dim]) written there by one ``index_select(out=)``."""
        if out is not None and self.device.type == "cpu":
            torch.index_select(self.weights, 0, rows, out=torch.from_numpy(out))
            return out
        got: np.ndarray = self.weights.index_select(0, rows.to(self.device)).detach().cpu().numpy()
        if out is not None:
            out[...] = got
            return out
        return got

    # -- push ----------------------------------------------------------------------
    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``id_map.lookup(ids)``, span by span on several threads under ``[ps] intra_op_threads``.

        Args:
            ids: int64 [n] CPU.
        """
        parts = intra_op.run(int(ids.numel()), lambda lo, hi: self.id_map.lookup(ids[lo:hi]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def check_push(self, ids: object, grads: object, pad: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Validate a push (raises BadRequest naming the problem); returns (ids, grads[n, dim]).

        Args:
            ids: int64 [n].
            grads: float32 [n, dim] or [n * dim].
            pad: also refuse id -1 (:func:`check_ids`).
        """
        ids = check_ids(self.name, ids, pad=pad)
        n = ids.shape[0]
        if not isinstance(grads, np.ndarray):
            raise BadRequest(f"table '{self.name}': grads must be a numpy float32 array, got {type(grads).__name__}")
        if grads.dtype != np.float32:
            raise BadRequest(f"table '{self.name}': grads must be float32, got {grads.dtype}")
        if grads.shape == (n, self.dim):
            g = grads
        elif grads.ndim == 1 and grads.shape[0] == n * self.dim:
            g = grads.reshape(n, self.dim)
        else:
            raise BadRequest(
                f"table '{self.name}': grads shape {grads.shape} does not match ids [{n}] x dim {self.dim} "
                f"(expected ({n}, {self.dim}) or ({n * self.dim},))"
            )
        return ids, g

    def push(self, ids: np.ndarray, grads: np.ndarray, nonfinite: NonfiniteMode = NonfiniteMode.REJECT) -> PushResult:
        """Apply gradients (duplicates summed). Raises BadRequest before changing anything."""
        ids, g = self.check_push(ids, grads)
        res = PushResult()
        n = ids.shape[0]
        if n == 0:
            return res
        # read-only inputs (np.frombuffer over a request) are copied: torch refuses to alias them silently
        ids_t = torch.from_numpy(ids if ids.flags.writeable else ids.copy())
        g_t = torch.from_numpy(g if g.flags.writeable else g.copy())
        # fast path: a finite min and max mean every element is finite (NaN propagates through
        # both); only a non-finite one pays for the per-row checks. The optimizer's growth bound
        # needs max |g| too: it is this one when the gradients reach it unchanged (one pass fewer)
        lo, hi = torch.aminmax(g_t)
        all_ok = bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
        gmax: float | None = float(torch.maximum(-lo, hi)) if all_ok else None
        rows: torch.Tensor | None = None
        new_pos: np.ndarray | None = None
        if all_ok:
            # ids unique in the request (the usual case: clients deduplicate) need no sort and
            # no duplicate sum; the lookup is the one the push needs anyway
            rows = self._lookup(ids_t)
            new_pos = self._unique_request(ids, rows.numpy())
        if new_pos is not None:
            assert rows is not None
            uniq, agg = ids_t, g_t
        else:
            uniq, inv = torch.unique(ids_t, return_inverse=True)
            agg = torch.zeros((uniq.numel(), self.dim), dtype=torch.float32).index_add_(0, inv, g_t)
            all_ok = all_ok and bool(torch.isfinite(agg.sum()))
            if rows is not None:  # rows of the unique ids from the lookup above (duplicates agree)
                rows_u = torch.empty(uniq.numel(), dtype=torch.int64)
                rows_u[inv] = rows
                rows = rows_u
        if not all_ok:
            row_ok = torch.isfinite(g_t).all(dim=1)
            agg_ok = torch.isfinite(agg).all(dim=1)
        if not all_ok and (not bool(row_ok.all()) or not bool(agg_ok.all())):
            if NonfiniteMode(nonfinite) == NonfiniteMode.REJECT:
                if not bool(row_ok.all()):
                    bad = torch.nonzero(~row_ok).reshape(-1)
                    first = int(bad[0])
                    raise BadRequest(
                        f"table '{self.name}': {bad.numel()} gradient row(s) hold NaN/Inf, first at row {first} "
                        f"(id {int(ids[first])}); push rejected, table unchanged"
                    )
                bad_ids = uniq[~agg_ok]
                raise BadRequest(
                    f"table '{self.name}': summed gradients of {bad_ids.numel()} id(s) overflow to Inf, "
                    f"first id {int(bad_ids[0])}; push rejected, table unchanged"
                )
            bad_u = ~agg_ok
            bad_u[inv[~row_ok]] = True
            res.nonfinite_dropped = int(bad_u.sum())
            uniq, agg = uniq[~bad_u], agg[~bad_u]
            rows = None
            self.counters["nonfinite_dropped"] += res.nonfinite_dropped

        self.step += 1
        self.counters["pushes"] += 1
        self.counters["push_ids"] += n
        if rows is None:
            rows = self.id_map.lookup(uniq)
        self.insert_new(uniq, rows, res, new_pos)
        live = rows >= 0
        if not bool(live.all()):
            rows, agg, uniq = rows[live], agg[live], uniq[live]
        if rows.numel():
            agg, clipped = clip_rows(agg, self.cfg.grad_clip_norm, self.cfg.grad_clip_value)
            self.counters["grad_clipped"] += clipped
            known_max = gmax if agg is g_t else None  # summed, filtered or clipped: not g_t's max
            ok = self.optimizer.apply(self.global_rows(rows.to(self.device)), agg.to(self.device), grad_absmax=known_max)
            if ok is not None and not bool(ok.all()):
                ok = ok.cpu()
                res.update_nonfinite_dropped = int((~ok).sum())
                if self._count_rare("update_nonfinite_dropped", res.update_nonfinite_dropped):
                    log.warning(
                        "updates that would be NaN/Inf not written",
                        extra=kv(table=self.name, rows=res.update_nonfinite_dropped, first_id=int(uniq[~ok][0]),
                                 total=self.counters["update_nonfinite_dropped"]),
                    )
                rows = rows[ok]
        res.applied = int(rows.numel())
        if res.applied:
            r = rows.numpy()
            f = self.freq[r]
            f += f < np.iinfo(np.int32).max  # +1 saturating at int32's max, in int32 (no int64 copies)
            self.freq[r] = f
            self.last_step[r] = self.step
            self.row_version[r] = self.current_version
        return res

    # -- allocation / eviction -----------------------------------------------------
    def _unique_request(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
        """Whether the ids of a request are unique, without sorting the known ones.

        Known ids are unique iff their rows are: each known row is stamped with its
        position in ``last_step`` (saved first and put back, so nothing changes) and
        read back; a row stamped twice reads another position. The unknown ids are
        sorted (the insertion stage allocates rows in id order, as after ``torch.unique``).

        Args:
            ids: int64 [n] the request's ids.
            rows: int64 [n] their rows, -1 = unknown.

        Returns:
            None when some id repeats; else the positions of the unknown ids in
            ascending id order (for :meth:`insert_new`).
        """
        known = rows >= 0
        n_known = int(np.count_nonzero(known))
        kr = rows if n_known == rows.shape[0] else rows[known]
        if n_known > 1:
            saved = self.last_step[kr]
            pos = np.arange(n_known, dtype=np.int32)
            self.last_step[kr] = pos
            dup = not np.array_equal(self.last_step[kr], pos)
            self.last_step[kr] = saved  # duplicates saved the same value: restored exactly
            if dup:
                return None
        if n_known == rows.shape[0]:
            return np.empty(0, dtype=np.int64)
        new_pos = np.flatnonzero(~known)
        new_ids = ids[new_pos]
        if new_ids.shape[0] > 1 and not bool((new_ids[1:] > new_ids[:-1]).all()):  # (sorted: unique, in order)
            order = np.argsort(new_ids)
            srt = new_ids[order]
            if bool((srt[1:] == srt[:-1]).any()):
                return None
            new_pos = new_pos[order]
        return new_pos

    def insert_new(
        self, uniq: torch.Tensor, rows: torch.Tensor, res: PushResult, new_pos: np.ndarray | None = None
    ) -> None:
        """The insertion stage of a push: give the unknown ids among ``uniq`` rows.

        Admission (one sketch update for the batch), eviction when the table is
        full, then one allocation for the admitted ids (:meth:`_alloc`: a slice of
        the free list, one initializer call, one weights copy, one optimizer-state
        fill, one scatter per metadata array, one map insert). No per-id Python.

        Args:
            uniq: int64 [n] unique ids of the push (sorted, from ``torch.unique``, or in
                request order with ``new_pos``).
            rows: int64 [n] their rows from the id map, -1 = unknown; the rows of
                the ids that got one are written in place.
            res: the push's result; admitted / unadmitted_dropped / evicted /
                full_dropped are set.
            new_pos: the positions of the unknown ids in ascending id order, when
                ``uniq`` is not sorted (:meth:`_unique_request`); None = every
                position with row -1 (``uniq`` sorted). Rows go to ids in id order
                either way.
        """
        rows_np = rows.numpy()  # same memory: writes below land in ``rows``
        if new_pos is None:
            new_pos = np.flatnonzero(rows_np < 0)  # increasing: all new iff every position
            all_new = new_pos.size == rows_np.shape[0]
        else:  # every position, in order (an increasing permutation of 0..n-1 is the identity)
            all_new = new_pos.size == rows_np.shape[0] and bool((new_pos[1:] > new_pos[:-1]).all())
        if not new_pos.size:
            return
        uniq_np = uniq.numpy()
        new_ids = uniq_np if all_new else uniq_np[new_pos]  # (the fill of a table: no gather)
        if self.cfg.admission.immediate:
            adm_pos, adm_ids = new_pos, new_ids
        else:
            admitted = self.admission.observe(new_ids)
            res.unadmitted_dropped = int(new_ids.shape[0] - np.count_nonzero(admitted))
            adm_pos = new_pos[admitted] if res.unadmitted_dropped else new_pos
            adm_ids = new_ids[admitted] if res.unadmitted_dropped else new_ids
        k = int(adm_pos.size)
        if k > self._n_free:
            existing = rows_np[rows_np >= 0]
            res.evicted = self._evict(k - self._n_free, protect=existing)
        take = min(k, self._n_free)
        res.full_dropped = k - take
        if take:
            new_rows = self._alloc(adm_ids[:take] if take < k else adm_ids)
            if all_new and take == rows_np.shape[0]:
                rows_np[:] = new_rows
            else:
                rows_np[adm_pos[:take]] = new_rows
        res.admitted = take
        self.counters["unadmitted_dropped"] += res.unadmitted_dropped
        self.counters["full_dropped"] += res.full_dropped
        self.counters["admissions"] += take

    def _alloc(self, ids: np.ndarray, init_values: bool = True) -> np.ndarray:
        """Take rows for new unique ``ids`` (caller ensured enough are free); map and init them.

        ``ids`` must be unique and absent from the id map (both callers derive them from
        a lookup that returned -1 on unique ids), so the map skips its own checks.
        The rows are one slice of the free list; while a table fills they are
        consecutive (the free list starts as 0, 1, 2, ...), and then the weights and
        metadata are written as slices (one copy) instead of scatters.

        Args:
            ids: int64 [k] unique ids without a row.
            init_values: write their initial rows and optimizer state (False: the
                caller imports values).
        """
        k = ids.shape[0]
        rows = self.take_free_rows(k)
        rows_t = torch.from_numpy(rows)
        dev_rows = rows_t.to(self.device)
        r0 = int(rows[0]) if k else 0
        run = k > 1 and int(rows[-1]) - r0 == k - 1 and bool((np.diff(rows) == 1).all())
        at: slice | np.ndarray = slice(r0, r0 + k) if run else rows  # the same rows, as a slice when consecutive
        if init_values:
            vals = torch.from_numpy(self.init(ids))
            lo, hi = torch.aminmax(vals)
            absmax = max(-float(lo), float(hi))
            if run:
                self.weights[r0 : r0 + k] = vals.to(self.device)
            else:
                self.weights.index_copy_(0, dev_rows, vals.to(self.device))
            g_rows = self.global_rows(dev_rows)
            b = self.base
            self.optimizer.reset_rows(slice(b + r0, b + r0 + k) if run else g_rows)  # a slice: one fill, no scatter
            self.optimizer.rows_initialized(g_rows, absmax)
        self.row_ids[at] = ids
        self.freq[at] = 0
        self.last_step[at] = self.step
        self.row_version[at] = self.current_version
        self.id_map.insert(ids, rows_t, known_new=True)
        return rows

    @property
    def n_free(self) -> int:
        """Rows on the free list."""
        return self._n_free

    def take_free_rows(self, k: int) -> np.ndarray:
        """Pop ``k`` rows off the free list (the caller checked :attr:`n_free`): int64 [k] local rows,
        ascending while the table fills. The caller maps and initializes them (:meth:`_alloc`, or a
        :class:`ps.table_group.TableGroup` for several tables at once)."""
        rows = self._free[self._n_free - k : self._n_free][::-1].astype(np.int64)
        self._n_free -= k
        return rows

    def _release(self, rows: np.ndarray) -> np.ndarray:
        """Unmap and free ``rows``; returns the ids they held."""
        ids: np.ndarray = self.row_ids[rows].copy()
        self.id_map.remove(ids)
        self.row_ids[rows] = -1
        self.freq[rows] = 0
        k = rows.shape[0]
        self._free[self._n_free : self._n_free + k] = rows
        self._n_free += k
        return ids

    def _evict(self, needed: int, protect: np.ndarray | None = None) -> int:
        victims = pick_victims(
            self.cfg.eviction, self.row_ids, self.freq, self.last_step, self.step, needed, protect
        )
        if victims.size == 0:
            return 0
        ids = self._release(victims)
        self._log_removed(ids)
        self.counters["evictions"] += int(victims.size)
        log.debug("evicted rows", extra=kv(table=self.name, rows=int(victims.size), free=self._n_free))
        return int(victims.size)

    # -- removal log (incremental delivery) ----------------------------------------
    def _log_removed(self, ids: np.ndarray) -> None:
        self._removed.append((self.current_version, ids))
        self._removed_n += ids.shape[0]
        bound = max(4 * self.capacity, _REMOVED_LOG_MIN)
        if self._removed_n <= bound:
            return
        # compact: keep each id's latest removal, forget ids that are present again
        vers = np.concatenate([np.full(a.shape[0], v, np.int64) for v, a in self._removed])
        allids = np.concatenate([a for _, a in self._removed])
        order = np.lexsort((-vers, allids))
        allids, vers = allids[order], vers[order]
        first = np.ones(allids.shape[0], dtype=bool)
        first[1:] = allids[1:] != allids[:-1]
        allids, vers = allids[first], vers[first]
        absent = self.lookup_rows(allids) < 0
        allids, vers = allids[absent], vers[absent]
        if allids.shape[0] > bound:  # still too many: forget the oldest
            keep = np.argsort(vers, kind="stable")[-bound:]
            dropped = np.setdiff1d(np.arange(vers.shape[0]), keep)
            self._removed_floor = max(self._removed_floor, int(vers[dropped].max()))
            allids, vers = allids[keep], vers[keep]
        self._removed = [(int(v), allids[vers == v]) for v in np.unique(vers)]
        self._removed_n = int(allids.shape[0])

    def removed_ids(self, since_version: int) -> np.ndarray:
        """Ids evicted at versions > since_version and not present now (sorted, unique)."""
        if since_version < self._removed_floor:
            raise BadRequest(
                f"table '{self.name}': removals before version {self._removed_floor} were forgotten "
                f"(log bounded); since_version {since_version} needs a full delivery"
            )
        parts = [a for v, a in self._removed if v > since_version]
        if not parts:
            return np.empty(0, dtype=np.int64)
        ids = np.unique(np.concatenate(parts))
        return ids[self.lookup_rows(ids) < 0]

    def pristine(self) -> bool:
        """No row stored, no push applied, no removal logged since construction."""
        return self._n_free == self.capacity and self.step == 0 and not self._removed and self._removed_floor == 0

    # -- export / import / drop ----------------------------------------------------
    def used_rows(self) -> np.ndarray:
        return np.nonzero(self.row_ids != FREE)[0]  # (negative ids are real ids; only -1 is refused)

    def export_rows(self, rows: np.ndarray) -> TableRows:
        """TableRows of the given row indices (copies)."""
        rows = np.asarray(rows, dtype=np.int64)
        rows_t = torch.from_numpy(rows).to(self.device)
        return TableRows(
            ids=self.row_ids[rows].copy(),
            weights=self.weights.index_select(0, rows_t).detach().cpu().numpy(),
            state=self.optimizer.export_state(self.global_rows(rows_t)),
            freq=self.freq[rows].astype(np.int64),
            last_step=self.last_step[rows].astype(np.int64),
        )

    def changed_rows(self, since_version: int) -> TableRows:
        """Rows changed (pushed, admitted, imported) at versions > since_version."""
        return self.export_rows(np.nonzero((self.row_ids != FREE) & (self.row_version > since_version))[0])

    def check_rows(self, rows: TableRows) -> None:
        """Validate rows for import (raises BadRequest naming the problem)."""
        ids = check_ids(self.name, rows.ids, "rows.ids")
        n = ids.shape[0]
        w = rows.weights
        if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.shape != (n, self.dim):
            got = f"{getattr(w, 'dtype', type(w).__name__)} {getattr(w, 'shape', '')}"
            raise BadRequest(f"table '{self.name}': rows.weights must be float32 ({n}, {self.dim}), got {got}")
        if n > 1:
            srt = np.sort(ids)  # (np.unique's hash path was ~30x slower here on 1M ids)
            if bool((srt[1:] == srt[:-1]).any()):
                raise BadRequest(f"table '{self.name}': rows.ids hold duplicates")
        spec = self.optimizer.state_spec(self.dim)
        if set(rows.state) != set(spec):
            raise BadRequest(
                f"table '{self.name}': optimizer state keys {sorted(rows.state)} do not match "
                f"{self.cfg.optimizer.kind.value} state {sorted(spec)}"
            )
        for k, (shape, _dt) in spec.items():
            got_state = np.asarray(rows.state[k])
            if got_state.shape != (n, *shape):
                raise BadRequest(
                    f"table '{self.name}': optimizer state '{k}' shape {got_state.shape}, expected {(n, *shape)}"
                )
        bad = ~np.isfinite(w).all(axis=1) if n else np.zeros(0, bool)
        for k in spec:
            st = np.asarray(rows.state[k])
            if n and st.dtype.kind == "f":
                bad |= ~np.isfinite(st.reshape(n, -1)).all(axis=1)
        if bad.any():
            first = int(np.argmax(bad))
            raise BadRequest(
                f"table '{self.name}': {int(bad.sum())} imported row(s) hold NaN/Inf in weights or optimizer "
                f"state, first id {int(ids[first])}; import refused, table unchanged"
            )
        for k in ("freq", "last_step"):
            a = getattr(rows, k)
            if np.asarray(a).shape != (n,):
                raise BadRequest(f"table '{self.name}': rows.{k} shape {np.asarray(a).shape}, expected ({n},)")
        if n > self.capacity:
            raise BadRequest(f"table '{self.name}': importing {n} rows exceeds capacity {self.capacity}")

    def import_rows(self, rows: TableRows) -> int:
        """Insert or overwrite rows with their state and metadata. Returns rows evicted for room."""
        self.check_rows(rows)
        n = len(rows)
        if n == 0:
            return 0
        cur = self.lookup_rows(rows.ids)
        new = cur < 0
        k = int(new.sum())
        evicted = 0
        if k > self._n_free:
            if self.cfg.eviction.policy == "none":
                raise BadRequest(
                    f"table '{self.name}': importing {k} new rows needs room but only {self._n_free} rows are "
                    f"free and eviction policy is 'none' (capacity {self.capacity})"
                )
            evicted = self._evict(k - self._n_free, protect=cur[~new])
            if k > self._n_free:  # cannot happen: n <= capacity and only unprotected rows are evicted
                raise BadRequest(f"table '{self.name}': could not free {k} rows for import")
        if k:
            cur[new] = self._alloc(rows.ids[new], init_values=False)
        rows_t = torch.from_numpy(cur).to(self.device)
        w_src = torch.from_numpy(np.ascontiguousarray(rows.weights)).to(self.device)
        self.weights[rows_t] = w_src
        self.optimizer.import_state(self.global_rows(rows_t), rows.state)
        rewritten = self.optimizer.rows_imported(self.global_rows(rows_t), w_src)
        if rewritten:
            log.warning(
                "imported weights differ from the optimizer state's; stored the state's",
                extra=kv(table=self.name, rows=rewritten, optimizer=self.cfg.optimizer.kind.value),
            )
        assert rows.freq is not None  # set by TableRows.__post_init__
        self.freq[cur] = np.minimum(rows.freq, np.iinfo(np.int32).max).astype(np.int32)
        self.last_step[cur] = np.asarray(rows.last_step).astype(np.int32)
        self.row_version[cur] = self.current_version
        return evicted

    def drop_rows(self, rows: np.ndarray) -> int:
        """Remove rows (migration: not logged as removals). Returns how many."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return 0
        self._release(rows)
        return int(rows.size)

    def stats(self) -> dict[str, int | float | str]:
        return {
            "rows": self.size,
            "capacity": self.capacity,
            "fill": self.size / self.capacity,
            "dim": self.dim,
            "optimizer": self.cfg.optimizer.kind.value,
            "step": self.step,
            "bytes": self.memory_bytes(),
            "id_map_rebuilds": self.id_map.rebuilds,
            **self.counters,
        }
