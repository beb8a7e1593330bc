"""The PS package's vocabulary: the store and host Protocols and the status keys on the wire.

One small module that the service pieces (``ps/servicer.py``, ``ps/gate.py``,
``ps/factory.py``), the client (``ps/client.py``, ``ps/routing.py``) and the
checkpoint coordinator (``ps/coordinator.py``) import, so none of them imports
another only for a constant or a type (TorchRec keeps such a ``types.py`` per
package). It imports no gRPC and no torch at run time.

* :class:`RowStore`: what the service needs of a shard's storage;
  ``ps.shard_store.ShardStore`` satisfies it (checked by mypy where the factory
  passes one to ``PsServer``).
* :class:`ShardHost`: what the checkpoint coordinator needs of a serving shard
  (its store, id, map, and :meth:`ShardHost.adopt_map`, the public way to change
  the map; ``ps.servicer.PsServer`` satisfies it).
* Trailing-metadata keys and values of the "ask again" / "wrong owner" protocol
  (see ``ps/servicer.py``'s module docstring for when each is sent).

Example::

    def serve(store: RowStore) -> None:
        rows = store.pull("user", np.array([3, 7], dtype=np.int64))
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ContextManager, Mapping, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

    from ps.dense_store import DenseStore
    from ps.embedding_table import EmbeddingTable, PushResult, TableRows
    from ps.partition_map import PartitionMap
    from ps.table_group import TableGroup

WRONG_OWNER = "wrong_owner"
"""ERROR_KEY value (FAILED_PRECONDITION): the request was routed with another map, or a vshard moved."""
PUSH_COUNT_FIELDS = (
    "applied", "nonfinite_dropped", "unadmitted_dropped", "admitted", "evicted", "full_dropped", "update_nonfinite_dropped",
)
"""ps.embedding_table.PushResult fields carried back in PushCounts (summed by the client)."""


@dataclasses.dataclass
class StepResult:
    """What a step's exchange got back (``PsClient.step_groups``, ``RowSource.exchange``).

    The push's counts stay as the shards sent them (one int64 matrix per storage group, summed
    over shards with one add each) until :attr:`counts` is read: a step pays no per-table work
    for counts nobody reads.

    Attributes:
        rows: the next batch's rows per storage group (float32 [N_g, dim]); None without a pull.
        dense: the dense parameters' new values, flat in the asked order; None without.
        group_counts: per push group, its tables and int64 [tables, 1 + len(PUSH_COUNT_FIELDS)]
            counts (rows, then the PushResult fields), summed over shards.
        other_counts: per table, the counts of what went by the ordinary calls (a fallback).
    """

    rows: "list[torch.Tensor] | None"
    dense: np.ndarray | None
    group_counts: list[tuple[tuple[str, ...], np.ndarray]] = dataclasses.field(default_factory=list)
    other_counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """table -> its push counts (``rows`` and the PushResult fields), every shard and path summed."""
        columns = ("rows",) + PUSH_COUNT_FIELDS
        out = {t: dict(c) for t, c in self.other_counts.items()}
        for names, arr in self.group_counts:
            for name, row in zip(names, arr.tolist()):
                c = out.setdefault(name, dict.fromkeys(columns, 0))
                for f, v in zip(columns, row):
                    c[f] += v
        return out

ERROR_KEY = "metaps-error"
MAP_VERSION_KEY = "metaps-map-version"
STALE_WAIT = "stale_wait"
"""ERROR_KEY value: the caller is ahead of the staleness bound / the barrier is not reached; ask again."""
PAUSED = "paused"
"""ERROR_KEY value: the shard is paused for a checkpoint; ask again."""
CLOCK_EXPIRED = "clock_expired"
"""ERROR_KEY value (FAILED_PRECONDITION): the worker's clock lease ran out; re-register, then resend."""
AWAITING_RECOVERY = "awaiting_recovery"
"""ERROR_KEY value: a restarted shard not yet recovered by the controller (data RPCs: UNAVAILABLE,
the client retries; Checkpoint: FAILED_PRECONDITION)."""
CHECKPOINT_NOT_WRITTEN = "checkpoint_not_written"
"""ERROR_KEY value (Checkpoint: RESOURCE_EXHAUSTED or FAILED_PRECONDITION): the shard file could not
be written (full disk, I/O error, permission); its partial file was removed. Deterministic: the
same write fails again (unlike a restarted shard's FAILED_PRECONDITION, AWAITING_RECOVERY)."""
MIN_CLOCK_KEY = "metaps-min-clock"
WAIT_TIMEOUT_KEY = "metaps-wait-timeout"
MAX_ROWS_KEY = "metaps-max-rows"
"""RESOURCE_EXHAUSTED hint: rows per request that fit the reply in the message limit."""
REPLY_LIMIT_KEY = "metaps-max-reply-bytes"
"""Request metadata: the caller's receive limit; a pull reply is sized to the smaller of it and ours."""


class RowStore(Protocol):
    """The storage of one PS shard as the service uses it (``ps.shard_store.ShardStore``).

    Every method may be called from several gRPC threads at once; the store locks
    per table. Bad input raises ``ps.errors.BadRequest`` naming the table and id.
    """

    @property
    def tables(self) -> Mapping[str, EmbeddingTable]:
        """Table name -> table (each has ``cfg.dim``)."""
        ...

    @property
    def dense(self) -> DenseStore:
        """Dense parameters held by this shard."""
        ...

    def pull(self, table: str, ids: np.ndarray, fp16: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` (int64 [n], known or admitted on read) as float32 (or saturated fp16) [n, dim];
        with ``out`` (writable float32 [n, dim]) written there and returned."""
        ...

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray) -> PushResult:
        """Apply float32 gradients [n, dim] to the rows of unique ``ids`` [n]."""
        ...

    def pull_many(self, items: Sequence[tuple[str, np.ndarray]], *, fp16: bool = False,
                  outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """:meth:`pull` of several tables at once (one lookup and one gather per storage group);
        with ``outs`` (one writable float32 [n, dim] per item) the rows are written there."""
        ...

    def push_many(self, items: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> list[PushResult]:
        """:meth:`push` of several tables at once, every item checked before any is applied."""
        ...

    @property
    def groups(self) -> Sequence[TableGroup]:
        """The storage groups (tables of one dim and optimizer stored and updated together)."""
        ...

    def group_of(self, names: Sequence[str]) -> int:
        """The index of the group holding exactly ``names`` (storage order); ValueError otherwise."""
        ...

    def pull_group(self, group: int, counts: np.ndarray, ids: "torch.Tensor",
                   out: "torch.Tensor | None" = None) -> "torch.Tensor":
        """Rows of one group's ids (counts per table, ids table by table, >= 0), into ``out`` if given."""
        ...

    def push_group(self, group: int, counts: np.ndarray, ids: "torch.Tensor", grads: "torch.Tensor", *,
                   trusted: bool = True) -> list[PushResult]:
        """One group's gradients in one pass; ``trusted=False`` finds repeated ids (a remote caller)."""
        ...

    def export_vshards(self, vshards: Sequence[int]) -> dict[str, TableRows]:
        """A consistent copy of every row of these vshards, per table."""
        ...

    def import_rows(self, table: str, rows: TableRows) -> None:
        """Insert or overwrite rows (weights, optimizer state, metadata) of ``table``."""
        ...

    def drop_vshards(self, vshards: Sequence[int]) -> int:
        """Remove every row of these vshards; returns how many rows went."""
        ...

    def write_lock(self) -> ContextManager[None]:
        """Hold every lock: no pull, push or import runs meanwhile."""
        ...

    def memory_bytes(self) -> int:
        """Bytes held (rows, state, id map, metadata, dense)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Per-table counters (``{"tables": {name: {key: number}}, ...}``)."""
        ...


class ShardHost(Protocol):
    """A serving shard as the checkpoint coordinator sees it (``ps.servicer.PsServer``)."""

    store: RowStore
    """The shard's store (checkpoints need a ``ps.shard_store.ShardStore``; a restore swaps it whole)."""

    @property
    def shard_id(self) -> int:
        ...

    @property
    def pmap(self) -> PartitionMap:
        ...

    def adopt_map(self, pmap: PartitionMap) -> None:
        """Serve under ``pmap`` from now on (the caller holds the shard's exclusive gate)."""
        ...
