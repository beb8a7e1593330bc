"""Packed record batches (format 2) vs one column per feature (format 1): same batches, same integrity.

Built datasets only (real Arrow IPC files): the same generated input is built
with ``pack_columns`` on and off and read back batch by batch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from meta_io import layout as L
from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from meta_io.build import MetaIOBuildConfig, build
from meta_io.layout import Layout
from meta_io.packing import PACKED_FORMAT_VERSION, UNPACKED_FORMAT_VERSION
from meta_io.reader import MetaIODataset
from common.errors import DataError

from .conftest import SMALL_QUERY, SMALL_ROWS_PER_BATCH, SMALL_SUPPORT


@pytest.fixture(scope="module")
def unpacked(generated, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``built`` dataset's twin, stored one column per feature (format 1)."""
    out = tmp_path_factory.mktemp("metaio-v1") / "ds"
    build(generated.out_dir, generated.schema_path, out,
          MetaIOBuildConfig(support=SMALL_SUPPORT, query=SMALL_QUERY, rows_per_batch=SMALL_ROWS_PER_BATCH,
                            max_file_mb=0.5, pack_columns=False))
    return out


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), what


def _same_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        _same(a[k], b[k], f"{what}[{k}]")


def _same_features(a: FeatureBatch, b: FeatureBatch, what: str) -> None:
    for name in ("ids", "vectors", "labels", "oracle"):
        _same_dict(getattr(a, name), getattr(b, name), f"{what}.{name}")
    for name in ("dense", "mask", "scenario"):
        _same(getattr(a, name), getattr(b, name), f"{what}.{name}")


def _same_batch(a: MetaBatch | PlainBatch, b: MetaBatch | PlainBatch, what: str) -> None:
    assert type(a) is type(b), what
    _same_dict(a.unique_ids, b.unique_ids, f"{what}.unique_ids")
    if isinstance(a, MetaBatch) and isinstance(b, MetaBatch):
        _same_features(a.support, b.support, f"{what}.support")
        _same_features(a.query, b.query, f"{what}.query")
        _same(a.task_keys, b.task_keys, f"{what}.task_keys")
        _same(a.task_mask, b.task_mask, f"{what}.task_mask")
    else:
        assert isinstance(a, PlainBatch) and isinstance(b, PlainBatch)
        _same_features(a.features, b.features, f"{what}.features")


def test_packed_and_unpacked_batches_are_equal_value_by_value(built: Path, unpacked: Path) -> None:
    new, old = MetaIODataset(built), MetaIODataset(unpacked)
    assert new.manifest["format_version"] == PACKED_FORMAT_VERSION and "packing" in new.manifest
    assert old.manifest["format_version"] == UNPACKED_FORMAT_VERSION and "packing" not in old.manifest
    # the stored files differ: blocks instead of one column per feature
    assert new.stored_record_batch(0, 0).schema.names != old.stored_record_batch(0, 0).schema.names
    assert new.total_batches == old.total_batches >= 4
    n = 0
    for a, b in zip(new.iter_all(), old.iter_all(), strict=True):
        _same_batch(a, b, f"batch {n}")
        n += 1
    assert n == new.total_batches
    lefts = list(zip(new.leftover(), old.leftover(), strict=True))
    assert lefts
    for i, (a, b) in enumerate(lefts):
        _same_batch(a, b, f"leftover {i}")
    # tools see the logical columns either way
    for f in range(new.num_files):
        for b in range(new.num_batches(f)):
            assert new.record_batch(f, b).equals(old.record_batch(f, b)), (f, b)
    for x, y in zip(new.leftover_record_batches(), old.leftover_record_batches(), strict=True):
        assert x.equals(y)


def test_packed_plain_layout_equals_unpacked(generated, tmp_path: Path) -> None:
    out = {}
    for pack in (True, False):
        out[pack] = build(generated.out_dir, generated.schema_path, tmp_path / f"plain-{pack}",
                          MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=256, pack_columns=pack)).out_dir
    pairs = list(zip(MetaIODataset(out[True]).iter_all(), MetaIODataset(out[False]).iter_all(), strict=True))
    assert len(pairs) >= 2
    for i, (a, b) in enumerate(pairs):
        _same_batch(a, b, f"plain batch {i}")


def test_a_packed_batch_is_a_handful_of_blocks(built: Path) -> None:
    ds = MetaIODataset(built)
    plan = ds.packing["main"][0]
    stored = ds.stored_record_batch(0, 0).schema.names
    assert stored == plan.stored_names
    assert [b.dtype for b in plan.blocks] == ["int64", "float32", "int32"]
    assert len(stored) <= 6 < len(ds.record_batch(0, 0).schema.names)
    batch = next(ds.read_range(0, 0, 1))
    # every id column of a half is a view of the one int64 block: same storage
    storages = {v.untyped_storage().data_ptr() for v in batch.support.ids.values()}
    storages |= {v.untyped_storage().data_ptr() for v in batch.query.ids.values()}
    assert len(storages) == 1


def _block_range(ds: MetaIODataset, path: Path, file: int, batch: int, block: str) -> tuple[int, int]:
    """(file offset, length) of a packed block's values in record batch ``batch``."""
    values = ds.stored_record_batch(file, batch).column(block).flatten()
    raw = values.buffers()[1].to_pybytes()[: values.nbytes]
    data = path.read_bytes()
    off = data.find(raw)
    assert off >= 0 and data.find(raw, off + 1) < 0  # found, and only once
    return off, len(raw)


def test_integrity_catches_a_flipped_byte_in_a_packed_block(copy: Path) -> None:
    ds = MetaIODataset(copy)
    f = max(range(ds.num_files), key=ds.num_batches)
    path = copy / ds.file_names[f]
    for block in ("__pack_int64", "__pack_float32"):
        off, n = _block_range(ds, path, f, 1, block)
        assert ds.index.has_checksums
        data = bytearray(path.read_bytes())
        data[off + n // 2] ^= 0x10  # one value in the middle of the block: still valid Arrow
        path.write_bytes(bytes(data))
        fresh = MetaIODataset(copy)
        list(fresh.read_range(f, 0, 1))  # batch 0 is intact
        with pytest.raises(DataError, match=rf"{path.name}: checksum mismatch in record batch 1 "):
            list(fresh.read_range(f, 1, 2))
        data[off + n // 2] ^= 0x10  # restore
        path.write_bytes(bytes(data))
    assert MetaIODataset(copy).verify() == []


def _rewrite(copy: Path, **changes: object) -> None:
    mpath = copy / L.MANIFEST_NAME
    m = json.loads(mpath.read_text())
    for k, v in changes.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    mpath.write_text(json.dumps(m))


def test_unknown_format_version_is_refused(copy: Path) -> None:
    _rewrite(copy, format_version=3)
    with pytest.raises(DataError, match=r"format_version 3 is not supported \(this reader reads 1.* and 2"):
        MetaIODataset(copy)


def test_packed_version_without_a_plan_is_refused(copy: Path) -> None:
    _rewrite(copy, packing=None)
    with pytest.raises(DataError, match="format_version 2 needs a \"packing\" entry"):
        MetaIODataset(copy)


def test_old_layout_manifest_over_packed_files_is_refused(copy: Path) -> None:
    # an old (format 1) manifest over files stored packed: the column check names the file
    _rewrite(copy, format_version=1, packing=None)
    ds = MetaIODataset(copy)
    with pytest.raises(DataError, match=r"part-00000.arrow: columns \['__pack_int64'.* do not match the manifest"):
        next(ds.read_range(0, 0, 1))


def test_plan_that_disagrees_with_the_file_is_refused(copy: Path) -> None:
    m = json.loads((copy / L.MANIFEST_NAME).read_text())
    blk = m["packing"]["main"]["blocks"][0]
    first = blk["columns"][0]
    assert not first[3]  # a scalar id column, width 1
    first[2] = 2  # claims width 2: every later member shifts by one
    for mem in blk["columns"][1:]:
        mem[1] += 1
    blk["width"] += 1
    _rewrite(copy, packing=m["packing"])
    ds = MetaIODataset(copy)
    with pytest.raises(DataError, match=r"part-00000.arrow: packed column __pack_int64 is .*\[\d+\], the manifest's "
                                        r"packing plan says .*\[\d+\]"):
        next(ds.read_range(0, 0, 1))


def test_malformed_plan_is_refused(copy: Path) -> None:
    m = json.loads((copy / L.MANIFEST_NAME).read_text())
    m["packing"]["main"]["blocks"][0]["columns"][1][1] += 1  # a gap between two members
    _rewrite(copy, packing=m["packing"])
    with pytest.raises(DataError, match=r"packing\['main'\]: malformed packing plan: block __pack_int64: member"):
        MetaIODataset(copy)


def test_old_layout_dataset_still_reads(unpacked: Path, tmp_path: Path) -> None:
    # a format 1 dataset (no packing) reads, and so does a copy of it
    dst = tmp_path / "v1"
    shutil.copytree(unpacked, dst)
    ds = MetaIODataset(dst)
    assert ds.packing == {} and ds.verify() == []
    b = next(ds.read_range(0, 0, 1))
    assert isinstance(b, MetaBatch) and b.num_tasks > 0
    assert np.all(b.support.mask.numpy()[:, 0][b.task_mask.numpy()])


def test_pack_columns_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="pack_columns must be true or false, got 'no'"):
        MetaIOBuildConfig(pack_columns="no").validate()  # type: ignore[arg-type]
