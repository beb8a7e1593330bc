"""Id -> row map of one table, on fbgemm's CPU open-addressing hash map.

fbgemm's ``pruned_hashmap_insert`` / ``pruned_hashmap_lookup`` (int64 keys,
linear probing, ~15-20M ops/s here) hold the map. Layout::

    slots  int64 [S, 2]      S = ceil(load_factor * capacity) + 8
    slot:  [ key | row ]      key -1 = never used; row -2 = removed (tombstone)

fbgemm has no delete: :meth:`IdMap.remove` re-inserts the key with row -2 (a
tombstone: lookups report -1, the slot keeps its key so probe chains stay
intact; fbgemm's insert silently skips row -1, hence -2). Tombstones are reclaimed by rebuilding the map from its live entries
once used slots pass ``rebuild_at`` of S, so the cost is amortized over many
removals. fbgemm's insert loops forever on a full table, so the map refuses an
insert that would take it past capacity (live entries) and rebuilds before
used slots (live + tombstones) could fill it.

Id -1 is the map's empty-slot marker and the schema's padding id; it is refused.

Every change of the map (insert, remove, rebuild, clear, and a caller's
:meth:`IdMap.reserve` before it writes :attr:`IdMap.slots` itself) adds one to
:attr:`IdMap.generation`, a counter the tables of one storage group share
(``ps.table_storage``), so a lookup result taken at generation g is still the
map's answer while the counter reads g (``ps.table_group``: a push reuses its
pull's lookup).

Example::

    m = IdMap(capacity=4)
    m.insert(np.array([10, 20]), np.array([0, 1]))
    m.lookup(np.array([20, 30]))   # array([ 1, -1])
"""

from __future__ import annotations

import numpy as np
import torch

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

from ps import hugepages

EMPTY_KEY = -1
TOMBSTONE = -2


LOAD_FACTOR = 1.5
"""Default hash slots per entry of capacity."""


def slots_for(capacity: int, load_factor: float = LOAD_FACTOR) -> int:
    """Hash slots of a map of ``capacity`` entries (what :class:`IdMap` allocates, or takes as ``slots``).

    Args:
        capacity: most live entries.
        load_factor: slots per entry (>= 1.2).
    """
    return int(np.ceil(load_factor * capacity)) + 8


class IdMap:
    """Fixed-capacity int64 id -> int64 row map (see the module docstring).

    Args:
        capacity: most live entries the map holds.
        load_factor: hash slots per entry of capacity (>= 1.2).
        rebuild_at: fraction of slots in use (live + tombstones) that triggers a rebuild.
        slots: int64 [slots_for(capacity, load_factor), 2] filled with -1 to hold the map (a view
            into a group's slot array, ``ps.table_storage``); None: allocated here.
        generation: int64 [1] change counter to share (a group's, ``GroupStorage.map_generation``);
            None: one of its own.
    """

    def __init__(self, capacity: int, load_factor: float = LOAD_FACTOR, rebuild_at: float = 0.85,
                 slots: torch.Tensor | None = None, generation: np.ndarray | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"IdMap capacity must be >= 1, got {capacity}")
        if load_factor < 1.2:
            raise ValueError(f"IdMap load_factor must be >= 1.2, got {load_factor}")
        self._capacity = int(capacity)
        self._slots_n = slots_for(capacity, load_factor)
        # at full capacity live / slots <= 1 / load_factor; keep the trigger above it
        self._rebuild_slots = max(int(rebuild_at * self._slots_n), self._capacity + 1)
        if slots is None:
            slots = hugepages.full((self._slots_n, 2), EMPTY_KEY, torch.int64)  # random probes: 2 MiB pages
        elif tuple(slots.shape) != (self._slots_n, 2) or slots.dtype != torch.int64 or not slots.is_contiguous():
            raise ValueError(f"IdMap slots must be contiguous int64 [{self._slots_n}, 2], got {slots.dtype} "
                             f"{list(slots.shape)}")
        self._table = slots
        self._table_offsets = torch.tensor([0, self._slots_n], dtype=torch.int64)
        self._size = 0
        self._used_slots = 0  # live + tombstones (slots whose key != -1)
        self.rebuilds = 0
        if generation is None:
            generation = np.zeros(1, dtype=np.int64)
        elif generation.shape != (1,) or generation.dtype != np.int64:
            raise ValueError(f"IdMap generation must be int64 [1], got {generation.dtype} {list(generation.shape)}")
        self.generation = generation
        """int64 [1]: +1 at every change of the map (shared by a storage group's tables)."""

    # -- queries -------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Live entries."""
        return self._size

    @property
    def capacity(self) -> int:
        return self._capacity

    def memory_bytes(self) -> int:
        return self._table.numel() * self._table.element_size()

    def lookup(self, ids: np.ndarray | torch.Tensor, *, checked: bool = False) -> torch.Tensor:
        """Rows of ``ids`` (int64 [n]); -1 for unknown ids. Returns an int64 CPU tensor.

        Args:
            ids: int64 [n].
            checked: the caller has already refused id -1 (``check_ids``): the scan for
                it is skipped (the pull path: one pass over the ids fewer).
        """
        t = _as_ids(ids, reserved_checked=checked)
        if t.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        offsets = torch.tensor([0, t.numel()], dtype=torch.int64)
        rows = torch.ops.fbgemm.pruned_hashmap_lookup(t, offsets, self._table, self._table_offsets)
        found: torch.Tensor = rows.clamp_(min=-1)  # tombstones (-2) read as unknown
        return found

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All live (ids, rows) as int64 arrays, in slot order."""
        keys = self._table[:, 0]
        rows = self._table[:, 1]
        live = (keys != EMPTY_KEY) & (rows >= 0)
        return keys[live].numpy().copy(), rows[live].numpy().copy()

    # -- updates -------------------------------------------------------------------
    def insert(
        self, ids: np.ndarray | torch.Tensor, rows: np.ndarray | torch.Tensor, *, known_new: bool = False
    ) -> None:
        """Map unique ``ids`` to ``rows`` (an existing id is overwritten).

        Args:
            ids: int64 [n], unique, no -1.
            rows: int64 [n], >= 0.
            known_new: the caller guarantees ``ids`` are unique and absent from the
                map (the insert path of a push: ids from ``torch.unique`` that looked
                up as -1), so the uniqueness sort and the lookup are skipped.

        Raises:
            ValueError: ids contain -1 or duplicates, lengths differ, or the map
                would exceed capacity. Nothing is inserted then.
        """
        t = _as_ids(ids)
        r = _as_ids(rows, what="rows")
        if t.numel() != r.numel():
            raise ValueError(f"IdMap.insert: {t.numel()} ids but {r.numel()} rows")
        if t.numel() == 0:
            return
        if bool((r < 0).any()):
            raise ValueError("IdMap.insert: rows must be >= 0 (use remove() to delete)")
        if known_new:
            n_new = int(t.numel())
        else:
            if t.unique().numel() != t.numel():  # type: ignore[no-untyped-call]  # torch.unique is untyped
                raise ValueError("IdMap.insert: ids must be unique")
            n_new = int((self.lookup(t) < 0).sum())
        if self._size + n_new > self._capacity:
            raise ValueError(
                f"IdMap.insert: {n_new} new ids would exceed capacity {self._capacity} (size {self._size})"
            )
        # worst case every new id takes a fresh slot; rebuild first so the table never fills
        if self._used_slots + n_new > self._rebuild_slots:
            self._rebuild()
        self._raw_insert(t, r)
        self._size += n_new
        # a re-inserted tombstoned key reuses its slot; counting it as fresh only
        # overestimates, which makes the next rebuild come early (and exact again)
        self._used_slots += n_new

    def reserve(self, n_new: int) -> None:
        """Account ``n_new`` ids about to be inserted by the caller straight into :attr:`slots`
        (a group's one multi-table insert, ``ps.table_group``): the capacity check and the
        rebuild-before-full of :meth:`insert`, done first.

        Raises:
            ValueError: ``n_new`` more ids would exceed the capacity (nothing changed).
        """
        if self._size + n_new > self._capacity:
            raise ValueError(f"IdMap.insert: {n_new} new ids would exceed capacity {self._capacity} (size {self._size})")
        if self._used_slots + n_new > self._rebuild_slots:
            self._rebuild()
        self._size += n_new
        self._used_slots += n_new
        self.generation[0] += 1  # the caller inserts next

    @property
    def slots(self) -> torch.Tensor:
        """The hash slots (int64 [S, 2]; a view into a group's slot array when given one)."""
        return self._table

    def remove(self, ids: np.ndarray | torch.Tensor) -> int:
        """Remove ``ids`` (unknown ids are ignored). Returns how many were removed."""
        t = _as_ids(ids)
        if t.numel() == 0:
            return 0
        t = t.unique()  # type: ignore[no-untyped-call]  # torch.unique is untyped
        present = t[self.lookup(t) >= 0]
        n = int(present.numel())
        if n:
            self._raw_insert(present, torch.full_like(present, TOMBSTONE))
            self._size -= n
        return n

    def clear(self) -> None:
        self.generation[0] += 1
        self._table.fill_(EMPTY_KEY)
        self._size = 0
        self._used_slots = 0

    # -- internals -----------------------------------------------------------------
    def _raw_insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.generation[0] += 1
        offsets = torch.tensor([0, ids.numel()], dtype=torch.int64)
        torch.ops.fbgemm.pruned_hashmap_insert(ids, rows, offsets, self._table, self._table_offsets)

    def _rebuild(self) -> None:
        self.generation[0] += 1
        ids, rows = self.items()
        self._table.fill_(EMPTY_KEY)
        if ids.size:
            self._raw_insert(torch.from_numpy(ids), torch.from_numpy(rows))
        self._used_slots = int(ids.size)
        self.rebuilds += 1


def _as_ids(x: np.ndarray | torch.Tensor, what: str = "ids", reserved_checked: bool = False) -> torch.Tensor:
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        x = x.copy()  # e.g. np.frombuffer over a request: torch warns on read-only memory
    t = torch.as_tensor(x)
    if t.dtype != torch.int64:
        raise ValueError(f"IdMap: {what} must be int64, got {t.dtype}")
    t = t.reshape(-1).contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    if what == "ids" and not reserved_checked and t.numel() and bool((t == EMPTY_KEY).any()):
        raise ValueError("IdMap: id -1 is reserved (empty-slot marker / padding id)")
    return t
