"""PullMany replies written in place: the rows are gathered straight into the reply's bytes.

gRPC Python sends only ``bytes`` (immutable), so a reply used to be built twice:
``index_select`` into a fresh tensor (4 MiB for 16K rows of dim 64, page faults
included), then copied into the reply by ``bytes.join``. Here the reply is a
``bytes`` object created uninitialized (CPython's ``PyBytes_FromStringAndSize(NULL,
n)``: documented as "the contents are uninitialized", to be filled before anyone
else sees the object) whose row regions are handed out as writable numpy arrays;
the store gathers into them with one ``index_select(..., out=)``. Nothing else
holds the object until :meth:`PullReplyBuffer.bytes` returns it, and the views are
dropped with the builder.

The layout is exactly :func:`ps.wire.encode_pull_reply`'s (any protobuf client parses
it). Where the interpreter is not CPython or the self-check at import fails,
:data:`IN_PLACE` is False and the buffer is a ``bytearray`` copied once at the end
(the old cost, never a wrong reply).

Example::

    buf = PullReplyBuffer([("user", wire.DType.FP32, 16384, 64)])
    torch.index_select(weights, 0, rows, out=torch.from_numpy(buf.rows(0)))
    reply = buf.bytes()
"""

from __future__ import annotations

import ctypes
import platform
from typing import Callable

import numpy as np

from protos import ps_pb2
from ps import wire

__all__ = ["IN_PLACE", "PullReplyBuffer", "RowsBuffer", "writable_bytes", "writable_view"]


def _uninitialized_bytes_factory() -> Callable[[int], tuple[bytes, np.ndarray]] | None:
    """A function n -> (bytes of n, writable uint8 view of its data), or None when unavailable."""
    if platform.python_implementation() != "CPython":
        return None
    try:
        make = ctypes.pythonapi.PyBytes_FromStringAndSize
        make.restype = ctypes.py_object
        make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    except AttributeError:
        return None

    def new(n: int) -> tuple[bytes, np.ndarray]:
        b: bytes = make(None, max(n, 1))  # (n = 0 would return the shared empty bytes)
        addr = ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value  # c_char_p(b) points at b's own data
        if addr is None:
            raise RuntimeError("no data pointer")
        view = np.ctypeslib.as_array((ctypes.c_uint8 * max(n, 1)).from_address(addr))
        return b, view[:n]

    try:  # self-check: what is written through the view is what the bytes hold
        b, v = new(64)
        v[:] = np.arange(64, dtype=np.uint8)
        if b != bytes(range(64)):
            return None
        del b, v
    except Exception:  # noqa: BLE001  (any failure: fall back to the copying buffer)
        return None
    return new


_NEW_BYTES = _uninitialized_bytes_factory()
IN_PLACE = _NEW_BYTES is not None
"""Whether replies are written in place (else a bytearray copied once at the end)."""


def writable_bytes(n: int) -> tuple[bytes | None, np.ndarray]:
    """A new ``bytes`` of ``n`` (uninitialized) and a writable uint8 view of its data.

    The caller fills every byte through the view before the object is seen by anyone
    else (``ps.frame`` builds request and reply frames this way: no join copy). Where
    :data:`IN_PLACE` is False the first item is None and the view is a ``bytearray``'s:
    ``view.tobytes()`` gives the bytes (one copy).

    Args:
        n: the size in bytes.
    """
    if _NEW_BYTES is not None:
        return _NEW_BYTES(n)
    return None, np.frombuffer(bytearray(n), dtype=np.uint8)


class _Owner:
    """Exposes a bytes object's data as a writable array and keeps the object alive (numpy's ``base``)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        addr = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
        self.__array_interface__ = {"shape": (len(data),), "typestr": "|u1", "data": (addr, False), "version": 3}


def writable_view(data: bytes) -> np.ndarray | None:
    """A writable uint8 array over ``data``'s own bytes (no copy), or None where unavailable.

    Only for a ``bytes`` object nobody else holds, such as a reply gRPC just received and
    handed to its deserializer (``ps.frame.decode_pull_reply``): the client then returns
    pulled rows as writable arrays that are views of the reply, instead of copying 4 MiB
    per 16K rows to make them writable. The array keeps ``data`` alive. None when
    :data:`IN_PLACE` is False (not CPython, or the self-check failed) or ``data`` has
    fewer than 2 bytes (CPython shares those objects).

    Args:
        data: a bytes object exclusively owned by the caller.
    """
    if not IN_PLACE or type(data) is not bytes or len(data) < 2:
        return None
    return np.asarray(_Owner(data))


class RowsBuffer:
    """A serialized reply under construction: one ``bytes`` (``writable_bytes``) whose row
    regions are writable, so rows are gathered straight into it (no intermediate tensor,
    no join copy). Subclasses lay out the header and set ``_spans``.
    """

    _spans: list[tuple[int, int, wire.DType, int, int]]  # (offset, nbytes, dtype, n, dim) per table
    _bytes: bytes | None
    _view: np.ndarray

    def rows(self, i: int) -> np.ndarray:
        """Table ``i``'s rows region: a writable C-contiguous [n, dim] array of its wire dtype.

        Every element must be written before :meth:`bytes` (the region starts uninitialized).

        Args:
            i: the table's index in the constructor's list.
        """
        off, nbytes, dtype, n, dim = self._spans[i]
        return self._view[off : off + nbytes].view(dtype.numpy).reshape(n, dim)

    def bytes(self) -> bytes:
        """The finished reply; the builder must not be used afterwards."""
        out = self._bytes if self._bytes is not None else self._view.tobytes()
        self._view = np.empty(0, dtype=np.uint8)  # drop the writable view
        self._bytes = None
        return out


class PullReplyBuffer(RowsBuffer):
    """A serialized ``PullManyResponse`` under construction, its row regions writable.

    Args:
        tables: per table (name, wire dtype, rows, dim), in reply order.
    """

    def __init__(self, tables: list[tuple[str, wire.DType, int, int]]) -> None:
        heads: list[bytes] = []
        self._spans = []
        total = 0
        for name, dtype, n, dim in tables:
            nbytes = int(n) * int(dim) * dtype.numpy.itemsize
            head = ps_pb2.TableValues(table=name, dtype=dtype.proto, dim=int(dim), rows=int(n)).SerializeToString()
            values_hdr = wire._VALUES_TAG + wire._varint(nbytes)
            prefix = wire._TABLES_TAG + wire._varint(len(head) + len(values_hdr) + nbytes) + head + values_hdr
            heads.append(prefix)
            self._spans.append((total + len(prefix), nbytes, dtype, int(n), int(dim)))
            total += len(prefix) + nbytes
        self._bytes, self._view = writable_bytes(total)
        pos = 0
        for prefix, (off, nbytes, _, _, _) in zip(heads, self._spans):
            self._view[pos : pos + len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
            pos = off + nbytes
