"""Admission of new ids into a table: a frequency filter with bounded memory.

An id without a row is a *candidate*. Each push that carries it is one
sighting. Sightings are counted in a count-min sketch (depth 4, int32 cells)
whose width is fixed at construction, so memory stays bounded however many
distinct ids arrive::

    cells int32 [DEPTH, width]
    h = mix64(id, SALT);  a = h mod 2^32;  b = (h >> 32) | 1
    cell(d, id) = (((a + d b) mod 2^32) * width) >> 32     d = 0 .. DEPTH-1
    count(id) = min_d cells[d, cell(d, id)]       (never under-counts)

(double hashing, Kirsch & Mitzenmacher 2006: one 64-bit hash per id gives the
DEPTH cells; multiply-shift maps 32 bits onto [0, width) without a division).
One push's sightings are one vectorized update: gather the DEPTH x n cells,
``est = min + 1``, then each cell becomes ``max(cell, est of every id hitting
it)`` (a ``scatter_reduce`` amax: colliding ids of one batch are all counted
against the counts before the push, in any order, as ``np.maximum.at`` did).

Rules (:class:`ps.config.AdmissionConfig`): admitted when ``count >= min_count``
(``min_count > 1``) or, per sighting, when ``u(id, count, seed) < probability``
(``probability < 1``; ``u`` is a hash-derived uniform, so the decision is
deterministic). Count-min can over-count under collisions, which can only admit
an id early, never late. Cells are halved every ``10 * width`` sightings (aging,
as in TinyLFU) so stale counts fade. When admission is immediate no sketch is
allocated.

Example::

    adm = Admission(AdmissionConfig(min_count=2), capacity=1000, seed=0)
    adm.observe(np.array([7, 8]))   # array([False, False])
    adm.observe(np.array([7]))      # array([ True])
"""

from __future__ import annotations

import numpy as np
import torch

from common.hashing import mix64
from ps.config import AdmissionConfig

DEPTH = 4
_SALT = 0x243F6A8885A308D3
_PROB_SALT = 0x452821E638D01377
_D = np.arange(DEPTH, dtype=np.uint64)[:, None]
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


class Admission:
    """Count sightings of candidate ids and decide admission (vectorized).

    Args:
        cfg: the table's admission rule.
        capacity: the table's row capacity (sizes the sketch: width = max(1024, capacity)).
        seed: job seed (probabilistic rule).
    """

    def __init__(self, cfg: AdmissionConfig, capacity: int, seed: int) -> None:
        self.cfg = cfg
        self.seed = int(seed)
        self.width = 0
        self._cells: np.ndarray | None = None
        self._flat = torch.empty(0, dtype=torch.int32)  # the cells, flat, as a torch view
        self._sightings = 0
        if not cfg.immediate:
            self.width = int(max(1024, capacity))
            self._cells = np.zeros((DEPTH, self.width), dtype=np.int32)
            self._flat = torch.from_numpy(self._cells.reshape(-1))  # same memory

    def memory_bytes(self) -> int:
        return 0 if self._cells is None else int(self._cells.nbytes)

    def _flat_cells(self, ids: np.ndarray) -> np.ndarray:
        """int64 [DEPTH, n]: flat index (d * width + cell(d, id)) of each id's cells."""
        h = mix64(ids, salt=_SALT)
        a = h & _M32
        b = (h >> _S32) | np.uint64(1)
        x = (a[None, :] + _D * b[None, :]) & _M32  # < 2^32
        x *= np.uint64(self.width)  # < 2^32 * width < 2^64
        x >>= _S32
        x += _D * np.uint64(self.width)
        return x.view(np.int64)

    def count(self, ids: np.ndarray) -> np.ndarray:
        """Current (over-)estimate of sightings of ``ids`` (int64 [n]).

        Args:
            ids: int64 [n].
        """
        if self._cells is None:
            return np.zeros(len(ids), dtype=np.int64)
        flat = self._flat_cells(np.asarray(ids, dtype=np.int64))
        counts: np.ndarray = self._cells.reshape(-1).take(flat).min(axis=0).astype(np.int64)
        return counts

    def observe(self, ids: np.ndarray) -> np.ndarray:
        """Record one sighting of each (unique) id; return which are admitted now."""
        ids = np.asarray(ids, dtype=np.int64)
        n = ids.shape[0]
        if self._cells is None or n == 0:
            return np.ones(n, dtype=bool)
        flat = self._flat_cells(ids)
        # conservative update: each cell becomes max(cell, est of every id hitting it),
        # so only the cells at an id's minimum rise; one scatter for the whole batch
        est = self._cells.reshape(-1).take(flat).min(axis=0) + 1  # int32 [n]
        self._flat.scatter_reduce_(
            0, torch.from_numpy(flat.reshape(-1)), torch.from_numpy(np.tile(est, DEPTH)), "amax"
        )
        admitted = np.zeros(n, dtype=bool)
        if self.cfg.min_count > 1:
            admitted |= est >= self.cfg.min_count
        if self.cfg.probability < 1.0:
            with np.errstate(over="ignore"):
                h = mix64(mix64(ids, salt=_PROB_SALT ^ self.seed) + est.astype(np.uint64))
            u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / float(1 << 53))
            admitted |= u < self.cfg.probability
        self._sightings += n
        if self._sightings >= 10 * self.width:
            self._cells >>= 1
            self._sightings = 0
        return admitted

    def forget(self, ids: np.ndarray) -> None:
        """Nothing to undo: the sketch has no per-id entries (kept for symmetry)."""

    def state(self) -> dict[str, np.ndarray]:
        """Sketch cells for checkpoints (empty when admission is immediate)."""
        return {} if self._cells is None else {"cells": self._cells.copy()}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        cells = state.get("cells")
        if cells is not None and self._cells is not None and cells.shape == self._cells.shape:
            self._cells[...] = cells
