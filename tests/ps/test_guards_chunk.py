"""A checkpoint chunk whose header changed is refused (issue 37 item 9).

A format-2 chunk carries a crc32 of every array and one of its json header
(``ps.checkpoint.pack_arrays``). With the header's check removed by hand the other
checkpoint tests still passed: their corruptions change array bytes or the format
field. The corruption here changes only the header, and keeps it a valid chunk: the
names of two arrays of the same dtype and shape swapped (Adam's ``m`` and ``v``),
each array's bytes and crc32 untouched. Without the header check it restores the
optimizer moments swapped, silently; with it the chunk is refused, naming file and key.

Real ShardStores and real LMDB files; the fault is applied on the write path
(``ps.checkpoint.write_fault``: after the chunk was packed, before it is stored), so
the manifest's whole-file sha256 matches and only the chunk's own checks can see it.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from ps.checkpoint import begin_checkpoint, commit_checkpoint, load_shard, pack_arrays, save_shard, unpack_arrays, \
    write_fault
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.errors import CheckpointError
from ps.shard_store import ShardStore

torch.set_num_threads(1)

NV = 4
HEADER_MISMATCH = "chunk header checksum mismatch"


def _store() -> ShardStore:
    cfg = TableConfig(name="user", dim=8, capacity=256, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM, lr=0.05))
    return ShardStore([cfg], shard_id=0, num_vshards=NV, seed=1)


def _trained() -> ShardStore:
    s = _store()
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = np.sort(rng.choice(200, size=60, replace=False)).astype(np.int64)
        s.push("user", ids, rng.standard_normal((60, 8)).astype(np.float32))
    return s


def _rows(s: ShardStore) -> dict[str, np.ndarray]:
    r = s.all_rows("user")
    o = np.argsort(r.ids)
    out = {"ids": r.ids[o], "weights": r.weights[o], "freq": r.freq[o], "last_step": r.last_step[o]}
    out.update({f"state/{k}": v[o] for k, v in r.state.items()})
    return out


def _header(chunk: bytes) -> tuple[int, bytes]:
    """(length, bytes) of a format-2 chunk's json header."""
    magic, fmt, hlen, _crc = struct.unpack_from("<4sIII", chunk, 0)
    assert (magic, fmt) == (b"MPSC", 2)
    return hlen, chunk[16 : 16 + hlen]


def _swap_m_and_v(chunk: bytes) -> bytes:
    """The header with the names of ``state/m`` and ``state/v`` swapped: same length, valid json,
    every array's offset, size and crc32 still those of its own bytes."""
    hlen, header = _header(chunk)
    assert header.count(b'"state/m"') == 1 and header.count(b'"state/v"') == 1, header
    swapped = header.replace(b'"state/m"', b'"state/@"').replace(b'"state/v"', b'"state/m"').replace(
        b'"state/@"', b'"state/v"')
    assert len(swapped) == hlen and swapped != header
    return chunk[:16] + swapped + chunk[16 + hlen :]


def _arrays_still_match(chunk: bytes) -> None:
    """Every array's crc32 in the (changed) header matches its bytes: only the header check can tell."""
    hlen, header = _header(chunk)
    base = 16 + hlen + (-(16 + hlen)) % 8
    for m in json.loads(header)["arrays"]:
        lo = base + m["offset"]
        assert zlib.crc32(chunk[lo : lo + m["nbytes"]]) == m["crc32"], m["name"]


def test_a_chunk_with_a_changed_header_is_refused() -> None:
    arrays = _rows(_trained())
    chunk = pack_arrays(arrays)
    assert unpack_arrays(chunk, "k").keys() == arrays.keys()
    bad = _swap_m_and_v(chunk)
    _arrays_still_match(bad)
    with pytest.raises(CheckpointError, match=f"^f key 't/user/0': {HEADER_MISMATCH} "):
        unpack_arrays(bad, "f key 't/user/0'")
    with pytest.raises(CheckpointError, match=HEADER_MISMATCH):
        unpack_arrays(bad, "f key 't/user/0'", checked=True)


def test_a_chunk_whose_header_checksum_changed_is_refused() -> None:
    chunk = bytearray(pack_arrays(_rows(_trained())))
    chunk[12] ^= 0x01  # the header's crc32, in the fixed prefix
    with pytest.raises(CheckpointError, match=HEADER_MISMATCH):
        unpack_arrays(bytes(chunk), "k")


def _cut(s: ShardStore, root: Path) -> Path:
    tmp, _plan = begin_checkpoint(root, 1, 1)
    save_shard(s, tmp, 0)
    return commit_checkpoint(tmp, {"step": 1, "dense_names": []})


def test_a_header_changed_on_the_write_path_fails_the_restore_and_loads_nothing(tmp_path: Path) -> None:
    s = _trained()
    want = _rows(s)
    good = _cut(s, tmp_path / "good")
    fresh = _store()
    load_shard(fresh, good, range(NV))
    got = _rows(fresh)
    for k in want:  # the control: an unchanged checkpoint restores every array as it was
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    changed: list[str] = []

    def fault(path: Path, key: str, data: bytes) -> bytes:
        if changed or not key.startswith("t/user/"):
            return data
        changed.append(key)
        return _swap_m_and_v(data)

    with write_fault(fault):
        bad = _cut(s, tmp_path / "bad")
    assert changed
    fresh = _store()
    with pytest.raises(CheckpointError) as err:
        load_shard(fresh, bad, range(NV))  # the manifest's sha256 matches: verified, then refused by the chunk
    msg = str(err.value)
    assert re.search(rf"shard-0\.lmdb key '{re.escape(changed[0])}': {HEADER_MISMATCH}", msg), msg
    assert fresh.tables["user"].size == 0  # nothing loaded
