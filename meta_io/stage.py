"""``metaps meta-io stage``: copy a built Meta-IO dataset between a data source URI and a folder.

The per-role-volume Kubernetes variant keeps built datasets at a data source
URI (``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``, ``file:///abs/path``
or a plain path). The data Job builds into its own scratch volume and uploads
(local -> URI); each worker pod copies the dataset into its own volume before
training (URI -> local); the controller copies only the metadata it reads batch
counts from (``--metadata-only``: ``manifest.json`` + ``index.arrow``).

How a stage goes (:func:`stage_dataset`):

1. Resolve SRC and DST with ``pyarrow.fs.FileSystem.from_uri`` (a plain path is
   made absolute and opened as the local filesystem). A scheme pyarrow cannot
   open is a one-line :class:`ConfigError` naming the scheme.
2. Read SRC's ``manifest.json`` (with ``wait_s`` > 0: poll for it, backing off
   from 0.2 s to every 2 s, a log line every ~30 s). The files to copy are what
   the manifest lists -- ``index.arrow``, every ``files`` / ``leftover_files``
   entry's ``name`` and ``ids`` sidecar -- never a listing of SRC (an object
   store has no cheap glob, and stray files must not travel). The expected size
   of each is the manifest's (``bytes``, ``ids_bytes``, ``index_bytes``); one
   ``get_file_info`` call checks SRC holds exactly those sizes before a byte is
   copied.
3. Copy each file as a stream (4 MiB reads), data files first, the index, and
   ``manifest.json`` LAST, so a reader that gates on the manifest never sees
   half a dataset (an object store has no rename). Each copied file's size must
   equal the expected size (:class:`DataError` naming the file, expected vs got).
4. A LOCAL destination is written into a sibling ``DST.staging-<random>``
   folder, verified, then renamed into place (``os.replace`` of the folder):
   a full copy is checked byte for byte against the build's checksums
   (:func:`meta_io.inspect.inspect_dataset` ``verify=True``); a metadata-only
   copy checks the index's crc32 against the manifest (a dataset built before
   checksums is checked by size only, with a warning). Any failure removes the
   staging folder and leaves DST as it was. A live stage holds a ``flock`` on its
   staging folder; one that no process holds (a stage killed by SIGKILL or the
   OOM killer) is removed by the next stage to the same DST. A remote destination is written in
   place (manifest last); on failure the files this stage wrote are deleted
   (best effort, the manifest first if it got written).

An existing DST holding a ``manifest.json`` byte-identical to SRC's is already
staged when (locally) every file this stage would copy is there at its size: nothing
is copied (``skipped=True``); with files missing (a metadata-only copy, then a full
stage) the same dataset is completed, no ``overwrite`` needed. An existing local DST
with anything else in it, or a remote DST with a different manifest, is refused unless
``overwrite=True`` (a local DST is then swapped for the new copy after it
verified; a remote DST loses its manifest first, and old files the new manifest
does not list stay behind, unread). An empty existing local folder is simply
replaced. DST must not be a mount point itself
(a folder cannot be renamed onto one): stage into a folder under the mount.

Example::

    r = stage_dataset("s3://bucket/metaio/2026-12-01", "/data/metaio", wait_s=600)
    r.files, r.bytes, r.skipped     # (7, 123456789, False)
    metaps meta-io stage --from s3://bucket/metaio --to /data/metaio --wait 600 --done-file /data/staged.json
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from meta_io import layout as L
from meta_io import integrity
from common.errors import ConfigError, DataError
from common.log import kv

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
"""Bytes per read while copying a file (a stream; no whole-file reads)."""
POLL_MAX_S = 2.0
"""Longest pause between two looks for SRC's manifest while waiting."""
POLL_LOG_S = 30.0
"""A log line about the wait at most this often."""
STAGING_INFIX = ".staging-"


@dataclass(frozen=True)
class StageResult:
    """What one stage did.

    Args:
        files: files copied (0 when skipped).
        bytes: bytes copied (0 when skipped).
        seconds: wall time of the stage, waiting included.
        skipped: DST already held this dataset (byte-identical manifest, every file at its size):
            nothing copied.
        src: the source as given.
        dst: the destination as given (a local path: made absolute).
    """

    files: int
    bytes: int
    seconds: float
    skipped: bool
    src: str
    dst: str


@dataclass(frozen=True)
class _Location:
    """A resolved SRC or DST: its filesystem, the dataset folder's path in it, and how it was given."""

    fs: pafs.FileSystem
    path: str
    given: str
    local: bool

    def join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def show(self, name: str = "") -> str:
        """``given/name`` for error messages (the URI or path as the user wrote it)."""
        return f"{self.given.rstrip('/')}/{name}" if name else self.given


def _resolve(where: str, given: str) -> _Location:
    """Open ``given`` (a URI or a local path) with pyarrow.

    Args:
        where: ``--from`` or ``--to`` (named in errors).
        given: the URI or path.

    Raises:
        ConfigError: empty, or a scheme pyarrow cannot open (one line naming it).
    """
    if not given:
        raise ConfigError(f"meta-io stage: {where} is empty; expected a URI (s3://, gs://, hdfs://, file://) or a path")
    if "://" not in given:
        path = os.path.abspath(given)
        return _Location(pafs.LocalFileSystem(), path, path, True)
    scheme = given.split("://", 1)[0]
    try:
        fs, path = pafs.FileSystem.from_uri(given)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ConfigError(f"meta-io stage: {where} {given}: cannot open scheme '{scheme}://': "
                          f"{_first_line(exc)}") from None
    return _Location(fs, path, given, isinstance(fs, pafs.LocalFileSystem))


def _first_line(exc: BaseException) -> str:
    """The first line of an error (pyarrow's HDFS errors run to dozens of lines)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _read_small(loc: _Location, name: str) -> bytes:
    with loc.fs.open_input_stream(loc.join(name), compression=None) as fh:
        return bytes(fh.read())


def _exists(loc: _Location, name: str) -> bool:
    return bool(loc.fs.get_file_info(loc.join(name)).type == pafs.FileType.File)


def _wait_for_manifest(src: _Location, wait_s: float) -> None:
    """Return once SRC's manifest exists; DataError naming SRC after ``wait_s`` seconds."""
    t0 = time.monotonic()
    last_log = t0
    pause = 0.2
    while not _exists(src, L.MANIFEST_NAME):
        now = time.monotonic()
        if now - t0 >= wait_s:
            how = f"after waiting {wait_s:g} s" if wait_s > 0 else "(no --wait given)"
            raise DataError(f"{src.show(L.MANIFEST_NAME)}: manifest not found {how}: {src.given} holds no "
                            "complete Meta-IO dataset (a build writes its manifest last)")
        if now - last_log >= POLL_LOG_S:
            log.info("waiting for the dataset manifest", extra=kv(src=src.given, waited_s=round(now - t0, 1),
                                                                   wait_s=wait_s))
            last_log = now
        time.sleep(min(pause, max(0.0, wait_s - (now - t0))))
        pause = min(POLL_MAX_S, pause * 2)


def _file_plan(src: _Location, raw: bytes, metadata_only: bool) -> list[tuple[str, int | None]]:
    """(file name, expected bytes or None) to copy, in copy order: data files, index, manifest LAST.

    Args:
        src: the source (named in errors).
        raw: SRC's manifest bytes.
        metadata_only: only the index and the manifest.
    """
    where = src.show(L.MANIFEST_NAME)
    try:
        m = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{where}: corrupt manifest: {exc}") from None
    if not isinstance(m, dict) or m.get("format") != "metaio":
        raise DataError(f"{where}: not a Meta-IO manifest (no \"format\": \"metaio\")")
    plan: list[tuple[str, int | None]] = []
    try:
        if not metadata_only:
            for f in list(m["files"]) + list(m.get("leftover_files", [])):
                plan.append((_plain_name(where, f["name"]), int(f["bytes"])))
                if f.get("ids"):
                    plan.append((_plain_name(where, f["ids"]), int(f["ids_bytes"])))
        index_bytes = m.get("index_bytes")
        plan.append((L.INDEX_NAME, int(index_bytes) if index_bytes is not None else None))
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{where}: malformed manifest file entry: {exc!r}") from None
    plan.append((L.MANIFEST_NAME, len(raw)))
    return plan


def _plain_name(where: str, name: Any) -> str:
    """A file name from the manifest: a bare name (no folder, no ``..``), or DataError."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise DataError(f"{where}: manifest lists file {name!r}; expected a bare file name")
    return name


def _check_source_sizes(src: _Location, plan: list[tuple[str, int | None]]) -> list[tuple[str, int]]:
    """One ``get_file_info`` over every file: present, and the size the manifest says. Returns (name, size)."""
    infos = src.fs.get_file_info([src.join(n) for n, _ in plan])
    out = []
    for (name, want), info in zip(plan, infos):
        if info.type != pafs.FileType.File:
            raise DataError(f"{src.show(name)}: listed in the manifest but missing from the source")
        size = int(info.size)
        if want is not None and size != want:
            raise DataError(f"{src.show(name)}: truncated or modified at the source: {size} bytes, "
                            f"manifest says {want}")
        out.append((name, size))
    return out


def _copy_file(src: _Location, dst_fs: pafs.FileSystem, dst_path: str, name: str, want: int) -> int:
    """Stream one file SRC -> ``dst_path`` in :data:`CHUNK_BYTES` reads; returns the bytes written."""
    n = 0
    try:
        with src.fs.open_input_stream(src.join(name), compression=None) as fin, \
                dst_fs.open_output_stream(dst_path, compression=None) as fout:
            while True:
                buf = fin.read(CHUNK_BYTES)
                if not buf:
                    break
                fout.write(buf)
                n += len(buf)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{src.show(name)} -> {dst_path}: copy failed: {_first_line(exc)}") from None
    if n != want:
        raise DataError(f"{src.show(name)}: copied {n} bytes, expected {want} (the source changed or the read "
                        "was cut short)")
    return n


def _copy_all(src: _Location, dst_fs: pafs.FileSystem, dst_root: str, files: list[tuple[str, int]],
              written: list[str]) -> int:
    """Copy ``files`` in order (the manifest is last in it), checking each copy's size at the destination.

    Args:
        written: appended with each destination path as it is created (for cleanup on failure).

    Returns:
        bytes copied.
    """
    total = 0
    for name, size in files:
        path = f"{dst_root.rstrip('/')}/{name}"
        written.append(path)
        total += _copy_file(src, dst_fs, path, name, size)
        info = dst_fs.get_file_info(path)  # as the destination sees it, before the next file (the manifest last)
        got = int(info.size) if info.type == pafs.FileType.File else -1
        if got != size:
            raise DataError(f"{path}: copy of {src.show(name)} has {got} bytes, expected {size}")
        log.debug("copied", extra=kv(file=name, bytes=size))
    return total


def _verify_local(folder: Path, raw_manifest: bytes, metadata_only: bool) -> None:
    """Check a local copy before it is renamed into place (DataError naming the file)."""
    m = json.loads(raw_manifest)
    if integrity.MANIFEST_KEY not in m:  # an older dataset: the sizes were all there was to check
        log.warning("dataset has no checksums (built by an older metaps): staged copy checked by size only",
                    extra=kv(dataset=str(folder)))
        return
    if metadata_only:
        integrity.check_whole_file(folder / L.INDEX_NAME, int(m["index_crc32"]), int(m["index_bytes"]), "index file")
        return
    from meta_io.inspect import inspect_dataset

    problems = inspect_dataset(folder, verify=True)["problems"]
    if problems:
        raise DataError(f"{problems[0]}"
                        + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))


def _local_dst_state(dst: Path, raw: bytes, files: list[tuple[str, int]], overwrite: bool) -> str:
    """``absent`` | ``empty`` | ``same`` | ``replace``; ConfigError when DST holds another dataset and not overwrite.

    ``same``: DST's manifest is byte-identical to SRC's and every file this stage would copy is
    there at its size. The same manifest with files missing (a metadata-only copy, when the
    whole dataset is asked for) is the same dataset in part: replaced, no ``overwrite`` needed.
    """
    if not dst.exists():
        return "absent"
    if not dst.is_dir():
        raise ConfigError(f"meta-io stage: --to {dst} exists and is not a folder")
    manifest = dst / L.MANIFEST_NAME
    if manifest.is_file() and manifest.read_bytes() == raw:
        whole = all((dst / n).is_file() and (dst / n).stat().st_size == size for n, size in files)
        return "same" if whole else "replace"
    if not any(dst.iterdir()):
        return "empty"
    if not overwrite:
        what = "a different Meta-IO dataset" if manifest.is_file() else "files but no Meta-IO manifest"
        raise ConfigError(f"meta-io stage: --to {dst} already holds {what}; pass --overwrite to replace it")
    return "replace"


def _stage_local(src: _Location, dst: Path, files: list[tuple[str, int]], raw: bytes, metadata_only: bool,
                 state: str) -> int:
    """Copy into ``DST.staging-<random>``, verify, rename into place; the staging folder never outlives a failure."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(dst)
    staging = dst.with_name(f"{dst.name}{STAGING_INFIX}{secrets.token_hex(4)}")
    staging.mkdir()
    lock = _lock(staging)
    old: Path | None = None
    try:
        total = _copy_all(src, pafs.LocalFileSystem(), str(staging), files, [])
        try:
            _verify_local(staging, raw, metadata_only)
        except DataError as exc:  # name the source's file: the staging folder is about to go
            raise DataError(str(exc).replace(str(staging), f"copy of {src.given.rstrip('/')}")) from None
        if state == "replace":  # move the old dataset aside, swap, then drop it
            old = dst.with_name(f"{dst.name}.old-{secrets.token_hex(4)}")
            os.replace(dst, old)
        os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and not dst.exists():
            os.replace(old, dst)  # the swap failed: put the previous dataset back
            old = None
        raise
    finally:
        if lock is not None:
            os.close(lock)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return total


def _lock(folder: Path) -> int | None:
    """An exclusive ``flock`` on ``folder`` (held while this stage owns it); None where locks are unsupported."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_stale_staging(dst: Path) -> None:
    """Remove ``DST.staging-*`` folders no live stage holds: what a killed stage (SIGKILL, OOM) left.

    A restarted init container would otherwise need room for two copies on a
    volume sized for one. A folder whose lock cannot be taken (a stage running
    now, or a filesystem without ``flock``) is left alone.
    """
    for p in dst.parent.glob(glob.escape(dst.name) + STAGING_INFIX + "*"):
        fd = _lock(p) if p.is_dir() else None
        if fd is None:
            continue
        try:
            shutil.rmtree(p, ignore_errors=True)
        finally:
            os.close(fd)
        log.warning("removed a staging folder left by an earlier stage that did not finish",
                    extra=kv(folder=str(p)))


def _stage_remote(src: _Location, dst: _Location, files: list[tuple[str, int]], raw: bytes,
                  overwrite: bool) -> tuple[int, bool]:
    """Write in place at a non-local DST, manifest last; returns (bytes, skipped)."""
    if _exists(dst, L.MANIFEST_NAME):
        if _read_small(dst, L.MANIFEST_NAME) == raw:
            return 0, True
        if not overwrite:
            raise ConfigError(f"meta-io stage: --to {dst.given} already holds a different Meta-IO dataset; "
                              "pass --overwrite to replace it")
        dst.fs.delete_file(dst.join(L.MANIFEST_NAME))  # from now on DST never looks complete until we finish
    if dst.path.strip("/"):
        dst.fs.create_dir(dst.path, recursive=True)
    written: list[str] = []
    try:
        return _copy_all(src, dst.fs, dst.path, files, written), False
    except BaseException:
        for p in reversed(written):  # the manifest (last) first, so a half copy never looks complete
            try:
                dst.fs.delete_file(p)
            except (OSError, pa.ArrowException):
                log.warning("could not remove a partial copy", extra=kv(file=p))
        raise


def stage_dataset(src: str, dst: str, *, metadata_only: bool = False, wait_s: float = 0.0,
                  overwrite: bool = False) -> StageResult:
    """Copy the Meta-IO dataset at ``src`` to ``dst`` (either may be a URI or a local path).

    Args:
        src: data source: ``s3://...``, ``gs://...``, ``hdfs://...``, ``file:///abs`` or a path.
        dst: destination, same forms; a local one is staged aside and renamed into place.
        metadata_only: copy ``manifest.json`` and ``index.arrow`` only (what the controller reads).
        wait_s: wait up to this many seconds for SRC's manifest to appear (0: fail at once).
        overwrite: replace a different dataset already at ``dst``.

    Returns:
        a :class:`StageResult`.

    Raises:
        ConfigError: a bad argument, a scheme pyarrow cannot open, DST holding another dataset.
        DataError: SRC incomplete, missing, malformed or corrupt; a copy of the wrong size.
    """
    if wait_s < 0:
        raise ConfigError(f"meta-io stage: --wait must be >= 0 seconds, got {wait_s}")
    t0 = time.monotonic()
    s, d = _resolve("--from", src), _resolve("--to", dst)
    try:
        return _stage(s, d, metadata_only, wait_s, overwrite, t0)
    except (OSError, pa.ArrowException) as exc:  # a filesystem call outside a file copy (listing, HEAD, mkdir)
        raise DataError(f"meta-io stage {s.given} -> {d.given}: {_first_line(exc)}") from None


def _stage(s: _Location, d: _Location, metadata_only: bool, wait_s: float, overwrite: bool,
           t0: float) -> StageResult:
    log.info("stage start", extra=kv(src=s.given, dst=d.given, metadata_only=metadata_only, wait_s=wait_s))
    _wait_for_manifest(s, wait_s)
    raw = _read_small(s, L.MANIFEST_NAME)
    files = _check_source_sizes(s, _file_plan(s, raw, metadata_only))
    if d.local:
        dpath = Path(d.path)
        state = _local_dst_state(dpath, raw, files, overwrite)
        skipped = state == "same"
        total = 0 if skipped else _stage_local(s, dpath, files, raw, metadata_only, state)
    else:
        total, skipped = _stage_remote(s, d, files, raw, overwrite)
    res = StageResult(files=0 if skipped else len(files), bytes=total, seconds=round(time.monotonic() - t0, 3),
                      skipped=skipped, src=s.given, dst=d.given)
    log.info("stage done", extra=kv(src=res.src, dst=res.dst, files=res.files, bytes=res.bytes,
                                    seconds=res.seconds, skipped=res.skipped))
    return res
