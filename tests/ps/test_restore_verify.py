"""A restore verifies content, not only a whole-file checksum (issue 27 item 3).

Real in-process PS shards on 127.0.0.1, a real coordinated checkpoint (LMDB files,
manifest), then corruption of what it wrote, and a Restore through the real gRPC
service. Each corruption must be refused with DATA_LOSS naming checkpoint, file and
chunk, and the shards must serve exactly the rows they had before (judged on the
stored state and on pulls, against a reference taken before the restore).

Corruption *on the write path* (``ps.checkpoint.write_fault``: after a chunk was
serialized, before LMDB stores it) happens before the manifest's sha256 is taken,
so the whole-file checksum passes and only the per-chunk checks can see it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable

import grpc
import numpy as np
import pytest
import torch

from ps.checkpoint import _sha256, pack_arrays, shard_path, unpack_arrays, write_fault
from ps.coordinator import checkpoint_all
from protos import ps_pb2

from .conftest import Fleet

torch.set_num_threads(1)

PAGE = 4096


def _state(fleet: Fleet) -> list[dict[str, bytes]]:
    """Every shard's rows (ids, weights, optimizer state) and dense params, by id, as bytes."""
    out = []
    for s in fleet.servers:
        d = {}
        for name in s.store.tables:
            r = s.store.all_rows(name)
            o = np.argsort(r.ids)
            d[name] = r.ids[o].tobytes() + r.weights[o].tobytes() + b"".join(
                v[o].tobytes() for _k, v in sorted(r.state.items()))
        for name, entry in sorted(s.store.dense.state().items()):
            d["dense:" + name] = b"".join(np.asarray(v).tobytes() for _k, v in sorted(entry.items()))
        out.append(d)
    return out


def _train(fleet: Fleet, seed: int) -> None:
    rng = np.random.default_rng(seed)
    c = fleet.client()
    for _ in range(2):
        ids = rng.integers(0, 1 << 40, 40)
        c.push({"user": (ids, rng.standard_normal((40, 8)).astype(np.float32)),
                "item": (ids[:20], rng.standard_normal((20, 4)).astype(np.float32))})
    c.close()


IDS = np.random.default_rng(0).integers(0, 1 << 40, 40)  # the ids the first training round pushed


def _cut(fleet: Fleet, root: Path, hook: Callable[..., Any] | None = None) -> Path:
    _train(fleet, 0)
    if hook is None:
        return checkpoint_all(fleet.addresses, root, 5, rpc_cfg=fleet.rpc)
    with write_fault(hook):
        return checkpoint_all(fleet.addresses, root, 5, rpc_cfg=fleet.rpc)


def _restore(fleet: Fleet, ckpt: Path) -> None:
    c = fleet.client()
    try:
        for k in range(len(fleet.servers)):
            c.stub(k).Restore(ps_pb2.RestoreRequest(dir=str(ckpt)), timeout=30)
    finally:
        c.close()


def _pull(fleet: Fleet) -> dict[str, np.ndarray]:
    c = fleet.client()
    try:
        return c.pull({"user": IDS, "item": IDS[:20]})
    finally:
        c.close()


def _refused(fleet: Fleet, ckpt: Path, match: str) -> None:
    """Restore on every shard is DATA_LOSS (``match`` in the message); nothing served changed."""
    _train(fleet, 1)  # after the cut: the live rows differ from the checkpoint's
    before, served = _state(fleet), _pull(fleet)
    with pytest.raises(grpc.RpcError) as err:
        _restore(fleet, ckpt)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS, (err.value.code(), err.value.details())
    details = err.value.details() or ""
    assert "\n" not in details and ckpt.name in details, details
    import re
    assert re.search(match, details), details
    assert _state(fleet) == before  # judged on the stored rows, not on the report
    after = _pull(fleet)
    for t in served:
        np.testing.assert_array_equal(after[t], served[t])


def _weights_region(chunk: bytes) -> tuple[int, int]:
    """(offset, nbytes) of the 'weights' array inside a format-2 chunk."""
    hlen = struct.unpack_from("<I", chunk, 8)[0]
    start = 16 + hlen
    header = json.loads(chunk[16:start])
    base = start + (-start) % 8
    w = next(a for a in header["arrays"] if a["name"] == "weights")
    return base + w["offset"], w["nbytes"]


def _first_user_chunk(path: Path, key: str) -> bool:
    return path.name == "shard-0.lmdb" and key.startswith("t/user/")


class _Once:
    """A write fault applied to the first ``t/user/*`` chunk of shard 0 only."""

    def __init__(self, change: Callable[[bytes], bytes | None]) -> None:
        self.change = change
        self.key = ""

    def __call__(self, path: Path, key: str, data: bytes) -> bytes | None:
        if self.key or not _first_user_chunk(path, key):
            return data
        self.key = key
        return self.change(data)


def _flip_weight(chunk: bytes) -> bytes:
    off, n = _weights_region(chunk)
    b = bytearray(chunk)
    b[off + n // 2 + 3] ^= 0x40  # an exponent bit of one weight: a changed value, still finite
    return bytes(b)


def _drop_rows(chunk: bytes) -> bytes:
    """A stage that loses rows and re-serializes: a valid chunk, with fresh checksums, of fewer rows."""
    a = unpack_arrays(chunk, "test")
    keep = max(0, a["ids"].shape[0] - 4)
    return pack_arrays({k: v[:keep] for k, v in a.items()})


def test_an_intact_checkpoint_restores(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    """The positive control: with a pass-through write hook the restore gives back the cut's rows."""
    fleet = ps_fleet(2)
    hook = _Once(lambda b: b)
    ckpt = _cut(fleet, tmp_path / "ckpt", hook)
    at_cut = _state(fleet)
    _train(fleet, 1)
    assert _state(fleet) != at_cut
    _restore(fleet, ckpt)
    assert _state(fleet) == at_cut and hook.key


def test_a_weight_changed_after_serialization_is_data_loss(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(2)
    hook = _Once(_flip_weight)
    ckpt = _cut(fleet, tmp_path / "ckpt", hook)
    _refused(fleet, ckpt, rf"{ckpt.name}/shard-0.lmdb key '{hook.key}': array 'weights' checksum mismatch")


def test_a_chunk_lost_on_the_write_path_is_data_loss(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(2)
    hook = _Once(lambda b: None)
    ckpt = _cut(fleet, tmp_path / "ckpt", hook)
    _refused(fleet, ckpt, rf"shard-0.lmdb key '{hook.key}': chunk missing; key 'n/user' records \d+ rows")


def test_rows_lost_on_the_write_path_are_data_loss(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    """The finding: 36 of 40 rows loaded silently. A re-serialized chunk with 4 rows fewer passes
    its own checksums; the rows per vshard recorded as the store handed them over do not match."""
    fleet = ps_fleet(2)
    hook = _Once(_drop_rows)
    ckpt = _cut(fleet, tmp_path / "ckpt", hook)
    _refused(fleet, ckpt, rf"shard-0.lmdb key '{hook.key}': \d+ rows, key 'n/user' records \d+ \(rows lost")


def _rehash(ckpt: Path, name: str) -> None:
    """The manifest re-sealed over the damaged file: damage from before the commit."""
    mpath = ckpt / "manifest.json"
    man = json.loads(mpath.read_text())
    p = ckpt / name
    man["files"][name] = {"sha256": _sha256(p), "bytes": p.stat().st_size}
    mpath.write_text(json.dumps(man))


def test_a_corrupt_lmdb_page_is_data_loss(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    """LMDB's own error (a leaf page of the B-tree with a wrong page type) is DATA_LOSS, not INTERNAL."""
    fleet = ps_fleet(2)
    ckpt = _cut(fleet, tmp_path / "ckpt")
    p = shard_path(ckpt, 1)
    data = bytearray(p.read_bytes())
    leaves = [pg for pg in range(2, len(data) // PAGE) if struct.unpack_from("<H", data, pg * PAGE + 10)[0] == 0x02]
    struct.pack_into("<H", data, leaves[-1] * PAGE + 10, 0x40)  # the last leaf: rows were already read before it
    p.write_bytes(bytes(data))
    _rehash(ckpt, p.name)
    _refused(fleet, ckpt, rf"{ckpt.name}/shard-1.lmdb key '[^']+': LMDB error CorruptedError")


def test_a_truncated_lmdb_file_is_data_loss_not_a_crash(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    """Reading pages past the end of a truncated LMDB file is SIGBUS (the whole PS dies); it is refused first."""
    fleet = ps_fleet(2)
    ckpt = _cut(fleet, tmp_path / "ckpt")
    p = shard_path(ckpt, 0)
    data = p.read_bytes()
    p.write_bytes(data[: (len(data) // PAGE - 2) * PAGE])
    _rehash(ckpt, p.name)
    _refused(fleet, ckpt, rf"{ckpt.name}/shard-0.lmdb: truncated LMDB file \(\d+ bytes; its last page ends at byte")


def test_changed_bytes_after_the_commit_are_data_loss(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(2)
    ckpt = _cut(fleet, tmp_path / "ckpt")
    p = shard_path(ckpt, 1)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    _refused(fleet, ckpt, rf"{ckpt.name}/shard-1.lmdb: sha256 mismatch")


# -- files written before checksums (format 1) --------------------------------------------------
def _pack_v1(arrays: dict[str, np.ndarray]) -> bytes:
    """A chunk as format 1 wrote it: no crc32s (transcribed from the code before issue 27)."""
    metas, bufs, offset = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a) if a.ndim else a
        b = a.tobytes()
        metas.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": len(b)})
        bufs.append(b + b"\0" * ((-len(b)) % 8))
        offset += len(b) + (-len(b)) % 8
    header = json.dumps({"arrays": metas}).encode()
    head = struct.pack("<4sII", b"MPSC", 1, len(header)) + header
    return head + b"\0" * ((-len(head)) % 8) + b"".join(bufs)


def _to_format_1(ckpt: Path, keep_one_v2: bool = False) -> None:
    """Rewrite a checkpoint's shard files as format 1 wrote them (meta format 1, no ``n/*``), re-sealed."""
    import lmdb

    for p in sorted(ckpt.glob("shard-*.lmdb")):
        env = lmdb.open(str(p), subdir=False, lock=False, map_size=1 << 28)
        with env.begin(write=True) as txn:
            items = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
            left_v2 = False
            for k, v in items:
                if k.startswith(b"n/"):
                    txn.delete(k)
                elif k == b"meta":
                    meta = json.loads(v)
                    meta["format"] = 1
                    txn.put(k, json.dumps(meta).encode())
                elif keep_one_v2 and not left_v2 and k.startswith(b"t/"):
                    left_v2 = True  # (one chunk stays format 2: still read, still checked)
                else:
                    txn.put(k, _pack_v1(unpack_arrays(v, k.decode())))
        env.close()
        _rehash(ckpt, p.name)


def test_a_checkpoint_of_the_previous_format_still_restores(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(2)
    ckpt = _cut(fleet, tmp_path / "ckpt")
    at_cut = _state(fleet)
    _to_format_1(ckpt, keep_one_v2=True)
    _train(fleet, 1)
    _restore(fleet, ckpt)
    assert _state(fleet) == at_cut


def test_a_chunk_downgraded_to_format_1_in_a_checksummed_file_is_data_loss(ps_fleet: Callable[..., Fleet],
                                                                          tmp_path: Path) -> None:
    """A changed format field must not switch the checks off."""
    fleet = ps_fleet(2)
    hook = _Once(lambda b: _pack_v1(unpack_arrays(b, "chunk")))
    ckpt = _cut(fleet, tmp_path / "ckpt", hook)
    _refused(fleet, ckpt, rf"shard-0.lmdb key '{hook.key}': chunk format 1, this build reads 2 \(the file's meta says format 2\)")


def test_a_delta_chunk_lost_on_the_write_path_is_refused(tmp_path: Path) -> None:
    """Delta files hold runs of vshards per chunk: the rows per vshard are compared once the
    last chunk was read; a lost run is named (the gRPC Restore builds aside, as above)."""
    from ps.checkpoint import begin_checkpoint, commit_checkpoint, load_shard, save_shard
    from ps.config import TableConfig
    from ps.errors import CheckpointError
    from ps.shard_store import ShardStore

    def store() -> ShardStore:
        return ShardStore([TableConfig(name="user", dim=8, capacity=1024)], shard_id=0, num_vshards=8, seed=1)

    s = store()
    rng = np.random.default_rng(0)
    s.push("user", np.arange(300, dtype=np.int64), rng.standard_normal((300, 8)).astype(np.float32))
    root = tmp_path / "ckpt"
    tmp, _ = begin_checkpoint(root, 1, full_every=4)
    save_shard(s, tmp, 0)
    commit_checkpoint(tmp, {"step": 1})
    s.push("user", np.arange(100, 160, dtype=np.int64), rng.standard_normal((60, 8)).astype(np.float32))
    tmp, plan = begin_checkpoint(root, 2, full_every=4)
    assert plan.kind == "delta"
    lost = _Once(lambda b: None)
    with write_fault(lost):
        save_shard(s, tmp, 0)
    delta = commit_checkpoint(tmp, {"step": 2})
    assert lost.key.startswith("t/user/")
    fresh = store()
    with pytest.raises(CheckpointError, match=r"ckpt-2/shard-0.lmdb key 't/user/...': vshard \d+ has 0 rows in its "
                                              r"chunks, key 'n/user' records \d+ \(a chunk missing or changed\)"):
        load_shard(fresh, delta, range(8))
    s2 = store()  # the intact base alone restores
    assert load_shard(s2, root / "ckpt-1", range(8))["user"] == 300
