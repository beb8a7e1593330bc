"""Batches as the reader yields them and models consume them.

A :class:`FeatureBatch` holds rows with any leading shape ``L`` (``[B]`` for a
plain batch, ``[T, S]`` or ``[T, Q]`` for the support/query halves of a meta
batch). Layout of one meta batch (T tasks, S support and Q query slots each)::

    record batch rows (T*(S+Q) slots)       MetaBatch
    +-----------------------------+
    | task 0: s s s s . . | q q . |   ->   support: FeatureBatch [T, S, ...]
    | task 1: s s . . . . | q . . |        query:   FeatureBatch [T, Q, ...]
    | ...                         |        mask False on padded slots ('.')
    +-----------------------------+

Per-feature tensors::

    ids[col]      int64   [*L, max_len]   (max_len = 1 for sparse; -1 = padding)
    dense         float32 [*L, n_dense]   (schema order of dense columns)
    vectors[col]  float32 [*L, dim]
    labels[lab]   float32 [*L]
    oracle[lab]   float32 [*L]            (only when the schema has oracle columns)
    scenario      int64   [*L]            (zeros when the schema has no scenario)
    mask          bool    [*L]            (False on padding rows)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # annotations only: opening a dataset (controller, launcher) needs no torch
    import torch

    from meta_io.schema import ColumnSpec


@dataclass
class FeatureBatch:
    ids: dict[str, torch.Tensor]
    dense: torch.Tensor
    vectors: dict[str, torch.Tensor]
    labels: dict[str, torch.Tensor]
    mask: torch.Tensor
    scenario: torch.Tensor
    oracle: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def shape(self) -> torch.Size:
        """The leading (row) shape ``L``."""
        return self.mask.shape

    def num_rows(self) -> int:
        """Real (unpadded) rows."""
        return int(self.mask.sum())

    def map(self, fn) -> "FeatureBatch":
        """Apply ``fn`` to every tensor (e.g. ``lambda t: t.to(device)``)."""
        return FeatureBatch(
            ids={k: fn(v) for k, v in self.ids.items()},
            dense=fn(self.dense),
            vectors={k: fn(v) for k, v in self.vectors.items()},
            labels={k: fn(v) for k, v in self.labels.items()},
            mask=fn(self.mask),
            scenario=fn(self.scenario),
            oracle={k: fn(v) for k, v in self.oracle.items()},
        )

    def flat(self) -> "FeatureBatch":
        """The same rows with a one-dimensional leading shape ``[prod(L)]`` (itself when already flat)."""
        lead = tuple(self.shape)
        if len(lead) == 1:
            return self
        return self.map(lambda t: t.reshape((-1,) + tuple(t.shape[len(lead):])))

    def unique_ids(self, id_columns: "Sequence[ColumnSpec]", tables: Iterable[str]) -> dict[str, torch.Tensor]:
        """Table -> the sorted unique ids (padding ``-1`` dropped) of every id column of that table,
        for each of ``tables`` (an empty int64 tensor for a table no column of this batch uses).

        The one gather before a lookup: serving (``delivery.loader``) and the API score with it.

        Args:
            id_columns: the schema's id columns (``Schema.id_columns``), each naming its table.
            tables: the tables to gather ids for; columns of other tables are skipped.

        Raises:
            DataError: an id column of one of ``tables`` is missing from the batch (named).
        """
        import torch

        from common.errors import DataError

        parts: dict[str, list[torch.Tensor]] = {t: [] for t in tables}
        for c in id_columns:
            if c.table_name in parts:
                if c.name not in self.ids:
                    raise DataError(f"batch has no id column '{c.name}' (table '{c.table_name}'); "
                                    f"got {sorted(self.ids)}")
                parts[c.table_name].append(self.ids[c.name].reshape(-1))
        out: dict[str, torch.Tensor] = {}
        for t, ps in parts.items():
            v = torch.cat(ps) if ps else torch.zeros(0, dtype=torch.int64)
            out[t] = torch.unique(v[v >= 0])
        return out


@dataclass
class PlainBatch:
    """B rows for ordinary supervised training."""

    features: FeatureBatch
    unique_ids: dict[str, torch.Tensor]
    """table name -> sorted unique ids (>= 0) used anywhere in the batch."""


@dataclass
class MetaBatch:
    """T tasks, each with S support and Q query slots."""

    support: FeatureBatch
    query: FeatureBatch
    task_keys: torch.Tensor
    """int64 [T]: the task key (hashed if it was a string) of each task slot."""
    task_mask: torch.Tensor
    """bool [T]: False for padding task slots in the last batch of a file."""
    unique_ids: dict[str, torch.Tensor]
    """table name -> sorted unique ids (>= 0) used in support or query."""

    @property
    def num_tasks(self) -> int:
        return int(self.task_mask.sum())

