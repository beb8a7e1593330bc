"""Framed binary PullMany/PushMany: the PS data plane without protobuf on the hot path.

Served as generic byte handlers (``/metaps.ps.ParameterServer/PullFrame`` and
``PushFrame``, no (de)serializer: ``ps.servicer._add_servicer``); ``ps.client.PsClient``
uses them by default, the protobuf ``PullMany``/``PushMany`` stay for compatibility
and give the same results bit for bit. Every frame is little-endian::

    header  32 B   magic "MPSF" | version u8 | kind u8 | flags u8 | 0 u8
                   | map_version i64 | step i64 | worker_len u16 | tables u16 | 0 u32
    worker id      worker_len bytes of UTF-8, zero-padded to 8
    per table      n i64 | dim u32 | name_len u16 | dtype u8 | 0 u8  (16 B),
                   then the name (UTF-8), zero-padded to 8
    per table      the payload at 8-aligned offsets, each part zero-padded to 8:
                   pull request: ids int64 [n]
                   push request: ids int64 [n], then grads fp32|fp16 [n, dim]
                   pull reply:   rows fp32|fp16 [n, dim]
                   push reply:   counts int64 [dim] (rows, then PUSH_COUNT_FIELDS; dim = their number)

``kind``: 1 pull request, 2 push request, 3 pull reply, 4 push reply. ``flags``: bit 0
fp16 rows wanted (pull request) / sent (pull reply), bit 1 ``step`` present. ``dtype``:
0 none (pull request), 1 fp32, 2 fp16, 3 int64 (push reply counts).

A receiver decodes with ``np.frombuffer`` at the offsets (views of the received
``bytes``: the gradient and row buffers are never copied) after checking every
length against the header; a malformed frame raises :class:`ps.wire.WireError`
(the shard answers INVALID_ARGUMENT and changes nothing) naming the field, the
table and the expected vs actual size. A sender writes the frame into one
preallocated ``bytes`` (``ps.reply_buffer.writable_bytes``): ids and rows are
gathered straight into it (``np.take``/``index_select(out=)``), no join copy.

Example::

    data = encode_pull_request([("user", ids)], map_version=3, fp16=False, worker_id="w0", step=7)
    req = decode_pull_request(data)          # req.tables[0].ids is a view of data
    reply = PullFrameBuffer([("user", DType.FP32, ids.size, 8)]); reply.rows(0)[:] = rows
    decode_pull_reply(reply.bytes()).tables[0].values
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Sequence

import numpy as np
import torch

from protos import ps_pb2
from ps import wire
from ps.reply_buffer import RowsBuffer, writable_bytes, writable_view
from ps.types import PUSH_COUNT_FIELDS
from ps.wire import Buffer, DType, WireError, pad8

__all__ = [
    "MAGIC", "VERSION", "FrameTable", "Frame", "PullFrameBuffer", "encode_pull_request", "encode_push_request",
    "decode_pull_request", "decode_push_request", "encode_pull_reply", "decode_pull_reply", "encode_push_reply",
    "decode_push_reply",
]

SERVICE = "metaps.ps.ParameterServer"
PULL_METHOD = "PullFrame"
PUSH_METHOD = "PushFrame"
PULL_PATH = f"/{SERVICE}/{PULL_METHOD}"
PUSH_PATH = f"/{SERVICE}/{PUSH_METHOD}"
MAGIC = b"MPSF"
VERSION = 1
PULL_REQUEST, PUSH_REQUEST, PULL_REPLY, PUSH_REPLY = 1, 2, 3, 4
_KIND_NAMES = {PULL_REQUEST: "pull request", PUSH_REQUEST: "push request", PULL_REPLY: "pull reply", PUSH_REPLY: "push reply"}
FLAG_FP16 = 1
FLAG_STEP = 2
_FLAGS = FLAG_FP16 | FLAG_STEP
_NONE, _FP32, _FP16, _I64 = 0, 1, 2, 3
_CODE = {DType.FP32: _FP32, DType.FP16: _FP16}
_FROM_CODE = {_FP32: DType.FP32, _FP16: DType.FP16}
_DTYPE_NAMES = {_NONE: "none", _FP32: "fp32", _FP16: "fp16", _I64: "int64"}

_HEADER = struct.Struct("<4sBBBBqqHHI")
_TABLE = struct.Struct("<qIHBB")
HEADER_BYTES = _HEADER.size  # 32
_ID = np.dtype("<i8")
_COUNT_NAMES = ("rows",) + PUSH_COUNT_FIELDS





@dataclasses.dataclass
class FrameTable:
    """One table of a decoded frame; arrays are read-only views of the frame's bytes.

    Attributes:
        name: the table.
        n: ids / rows.
        dim: row width (0 in a pull request; the number of counts in a push reply).
        dtype: the rows' wire dtype (pull reply, push request); None otherwise.
        ids: int64 [n] (requests).
        values: [n, dim] gradients (push request) or rows (pull reply); int64 counts (push reply).
    """

    name: str
    n: int
    dim: int
    dtype: DType | None
    ids: np.ndarray | None = None
    values: np.ndarray | None = None


@dataclasses.dataclass
class Frame:
    """A decoded frame: the header's fields and its tables in frame order."""

    kind: int
    fp16: bool
    map_version: int
    step: int | None
    worker_id: str
    tables: list[FrameTable]


# -- encoding ------------------------------------------------------------------------------------
def _layout(worker: bytes, names: list[bytes]) -> tuple[int, list[int]]:
    """(offset where the payload starts, offset of each table descriptor)."""
    pos = HEADER_BYTES + pad8(len(worker))
    offs = []
    for name in names:
        offs.append(pos)
        pos += _TABLE.size + pad8(len(name))
    return pos, offs


def _names(tables: Sequence[str]) -> list[bytes]:
    out = []
    for t in tables:
        b = t.encode("utf-8")
        if len(b) > 0xFFFF:
            raise WireError(f"table name of {len(b)} bytes is over the frame's 65535")
        out.append(b)
    if len(out) > 0xFFFF:
        raise WireError(f"{len(out)} tables in one frame, at most 65535")
    return out


def _write_head(view: np.ndarray, kind: int, flags: int, map_version: int, step: int | None, worker: bytes,
                names: list[bytes], descs: list[tuple[int, int, int]], offs: list[int]) -> None:
    """Header, worker id and table descriptors into ``view`` (zero padding included)."""
    start = offs[0] if offs else HEADER_BYTES + pad8(len(worker))
    view[:start] = 0
    _HEADER.pack_into(view.data, 0, MAGIC, VERSION, kind, flags, 0, map_version, 0 if step is None else step,
                      len(worker), len(names), 0)
    view[HEADER_BYTES:HEADER_BYTES + len(worker)] = np.frombuffer(worker, dtype=np.uint8)
    for name, (n, dim, code), off in zip(names, descs, offs):
        end = off + _TABLE.size + pad8(len(name))
        view[off:end] = 0
        _TABLE.pack_into(view.data, off, n, dim, len(name), code, 0)
        view[off + _TABLE.size:off + _TABLE.size + len(name)] = np.frombuffer(name, dtype=np.uint8)


def _done(data: bytes | None, view: np.ndarray) -> bytes:
    """The filled frame (the view copied once where bytes cannot be written in place)."""
    return data if data is not None else view.tobytes()


def _flags(fp16: bool, step: int | None) -> int:
    return (FLAG_FP16 if fp16 else 0) | (0 if step is None else FLAG_STEP)


def _region(view: np.ndarray, off: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A writable typed region of ``view``; its padding to 8 zeroed."""
    view[off + nbytes:off + pad8(nbytes)] = 0
    return view[off:off + nbytes].view(dtype).reshape(shape)


def _put_ids(dst: np.ndarray, ids: np.ndarray, pos: np.ndarray | None) -> None:
    if pos is None:
        dst[:] = ids
    else:
        np.take(ids, pos, out=dst)


def encode_pull_request(tables: Sequence[tuple[str, np.ndarray, np.ndarray | None]], *, map_version: int, fp16: bool,
                        worker_id: str, step: int | None) -> bytes:
    """A pull request frame.

    Args:
        tables: per table its name, its ids (int64) and positions into them to send
            (None: all, in order); the ids are gathered straight into the frame.
        map_version: the partition map the ids were routed with.
        fp16: ask for fp16 rows.
        worker_id, step: the caller's clock (``step`` None: no clock).
    """
    worker = worker_id.encode("utf-8")
    names = _names([t for t, _, _ in tables])
    counts = [int(ids.size if pos is None else pos.size) for _, ids, pos in tables]
    payload, offs = _layout(worker, names)
    total = payload + sum(8 * n for n in counts)
    data, view = writable_bytes(total)
    _write_head(view, PULL_REQUEST, _flags(fp16, step), map_version, step, worker, names,
                [(n, 0, _NONE) for n in counts], offs)
    pos_ = payload
    for (_, ids, pos), n in zip(tables, counts):
        _put_ids(_region(view, pos_, 8 * n, _ID, (n,)), ids, pos)
        pos_ += 8 * n
    return _done(data, view)


def encode_push_request(tables: Sequence[tuple[str, np.ndarray, np.ndarray, np.ndarray | None]], *, grad_dtype: DType,
                        map_version: int, worker_id: str, step: int | None) -> bytes:
    """A push request frame.

    Args:
        tables: per table its name, ids (int64 [k]), float32 gradients [k, dim] and the
            positions to send (None: all rows in order); gathered straight into the frame
            (fp32) or converted into it (fp16, saturated as ``wire.wire_rows``).
        grad_dtype: gradients on the wire.
        map_version, worker_id, step: as :func:`encode_pull_request`.
    """
    worker = worker_id.encode("utf-8")
    names = _names([t for t, _, _, _ in tables])
    item = grad_dtype.numpy.itemsize
    shapes = [(int(ids.size if pos is None else pos.size), int(g.shape[1])) for _, ids, g, pos in tables]
    payload, offs = _layout(worker, names)
    total = payload + sum(8 * n + pad8(n * d * item) for n, d in shapes)
    data, view = writable_bytes(total)
    _write_head(view, PUSH_REQUEST, _flags(False, step), map_version, step, worker, names,
                [(n, d, _CODE[grad_dtype]) for n, d in shapes], offs)
    at = payload
    for (_, ids, grads, pos), (n, d) in zip(tables, shapes):
        _put_ids(_region(view, at, 8 * n, _ID, (n,)), ids, pos)
        at += 8 * n
        dst = _region(view, at, n * d * item, grad_dtype.numpy, (n, d))
        at += pad8(n * d * item)
        if not n * d:
            continue
        if grad_dtype == DType.FP32 and grads.dtype == np.float32:
            src = torch.from_numpy(np.ascontiguousarray(grads))
            if pos is None:
                torch.from_numpy(dst).copy_(src)
            else:
                torch.index_select(src, 0, torch.from_numpy(pos), out=torch.from_numpy(dst))
        else:
            dst[:] = wire.wire_rows(grads if pos is None else grads[pos], grad_dtype)
    return _done(data, view)


class PullFrameBuffer(RowsBuffer):
    """A pull reply frame under construction, its row regions writable (gathered into in place).

    Args:
        tables: per table (name, wire dtype, rows, dim), in request order.
    """

    def __init__(self, tables: Sequence[tuple[str, DType, int, int]]) -> None:
        names = _names([t for t, _, _, _ in tables])
        fp16 = any(dt == DType.FP16 for _, dt, _, _ in tables)
        payload, offs = _layout(b"", names)
        self._spans = []
        at = payload
        for _, dt, n, dim in tables:
            nbytes = int(n) * int(dim) * dt.numpy.itemsize
            self._spans.append((at, nbytes, dt, int(n), int(dim)))
            at += pad8(nbytes)
        self._bytes, self._view = writable_bytes(at)
        _write_head(self._view, PULL_REPLY, _flags(fp16, None), 0, None, b"", names,
                    [(int(n), int(dim), _CODE[dt]) for _, dt, n, dim in tables], offs)
        for off, nbytes, _, _, _ in self._spans:
            self._view[off + nbytes:off + pad8(nbytes)] = 0


def encode_pull_reply(tables: Sequence[tuple[str, DType, np.ndarray]]) -> bytes:
    """A pull reply frame from (table, wire dtype, rows [n, dim] in that dtype).

    Args:
        tables: per table its name, wire dtype and rows.
    """
    buf = PullFrameBuffer([(name, dt, int(rows.shape[0]), int(rows.shape[1])) for name, dt, rows in tables])
    for i, (name, dt, rows) in enumerate(tables):
        if rows.ndim != 2 or rows.dtype != dt.numpy:
            raise WireError(f"table '{name}': reply rows must be [n, dim] {dt.value}, got {rows.dtype} shape {rows.shape}")
        buf.rows(i)[...] = rows
    return buf.bytes()


def encode_push_reply(counts: Sequence[tuple[str, int, object]]) -> bytes:
    """A push reply frame: per table its rows and ``PUSH_COUNT_FIELDS`` counts.

    Args:
        counts: per table, in request order: (table, rows, an object with the
            ``PUSH_COUNT_FIELDS`` attributes: a ``ps.embedding_table.PushResult``).
    """
    names = _names([t for t, _, _ in counts])
    payload, offs = _layout(b"", names)
    k = len(_COUNT_NAMES)
    data, view = writable_bytes(payload + 8 * k * len(names))
    _write_head(view, PUSH_REPLY, 0, 0, None, b"", names, [(1, k, _I64)] * len(names), offs)
    arr = view[payload:].view(_ID).reshape(len(names), k)
    if counts:  # (a push of no rows, sent for the step clock alone, has no table)
        arr[:] = [[rows] + [int(getattr(res, f) or 0) for f in PUSH_COUNT_FIELDS] for _, rows, res in counts]
    return _done(data, view)


# -- decoding ------------------------------------------------------------------------------------
def _parse(data: Buffer, kind: int) -> tuple[Frame, list[tuple[int, int, int]], int]:
    """Header, worker id and descriptors of a frame of ``kind``, every length checked.

    Returns:
        (frame without payload, per table (n, dim, dtype code), payload offset).
    """
    what = _KIND_NAMES[kind]
    size = len(data)
    if size < HEADER_BYTES:
        raise WireError(f"{what} frame: short header: {size} bytes, expected at least {HEADER_BYTES}")
    magic, version, got_kind, flags, _, map_version, step, wlen, ntables, _ = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireError(f"{what} frame: magic {magic!r}, expected {MAGIC!r} (not a metaps PS frame)")
    if version != VERSION:
        raise WireError(f"{what} frame: version {version}, this side speaks version {VERSION}")
    if got_kind != kind:
        raise WireError(f"{what} frame: kind {got_kind} ({_KIND_NAMES.get(got_kind, 'unknown')}), expected {kind} ({what})")
    if flags & ~_FLAGS:
        raise WireError(f"{what} frame: unknown flag bits {flags & ~_FLAGS:#x} (known: fp16 {FLAG_FP16}, step {FLAG_STEP})")
    pos = HEADER_BYTES
    worker = _utf8(data, pos, wlen, f"{what} frame: worker id")
    pos += pad8(wlen)
    tables: list[FrameTable] = []
    descs: list[tuple[int, int, int]] = []
    for i in range(ntables):
        if pos + _TABLE.size > size:
            raise WireError(f"{what} frame: table {i} of {ntables}: descriptor at offset {pos} needs {_TABLE.size} bytes, "
                            f"the frame has {max(0, size - pos)} left")
        n, dim, nlen, code, _ = _TABLE.unpack_from(data, pos)
        pos += _TABLE.size
        name = _utf8(data, pos, nlen, f"{what} frame: table {i} of {ntables}: name")
        pos += pad8(nlen)
        if n < 0:
            raise WireError(f"{what} frame: table '{name}': n must be >= 0, got {n}")
        tables.append(FrameTable(name=name, n=n, dim=dim, dtype=_FROM_CODE.get(code)))
        descs.append((n, dim, code))
    frame = Frame(kind=kind, fp16=bool(flags & FLAG_FP16), map_version=map_version,
                  step=step if flags & FLAG_STEP else None, worker_id=worker, tables=tables)
    return frame, descs, pos


def _utf8(data: Buffer, pos: int, n: int, what: str) -> str:
    """The ``n``-byte UTF-8 string at ``pos`` (``what``: e.g. "pull request frame: worker id"), bounds checked."""
    if pos + n > len(data):
        raise WireError(f"{what} of {n} bytes at offset {pos} runs past the end ({len(data)} bytes)")
    try:
        return bytes(data[pos:pos + n]).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"{what} is not UTF-8") from None


def _take(data: Buffer, pos: int, nbytes: int, what: str, table: str, field: str, detail: str) -> int:
    """Check that ``nbytes`` at ``pos`` lie inside ``data``; returns the next 8-aligned offset."""
    if pos + nbytes > len(data):
        raise WireError(f"{what} frame: table '{table}': {field} need {nbytes} bytes ({detail}) at offset {pos}, "
                        f"the frame has {max(0, len(data) - pos)} left")
    return pos + pad8(nbytes)


def _check_end(data: Buffer, pos: int, what: str) -> None:
    if pos != len(data):
        raise WireError(f"{what} frame: {len(data)} bytes, its header and tables say {pos}")


def _view(data: Buffer | np.ndarray, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset) if count else np.empty(0, dtype=dtype)


def decode_pull_request(data: Buffer) -> Frame:
    """A pull request frame -> :class:`Frame` (ids are views of ``data``).

    Args:
        data: the received bytes.

    Raises:
        ps.wire.WireError: malformed (the message names the field, table and sizes).
    """
    what = _KIND_NAMES[PULL_REQUEST]
    frame, descs, pos = _parse(data, PULL_REQUEST)
    for t, (n, dim, code) in zip(frame.tables, descs):
        if code != _NONE or dim != 0:
            raise WireError(f"{what} frame: table '{t.name}': dtype {_DTYPE_NAMES.get(code, code)} / dim {dim}, "
                            f"expected none / 0 (a pull sends ids only)")
        start = pos
        pos = _take(data, pos, 8 * n, what, t.name, "ids", f"{n} int64 ids")
        t.ids = _view(data, _ID, n, start)
    _check_end(data, pos, what)
    return frame


def decode_push_request(data: Buffer, *, writable: bool = False) -> Frame:
    """A push request frame -> :class:`Frame` (ids and gradients are views of ``data``).

    Args:
        data: the received bytes.
        writable: the views may be writable (``reply_buffer.writable_view``), so the store
            uses the gradients as they are instead of copying 4 MiB per 16K rows to own
            them; only for bytes nobody else holds (the request gRPC just received).

    Raises:
        ps.wire.WireError: malformed (the message names the field, table and sizes).
    """
    what = _KIND_NAMES[PUSH_REQUEST]
    frame, descs, pos = _parse(data, PUSH_REQUEST)
    owned = writable_view(data) if writable and isinstance(data, bytes) else None
    src: Buffer | np.ndarray = data if owned is None else owned
    for t, (n, dim, code) in zip(frame.tables, descs):
        if t.dtype is None:
            raise WireError(f"{what} frame: table '{t.name}': grads dtype {_DTYPE_NAMES.get(code, code)}, expected fp32 or fp16")
        start = pos
        pos = _take(data, pos, 8 * n, what, t.name, "ids", f"{n} int64 ids")
        t.ids = _view(src, _ID, n, start)
        item = t.dtype.numpy.itemsize
        start = pos
        pos = _take(data, pos, n * dim * item, what, t.name, "grads", f"{n} ids x dim {dim} x {item} bytes {t.dtype.value}")
        t.values = _view(src, t.dtype.numpy, n * dim, start).reshape(n, dim)
    _check_end(data, pos, what)
    return frame


def decode_pull_reply(data: Buffer) -> wire.PullReply:
    """A pull reply frame -> ``wire.PullReply`` (the shape ``routing.scatter_pull`` reads).

    The rows are views of ``data``, writable where ``reply_buffer.writable_view`` allows
    (``data`` must then be held by nobody else: gRPC's freshly received reply).

    Args:
        data: the received bytes.
    """
    what = _KIND_NAMES[PULL_REPLY]
    frame, descs, pos = _parse(data, PULL_REPLY)
    # The reply is ours alone: its rows are handed out as writable views (no copy to own them).
    owned = writable_view(data) if isinstance(data, bytes) else None
    buf = owned.data if owned is not None else memoryview(data)
    out = []
    for t, (n, dim, code) in zip(frame.tables, descs):
        if t.dtype is None:
            raise WireError(f"{what} frame: table '{t.name}': rows dtype {_DTYPE_NAMES.get(code, code)}, expected fp32 or fp16")
        nbytes = n * dim * t.dtype.numpy.itemsize
        start = pos
        pos = _take(data, pos, nbytes, what, t.name, "rows", f"{n} rows x dim {dim} {t.dtype.value}")
        out.append(wire.TableValuesView(table=t.name, values=buf[start:start + nbytes], dtype=t.dtype.proto, dim=dim,
                                        rows=n, offset=start))
    _check_end(data, pos, what)
    return wire.PullReply(out, buffer=buf)


def decode_push_reply(data: Buffer) -> ps_pb2.PushManyResponse:
    """A push reply frame -> the ``PushManyResponse`` it stands for (what ``routing.add_push_counts`` reads).

    Args:
        data: the received bytes.
    """
    what = _KIND_NAMES[PUSH_REPLY]
    frame, descs, pos = _parse(data, PUSH_REPLY)
    k = len(_COUNT_NAMES)
    counts = []
    for t, (n, dim, code) in zip(frame.tables, descs):
        if code != _I64 or dim != k:
            raise WireError(f"{what} frame: table '{t.name}': {dim} counts of {_DTYPE_NAMES.get(code, code)}, "
                            f"expected {k} of int64 ({', '.join(_COUNT_NAMES)})")
        start = pos
        pos = _take(data, pos, 8 * k, what, t.name, "counts", f"{k} int64")
        vals = _view(data, _ID, k, start)
        counts.append(ps_pb2.PushCounts(table=t.name, **{f: int(v) for f, v in zip(_COUNT_NAMES, vals)}))
    _check_end(data, pos, what)
    return ps_pb2.PushManyResponse(tables=counts)
