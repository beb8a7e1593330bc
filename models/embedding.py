"""Embedding lookup and pooling over rows gathered from the PS.

Models never own embedding tables. For each batch the worker pulls, per table,
the rows of the batch's unique ids and passes them in::

    unique_ids[t]  int64   [U_t]          sorted, >= 0 (batch.unique_ids)
    rows[t]        float32 [U_t, dim_t]   rows[t][i] is the row of unique_ids[t][i]

Lookup is split in two so the differentiable half is a pure tensor function:

1. :func:`build_index` (eager, once per batch, checked): every id column of a
   table is padded to the table's longest list and stacked, then mapped to row
   positions with ``searchsorted``::

       ids[col]  [*L, m_c]  --pad to M, stack-->  [*L, C, M]
       pos       int64   [*L, C, M]   index into rows[t] (0 on padding)
       weight    float32 [*L, C, M]   1 (sum) or 1/count (mean); 0 on padding

   An id absent from ``unique_ids`` is an error naming the column and table.
2. :func:`pool` (differentiable w.r.t. ``rows``, vmap-safe, any ``L``)::

       rows[t][pos] * weight  --sum over M-->  [*L, C, dim_t]

One gather per table (not per column) keeps the op count low, which is what a
per-task loop pays for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from meta_io.batch import FeatureBatch
from meta_io.schema import PAD_ID, ColumnSpec, Pooling
from common.errors import DataError


class TableIndex(NamedTuple):
    """Row positions and pooling weights of every id column of one table (a pytree)."""

    pos: Tensor  # int64   [*L, C, M]
    weight: Tensor  # float32 [*L, C, M]


LookupIndex = dict[str, TableIndex]
"""table -> :class:`TableIndex`; the precomputed, validated half of a lookup."""


@dataclass(frozen=True)
class TableLayout:
    """The id columns that read one table, in schema order.

    Args:
        table: table name.
        dim: embedding dim of the table.
        columns: id columns reading it.
        lengths: ids per row of each column (1 for sparse, max_len for lists).
        poolings: pooling of each column.
    """

    table: str
    dim: int
    columns: tuple[str, ...]
    lengths: tuple[int, ...]
    poolings: tuple[Pooling, ...]

    @property
    def width(self) -> int:
        """M: the longest id list of the table's columns."""
        return max(self.lengths)

    @staticmethod
    def from_columns(table: str, dim: int, columns: Sequence[ColumnSpec]) -> "TableLayout":
        return TableLayout(
            table=table,
            dim=dim,
            columns=tuple(c.name for c in columns),
            lengths=tuple(max(c.max_len, 1) for c in columns),
            poolings=tuple(Pooling(c.pooling) for c in columns),
        )


def build_index(
    layouts: Sequence[TableLayout],
    features: FeatureBatch,
    unique_ids: dict[str, Tensor],
    rows: dict[str, Tensor] | None = None,
) -> LookupIndex:
    """Map every id of ``features`` to its row position, checking the inputs.

    Args:
        layouts: one per table (``CtrModel.layouts``).
        features: a batch with any leading shape ``L``.
        unique_ids: table -> sorted unique ids [U_t].
        rows: table -> [U_t, dim_t]; when given, their shapes are checked too.

    Returns:
        table -> TableIndex(pos [*L, C, M], weight [*L, C, M]).

    Raises:
        DataError: a table missing from ``unique_ids``/``rows``, a rows shape
            that disagrees with ``unique_ids`` or the configured dim, unsorted
            ``unique_ids``, a missing id column, or an id not in ``unique_ids``.

    Example::

        idx = build_index(model.layouts, batch.features, batch.unique_ids, rows)
        emb = pool(rows["item"], idx["item"])   # [B, C_item, dim_item]
    """
    index: LookupIndex = {}
    lead = tuple(features.shape)
    for lay in layouts:
        t = lay.table
        if t not in unique_ids:
            raise DataError(f"unique_ids has no table '{t}' (got tables {sorted(unique_ids)})")
        uniq = unique_ids[t]
        if uniq.dim() != 1:
            raise DataError(f"unique_ids['{t}']: expected a 1-d tensor, got shape {list(uniq.shape)}")
        if uniq.numel() > 1 and not bool((uniq[1:] > uniq[:-1]).all()):
            raise DataError(f"unique_ids['{t}'] must be sorted and unique")
        if rows is not None:
            if t not in rows:
                raise DataError(f"rows has no table '{t}' (got tables {sorted(rows)})")
            if rows[t].dtype != torch.float32:
                raise DataError(f"rows['{t}']: expected float32, got {rows[t].dtype} (convert fp16 wire values first)")
            want = (uniq.numel(), lay.dim)
            if tuple(rows[t].shape) != want:
                raise DataError(
                    f"rows['{t}']: expected shape [{want[0]}, {want[1]}] "
                    f"(len(unique_ids['{t}']) x model dim), got {list(rows[t].shape)}"
                )
        cols = []
        for name, length in zip(lay.columns, lay.lengths):
            if name not in features.ids:
                raise DataError(f"batch has no id column '{name}' (table '{t}'); got {sorted(features.ids)}")
            ids = features.ids[name]
            if ids.dim() == len(lead):  # tolerate [*L] for sparse columns
                ids = ids.unsqueeze(-1)
            if tuple(ids.shape) != lead + (length,):
                raise DataError(
                    f"id column '{name}': expected shape {list(lead) + [length]}, got {list(ids.shape)}"
                )
            if ids.shape[-1] < lay.width:
                ids = torch.nn.functional.pad(ids, (0, lay.width - ids.shape[-1]), value=PAD_ID)
            cols.append(ids.long())
        ids = torch.stack(cols, dim=-2)  # [*L, C, M]
        valid = ids >= 0
        if uniq.numel() == 0:
            if bool(valid.any()):
                raise DataError(f"table '{t}': batch has ids but unique_ids['{t}'] is empty")
            pos = torch.zeros_like(ids)
        else:
            pos = torch.searchsorted(uniq, ids.clamp_min(0)).clamp_max(uniq.numel() - 1)
            missing = valid & (uniq[pos] != ids)
            if bool(missing.any()):
                at = missing.nonzero()[0].tolist()
                col = lay.columns[at[-2]]
                raise DataError(
                    f"id {int(ids[tuple(at)])} of column '{col}' is not in unique_ids['{t}'] "
                    f"({int(missing.sum())} ids missing in table '{t}')"
                )
            pos = torch.where(valid, pos, 0)
        weight = valid.to(torch.float32)
        is_mean = torch.tensor([p == Pooling.MEAN for p in lay.poolings])
        if bool(is_mean.any()):
            count = weight.sum(-1, keepdim=True).clamp_min(1.0)
            weight = torch.where(is_mean.unsqueeze(-1), weight / count, weight)
        index[t] = TableIndex(pos, weight)
    return index


def pool(rows: Tensor, index: TableIndex) -> Tensor:
    """Gather and pool one table's rows: ``[U, D]`` -> ``[*L, C, D]``.

    Differentiable w.r.t. ``rows`` (the gradient is what the worker pushes);
    pure tensor ops, so it works under ``torch.func.vmap``/``grad``.

    Args:
        rows: ``[U, D]`` gathered rows of the table.
        index: from :func:`build_index`.

    Example::

        emb = pool(rows["tag"], idx["tag"])   # [B, C_tag, D]
    """
    if rows.shape[0] == 0:  # a table with no ids in this batch: everything is padding
        return rows.new_zeros(index.pos.shape[:-1] + (rows.shape[-1],))
    gathered = rows[index.pos]  # [*L, C, M, D]
    return (gathered * index.weight.unsqueeze(-1)).sum(-2)


# -- one embedding_bag per storage group -----------------------------------------------------
@dataclass(frozen=True)
class GroupLayout:
    """The id columns of one storage group, in the order its pooled features come out.

    A group (``ps.grouping``: tables stored together on the PS, one dim) is pulled as one
    ``[N, D]`` tensor, its tables' unique ids one after the other; its columns pool with one
    ``F.embedding_bag`` into ``[*L, C, D]``, columns table by table in group order.

    Args:
        tables: the group's tables, in storage order (each a :class:`TableLayout`).
        dim: their common dim.
    """

    tables: tuple[TableLayout, ...]
    dim: int

    @functools.cached_property
    def plan(self) -> "_GroupPlan":
        """Static index arithmetic of the group (built once)."""
        return _GroupPlan(self)


class _GroupPlan:
    """What :func:`build_grouped_index` needs of a group that does not change per batch."""

    def __init__(self, g: GroupLayout) -> None:
        cols: list[tuple[int, str, int, bool]] = []  # (table index, name, width, mean) in output order
        for ti, lay in enumerate(g.tables):
            for name, length, pooling in zip(lay.columns, lay.lengths, lay.poolings):
                cols.append((ti, name, length, pooling == Pooling.MEAN))
        self.columns = cols
        self.n_cols = len(cols)
        widths = np.array([c[2] for c in cols], dtype=np.int64)
        self.slot_start = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        """First slot (id position in a row) of each column."""
        self.width = int(widths.sum())
        self.single = bool((widths == 1).all())
        """Every column holds one id per row: a bag's count is its id's validity."""
        self.slot_col = np.repeat(np.arange(self.n_cols), widths)
        self.mean = np.array([c[3] for c in cols], dtype=bool)
        # A task's pooling (pool_local) sums a column's slots as a view: slots stored column by column
        # with the columns grouped by width (classes in order of first appearance), so a class is one
        # [.., n_cols, width, D] block; the classes' columns are then put back in output order.
        classes: dict[int, list[int]] = {}
        for ci, c in enumerate(cols):
            classes.setdefault(c[2], []).append(ci)
        class_cols = [ci for idx in classes.values() for ci in idx]
        self.slot_order = np.concatenate([np.arange(self.slot_start[ci], self.slot_start[ci] + cols[ci][2])
                                          for ci in class_cols]).astype(np.int64)
        """Slots in class order (a task index stores its slots so)."""
        self.blocks: list[tuple[int, int, int]] = []
        """Per width class: (first slot, columns, width), in class order."""
        at = 0
        for k, idx in classes.items():
            self.blocks.append((at, len(idx), k))
            at += len(idx) * k
        back = np.argsort(np.asarray(class_cols))
        self.class_perm = None if class_cols == list(range(self.n_cols)) else torch.from_numpy(back.astype(np.int64))
        """Class order -> output order of the columns (None: the same)."""


class PooledIndex(NamedTuple):
    """One group's pooling of a batch, both ways, as ``F.embedding_bag`` inputs.

    Forward, a bag per (row, column) over the group's rows: ``out[b] = sum w[e] * rows[input[e]]``
    for the elements ``e`` of bag ``b``. Backward is the same sum transposed, a bag per pulled
    row over the output gradient: ``grad_rows[i] = sum w[e] * grad_out[bag[e]]`` for the elements
    of row ``i``, i.e. the elements sorted by row (``t_*``). Both directions are then one
    ``embedding_bag`` call (torch's own embedding_bag backward sorts the elements every step,
    ~40x slower here).
    """

    input: Tensor  # int64 [nnz]: positions into the group's pulled rows
    offsets: Tensor  # int64 [R * C]: where each bag starts (rows x columns, row-major)
    weights: Tensor  # float32 [nnz]: 1 (sum pooling) or 1/count (mean)
    t_input: Tensor  # int64 [nnz]: the bag of each element, elements in row order
    t_offsets: Tensor  # int64 [N]: where each pulled row's elements start
    t_weights: Tensor  # float32 [nnz]: ``weights`` in row order


@dataclass
class GroupedIndex:
    """What a step needs of a batch's ids, grouped for one pull and one pooling per group.

    Built once per batch (:func:`build_grouped_index`, on the prefetch thread), checked there.

    Args:
        ids: per group, int64 [N_g]: the unique ids of its tables, table by table (storage order).
        counts: per group, int64 [T_g]: how many of ``ids`` each table has.
        pooled: per group, its :class:`PooledIndex`.
        lead: the batch's leading shape ``L``.
        tables: per group, its tables (storage order).
        dims: per group, its dim.
    """

    ids: list[Tensor]
    counts: list[np.ndarray]
    pooled: list[PooledIndex]
    lead: tuple[int, ...]
    tables: list[tuple[str, ...]]
    dims: list[int]


def group_layouts(layouts: Sequence[TableLayout], groups: Sequence[Sequence[str]]) -> list[GroupLayout]:
    """The model's tables arranged as the PS stores them.

    Args:
        layouts: the model's table layouts (``CtrModel.layouts``).
        groups: table names per storage group, storage order (``ps.grouping.group_tables``); every
            model table in exactly one group. Tables of a group the model does not read are left out.

    Raises:
        DataError: a model table in no group, or in two, or a group of different dims.
    """
    by_name = {lay.table: lay for lay in layouts}
    seen: set[str] = set()
    out = []
    for names in groups:
        lays = tuple(by_name[n] for n in names if n in by_name)
        if not lays:
            continue
        dims = {lay.dim for lay in lays}
        if len(dims) != 1:
            raise DataError(f"storage group {list(names)} mixes dims {sorted(dims)}")
        dup = seen & {lay.table for lay in lays}
        if dup:
            raise DataError(f"tables {sorted(dup)} are in two storage groups")
        seen |= {lay.table for lay in lays}
        out.append(GroupLayout(lays, lays[0].dim))
    missing = [t for t in by_name if t not in seen]
    if missing:
        raise DataError(f"model tables {missing} are in no storage group (groups: {[list(g) for g in groups]})")
    return out


def pooled_permutation(layouts: Sequence[TableLayout], groups: Sequence[GroupLayout]) -> Tensor | None:
    """Index that puts the groups' pooled features (concatenated) in the model's layout order; None when
    they already are (one group, or groups that follow the layouts)."""
    width = {lay.table: len(lay.columns) * lay.dim for lay in layouts}
    start, at = {}, 0
    for g in groups:
        for lay in g.tables:
            start[lay.table] = at
            at += width[lay.table]
    perm = torch.cat([torch.arange(start[lay.table], start[lay.table] + width[lay.table]) for lay in layouts])
    return None if bool((perm == torch.arange(perm.numel())).all()) else perm


def _group_ids(g: GroupLayout, unique_ids: dict[str, Tensor]) -> tuple[Tensor, list[np.ndarray], np.ndarray]:
    """A group's unique ids: (all of them table by table, each table's as numpy, table starts [T + 1]).

    Raises:
        DataError: a table missing from ``unique_ids``, not 1-d, or not sorted and unique.
    """
    uniq_t = []
    for lay in g.tables:
        u = unique_ids.get(lay.table)
        if u is None:
            raise DataError(f"unique_ids has no table '{lay.table}' (got tables {sorted(unique_ids)})")
        if u.dim() != 1:
            raise DataError(f"unique_ids['{lay.table}']: expected a 1-d tensor, got shape {list(u.shape)}")
        uniq_t.append(u)
    uniq = [u.numpy() for u in uniq_t]
    starts = np.concatenate([[0], np.cumsum([u.size for u in uniq])]).astype(np.int64)
    u_all = uniq_t[0] if len(uniq_t) == 1 else torch.cat(uniq_t)
    _check_sorted(g, u_all.numpy(), starts)
    return u_all, uniq, starts


def _group_positions(g: GroupLayout, features: FeatureBatch, uniq: list[np.ndarray],
                     starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every id slot of a group's columns: (position in the group's ids, valid, pooling weight), each
    ``[R, W]`` (R rows of ``features``, W the columns' slots in output order; padding: 0, False, 0),
    and the ids per bag ``[R, C]`` (one bag per row and column).

    Raises:
        DataError: a missing id column, one of the wrong shape, or an id not in its table's unique ids.
    """
    plan = g.plan
    lead = tuple(features.shape)
    r = int(np.prod(lead)) if lead else 1
    pos = np.empty((r, plan.width), dtype=np.int64)
    valid = np.empty((r, plan.width), dtype=bool)
    for (ti, name, k, _), s0 in zip(plan.columns, plan.slot_start.tolist()):
        col = features.ids.get(name)
        if col is None:
            raise DataError(f"batch has no id column '{name}' (table '{g.tables[ti].table}'); got {sorted(features.ids)}")
        if col.dim() == len(lead):
            col = col.unsqueeze(-1)
        if tuple(col.shape) != lead + (k,):
            raise DataError(f"id column '{name}': expected shape {list(lead) + [k]}, got {list(col.shape)}")
        ids = col.numpy().reshape(r, k)
        u = uniq[ti]
        ok = ids >= 0
        if u.size == 0:
            if ok.any():
                raise DataError(f"table '{g.tables[ti].table}': batch has ids but unique_ids['{g.tables[ti].table}'] is empty")
            p = np.zeros((r, k), dtype=np.int64)
        else:
            p = np.searchsorted(u, ids)
            np.minimum(p, u.size - 1, out=p)
            miss = ok & (u[p] != ids)
            if miss.any():
                t = g.tables[ti].table
                raise DataError(f"id {int(ids[miss][0])} of column '{name}' is not in unique_ids['{t}'] "
                                f"({int(miss.sum())} ids missing in column '{name}')")
            if starts[ti]:
                p += starts[ti]
        pos[:, s0 : s0 + k] = np.where(ok, p, 0)
        valid[:, s0 : s0 + k] = ok
    # ids per bag (row x column) and each id's pooling weight: 1 (sum) or 1 / count (mean); 0 on padding
    cnt = valid if plan.single else np.add.reduceat(valid, plan.slot_start, axis=1, dtype=np.int64)
    if plan.mean.any():
        per_bag = np.where(plan.mean, 1.0 / np.maximum(cnt, 1), 1.0).astype(np.float32)
        w = per_bag if plan.single else per_bag[:, plan.slot_col]
        w = np.where(valid, w, np.float32(0.0))
    else:
        w = valid.astype(np.float32)
    return pos, valid, w, cnt


def build_grouped_index(groups: Sequence[GroupLayout], features: FeatureBatch, unique_ids: dict[str, Tensor]) -> GroupedIndex:
    """Check a batch's ids and build each group's pull ids and ``embedding_bag`` inputs (both ways).

    The same checks (and errors) as :func:`build_index`. numpy throughout (a call costs ~1 us
    there against ~10 us for a small torch op): per column one ``searchsorted`` and a few
    vectorized ops, per group a dozen more; no per-row Python.

    Args:
        groups: :func:`group_layouts` of the model.
        features: a batch with leading shape ``L``.
        unique_ids: table -> sorted unique ids [U_t].

    Raises:
        DataError: a table missing from ``unique_ids``, unsorted ``unique_ids``, a missing id column
            or one of the wrong shape, or an id not in ``unique_ids``.
    """
    lead = tuple(features.shape)
    out = GroupedIndex(ids=[], counts=[], pooled=[], lead=lead, tables=[], dims=[g.dim for g in groups])
    for g in groups:
        u_all, uniq, starts = _group_ids(g, unique_ids)
        n = int(starts[-1])
        pos, valid, w, cnt = _group_positions(g, features, uniq, starts)
        flat_valid = valid.ravel()
        if flat_valid.all():
            inp, wts = pos.ravel(), np.ascontiguousarray(w).ravel()
        else:
            inp, wts = pos.ravel()[flat_valid], w.ravel()[flat_valid]
        sizes = cnt.ravel().astype(np.int64)
        offsets = np.cumsum(sizes) - sizes
        # the transpose, for the backward (see PooledIndex): elements in row order; a stable sort
        # of small ints is numpy's radix sort
        key = inp.astype(np.int16 if n <= np.iinfo(np.int16).max else np.int32)
        order = np.argsort(key, kind="stable")
        bags = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
        per_row = np.bincount(inp, minlength=n)
        t_offsets = np.cumsum(per_row) - per_row
        T = torch.from_numpy
        out.ids.append(u_all)
        out.counts.append(np.diff(starts))
        out.pooled.append(PooledIndex(T(inp), T(offsets), T(wts), T(bags[order]), T(t_offsets), T(wts[order])))
        out.tables.append(tuple(lay.table for lay in g.tables))
    return out


# -- meta batches: each task pools its own rows --------------------------------------------
class LocalIndex(NamedTuple):
    """One storage group's id slots of a task's rows, as positions into the task's own rows ``[K_g, D]``
    (slots in the group's class order, ``_GroupPlan.slot_order``)."""

    pos: Tensor  # int64 [*L, W]: slot -> row of the task's rows (0 on padding)
    weight: Tensor  # float32 [*L, W]: pooling weight of the slot (0 on padding)


class GroupedPlan(Protocol):
    """The static part of a grouped lookup (:class:`~models.features.GroupedLookup`)."""

    groups: list[GroupLayout]
    """The model's tables per storage group (:func:`group_layouts`)."""
    keys: list[str]
    """Each group's name in a meta step's rows dict."""
    perm: Tensor | None
    """The groups' pooled features -> layout order (:func:`pooled_permutation`)."""


class LocalLookup:
    """One half (support or query) of a meta batch's pooling, every storage group, on each task's own
    rows: a pytree of :class:`LocalIndex` (vmapped over tasks) whose static part, the model's
    :class:`~models.features.GroupedLookup` (slot -> column sums, layout order), rides along as the
    pytree context, so ``CtrModel.forward`` takes it as its ``index``.

    Args:
        parts: per group, its :class:`LocalIndex`.
        lookup: the model's grouped lookup (static).
    """

    def __init__(self, parts: Sequence[LocalIndex], lookup: GroupedPlan) -> None:
        self.parts = tuple(parts)
        self.lookup = lookup


torch.utils._pytree.register_pytree_node(
    LocalLookup,
    lambda x: (list(x.parts), x.lookup),
    lambda children, ctx: LocalLookup(tuple(children), ctx),
    serialized_type_name="models.embedding.LocalLookup",
)


@dataclass
class MetaGroupedIndex:
    """A meta batch's pull ids and per-task pooling, grouped as the PS stores its tables.

    Built once per batch on the prefetch thread (:func:`build_meta_index`); the step then pulls one
    tensor per group (``ids`` / ``counts`` / ``tables`` / ``dims`` as :class:`GroupedIndex`), gathers
    each task's rows ``rows[l2g]`` and pools them with ``support`` / ``query``.

    Args:
        ids, counts, tables, dims: per group, as :class:`GroupedIndex`.
        keys: per group, its name in the step's rows dict (``"g0"``, ...).
        l2g: per group, int64 ``[T, K_g]``: a task's row slot -> row of the group's pulled rows.
        support, query: the halves' :class:`LocalLookup`.
    """

    ids: list[Tensor]
    counts: list[np.ndarray]
    tables: list[tuple[str, ...]]
    dims: list[int]
    keys: list[str]
    l2g: dict[str, Tensor]
    support: LocalLookup
    query: LocalLookup


def build_meta_index(lookup: GroupedPlan, support: FeatureBatch, query: FeatureBatch,
                     unique_ids: dict[str, Tensor]) -> MetaGroupedIndex:
    """Check a meta batch's ids and build its grouped, per-task pooling (numpy; see :func:`build_grouped_index`).

    Each task's slots (support and query) are re-indexed onto the task's own distinct rows, as
    ``models.meta._localize`` does per table, here per group with one row-wise sort::

        global pos [T, N] (support, query) --per-task unique--> local pos [T, N], l2g [T, K]

    Args:
        lookup: the model's :class:`~models.features.GroupedLookup` (the static pooling plan).
        support, query: ``[T, S, ..]`` and ``[T, Q, ..]``.
        unique_ids: table -> sorted unique ids of both halves.

    Raises:
        DataError: as :func:`build_grouped_index`.
    """
    t_count, s_n = int(support.shape[0]), int(support.shape[1])
    q_n = int(query.shape[1])
    ids: list[Tensor] = []
    counts: list[np.ndarray] = []
    l2gs: dict[str, Tensor] = {}
    sup_parts, qry_parts = [], []
    for key, g in zip(lookup.keys, lookup.groups):
        u_all, uniq, starts = _group_ids(g, unique_ids)
        n = int(starts[-1])
        width = g.plan.width
        ps, vs, ws, _ = _group_positions(g, support, uniq, starts)
        pq, vq, wq, _ = _group_positions(g, query, uniq, starts)
        glob = np.concatenate([np.where(vs, ps, n).reshape(t_count, -1), np.where(vq, pq, n).reshape(t_count, -1)], axis=1)
        key_t = glob.astype(np.int16 if n < np.iinfo(np.int16).max else np.int32)
        order = np.argsort(key_t, axis=1, kind="stable")
        srt = np.take_along_axis(glob, order, axis=1)
        slot = np.zeros_like(srt)
        if srt.shape[1] > 1:
            np.cumsum(srt[:, 1:] != srt[:, :-1], axis=1, out=slot[:, 1:])
        local = np.empty_like(slot)
        np.put_along_axis(local, order, slot, axis=1)
        k = int(slot[:, -1].max()) + 1 if slot.size else 1
        l2g = np.zeros((t_count, k), dtype=np.int64)
        np.put_along_axis(l2g, slot, srt, axis=1)
        np.minimum(l2g, max(n - 1, 0), out=l2g)  # the padding slot (position n) reads any row at weight 0
        split = s_n * width
        order_ = g.plan.slot_order  # slots in class order: pool_local sums a column as a view
        sup_parts.append(_local_index(local[:, :split], ws, (t_count, s_n, width), order_))
        qry_parts.append(_local_index(local[:, split:], wq, (t_count, q_n, width), order_))
        ids.append(u_all)
        counts.append(np.diff(starts))
        l2gs[key] = torch.from_numpy(l2g)
    return MetaGroupedIndex(ids=ids, counts=counts, tables=[tuple(lay.table for lay in g.tables) for g in lookup.groups],
                            dims=[g.dim for g in lookup.groups], keys=list(lookup.keys), l2g=l2gs,
                            support=LocalLookup(sup_parts, lookup), query=LocalLookup(qry_parts, lookup))


def _local_index(pos: np.ndarray, weight: np.ndarray, shape: tuple[int, int, int], slot_order: np.ndarray) -> LocalIndex:
    """A half's :class:`LocalIndex`: its slots' local positions and weights ``[T, rows, W]``, slots in class order."""
    def arrange(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(shape)[..., slot_order]))
    return LocalIndex(arrange(pos), arrange(weight))


def _check_sorted(g: GroupLayout, u_all: np.ndarray, starts: np.ndarray) -> None:
    """DataError naming the first table whose unique ids are not strictly increasing."""
    if u_all.size < 2:
        return
    up = u_all[1:] > u_all[:-1]
    cut = starts[1:-1] - 1  # the pair across two tables' boundary does not count
    up[cut[(cut >= 0) & (cut < up.size)]] = True
    if up.all():
        return
    at = int(np.argmin(up))
    t = int(np.searchsorted(starts, at, side="right")) - 1
    raise DataError(f"unique_ids['{g.tables[t].table}'] must be sorted and unique")


class _GroupPool(torch.autograd.Function):
    """``embedding_bag`` forward, its transpose (another ``embedding_bag``) backward: see :class:`PooledIndex`."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, index: PooledIndex) -> Tensor:  # type: ignore[override]
        ctx.index = index
        ctx.n_rows = rows.shape[0]
        # detached: torch picks its forward-only kernel (no buffers for its own backward, ~5x faster)
        return torch.nn.functional.embedding_bag(index.input, rows.detach(), index.offsets, mode="sum",
                                                 per_sample_weights=index.weights)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        index: PooledIndex = ctx.index
        if ctx.n_rows == 0:
            return grad_out.new_zeros((0, grad_out.shape[-1])), None
        grad = torch.nn.functional.embedding_bag(index.t_input, grad_out.contiguous(), index.t_offsets, mode="sum",
                                                 per_sample_weights=index.t_weights)
        return grad, None


def pool_grouped(rows: Tensor, index: PooledIndex, lead: tuple[int, ...]) -> Tensor:
    """One group's pooled features ``[*L, C * D]`` from its pulled rows ``[N, D]`` (differentiable
    w.r.t. ``rows``; not under ``torch.func`` transforms: the plain step's autograd path)."""
    return _GroupPool.apply(rows, index).view(*lead, -1)
