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
    t/<table>/<vshard>   one chunk: that vshard's TableRows
    d/<name>             one chunk: dense value + optimizer state

Chunk format (little-endian)::

    b"MPSC" | u32 format=1 | u32 header_len | header json | pad to 8 | buffers
    header = {"arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}

Because rows are keyed by vshard, a checkpoint taken with N shards restores
onto M shards: each new shard reads every ``shard-*.lmdb`` and imports only the
vshards it owns (rows are re-bucketed by id when num_vshards changed).

Not checkpointed: admission sketches (pending counts of not-yet-admitted ids)
and the eviction removal log; they restart empty.

Example::

    tmp = checkpoint_tmp_dir(root, step=100)
    save_shard(store, tmp, shard_id=0)            # each shard, into the same tmp dir
    final = commit_checkpoint(tmp, {"step": 100})  # once, after every shard saved
    new_store = ShardStore(...); load_shard(new_store, latest_checkpoint(root), owned_vshards)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import lmdb
import numpy as np

from metaps.core.hashing import vshard_of
from metaps.core.log import kv
from ps.embedding_table import TableRows
from ps.errors import BadRequest, CheckpointError, CheckpointNotFound

log = logging.getLogger(__name__)

MAGIC = b"MPSC"
FORMAT = 1
MANIFEST = "manifest.json"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
_TMP_RE = re.compile(r"^ckpt-(\d+)\.tmp$")
_SHARD_RE = re.compile(r"^shard-(\d+)\.lmdb$")
_HDR = struct.Struct("<4sII")
_TXN_BYTES = 64 << 20
"""A streaming save commits its LMDB write transaction every this many bytes."""


# -- chunk encoding ----------------------------------------------------------------
def pack_arrays(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Serialize named arrays as raw little-endian buffers behind a small json header."""
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
        metas.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": len(b)})
        bufs.append(b)
        pad = (-len(b)) % 8
        if pad:
            bufs.append(b"\0" * pad)
        offset += len(b) + pad
    header = json.dumps({"arrays": metas}).encode()
    head = _HDR.pack(MAGIC, FORMAT, len(header)) + header
    head += b"\0" * ((-len(head)) % 8)
    return head + b"".join(bufs)


def unpack_arrays(buf: bytes | memoryview, where: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_arrays`; ``where`` names file and key in errors."""
    buf = memoryview(buf)
    if len(buf) < _HDR.size:
        raise CheckpointError(f"{where}: chunk truncated ({len(buf)} bytes)")
    magic, fmt, hlen = _HDR.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CheckpointError(f"{where}: bad chunk magic {bytes(magic)!r}, expected {MAGIC!r}")
    if fmt != FORMAT:
        raise CheckpointError(f"{where}: chunk format {fmt}, this build reads {FORMAT}")
    start = _HDR.size + hlen
    try:
        header = json.loads(bytes(buf[_HDR.size : start]))
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
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: malformed array entry {str(m)[:120]} in the chunk header: {exc}") from None
        if hi > len(buf) or lo < base or min(shape, default=0) < 0:
            raise CheckpointError(f"{where}: array '{m.get('name')}' runs past the chunk end ({hi} > {len(buf)})")
        if int(np.prod(shape)) * dt.itemsize != int(m["nbytes"]):
            raise CheckpointError(f"{where}: array '{m['name']}' size does not match shape {shape} {dt}")
        out[m["name"]] = np.frombuffer(buf[lo:hi], dtype=dt).reshape(shape).copy()
    return out


def _rows_to_arrays(rows: TableRows) -> dict[str, np.ndarray]:
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


# -- save ----------------------------------------------------------------------------
def checkpoint_tmp_dir(root: str | Path, step: int) -> Path:
    """Create (if needed) and return ``<root>/ckpt-<step>.tmp``."""
    p = Path(root) / f"ckpt-{int(step)}.tmp"
    p.mkdir(parents=True, exist_ok=True)
    return p


def shard_path(ckpt_dir: str | Path, shard_id: int) -> Path:
    return Path(ckpt_dir) / f"shard-{int(shard_id)}.lmdb"


def save_shard(store: "ShardStore", ckpt_dir: str | Path, shard_id: int) -> dict:  # noqa: F821
    """Write this shard's tables and dense params into ``<ckpt_dir>/shard-<K>.lmdb``.

    Streamed: under ``store.write_lock()`` (a consistent cut) every table is
    written one vshard chunk at a time (``ShardStore.vshard_chunks``), committing
    the LMDB transaction every ``_TXN_BYTES``, so the extra memory is one chunk
    plus a row index, never a copy of the tables; pulls and pushes wait meanwhile.

    Returns:
        a summary: {"file", "rows": {table: n}, "dense": n, "bytes"}.
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = shard_path(ckpt_dir, shard_id)
    for stale in (path, Path(str(path) + "-lock")):
        if stale.exists():
            stale.unlink()
    # streamed under the lock: one vshard chunk in memory at a time (no copy of the tables);
    # pushes and pulls wait for the write
    with store.write_lock():
        dense = store.dense.state()
        meta = _shard_meta(store, shard_id)
        est = sum(t.size * (8 * 3 + t.raw_bytes_per_row()) for t in store.tables.values())
        est += sum(sum(np.asarray(a).nbytes for a in e.values()) for e in dense.values())
        env = lmdb.open(str(path), subdir=False, lock=False, map_size=max(2 * est + (64 << 20), 1 << 26), sync=False)
        try:
            txn = env.begin(write=True)
            pending = 0
            txn.put(b"meta", json.dumps(meta).encode())
            for name in store.tables:
                for v, part in store.vshard_chunks(name):
                    chunk = pack_arrays(_rows_to_arrays(part))
                    del part
                    txn.put(f"t/{name}/{v}".encode(), chunk)
                    pending += len(chunk)
                    del chunk
                    if pending >= _TXN_BYTES:  # bound LMDB's dirty pages in memory
                        txn.commit()
                        txn = env.begin(write=True)
                        pending = 0
            for name, entry in dense.items():
                txn.put(f"d/{name}".encode(), pack_arrays(entry))
            txn.commit()
            env.sync(True)  # one fsync for the file (not one per transaction)
        except BaseException:
            with contextlib.suppress(Exception):
                txn.abort()
            raise
        finally:
            env.close()
    rows = {name: int(m["rows"]) for name, m in meta["tables"].items()}
    summary = {
        "file": str(path),
        "rows": rows,
        "dense": len(dense),
        "bytes": path.stat().st_size,
    }
    log.info("saved shard checkpoint", extra=kv(shard=shard_id, path=str(path), bytes=summary["bytes"]))
    return summary


def _shard_meta(store: "ShardStore", shard_id: int) -> dict:  # noqa: F821
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


def _read_meta(path: Path) -> dict:
    env = _open_ro(path)
    try:
        with env.begin() as txn:
            raw = txn.get(b"meta")
    finally:
        env.close()
    if raw is None:
        raise CheckpointError(f"{path}: key 'meta' missing (incomplete shard file)")
    try:
        return json.loads(bytes(raw))
    except ValueError as exc:
        raise CheckpointError(f"{path}: key 'meta' is not valid json: {exc}") from None


def _open_ro(path: Path) -> lmdb.Environment:
    try:
        return lmdb.open(str(path), subdir=False, readonly=True, lock=False, readahead=False)
    except lmdb.Error as exc:
        raise CheckpointError(f"{path}: cannot open as LMDB: {exc}") from None


def shard_files(ckpt_dir: str | Path) -> list[Path]:
    """``shard-*.lmdb`` files of a checkpoint dir, by shard id."""
    files = [p for p in Path(ckpt_dir).iterdir() if _SHARD_RE.match(p.name)]
    return sorted(files, key=lambda p: int(_SHARD_RE.match(p.name).group(1)))


def commit_checkpoint(tmp_dir: str | Path, info: dict) -> Path:
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
    vsh = {mm["num_vshards"] for mm in metas}
    if len(vsh) != 1:
        raise CheckpointError(f"{tmp_dir}: shard files disagree on num_vshards: {sorted(vsh)}")
    tables: dict[str, dict] = {}
    for p, mm in zip(shards, metas):
        for name, t in mm["tables"].items():
            prev = tables.get(name)
            if prev is not None and (prev["dim"], prev["optimizer"]) != (t["dim"], t["optimizer"]):
                raise CheckpointError(f"{p}: table '{name}' dim/optimizer differ from another shard's")
            entry = tables.setdefault(name, {"dim": t["dim"], "optimizer": t["optimizer"], "rows": 0})
            entry["rows"] += t["rows"]
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
        "num_vshards": vsh.pop(),
        "tables": tables,
        "files": files,
        "info": info,
    }
    mpath = tmp_dir / MANIFEST
    with mpath.open("w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp_dir)
    os.rename(tmp_dir, final)
    _fsync_dir(final.parent)
    log.info("committed checkpoint", extra=kv(path=str(final), step=step, shards=len(shards), files=len(files)))
    return final


def read_manifest(ckpt_dir: str | Path) -> dict:
    """The manifest of a committed checkpoint (CheckpointError when missing or invalid)."""
    path = Path(ckpt_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointNotFound(f"{path}: no manifest (not a committed checkpoint)") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: invalid json: {exc}") from None
    for key in ("format", "step", "shards", "num_vshards", "tables", "files"):
        if key not in data:
            raise CheckpointError(f"{path}: manifest lacks '{key}'")
    return data


def verify_checkpoint(ckpt_dir: str | Path, files: Sequence[str] | None = None) -> dict:
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


def verify_for_restore(ckpt_dir: str | Path) -> dict:
    """Everything a restore can check before it touches a shard; returns the manifest.

    The manifest is valid json with its keys; every file it lists exists with
    its size and sha256; the ``shard-*.lmdb`` files on disk are exactly the ones
    it lists, as many as its ``shards``; each shard file's ``meta`` agrees with
    the manifest's num_vshards and table dims/optimizers.

    Raises:
        CheckpointError: the first problem, naming the file (and key).
    """
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


def _iter_table_chunks(path: Path, table: str, vshards: Sequence[int] | None) -> Iterator[tuple[str, TableRows]]:
    env = _open_ro(path)
    try:
        with env.begin() as txn:
            if vshards is not None:
                for v in vshards:
                    key = f"t/{table}/{int(v)}"
                    raw = txn.get(key.encode())
                    if raw is not None:
                        where = f"{path} key '{key}'"
                        yield where, _arrays_to_rows(unpack_arrays(raw, where), where)
            else:
                prefix = f"t/{table}/".encode()
                cur = txn.cursor()
                if cur.set_range(prefix):
                    for k, raw in cur:
                        if not bytes(k).startswith(prefix):
                            break
                        where = f"{path} key '{bytes(k).decode()}'"
                        yield where, _arrays_to_rows(unpack_arrays(raw, where), where)
    finally:
        env.close()


def load_shard(
    store: "ShardStore",  # noqa: F821
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
    shards = _shards_to_read(ckpt_dir, verify)
    owned = np.unique(np.asarray(list(owned_vshards), dtype=np.int64))
    counts = {name: 0 for name in store.tables}
    with store.write_lock():
        for path in shards:
            meta = _read_meta(path)
            same_v = int(meta["num_vshards"]) == store.num_vshards
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
                chunks = _iter_table_chunks(path, name, owned.tolist() if same_v else None)
                for where, rows in chunks:
                    if not same_v:  # re-bucket by id under the new vshard count
                        rows = rows.take(np.nonzero(np.isin(vshard_of(rows.ids, store.num_vshards), owned))[0])
                    try:
                        store.import_rows(name, rows)
                    except BadRequest as exc:
                        raise CheckpointError(f"{where}: {exc}") from None
                    counts[name] += len(rows)
    log.info("loaded shard checkpoint", extra=kv(shard=store.shard_id, path=str(ckpt_dir), **counts))
    return counts


def load_dense(
    store: "ShardStore",  # noqa: F821
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
        env = _open_ro(path)
        try:
            with env.begin() as txn:
                cur = txn.cursor()
                if not cur.set_range(b"d/"):
                    continue
                for k, raw in cur:
                    key = bytes(k).decode()
                    if not key.startswith("d/"):
                        break
                    name = key[2:]
                    if want is not None and name not in want:
                        continue
                    arrays = unpack_arrays(raw, f"{path} key '{key}'")
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
    """Every row of ``table`` across all shard files, one vshard chunk at a time."""
    ckpt_dir = Path(ckpt_dir)
    for path in _shards_to_read(ckpt_dir, verify):
        meta = _read_meta(path)
        if table not in meta["tables"]:
            raise CheckpointError(f"{path}: no table '{table}' (has {sorted(meta['tables'])})")
        for _where, rows in _iter_table_chunks(path, table, None):
            yield rows
