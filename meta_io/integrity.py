"""Content checksums of a Meta-IO dataset: computed by the build, checked by the reader and ``inspect --verify``.

What is covered (algorithm: CRC-32, ``zlib.crc32``, ~1 GB/s here and it
releases the GIL, so the prefetch thread checks while the consumer computes)::

    index.arrow, per record batch     crc32 of the batch's bytes in its file (Arrow IPC
                                      message: metadata + body; the first batch's range
                                      also covers the file magic and the schema message)
        byte_offset, byte_length, crc32            data file (part-*, leftover-*)
        ids_byte_offset, ids_byte_length, ids_crc32   its unique-ids sidecar
    manifest.json, per file           frame_crc32 / ids_frame_crc32: every byte not inside
                                      a batch range (the IPC footer and trailing magic)
    manifest.json                     index_crc32 + index_bytes: the whole index file

So every byte of every data file, sidecar and the index is under exactly one
checksum. Checking:

* the reader (cheap): the index and each file's frame when the file is opened,
  each record batch the first time it is read (a per-file bitmap remembers
  which batches passed, so later epochs pay nothing);
* ``metaps meta-io inspect --verify`` (full): every byte of every file;
* the preflight of ``metaps launch``: sizes and frames of every file (no batch reads).

A dataset built before checksums existed (no ``checksums`` key in its
manifest) still reads, with one warning per open: corruption there is only
caught when it breaks the Arrow format. ``inspect --verify`` reports it as a
problem (nothing can be verified); rebuild the dataset to get checksums.

Example::

    frame_gaps([(0, 360), (360, 232)], size=1058)    # [(592, 466)]: the footer
    checker = BatchChecker(path, offsets, lengths, crcs, frame_crc)
    checker.check_frame(); checker.check(3)          # DataError naming the file and batch 3
"""

from __future__ import annotations

import mmap
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from common.errors import DataError

ALGO = "crc32"
MANIFEST_KEY = "checksums"
"""Manifest key whose presence means the dataset carries checksums: ``{"algo": "crc32", ...}``."""

MANIFEST_VALUE = {
    "algo": ALGO,
    "per_batch": "index columns byte_offset, byte_length, crc32 (+ ids_*) of every record batch",
    "per_file": "manifest files[].frame_crc32 / ids_frame_crc32: bytes outside the batch ranges",
    "index": "manifest index_crc32 / index_bytes",
}


def crc32_of(buf: memoryview | bytes, offset: int = 0, length: int | None = None) -> int:
    """CRC-32 (unsigned) of ``buf[offset:offset+length]`` (zero-copy on a memoryview)."""
    end = len(buf) if length is None else offset + length
    return zlib.crc32(buf[offset:end]) & 0xFFFFFFFF


def frame_gaps(ranges: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` pieces of ``[0, size)`` outside every batch range, in order.

    Args:
        ranges: ``(offset, length)`` of each record batch, in file order.
        size: the file size.
    """
    gaps, pos = [], 0
    for off, n in sorted(ranges):
        if off > pos:
            gaps.append((pos, off - pos))
        pos = max(pos, off + n)
    if pos < size:
        gaps.append((pos, size - pos))
    return gaps


def frame_crc32(buf: memoryview | bytes, ranges: Sequence[tuple[int, int]]) -> int:
    """CRC-32 of the bytes of ``buf`` not inside any batch range (chained over the gaps)."""
    crc = 0
    for off, n in frame_gaps(ranges, len(buf)):
        crc = zlib.crc32(buf[off : off + n], crc)
    return crc & 0xFFFFFFFF


class MappedFile:
    """A read-only ``mmap`` of one file for checksum checks (separate from Arrow's map).

    Args:
        path: the file (must exist and be non-empty).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as fh:
            size = path.stat().st_size
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.view = memoryview(self._mm) if self._mm is not None else memoryview(b"")

    def __len__(self) -> int:
        return len(self.view)

    def close(self) -> None:
        self.view.release()
        if self._mm is not None:
            self._mm.close()


def file_checksums(path: Path, ranges: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """(crc32 of each batch range, frame crc32) of a finished file; used by the build."""
    mf = MappedFile(path)
    try:
        crcs = [crc32_of(mf.view, off, n) for off, n in ranges]
        return crcs, frame_crc32(mf.view, ranges)
    finally:
        mf.close()


class BatchChecker:
    """Checks one file's record batches against their index checksums, each batch once.

    Args:
        path: the data or sidecar file.
        offsets, lengths, crcs: per batch (batch order), from the index.
        frame_crc: the manifest's frame checksum of the file.

    Raises (from the methods):
        DataError: naming the file and the record batch (or "frame").
    """

    def __init__(self, path: Path, offsets: np.ndarray, lengths: np.ndarray, crcs: np.ndarray, frame_crc: int) -> None:
        self.path = path
        self.offsets = offsets.astype(np.int64)
        self.lengths = lengths.astype(np.int64)
        self.crcs = crcs.astype(np.int64)
        self.frame_crc = int(frame_crc)
        self.ok = np.zeros(len(offsets), dtype=bool)
        self._mf: MappedFile | None = None

    def _map(self) -> MappedFile:
        if self._mf is None:
            self._mf = MappedFile(self.path)
        return self._mf

    def check_frame(self) -> None:
        """The bytes outside the batches (footer, magic): cheap, done when the file is opened."""
        mf = self._map()
        ranges = list(zip(self.offsets.tolist(), self.lengths.tolist()))
        ends = self.offsets + self.lengths
        if len(ends) and int(ends.max()) > len(mf):
            raise DataError(f"{self.path}: index says record batch {int(ends.argmax())} ends at byte "
                            f"{int(ends.max())}, the file has {len(mf)} bytes")
        got = frame_crc32(mf.view, ranges)
        if got != self.frame_crc:
            raise DataError(f"{self.path}: checksum mismatch in the file frame (footer/magic): crc32 {got:08x}, "
                            f"manifest says {self.frame_crc:08x}; the file is corrupt: rebuild the dataset")

    def check(self, i: int) -> None:
        """Record batch ``i`` (a no-op once it passed)."""
        if self.ok[i]:
            return
        got = crc32_of(self._map().view, int(self.offsets[i]), int(self.lengths[i]))
        if got != int(self.crcs[i]):
            raise DataError(
                f"{self.path}: checksum mismatch in record batch {i} (bytes {int(self.offsets[i])}.."
                f"{int(self.offsets[i] + self.lengths[i])}): crc32 {got:08x}, index says {int(self.crcs[i]):08x}; "
                "the file is corrupt: rebuild the dataset"
            )
        self.ok[i] = True

    def check_all(self) -> None:
        self.check_frame()
        for i in range(len(self.ok)):  # per record batch (not per row)
            self.check(i)

    def close(self) -> None:
        if self._mf is not None:
            self._mf.close()
            self._mf = None


def check_whole_file(path: Path, want_crc: int, want_bytes: int, what: str) -> None:
    """One crc32 over a whole (small) file, e.g. ``index.arrow`` against the manifest."""
    if not path.exists():
        raise DataError(f"{path}: {what} not found")
    size = path.stat().st_size
    if size != want_bytes:
        raise DataError(f"{path}: corrupt {what}: {size} bytes, manifest says {want_bytes} (truncated or modified)")
    got = zlib.crc32(path.read_bytes()) & 0xFFFFFFFF
    if got != want_crc:
        raise DataError(f"{path}: corrupt {what}: checksum mismatch: crc32 {got:08x}, manifest says {want_crc:08x}; "
                        "rebuild the dataset")
