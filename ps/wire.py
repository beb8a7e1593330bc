"""Raw little-endian buffers for ids, rows and gradients on the PS wire.

Every tensor crosses gRPC as one ``bytes`` field (never ``repeated float``)::

    ids     int64 LE   [n]           8*n bytes
    values  fp32|fp16  [n, dim]      row-major, n*dim*(4|2) bytes
    grads   fp32|fp16  [n, dim]

Decoding is zero-copy (``np.frombuffer``; the arrays are read-only) and checks
every length, so a malformed request is refused with a message naming the
table, the field and the expected vs actual size.

Example::

    buf = encode_ids(np.array([3, 7], dtype=np.int64))
    ids = decode_ids(buf, table="user")            # array([3, 7])
    vals = decode_rows(encode_rows(rows, DType.FP16), DType.FP16, 2, 8, table="user", field="values")
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np
import torch

from common.errors import MetapsError
from protos import ps_pb2


class WireError(MetapsError, ValueError):
    """A buffer on the wire does not have the size or dtype its header says."""


class DType(str, enum.Enum):
    """Value/gradient dtype on the wire."""

    FP32 = "fp32"
    FP16 = "fp16"

    @property
    def numpy(self) -> np.dtype[Any]:
        return _NUMPY[self]

    @property
    def proto(self) -> int:
        return _PROTO[self]

    @classmethod
    def from_proto(cls, value: int, *, table: str = "", field: str = "dtype") -> "DType":
        try:
            return _FROM_PROTO[value]
        except KeyError:
            where = f"table '{table}': " if table else ""
            raise WireError(
                f"{where}{field} must be DTYPE_FP32 or DTYPE_FP16, got {ps_pb2.DType.Name(value) if value in ps_pb2.DType.values() else value}"
            ) from None


_NUMPY: dict[DType, np.dtype[Any]] = {DType.FP32: np.dtype("<f4"), DType.FP16: np.dtype("<f2")}
_PROTO: dict[DType, int] = {DType.FP32: int(ps_pb2.DTYPE_FP32), DType.FP16: int(ps_pb2.DTYPE_FP16)}
_FROM_PROTO: dict[int, DType] = {v: k for k, v in _PROTO.items()}
_ID_DTYPE = np.dtype("<i8")

Buffer = bytes | memoryview
"""What a frame decoder reads: received bytes, or a part of them (a StepFrame's push or pull)."""


def pad8(n: int) -> int:
    """``n`` rounded up to a multiple of 8 (every frame part starts 8-aligned)."""
    return (n + 7) & ~7


def encode_ids(ids: np.ndarray) -> bytes:
    """int64 ids as little-endian bytes."""
    return np.ascontiguousarray(ids, dtype=_ID_DTYPE).tobytes()


def decode_ids(buf: bytes, *, table: str = "") -> np.ndarray:
    """Bytes -> read-only int64 [n]; refuses a length that is not a multiple of 8."""
    if len(buf) % 8:
        raise WireError(f"table '{table}': ids buffer has {len(buf)} bytes, not a multiple of 8 (int64 ids)")
    return np.frombuffer(buf, dtype=_ID_DTYPE)


FP16_MAX = 65504.0
"""Largest finite float16."""


def encode_rows(rows: np.ndarray, dtype: DType = DType.FP32) -> bytes:
    """A [n, dim] float array as row-major bytes in ``dtype``.

    fp32 -> fp16 goes through torch: numpy's half conversion is ~20x slower here.

    **fp16 range.** float16 has no finite value beyond +-65504. This function
    saturates finite values beyond it to +-65504 (one ``aminmax`` pass decides;
    only out-of-range input pays for the clamp), so a finite value never
    becomes Inf on the wire; NaN/Inf input stays NaN/Inf. Pulled rows are
    saturated (and counted, table stat ``fp16_saturated``) by the PS before they
    get here (``EmbeddingTable.pull(ids, fp16=True)``); for fp16 gradients
    (client ``grad_dtype = "fp16"``) saturation acts as an element clip at
    65504, so use fp32 gradients where that range matters.
    """
    return wire_rows(rows, dtype).tobytes()


def wire_rows(rows: np.ndarray, dtype: DType = DType.FP32) -> np.ndarray:
    """``rows`` as a C-contiguous array in the wire dtype, without copying fp32 rows that already are.

    The same conversion and fp16 saturation as :func:`encode_rows`, whose bytes are
    this array's; :func:`encode_pull_reply` writes it into the reply without ``tobytes``.

    Args:
        rows: float [n, dim].
        dtype: the wire dtype.
    """
    if dtype == DType.FP16 and rows.dtype == np.float32:
        t = torch.from_numpy(np.ascontiguousarray(rows))
        if t.numel():
            lo, hi = torch.aminmax(t)
            if not (-FP16_MAX <= float(lo) and float(hi) <= FP16_MAX):  # also true when a NaN hides the range
                t = t.clamp(-FP16_MAX, FP16_MAX)  # NaN stays NaN
        half: np.ndarray = t.to(torch.float16).numpy()
        return half
    if dtype == DType.FP16:
        rows = np.clip(rows, -FP16_MAX, FP16_MAX)
    return np.ascontiguousarray(rows, dtype=dtype.numpy)


# -- PullManyResponse without protobuf copies ----------------------------------------------------
#   The reply of a pull is almost all row bytes. Built by protobuf, they are copied three
#   times (tobytes, into the message, serialized); parsed by protobuf, twice more (into the
#   message, out as bytes). The functions below write and read the same wire format
#   (``protos/ps.proto``: PullManyResponse{repeated TableValues tables = 1}) around the
#   row buffer: one copy to build, none to read (the rows are a view of the reply).
_TABLES_TAG = b"\x0a"  # field 1, length-delimited
_VALUES_TAG = b"\x12"  # TableValues.values: field 2, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_pull_reply(tables: list[tuple[str, DType, np.ndarray]]) -> bytes:
    """A serialized ``PullManyResponse`` from (table, wire dtype, rows [n, dim] in that dtype).

    Byte-for-byte a valid PullManyResponse (any protobuf client parses it); the rows are
    copied once, straight into the reply.

    Args:
        tables: per table its name, wire dtype and C-contiguous rows (:func:`wire_rows`).
    """
    parts: list[bytes | memoryview] = []
    for name, dtype, rows in tables:
        if rows.ndim != 2 or rows.dtype != dtype.numpy or not rows.flags.c_contiguous:
            raise WireError(f"table '{name}': reply rows must be C-contiguous [n, dim] {dtype.value}, "
                            f"got {rows.dtype} shape {rows.shape}")
        head = ps_pb2.TableValues(table=name, dtype=dtype.proto, dim=int(rows.shape[1]), rows=int(rows.shape[0]))
        head_bytes = head.SerializeToString()
        values_hdr = _VALUES_TAG + _varint(rows.nbytes)
        parts.append(_TABLES_TAG + _varint(len(head_bytes) + len(values_hdr) + rows.nbytes) + head_bytes + values_hdr)
        if rows.nbytes:  # (a memoryview of a zero-size array cannot be cast)
            parts.append(rows.data.cast("B"))
    return b"".join(parts)


@dataclasses.dataclass
class TableValuesView:
    """One table of a pull reply; ``values`` is a view of the reply's bytes (no copy)."""

    table: str
    values: memoryview
    dtype: int
    dim: int
    rows: int
    offset: int = -1
    """Where ``values`` starts in :attr:`PullReply.buffer` (-1: not known)."""


@dataclasses.dataclass
class PullReply:
    """A parsed ``PullManyResponse`` (``tables`` in reply order)."""

    tables: list[TableValuesView]
    buffer: memoryview | None = None
    """The reply's bytes that the ``values`` view (framed replies), for spans of several tables."""

    def span(self, first: int, last: int) -> memoryview | None:
        """One view of tables ``first`` .. ``last - 1``'s values when they lie back to back with one
        dtype and dim (a framed reply of one storage group's tables), else None."""
        if self.buffer is None or last <= first:
            return None
        tvs = self.tables[first:last]
        t0 = tvs[0]
        at = t0.offset
        for tv in tvs:
            if tv.offset != at or tv.dtype != t0.dtype or tv.dim != t0.dim:
                return None
            at += len(tv.values)
        return self.buffer[t0.offset:at]


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError(f"pull reply: truncated or overlong varint at byte {pos}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _skip(buf: memoryview, pos: int, end: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(buf, pos, end)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        n, pos = _read_varint(buf, pos, end)
        return pos + n
    if wire_type == 5:
        return pos + 4
    raise WireError(f"pull reply: unsupported protobuf wire type {wire_type} at byte {pos}")


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def decode_pull_reply(data: bytes) -> PullReply:
    """Parse a serialized ``PullManyResponse``; the row bytes stay in ``data`` (views, no copy).

    Unknown fields are skipped, as protobuf does; a truncated message raises WireError.

    Args:
        data: the reply's bytes as received.
    """
    buf = memoryview(data)
    out: list[TableValuesView] = []
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        if tag != 0x0A:
            pos = _skip(buf, pos, end, tag & 7)
            continue
        n, pos = _read_varint(buf, pos, end)
        stop = pos + n
        if stop > end:
            raise WireError(f"pull reply: table entry of {n} bytes at byte {pos} runs past the end ({end})")
        tv = TableValuesView(table="", values=buf[0:0], dtype=0, dim=0, rows=0)
        while pos < stop:
            tag, pos = _read_varint(buf, pos, stop)
            field, wire_type = tag >> 3, tag & 7
            if wire_type == 2 and field in (1, 2):
                k, pos = _read_varint(buf, pos, stop)
                if pos + k > stop:
                    raise WireError(f"pull reply: field {field} of {k} bytes at byte {pos} runs past its table entry")
                if field == 1:
                    tv.table = bytes(buf[pos:pos + k]).decode("utf-8")
                else:
                    tv.values = buf[pos:pos + k]
                pos += k
            elif wire_type == 0 and field in (3, 4, 5):
                v, pos = _read_varint(buf, pos, stop)
                if field == 3:
                    tv.dtype = _signed(v)
                elif field == 4:
                    tv.dim = _signed(v)
                else:
                    tv.rows = _signed(v)
            else:
                pos = _skip(buf, pos, stop, wire_type)
        if pos != stop:
            raise WireError(f"pull reply: table entry ends at byte {pos}, its length says {stop}")
        out.append(tv)
    if pos != end:
        raise WireError(f"pull reply: a field runs past the end of the message ({pos} > {end})")
    return PullReply(out)


def to_float32(values: np.ndarray) -> np.ndarray:
    """fp16/fp32 rows as float32 (torch's vectorized half conversion; no copy for fp32)."""
    if values.dtype == np.float32:
        return values
    return torch.from_numpy(np.array(values, copy=False)).to(torch.float32).numpy()


def decode_rows(buf: bytes | memoryview, dtype: DType, n: int, dim: int, *, table: str = "", field: str = "values") -> np.ndarray:
    """Bytes -> read-only [n, dim] array in ``dtype``; refuses a wrong length."""
    itemsize = dtype.numpy.itemsize
    want = n * dim * itemsize
    if len(buf) != want:
        raise WireError(
            f"table '{table}': {field} buffer has {len(buf)} bytes, expected {want} "
            f"= {n} ids x dim {dim} x {itemsize} bytes ({dtype.value})"
        )
    return np.frombuffer(buf, dtype=dtype.numpy).reshape(n, dim)


def array_to_proto(name: str, arr: np.ndarray) -> ps_pb2.NamedArray:
    """Any numpy array (little-endian) as a NamedArray message."""
    arr = np.asarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return ps_pb2.NamedArray(name=name, dtype=arr.dtype.str, shape=list(arr.shape), data=arr.tobytes())


def array_from_proto(msg: ps_pb2.NamedArray) -> np.ndarray:
    """A NamedArray message back to a (writable) numpy array; checks the size."""
    try:
        dt = np.dtype(msg.dtype)
    except TypeError:
        raise WireError(f"array '{msg.name}': unknown dtype {msg.dtype!r}") from None
    count = int(np.prod(msg.shape)) if len(msg.shape) else 1
    if len(msg.data) != count * dt.itemsize:
        raise WireError(
            f"array '{msg.name}': {len(msg.data)} bytes, expected {count * dt.itemsize} for shape {list(msg.shape)} {msg.dtype}"
        )
    return np.frombuffer(msg.data, dtype=dt).reshape(tuple(msg.shape)).copy()


def dense_to_proto(name: str, value: Any, dtype: DType = DType.FP32) -> ps_pb2.DenseTensor:
    """A dense tensor (numpy or torch) as a DenseTensor message."""
    arr = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    return ps_pb2.DenseTensor(
        name=name, shape=list(arr.shape), data=np.ascontiguousarray(arr, dtype=dtype.numpy).tobytes(), dtype=dtype.proto
    )


def dense_from_proto(msg: ps_pb2.DenseTensor) -> np.ndarray:
    """A DenseTensor message -> float32 numpy array of its shape; checks the size."""
    dtype = DType.from_proto(msg.dtype, table=msg.name, field="dense dtype")
    count = int(np.prod(msg.shape)) if len(msg.shape) else 1
    want = count * dtype.numpy.itemsize
    if len(msg.data) != want:
        raise WireError(
            f"dense '{msg.name}': data has {len(msg.data)} bytes, expected {want} for shape {list(msg.shape)} ({dtype.value})"
        )
    return np.frombuffer(msg.data, dtype=dtype.numpy).reshape(tuple(msg.shape)).astype(np.float32)
