"""Meta-IO reader: ranges, batch contents, zero-copy, unique ids, errors, prefetch."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from meta_io import layout as L
from meta_io.batch import MetaBatch, PlainBatch
from meta_io.build import MetaIOBuildConfig, build
from meta_io.layout import Layout
from meta_io.prefetch import prefetch
from meta_io.reader import MetaIODataset
from common.errors import DataError

from .conftest import SMALL_ROWS_PER_BATCH


def np_col(rb: pa.RecordBatch, name: str) -> np.ndarray:
    col = rb.column(name)
    if pa.types.is_fixed_size_list(col.type):
        return col.flatten().to_numpy().reshape(len(col), col.type.list_size)
    return np.asarray(col.to_numpy(zero_copy_only=False))


def assert_batches_equal(a: MetaBatch, b: MetaBatch) -> None:
    for half in ("support", "query"):
        fa, fb = getattr(a, half), getattr(b, half)
        for k in fa.ids:
            assert torch.equal(fa.ids[k], fb.ids[k])
        assert torch.equal(fa.dense, fb.dense) and torch.equal(fa.mask, fb.mask)
    assert torch.equal(a.task_keys, b.task_keys) and torch.equal(a.task_mask, b.task_mask)


def test_dataset_shape(built) -> None:
    ds = MetaIODataset(built)
    assert ds.layout == "meta" and ds.num_files >= 2
    assert ds.total_batches == sum(ds.num_batches(f) for f in range(ds.num_files))
    assert ds.total_batches == ds.manifest["totals"]["meta_batches"]
    assert ds.schema.task_key == "user_id"


def test_read_range_in_the_middle_of_a_file(built) -> None:
    ds = MetaIODataset(built)
    f = max(range(ds.num_files), key=ds.num_batches)
    n = ds.num_batches(f)
    assert n >= 4
    everything = list(ds.read_range(f, 0, n))
    part = list(ds.read_range(f, 1, n - 1))
    assert len(part) == n - 2
    for x, y in zip(part, everything[1 : n - 1]):
        assert_batches_equal(x, y)
    assert list(ds.read_range(f, 2, 2)) == []
    with pytest.raises(IndexError, match="batch range"):
        ds.read_range(f, 2, n + 1)
    with pytest.raises(IndexError, match="file 99"):
        ds.read_range(99, 0, 1)


def test_meta_batch_matches_the_record_batch(built, generated_schema) -> None:
    ds = MetaIODataset(built)
    idx = ds.index
    for f in range(ds.num_files):
        for b, batch in enumerate(ds.read_range(f, 0, ds.num_batches(f))):
            e = idx.entry(int(idx.rows_of("meta", f)[b]))
            rb = ds.record_batch(f, b)
            T, c, s = e.task_slots, e.capacity, e.support
            assert isinstance(batch, MetaBatch)
            assert batch.support.shape == (T, s) and batch.query.shape == (T, c - s)
            mask = np_col(rb, L.MASK_COL).reshape(T, c)
            assert np.array_equal(batch.support.mask.numpy(), mask[:, :s])
            assert np.array_equal(batch.query.mask.numpy(), mask[:, s:])
            assert batch.num_tasks == e.n_tasks
            assert np.array_equal(batch.task_keys.numpy(), np_col(rb, L.TASK_KEY_COL).reshape(T, c)[:, 0])
            items = np_col(rb, "item_id").reshape(T, c, 1)
            assert np.array_equal(batch.query.ids["item_id"].numpy(), items[:, s:])
            tags = np_col(rb, "mh_item_tags").reshape(T, c, -1)
            assert np.array_equal(batch.support.ids["mh_item_tags"].numpy(), tags[:, :s])
            dense = np.stack([np_col(rb, d.name) for d in generated_schema.dense_columns], -1).reshape(T, c, -1)
            assert np.array_equal(batch.support.dense.numpy(), dense[:, :s])
            assert np.array_equal(batch.query.labels["click"].numpy(), np_col(rb, "click").reshape(T, c)[:, s:])
            assert np.array_equal(batch.query.oracle["click"].numpy(), np_col(rb, "p_click").reshape(T, c)[:, s:])
            img = np_col(rb, "image").reshape(T, c, -1)
            assert np.array_equal(batch.support.vectors["image"].numpy(), img[:, :s])
            assert np.array_equal(batch.support.scenario.numpy(), np_col(rb, "scene").reshape(T, c)[:, :s])
            # unique ids: per table, over every id column of that table, padding dropped
            for table in generated_schema.tables:
                cols = [col for col in generated_schema.id_columns if col.table_name == table]
                vals = np.concatenate([np_col(rb, col.name).reshape(-1) for col in cols])
                expect = np.unique(vals[vals >= 0])
                assert np.array_equal(batch.unique_ids[table].numpy(), expect), table
            assert (batch.task_mask.numpy() == mask.any(1)).all()
            # the build's precomputed ids equal the read-time computation
            full = ds.converter.features(rb, (T, c))
            computed = ds.converter.unique_ids(full)
            assert computed.keys() == batch.unique_ids.keys()
            assert all(torch.equal(computed[k], batch.unique_ids[k]) for k in computed)


def test_id_columns_and_labels_are_zero_copy(built) -> None:
    ds = MetaIODataset(built)
    batch = next(ds.read_range(0, 0, 1))
    rb = ds.stored_record_batch(0, 0)  # same memory map as the reader's (packed blocks, format 2)
    plan = ds.packing["main"][0]

    def address(col: str, itemsize: int) -> tuple[int, int]:
        """(address of the column's first value inside its block, bytes per block row)."""
        blk, m = plan.locate(col)
        return rb.column(blk.name).flatten().buffers()[1].address + itemsize * m.offset, itemsize * blk.width

    item, row = address("item_id", 8)
    assert batch.support.ids["item_id"].data_ptr() == item
    assert batch.support.ids["mh_item_tags"].data_ptr() == address("mh_item_tags", 8)[0]
    assert batch.support.vectors["image"].data_ptr() == address("image", 4)[0]
    assert batch.support.labels["click"].data_ptr() == address("click", 4)[0]
    s = ds.index.entry(0).support
    assert batch.query.ids["item_id"].data_ptr() == item + row * s  # a strided view, no copy


def test_leftover_and_plain_batches(built, generated, tmp_path) -> None:
    ds = MetaIODataset(built)
    left = list(ds.leftover())
    assert left and all(isinstance(b, PlainBatch) for b in left)
    assert sum(b.features.num_rows() for b in left) == ds.manifest["totals"]["leftover_rows"]
    assert all(b.features.shape == (SMALL_ROWS_PER_BATCH,) for b in left)
    plain = build(generated.out_dir, generated.schema_path, tmp_path / "plain",
                  MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=256)).out_dir
    pds = MetaIODataset(plain)
    batches = list(pds.iter_all())
    assert sum(b.features.num_rows() for b in batches) == 3000
    b0 = batches[0]
    assert b0.features.ids["mh_item_tags"].shape == (256, 6) and b0.features.dense.shape == (256, 8)
    assert torch.equal(b0.unique_ids["item"], torch.unique(b0.features.ids["item_id"]))
    assert list(pds.leftover()) == []


# --------------------------------------------------------------------------- errors


def test_missing_manifest(copy) -> None:
    (copy / L.MANIFEST_NAME).unlink()
    with pytest.raises(DataError, match=r"manifest\.json: manifest not found.*not a complete"):
        MetaIODataset(copy)


def test_corrupt_manifest_and_missing_index(copy) -> None:
    (copy / L.INDEX_NAME).unlink()
    with pytest.raises(DataError, match=r"index\.arrow: index file not found"):
        MetaIODataset(copy)
    (copy / L.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DataError, match=r"manifest\.json: corrupt manifest"):
        MetaIODataset(copy)


def test_corrupt_index(copy) -> None:
    (copy / L.INDEX_NAME).write_bytes(b"garbage" * 10)
    with pytest.raises(DataError, match=r"index\.arrow: corrupt index file"):
        MetaIODataset(copy)


def test_truncated_data_file(copy) -> None:
    ds = MetaIODataset(copy)
    p = copy / ds.file_names[0]
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    ds = MetaIODataset(copy)  # opening reads manifest + index only
    with pytest.raises(DataError, match=r"part-00000\.arrow: truncated or modified"):
        next(ds.read_range(0, 0, 1))
    assert next(ds.read_range(1, 0, 1)) is not None  # other files still read


def test_corrupt_footer_same_size(copy) -> None:
    ds = MetaIODataset(copy)
    p = copy / ds.file_names[1]
    raw = bytearray(p.read_bytes())
    raw[-64:] = b"\xff" * 64
    p.write_bytes(bytes(raw))
    ds = MetaIODataset(copy)
    with pytest.raises(DataError, match=r"part-00001\.arrow: corrupt Arrow IPC file"):
        list(ds.read_range(1, 0, 1))


def test_missing_data_file(copy) -> None:
    ds = MetaIODataset(copy)
    (copy / ds.file_names[0]).unlink()
    with pytest.raises(DataError, match=r"part-00000\.arrow: data file listed in the manifest is missing"):
        MetaIODataset(copy).check_files()


def test_missing_or_truncated_unique_ids_sidecar(copy) -> None:
    ds = MetaIODataset(copy)
    ids = copy / L.ids_file_name(ds.file_names[0])
    ids.write_bytes(ids.read_bytes()[:100])
    with pytest.raises(DataError, match=r"part-00000\.ids\.arrow: truncated or modified"):
        next(MetaIODataset(copy).read_range(0, 0, 1))
    ids.unlink()
    with pytest.raises(DataError, match=r"part-00000\.ids\.arrow: unique-ids file listed in the manifest is missing"):
        MetaIODataset(copy).check_files()


def test_index_disagreeing_with_manifest(copy) -> None:
    m = json.loads((copy / L.MANIFEST_NAME).read_text())
    m["files"][0]["batches"] += 1
    (copy / L.MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(DataError, match="lists .* batches of part-00000.arrow, manifest says"):
        MetaIODataset(copy)


# --------------------------------------------------------------------------- prefetch


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "metaio-prefetch"]


def test_prefetch_keeps_order_and_bounds_the_queue() -> None:
    produced = []

    def src():
        for i in range(20):
            produced.append(i)
            yield i

    it = prefetch(src(), depth=3)
    assert next(it) == 0
    time.sleep(0.2)
    # one handed out, <= 3 queued, one blocked in put
    assert len(produced) <= 1 + 3 + 1
    assert [0] + list(it) == list(range(20))
    assert not _threads()


def test_prefetch_propagates_exceptions_after_earlier_items() -> None:
    def src():
        yield 1
        yield 2
        raise DataError("part-00007.arrow: corrupt record batch 3")

    got = []
    with pytest.raises(DataError, match="part-00007"):
        for x in prefetch(src(), depth=2):
            got.append(x)
    assert got == [1, 2]
    assert not _threads()


def test_prefetch_stops_cleanly_when_the_consumer_stops_early() -> None:
    closed = threading.Event()

    def src():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    it = prefetch(src(), depth=2)
    for x in it:
        if x == 5:
            break
    it.close()
    assert closed.wait(5) and not _threads()


def test_prefetch_over_the_reader(built) -> None:
    ds = MetaIODataset(built)
    direct = list(ds.iter_all())
    fetched = list(prefetch(ds.iter_all(), depth=2))
    assert len(direct) == len(fetched) == ds.total_batches
    for a, b in zip(direct, fetched):
        assert_batches_equal(a, b)
    with pytest.raises(ValueError, match="depth"):
        prefetch([], depth=0)


def test_opening_a_dataset_imports_no_torch(built) -> None:
    """The controller (batch counts for the DDS) and `meta-io inspect` open datasets without
    paying for torch (~2.7 s of CPU, ~300 MB per process); the first tensor read imports it."""
    import subprocess
    import sys

    code = ("import sys; from controller.types import DatasetSpec; from meta_io.inspect import inspect_dataset; "
            f"DatasetSpec.from_meta_io('train', {str(built)!r}); inspect_dataset({str(built)!r}); "
            "print('torch' in sys.modules); "
            f"from meta_io.reader import MetaIODataset; ds = MetaIODataset({str(built)!r}); "
            "b = next(ds.read_range(0, 0, 1)); import torch; "
            "print('torch' in sys.modules, isinstance(b.task_keys, torch.Tensor))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split("\n")
    assert out[:2] == ["False", "True True"], out
