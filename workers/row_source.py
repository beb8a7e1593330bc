"""Where a worker gets embedding rows and dense parameters from.

The training loop talks to a :class:`RowSource` only, so the distributed
worker (:class:`RemoteRowSource`, gRPC to the PS fleet) and the local
reference (:class:`LocalRowSource`, an in-process :class:`~ps.shard_store.ShardStore`
with the very same optimizers) run the same code: that is what makes
``metaps train-local`` a parity reference and a speed baseline.

Example::

    src = LocalRowSource(ShardStore(tables, shard_id=0, num_vshards=256, seed=0))
    rows = src.pull({"item": np.array([3, 7])})        # {"item": float32 [2, dim]}
    src.push({"item": (np.array([3, 7]), grads)})
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ps.types import StepResult

if TYPE_CHECKING:
    import torch


class GroupedIds(Protocol):
    """A step's ids per PS storage group (``models.embedding.GroupedIndex`` / ``MetaGroupedIndex``)."""

    @property
    def tables(self) -> list[tuple[str, ...]]: ...

    @property
    def counts(self) -> list[np.ndarray]: ...

    @property
    def ids(self) -> list[torch.Tensor]: ...

    @property
    def dims(self) -> list[int]: ...


DenseGrads = tuple[list[str], np.ndarray, list[int]]
"""A step's dense gradients as one flat float32 array: (names, flat, each one's size)."""
IdsByTable = dict[str, np.ndarray]
RowsByTable = dict[str, np.ndarray]
GradsByTable = dict[str, tuple[np.ndarray, np.ndarray]]


class RowSource(Protocol):
    def pull(self, ids: IdsByTable, step: int | None = None) -> RowsByTable: ...

    def pull_groups(self, index: GroupedIds, step: int | None = None) -> list[torch.Tensor]: ...

    def pull_groups_async(self, index: GroupedIds, step: int | None = None) -> "Future[list[torch.Tensor]]": ...

    def push_groups(self, index: GroupedIds, grads: list[torch.Tensor], step: int) -> None: ...

    def push_groups_async(self, index: GroupedIds, grads: list[torch.Tensor], step: int) -> "Future[None]": ...

    def pull_async(self, ids: IdsByTable, step: int | None = None) -> "Future[RowsByTable]": ...

    def push(self, grads: GradsByTable, step: int) -> None: ...

    def push_async(self, grads: GradsByTable, step: int) -> "Future[None]": ...

    def register_dense(self, params: dict[str, np.ndarray]) -> None: ...

    def pull_dense(self, names: list[str]) -> dict[str, np.ndarray]: ...

    def push_dense(self, grads: dict[str, np.ndarray], step: int) -> None: ...

    def push_pull_dense(self, grads: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]: ...

    def set_dense(self, values: dict[str, np.ndarray]) -> None: ...

    def exchange(self, push: tuple[GroupedIds, list[torch.Tensor]] | None, dense: DenseGrads | None,
                 pull: GroupedIds | None, step: int | None) -> StepResult: ...

    def exchange_async(self, push: tuple[GroupedIds, list[torch.Tensor]] | None, dense: DenseGrads | None,
                       pull: GroupedIds | None, step: int | None) -> "Future[StepResult]": ...

    def checkpoint(self, root: Path, step: int, info: dict[str, Any], full_every: int = 1) -> Path: ...

    def leave_clock(self) -> None: ...

    def join_clock(self, step: int) -> int | None: ...

    def close(self) -> None: ...


class _Done(Future):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.set_result(value)


class LocalRowSource:
    """Rows and dense parameters in one in-process ShardStore (no RPC)."""

    in_process = True
    """Calls complete before returning: the trainer's overlap lane has nothing to hide."""
    supports_groups = True
    """Has :meth:`pull_groups` / :meth:`push_groups` (a step's tables per storage group)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._groups: dict[tuple[str, ...], int | None] = {}

    def pull(self, ids: IdsByTable, step: int | None = None) -> RowsByTable:
        return {t: self.store.pull(t, v) for t, v in ids.items()}

    def _group(self, names: tuple[str, ...]) -> int | None:
        """The store's group holding exactly ``names`` (None: the store groups them otherwise)."""
        if names not in self._groups:
            try:
                self._groups[names] = self.store.group_of(names)
            except ValueError:
                self._groups[names] = None
        return self._groups[names]

    def pull_groups(self, index: GroupedIds, step: int | None = None) -> list[torch.Tensor]:
        """One store call per group (trusted: the ids are the reader's unique ids)."""
        import torch

        out = []
        for names, counts, ids in zip(index.tables, index.counts, index.ids):
            gi = self._group(names)
            if gi is not None:
                out.append(self.store.pull_group(gi, counts, ids))
            else:  # table by table
                parts = torch.split(ids, counts.tolist())
                out.append(torch.cat([torch.from_numpy(self.store.pull(t, p.numpy())) for t, p in zip(names, parts)]))
        return out

    def pull_groups_async(self, index: GroupedIds, step: int | None = None) -> "Future[list[torch.Tensor]]":
        return _Done(self.pull_groups(index))

    def push_groups(self, index: GroupedIds, grads: list[torch.Tensor], step: int) -> None:
        """One store call per group: one lookup, one fused update (trusted, finiteness checked once)."""
        import torch

        for names, counts, ids, g in zip(index.tables, index.counts, index.ids, grads):
            gi = self._group(names)
            if gi is not None:
                self.store.push_group(gi, counts, ids, g)
                continue
            for t, i, gg in zip(names, torch.split(ids, counts.tolist()), torch.split(g, counts.tolist())):
                if i.numel():
                    self.store.push(t, i.numpy(), gg.contiguous().numpy())

    def push_groups_async(self, index: GroupedIds, grads: list[torch.Tensor], step: int) -> "Future[None]":
        """Applied before returning (in-process: nothing to overlap with)."""
        self.push_groups(index, grads, step)
        return _Done(None)

    def pull_async(self, ids: IdsByTable, step: int | None = None) -> "Future[RowsByTable]":
        return _Done(self.pull(ids))

    def push(self, grads: GradsByTable, step: int) -> None:
        for table, (ids, g) in grads.items():
            if len(ids):
                self.store.push(table, ids, g)

    def push_async(self, grads: GradsByTable, step: int) -> "Future[None]":
        """Applied before returning (in-process: nothing to overlap with)."""
        self.push(grads, step)
        return _Done(None)

    def register_dense(self, params: dict[str, np.ndarray]) -> None:
        for name, value in params.items():
            self.store.dense.register(name, value)

    def pull_dense(self, names: list[str]) -> dict[str, np.ndarray]:
        return self.store.dense.pull(names)

    def push_dense(self, grads: dict[str, np.ndarray], step: int) -> None:
        self.store.dense.push(grads)

    def push_pull_dense(self, grads: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        """Apply dense gradients, then the pushed parameters' new values."""
        self.store.dense.push(grads)
        return self.store.dense.pull(list(grads))

    supports_exchange = True
    """Has :meth:`exchange`, with the remote source's order and results (the parity reference)."""

    def exchange(self, push: tuple[GroupedIds, list[torch.Tensor]] | None, dense: DenseGrads | None,
                 pull: GroupedIds | None, step: int | None) -> StepResult:
        """A step's push, dense update (new values back) and next pull, applied in that order,
        as a shard applies a StepFrame (``RemoteRowSource.exchange``)."""
        if push is not None:
            self.push_groups(push[0], push[1], step if step is not None else 0)
        values = None
        if dense is not None:
            from ps.step_frame import DenseSection

            names, flat, sizes = dense
            self.store.dense.push(DenseSection(names, sizes, flat).split())  # as the shard splits a step's
            got = self.store.dense.pull(names)
            values = np.concatenate([got[n].reshape(-1) for n in names]) if names else np.empty(0, np.float32)
        return StepResult(rows=self.pull_groups(pull) if pull is not None else None, dense=values)

    def exchange_async(self, push: tuple[GroupedIds, list[torch.Tensor]] | None, dense: DenseGrads | None,
                       pull: GroupedIds | None, step: int | None) -> "Future[StepResult]":
        """Applied before returning (in-process: nothing to overlap with)."""
        return _Done(self.exchange(push, dense, pull, step))

    def set_dense(self, values: dict[str, np.ndarray]) -> None:
        self.register_dense(values)
        self.store.dense.set(values)

    def checkpoint(self, root: Path, step: int, info: dict[str, Any], full_every: int = 1) -> Path:
        from ps.coordinator import checkpoint_local

        # full, or a delta ([ps] checkpoint_full_every); a failure leaves no tmp dir, a full disk
        # raises CheckpointCoordinationError (a periodic cut is skipped, training goes on)
        return checkpoint_local(self.store, root, step, info, full_every)

    def leave_clock(self) -> None:
        pass  # one process: no staleness clocks

    def join_clock(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class RemoteRowSource:
    """Rows from the sharded PS fleet through :class:`ps.client.PsClient`."""

    supports_exchange = True
    """Has :meth:`exchange`: a step's push, dense sync and next pull in one message per shard."""
    supports_groups = True
    """Has :meth:`pull_groups` / :meth:`push_groups` (a step's tables per storage group)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="row-push")

    def pull(self, ids: IdsByTable, step: int | None = None) -> RowsByTable:
        return self.client.pull(ids, step=step)

    def pull_async(self, ids: IdsByTable, step: int | None = None) -> "Future[RowsByTable]":
        return self.client.pull_async(ids, step=step)

    def pull_groups(self, index: GroupedIds, step: int | None = None) -> list[torch.Tensor]:
        """Rows per group: one request per shard for every table of the step."""
        return self.client.pull_groups(index.tables, index.counts, index.ids, index.dims, step=step)

    def pull_groups_async(self, index: GroupedIds, step: int | None = None) -> "Future[list[torch.Tensor]]":
        return self.client.pull_groups_async(index.tables, index.counts, index.ids, index.dims, step=step)

    def push_groups(self, index: GroupedIds, grads: list[torch.Tensor], step: int) -> None:
        self.client.push_groups(index.tables, index.counts, index.ids, grads, step=step)

    def push_groups_async(self, index: GroupedIds, grads: list[torch.Tensor], step: int) -> "Future[None]":
        """:meth:`push_groups` on a background thread (the caller must not modify ``grads`` until done)."""
        return self._pusher.submit(self.push_groups, index, grads, step)

    def push(self, grads: GradsByTable, step: int) -> None:
        self.client.push(grads, step=step)

    def push_async(self, grads: GradsByTable, step: int) -> "Future[None]":
        """:meth:`push` on a background thread (the caller must not modify ``grads`` until done)."""
        return self._pusher.submit(self.client.push, grads, step=step)

    def register_dense(self, params: dict[str, np.ndarray]) -> None:
        self.client.register_dense(params)

    def pull_dense(self, names: list[str]) -> dict[str, np.ndarray]:
        return self.client.pull_dense(names)

    def push_dense(self, grads: dict[str, np.ndarray], step: int) -> None:
        self.client.push_dense(grads)

    def push_pull_dense(self, grads: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        """Apply dense gradients and get the new values back: one round trip per shard."""
        return self.client.push_dense(grads, return_values=True)

    def exchange(self, push: tuple[GroupedIds, list[torch.Tensor]] | None, dense: DenseGrads | None,
                 pull: GroupedIds | None, step: int | None) -> StepResult:
        """A step's traffic in one message per shard (``PsClient.step_groups``): the push of
        ``step`` and its dense gradients (new values back), then the pull of the next batch.

        Args:
            push: the step's grouped ids and their row gradients per group (None: none).
            dense: (names, flat gradients, sizes) (None: no dense exchange).
            pull: the next batch's grouped ids (None: no pull).
            step: the step the push completes.

        Returns:
            ``ps.client.StepResult``: the pulled rows per group, the new dense values (flat).
        """
        g = None
        if push is not None:
            index, grads = push
            g = (index.tables, index.counts, index.ids, grads)
        q = (pull.tables, pull.counts, pull.ids, pull.dims) if pull is not None else None
        return self.client.step_groups(push=g, dense=dense, pull=q, step=step)

    def exchange_async(self, push: tuple[GroupedIds, list[torch.Tensor]] | None, dense: DenseGrads | None,
                       pull: GroupedIds | None, step: int | None) -> "Future[StepResult]":
        """:meth:`exchange` on a background thread (the caller keeps ``push`` and ``dense`` unchanged until done)."""
        return self._pusher.submit(self.exchange, push, dense, pull, step)

    def set_dense(self, values: dict[str, np.ndarray]) -> None:
        self.client.set_dense(values)

    def checkpoint(self, root: Path, step: int, info: dict[str, Any], full_every: int = 1) -> Path:
        from ps.coordinator import checkpoint_all

        return checkpoint_all(self.client.addresses, Path(root), step, rpc_cfg=self.client.rpc_cfg, extra_info=info,
                              full_every=full_every)

    def leave_clock(self) -> None:
        self.client.leave_clock()

    def join_clock(self, step: int) -> int:
        return self.client.join_clock(step)

    def close(self) -> None:
        self._pusher.shutdown(wait=True)
        self.client.close()
