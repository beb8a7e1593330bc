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

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from meta_io.batch import FeatureBatch
from meta_io.schema import PAD_ID, ColumnSpec, Pooling
from metaps.core.errors import DataError


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
