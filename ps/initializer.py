"""Initial embedding rows: deterministic per (table name, id, seed).

A row's initial value depends only on the table name, the id and the job seed,
never on which shard (or which row slot) holds it, so a resharded or restarted
job and a not-yet-admitted id all read the same value. Values are computed
vectorized from counters hashed with :func:`metaps.hashing.mix64`::

    key[i]      = mix64(id[i], salt = mix64(fnv(table)) ^ seed)
    u1[i, j]    = uniform(mix64(key[i] + 2j))       in (0, 1]
    u2[i, j]    = uniform(mix64(key[i] + 2j + 1))   in (0, 1]
    normal      = scale * sqrt(-2 ln u1) * cos(2 pi u2)        (Box-Muller)
    uniform     = scale * (2 u1 - 1)

Example::

    init = RowInitializer("user", dim=8, kind=InitKind.NORMAL, scale=0.01, seed=0)
    init(np.array([1, 2, 3]))   # float32 [3, 8], same on every shard
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from metaps.hashing import hash_strings, mix64
from ps.config import InitKind

_TWO_POW_M53 = 1.0 / float(1 << 53)


def _unit(u: np.ndarray) -> np.ndarray:
    """uint64 -> float64 in (0, 1] using the top 53 bits."""
    return ((u >> np.uint64(11)).astype(np.float64) + 1.0) * _TWO_POW_M53


class RowInitializer:
    """Deterministic initial rows of one table.

    Args:
        table: table name (part of the hash salt, so tables differ).
        dim: row length.
        kind: normal, uniform or zeros.
        scale: std (normal) or half-width (uniform).
        seed: job seed.
    """

    def __init__(self, table: str, dim: int, kind: InitKind, scale: float, seed: int) -> None:
        self.table = table
        self.dim = int(dim)
        self.kind = InitKind(kind)
        self.scale = float(scale)
        name_hash = int(hash_strings(pa.array([table]))[0])
        self._salt = int(mix64(np.uint64(name_hash))) ^ (int(seed) & 0xFFFFFFFFFFFFFFFF)
        self._col = (np.arange(self.dim, dtype=np.uint64) * np.uint64(2))[None, :]

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """Initial rows of ``ids`` (int64 [n]) as float32 [n, dim]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if self.kind == InitKind.ZEROS or n == 0 or self.scale == 0.0:
            return np.zeros((n, self.dim), dtype=np.float32)
        key = mix64(ids, salt=self._salt)[:, None]
        with np.errstate(over="ignore"):
            c = key + self._col
            u1 = _unit(mix64(c))
            if self.kind == InitKind.UNIFORM:
                return (self.scale * (2.0 * u1 - 1.0)).astype(np.float32)
            u2 = _unit(mix64(c + np.uint64(1)))
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        return (self.scale * z).astype(np.float32)
