"""Admission of new ids into a table: a frequency filter with bounded memory.

An id without a row is a *candidate*. Each push that carries it is one
sighting. Sightings are counted in a count-min sketch (depth 4, int32 cells)
whose width is fixed at construction, so memory stays bounded however many
distinct ids arrive::

    cells int32 [DEPTH, width]     cell(d, id) = mix64(id, salt_d) % width
    count(id) = min_d cells[d, cell(d, id)]       (never under-counts)

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

from metaps.core.hashing import mix64
from ps.config import AdmissionConfig

DEPTH = 4
_SALTS = [0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89]
_PROB_SALT = 0x452821E638D01377


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
        self._sightings = 0
        if not cfg.immediate:
            self.width = int(max(1024, capacity))
            self._cells = np.zeros((DEPTH, self.width), dtype=np.int32)

    def memory_bytes(self) -> int:
        return 0 if self._cells is None else int(self._cells.nbytes)

    def _cols(self, ids: np.ndarray) -> np.ndarray:
        w = np.uint64(self.width)
        return np.stack([(mix64(ids, salt=s) % w).astype(np.int64) for s in _SALTS])

    def count(self, ids: np.ndarray) -> np.ndarray:
        """Current (over-)estimate of sightings of ``ids`` (int64 [n])."""
        if self._cells is None:
            return np.zeros(len(ids), dtype=np.int64)
        cols = self._cols(ids)
        counts: np.ndarray = self._cells[np.arange(DEPTH)[:, None], cols].min(axis=0).astype(np.int64)
        return counts

    def observe(self, ids: np.ndarray) -> np.ndarray:
        """Record one sighting of each (unique) id; return which are admitted now."""
        ids = np.asarray(ids, dtype=np.int64)
        n = ids.shape[0]
        if self._cells is None or n == 0:
            return np.ones(n, dtype=bool)
        cols = self._cols(ids)
        rows = np.arange(DEPTH)[:, None]
        # conservative update: only raise the cells that equal the current minimum
        cur = self._cells[rows, cols]
        est = cur.min(axis=0) + 1
        np.maximum.at(self._cells, (np.broadcast_to(rows, cols.shape), cols), np.broadcast_to(est, cols.shape).astype(np.int32))
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
