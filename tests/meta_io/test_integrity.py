"""Meta-IO content checksums: a flipped byte anywhere is caught, naming the file (and batch).

Also: datasets built before checksums still read (with a warning), and a failed
build leaves no output folder behind.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from meta_io import layout as L
from meta_io.build import MetaIOBuildConfig, build
from meta_io.index import CHECKSUM_COLUMNS, INDEX_SCHEMA
from meta_io.inspect import inspect_dataset
from meta_io.integrity import MANIFEST_KEY
from meta_io.reader import MetaIODataset
from metaps.cli import main
from common.errors import DataError


def flip(path: Path, offset: int, n: int = 1) -> None:
    """Invert ``n`` bytes of ``path`` at ``offset`` (same size, so the size check cannot see it)."""
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def read_everything(ds: MetaIODataset) -> None:
    for _ in ds.iter_all():
        pass
    for _ in ds.leftover():
        pass


def batch_range(ds: MetaIODataset, file: str, batch: int, ids: bool = False) -> tuple[int, int]:
    c = ds.index.cols
    pos = int(np.flatnonzero((ds.index.file == file) & (c["batch"] == batch))[0])
    pre = "ids_" if ids else ""
    return int(c[pre + "byte_offset"][pos]), int(c[pre + "byte_length"][pos])


def test_build_records_a_checksum_for_every_batch_and_file(built) -> None:
    m = json.loads((built / L.MANIFEST_NAME).read_text())
    assert m[MANIFEST_KEY]["algo"] == "crc32"
    ds = MetaIODataset(built)
    assert ds.has_checksums and ds.index.has_checksums
    for entry in m["files"] + m["leftover_files"]:
        assert isinstance(entry["frame_crc32"], int) and isinstance(entry["ids_frame_crc32"], int)
        # the batch ranges of a file tile it from byte 0 up to its footer
        for ids, name in ((False, entry["name"]), (True, entry["ids"])):
            ranges = sorted(batch_range(ds, entry["name"], b, ids) for b in range(entry["batches"]))
            assert ranges[0][0] == 0
            assert all(a[0] + a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert ranges[-1][0] + ranges[-1][1] < (built / name).stat().st_size
    assert inspect_dataset(built, verify=True)["problems"] == []


def test_4kib_flipped_in_a_part_file_is_caught_by_verify_and_the_reader(copy, capsys) -> None:
    ds = MetaIODataset(copy)
    off, n = batch_range(ds, "part-00001.arrow", 2)
    assert n > 4096
    flip(copy / "part-00001.arrow", off + n // 2 - 2048, 4096)

    assert main(["meta-io", "inspect", str(copy)]) == 0  # without --verify the bytes are not read
    assert "file contents not read: --verify checks every crc32" in capsys.readouterr().out
    assert main(["meta-io", "inspect", str(copy), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "part-00001.arrow: checksum mismatch in record batch 2" in out
    assert "consistency     ok" not in out

    ds = MetaIODataset(copy)
    assert len(list(ds.read_range(1, 0, 2))) == 2  # the batches before it are intact
    with pytest.raises(DataError, match=r"part-00001\.arrow: checksum mismatch in record batch 2 "):
        list(ds.read_range(1, 2, 3))
    with pytest.raises(DataError, match=r"part-00001\.arrow: checksum mismatch in record batch 2 "):
        read_everything(MetaIODataset(copy))


@pytest.mark.parametrize("where", ["first byte", "schema message", "last batch", "footer", "last byte",
                                   "sidecar batch", "leftover file"])
def test_a_flipped_byte_anywhere_is_caught(copy, where) -> None:
    ds = MetaIODataset(copy)
    name, size = "part-00000.arrow", (copy / "part-00000.arrow").stat().st_size
    last = ds.num_batches(0) - 1
    target = {
        "first byte": (name, 0),
        "schema message": (name, 40),
        "last batch": (name, sum(batch_range(ds, name, last)) - 1),
        # a byte of the footer's flatbuffer that Arrow itself does not notice (found by flipping each one)
        "footer": (name, sum(batch_range(ds, name, last)) + 28),
        "last byte": (name, size - 1),
        "sidecar batch": (L.ids_file_name(name), batch_range(ds, name, 1, ids=True)[0] + 30),
        "leftover file": ("leftover-00000.arrow", batch_range(ds, "leftover-00000.arrow", 0)[0] + 200),
    }[where]
    flip(copy / target[0], target[1])
    problems = inspect_dataset(copy, verify=True)["problems"]
    assert len(problems) == 1 and f"{target[0]}: " in problems[0], problems
    assert "checksum mismatch" in problems[0] or "corrupt" in problems[0]
    with pytest.raises(DataError, match=target[0].replace(".", r"\.")):
        read_everything(MetaIODataset(copy))


def test_corrupt_index_bytes_are_caught_on_open(copy) -> None:
    flip(copy / L.INDEX_NAME, (copy / L.INDEX_NAME).stat().st_size // 2)
    with pytest.raises(DataError, match=r"index\.arrow: corrupt index file: checksum mismatch"):
        MetaIODataset(copy)


def strip_checksums(ds_dir: Path) -> None:
    """Turn a dataset into what a build before checksums wrote."""
    m = json.loads((ds_dir / L.MANIFEST_NAME).read_text())
    for k in (MANIFEST_KEY, "index_crc32", "index_bytes"):
        m.pop(k)
    for f in m["files"] + m["leftover_files"]:
        f.pop("frame_crc32")
        f.pop("ids_frame_crc32")
    (ds_dir / L.MANIFEST_NAME).write_text(json.dumps(m))
    t = ipc.open_file(pa.BufferReader((ds_dir / L.INDEX_NAME).read_bytes())).read_all()  # not mapped: rewritten below
    assert set(CHECKSUM_COLUMNS) <= set(t.column_names)
    t = t.select(INDEX_SCHEMA.names)
    with pa.OSFile(str(ds_dir / L.INDEX_NAME), "wb") as sink, ipc.new_file(sink, t.schema) as w:
        w.write_table(t)


def test_dataset_without_checksums_reads_with_a_warning(copy, caplog, capsys) -> None:
    n = MetaIODataset(copy).total_batches
    strip_checksums(copy)
    with caplog.at_level(logging.WARNING, logger="meta_io.reader"):
        ds = MetaIODataset(copy)
    assert not ds.has_checksums
    assert any("has no checksums" in r.getMessage() for r in caplog.records)
    assert sum(1 for _ in ds.iter_all()) == n
    assert main(["meta-io", "inspect", str(copy)]) == 0
    assert "no checksums (older build)" in capsys.readouterr().out
    assert main(["meta-io", "inspect", str(copy), "--verify"]) == 1
    assert "no checksums to verify" in capsys.readouterr().out


def test_failed_build_leaves_no_output_folder(generated, generated_schema, tmp_path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    t = pq.read_table(generated.files[0])
    t = t.set_column(t.schema.get_field_index("click"), "click", pa.array(np.full(t.num_rows, 2, np.int8)))
    pq.write_table(t, bad / "x.parquet")
    out = tmp_path / "new" / "deeper" / "ds"
    with pytest.raises(DataError, match=r"x\.parquet.*'click'"):
        build(bad, generated_schema, out, MetaIOBuildConfig())
    assert not (tmp_path / "new").exists()  # nor the parents it had to create
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
    # the CLI too: exit 1, one line, nothing left
    assert main(["meta-io", "build", "--input", str(bad), "--schema", str(generated.schema_path),
                 "--out", str(tmp_path / "cli-ds")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
    # an existing empty folder stays as it was (empty); a good build then fills it
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError):
        build(bad, generated_schema, tmp_path / "empty", MetaIOBuildConfig())
    assert list((tmp_path / "empty").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "empty"]
