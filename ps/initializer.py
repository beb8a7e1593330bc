"""Initial embedding rows: deterministic per (table name, id, seed).

A row's initial value depends only on the table name, the id and the job seed,
never on which shard (or which row slot) holds it, so a resharded or restarted
job and a not-yet-admitted id all read the same value. Values are computed
vectorized from counters hashed with :func:`metaps.core.hashing.mix64`::

    key[i]      = mix64(id[i], salt = mix64(fnv(table)) ^ seed)
    u1[i, j]    = uniform(mix64(key[i] + 2j))       in (0, 1]
    u2[i, j]    = uniform(mix64(key[i] + 2j + 1))   in (0, 1]
    normal      = scale * sqrt(-2 ln u1) * cos(2 pi u2)        (Box-Muller)
    uniform     = scale * (2 u1 - 1)

The rows are computed in blocks of ~16K elements, in place in scratch arrays
that stay in L2, with the same float64 operations in the same order, so the
values are bit-identical to evaluating the formula on whole arrays (tested
against that transcription in tests/ps/test_insert_path.py). The floor is
glibc's scalar ``log`` and ``cos`` (numpy uses them for float64 on AVX2):
~20 ns per element, i.e. ~1.3 us per row of dim 64.

Example::

    init = RowInitializer("user", dim=8, kind=InitKind.NORMAL, scale=0.01, seed=0)
    init(np.array([1, 2, 3]))   # float32 [3, 8], same on every shard
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from metaps.core.hashing import hash_strings, mix64
from ps.config import InitKind

_TWO_POW_M53 = 1.0 / float(1 << 53)
_CHUNK_ELEMS = 16384
"""Elements per block: the ~6 scratch arrays of a block (128 KiB each) stay in L2."""


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
        out = np.empty((n, self.dim), dtype=np.float32)
        key = mix64(ids, salt=self._salt)[:, None]
        step = max(1, _CHUNK_ELEMS // self.dim)
        shape = (min(step, n), self.dim)
        bufs = _Buffers(shape, normal=self.kind == InitKind.NORMAL)
        with np.errstate(over="ignore"):
            for lo in range(0, n, step):  # per cache-sized block of rows, vectorized inside
                hi = min(n, lo + step)
                self._block(key[lo:hi], out[lo:hi], bufs.view(hi - lo))
        return out

    def _block(self, key: np.ndarray, out: np.ndarray, b: "_Buffers") -> None:
        """Rows of one block, in place in ``b``: the same float64 operations, in the same
        order, as the formula in the module docstring, so the values are bit-identical."""
        np.add(key, self._col, out=b.c)
        if self.kind == InitKind.NORMAL:
            np.add(b.c, _ONE, out=b.c2)  # c + 1 (u2's counter)
        _mix64_(b.c, b.tmp)
        _unit_(b.c, b.f1)  # u1
        if self.kind == InitKind.UNIFORM:
            b.f1 *= 2.0
            b.f1 -= 1.0
            b.f1 *= self.scale
            out[...] = b.f1
            return
        _mix64_(b.c2, b.tmp)
        _unit_(b.c2, b.f2)  # u2
        np.log(b.f1, out=b.f1)
        b.f1 *= -2.0
        np.sqrt(b.f1, out=b.f1)
        b.f2 *= _TWO_PI  # (2.0 * np.pi) * u2, as Python evaluates 2.0 * np.pi * u2
        np.cos(b.f2, out=b.f2)
        b.f1 *= b.f2
        b.f1 *= self.scale
        out[...] = b.f1  # float64 -> float32, round to nearest (as astype)


class _Buffers:
    """Scratch arrays of one block (reused across blocks; cache-sized)."""

    def __init__(self, shape: tuple[int, int], normal: bool) -> None:
        self.shape = shape
        self._c = np.empty(shape, dtype=np.uint64)
        self._c2 = np.empty(shape, dtype=np.uint64) if normal else self._c
        self._tmp = np.empty(shape, dtype=np.uint64)
        self._f1 = np.empty(shape, dtype=np.float64)
        self._f2 = np.empty(shape, dtype=np.float64) if normal else self._f1

    def view(self, rows: int) -> "_Buffers":
        v = object.__new__(_Buffers)
        v.c, v.c2, v.tmp = self._c[:rows], self._c2[:rows], self._tmp[:rows]
        v.f1, v.f2 = self._f1[:rows], self._f2[:rows]
        return v


_ONE = np.uint64(1)
_TWO_PI = 2.0 * np.pi
_MIX_ADD = np.uint64(0x9E3779B97F4A7C15)
_MIX_M1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


def _mix64_(z: np.ndarray, tmp: np.ndarray) -> None:
    """``z = mix64(z)`` (salt 0) in place; ``tmp`` is scratch of z's shape (same bits as metaps.core.hashing.mix64)."""
    z += _MIX_ADD
    np.right_shift(z, _S30, out=tmp)
    z ^= tmp
    z *= _MIX_M1
    np.right_shift(z, _S27, out=tmp)
    z ^= tmp
    z *= _MIX_M2
    np.right_shift(z, _S31, out=tmp)
    z ^= tmp


def _unit_(u: np.ndarray, out: np.ndarray) -> None:
    """``out = _unit(u)``; clobbers ``u``. (u >> 11) + 1 <= 2^53 is exact in float64, so
    adding the 1 before the conversion gives the same value as adding 1.0 after it."""
    u >>= _S11
    u += _ONE
    np.multiply(u, _TWO_POW_M53, out=out)
