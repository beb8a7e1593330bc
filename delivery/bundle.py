"""The delivery bundle: on-disk format, embedding writer/reader, manifest, checksums.

A bundle is one directory, immutable once published::

    v000007/
      manifest.json     what it is (below); written last inside the staging dir
      embeddings.lmdb   one LMDB file (subdir=False, no lock file), one key space:
                          key   = table name | 0x00 | id as big-endian int64
                          value = the row, dim x fp32 (or fp16), little-endian
                        so a table's keys are contiguous and sorted by id:
                          b"item\\x00" 00..00 05 -> row of item 5
                          b"item\\x00" 00..01 2c -> row of item 300
                          b"user\\x00" 00..00 07 -> row of user 7
      index.arrow       per row written here: table, id, 64-bit fingerprint of the
                        stored row bytes (deltas diff against it; see below)
      dense.pt          the dense network as TorchScript (see delivery.dense)
      removed.arrow     delta bundles only: ids present in the parent but gone now
                        (Arrow IPC file, columns table: string, id: int64)

A *full* bundle holds every row. A *delta* bundle holds only the rows changed
since its parent version plus ``removed.arrow``; ``manifest["parent"]`` names
the parent and ``manifest["base"]`` the full bundle its chain starts from::

    v000005 (full) <- v000006 (delta) <- v000007 (delta)     LATEST = v000007

Deltas are exact: a row goes into a delta when its id is new or its stored
bytes' fingerprint differs from the parent's (``index.arrow`` of the chain).
The PS's ``last_step`` is a per-(shard, table) push counter that vshard
migration carries across shards, so a step watermark could miss changed rows;
it is recorded in the manifest for information only.

The manifest records: format, version, kind, parent, base, creation time, the
source checkpoint (path, step, row watermark), data range, training metrics,
per-table dim / rows (live rows at this version) / written / removed, dtype,
the dense network's input and head names, the schema and model config, the
sha256 of every file, and (after the gate) the holdout metrics.

Example::

    w = EmbeddingWriter(staging / EMBEDDINGS, RowDtype.FP32)
    w.write_table("user", ids_sorted, rows)
    w.close()
    r = EmbeddingReader(staging / EMBEDDINGS, {"user": 16}, RowDtype.FP32)
    found, rows = r.get("user", np.array([7, 9]))
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import logging
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import lmdb
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from delivery.config import RowDtype
from common.atomic_write import write_json_atomic
from common.config import from_mapping, to_dict
from common.errors import ConfigError, MetapsError
from common.hashing import mix64
from common.log import kv

log = logging.getLogger(__name__)

FORMAT = "metaps-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.lmdb"
DENSE = "dense.pt"
REMOVED = "removed.arrow"
INDEX = "index.arrow"
_FP_SALT = 0x6D65746170732D31  # "metaps-1"

# Rows handed to one putmulti call / held as Python bytes at once (bounds memory).
_WRITE_CHUNK = 1 << 18
_HASH_BLOCK = 1 << 22


class DeliveryError(MetapsError):
    """A delivery input or bundle is bad: missing checkpoint, corrupt file, broken chain."""


class DeliveryWriteError(DeliveryError):
    """Writing the bundle failed (a full disk, an I/O error); nothing partial was left under the
    publish root and LATEST is unchanged."""


class BundleKind(str, enum.Enum):
    FULL = "full"
    DELTA = "delta"


@dataclass(frozen=True)
class TableInfo:
    """One embedding table in a bundle.

    Args:
        dim: row length.
        rows: live rows of the table at this version (after applying the chain).
        written: rows stored in this bundle's LMDB (== rows for a full bundle).
        removed: ids listed in this bundle's removed.arrow.
    """

    dim: int
    rows: int
    written: int
    removed: int = 0

    def validate(self) -> None:
        if self.dim < 1 or min(self.rows, self.written, self.removed) < 0:
            raise ValueError(f"bad table info: dim={self.dim} rows={self.rows} written={self.written} removed={self.removed}")


@dataclass(frozen=True)
class BundleManifest:
    """The parsed ``manifest.json`` of a bundle (see the module docstring)."""

    version: str
    kind: BundleKind
    created: str
    source: dict[str, Any]
    schema: dict[str, Any]
    model: dict[str, Any]
    dtype: RowDtype
    tables: dict[str, TableInfo]
    dense: dict[str, Any]
    files: dict[str, str]
    parent: str | None = None
    base: str = ""
    data_range: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    adapt: dict[str, Any] = field(default_factory=dict)
    """The adaptation recipe (delivery.adapt): base parameters file, [meta] inner loop, unseen-id init."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def validate(self) -> None:
        if self.format != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got {self.format!r}")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version {self.format_version} is not supported (this reader: {FORMAT_VERSION})")
        if (self.kind is BundleKind.DELTA) != (self.parent is not None):
            raise ValueError(f"a {self.kind.value} bundle must {'' if self.kind is BundleKind.DELTA else 'not '}name a parent")

    @property
    def source_step(self) -> int:
        return int(self.source.get("step", -1))

    @property
    def row_watermark(self) -> int:
        """Highest ``last_step`` of any row in the source checkpoint (deltas take rows above it)."""
        return int(self.source.get("row_watermark", -1))

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def read_manifest(bundle_dir: str | Path) -> BundleManifest:
    """Parse and validate ``bundle_dir/manifest.json``.

    Raises:
        DeliveryError: missing, unparsable or invalid manifest (the path is named).
    """
    path = Path(bundle_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DeliveryError(f"{path}: bundle manifest not found (not a bundle, or a half-written one)") from None
    except json.JSONDecodeError as exc:
        raise DeliveryError(f"{path}: invalid JSON: {exc}") from None
    try:
        return from_mapping(BundleManifest, data, where=str(path))
    except ConfigError as exc:
        raise DeliveryError(str(exc)) from None


def write_manifest(bundle_dir: str | Path, manifest: BundleManifest, fsync: bool = True) -> Path:
    """Write ``manifest.json`` (via a temp file + rename, so it is whole or absent).

    Args:
        bundle_dir: the bundle (or staging) directory.
        manifest: the manifest.
        fsync: flush it to disk now; False only in a staging directory, which
            ``Publisher.publish`` fsyncs file by file before it becomes visible.
    """
    path = Path(bundle_dir) / MANIFEST
    write_json_atomic(path, manifest.to_dict(), indent=2, sort_keys=True, fsync=fsync)
    return path


# -- checksums --------------------------------------------------------------------
def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def checksum_files(bundle_dir: str | Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of every file of a bundle except the manifest itself.

    Args:
        bundle_dir: the bundle (or staging) directory.
        known: name -> sha256 of files the caller hashed from the very bytes it wrote
            (not read back); every other file is read and hashed.
    """
    d = Path(bundle_dir)
    known = known or {}
    return {p.name: known.get(p.name) or sha256_file(p)
            for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}


def verify_checksums(bundle_dir: str | Path, manifest: BundleManifest) -> list[str]:
    """Problems found comparing the files on disk with the manifest ([] = all good)."""
    d = Path(bundle_dir)
    problems = []
    for name, want in sorted(manifest.files.items()):
        p = d / name
        if not p.is_file():
            problems.append(f"{p}: file listed in the manifest is missing")
            continue
        got = sha256_file(p)
        if got != want:
            problems.append(f"{p}: checksum mismatch: manifest sha256 {want[:16]}..., file has {got[:16]}...")
    extra = sorted(p.name for p in d.iterdir() if p.is_file() and p.name != MANIFEST and p.name not in manifest.files)
    if extra:
        problems.append(f"{d}: files not listed in the manifest: {extra}")
    return problems


# -- keys ---------------------------------------------------------------------------
def table_prefix(table: str) -> bytes:
    """Key prefix of a table: its UTF-8 name and a 0x00 separator (names never contain NUL)."""
    raw = table.encode()
    if not raw or b"\x00" in raw:
        raise DeliveryError(f"table name {table!r} must be non-empty and contain no NUL byte")
    return raw + b"\x00"


def encode_keys(table: str, ids: np.ndarray) -> list[bytes]:
    """LMDB keys of ``ids`` in ``table``, built as one uint8 matrix (no per-id Python)."""
    prefix = table_prefix(table)
    ids = np.asarray(ids, dtype=np.int64)
    k = len(prefix) + 8
    buf = np.empty((ids.shape[0], k), dtype=np.uint8)
    buf[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    buf[:, len(prefix) :] = ids.astype(">i8").view(np.uint8).reshape(-1, 8)
    # A void dtype keeps trailing zero bytes ('S' would strip them).
    return buf.view(f"V{k}").ravel().tolist()


def decode_ids(joined: bytes, prefix_len: int) -> np.ndarray:
    """int64 ids from concatenated keys of one table."""
    k = prefix_len + 8
    raw = np.frombuffer(joined, dtype=np.uint8).reshape(-1, k)[:, prefix_len:]
    return np.ascontiguousarray(raw).view(">i8").ravel().astype(np.int64)


def _row_values(rows: np.ndarray, dtype: RowDtype) -> list[bytes]:
    r = np.ascontiguousarray(rows, dtype=dtype.numpy.newbyteorder("<"))
    return r.view(f"V{r.shape[1] * r.itemsize}").ravel().tolist()


def check_rows(table: str, ids: np.ndarray, rows: np.ndarray, dim: int, where: str) -> None:
    """Refuse rows that cannot go into a bundle (naming table, id, expected vs got).

    Raises:
        DeliveryError: shape mismatch, unsorted/duplicate/negative ids, NaN/inf values.
    """
    if rows.ndim != 2 or rows.shape[1] != dim:
        raise DeliveryError(f"{where}: table '{table}': expected rows of dim {dim}, got shape {tuple(rows.shape)}")
    if rows.shape[0] != ids.shape[0]:
        raise DeliveryError(f"{where}: table '{table}': {ids.shape[0]} ids but {rows.shape[0]} rows")
    if ids.size:
        if ids[0] < 0:
            raise DeliveryError(f"{where}: table '{table}': negative id {int(ids[0])}")
        bad = np.flatnonzero(np.diff(ids) <= 0)
        if bad.size:
            i = int(bad[0])
            raise DeliveryError(
                f"{where}: table '{table}': ids must be sorted and unique; id {int(ids[i + 1])} follows {int(ids[i])}"
            )
    finite = np.isfinite(rows).all(axis=1)
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise DeliveryError(
            f"{where}: table '{table}': row of id {int(ids[i])} has NaN/inf values ({int((~finite).sum())} such rows)"
        )


class EmbeddingWriter:
    """Writes sorted rows of several tables into one LMDB file with bulk ``putmulti``.

    Args:
        path: the ``embeddings.lmdb`` file to create.
        dtype: row storage type.
        map_size_gb: LMDB map ceiling (the file only grows as written).

    Example::

        w = EmbeddingWriter(d / EMBEDDINGS, RowDtype.FP16)
        w.write_table("item", np.array([3, 8]), np.ones((2, 8), np.float32))
        w.close()
    """

    def __init__(self, path: str | Path, dtype: RowDtype, map_size_gb: float = 64.0) -> None:
        self.path = Path(path)
        self.dtype = dtype
        # sync=False: the publisher fsyncs the finished file once; lock=False: one writer, no lock file.
        self._env = lmdb.open(
            str(self.path), subdir=False, map_size=int(map_size_gb * (1 << 30)), lock=False,
            sync=False, metasync=False, readahead=False, meminit=False, max_dbs=0,
        )
        self._last_prefix = b""
        self.written: dict[str, int] = {}
        self.index: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def write_table(self, table: str, ids: np.ndarray, rows: np.ndarray,
                    fingerprints: np.ndarray | None = None) -> int:
        """Write one table's rows (``ids`` sorted unique int64, ``rows`` float [n, dim]).

        Args:
            table: the table name.
            ids: sorted unique int64 ids.
            rows: float [n, dim] rows.
            fingerprints: ``row_fingerprints`` of ``rows`` as stored, when the caller
                computed them already (FP32 only: they are of the bytes written); None = here.

        Returns:
            the number of rows written.
        """
        if table in self.written:
            raise DeliveryError(f"{self.path}: table '{table}' written twice")
        ids = np.asarray(ids, dtype=np.int64)
        rows = np.asarray(rows)
        check_rows(table, ids, rows, rows.shape[1] if rows.ndim == 2 else -1, str(self.path))
        prefix = table_prefix(table)
        stored = np.ascontiguousarray(rows, dtype=self.dtype.numpy.newbyteorder("<"))
        if self.dtype is not RowDtype.FP32:
            check_rows(table, ids, stored, stored.shape[1], f"{self.path} ({self.dtype.value})")
        if fingerprints is None or self.dtype is not RowDtype.FP32 or fingerprints.shape != ids.shape:
            fingerprints = row_fingerprints(stored)
        self.index[table] = (ids, fingerprints)
        # Append mode (no B-tree search per key) only while keys arrive in global order.
        append = prefix > self._last_prefix
        self._last_prefix = max(prefix, self._last_prefix)
        n = ids.shape[0]
        for lo in range(0, n, _WRITE_CHUNK):
            hi = min(n, lo + _WRITE_CHUNK)
            keys = encode_keys(table, ids[lo:hi])
            vals = _row_values(stored[lo:hi], self.dtype)
            with self._env.begin(write=True) as txn:
                consumed, added = txn.cursor().putmulti(zip(keys, vals), dupdata=False, overwrite=True, append=append)
            if added != hi - lo:
                raise DeliveryError(f"{self.path}: table '{table}': wrote {added} of {hi - lo} rows")
        self.written[table] = n
        log.debug("table written", extra=kv(table=table, rows=n, path=self.path))
        return n

    def close(self, fsync: bool = True) -> None:
        """Flush the LMDB file and write ``index.arrow`` next to it.

        Args:
            fsync: fsync the LMDB file now; False when it is written into a staging
                directory that ``Publisher.publish`` fsyncs (one fsync per file).
        """
        self._env.sync(fsync)
        self._env.close()
        write_index(self.path.with_name(INDEX), self.index)


class EmbeddingReader:
    """Reads rows of a bundle's ``embeddings.lmdb`` (read-only, safe across threads).

    Args:
        path: the ``embeddings.lmdb`` file.
        dims: table name -> dim (from the manifest).
        dtype: the stored row type.
    """

    def __init__(self, path: str | Path, dims: dict[str, int], dtype: RowDtype) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DeliveryError(f"{self.path}: embeddings file not found")
        self.dims = dict(dims)
        self.dtype = dtype
        self._env = lmdb.open(
            str(self.path), subdir=False, readonly=True, lock=False, readahead=False, max_dbs=0,
            max_readers=1024,
        )

    def _dim(self, table: str) -> int:
        try:
            return self.dims[table]
        except KeyError:
            raise DeliveryError(f"{self.path}: unknown table '{table}'; bundle tables: {sorted(self.dims)}") from None

    def _rows(self, joined: bytes, table: str, dim: int) -> np.ndarray:
        item = self.dtype.numpy.itemsize
        if len(joined) % (dim * item):
            raise DeliveryError(
                f"{self.path}: table '{table}': stored values are not rows of dim {dim} x {self.dtype.value}"
            )
        return np.frombuffer(joined, dtype=self.dtype.numpy.newbyteorder("<")).reshape(-1, dim)

    def get(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``ids``: ``(found bool[n], rows float32[n, dim])`` (zeros where not found).

        One C-level pass: ``b"".join(map(txn.get, keys, repeat(NaN row)))`` then one
        ``np.frombuffer``. A missing key yields the NaN row, which marks it (stored
        rows are never NaN: the writer and the gate refuse them). Measured faster
        than ``cursor.getmulti`` here (py-lmdb 3.0: ~15%), which also drops misses.
        """
        dim = self._dim(table)
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return np.zeros(0, dtype=bool), np.zeros((0, dim), dtype=np.float32)
        dt = self.dtype.numpy.newbyteorder("<")
        missing = np.full(dim, np.nan, dtype=dt).tobytes()
        with self._env.begin(buffers=False) as txn:
            joined = b"".join(map(txn.get, encode_keys(table, ids), itertools.repeat(missing)))
        if len(joined) != ids.size * len(missing):
            raise DeliveryError(f"{self.path}: table '{table}': a stored value has the wrong size (expected dim {dim})")
        rows = np.frombuffer(joined, dtype=dt).reshape(-1, dim)
        found = ~np.isnan(rows[:, 0])
        out = rows.astype(np.float32)
        out[~found] = 0.0
        return found, out

    def scan(self, table: str, count: int, values: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """All ``count`` rows of a table in id order: ``(ids, rows or None)``.

        Iteration runs inside LMDB's C iterator (``islice`` + ``join``), no Python per row.
        """
        dim = self._dim(table)
        prefix = table_prefix(table)
        with self._env.begin(buffers=False) as txn:
            cur = txn.cursor()
            if count == 0 or not cur.set_range(prefix):
                return np.zeros(0, np.int64), (np.zeros((0, dim), np.float32) if values else None)
            if values:
                pairs = list(itertools.islice(cur.iternext(keys=True, values=True), count))
                keys = b"".join(map(operator.itemgetter(0), pairs))
                vals = b"".join(map(operator.itemgetter(1), pairs))
            else:
                keys = b"".join(itertools.islice(cur.iternext(keys=True, values=False), count))
        k = len(prefix) + 8
        if len(keys) != count * k or np.frombuffer(keys, np.uint8).reshape(-1, k)[-1, : len(prefix)].tobytes() != prefix:
            raise DeliveryError(f"{self.path}: table '{table}': expected {count} rows, the file holds fewer")
        ids = decode_ids(keys, len(prefix))
        if not values:
            return ids, None
        rows = self._rows(vals, table, dim)
        if rows.shape[0] != count:
            raise DeliveryError(f"{self.path}: table '{table}': a stored value has the wrong size (expected dim {dim})")
        return ids, rows.astype(np.float32)

    def entries(self) -> int:
        """Total keys in the file (all tables)."""
        with self._env.begin() as txn:
            return int(txn.stat()["entries"])

    def close(self) -> None:
        self._env.close()


# -- row fingerprints and the index --------------------------------------------------------
def row_fingerprints(rows: np.ndarray) -> np.ndarray:
    """A 64-bit fingerprint of each row's bytes (uint64 [n]), one mix per 8-byte column.

    Args:
        rows: rows as stored (fp32 or fp16, C-contiguous); dims are multiples of 4,
            so a row is a whole number of 8-byte words.
    """
    n = rows.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(n, -1)
    pad = (-raw.shape[1]) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros((n, pad), np.uint8)], axis=1)
    words = raw.view(np.uint64)
    h = np.full(n, _FP_SALT, dtype=np.uint64)
    for j in range(words.shape[1]):  # per column (dim / 2 passes), never per row
        h = mix64(h ^ words[:, j])
    return h


def write_index(path: str | Path, index: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Write ``index.arrow``: (table, id, fp) of every row written, tables in key order."""
    tables = sorted(index, key=table_prefix)
    schema = pa.schema([("table", pa.dictionary(pa.int32(), pa.string())), ("id", pa.int64()), ("fp", pa.uint64())])
    names = pa.array(tables, pa.string())
    with ipc.new_file(str(path), schema) as w:
        for i, t in enumerate(tables):
            ids, fp = index[t]
            codes = pa.array(np.full(len(ids), i, np.int32))
            w.write_batch(pa.record_batch(
                [pa.DictionaryArray.from_arrays(codes, names), pa.array(ids, pa.int64()), pa.array(fp, pa.uint64())],
                schema=schema,
            ))


def read_index(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``index.arrow`` as table -> (sorted ids, fingerprints)."""
    p = Path(path)
    try:
        with pa.memory_map(str(p)) as src:
            reader = ipc.open_file(src)
            out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
            for i in range(reader.num_record_batches):
                rb = reader.get_batch(i)
                if rb.num_rows == 0:
                    continue
                col = rb.column(0)
                t = str(col.dictionary[int(col.indices[0].as_py())])
                out[t] = (rb.column(1).to_numpy().copy(), rb.column(2).to_numpy().copy())
            return out
    except FileNotFoundError:
        raise DeliveryError(f"{p}: bundle index not found") from None
    except pa.ArrowInvalid as exc:
        raise DeliveryError(f"{p}: unreadable bundle index: {exc}") from None


# -- removed ids ----------------------------------------------------------------------
def write_removed(path: str | Path, removed: dict[str, np.ndarray]) -> None:
    """Write ``removed.arrow``: (table, id) of ids gone since the parent version."""
    tables = [t for t in sorted(removed)]
    names = pa.array(np.repeat(np.array(tables, dtype=object), [len(removed[t]) for t in tables]) if tables else [], pa.string())
    ids = pa.array(np.concatenate([np.asarray(removed[t], np.int64) for t in tables]) if tables else np.zeros(0, np.int64))
    table = pa.table({"table": names, "id": ids})
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)


def read_removed(path: str | Path) -> dict[str, np.ndarray]:
    """``removed.arrow`` as table -> sorted int64 ids ({} if the file does not exist)."""
    p = Path(path)
    if not p.exists():
        return {}
    try:
        with pa.memory_map(str(p)) as src:
            tab = ipc.open_file(src).read_all()
    except pa.ArrowInvalid as exc:
        raise DeliveryError(f"{p}: unreadable removed-ids file: {exc}") from None
    if tab.num_rows == 0:
        return {}
    names = tab.column("table").to_numpy(zero_copy_only=False)
    ids = tab.column("id").to_numpy()
    order = np.lexsort((ids, names))
    names, ids = names[order], ids[order]
    cut = np.flatnonzero(names[1:] != names[:-1]) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(names)]])
    return {str(names[s]): ids[s:e].copy() for s, e in zip(starts, ends)}


def files_in(bundle_dir: str | Path) -> Iterable[Path]:
    return (p for p in Path(bundle_dir).iterdir() if p.is_file())
