"""Checkpoint files of the PS: one LMDB file per shard, a manifest, atomic commit.

Directory layout::

    <root>/ckpt-<step>.tmp/        being written (ignored by latest_checkpoint)
    <root>/ckpt-<step>/            committed (atomic rename of the .tmp dir)
        shard-0.lmdb               LMDB env (subdir=False, no lock file)
        shard-1.lmdb
        ...                        other parts (e.g. DDS state) written by their owners
        manifest.json              sha256 + size of every file, tables, dims, shards,
                                   num_vshards, step, caller's info

Keys in ``shard-<K>.lmdb``::

    meta                 json: format, shard_id, num_vshards, version, seed,
                         tables {name: {dim, optimizer, capacity, rows, step, state}}, dense [names]
    t/<table>/<vshard>   one chunk: that vshard's TableRows (full checkpoints; see
                         ``row_chunks`` below for delta files)
    n/<table>            one chunk: rows per vshard as written (int64 "vshards", "rows");
                         format 2: a restore compares what it reads with it
    d/<name>             one chunk: dense value + optimizer state

Chunk format (little-endian)::

    b"MPSC" | u32 format=2 | u32 header_len | u32 crc32(header) | header json | pad to 8 | buffers
    header = {"arrays": [{"name", "dtype", "shape", "offset", "nbytes", "crc32"}, ...]}

The crc32s are taken as the rows are serialized (:func:`pack_arrays`) and checked
on every read: damage after serialization (a write-path fault, the disk, LMDB) is
refused as :class:`CheckpointError` (DATA_LOSS on the wire) naming file and key.
Format 1 (no crc fields, files written before) is still read.

Because rows are keyed by vshard, a checkpoint taken with N shards restores
onto M shards: each new shard reads every ``shard-*.lmdb`` and imports only the
vshards it owns (rows are re-bucketed by id when num_vshards changed).

Not checkpointed: admission sketches (pending counts of not-yet-admitted ids)
and the eviction removal log; they restart empty.

Delta checkpoints (``[ps] checkpoint_full_every`` > 1)::

    <root>/ckpt-<step>.tmp/plan.json   written first (begin_checkpoint): ckpt_id, kind, parent, chain
    shard-<K>.lmdb of a delta          t/<table>/<vshard>: only rows with row_version > the store's
                                       cut of the parent; r/<table>: ids evicted since that cut
                                       meta "row_chunks": "runs": a chunk holds the rows of vshards
                                       <vshard> .. (the next chunk's key - 1), closed once it
                                       reaches DELTA_CHUNK_BYTES (one chunk per table per file for a small delta: a
                                       reader decodes a handful of chunks, not one per vshard);
                                       absent (files written before): one chunk per vshard
    manifest.json                      + ckpt_id, kind (full|delta), parent, chain [[name, ckpt_id], ...]

A restore (``load_shard``) verifies every chain member first, then imports the
base and replays each delta (its removals, then its rows). See
docs/design/ps_storage.md "Delta checkpoints".

Example::

    tmp = checkpoint_tmp_dir(root, step=100)
    save_shard(store, tmp, shard_id=0)            # each shard, into the same tmp dir
    final = commit_checkpoint(tmp, {"step": 100})  # once, after every shard saved
    new_store = ShardStore(...); load_shard(new_store, latest_checkpoint(root), owned_vshards)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import shutil
import uuid
import zlib
from dataclasses import dataclass
import json
import logging
import math
import os
import re
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import lmdb
import numpy as np

from common.hashing import vshard_of
from common.log import kv
from ps.rows import TableRows
from common.atomic_write import write_text_atomic
from ps.errors import BadRequest, CheckpointError, CheckpointNoSpace, CheckpointNotFound, CheckpointWriteError

if TYPE_CHECKING:
    from ps.shard_store import ShardStore

log = logging.getLogger(__name__)

MAGIC = b"MPSC"
FORMAT = 2
"""Chunk and shard-file format written: 2 = per-chunk crc32s and per-vshard row counts (``n/<table>``).
Files of format 1 (no checksums, written before) are still read."""
MANIFEST = "manifest.json"
PLAN = "plan.json"
DELTA_UNAVAILABLE = "delta unavailable"
"""Start of a :class:`DeltaUnavailable` message (the coordinator matches it to retry as a full checkpoint)."""
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
_TMP_RE = re.compile(r"^ckpt-(\d+)\.tmp$")
_SHARD_RE = re.compile(r"^shard-(\d+)\.lmdb$")
_HDR = struct.Struct("<4sII")
"""Chunk prefix: magic, format, header length (format 1 ends here)."""
_HDR2 = struct.Struct("<4sIII")
"""Format 2 chunk prefix: + crc32 of the json header."""
_TXN_BYTES = 64 << 20
"""A streaming save commits its LMDB write transaction every this many bytes."""
DELTA_CHUNK_BYTES = 16 << 20
"""A delta file's rows go into chunks of consecutive vshards of about this many bytes (meta
``row_chunks = "runs"``): few chunks to decode, bounded memory while saving."""
ROW_CHUNKS_RUNS = "runs"
"""``meta["row_chunks"]`` of a file whose chunk ``t/<table>/<v>`` holds vshards v .. next key - 1."""


# -- chunk encoding ----------------------------------------------------------------
def pack_arrays(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Serialize named arrays as raw little-endian buffers behind a small json header.

    Format 2: every array's crc32 is taken from its bytes here, as the rows are
    serialized, and stored in the header; the header's own crc32 is in the fixed
    prefix. A reader (:func:`unpack_arrays`) recomputes both, so any later stage
    that changes a byte (a write-path fault, the disk, LMDB) is caught per chunk.
    """
    metas = []
    bufs = []
    offset = 0
    for name, a in arrays.items():
        a = np.asarray(a)
        if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
            a = a.copy(order="C")
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        b = a.tobytes()
        metas.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": len(b),
                      "crc32": zlib.crc32(b)})
        bufs.append(b)
        pad = (-len(b)) % 8
        if pad:
            bufs.append(b"\0" * pad)
        offset += len(b) + pad
    header = json.dumps({"arrays": metas}).encode()
    head = _HDR2.pack(MAGIC, FORMAT, len(header), zlib.crc32(header)) + header
    head += b"\0" * ((-len(head)) % 8)
    return head + b"".join(bufs)


def unpack_arrays(buf: bytes | memoryview, where: str, checked: bool = False) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_arrays`; ``where`` names file and key in errors.

    Args:
        buf: the chunk.
        where: ``<file> key '<key>'`` for error messages.
        checked: the chunk must carry checksums (format 2): set for chunks of a file whose
            meta says format 2, so a corrupted format field cannot skip the check. Format 1
            chunks (files written before checksums) are read when False.

    Raises:
        CheckpointError: truncated, malformed, or a checksum that does not match.
    """
    buf = memoryview(buf)
    if len(buf) < _HDR.size:
        raise CheckpointError(f"{where}: chunk truncated ({len(buf)} bytes)")
    magic, fmt, hlen = _HDR.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CheckpointError(f"{where}: bad chunk magic {bytes(magic)!r}, expected {MAGIC!r}")
    if fmt not in (1, FORMAT) or (checked and fmt != FORMAT):
        raise CheckpointError(f"{where}: chunk format {fmt}, this build reads {FORMAT}"
                              + (" (the file's meta says format 2)" if checked and fmt == 1 else " and 1"))
    hstart = _HDR2.size if fmt == FORMAT else _HDR.size
    start = hstart + hlen
    if start > len(buf):
        raise CheckpointError(f"{where}: chunk truncated (header of {hlen} bytes, chunk of {len(buf)})")
    if fmt == FORMAT:
        want = _HDR2.unpack_from(buf, 0)[3]
        got = zlib.crc32(buf[hstart:start])
        if got != want:
            raise CheckpointError(f"{where}: chunk header checksum mismatch (crc32 written {want:08x}, "
                                  f"read {got:08x}): the chunk changed after it was written")
    try:
        header = json.loads(bytes(buf[hstart:start]))
    except ValueError as exc:
        raise CheckpointError(f"{where}: corrupt chunk header: {exc}") from None
    base = start + ((-start) % 8)
    out = {}
    arrays = header.get("arrays", []) if isinstance(header, dict) else None
    if not isinstance(arrays, list):
        raise CheckpointError(f"{where}: chunk header has no 'arrays' list")
    for m in arrays:
        try:
            lo = base + int(m["offset"])
            hi = lo + int(m["nbytes"])
            dt = np.dtype(m["dtype"])
            shape = tuple(int(s) for s in m["shape"])
            crc = int(m["crc32"]) if fmt == FORMAT else None
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: malformed array entry {str(m)[:120]} in the chunk header: {exc}") from None
        if hi > len(buf) or lo < base or min(shape, default=0) < 0:
            raise CheckpointError(f"{where}: array '{m.get('name')}' runs past the chunk end ({hi} > {len(buf)})")
        if math.prod(shape) * dt.itemsize != int(m["nbytes"]):
            raise CheckpointError(f"{where}: array '{m['name']}' size does not match shape {shape} {dt}")
        if crc is not None:
            got = zlib.crc32(buf[lo:hi])
            if got != crc:
                raise CheckpointError(f"{where}: array '{m['name']}' checksum mismatch (crc32 written {crc:08x}, "
                                      f"read {got:08x}): the chunk changed after it was written")
        out[m["name"]] = np.frombuffer(buf[lo:hi], dtype=dt).reshape(shape).copy()
    return out


def _rows_to_arrays(rows: TableRows) -> dict[str, np.ndarray]:
    assert rows.freq is not None and rows.last_step is not None  # set by TableRows.__post_init__
    d = {"ids": rows.ids, "weights": rows.weights, "freq": rows.freq, "last_step": rows.last_step}
    d.update({f"state/{k}": v for k, v in rows.state.items()})
    return d


def _arrays_to_rows(a: dict[str, np.ndarray], where: str) -> TableRows:
    for k in ("ids", "weights", "freq", "last_step"):
        if k not in a:
            raise CheckpointError(f"{where}: chunk lacks array '{k}'")
    return TableRows(
        ids=a["ids"],
        weights=a["weights"],
        state={k[6:]: v for k, v in a.items() if k.startswith("state/")},
        freq=a["freq"],
        last_step=a["last_step"],
    )


# -- plans: full or delta ------------------------------------------------------------
class DeltaUnavailable(CheckpointError):
    """A shard cannot write the planned delta (it has no cut of the parent, or its
    removal log forgot removals since then); nothing was written. The coordinator
    retries the checkpoint as a full one."""


@dataclass(frozen=True)
class CheckpointPlan:
    """What one checkpoint is: full, or a delta over its parent.

    Written as ``plan.json`` into ``ckpt-<step>.tmp`` by :func:`begin_checkpoint`
    before any shard saves; every shard reads it (shared directory), and
    :func:`commit_checkpoint` copies it into the manifest.

    Args:
        ckpt_id: unique id of this checkpoint attempt (a retried or aborted attempt has another).
        parent: directory name of the parent checkpoint (``ckpt-<step>``); None = full.
        parent_id: the parent's ``ckpt_id``.
        chain: ``[[name, ckpt_id], ...]`` from the base (a full checkpoint) to the parent.
    """

    ckpt_id: str
    parent: str | None = None
    parent_id: str | None = None
    chain: tuple[tuple[str, str], ...] = ()

    @property
    def kind(self) -> str:
        return "full" if self.parent is None else "delta"

    def to_dict(self) -> dict[str, Any]:
        return {"ckpt_id": self.ckpt_id, "kind": self.kind, "parent": self.parent, "parent_id": self.parent_id,
                "chain": [list(c) for c in self.chain]}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> "CheckpointPlan":
        try:
            plan = cls(ckpt_id=str(d["ckpt_id"]), parent=d.get("parent"), parent_id=d.get("parent_id"),
                       chain=tuple((str(n), str(i)) for n, i in d.get("chain") or ()))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: invalid checkpoint plan: {exc!r}") from None
        if (plan.parent is None) != (plan.parent_id is None) or (plan.parent is not None and not plan.chain):
            raise CheckpointError(f"{where}: invalid checkpoint plan: a delta needs parent, parent_id and chain")
        return plan


def _new_id() -> str:
    return uuid.uuid4().hex


def plan_checkpoint(root: str | Path, step: int, full_every: int = 1) -> CheckpointPlan:
    """Full or delta for the next checkpoint under ``root`` (``[ps] checkpoint_full_every``).

    A delta over the newest committed checkpoint when ``full_every > 1``, that
    checkpoint has a ``ckpt_id`` (written by this code) and an older step, and its
    chain (base + deltas) is shorter than ``full_every``; else full.

    Args:
        root: the checkpoint root.
        step: the new checkpoint's step.
        full_every: K of "a full checkpoint every K" (1 = always full).
    """
    if full_every < 1:
        raise ValueError(f"checkpoint_full_every must be >= 1, got {full_every}")
    full = CheckpointPlan(ckpt_id=_new_id())
    latest = latest_checkpoint(root) if full_every > 1 else None
    if latest is None:
        return full
    man = read_manifest(latest)
    pid = man.get("ckpt_id")
    if not pid or int(man["step"]) >= int(step):
        return full
    chain = tuple((str(n), str(i)) for n, i in man.get("chain") or ()) + ((latest.name, str(pid)),)
    if len(chain) >= full_every:
        return full
    return CheckpointPlan(ckpt_id=full.ckpt_id, parent=latest.name, parent_id=str(pid), chain=chain)


def write_plan(ckpt_dir: str | Path, plan: CheckpointPlan) -> Path:
    """Write ``plan.json`` into a checkpoint tmp dir (atomically, fsynced)."""
    path = Path(ckpt_dir) / PLAN
    text = json.dumps(plan.to_dict(), indent=1) + "\n"
    try:
        return write_text_atomic(path, (_faulted(path, PLAN, text.encode()) or b"").decode(), fsync=True)
    except OSError as exc:
        raise write_failed(path, exc, "writing the checkpoint plan") from None


def read_plan(ckpt_dir: str | Path) -> CheckpointPlan | None:
    """The ``plan.json`` of a tmp dir (None when absent: a plain full checkpoint without id)."""
    path = Path(ckpt_dir) / PLAN
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise CheckpointError(f"{path}: invalid json: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a json object")
    return CheckpointPlan.from_dict(data, str(path))


def begin_checkpoint(root: str | Path, step: int, full_every: int = 1) -> tuple[Path, CheckpointPlan]:
    """Create ``<root>/ckpt-<step>.tmp`` with its plan (full or delta); returns (tmp dir, plan).

    Example::

        tmp, plan = begin_checkpoint(root, 200, full_every=4)
        for k, store in enumerate(stores):
            save_shard(store, tmp, k)          # reads tmp/plan.json
        commit_checkpoint(tmp, {"step": 200})
    """
    plan = plan_checkpoint(root, step, full_every)
    tmp = Path(root) / f"ckpt-{int(step)}.tmp"
    try:
        tmp = checkpoint_tmp_dir(root, step)
        write_plan(tmp, plan)
    except OSError as exc:  # a full disk before the first shard writes: no tmp dir left
        failed = write_failed(tmp, exc, "creating the checkpoint directory")
        abort_checkpoint(tmp)
        raise failed from None
    except CheckpointWriteError:
        abort_checkpoint(tmp)
        raise
    return tmp, plan


# -- save ----------------------------------------------------------------------------
WriteFault = Callable[[Path, str, bytes], "bytes | None"]
"""A write-path fault hook: (file, key, chunk as serialized) -> the bytes actually written.

It may change the bytes (a corrupting stage after serialization), return None (an LMDB
chunk lost on its way: not written) or raise ``OSError`` (a full disk at the write
point). For tests and fault demos: see :func:`write_fault`."""

_WRITE_FAULTS: list[WriteFault] = []
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_LOW_SPACE = 2 * _TXN_BYTES
"""An LMDB write error with less than this free on the filesystem is reported as a full disk
(LMDB reports ENOSPC while flushing pages as "Input/output error")."""


@contextlib.contextmanager
def write_fault(hook: WriteFault) -> Iterator[None]:
    """Pass every checkpoint write of this process through ``hook`` while the block runs.

    Called with each LMDB chunk of :func:`save_shard` after it was packed (its
    checksums already taken) and before ``txn.put``, with ``plan.json`` and
    ``manifest.json`` (key = the file name) before they are written.

    Example::

        def full(path, key, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        with write_fault(full):
            save_shard(store, tmp, 0)      # -> CheckpointNoSpace, no shard file left
    """
    _WRITE_FAULTS.append(hook)
    try:
        yield
    finally:
        _WRITE_FAULTS.remove(hook)


def _faulted(path: Path, key: str, data: bytes) -> bytes | None:
    out: bytes | None = data
    for hook in _WRITE_FAULTS:
        if out is None:
            break
        out = hook(path, key, out)
    return out


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return int(st.f_bavail * st.f_frsize)
    return None


def write_failed(path: Path, exc: BaseException, doing: str) -> CheckpointWriteError:
    """The one-line error for an I/O failure while ``doing`` on ``path`` (a full disk named as such)."""
    free = _free_bytes(path)
    err = getattr(exc, "errno", None)
    what = " ".join(str(exc).split()) or type(exc).__name__
    if err in _DISK_FULL or (isinstance(exc, lmdb.Error) and free is not None and free < _LOW_SPACE):
        name = errno.errorcode.get(err, "ENOSPC") if err in _DISK_FULL else "ENOSPC"
        return CheckpointNoSpace(f"{path}: no space left on device while {doing} ({name}: {what}; "
                                 f"{free} bytes free); the checkpoint's partial files were removed")
    return CheckpointWriteError(f"{path}: I/O error while {doing} ({type(exc).__name__}: {what}); "
                                f"the checkpoint's partial files were removed")


def _remove_partial(path: Path) -> None:
    for p in (path, Path(str(path) + "-lock")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def abort_checkpoint(tmp_dir: str | Path) -> bool:
    """Remove a checkpoint tmp dir (``ckpt-<step>.tmp``) after a failed attempt; True if removed.

    Never touches a committed ``ckpt-<step>`` directory.
    """
    tmp_dir = Path(tmp_dir)
    if not _TMP_RE.match(tmp_dir.name) or not tmp_dir.exists():
        return False
    shutil.rmtree(tmp_dir, ignore_errors=True)
    gone = not tmp_dir.exists()
    log.warning("checkpoint attempt aborted; its tmp dir removed" if gone else
                "checkpoint attempt aborted; its tmp dir could not be removed", extra=kv(dir=str(tmp_dir)))
    return gone


def checkpoint_tmp_dir(root: str | Path, step: int) -> Path:
    """Create (if needed) and return ``<root>/ckpt-<step>.tmp``."""
    p = Path(root) / f"ckpt-{int(step)}.tmp"
    p.mkdir(parents=True, exist_ok=True)
    return p


def shard_path(ckpt_dir: str | Path, shard_id: int) -> Path:
    return Path(ckpt_dir) / f"shard-{int(shard_id)}.lmdb"


def save_shard(
    store: ShardStore,
    ckpt_dir: str | Path,
    shard_id: int,
    plan: CheckpointPlan | None = None,
) -> dict[str, Any]:
    """Write this shard's tables and dense params into ``<ckpt_dir>/shard-<K>.lmdb``.

    Streamed: under ``store.write_lock()`` (a consistent cut) every table is
    written one vshard chunk at a time (``ShardStore.vshard_chunks``), committing
    the LMDB transaction every ``_TXN_BYTES``, so the extra memory is one chunk
    plus a row index, never a copy of the tables; pulls and pushes wait meanwhile.

    A delta plan writes only the rows changed since this store's cut of the
    parent (``row_version`` above it) plus, per table, the ids evicted since
    then (key ``r/<table>``); dense params are always written whole. The cut
    is recorded in the store under the plan's ``ckpt_id`` (a parent for later
    deltas once committed; an aborted cut is simply never named as a parent).

    Args:
        store: the shard's store.
        ckpt_dir: the checkpoint tmp dir (shared by every shard).
        shard_id: this shard's index (the file name).
        plan: full or delta; None = read ``<ckpt_dir>/plan.json`` (absent = full, no id).

    Returns:
        a summary: {"file", "kind", "rows": {table: n}, "removed": {table: n}, "dense": n, "bytes"}.

    Raises:
        DeltaUnavailable: a delta plan whose parent this store has no cut of, or
            whose removals it forgot (nothing written; retry as full).
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if plan is None:
        plan = read_plan(ckpt_dir)
    path = shard_path(ckpt_dir, shard_id)
    for stale in (path, Path(str(path) + "-lock")):
        if stale.exists():
            stale.unlink()
    # streamed under the lock: one vshard chunk in memory at a time (no copy of the tables);
    # pushes and pulls wait for the write
    with store.write_lock():
        since: int | None = None
        removed: dict[str, np.ndarray] = {}
        if plan is not None and plan.parent_id is not None:
            since = store.cut_version(plan.parent_id)
            if since is None:
                raise DeltaUnavailable(
                    f"{DELTA_UNAVAILABLE}: shard {shard_id} has no cut of parent {plan.parent} "
                    f"(id {plan.parent_id}): restarted or not restored from it; take a full checkpoint"
                )
            for name in store.tables:
                try:
                    removed[name] = store.removed_ids(name, since)
                except BadRequest as exc:
                    raise DeltaUnavailable(f"{DELTA_UNAVAILABLE}: shard {shard_id}: {exc}") from None
        cut = store.bump_version()  # rows stamped <= cut are in this checkpoint; later changes are not
        dense = store.dense.state()
        meta = _shard_meta(store, shard_id)
        meta["kind"] = "full" if since is None else "delta"
        meta["ckpt_id"] = None if plan is None else plan.ckpt_id
        meta["parent_id"] = None if plan is None else plan.parent_id
        meta["since_version"] = since
        meta["cut_version"] = cut
        if since is not None:
            meta["row_chunks"] = ROW_CHUNKS_RUNS
        if since is not None:
            for name in store.tables:
                meta["tables"][name]["delta_rows"] = store.dirty_count(name, since)
                meta["tables"][name]["removed"] = int(removed[name].shape[0])
        est = sum(t.size * (8 * 3 + t.raw_bytes_per_row()) for t in store.tables.values())
        est += sum(8 * int(r.shape[0]) for r in removed.values())
        est += sum(sum(np.asarray(a).nbytes for a in e.values()) for e in dense.values())
        try:
            _write_shard_file(store, path, meta, since, removed, dense, est)
        except (OSError, lmdb.Error) as exc:  # a full disk, an I/O error: no partial file, one line
            failed = write_failed(path, exc, "writing checkpoint shard file")  # (free space before the removal)
            _remove_partial(path)
            raise failed from None
        except BaseException:
            _remove_partial(path)
            raise
        if plan is not None:
            store.record_cut(plan.ckpt_id, cut)
    rows = {name: int(m["rows"]) for name, m in meta["tables"].items()}
    summary = {
        "file": str(path),
        "kind": meta["kind"],
        "removed": {name: int(r.shape[0]) for name, r in removed.items()},
        "rows": rows,
        "dense": len(dense),
        "bytes": path.stat().st_size,
    }
    log.info("saved shard checkpoint", extra=kv(shard=shard_id, path=str(path), kind=meta["kind"],
                                                bytes=summary["bytes"]))
    return summary


def _write_shard_file(store: ShardStore, path: Path, meta: dict[str, Any], since: int | None,
                      removed: dict[str, np.ndarray], dense: dict[str, dict[str, np.ndarray]], est: int) -> None:
    """The LMDB write of :func:`save_shard` (called under ``store.write_lock()``).

    Every chunk is packed (its crc32s taken from the rows as they are serialized) and
    then passes the write-fault hooks (:func:`write_fault`) on its way to ``txn.put``.
    Per table the rows of each vshard are counted as the store hands them over and
    written as ``n/<table>`` (vshards, rows): a restore compares them with what it reads,
    so a chunk that never reached the file, or lost rows, is found.
    """
    env = lmdb.open(str(path), subdir=False, lock=False, map_size=max(2 * est + (64 << 20), 1 << 26), sync=False)
    txn: lmdb.Transaction | None = None
    try:
        txn = env.begin(write=True)
        pending = 0

        def put(key: str, value: bytes) -> None:
            nonlocal txn, pending
            assert txn is not None
            out = _faulted(path, key, value)
            if out is None:  # (a fault hook lost this write)
                return
            txn.put(key.encode(), out)
            pending += len(out)
            if pending >= _TXN_BYTES:  # bound LMDB's dirty pages in memory
                txn.commit()
                txn = env.begin(write=True)
                pending = 0

        put("meta", json.dumps(meta).encode())
        for name in store.tables:
            if since is not None:
                put(f"r/{name}", pack_arrays({"ids": removed[name]}))
            counts = np.zeros(store.num_vshards, dtype=np.int64)
            parts = _counted(store.vshard_chunks(name, since_version=since), counts)
            if since is not None:  # a delta: runs of vshards, a few chunks per table
                parts = _vshard_runs(parts, DELTA_CHUNK_BYTES)
            for v, part in parts:
                chunk = pack_arrays(_rows_to_arrays(part))
                del part
                put(f"t/{name}/{v}", chunk)
                del chunk
            nz = np.flatnonzero(counts)
            put(f"n/{name}", pack_arrays({"vshards": nz.astype(np.int64), "rows": counts[nz]}))
        for name, entry in dense.items():
            put(f"d/{name}", pack_arrays(entry))
        txn.commit()
        txn = None
        env.sync(True)  # one fsync for the file (not one per transaction)
    except BaseException:
        if txn is not None:
            with contextlib.suppress(Exception):
                txn.abort()
        raise
    finally:
        env.close()


def _counted(parts: Iterator[tuple[int, TableRows]], counts: np.ndarray) -> Iterator[tuple[int, TableRows]]:
    """``parts`` unchanged, adding each part's row count to ``counts[vshard]`` as it passes."""
    for v, part in parts:
        counts[v] += part.ids.shape[0]
        yield v, part


def _vshard_runs(parts: Iterator[tuple[int, TableRows]], limit: int) -> Iterator[tuple[int, TableRows]]:
    """Consecutive vshard chunks joined into runs of about ``limit`` bytes: (first vshard, rows).

    Args:
        parts: (vshard, rows) in ascending vshard order (``ShardStore.vshard_chunks``).
        limit: a run is emitted once its rows reach this many bytes.
    """
    run: list[TableRows] = []
    first = -1
    size = 0
    for v, part in parts:
        if not run:
            first = v
        run.append(part)
        size += sum(a.nbytes for a in _rows_to_arrays(part).values())
        if size >= limit:
            yield first, run[0] if len(run) == 1 else TableRows.concat(run, int(part.weights.shape[1]))
            run, size = [], 0
    if run:
        yield first, run[0] if len(run) == 1 else TableRows.concat(run, int(run[0].weights.shape[1]))


def _row_chunks(path: Path, meta: dict[str, Any]) -> str:
    """A shard file's row chunk layout: "vshard" (one chunk per vshard) or "runs"."""
    layout = meta.get("row_chunks", "vshard")
    if layout not in ("vshard", ROW_CHUNKS_RUNS):
        raise CheckpointError(f"{path} key 'meta': row_chunks {layout!r}, this build reads 'vshard' or "
                              f"{ROW_CHUNKS_RUNS!r}")
    return str(layout)


def _shard_meta(store: ShardStore, shard_id: int) -> dict[str, Any]:
    """The ``meta`` record of a shard file (call under ``store.write_lock()``)."""
    return {
        "format": FORMAT,
        "shard_id": int(shard_id),
        "num_vshards": store.num_vshards,
        "seed": store.seed,
        "version": store.version,
        "tables": {
            name: {
                "dim": t.dim,
                "optimizer": t.cfg.optimizer.kind.value,
                "capacity": t.capacity,
                "rows": t.size,
                "step": t.step,
                "state": {k: [list(shape), np.dtype(dt).str] for k, (shape, dt) in t.optimizer.state_spec(t.dim).items()},
            }
            for name, t in store.tables.items()
        },
        "dense": sorted(store.dense.names()),
    }


# -- manifest / commit ---------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_meta(path: Path) -> dict[str, Any]:
    env = _open_ro(path)
    try:
        with _reading(path, "meta"), env.begin() as txn:
            raw = txn.get(b"meta")
            raw = None if raw is None else bytes(raw)
    finally:
        env.close()
    if raw is None:
        raise CheckpointError(f"{path}: key 'meta' missing (incomplete shard file)")
    try:
        meta: dict[str, Any] = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: key 'meta' is not valid json: {exc}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: key 'meta' is not a json object")
    fmt = meta.get("format", 1)
    if not isinstance(fmt, int) or not 1 <= fmt <= FORMAT:
        raise CheckpointError(f"{path} key 'meta': format {fmt!r}, this build reads 1 to {FORMAT}")
    return meta


def _checked(meta: Mapping[str, Any]) -> bool:
    """The file carries checksums (format 2): its chunks must be format 2 and ``n/<table>`` present."""
    return int(meta.get("format", 1)) >= 2


@contextlib.contextmanager
def _reading(path: Path, key: str) -> Iterator[None]:
    """LMDB's own errors while reading ``key`` of ``path`` (a damaged page, a bad node) as CheckpointError."""
    try:
        yield
    except lmdb.Error as exc:
        raise CheckpointError(f"{path} key '{key}': LMDB error {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())} (corrupt shard file)") from None


def _open_ro(path: Path) -> lmdb.Environment:
    """A shard file opened read-only, refused when shorter than LMDB's own last page says (truncated:
    reading its missing pages would fault the process, not raise)."""
    try:
        env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, readahead=False)
    except lmdb.Error as exc:
        raise CheckpointError(f"{path}: cannot open as LMDB: {exc}") from None
    try:
        need = (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
        size = path.stat().st_size
    except (lmdb.Error, OSError) as exc:
        env.close()
        raise CheckpointError(f"{path}: cannot read its LMDB header: {exc}") from None
    if size < need:
        env.close()
        raise CheckpointError(f"{path}: truncated LMDB file ({size} bytes; its last page ends at byte {need})")
    return env


def open_shard_file(path: str | Path) -> lmdb.Environment:
    """A checkpoint's shard file opened read-only (CheckpointError when it is not LMDB or is truncated)."""
    return _open_ro(Path(path))


def shard_files(ckpt_dir: str | Path) -> list[Path]:
    """``shard-*.lmdb`` files of a checkpoint dir, by shard id."""
    numbered = [(int(m.group(1)), p) for p in Path(ckpt_dir).iterdir() if (m := _SHARD_RE.match(p.name))]
    return [p for _, p in sorted(numbered, key=lambda t: t[0])]


def commit_checkpoint(tmp_dir: str | Path, info: dict[str, Any]) -> Path:
    """Seal ``<root>/ckpt-<step>.tmp`` into ``<root>/ckpt-<step>`` atomically.

    fsyncs every file, writes manifest.json (sha256 and size of each file,
    tables + dims, shard count, num_vshards, step, ``info``), then renames.

    Args:
        tmp_dir: the directory every shard saved into (name ``ckpt-<step>.tmp``).
        info: caller's data (step, DDS cursor, metrics...); ``info["step"]``, if
            given, must match the directory name.

    Returns:
        the final directory.
    """
    tmp_dir = Path(tmp_dir)
    m = _TMP_RE.match(tmp_dir.name)
    if not m:
        raise CheckpointError(f"{tmp_dir}: checkpoint tmp dir must be named ckpt-<step>.tmp")
    step = int(m.group(1))
    if "step" in info and int(info["step"]) != step:
        raise CheckpointError(f"{tmp_dir}: info step {info['step']} does not match dir step {step}")
    final = tmp_dir.with_name(f"ckpt-{step}")
    if final.exists():
        raise CheckpointError(f"{final}: already exists; refusing to overwrite a committed checkpoint")
    shards = shard_files(tmp_dir)
    if not shards:
        raise CheckpointError(f"{tmp_dir}: no shard-*.lmdb files to commit")
    metas = [_read_meta(p) for p in shards]
    plan = read_plan(tmp_dir)
    want_id = None if plan is None else plan.ckpt_id
    want_kind = "full" if plan is None else plan.kind
    for p, mm in zip(shards, metas):
        if mm.get("ckpt_id") != want_id or mm.get("kind", "full") != want_kind:
            raise CheckpointError(
                f"{p} key 'meta': written for checkpoint {mm.get('ckpt_id')} ({mm.get('kind', 'full')}), "
                f"the plan is {want_id} ({want_kind}): a stale file from another attempt"
            )
    if plan is not None and plan.parent is not None:
        parent_dir = tmp_dir.parent / plan.parent
        try:
            pman = read_manifest(parent_dir)
        except CheckpointError as exc:
            raise CheckpointError(f"{tmp_dir}: delta over {plan.parent}, which is not committed: {exc}") from None
        if pman.get("ckpt_id") != plan.parent_id:
            raise CheckpointError(f"{parent_dir / MANIFEST}: ckpt_id {pman.get('ckpt_id')}, "
                                  f"the delta was cut over {plan.parent_id}")
    vsh = {mm["num_vshards"] for mm in metas}
    if len(vsh) != 1:
        raise CheckpointError(f"{tmp_dir}: shard files disagree on num_vshards: {sorted(vsh)}")
    tables: dict[str, dict[str, Any]] = {}
    for p, mm in zip(shards, metas):
        for name, t in mm["tables"].items():
            prev = tables.get(name)
            if prev is not None and (prev["dim"], prev["optimizer"]) != (t["dim"], t["optimizer"]):
                raise CheckpointError(f"{p}: table '{name}' dim/optimizer differ from another shard's")
            entry = tables.setdefault(name, {"dim": t["dim"], "optimizer": t["optimizer"], "rows": 0})
            entry["rows"] += t["rows"]
    try:
        return _seal(tmp_dir, final, step, shards, vsh.pop(), tables, info, plan, want_kind)
    except OSError as exc:  # a full disk while sealing: the attempt is dropped whole, nothing committed
        if final.exists() and not tmp_dir.exists():
            raise  # (renamed already: committed; only the root's fsync failed)
        failed = write_failed(tmp_dir / MANIFEST, exc, "committing the checkpoint")
        abort_checkpoint(tmp_dir)
        raise failed from None


def _seal(tmp_dir: Path, final: Path, step: int, shards: list[Path], num_vshards: int,
          tables: dict[str, dict[str, Any]], info: dict[str, Any], plan: CheckpointPlan | None,
          want_kind: str) -> Path:
    """fsync + sha256 every file, write the manifest, rename ``tmp_dir`` to ``final`` (see commit_checkpoint)."""
    files = {}
    for p in sorted(tmp_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            _fsync_file(p)
            files[str(p.relative_to(tmp_dir))] = {"sha256": _sha256(p), "bytes": p.stat().st_size}
    manifest = {
        "format": FORMAT,
        "step": step,
        "created": time.time(),
        "shards": len(shards),
        "num_vshards": num_vshards,
        "tables": tables,
        "files": files,
        "info": info,
    }
    if plan is not None:
        manifest.update({"ckpt_id": plan.ckpt_id, "kind": plan.kind, "parent": plan.parent,
                         "chain": [list(c) for c in plan.chain]})
    mpath = tmp_dir / MANIFEST
    data = _faulted(mpath, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode()) or b""
    with mpath.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp_dir)
    os.rename(tmp_dir, final)
    _fsync_dir(final.parent)
    log.info("committed checkpoint", extra=kv(path=str(final), step=step, shards=len(shards), files=len(files),
                                              kind=want_kind, parent=None if plan is None else plan.parent))
    return final


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint (CheckpointError when missing or invalid)."""
    path = Path(ckpt_dir) / MANIFEST
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointNotFound(f"{path}: no manifest (not a committed checkpoint)") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: invalid json: {exc}") from None
    for key in ("format", "step", "shards", "num_vshards", "tables", "files"):
        if key not in data:
            raise CheckpointError(f"{path}: manifest lacks '{key}'")
    return data


def verify_checkpoint(ckpt_dir: str | Path, files: Sequence[str] | None = None) -> dict[str, Any]:
    """Check sha256 and size of the manifest's files (or the given subset); returns the manifest."""
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    for rel, want in manifest["files"].items():
        if files is not None and rel not in files:
            continue
        p = ckpt_dir / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: listed in the manifest but missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{p}: size {size} bytes, manifest says {want['bytes']}")
        got = _sha256(p)
        if got != want["sha256"]:
            raise CheckpointError(f"{p}: sha256 mismatch (manifest {want['sha256'][:16]}..., file {got[:16]}...)")
    return manifest


def checkpoint_chain(ckpt_dir: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """(directory, manifest) of every checkpoint a restore of ``ckpt_dir`` reads, base first.

    A full checkpoint is its own chain. A delta's manifest lists its chain
    (base .. parent, names and ids); each member must be a committed sibling
    directory whose manifest carries that id.

    Raises:
        CheckpointError: a missing member or an id mismatch (named).
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointNotFound(f"{ckpt_dir}: checkpoint directory not found (no manifest)")
    tip = read_manifest(ckpt_dir)
    if tip.get("kind", "full") == "full":
        return [(ckpt_dir, tip)]
    chain = tip.get("chain")
    if not isinstance(chain, list) or not chain:
        raise CheckpointError(f"{ckpt_dir / MANIFEST}: a delta checkpoint without its 'chain'")
    out: list[tuple[Path, dict[str, Any]]] = []
    for i, link in enumerate(chain):
        try:
            name, cid = str(link[0]), str(link[1])
        except (TypeError, IndexError, KeyError):
            raise CheckpointError(f"{ckpt_dir / MANIFEST}: key 'chain' entry {i} is not [name, ckpt_id]") from None
        d = ckpt_dir.parent / name
        try:
            man = read_manifest(d)
        except CheckpointError as exc:
            raise CheckpointError(f"{ckpt_dir}: chain member {name} is not a committed checkpoint: {exc}") from None
        if man.get("ckpt_id") != cid:
            raise CheckpointError(f"{d / MANIFEST}: ckpt_id {man.get('ckpt_id')}, the chain of {ckpt_dir.name} "
                                  f"names {cid} (replaced checkpoint)")
        if (man.get("kind", "full") == "full") != (i == 0):
            raise CheckpointError(f"{d / MANIFEST}: chain member {i} of {ckpt_dir.name} is "
                                  f"{man.get('kind', 'full')}; a chain is one full base then deltas")
        out.append((d, man))
    out.append((ckpt_dir, tip))
    return out


def verify_for_restore(ckpt_dir: str | Path) -> dict[str, Any]:
    """Everything a restore can check before it touches a shard; returns the manifest.

    For a delta checkpoint every member of its chain (base + deltas) is checked,
    all before anything is loaded: one bad file refuses the whole restore.
    Per checkpoint: the manifest is valid json with its keys; every file it lists
    exists with its size and sha256; the ``shard-*.lmdb`` files on disk are
    exactly the ones it lists, as many as its ``shards``; each shard file's
    ``meta`` agrees with the manifest's num_vshards and table dims/optimizers.

    Raises:
        CheckpointError: the first problem, naming the file (and key).
    """
    chain = checkpoint_chain(ckpt_dir)
    for d, _man in chain:
        _verify_one_for_restore(d)
    return chain[-1][1]


def _verify_one_for_restore(ckpt_dir: str | Path) -> dict[str, Any]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointNotFound(f"{ckpt_dir}: checkpoint directory not found (no manifest)")
    manifest = verify_checkpoint(ckpt_dir)
    mpath = ckpt_dir / MANIFEST
    listed = sorted(n for n in manifest["files"] if _SHARD_RE.match(n))
    on_disk = sorted(p.name for p in shard_files(ckpt_dir))
    if listed != on_disk:
        raise CheckpointError(f"{mpath}: lists shard files {listed}, the directory holds {on_disk}")
    if len(listed) != int(manifest["shards"]):
        raise CheckpointError(f"{mpath}: 'shards' is {manifest['shards']} but {len(listed)} shard files are listed")
    for name in listed:
        path = ckpt_dir / name
        meta = _read_meta(path)
        if int(meta.get("num_vshards", -1)) != int(manifest["num_vshards"]):
            raise CheckpointError(f"{path} key 'meta': num_vshards {meta.get('num_vshards')}, "
                                  f"manifest says {manifest['num_vshards']}")
        for table, tmeta in (meta.get("tables") or {}).items():
            want = manifest["tables"].get(table)
            if want is None or (want.get("dim"), want.get("optimizer")) != (tmeta.get("dim"), tmeta.get("optimizer")):
                raise CheckpointError(f"{path} key 'meta': table '{table}' dim/optimizer "
                                      f"{tmeta.get('dim')}/{tmeta.get('optimizer')} do not match the manifest's {want}")
    return manifest


def checkpoint_step(path: str | Path) -> int:
    """The step of a committed checkpoint directory, from its name ``ckpt-<step>``.

    Args:
        path: the checkpoint directory.

    Raises:
        CheckpointError: the name is not ``ckpt-<step>`` (a ``.tmp`` or foreign directory).
    """
    m = _CKPT_RE.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path}: not a committed checkpoint directory (expected ckpt-<step>)")
    return int(m.group(1))


def latest_checkpoint(root: str | Path) -> Path | None:
    """Newest committed ``ckpt-<step>`` under root with a valid manifest (``*.tmp`` ignored)."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in root.iterdir():
        m = _CKPT_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        try:
            man = read_manifest(p)
        except CheckpointError:
            continue
        if int(man["step"]) != int(m.group(1)):
            continue
        if best is None or int(m.group(1)) > best[0]:
            best = (int(m.group(1)), p)
    return None if best is None else best[1]


# -- load ----------------------------------------------------------------------------
def _shards_to_read(ckpt_dir: Path, verify: bool) -> list[Path]:
    if not ckpt_dir.is_dir():
        raise CheckpointNotFound(f"{ckpt_dir}: checkpoint directory not found (no manifest)")
    shards = shard_files(ckpt_dir)
    if verify:
        manifest = read_manifest(ckpt_dir)
        listed = [n for n in manifest["files"] if _SHARD_RE.match(Path(n).name)]
        names = {p.name for p in shards}
        missing = sorted(set(listed) - names)
        if missing:
            raise CheckpointError(f"{ckpt_dir}: shard file(s) {missing} listed in the manifest are missing")
        verify_checkpoint(ckpt_dir, files=listed)
    if not shards:
        raise CheckpointError(f"{ckpt_dir}: no shard-*.lmdb files")
    return shards


def _iter_table_chunks(path: Path, meta: Mapping[str, Any], table: str,
                       vshards: Sequence[int] | None) -> Iterator[tuple[str, TableRows]]:
    """Chunks of ``table`` in one shard file: of ``vshards`` by key, or all (None); see :func:`_table_chunks`."""
    env = _open_ro(path)
    try:
        with env.begin() as txn:
            yield from _table_chunks(txn, path, meta, table, vshards)
    finally:
        env.close()


def _all_table_chunks(txn: lmdb.Transaction, path: Path, table: str,
                      meta: Mapping[str, Any]) -> Iterator[tuple[str, TableRows]]:
    """Every ``t/<table>/<vshard>`` chunk of one open shard file, in key order: (where, rows)."""
    return _table_chunks(txn, path, meta, table, None)


def _decode_rows(raw: Any, where: str, checked: bool) -> TableRows:
    return _arrays_to_rows(unpack_arrays(raw, where, checked), where)


def _expected_counts(txn: lmdb.Transaction, path: Path, meta: Mapping[str, Any], table: str) -> np.ndarray | None:
    """Rows per vshard the file recorded for ``table`` as it wrote it (key ``n/<table>``); None for format 1."""
    if not _checked(meta):
        return None
    key = f"n/{table}"
    where = f"{path} key '{key}'"
    with _reading(path, key):
        raw = txn.get(key.encode())
    if raw is None:
        raise CheckpointError(f"{where}: missing (a format-2 shard file records the rows of every table)")
    a = unpack_arrays(raw, where, checked=True)
    nv = int(meta["num_vshards"])
    vs, rows = a.get("vshards"), a.get("rows")
    if (vs is None or rows is None or vs.dtype != np.int64 or rows.dtype != np.int64 or vs.ndim != 1
            or vs.shape != rows.shape or (vs.size and (vs.min() < 0 or vs.max() >= nv)) or (rows < 0).any()):
        raise CheckpointError(f"{where}: expected int64 [n] arrays 'vshards' (< {nv}) and 'rows' (>= 0)")
    counts = np.zeros(nv, dtype=np.int64)
    counts[vs] = rows
    tmeta = (meta.get("tables") or {}).get(table) or {}
    total = tmeta.get("delta_rows", tmeta.get("rows")) if meta.get("kind") == "delta" else tmeta.get("rows")
    if total is not None and int(counts.sum()) != int(total):
        raise CheckpointError(f"{where}: records {int(counts.sum())} rows, key 'meta' says {total}")
    return counts


def _table_chunks(txn: lmdb.Transaction, path: Path, meta: Mapping[str, Any], table: str,
                  vshards: Sequence[int] | None) -> Iterator[tuple[str, TableRows]]:
    """(where, rows) of ``table``'s chunks in one open shard file, each checked against what was written.

    Every chunk's checksums are verified (:func:`unpack_arrays`). In a format-2 file the rows
    read are also counted per vshard and compared with ``n/<table>`` (written as the store
    handed the rows over): a chunk that is missing, holds rows of another vshard, or lost or
    gained rows raises :class:`CheckpointError` naming file, key and vshard. By key
    (``vshards`` given; one chunk per vshard) each chunk is checked as it is read; reading all
    (None), the counts are compared once the last chunk was read.
    """
    checked = _checked(meta)
    want = _expected_counts(txn, path, meta, table)
    nv = int(meta["num_vshards"])
    if vshards is not None:
        for v in vshards:
            key = f"t/{table}/{int(v)}"
            with _reading(path, key):
                raw = txn.get(key.encode())
            n = 0 if want is None else int(want[int(v)])
            where = f"{path} key '{key}'"
            if raw is None:
                if n:
                    raise CheckpointError(f"{where}: chunk missing; key 'n/{table}' records {n} rows of vshard {v}")
                continue
            rows = _decode_rows(raw, where, checked)
            if want is not None:
                if len(rows) != n:
                    raise CheckpointError(f"{where}: {len(rows)} rows, key 'n/{table}' records {n} (rows lost or added)")
                if n and (vshard_of(rows.ids, nv) != int(v)).any():
                    raise CheckpointError(f"{where}: holds ids of vshards other than {v}")
            yield where, rows
        return
    got = None if want is None else np.zeros(nv, dtype=np.int64)
    prefix = f"t/{table}/".encode()
    key = prefix.decode()
    with _reading(path, key):
        cur = txn.cursor()
        found = cur.set_range(prefix)
    while found:
        with _reading(path, key):
            k = bytes(cur.key())
            if not k.startswith(prefix):
                break
            key = k.decode(errors="replace")
            raw = cur.value()
        where = f"{path} key '{key}'"
        rows = _decode_rows(raw, where, checked)
        if got is not None and len(rows):
            got += np.bincount(vshard_of(rows.ids, nv), minlength=nv)
        yield where, rows
        with _reading(path, key):
            found = cur.next()
    if got is not None and want is not None and not np.array_equal(got, want):
        v = int(np.flatnonzero(got != want)[0])
        raise CheckpointError(f"{path} key 't/{table}/...': vshard {v} has {int(got[v])} rows in its chunks, "
                              f"key 'n/{table}' records {int(want[v])} (a chunk missing or changed)")


def load_shard(
    store: ShardStore,
    ckpt_dir: str | Path,
    owned_vshards: Sequence[int],
    verify: bool = True,
) -> dict[str, int]:
    """Import the rows of ``owned_vshards`` from every shard file of a checkpoint.

    Args:
        store: the (fresh) shard store to fill.
        ckpt_dir: a committed checkpoint directory.
        owned_vshards: vshards this shard owns under the current partition map.
        verify: check the manifest's sha256 of the shard files first.

    Returns:
        rows imported per table.

    Raises:
        CheckpointError: corrupt/missing file or key, a checkpoint table the store
            lacks, or a dim/optimizer mismatch (named).
    """
    ckpt_dir = Path(ckpt_dir)
    chain = checkpoint_chain(ckpt_dir)
    files = [_shards_to_read(d, False) for d, _m in chain]  # all present before anything loads
    if verify:
        for d, _m in chain:
            _verify_one_for_restore(d)
    owned = np.unique(np.asarray(list(owned_vshards), dtype=np.int64))
    with store.write_lock():
        was_empty = all(t.size == 0 for t in store.tables.values())
        before = {name: t.size for name, t in store.tables.items()}
        for i, shards in enumerate(files):
            if i:  # a delta: its removals (ids evicted since the parent), then its changed rows
                for path in shards:
                    _apply_removals(store, path, owned)
            _import_files(store, shards, owned)
        counts = {name: t.size - before[name] for name, t in store.tables.items()}
        tip = chain[-1][1]
        if was_empty and tip.get("ckpt_id"):
            # the store now holds exactly this checkpoint's rows of its vshards: later deltas over it
            # write what changes from here
            store.record_cut(str(tip["ckpt_id"]), store.bump_version())
    log.info("loaded shard checkpoint", extra=kv(shard=store.shard_id, path=str(ckpt_dir), chain=len(chain), **counts))
    return counts


def _apply_removals(store: ShardStore, path: Path, owned: np.ndarray) -> None:
    """Drop the owned ids a delta shard file lists as removed (``r/<table>``)."""
    meta = _read_meta(path)
    env = _open_ro(path)
    try:
        with env.begin() as txn:
            for name in store.tables:
                key = f"r/{name}"
                with _reading(path, key):
                    raw = txn.get(key.encode())
                if raw is None:
                    if _checked(meta) and name in (meta.get("tables") or {}):
                        raise CheckpointError(f"{path} key '{key}': missing (a format-2 delta file lists the "
                                              f"removals of every table)")
                    continue
                ids = unpack_arrays(raw, f"{path} key '{key}'", _checked(meta)).get("ids")
                if ids is None or ids.dtype != np.int64 or ids.ndim != 1:
                    raise CheckpointError(f"{path} key '{key}': expected an int64 [n] array 'ids'")
                mine = ids[np.isin(vshard_of(ids, store.num_vshards), owned)]
                store.remove_ids(name, mine)
    finally:
        env.close()


def _import_files(store: ShardStore, shards: list[Path], owned: np.ndarray) -> None:
    """Import the owned vshards' rows of ``shards`` (one checkpoint's files) into ``store``."""
    for path in shards:
        meta = _read_meta(path)
        # by key only when each chunk is one vshard of the same partition; else read all and filter
        by_key = _row_chunks(path, meta) == "vshard" and int(meta["num_vshards"]) == store.num_vshards
        for name, tmeta in meta["tables"].items():
            t = store.tables.get(name)
            if t is None:
                raise CheckpointError(
                    f"{path}: checkpoint table '{name}' is not configured on this shard ({sorted(store.tables)})"
                )
            if (t.dim, t.cfg.optimizer.kind.value) != (tmeta["dim"], tmeta["optimizer"]):
                raise CheckpointError(
                    f"{path}: table '{name}' is dim {tmeta['dim']} / {tmeta['optimizer']} in the checkpoint, "
                    f"configured dim {t.dim} / {t.cfg.optimizer.kind.value}"
                )
            t.step = max(t.step, int(tmeta.get("step", 0)))
            chunks = _iter_table_chunks(path, meta, name, owned.tolist() if by_key else None)
            for where, rows in chunks:
                if not by_key:  # re-bucket by id (new vshard count, or runs of vshards)
                    rows = rows.take(np.nonzero(np.isin(vshard_of(rows.ids, store.num_vshards), owned))[0])
                try:
                    store.import_rows(name, rows)
                except BadRequest as exc:
                    raise CheckpointError(f"{where}: {exc}") from None


def load_dense(
    store: ShardStore,
    ckpt_dir: str | Path,
    names: Sequence[str] | None = None,
    verify: bool = True,
) -> list[str]:
    """Restore dense params (value + optimizer state) from every shard file; returns names loaded."""
    ckpt_dir = Path(ckpt_dir)
    shards = _shards_to_read(ckpt_dir, verify)
    want = None if names is None else set(names)
    loaded = []
    for path in shards:
        checked = _checked(_read_meta(path))
        env = _open_ro(path)
        try:
            with env.begin() as txn:
                with _reading(path, "d/"):
                    found = [(bytes(k).decode(errors="replace"), bytes(raw)) for k, raw in _prefixed(txn, b"d/")]
                for key, raw in found:
                    name = key[2:]
                    if want is not None and name not in want:
                        continue
                    arrays = unpack_arrays(raw, f"{path} key '{key}'", checked)
                    if "value" not in arrays:
                        raise CheckpointError(f"{path} key '{key}': dense chunk lacks 'value'")
                    try:
                        store.dense.load_state({name: arrays})
                    except BadRequest as exc:
                        raise CheckpointError(f"{path} key '{key}': {exc}") from None
                    loaded.append(name)
        finally:
            env.close()
    return loaded


def read_rows(ckpt_dir: str | Path, table: str, verify: bool = False) -> Iterator[TableRows]:
    """Every row of ``table`` across all shard files, one vshard chunk at a time.

    For a delta checkpoint the chain is resolved (base rows, minus each delta's
    removed ids, overridden by its changed rows; sorted-set numpy ops) and the
    result comes as one chunk; ``verify`` then checks every member of the chain.
    """
    ckpt_dir = Path(ckpt_dir)
    chain = checkpoint_chain(ckpt_dir)
    if len(chain) > 1:
        yield _resolved_rows(chain, table, verify)
        return
    yield from _read_rows_one(ckpt_dir, table, verify)


def _resolved_rows(chain: list[tuple[Path, dict[str, Any]]], table: str, verify: bool) -> TableRows:
    if verify:
        for d, _m in chain:
            verify_checkpoint(d)
    base = list(_read_rows_one(chain[0][0], table, False))
    dim = int(chain[0][1]["tables"][table]["dim"]) if table in chain[0][1]["tables"] else 0
    cur = TableRows.concat(base, dim) if base else None
    for d, _m in chain[1:]:
        rows, removed = read_changes(d, table)
        if cur is None:
            cur = rows
            continue
        drop = np.sort(np.concatenate([removed, rows.ids]))
        kept = cur.take(np.flatnonzero(~in_sorted(cur.ids, drop)))
        # (a delta without changed rows of this table carries no optimizer-state arrays to concat)
        cur = TableRows.concat([kept, rows], dim) if rows.ids.size else kept
    if cur is None:
        raise CheckpointError(f"{chain[-1][0]}: no table '{table}' in its chain")
    return cur


def read_changes(ckpt_dir: str | Path, table: str) -> tuple[TableRows, np.ndarray]:
    """A delta checkpoint's rows of ``table`` changed since its parent, and the ids removed since then.

    Reads only the delta's own files (no base); removed ids that are also in
    the changed rows (evicted, then back) are left out of the removals.

    Raises:
        CheckpointError: not a delta checkpoint, or a corrupt file (named).
    """
    return read_changes_tables(ckpt_dir, [table])[table]


def read_changes_tables(ckpt_dir: str | Path, tables: Sequence[str]) -> dict[str, tuple[TableRows, np.ndarray]]:
    """:func:`read_changes` of several tables in one pass: each shard file opened once.

    Returns:
        table -> (changed rows, removed ids sorted).

    Raises:
        CheckpointError: not a delta checkpoint, or a corrupt file (named).
    """
    ckpt_dir = Path(ckpt_dir)
    man = read_manifest(ckpt_dir)
    if man.get("kind", "full") != "delta":
        raise CheckpointError(f"{ckpt_dir}: not a delta checkpoint")
    parts: dict[str, list[TableRows]] = {t: [] for t in tables}
    removed: dict[str, list[np.ndarray]] = {t: [] for t in tables}
    for path in _shards_to_read(ckpt_dir, False):
        meta = _read_meta(path)
        env = _open_ro(path)
        try:
            with env.begin() as txn:
                _row_chunks(path, meta)  # either layout reads by prefix; an unknown one is refused
                for table in tables:
                    if table not in meta["tables"]:
                        raise CheckpointError(f"{path}: no table '{table}' (has {sorted(meta['tables'])})")
                    parts[table].extend(rows for _, rows in _all_table_chunks(txn, path, table, meta))
                    with _reading(path, f"r/{table}"):
                        raw_removed = txn.get(f"r/{table}".encode())
                    if raw_removed is None:
                        raise CheckpointError(f"{path}: delta shard file lacks key 'r/{table}'")
                    ids = unpack_arrays(raw_removed, f"{path} key 'r/{table}'", _checked(meta)).get("ids")
                    if ids is None or ids.dtype != np.int64 or ids.ndim != 1:
                        raise CheckpointError(f"{path} key 'r/{table}': expected an int64 [n] array 'ids'")
                    removed[table].append(ids)
        finally:
            env.close()
    out: dict[str, tuple[TableRows, np.ndarray]] = {}
    for table in tables:
        dim = int(man["tables"].get(table, {}).get("dim", 0))
        p = parts[table]
        rows = TableRows.concat(p, dim) if p else TableRows(np.zeros(0, np.int64), np.zeros((0, dim), np.float32))
        gone = _sorted_unique(np.concatenate(removed[table])) if removed[table] else np.zeros(0, np.int64)
        out[table] = (rows, gone[~in_sorted(gone, np.sort(rows.ids))])
    return out


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """Sorted unique values by sort + neighbour compare (numpy 2's hash-based unique is much slower here)."""
    a = np.sort(a)
    if a.size > 1:
        a = a[np.concatenate([[True], a[1:] != a[:-1]])]
    return a


def in_sorted(x: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """bool per element of ``x``: present in the sorted array ``ref`` (one searchsorted, no hashing)."""
    if ref.size == 0:
        return np.zeros(x.shape[0], dtype=bool)
    pos = np.searchsorted(ref, x).clip(max=ref.size - 1)
    found: np.ndarray = ref[pos] == x
    return found


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete committed checkpoints beyond the newest ``keep``, never one a kept delta needs.

    A kept delta's whole chain (its base and the deltas between) is kept too,
    whatever its age. ``*.tmp`` dirs are left alone.

    Args:
        root: the checkpoint root.
        keep: how many of the newest committed checkpoints to keep (>= 1).

    Returns:
        the directories deleted.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    found: list[tuple[int, Path, dict[str, Any]]] = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _CKPT_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        try:
            found.append((int(m.group(1)), p, read_manifest(p)))
        except CheckpointError:
            continue
    found.sort(key=lambda x: x[0])
    needed: set[str] = set()
    for _step, p, man in found[-keep:]:
        needed.add(p.name)
        needed.update(str(link[0]) for link in man.get("chain") or ())
    doomed = [p for _step, p, _man in found if p.name not in needed]
    for p in doomed:
        shutil.rmtree(p)
    if doomed:
        log.info("pruned checkpoints", extra=kv(root=str(root), deleted=len(doomed), kept=len(needed)))
    return doomed


def _read_rows_one(ckpt_dir: Path, table: str, verify: bool) -> Iterator[TableRows]:
    for path in _shards_to_read(ckpt_dir, verify):
        meta = _read_meta(path)
        if table not in meta["tables"]:
            raise CheckpointError(f"{path}: no table '{table}' (has {sorted(meta['tables'])})")
        for _where, rows in _iter_table_chunks(path, meta, table, None):
            yield rows


def _prefixed(txn: lmdb.Transaction, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of every key starting with ``prefix``, in key order."""
    cur = txn.cursor()
    if not cur.set_range(prefix):
        return
    for k, raw in cur:
        if not bytes(k).startswith(prefix):
            break
        yield bytes(k), bytes(raw)
