"""One worker step with one shard in one message: StepFrame, the fleet's round trip.

A worker step used to cost three RPCs to every shard (PullFrame, PushFrame, PushDense). A
StepFrame carries all three parts a shard needs from one step, and the shard applies them in
this order inside one handler call::

    push    the rows' gradients of step t (a group push frame, ``ps/group_frame.py``: per storage group
            one run of ids and gradients; its step advances the clock)
    dense   the dense gradients of the parameters this shard owns, and their new values back
    pull    the rows of the next batch (a group pull frame), read after the push: a serial worker's
            next rows include its own last update, as with separate calls

Every part is optional. Every refusal of the push or dense part (a malformed frame, a wrong
owner, NaN gradients, a paused shard) comes before anything is applied, so the caller may resend
the parts by the ordinary calls; once they are applied, a pull that cannot be served now (a wrong
owner, too far ahead of the slowest worker, a reply over the size limit) is not an error: the reply
says "pull deferred" with the reason, and the caller pulls by the ordinary path, which knows how to
wait, refresh the map and split.

Layout (little-endian, every part at an 8-aligned offset, zero-padded to 8)::

    envelope  32 B  magic "MPSS" | version u8 | kind u8 | flags u8 | 0 u8
                    | push_len u64 | dense_len u64 | pull_len u64
              then the push part, the dense part, the pull part (each *_len bytes; 0 = absent)
    kind      1 request, 2 reply
    flags     request: bit 0 dense values wanted back; reply: bit 1 pull deferred (the pull
              part is then the reason, UTF-8)
    request   push = a group push request, pull = a group pull request (``ps/group_frame.py``)
    reply     push = a group push reply, pull = a group pull reply

    dense     16 B  magic "MPSD" | count u32 | floats u64
              per parameter 8 B: numel u32 | name_len u16 | 0 u16, then the names (UTF-8) zero-padded
              to 8, then float32 [floats] (the parameters' values or gradients, flat, in order)

A dense part decodes to one flat float32 array (a view of the message) and the names and sizes
that split it: the client encodes a step's dense gradients from one flat tensor and loads the
reply's values as one flat tensor; no per-parameter message.

Example::

    req = encode_step(REQUEST, push=group_push, dense=encode_dense(["w"], np.ones(3, np.float32), [3]),
                      pull=group_pull, flags=FLAG_WANT_VALUES)
    parts = decode_step(req, REQUEST)   # parts.push, parts.dense, parts.pull: views of req
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Sequence

import numpy as np

from ps.reply_buffer import writable_bytes, writable_view
from ps.wire import Buffer, WireError, pad8

__all__ = [
    "STEP_METHOD", "STEP_PATH", "REQUEST", "REPLY", "StepParts", "DenseSection", "encode_step", "decode_step",
    "encode_dense", "decode_dense",
]

SERVICE = "metaps.ps.ParameterServer"
STEP_METHOD = "StepFrame"
STEP_PATH = f"/{SERVICE}/{STEP_METHOD}"
MAGIC = b"MPSS"
DENSE_MAGIC = b"MPSD"
VERSION = 1
REQUEST, REPLY = 1, 2
FLAG_WANT_VALUES = 1
FLAG_PULL_DEFERRED = 2
_ENVELOPE = struct.Struct("<4sBBBBQQQ")
_DENSE_HEAD = struct.Struct("<4sIQ")
_DENSE_PARAM = struct.Struct("<IHH")
_KINDS = {REQUEST: "step request", REPLY: "step reply"}




@dataclasses.dataclass
class StepParts:
    """A decoded step message: its parts as views of the message (None: absent).

    Attributes:
        kind: REQUEST or REPLY.
        push: the push request (reply) frame.
        dense: the dense part.
        pull: the pull request (reply) frame; the reason (UTF-8) when ``pull_deferred``.
        want_values: (request) the dense parameters' new values are wanted back.
        pull_deferred: (reply) the pull was not served; ``pull`` holds why.
    """

    kind: int
    push: memoryview | None
    dense: memoryview | None
    pull: memoryview | None
    want_values: bool = False
    pull_deferred: bool = False

    @property
    def deferred_reason(self) -> str:
        """Why the pull was deferred ("" when it was not)."""
        return bytes(self.pull).decode("utf-8", "replace") if self.pull_deferred and self.pull is not None else ""


def encode_step(kind: int, *, push: Buffer | None = None, dense: Buffer | None = None, pull: Buffer | None = None,
                flags: int = 0) -> bytes:
    """A step message of ``kind`` from its parts (copied once into one new ``bytes``).

    Args:
        kind: REQUEST or REPLY.
        push, dense, pull: the parts (see the module docstring); None or empty: absent.
        flags: FLAG_WANT_VALUES (request) / FLAG_PULL_DEFERRED (reply).
    """
    parts = [p if p is not None else b"" for p in (push, dense, pull)]
    sizes = [len(p) for p in parts]
    total = _ENVELOPE.size + sum(pad8(n) for n in sizes)
    data, view = writable_bytes(total)
    _ENVELOPE.pack_into(view.data, 0, MAGIC, VERSION, kind, flags, 0, *sizes)
    at = _ENVELOPE.size
    for part, n in zip(parts, sizes):
        if n:
            view[at:at + n] = np.frombuffer(part, dtype=np.uint8)
        view[at + n:at + pad8(n)] = 0
        at += pad8(n)
    return data if data is not None else view.tobytes()


def decode_step(data: bytes, kind: int, *, writable: bool = False) -> StepParts:
    """A step message -> its parts, every length checked against the message.

    Args:
        data: the received bytes.
        kind: the kind expected (REQUEST on a shard, REPLY on a client).
        writable: the parts may be writable views (only for bytes nobody else holds: what gRPC
            just received), so pulled rows and pushed gradients are used without a copy.

    Raises:
        ps.wire.WireError: malformed (the message names the field and the sizes).
    """
    what = _KINDS[kind]
    size = len(data)
    if size < _ENVELOPE.size:
        raise WireError(f"{what}: short envelope: {size} bytes, expected at least {_ENVELOPE.size}")
    magic, version, got, flags, _, *sizes = _ENVELOPE.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireError(f"{what}: magic {magic!r}, expected {MAGIC!r} (not a metaps step message)")
    if version != VERSION:
        raise WireError(f"{what}: version {version}, this side speaks version {VERSION}")
    if got != kind:
        raise WireError(f"{what}: kind {got} ({_KINDS.get(got, 'unknown')}), expected {kind}")
    known = FLAG_WANT_VALUES if kind == REQUEST else FLAG_PULL_DEFERRED
    if flags & ~known:
        raise WireError(f"{what}: unknown flag bits {flags & ~known:#x}")
    need = _ENVELOPE.size + sum(pad8(n) for n in sizes)
    if need != size:
        raise WireError(f"{what}: {size} bytes, its envelope says {need} (push {sizes[0]}, dense {sizes[1]}, "
                        f"pull {sizes[2]})")
    owned = writable_view(data) if writable else None
    mv = owned.data if owned is not None else memoryview(data)
    out: list[memoryview | None] = []
    at = _ENVELOPE.size
    for n in sizes:
        out.append(mv[at:at + n] if n else None)
        at += pad8(n)
    return StepParts(kind, out[0], out[1], out[2], want_values=bool(flags & FLAG_WANT_VALUES) and kind == REQUEST,
                     pull_deferred=bool(flags & FLAG_PULL_DEFERRED) and kind == REPLY)


@dataclasses.dataclass
class DenseSection:
    """A decoded dense part.

    Attributes:
        names: the parameters, in order.
        sizes: each one's element count.
        flat: float32 [sum(sizes)], a view of the message.
    """

    names: list[str]
    sizes: list[int]
    flat: np.ndarray

    def split(self) -> dict[str, np.ndarray]:
        """name -> its flat float32 view (no copy)."""
        out, at = {}, 0
        for name, n in zip(self.names, self.sizes):
            out[name] = self.flat[at:at + n]
            at += n
        return out


def encode_dense(names: Sequence[str], flat: np.ndarray, sizes: Sequence[int]) -> bytes:
    """A dense part: parameters ``names`` whose values (or gradients) lie in ``flat`` in order.

    Args:
        names: the parameters.
        flat: float32 [sum(sizes)].
        sizes: each parameter's element count.

    Raises:
        ps.wire.WireError: names and sizes disagree, a name is too long, or ``flat`` has another size.
    """
    if len(names) != len(sizes):
        raise WireError(f"dense part: {len(names)} names for {len(sizes)} sizes")
    enc = [n.encode("utf-8") for n in names]
    for n, b in zip(names, enc):
        if not b or len(b) > 0xFFFF:
            raise WireError(f"dense part: parameter name {n!r} must be 1..65535 bytes of UTF-8")
    total = int(sum(sizes))
    flat = np.ascontiguousarray(flat, dtype=np.float32).reshape(-1)
    if flat.size != total:
        raise WireError(f"dense part: {flat.size} floats for parameters of {total}")
    blob = b"".join(enc)
    head = _DENSE_HEAD.size + _DENSE_PARAM.size * len(enc)
    nbytes = head + pad8(len(blob)) + 4 * total
    data, view = writable_bytes(nbytes)
    _DENSE_HEAD.pack_into(view.data, 0, DENSE_MAGIC, len(enc), total)
    at = _DENSE_HEAD.size
    for b, k in zip(enc, sizes):
        _DENSE_PARAM.pack_into(view.data, at, int(k), len(b), 0)
        at += _DENSE_PARAM.size
    view[at:at + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    view[at + len(blob):at + pad8(len(blob))] = 0
    at += pad8(len(blob))
    view[at:].view(np.float32)[:] = flat
    return data if data is not None else view.tobytes()


def decode_dense(data: Buffer) -> DenseSection:
    """A dense part -> :class:`DenseSection` (``flat`` is a view of ``data``).

    Raises:
        ps.wire.WireError: malformed (sizes, names, the float count).
    """
    size = len(data)
    if size < _DENSE_HEAD.size:
        raise WireError(f"dense part: {size} bytes, shorter than its {_DENSE_HEAD.size}-byte header")
    magic, count, total = _DENSE_HEAD.unpack_from(data, 0)
    if magic != DENSE_MAGIC:
        raise WireError(f"dense part: magic {magic!r}, expected {DENSE_MAGIC!r}")
    at = _DENSE_HEAD.size
    if at + _DENSE_PARAM.size * count > size:
        raise WireError(f"dense part: {count} parameter descriptors need {_DENSE_PARAM.size * count} bytes, "
                        f"{size - at} left")
    sizes, lens = [], []
    for _ in range(count):
        n, nlen, _ = _DENSE_PARAM.unpack_from(data, at)
        sizes.append(int(n))
        lens.append(int(nlen))
        at += _DENSE_PARAM.size
    if sum(sizes) != total:
        raise WireError(f"dense part: parameter sizes add up to {sum(sizes)}, the header says {total}")
    blob_len = sum(lens)
    if at + pad8(blob_len) + 4 * total != size:
        raise WireError(f"dense part: {size} bytes, its header and descriptors say {at + pad8(blob_len) + 4 * total}")
    names = []
    pos = at
    for nlen in lens:
        try:
            names.append(bytes(data[pos:pos + nlen]).decode("utf-8"))
        except UnicodeDecodeError:
            raise WireError("dense part: a parameter name is not UTF-8") from None
        if not nlen:
            raise WireError("dense part: a parameter name is empty")
        pos += nlen
    flat = np.frombuffer(data, dtype=np.float32, count=total, offset=at + pad8(blob_len)) if total else \
        np.empty(0, dtype=np.float32)
    return DenseSection(names, sizes, flat)
