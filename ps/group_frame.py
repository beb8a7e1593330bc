"""Group frames: a step's rows per storage group, no per-table sections (StepFrame's push and pull parts).

A PS shard stores tables of one dim and optimizer in one storage group (``ps/grouping.py``) and
updates a group in one pass; a worker moves a step's rows group by group. A group frame carries
exactly that: per group its table names once, the ids per table as one int64 count vector, then
all its ids and (push) all its gradients as single runs. Decoding a frame is a fixed number of
``np.frombuffer`` views per group, whatever the number of tables, and the shard hands the runs to
the group's store call unchanged; the pull reply is one run of rows per group, gathered into the
reply buffer in place.

Layout (little-endian; every part at an 8-aligned offset, zero-padded to 8)::

    header   32 B  magic "MPSG" | version u8 | kind u8 | flags u8 | 0 u8 | map_version i64 | step i64
                   | worker_len u16 | groups u16 | 0 u32
    worker id      worker_len bytes of UTF-8
    per group 24 B n i64 | dim u32 | names_len u32 | tables u16 | dtype u8 | 0 u8 | 0 u32,
                   then the table names (UTF-8, joined by "\\n"), then counts int64 [tables]
    per group      the payload: push request: ids int64 [n], grads [n, dim]
                                pull request: ids int64 [n]
                                pull reply:   rows [n, dim]
                                push reply:   counts int64 [tables, 1 + len(PUSH_COUNT_FIELDS)]

``kind``: 1 push request, 2 pull request, 3 pull reply, 4 push reply. ``flags``: bit 0 fp16 rows
(wanted / sent), bit 1 ``step`` present. ``dtype``: 0 none, 1 fp32, 2 fp16, 3 int64. Replies carry
no names (the request's order); their descriptors repeat n, dim and the table count.

Example::

    data = encode_push([(("a", "b"), counts, ids, grads, None)], grad_dtype=DType.FP32, map_version=1,
                       worker_id="w0", step=3)
    frame = decode(data, PUSH_REQUEST)   # frame.groups[0].ids / .values: views of data
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Sequence

import numpy as np
import torch

from ps.reply_buffer import writable_bytes
from ps.types import PUSH_COUNT_FIELDS
from ps.wire import Buffer, DType, WireError, pad8

__all__ = ["PUSH_REQUEST", "PULL_REQUEST", "PULL_REPLY", "PUSH_REPLY", "GroupPart", "GroupFrame", "encode_push",
           "encode_pull", "encode_push_reply", "decode", "PullReplyBuffer", "COUNT_FIELDS"]

MAGIC = b"MPSG"
VERSION = 1
PUSH_REQUEST, PULL_REQUEST, PULL_REPLY, PUSH_REPLY = 1, 2, 3, 4
_KINDS = {PUSH_REQUEST: "group push request", PULL_REQUEST: "group pull request", PULL_REPLY: "group pull reply",
          PUSH_REPLY: "group push reply"}
FLAG_FP16 = 1
FLAG_STEP = 2
_NONE, _FP32, _FP16, _I64 = 0, 1, 2, 3
_CODE = {DType.FP32: _FP32, DType.FP16: _FP16}
_DT: dict[int, np.dtype] = {_FP32: np.dtype("<f4"), _FP16: np.dtype("<f2"), _I64: np.dtype("<i8")}
_HEADER = struct.Struct("<4sBBBBqqHHI")
_GROUP = struct.Struct("<qIIHBBI")
_ID = np.dtype("<i8")
COUNT_FIELDS = ("rows",) + PUSH_COUNT_FIELDS
"""The columns of a push reply's counts: rows sent, then the store's PushResult fields."""




@dataclasses.dataclass
class GroupPart:
    """One storage group of a frame.

    Attributes:
        names: its tables (storage order); empty in replies.
        counts: int64 [tables]: ids (rows) per table.
        ids: int64 [n] (requests), the tables' ids one after the other.
        values: [n, dim] gradients (push request) or rows (pull reply); int64 [tables, k] counts (push reply).
        dim: row width.
        dtype: the values' wire dtype (None: none).
    """

    names: tuple[str, ...]
    counts: np.ndarray
    ids: np.ndarray | None = None
    values: np.ndarray | None = None
    dim: int = 0
    dtype: DType | None = None


@dataclasses.dataclass
class GroupFrame:
    """A decoded group frame."""

    kind: int
    fp16: bool
    map_version: int
    step: int | None
    worker_id: str
    groups: list[GroupPart]


def _layout(kind: int, worker: bytes, parts: Sequence[tuple[bytes, int, int, int, int]]) -> tuple[int, list[int]]:
    """(total size, offset of each group's descriptor); parts: (names blob, tables, n, dim, itemsize)."""
    at = _HEADER.size + pad8(len(worker))
    offs = []
    for blob, tables, _, _, _ in parts:
        offs.append(at)
        at += _GROUP.size + pad8(len(blob)) + 8 * tables
    for _, tables, n, dim, item in parts:
        if kind in (PUSH_REQUEST, PULL_REQUEST):
            at += 8 * n
        if kind == PUSH_REQUEST or kind == PULL_REPLY:
            at += pad8(n * dim * item)
        if kind == PUSH_REPLY:
            at += 8 * tables * len(COUNT_FIELDS)
    return at, offs


def _blob(names: Sequence[str]) -> bytes:
    b = "\n".join(names).encode("utf-8")
    if any(not n or "\n" in n for n in names):
        raise WireError(f"group frame: table names must be non-empty without newlines, got {list(names)}")
    return b


class _Writer:
    """A frame of ``kind`` under construction in one new ``bytes``: header and descriptors written,
    each group's payload regions handed out as writable arrays."""

    def __init__(self, kind: int, groups: Sequence[tuple[Sequence[str], np.ndarray, int, int, DType | None]], *,
                 # per group: (names, counts per table, dim, rows, wire dtype)
                 flags: int, map_version: int, step: int | None, worker_id: str) -> None:
        worker = worker_id.encode("utf-8")
        if len(worker) > 0xFFFF or len(groups) > 0xFFFF:
            raise WireError(f"group frame: worker id of {len(worker)} bytes / {len(groups)} groups, at most 65535")
        blobs = [_blob(names) if kind in (PUSH_REQUEST, PULL_REQUEST) else b"" for names, *_ in groups]
        shapes = [(b, int(c.size), int(n), int(dim), dt.numpy.itemsize if dt is not None else 8)
                  for b, (_, c, dim, n, dt) in zip(blobs, groups)]
        total, offs = _layout(kind, worker, shapes)
        self.data, self.view = writable_bytes(total)
        v = self.view
        v[:] = 0
        _HEADER.pack_into(v.data, 0, MAGIC, VERSION, kind, flags, 0, map_version, 0 if step is None else step,
                          len(worker), len(groups), 0)
        v[_HEADER.size:_HEADER.size + len(worker)] = np.frombuffer(worker, dtype=np.uint8)
        for (blob, tables, n, dim, _), (_, counts, _, _, dt), off in zip(shapes, groups, offs):
            code = _I64 if kind == PUSH_REPLY else (_CODE[dt] if dt is not None else _NONE)
            _GROUP.pack_into(v.data, off, n, dim, len(blob), tables, code, 0, 0)
            at = off + _GROUP.size
            v[at:at + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            at += pad8(len(blob))
            v[at:at + 8 * tables].view(_ID)[:] = counts
        self.at = offs[-1] + _GROUP.size + pad8(len(shapes[-1][0])) + 8 * shapes[-1][1] if offs else \
            _HEADER.size + pad8(len(worker))
        self.total = total

    def region(self, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The next ``nbytes`` of payload as a writable array (advances past its padding)."""
        out = self.view[self.at:self.at + nbytes].view(dtype).reshape(shape)
        self.at += pad8(nbytes)
        return out

    def bytes(self) -> bytes:
        assert self.at == self.total, (self.at, self.total)
        return self.data if self.data is not None else self.view.tobytes()


def _put(dst: np.ndarray, src: np.ndarray, pos: np.ndarray | None) -> None:
    if pos is None:
        dst[...] = src
    elif src.ndim == 1:
        np.take(src, pos, out=dst)
    else:
        torch.index_select(torch.from_numpy(np.ascontiguousarray(src)), 0, torch.from_numpy(pos), out=torch.from_numpy(dst))


def encode_push(groups: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]], *,
                grad_dtype: DType, map_version: int, worker_id: str, step: int | None) -> bytes:
    """A push request: per group (names, counts, ids [N], float32 grads [N, dim], positions or None).

    With positions, the group's rows at those positions are sent (their counts per table given);
    without, all of them in order. Ids and gradients are gathered straight into the frame.
    """
    parts = [(names, counts, int(g.shape[1]), int(counts.sum()), grad_dtype) for names, counts, _, g, _ in groups]
    w = _Writer(PUSH_REQUEST, parts, flags=FLAG_STEP if step is not None else 0, map_version=map_version,
                step=step, worker_id=worker_id)
    for (names, counts, ids, grads, pos), (_, _, dim, n, _) in zip(groups, parts):
        _put(w.region(8 * n, _ID, (n,)), ids, pos)
        dst = w.region(n * dim * grad_dtype.numpy.itemsize, grad_dtype.numpy, (n, dim))
        if n and grad_dtype == DType.FP32:
            _put(dst, grads, pos)
        elif n:
            dst[...] = (grads if pos is None else grads[pos]).astype(grad_dtype.numpy)
    return w.bytes()


def encode_pull(groups: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray | None]], *, fp16: bool,
                map_version: int, worker_id: str, step: int | None) -> bytes:
    """A pull request: per group (names, counts, ids [N], positions or None)."""
    parts = [(names, counts, 0, int(counts.sum()), None) for names, counts, _, _ in groups]
    flags = (FLAG_FP16 if fp16 else 0) | (FLAG_STEP if step is not None else 0)
    w = _Writer(PULL_REQUEST, parts, flags=flags, map_version=map_version, step=step, worker_id=worker_id)
    for (_, _, ids, pos), (_, _, _, n, _) in zip(groups, parts):
        _put(w.region(8 * n, _ID, (n,)), ids, pos)
    return w.bytes()


class PullReplyBuffer:
    """A pull reply under construction: per group a writable rows region the store gathers into.

    Args:
        groups: per group (counts per table, n, dim, wire dtype), in request order.
    """

    def __init__(self, groups: Sequence[tuple[np.ndarray, int, int, DType]]) -> None:
        self._w = _Writer(PULL_REPLY, [((), c, dim, n, dt) for c, n, dim, dt in groups],
                          flags=FLAG_FP16 if any(dt == DType.FP16 for *_, dt in groups) else 0,
                          map_version=0, step=None, worker_id="")
        self._rows = [self._w.region(n * dim * dt.numpy.itemsize, dt.numpy, (n, dim)) for _, n, dim, dt in groups]

    def rows(self, i: int) -> np.ndarray:
        """Group ``i``'s rows region: writable C-contiguous [n, dim] of its wire dtype."""
        return self._rows[i]

    def bytes(self) -> bytes:
        return self._w.bytes()


def encode_push_reply(groups: Sequence[np.ndarray]) -> bytes:
    """A push reply: per group int64 [tables, len(COUNT_FIELDS)] counts."""
    k = len(COUNT_FIELDS)
    w = _Writer(PUSH_REPLY, [((), np.ascontiguousarray(c[:, 0]), k, 0, None) for c in groups], flags=0,
                map_version=0, step=None, worker_id="")
    for c in groups:
        w.region(8 * c.size, _ID, c.shape)[...] = c
    return w.bytes()


def decode(data: Buffer, kind: int) -> GroupFrame:
    """A group frame of ``kind`` -> :class:`GroupFrame` (arrays are views of ``data``), every length
    checked against the frame before anything is read.

    Raises:
        ps.wire.WireError: malformed (the message names the group, the field and the sizes).
    """
    what = _KINDS[kind]
    size = len(data)
    if size < _HEADER.size:
        raise WireError(f"{what}: short header: {size} bytes, expected at least {_HEADER.size}")
    magic, version, got, flags, _, map_version, step, wlen, ngroups, _ = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireError(f"{what}: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"{what}: version {version}, this side speaks version {VERSION}")
    if got != kind:
        raise WireError(f"{what}: kind {got} ({_KINDS.get(got, 'unknown')}), expected {kind}")
    if flags & ~(FLAG_FP16 | FLAG_STEP):
        raise WireError(f"{what}: unknown flag bits {flags & ~(FLAG_FP16 | FLAG_STEP):#x}")
    at = _HEADER.size

    def need(nbytes: int, field: str) -> None:
        if at + nbytes > size:
            raise WireError(f"{what}: {field} needs {nbytes} bytes at offset {at}, the frame has {max(0, size - at)} left")

    need(wlen, "worker id")
    try:
        worker = bytes(data[at:at + wlen]).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"{what}: worker id is not UTF-8") from None
    at += pad8(wlen)
    groups: list[GroupPart] = []
    descs = []
    for gi in range(ngroups):
        need(_GROUP.size, f"group {gi} of {ngroups}: descriptor")
        n, dim, blen, tables, code, _, _ = _GROUP.unpack_from(data, at)
        at += _GROUP.size
        need(blen, f"group {gi}: names")
        try:
            names = tuple(bytes(data[at:at + blen]).decode("utf-8").split("\n")) if blen else ()
        except UnicodeDecodeError:
            raise WireError(f"{what}: group {gi}: table names are not UTF-8") from None
        at += pad8(blen)
        if kind in (PUSH_REQUEST, PULL_REQUEST) and len(names) != tables:
            raise WireError(f"{what}: group {gi}: {len(names)} table names for {tables} tables")
        need(8 * tables, f"group {gi} {list(names)}: counts")
        counts = np.frombuffer(data, dtype=_ID, count=tables, offset=at) if tables else np.zeros(0, np.int64)
        at += 8 * tables
        if n < 0 or (counts < 0).any() or (kind != PUSH_REPLY and int(counts.sum()) != n):
            raise WireError(f"{what}: group {gi} {list(names)}: counts {counts.tolist()} do not add up to its {n} rows")
        want_code = {PUSH_REQUEST: (_FP32, _FP16), PULL_REQUEST: (_NONE,), PULL_REPLY: (_FP32, _FP16),
                     PUSH_REPLY: (_I64,)}[kind]
        if code not in want_code:
            raise WireError(f"{what}: group {gi} {list(names)}: dtype code {code}, expected one of {list(want_code)}")
        dt = {_FP32: DType.FP32, _FP16: DType.FP16}.get(code)
        groups.append(GroupPart(names, counts, dim=int(dim), dtype=dt))
        descs.append((int(n), int(dim), code, int(tables)))
    for gi, (g, (n, dim, code, tables)) in enumerate(zip(groups, descs)):
        if kind in (PUSH_REQUEST, PULL_REQUEST):
            need(8 * n, f"group {gi} {list(g.names)}: ids ({n} int64)")
            g.ids = np.frombuffer(data, dtype=_ID, count=n, offset=at) if n else np.zeros(0, np.int64)
            at += 8 * n
        if kind in (PUSH_REQUEST, PULL_REPLY):
            nbytes = n * dim * _DT[code].itemsize
            need(nbytes, f"group {gi} {list(g.names)}: {'grads' if kind == PUSH_REQUEST else 'rows'} ({n} x dim {dim})")
            g.values = np.frombuffer(data, dtype=_DT[code], count=n * dim, offset=at).reshape(n, dim) if n * dim else \
                np.zeros((n, dim), _DT[code])
            at += pad8(nbytes)
        if kind == PUSH_REPLY:
            need(8 * tables * dim, f"group {gi}: counts")
            g.values = np.frombuffer(data, dtype=_ID, count=tables * dim, offset=at).reshape(tables, dim)
            at += 8 * tables * dim
    if at != size:
        raise WireError(f"{what}: {size} bytes, its header and groups say {at}")
    return GroupFrame(kind, bool(flags & FLAG_FP16), int(map_version), int(step) if flags & FLAG_STEP else None, worker,
                      groups)
