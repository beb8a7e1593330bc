"""Bundle format: LMDB rows round-trip, key order, checksums, removed ids, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from delivery.bundle import (
    EMBEDDINGS, DeliveryError, EmbeddingReader, EmbeddingWriter, encode_keys, read_manifest, read_removed,
    verify_checksums, write_removed,
)
from delivery.config import RowDtype
from tests.delivery.conftest import random_rows, write_bundle


def _write(path, tables, dtype=RowDtype.FP32):
    w = EmbeddingWriter(path, dtype, map_size_gb=1)
    for t, (ids, rows) in tables.items():
        w.write_table(t, ids, rows)
    w.close()


@pytest.mark.parametrize("dtype", [RowDtype.FP32, RowDtype.FP16])
def test_rows_round_trip_with_prefix_sharing_table_names(tmp_path, dtype):
    rng = np.random.default_rng(0)
    # "a" and "ab" share a prefix; ids near 2**62 have a first big-endian byte of 'b'-like values.
    ids_a = np.sort(np.concatenate([rng.choice(1 << 20, 300, replace=False), [0x62 << 55, (1 << 62) + 5]]))
    ids_ab = np.sort(rng.choice(1 << 40, 200, replace=False))
    tables = {
        "ab": (ids_ab.astype(np.int64), rng.normal(size=(200, 4)).astype(np.float32)),
        "a": (ids_a.astype(np.int64), rng.normal(size=(302, 8)).astype(np.float32)),
    }
    _write(tmp_path / EMBEDDINGS, tables, dtype)
    r = EmbeddingReader(tmp_path / EMBEDDINGS, {"a": 8, "ab": 4}, dtype)
    assert r.entries() == 502
    tol = 0 if dtype is RowDtype.FP32 else 2e-3
    for t, (ids, rows) in tables.items():
        got_ids, got_rows = r.scan(t, len(ids))
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_allclose(got_rows, rows, atol=tol * 4, rtol=tol)
        query = np.concatenate([ids[::7], [ids.max() + 1]])
        query.sort()
        found, got = r.get(t, query)
        assert found[:-1].all() and not found[-1]
        np.testing.assert_allclose(got[:-1], rows[::7], atol=tol * 4, rtol=tol)
        assert (got[-1] == 0).all()
    r.close()


def test_keys_are_table_prefixed_big_endian():
    keys = encode_keys("item", np.array([5, 256]))
    assert keys == [b"item\x00" + (5).to_bytes(8, "big"), b"item\x00" + (256).to_bytes(8, "big")]


def test_writer_refuses_bad_rows_naming_table_and_id(tmp_path):
    w = EmbeddingWriter(tmp_path / EMBEDDINGS, RowDtype.FP32, map_size_gb=1)
    rows = np.zeros((3, 4), np.float32)
    with pytest.raises(DeliveryError, match=r"table 'user'.*sorted and unique; id 2 follows 7"):
        w.write_table("user", np.array([1, 7, 2]), rows)
    rows[1, 2] = np.nan
    with pytest.raises(DeliveryError, match=r"table 'user'.*id 7 has NaN"):
        w.write_table("user", np.array([1, 7, 9]), rows)
    with pytest.raises(DeliveryError, match=r"table 'user'.*negative id -3"):
        w.write_table("user", np.array([-3, 7, 9]), np.zeros((3, 4), np.float32))
    with pytest.raises(DeliveryError, match=r"NUL"):
        w.write_table("us\x00er", np.array([1]), np.zeros((1, 4), np.float32))
    w.close()


def test_reader_unknown_table_and_short_file(tmp_path):
    _write(tmp_path / EMBEDDINGS, {"user": (np.arange(5), np.ones((5, 4), np.float32))})
    r = EmbeddingReader(tmp_path / EMBEDDINGS, {"user": 4, "item": 4}, RowDtype.FP32)
    with pytest.raises(DeliveryError, match=r"unknown table 'nope'"):
        r.get("nope", np.array([1]))
    with pytest.raises(DeliveryError, match=r"table 'user': expected 9 rows"):
        r.scan("user", 9)
    with pytest.raises(DeliveryError, match=r"table 'item': expected 2 rows"):
        r.scan("item", 2)
    r.close()
    with pytest.raises(DeliveryError, match=r"embeddings file not found"):
        EmbeddingReader(tmp_path / "missing.lmdb", {"user": 4}, RowDtype.FP32)


def test_removed_ids_round_trip(tmp_path):
    write_removed(tmp_path / "removed.arrow", {"user": np.array([9, 3]), "item": np.array([], np.int64), "tag": np.array([1])})
    got = read_removed(tmp_path / "removed.arrow")
    assert sorted(got) == ["tag", "user"]
    np.testing.assert_array_equal(got["user"], [3, 9])
    assert read_removed(tmp_path / "absent.arrow") == {}


def test_corrupted_file_is_detected_by_checksum(tmp_path, tiny):
    m = write_bundle(tmp_path, tiny, "v000001", random_rows(tiny, 20, seed=1))
    assert verify_checksums(tmp_path, m) == []
    data = bytearray((tmp_path / EMBEDDINGS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / EMBEDDINGS).write_bytes(bytes(data))
    problems = verify_checksums(tmp_path, read_manifest(tmp_path))
    assert len(problems) == 1 and "embeddings.lmdb: checksum mismatch" in problems[0]


def test_manifest_errors_name_the_file(tmp_path, tiny):
    with pytest.raises(DeliveryError, match=r"manifest not found"):
        read_manifest(tmp_path)
    write_bundle(tmp_path, tiny, "v000001", random_rows(tiny, 5, seed=1))
    text = (tmp_path / "manifest.json").read_text().replace('"kind": "full"', '"kind": "half"')
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(DeliveryError, match=r"manifest.json.*'kind'.*expected one of \['full', 'delta'\]"):
        read_manifest(tmp_path)
