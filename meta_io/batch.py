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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: opening a dataset (controller, launcher) needs no torch
    import torch


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

