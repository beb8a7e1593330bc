"""Atomic publish, LATEST, stale staging cleanup, keep-K retention that never breaks a chain."""

from __future__ import annotations

import numpy as np
import pytest

from delivery.bundle import DeliveryError
from delivery.loader import load_bundle
from delivery.publish import LATEST, Publisher
from tests.delivery.conftest import random_rows, write_bundle


def _publish(pub, tiny, kind_parent=None, seed=0):
    v = pub.next_version()
    st = pub.staging_dir(v)
    base = ""
    if kind_parent:
        base = pub.chain(kind_parent)[0]
    write_bundle(st, tiny, v, random_rows(tiny, 10, seed), parent=kind_parent, base=base)
    pub.publish(st, v)
    return v


def test_publish_moves_staging_into_place_and_points_latest(tmp_path, tiny):
    pub = Publisher(tmp_path / "out")
    assert pub.latest() is None
    v1 = _publish(pub, tiny)
    assert v1 == "v000001" and pub.latest() == v1
    assert not any(p.name.endswith(".tmp") for p in pub.root.iterdir())
    v2 = _publish(pub, tiny, seed=1)
    assert (pub.root / LATEST).read_text() == "v000002\n"
    assert load_bundle(pub.root).version == v2
    with pytest.raises(DeliveryError, match="already published"):
        pub.publish(pub.staging_dir(v2), v2)


def test_stale_staging_is_removed_under_the_lock(tmp_path, tiny):
    pub = Publisher(tmp_path)
    _publish(pub, tiny)
    st = pub.staging_dir("v000002")
    (st / "junk").write_text("half written")
    (tmp_path / "LATEST.tmp").write_text("v000002\n")
    with pub.locked():
        assert not st.exists() and not (tmp_path / "LATEST.tmp").exists()
        with pytest.raises(DeliveryError, match="another delivery holds"):
            with Publisher(tmp_path).locked():
                pass
    assert pub.latest() == "v000001"


def test_keep_k_keeps_every_chain_loadable(tmp_path, tiny):
    pub = Publisher(tmp_path)
    v1 = _publish(pub, tiny, seed=1)           # full
    v2 = _publish(pub, tiny, v1, seed=2)       # delta on v1
    v3 = _publish(pub, tiny, v2, seed=3)       # delta on v2
    v4 = _publish(pub, tiny, seed=4)           # full
    v5 = _publish(pub, tiny, v4, seed=5)       # delta on v4
    assert pub.retain(keep=2) == [v1, v2, v3]  # v5 needs v4 only
    assert pub.versions() == [v4, v5]
    for v in pub.versions():
        assert load_bundle(tmp_path / v).version == v


def test_keep_one_with_a_delta_latest_keeps_its_whole_chain(tmp_path, tiny):
    pub = Publisher(tmp_path)
    v1 = _publish(pub, tiny, seed=1)
    v2 = _publish(pub, tiny, v1, seed=2)
    v3 = _publish(pub, tiny, v2, seed=3)
    assert pub.retain(keep=1) == []
    assert pub.versions() == [v1, v2, v3]
    assert load_bundle(tmp_path).version == v3
    np.testing.assert_array_equal(pub.chain(v3), [v1, v2, v3])


def test_latest_naming_a_missing_version_is_a_clear_error(tmp_path, tiny):
    pub = Publisher(tmp_path)
    _publish(pub, tiny)
    (tmp_path / LATEST).write_text("v000009\n")
    with pytest.raises(DeliveryError, match=r"LATEST: names 'v000009', which is not a published version"):
        load_bundle(tmp_path)


def test_publish_fsyncs_every_file_then_the_directory_before_the_rename(tmp_path, tiny, monkeypatch):
    """Durability of a published bundle: each staged file (fsynced concurrently), then the staging
    dir, are on disk before the rename makes the version visible; LATEST after the rename."""
    import os
    import threading

    pub = Publisher(tmp_path / "out")
    v = pub.next_version()
    st = pub.staging_dir(v)
    write_bundle(st, tiny, v, random_rows(tiny, 10, 0))
    (st / "extra.bin").write_bytes(b"x" * 4096)  # more files than one
    staged = sorted(str(p) for p in st.iterdir())
    assert len(staged) >= 4
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):  # os.fsync, not a project part: records which path was made durable
        real_fsync(fd)
        with lock:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def rename(a, b):
        with lock:
            events.append(("rename", str(a)))
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    pub.publish(st, v)
    at = events.index(("rename", str(st)))
    before = [p for kind, p in events[:at] if kind == "fsync"]
    assert set(staged) <= set(before), sorted(set(staged) - set(before))
    assert before.index(str(st)) > max(before.index(f) for f in staged)  # the dir after its files
    after = [p for kind, p in events[at + 1 :] if kind == "fsync"]
    assert str(pub.root) in after and str(pub.root / (LATEST + ".tmp")) in after
    # LATEST.tmp (fsynced alongside the root's fsync) is renamed only after both are on disk,
    # and the root is fsynced once more after that rename
    latest_tmp = str(pub.root / (LATEST + ".tmp"))
    swap = events.index(("rename", latest_tmp))
    assert swap > at
    done_before = [p for kind, p in events[at + 1 : swap] if kind == "fsync"]
    assert str(pub.root) in done_before and latest_tmp in done_before
    assert ("fsync", str(pub.root)) in events[swap + 1 :]
