"""``metaps meta-io stage``: copies a built dataset whole (or its metadata), manifest last, verified, all or nothing.

Real datasets (the ``built`` fixture of conftest: several small part files with
sidecars and leftovers), real folders, ``file://`` URIs and pyarrow's in-memory
``mock://`` filesystem (a non-local destination: written in place, no rename).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meta_io import layout as L
from meta_io.reader import MetaIODataset
from meta_io.stage import STAGING_INFIX, stage_dataset
from common.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[2]


def listed_files(ds: Path) -> list[str]:
    m = json.loads((ds / L.MANIFEST_NAME).read_text())
    out = [L.MANIFEST_NAME, L.INDEX_NAME]
    for f in m["files"] + m["leftover_files"]:
        out += [f["name"], f["ids"]]
    return sorted(out)


def leftovers(parent: Path) -> list[str]:
    """Staging or set-aside folders left beside a destination."""
    return sorted(p.name for p in parent.iterdir() if STAGING_INFIX in p.name or ".old-" in p.name)


def batch_counts(ds: Path) -> list[int]:
    d = MetaIODataset(ds)
    return [d.num_batches(i) for i in range(d.num_files)]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture()
def src(built: Path, tmp_path: Path) -> Path:
    """A private copy of ``built`` plus a stray file the manifest does not list."""
    out = tmp_path / "src"
    shutil.copytree(built, out)
    (out / "part-99999.arrow").write_bytes(b"stray: not in the manifest")
    return out


def test_full_copy_is_byte_identical_and_reads(src: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dst = tmp_path / "vol" / "metaio"
    with caplog.at_level(logging.DEBUG, logger="meta_io.stage"):
        res = stage_dataset(str(src), str(dst))
    names = listed_files(src)
    assert sorted(p.name for p in dst.iterdir()) == names  # the stray part-99999 did not travel
    for n in names:
        assert (dst / n).read_bytes() == (src / n).read_bytes(), n
    assert (res.files, res.skipped) == (len(names), False)
    assert res.bytes == sum((src / n).stat().st_size for n in names)
    assert batch_counts(dst) == batch_counts(src)
    assert sum(1 for _ in MetaIODataset(dst).iter_all()) == MetaIODataset(src).total_batches
    assert leftovers(dst.parent) == []
    # copy order: every data file, then the index, the manifest LAST
    copied = [r.kv["file"] for r in caplog.records if r.getMessage() == "copied"]  # type: ignore[attr-defined]
    assert sorted(copied) == names
    assert copied[-2:] == [L.INDEX_NAME, L.MANIFEST_NAME]
    done = [r for r in caplog.records if r.getMessage() == "stage done"]
    assert done and done[0].kv["files"] == len(names)  # type: ignore[attr-defined]


def test_file_uri_source_and_identical_destination_is_skipped(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    first = stage_dataset(src.as_uri(), str(dst))
    assert not first.skipped and (dst / L.MANIFEST_NAME).read_bytes() == (src / L.MANIFEST_NAME).read_bytes()
    mtimes = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    again = stage_dataset(src.as_uri(), dst.as_uri())
    assert (again.skipped, again.files, again.bytes) == (True, 0, 0)
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == mtimes  # nothing rewritten


def test_metadata_only_copies_two_files_and_opens(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "meta"
    res = stage_dataset(str(src), str(dst), metadata_only=True)
    assert res.files == 2
    assert sorted(p.name for p in dst.iterdir()) == sorted([L.MANIFEST_NAME, L.INDEX_NAME])
    assert batch_counts(dst) == batch_counts(src)


def test_a_metadata_only_copy_is_completed_not_skipped_by_a_full_stage(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    stage_dataset(str(src), str(dst), metadata_only=True)
    again = stage_dataset(str(src), str(dst))  # the same manifest, the data files missing: copied, no --overwrite
    assert not again.skipped and again.files == len(listed_files(src))
    assert sorted(p.name for p in dst.iterdir()) == sorted(listed_files(src)) and leftovers(tmp_path) == []
    assert stage_dataset(str(src), str(dst), metadata_only=True).skipped  # what it asks for is there


def test_metadata_only_catches_a_corrupt_index(src: Path, tmp_path: Path) -> None:
    flip(src / L.INDEX_NAME, (src / L.INDEX_NAME).stat().st_size // 2)
    dst = tmp_path / "meta"
    with pytest.raises(DataError, match=rf"^copy of {src}/index\.arrow: corrupt index file: checksum mismatch"):
        stage_dataset(str(src), str(dst), metadata_only=True)
    assert not dst.exists() and leftovers(tmp_path) == []


def test_truncated_source_file_fails_naming_it_and_leaves_nothing(src: Path, tmp_path: Path) -> None:
    part = src / "part-00001.arrow"
    part.write_bytes(part.read_bytes()[:-100])
    dst = tmp_path / "dst"
    with pytest.raises(DataError, match=r"part-00001\.arrow: truncated or modified at the source: \d+ bytes, "
                                        r"manifest says \d+"):
        stage_dataset(str(src), str(dst))
    assert not dst.exists() and leftovers(tmp_path) == []


def test_flipped_byte_fails_verification_and_leaves_nothing(src: Path, tmp_path: Path) -> None:
    part = src / "part-00001.arrow"
    flip(part, part.stat().st_size // 3)  # same size: only the checksums can see it
    dst = tmp_path / "dst"
    with pytest.raises(DataError, match=rf"^copy of {src}/part-00001\.arrow: checksum mismatch"):
        stage_dataset(str(src), str(dst))
    assert not dst.exists() and leftovers(tmp_path) == []


def test_different_destination_is_refused_then_replaced_with_overwrite(src: Path, built: Path,
                                                                       tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    stage_dataset(str(src), str(dst), metadata_only=True)  # a different dataset: 2 files only
    m = json.loads((src / L.MANIFEST_NAME).read_text())
    m["created"] = "another build"
    (src / L.MANIFEST_NAME).write_text(json.dumps(m))
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    with pytest.raises(ConfigError, match=r"already holds a different Meta-IO dataset; pass --overwrite"):
        stage_dataset(str(src), str(dst))
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # kept intact
    res = stage_dataset(str(src), str(dst), overwrite=True)
    assert not res.skipped and sorted(p.name for p in dst.iterdir()) == listed_files(src)
    assert (dst / L.MANIFEST_NAME).read_bytes() == (src / L.MANIFEST_NAME).read_bytes()
    assert leftovers(tmp_path) == []


def test_wait_times_out_naming_the_source(tmp_path: Path) -> None:
    missing = tmp_path / "not-built-yet"
    t0 = time.monotonic()
    with pytest.raises(DataError, match=rf"{missing}/manifest.json: manifest not found after waiting 1 s"):
        stage_dataset(str(missing), str(tmp_path / "dst"), wait_s=1.0)
    assert 0.9 < time.monotonic() - t0 < 5
    with pytest.raises(DataError, match=r"manifest not found \(no --wait given\)"):
        stage_dataset(str(missing), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


def test_wait_succeeds_when_the_manifest_appears(built: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"

    def publish() -> None:  # as a build would: the data, then the manifest last
        time.sleep(0.5)
        src.mkdir()
        for n in listed_files(built):
            if n != L.MANIFEST_NAME:
                shutil.copyfile(built / n, src / n)
        shutil.copyfile(built / L.MANIFEST_NAME, src / "manifest.tmp")  # whole or absent, as a build's rename
        os.replace(src / "manifest.tmp", src / L.MANIFEST_NAME)

    th = threading.Thread(target=publish)
    th.start()
    try:
        res = stage_dataset(str(src), str(tmp_path / "dst"), wait_s=10.0)
    finally:
        th.join()
    assert res.files == len(listed_files(built)) and res.seconds >= 0.5
    assert batch_counts(tmp_path / "dst") == batch_counts(built)


def test_non_local_destination_is_written_in_place_manifest_last(src: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="meta_io.stage"):
        res = stage_dataset(str(src), "mock:///bucket/metaio")
    assert res.files == len(listed_files(src))
    copied = [r.kv["file"] for r in caplog.records if r.getMessage() == "copied"]  # type: ignore[attr-defined]
    assert copied[-1] == L.MANIFEST_NAME


def test_bad_uris_are_one_line_config_errors(src: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^meta-io stage: --from foo://x/y: cannot open scheme 'foo://': [^\n]*$"):
        stage_dataset("foo://x/y", str(tmp_path / "dst"))
    with pytest.raises(ConfigError, match=r"--wait must be >= 0"):
        stage_dataset(str(src), str(tmp_path / "dst"), wait_s=-1)


def test_cli_end_to_end_with_done_file(src: Path, tmp_path: Path) -> None:
    dst, done = tmp_path / "dst", tmp_path / "run" / "data-ready.json"
    cmd = [sys.executable, "-m", "metaps", "--json", "meta-io", "stage", "--from", src.as_uri(), "--to", str(dst),
           "--done-file", str(done)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["files"] == len(listed_files(src)) and out["skipped"] is False
    gate = json.loads(done.read_text())
    assert (gate["src"], gate["dst"], gate["files"], gate["bytes"]) == (src.as_uri(), str(dst), out["files"],
                                                                       out["bytes"])
    assert "stage done" not in p.stderr  # the summary replaces the log twin
    assert batch_counts(dst) == batch_counts(src)


def test_dataset_without_checksums_is_staged_by_size_with_a_warning(src: Path, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    m = json.loads((src / L.MANIFEST_NAME).read_text())
    for k in ("checksums", "index_crc32", "index_bytes"):  # as a build before checksums wrote it
        m.pop(k)
    (src / L.MANIFEST_NAME).write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="meta_io.stage"):
        res = stage_dataset(str(src), str(tmp_path / "dst"))
    assert res.files == len(listed_files(src))
    assert any("checked by size only" in r.getMessage() for r in caplog.records)


def test_a_killed_stages_staging_folder_is_removed_a_live_ones_kept(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    dead = tmp_path / f"dst{STAGING_INFIX}0badf00d"  # as a SIGKILLed stage leaves it: no process holds its lock
    dead.mkdir()
    (dead / "part-00000.arrow").write_bytes(b"half a file")
    live = tmp_path / f"dst{STAGING_INFIX}11ve1111"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a stage running now holds its folder
    try:
        stage_dataset(str(src), str(dst), metadata_only=True)
    finally:
        os.close(fd)
    assert not dead.exists() and live.exists()
    assert batch_counts(dst) == batch_counts(src)
