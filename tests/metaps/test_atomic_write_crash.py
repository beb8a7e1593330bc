"""Atomic writes under failure: a crash or an error mid-write leaves the old file whole.

A real crash mid-write, deterministically: a child process lowers its file-size limit
(``RLIMIT_FSIZE``) below the new content, so the kernel stops it (``SIGXFSZ``, or
``EFBIG`` when the signal is ignored) in the middle of the write. Whatever the writer
did, the target must hold its previous content, whole: a writer that wrote in place
(truncate + write) would leave a truncated target behind.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from common.atomic_write import PRIVATE_FILE_MODE, atomic_output, write_json_atomic, write_text_atomic

REPO = Path(__file__).resolve().parents[2]
LIMIT = 64 * 1024  # the child's file-size limit: the new content is 16x larger

_CHILD = r"""
import resource, signal, sys
from common.atomic_write import write_text_atomic
path, mode = sys.argv[1], sys.argv[2]
# Python ignores SIGXFSZ (a write past the limit fails with EFBIG); "kill" restores the kernel's
# default: the process dies in the middle of the write, as on a crash
signal.signal(signal.SIGXFSZ, signal.SIG_IGN if mode == "raise" else signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
resource.setrlimit(resource.RLIMIT_FSIZE, (%d, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_text_atomic(path, "n" * (1 << 20))
except OSError as exc:
    print(exc.errno)
    sys.exit(3)
print("written")
""" % LIMIT


def _child_write(path: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD, str(path), mode], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def _assert_old_and_whole(path: Path, old: str) -> None:
    assert path.read_text() == old, f"{path} changed: {path.stat().st_size} bytes, not the old {len(old)}"
    for q in path.parent.iterdir():  # what the crash left beside it is the unfinished temporary, never the target
        if q != path:
            assert q.name.endswith(".tmp") and q.stat().st_size <= LIMIT, q


def test_a_crash_mid_write_leaves_the_old_content_whole(tmp_path: Path) -> None:
    p = tmp_path / "ready.json"
    old = "o" * 4000 + "\n"
    write_text_atomic(p, old)
    res = _child_write(p, "kill")
    assert res.returncode == -signal.SIGXFSZ, (res.returncode, res.stdout, res.stderr)  # really died mid-write
    _assert_old_and_whole(p, old)
    # the next writer replaces both the target and the crashed writer's leftover
    write_text_atomic(p, "new\n")
    assert p.read_text() == "new\n" and [q.name for q in tmp_path.iterdir()] == ["ready.json"]


def test_a_write_that_fails_midway_raises_and_leaves_the_old_content(tmp_path: Path) -> None:
    p = tmp_path / "address"
    old = "127.0.0.1:5000\n"
    write_text_atomic(p, old)
    res = _child_write(p, "raise")
    assert res.returncode == 3 and res.stdout.strip() == str(errno.EFBIG), (res.returncode, res.stdout, res.stderr)
    _assert_old_and_whole(p, old)


def test_an_unencodable_text_leaves_the_old_content(tmp_path: Path) -> None:
    p = tmp_path / "report.txt"
    write_text_atomic(p, "old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(p, "x" * 100_000 + "\udc80")  # a lone surrogate: fails inside the write
    assert p.read_text() == "old\n"


def test_a_crash_before_the_first_write_leaves_no_target(tmp_path: Path) -> None:
    p = tmp_path / "new.json"
    res = _child_write(p, "kill")
    assert res.returncode == -signal.SIGXFSZ
    assert not p.exists()  # a reader finds no file rather than half a file


def test_a_concurrent_reader_sees_old_or_new_never_part(tmp_path: Path) -> None:
    p = tmp_path / "manifest.json"
    a, b = "a" * 300_000 + "\n", "b" * 200_000 + "\n"
    write_text_atomic(p, a)
    done = threading.Event()
    seen: list[int] = []
    bad: list[tuple[int, str]] = []

    def read() -> None:
        while not done.is_set():
            with open(p) as fh:
                text = fh.read()
            seen.append(len(text))
            if text not in (a, b):
                bad.append((len(text), text[:1]))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(150):
            write_text_atomic(p, b if i % 2 == 0 else a)
    finally:
        done.set()
        reader.join(30)
    assert seen and not bad, f"{len(bad)} of {len(seen)} reads saw a partial file, e.g. {bad[:3]}"


def test_mode_is_the_runs_by_default_whatever_the_umask_and_an_old_tmp(tmp_path: Path) -> None:
    """0640 by default (a run's file: the group reads, never others), 0600 when asked (a secret)."""
    p = tmp_path / "job.toml"
    stale = tmp_path / "job.toml.tmp"
    stale.write_text("left by a crashed writer, readable by everyone")
    os.chmod(stale, 0o666)
    old_umask = os.umask(0)
    try:
        write_text_atomic(p, "a\n")
        assert stat.S_IMODE(p.stat().st_mode) == 0o640 and p.read_text() == "a\n"  # the old tmp truncated
        write_text_atomic(p, "b\n", mode=PRIVATE_FILE_MODE)
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        write_json_atomic(p, [1], mode=0o604)
        assert stat.S_IMODE(p.stat().st_mode) == 0o604
        write_json_atomic(p, [2])
        assert stat.S_IMODE(p.stat().st_mode) == 0o640
    finally:
        os.umask(old_umask)
    assert [q.name for q in tmp_path.iterdir()] == ["job.toml"]


@dataclass
class _Cfg:
    address: str
    token: str
    rows: int


def test_json_layout_encoding_and_redaction(tmp_path: Path) -> None:
    p = tmp_path / "r.json"
    assert write_json_atomic(p, {"b": 1, "a": [np.int64(2)]}) == p
    assert p.read_text() == '{\n "b": 1,\n "a": [\n  2\n ]\n}\n'  # indent 1, key order kept, newline ended
    write_json_atomic(p, {"b": 1, "a": 2}, indent=None, sort_keys=True, fsync=True)
    assert p.read_text() == '{"a": 2, "b": 1}\n'
    write_json_atomic(p, {"cfg": _Cfg("h:1", "s3cret", 3), "x": np.float32(0.25), "p": tmp_path}, indent=None)
    got = json.loads(p.read_text())
    assert got == {"cfg": {"address": "h:1", "token": "<redacted>", "rows": 3}, "x": 0.25, "p": str(tmp_path)}
    assert "s3cret" not in p.read_text()
    assert write_text_atomic(str(p), "t") == p and p.read_text() == "t"  # a str path works and returns a Path


def test_atomic_output_renames_only_on_success(tmp_path: Path) -> None:
    p = tmp_path / "scores.parquet"
    with atomic_output(p) as tmp:
        assert tmp.parent == tmp_path and tmp != p and tmp.name.endswith(".tmp") and tmp.name.startswith(".")
        tmp.write_text("v1")
        assert not p.exists()  # nothing visible until the block succeeds
    assert p.read_text() == "v1" and [q.name for q in tmp_path.iterdir()] == ["scores.parquet"]

    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_output(p) as tmp:
            tmp.write_text("half of v2")
            raise RuntimeError("writer failed")
    assert p.read_text() == "v1" and [q.name for q in tmp_path.iterdir()] == ["scores.parquet"]

    with pytest.raises(RuntimeError):
        with atomic_output(tmp_path / "never.parquet"):
            raise RuntimeError("failed before writing anything")
    assert [q.name for q in tmp_path.iterdir()] == ["scores.parquet"]
