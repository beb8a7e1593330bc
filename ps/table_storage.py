"""The storage that several tables of one shard share: one TBE, one id-map array, one metadata array each.

Tables whose rows update the same way (same dim, optimizer settings and
gradient clipping: :func:`ps.grouping.storage_key`) live in one
:class:`GroupStorage`, each in its own range of rows::

    rows       0 ........ C_0-1 | C_0 ........ C_0+C_1-1 | ...
    table         user          |        item            | ...
    weights    float32 [sum C, D]    one fbgemm TBE (HOST/CPU or DEVICE/CUDA)
    optimizer  one ps.optimizers.SparseOptimizer over those weights (its state rows align)
    id map     int64 [sum S_t, 2]    table t's hash slots at map_offsets[t] .. map_offsets[t+1]
    row_ids, freq, last_step, row_version   [sum C] each

Each table (:class:`ps.embedding_table.EmbeddingTable`) holds *views* of its
range (``weights[base : base + C]``, its slots, its metadata) and keeps
table-local row numbers (0 .. C-1) everywhere; only the optimizer, which owns
the whole range, is called with ``base + row``. A step of many tables
(:mod:`ps.table_group`) then costs one hash-map lookup (fbgemm's lookup takes
per-table slot offsets), one gather and one fused optimizer update over all of
them instead of one of each per table. A table built on its own gets a storage
of one table (base 0): exactly the layout it always had.

fbgemm's exact rowwise Adagrad caps one TBE at 2^31-1 rows: groups never
exceed it (:func:`ps.grouping.group_tables`).

Example::

    storage = GroupStorage([TableConfig("user", capacity=10), TableConfig("item", capacity=20)], "cpu")
    storage.span(1).weights.shape      # (20, 16): a view of storage.weights[10:30]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from ps import hugepages
from ps.config import TableConfig
from ps.grouping import storage_key
from ps.id_map import EMPTY_KEY, slots_for
from ps.optimizers import SparseOptimizer, make_optimizer, tbe_optim_type

__all__ = ["GroupStorage", "TableSpan"]


@dataclass(frozen=True)
class TableSpan:
    """One table's part of a :class:`GroupStorage`: views, and where they sit in the whole.

    Args:
        index: the table's position in the storage.
        base: its first row in the storage.
        capacity: its rows.
        weights: float32 [capacity, dim] view of the storage's weights.
        map_slots: int64 [S, 2] view of the storage's id-map slots.
        row_ids, freq, last_step, row_version: views of the storage's metadata arrays.
    """

    index: int
    base: int
    capacity: int
    weights: torch.Tensor
    map_slots: torch.Tensor
    row_ids: np.ndarray
    freq: np.ndarray
    last_step: np.ndarray
    row_version: np.ndarray


def _weights_on_hugepages(tbe: SplitTableBatchedEmbeddingBagsCodegen) -> None:
    """Give a CPU TBE fresh, untouched, THP-advised weight storage (see ps.hugepages).

    TBE fills its weights with random values at construction; a table never
    reads them (rows get their deterministic initial value when allocated, or
    imported values), so the storage is replaced (zeroed) rather than copied:
    the old storage is freed right away, never two copies of a big table.
    """
    w = tbe.weights_host
    if w.numel() * w.element_size() < hugepages.MIN_BYTES:
        return
    shape, dtype = tuple(w.shape), w.dtype
    with torch.no_grad():
        w.data = torch.empty(0, dtype=dtype)  # free TBE's storage first: never two copies at once
        w.data = hugepages.full(shape, 0.0, dtype)
    momentum = getattr(tbe, "momentum1_host", None)
    if momentum is not None and momentum.numel() * momentum.element_size() >= hugepages.MIN_BYTES:
        shape, dtype = tuple(momentum.shape), momentum.dtype
        momentum.data = torch.empty(0, dtype=dtype)
        momentum.data = hugepages.full(shape, 0.0, dtype)  # the optimizer fills it


class GroupStorage:
    """Weights, optimizer state, id-map slots and row metadata of tables that share one storage key.

    Args:
        cfgs: the tables, validated, all with the same :func:`ps.grouping.storage_key`.
        device: "cpu" or "cuda".

    Raises:
        ValueError: no tables, different storage keys, or more than 2^31-1 rows in all.
    """

    def __init__(self, cfgs: Sequence[TableConfig], device: str = "cpu") -> None:
        if not cfgs:
            raise ValueError("GroupStorage needs at least one table")
        keys = {storage_key(c) for c in cfgs}
        if len(keys) != 1:
            raise ValueError(f"tables {[c.name for c in cfgs]} do not share one storage key (dim, optimizer, clipping)")
        caps = [int(c.capacity) for c in cfgs]
        total = sum(caps)
        if total > 2**31 - 1:
            raise ValueError(f"tables {[c.name for c in cfgs]} hold {total} rows in all, over fbgemm's 2^31-1")
        self.cfgs = list(cfgs)
        self.dim = int(cfgs[0].dim)
        self.device = torch.device(device)
        self.lock = threading.RLock()
        """One lock for every table of the storage: they share the optimizer and its bounds."""
        self.bases = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
        """Row offsets: table i owns rows bases[i] .. bases[i+1]-1."""
        o = cfgs[0].optimizer
        if self.device.type == "cuda":
            spec = [(total, self.dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)]
            extra = {"device": self.device}
        else:
            spec = [(total, self.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)]
            extra = {}
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            spec,
            optimizer=tbe_optim_type(o.kind),
            learning_rate=o.lr,
            eps=o.eps,
            weight_decay=0.0,  # L2 is added to the gradient by ps.optimizers
            pooling_mode=PoolingMode.SUM,
            **extra,
        )
        if self.device.type == "cpu":
            _weights_on_hugepages(self.tbe)
        # detach: same storage, but in-place writes need no autograd bookkeeping
        self.weights: torch.Tensor = self.tbe.split_embedding_weights()[0].detach()
        self.optimizer: SparseOptimizer = make_optimizer(o, self.weights, self.tbe)
        slots = [slots_for(c) for c in caps]
        self.map_offsets = torch.tensor(np.concatenate([[0], np.cumsum(slots)]), dtype=torch.int64)
        """Id-map slot offsets per table (fbgemm's ``hash_table_offsets``)."""
        # random probes and random row writes: 2 MiB pages when big
        self.map_slots = hugepages.full((int(sum(slots)), 2), EMPTY_KEY, torch.int64)
        self.map_generation = np.zeros(1, dtype=np.int64)
        """+1 at every change of any table's id map (``IdMap.generation``, shared): a lookup taken at
        generation g still holds while this reads g."""
        self.row_ids = hugepages.numpy_full(total, -1, torch.int64)
        self.freq = hugepages.numpy_full(total, 0, torch.int32)
        self.last_step = hugepages.numpy_full(total, 0, torch.int32)
        self.row_version = hugepages.numpy_full(total, 0, torch.int32)

    @property
    def rows(self) -> int:
        """Rows of all tables together."""
        return int(self.bases[-1])

    def span(self, i: int) -> TableSpan:
        """Table ``i``'s views.

        Args:
            i: the table's position in ``cfgs``.
        """
        lo, hi = int(self.bases[i]), int(self.bases[i + 1])
        s_lo, s_hi = int(self.map_offsets[i]), int(self.map_offsets[i + 1])
        return TableSpan(
            index=i, base=lo, capacity=hi - lo, weights=self.weights[lo:hi], map_slots=self.map_slots[s_lo:s_hi],
            row_ids=self.row_ids[lo:hi], freq=self.freq[lo:hi], last_step=self.last_step[lo:hi],
            row_version=self.row_version[lo:hi],
        )
