"""Initial embedding rows: deterministic per (table name, id, seed), at gather speed.

A row's initial value depends only on the table name, the id and the job seed,
never on which shard, row slot or batch holds it, so a resharded or restarted
job and a not-yet-admitted id all read the same value, in every process on any
machine. At run time only IEEE-exact operations are used (integer hashing,
gathers, float32 ``+`` and ``*``); no libm function is evaluated per id.

Formula (issue 15 point 2; the values changed from the old per-element
Box-Muller, see docs/design/ps_storage.md)::

    key      = mix64(id, salt = mix64(fnv(table)) ^ seed)          one per row
    h_0      = key;  h_c = mix64(key + c)   c = 1 .. ceil(dim / 64) - 1 (64 columns each)
    i1, i2, i3 = bits 0-15, 16-31 and 32-47 of h_c
    normal   = (S1[i1, :w] + S2[i2, :w]) + S3[i3, :w],   S_t = N_t * float32(scale / sqrt(3))   float32
    uniform  = ((((U1[i1, :w] + U2[i2, :w] + U3[i3, :w]) mod 2^32 >> 9) + 0.5) * 2^-22 - 1) * float32(scale)

``N1..N3`` (float32 [65536, 64]) and ``U1..U3`` (uint32 [65536, 64]) are
process-wide constants built once, from integer hashes and IEEE-exact float64
arithmetic only (:func:`_normal_tables`, :func:`_uniform_tables`), so they are
bit-identical everywhere. Columns are independent, so a process builds only the
columns its tables' widths need (dim 16: a quarter), and a store builds them
when it is constructed (:meth:`RowInitializer.warm`, called by
``ps.table_group.TableGroup``), not inside its first pull (issue 36 item 4: the
whole 64-column build was ~0.4 s of CPU in a PS's first pull, most of the first
epoch's store time of a short fleet run):

* every column of ``N1`` / ``N2`` is a permutation (a keyed 16-bit bijection
  of the row index) of the 65536 standard-normal quantiles
  ``Phi^-1((k + 0.5) / 65536)`` (Acklam's rational approximation, relative error
  1.2e-9, with an fdlibm ``log`` written in numpy ops), rescaled to unit RMS;
  so each table column has mean 0 and std 1 exactly (up to float32 rounding),
  and the sum of three independent columns scaled by 1/sqrt(3) is N(0, 1);
* ``U1`` / ``U2`` are hash bits; their sum mod 2^32 is uniform, so the uniform
  kind is a grid of 2^23 levels symmetric in (-scale, scale).

Two ids share a chunk only if all three 16-bit fields collide (2^-48 per
pair: ~4 pairs among 50M ids; with two fields, 2^-32, it was ~300K pairs, and
two of 32K consecutive ids already shared a row). Ids that share one field are
correlated 1/3 in that chunk: random pairs, 3 in 65536, never systematically
neighbours (the fields come from a 64-bit mix of the salted id).

The scaled tables ``S_t`` (one IEEE multiply per element) are cached per (width,
scale), at most ``_SCALED_MAX`` of them; past that the same operations run
unfused (gather, multiply, add), so the values never depend on the cache. Rows
are one ``embedding_bag`` (mode sum) over the stacked ``S_t``: a fused gather
and sum, ``acc = 0 + S1[i1]; acc += S2[i2]; acc += S3[i3]`` in float32 (tested
bit-identical to a numpy transcription; the tables hold no zero, and scales
too small for ``N * scale`` to stay a normal float are not supported).

Cost: one ``mix64`` per row (and per extra chunk), the gather-sum of three rows
of 64 floats: ~0.25 us per row of dim 64 instead of ~1.3 us (Box-Muller with
scalar libm).

Example::

    init = RowInitializer("user", dim=8, kind=InitKind.NORMAL, scale=0.01, seed=0)
    init(np.array([1, 2, 3]))   # float32 [3, 8], same on every shard
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from common.hashing import hash_strings, mix64
from ps.config import InitKind

TABLE_ROWS = 1 << 16
"""Rows of each constant table (indexed by a 16-bit hash field)."""
WIDTH = 64
"""Columns of each constant table; rows longer than this take one chunk per 64 columns."""

_N_TABLES = 3
_BIJ_SALT = 0x3C6EF372FE94F82B
_UNI_SALT = 0xA54FF53A5F1D36F1
_tables: dict[str, np.ndarray] = {}
_weights: dict[tuple[int, float], torch.Tensor] = {}
_SCALED_MAX = 8
"""Scaled copies of the normal tables kept per process (each <= 48 MiB); more (w, scale)
pairs than this compute the same values from the unscaled tables, slower."""
_tables_lock = threading.Lock()


def _log(x: np.ndarray) -> np.ndarray:
    """Natural log of float64 ``x`` > 0 in numpy +, -, *, / only (fdlibm's ``__ieee754_log``).

    Every step is one IEEE-rounded operation, so the result is the same on every
    machine (libm's ``log`` and numpy's SIMD ``log`` may differ in the last ulp).

    Args:
        x: float64 array of finite positive normal numbers.
    """
    m, e = np.frexp(x)  # x = m 2^e, m in [0.5, 1): exact
    small = m < 0.7071067811865476
    m = np.where(small, m * 2.0, m)  # m in [sqrt(1/2), sqrt(2)): exact
    k = (e - small.astype(e.dtype)).astype(np.float64)
    f = m - 1.0  # exact (Sterbenz)
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (3.999999999940941908e-01 + w * (2.222219843214978396e-01 + w * 1.531383769920937332e-01))
    t2 = z * (6.666666666666735130e-01 + w * (2.857142874366239149e-01 + w * (1.818357216161805012e-01
                                                                             + w * 1.479819860511658591e-01)))
    r = t2 + t1
    hfsq = 0.5 * f * f
    out: np.ndarray = k * 6.93147180369123816490e-01 - ((hfsq - (s * (hfsq + r) + k * 1.90821492927058770002e-10)) - f)
    return out


_A = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
      -3.066479806614716e01, 2.506628277459239e00)
_B = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
      -1.328068155288572e01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
      4.374664141464968e00, 2.938163982698783e00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)


def normal_quantiles(n: int = TABLE_ROWS) -> np.ndarray:
    """``Phi^-1((k + 0.5) / n)`` for k < n, float64, exactly antisymmetric (Acklam, rel. error 1.2e-9).

    Args:
        n: number of quantiles (even).
    """
    half = n // 2
    p = (np.arange(half, dtype=np.float64) + 0.5) / float(n)  # lower half, p < 0.5
    out = np.empty(half, dtype=np.float64)
    tail = p < 0.02425
    q = np.sqrt(-2.0 * _log(p[tail]))
    out[tail] = (((((_C[0] * q + _C[1]) * q + _C[2]) * q + _C[3]) * q + _C[4]) * q + _C[5]) / (
        (((_D[0] * q + _D[1]) * q + _D[2]) * q + _D[3]) * q + 1.0
    )
    q = p[~tail] - 0.5
    r = q * q
    out[~tail] = (((((_A[0] * r + _A[1]) * r + _A[2]) * r + _A[3]) * r + _A[4]) * r + _A[5]) * q / (
        ((((_B[0] * r + _B[1]) * r + _B[2]) * r + _B[3]) * r + _B[4]) * r + 1.0
    )
    return np.concatenate([out, -out[::-1]])


def _bijection16(k: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of 16-bit ints: xor/add a key, multiply by an odd key, xorshift, 3 rounds.

    Args:
        k: uint32 [n, 1] values < 2^16.
        keys: uint32 [3, 3, cols] round keys (xor, odd multiplier, add) < 2^16.
    """
    mask = np.uint32(0xFFFF)
    x = np.broadcast_to(k, (k.shape[0], keys.shape[2])).copy()
    for r, shift in enumerate((7, 9, 8)):
        x ^= keys[r, 0]
        x *= keys[r, 1] | np.uint32(1)
        x += keys[r, 2]
        x &= mask
        x ^= x >> np.uint32(shift)
    return x


def _round_keys(salt: int, tables: int) -> np.ndarray:
    """uint32 [tables, 3, 3, WIDTH] 16-bit round keys from hashes of counters."""
    h = mix64(np.arange(tables * 9 * WIDTH, dtype=np.uint64), salt=salt)
    return (h & np.uint64(0xFFFF)).astype(np.uint32).reshape(tables, 3, 3, WIDTH)


def _normal_tables(w: int = WIDTH) -> np.ndarray:
    """float32 [3, TABLE_ROWS, w] (read-only view): each column a keyed permutation of the
    unit-RMS normal quantiles.

    Columns are independent (column ``j`` depends only on ``j``'s round keys), so only the
    first ``w`` are built: a process whose tables are all dim 16 builds a quarter of the
    64 (issue 36 item 4: the full build was ~0.4 s of CPU at a PS's first pull). A wider
    request rebuilds at that width; the columns already built come out the same.

    Args:
        w: columns wanted (1 .. WIDTH).
    """
    with _tables_lock:
        got = _tables.get("normal")
        if got is None or got.shape[2] < w:
            q = normal_quantiles(TABLE_ROWS)
            rms = math.sqrt(math.fsum((q * q).tolist()) / TABLE_ROWS)  # fsum: exact, order-free
            q32 = (q / rms).astype(np.float32)
            k = np.arange(TABLE_ROWS, dtype=np.uint32)[:, None]
            keys = _round_keys(_BIJ_SALT, _N_TABLES)[..., :w]
            got = np.stack([q32[_bijection16(k, keys[t])] for t in range(_N_TABLES)])
            _tables["normal"] = got  # writable base (the unfused path's torch view)
    view = got[:, :, :w]
    view.setflags(write=False)
    return view


def _scaled_weight(w: int, mul: np.float32) -> torch.Tensor | None:
    """float32 [3 * TABLE_ROWS, w], contiguous: ``float32(N_t[:, :w] * mul)`` for t = 1, 2, 3
    stacked (the ``embedding_bag`` weight of the tables scaled by ``mul``), cached per
    (w, mul); None once ``_SCALED_MAX`` are cached (the caller then computes the same values
    without it). Never written.

    Args:
        w: columns (<= 64).
        mul: the float32 multiplier.
    """
    key = (w, float(mul))
    got = _weights.get(key)
    if got is None:
        base = _normal_tables(w)
        scaled = np.multiply(base, mul).reshape(-1, w)  # float32 * float32: one IEEE rounding
        with _tables_lock:
            got = _weights.get(key)
            if got is None:
                if len(_weights) >= _SCALED_MAX:
                    return None
                got = _weights[key] = torch.from_numpy(scaled)
    return got


def _uniform_tables(w: int = WIDTH) -> np.ndarray:
    """uint32 [3, TABLE_ROWS, w] (read-only view) of hash bits.

    Element (t, r, c) of the full tables is word ``t * TABLE_ROWS * WIDTH + r * WIDTH + c`` of
    ``lo(h) ++ hi(h)``, ``h = mix64(arange(2 * TABLE_ROWS * WIDTH), salt=_UNI_SALT)``: tables 0 and 1
    are the low halves of the hashes of the flat indices, table 2 the high halves of table 0's
    hashes. Only the first ``w`` columns are hashed (as :func:`_normal_tables`).

    Args:
        w: columns wanted (1 .. WIDTH).
    """
    with _tables_lock:
        got = _tables.get("uniform")
        if got is None or got.shape[2] < w:
            flat = (np.arange(TABLE_ROWS, dtype=np.uint64)[:, None] * np.uint64(WIDTH)
                    + np.arange(w, dtype=np.uint64)[None, :])  # r * WIDTH + c, [TABLE_ROWS, w]
            h0 = mix64(flat, salt=_UNI_SALT)
            h1 = mix64(flat + np.uint64(TABLE_ROWS * WIDTH), salt=_UNI_SALT)
            got = np.stack([(h0 & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                            (h1 & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                            (h0 >> np.uint64(32)).astype(np.uint32)])
            got.setflags(write=False)
            _tables["uniform"] = got
    return got[:, :, :w]


_MASK16 = np.uint64(0xFFFF)
_S16 = np.uint64(16)
_S32 = np.uint64(32)
_S9 = np.uint32(9)
_TWO_M22 = np.float32(2.0**-22)


class TablesInitializer:
    """Initial rows of ids of several tables at once (a storage group's new ids).

    ``ids[i]`` belongs to table ``owner[i]``; the rows are the same bits as each table's own
    :class:`RowInitializer` call (``mix64(id, salt)`` is ``mix64(id ^ salt)``): tables of one
    family (:attr:`RowInitializer.family`, a storage group's usual case) in one pass whatever
    their number, otherwise family by family.

    Args:
        inits: the tables' initializers, one dim.

    Example::

        rows = TablesInitializer([init_user, init_item])(np.array([0, 1, 1]), np.array([7, 7, 9]))
    """

    def __init__(self, inits: Sequence["RowInitializer"]) -> None:
        self.inits = list(inits)
        self.dim = self.inits[0].dim
        fams: dict[tuple[int, InitKind, float, float], list[int]] = {}
        for i, init in enumerate(self.inits):
            fams.setdefault(init.family, []).append(i)
        self.families = [(self.inits[m[0]], np.asarray(m, dtype=np.int64)) for m in fams.values()]
        self.salts = np.array([init._salt for init in self.inits], dtype=np.uint64)

    def warm(self) -> None:
        """Build the process-wide tables every family reads (:meth:`RowInitializer.warm`)."""
        for first, _ in self.families:
            first.warm()

    def __call__(self, owner: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """float32 [n, dim]: the initial row of each ``ids[i]`` in table ``owner[i]``.

        Args:
            owner: int [n] table index of each id.
            ids: int64 [n].
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.shape[0], self.dim), dtype=np.float32) if len(self.families) > 1 else None
        for first, members in self.families:
            mine = np.isin(owner, members) if out is not None else None
            sel, own = (ids, owner) if mine is None else (ids[mine], owner[mine])
            if first.kind == InitKind.ZEROS or first.scale == 0.0 or sel.size == 0:
                rows = np.zeros((sel.size, self.dim), dtype=np.float32)
            else:
                rows = first._rows_of_keys(mix64(sel.astype(np.uint64) ^ self.salts[own]))
            if out is None:
                return rows
            out[mine] = rows
        assert out is not None
        return out


class RowInitializer:
    """Deterministic initial rows of one table (see the module docstring).

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
        self.seed = int(seed)
        name_hash = int(hash_strings(pa.array([table]))[0])
        self._salt = int(mix64(np.asarray(np.uint64(name_hash)))) ^ (int(seed) & 0xFFFFFFFFFFFFFFFF)
        self._chunks = -(-self.dim // WIDTH)
        # the multiplier, rounded once to float32 (the rows are float32 products)
        self._mul = np.float32(self.scale / math.sqrt(3.0) if self.kind == InitKind.NORMAL else self.scale)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """Initial rows of ``ids`` (int64 [n]) as float32 [n, dim].

        Args:
            ids: int64 [n] (any values; duplicates get identical rows).
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if self.kind == InitKind.ZEROS or n == 0 or self.scale == 0.0:
            return np.zeros((n, self.dim), dtype=np.float32)
        return self._rows_of_keys(mix64(ids, salt=self._salt))

    def warm(self) -> None:
        """Build the process-wide tables this table's rows read (the scaled normal tables of each
        chunk width, or the uniform tables), so a store pays for them when it is built, not inside
        its first pull. Values do not depend on whether, or when, this ran."""
        if self.kind == InitKind.ZEROS or self.scale == 0.0:
            return
        for w in sorted({min(WIDTH, self.dim - c * WIDTH) for c in range(self._chunks)}, reverse=True):
            if self.kind == InitKind.NORMAL:
                _scaled_weight(w, self._mul)
            else:
                _uniform_tables(w)

    @property
    def family(self) -> tuple[int, InitKind, float, float]:
        """What initializers must share to compute rows of several tables in one call
        (:class:`TablesInitializer`): dim, kind, scale and the float32 multiplier. (The salt differs.)"""
        return (self.dim, self.kind, self.scale, float(self._mul))

    def _rows_of_keys(self, key: np.ndarray) -> np.ndarray:
        """Rows of salted row keys (``mix64(id, salt)``), float32 [n, dim] (kind normal or uniform)."""
        n = key.shape[0]
        chunk = self._normal_chunk if self.kind == InitKind.NORMAL else self._uniform_chunk
        if self._chunks == 1:  # dim <= 64: the chunk is the result (no extra copy)
            return chunk(key, 0, self.dim)
        out = np.empty((n, self.dim), dtype=np.float32)
        for c in range(self._chunks):  # one chunk per 64 columns
            lo, hi = c * WIDTH, min(self.dim, (c + 1) * WIDTH)
            out[:, lo:hi] = chunk(key, c, hi - lo)
        return out

    @staticmethod
    def _fields(key: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Table rows (i1, i2, i3) of chunk ``c``: bits 0-15, 16-31, 32-47 of ``h_c``."""
        with np.errstate(over="ignore"):
            h = mix64(key + np.uint64(c)) if c else key  # h_0 = key: one hash per row
        i1 = (h & _MASK16).astype(np.intp)
        i2 = ((h >> _S16) & _MASK16).astype(np.intp)
        i3 = ((h >> _S32) & _MASK16).astype(np.intp)
        return i1, i2, i3

    def _normal_chunk(self, key: np.ndarray, c: int, w: int) -> np.ndarray:
        """float32 [n, w]: ``(S1[i1, :w] + S2[i2, :w]) + S3[i3, :w]``, ``S_t = float32(N_t * mul)``."""
        if c:
            with np.errstate(over="ignore"):
                h = mix64(key + np.uint64(c))
        else:
            h = key  # h_0 = key: one hash per row
        bags = np.empty((key.shape[0], 3), dtype=np.uint64)  # row r of N_t is row t * 2^16 + r
        np.bitwise_and(h, _MASK16, out=bags[:, 0])
        bags[:, 1] = ((h >> _S16) & _MASK16) + np.uint64(TABLE_ROWS)
        bags[:, 2] = ((h >> _S32) & _MASK16) + np.uint64(2 * TABLE_ROWS)
        idx = torch.from_numpy(bags.view(np.int64))
        weight = _scaled_weight(w, self._mul)
        if weight is not None:
            # one fused gather-sum per row over the scaled tables: acc = 0 + S1[i1];
            # acc += S2[i2]; acc += S3[i3] (float32, this order; 0 + x == x for x != -0.0)
            out = F.embedding_bag(idx, weight, mode="sum")
        else:  # the same IEEE operations, unfused: scale each gathered row, then sum in order
            _normal_tables(w)
            full = _tables["normal"]
            base = torch.from_numpy(full.reshape(-1, full.shape[2])[:, :w])
            m = float(self._mul)
            out = base.index_select(0, idx[:, 0]).mul_(m)
            out += base.index_select(0, idx[:, 1]).mul_(m)
            out += base.index_select(0, idx[:, 2]).mul_(m)
        return out.numpy()

    def _uniform_chunk(self, key: np.ndarray, c: int, w: int) -> np.ndarray:
        """float32 [n, w]: ``((((U1 + U2 + U3) mod 2^32 >> 9) + 0.5) * 2^-22 - 1) * float32(scale)``."""
        i1, i2, i3 = self._fields(key, c)
        tabs = _uniform_tables(w)
        s: np.ndarray = tabs[0].take(i1, axis=0)
        s += tabs[1].take(i2, axis=0)  # uint32: wraps mod 2^32
        s += tabs[2].take(i3, axis=0)
        s >>= _S9  # 23 bits: (k + 0.5) * 2^-22 - 1 is exact in float32
        f: np.ndarray = s.astype(np.float32)
        f += np.float32(0.5)
        f *= _TWO_M22
        f -= np.float32(1.0)
        f *= self._mul
        return f
