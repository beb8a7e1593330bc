"""Deterministic, vectorized hashes shared by data import, routing and init.

* :func:`hash_strings` turns string ids into int64 ids (FNV-1a 64, over the
  Arrow string buffers, vectorized per character position, never per row).
* :func:`mix64` is splitmix64's finalizer: a bijection on 64-bit ints used for
  vshard routing (``vshard = mix64(id) % V``) and for per-id random init seeds.

Both are stable across processes, machines and Python versions (no ``hash()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_MASK63 = np.uint64(0x7FFFFFFFFFFFFFFF)


def mix64(x: np.ndarray | int, salt: int = 0) -> np.ndarray:
    """splitmix64 finalizer of ``x ^ salt`` as uint64 (vectorized).

    Args:
        x: int64 or uint64 array (or scalar).
        salt: a 64-bit salt, so different uses (routing, init) are independent.
    """
    z = np.asarray(x).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= np.uint64(salt & 0xFFFFFFFFFFFFFFFF)
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z


def vshard_of(ids: np.ndarray, num_vshards: int) -> np.ndarray:
    """Virtual shard of each id: ``mix64(id) % num_vshards`` as int64."""
    return (mix64(ids) % np.uint64(num_vshards)).astype(np.int64)


def hash_strings(arr: pa.Array | pa.ChunkedArray, salt: int = 0) -> np.ndarray:
    """FNV-1a 64 of every UTF-8 string, masked to a non-negative int64.

    Nulls hash to -1 (callers decide whether a null id is an error).

    Example::

        >>> hash_strings(pa.array(["a", "b", None])).tolist()[2]
        -1
    """
    if isinstance(arr, pa.ChunkedArray):
        if arr.num_chunks == 0:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([hash_strings(c, salt) for c in arr.chunks])
    off_dtype: type[np.signedinteger[Any]]
    if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type):
        off_dtype = np.int64
    elif pa.types.is_string(arr.type) or pa.types.is_binary(arr.type):
        off_dtype = np.int32
    else:
        raise TypeError(f"hash_strings needs a string column, got {arr.type}")
    n = len(arr)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    bufs = arr.buffers()
    offsets: np.ndarray = np.frombuffer(bufs[1], dtype=off_dtype, count=n + 1 + arr.offset)[arr.offset :]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    starts = offsets[:-1].astype(np.int64)
    lengths = (offsets[1:] - offsets[:-1]).astype(np.int64)
    h = np.full(n, _FNV_OFFSET ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF), dtype=np.uint64)
    max_len = int(lengths.max()) if n else 0
    with np.errstate(over="ignore"):
        for pos in range(max_len):  # loop over character positions, vectorized over rows
            live = lengths > pos
            idx = np.nonzero(live)[0]
            byte = data[starts[idx] + pos].astype(np.uint64)
            h[idx] = (h[idx] ^ byte) * _FNV_PRIME
    out = (h & _MASK63).astype(np.int64)
    if arr.null_count:
        valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        out[~valid] = -1
    return out
