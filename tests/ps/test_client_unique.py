"""Unique ids skip the client's np.unique: they travel in request order, rows and gradients stay matched.

Real shards on 127.0.0.1 (the ``ps_fleet`` fixture); SGD tables, so a push's effect
on each row is checkable exactly: row -= lr * its own gradient.
"""

from __future__ import annotations

import numpy as np

from ps import client as ps_client


def test_unique_unsorted_ids_pull_and_push_in_request_order(ps_fleet) -> None:
    fleet = ps_fleet(2)
    client = fleet.client()
    ids = np.random.default_rng(4).permutation(np.arange(1, 600, dtype=np.int64) * 7919)[:300]  # unique, unsorted
    assert ps_client._all_unique(ids) and not bool((np.diff(ids) > 0).all())
    rows = client.pull({"user": ids})["user"]
    single = np.stack([client.pull({"user": ids[i : i + 1]})["user"][0] for i in (0, 1, 150, 299)])
    np.testing.assert_array_equal(rows[[0, 1, 150, 299]], single)
    g = np.random.default_rng(5).standard_normal((ids.size, 8)).astype(np.float32)
    counts = client.push({"user": (ids, g)})["user"]
    assert counts["rows"] == ids.size and counts["applied"] == ids.size
    after = client.pull({"user": ids})["user"]
    np.testing.assert_allclose(after, rows - 0.5 * g, rtol=1e-6, atol=1e-6)  # SGD lr 0.5: each row its own grad
    after[:] = 0.0  # the result is the caller's (writable, not a view of the reply)


def test_all_unique() -> None:
    assert ps_client._all_unique(np.array([], dtype=np.int64))
    assert ps_client._all_unique(np.array([5, -3, 9], dtype=np.int64))
    assert not ps_client._all_unique(np.array([5, -3, 9, -3], dtype=np.int64))


def test_all_unique_matches_np_unique_on_every_path() -> None:
    """Sorted ids (the compare), random order (the hashed pre-check) and ids that all share
    one bucket (the sort fallback) each answer exactly as ``np.unique`` does."""
    rng = np.random.default_rng(11)
    n = 3000
    bits = ps_client._unique_hash_bits(n)
    inv = np.uint64(pow(int(ps_client._GOLDEN), -1, 1 << 64))  # id * GOLDEN = 2^40 + k: one bucket for all
    same_bucket = (np.arange(n, dtype=np.uint64) + np.uint64(1 << 40)) * inv
    h = (same_bucket * ps_client._GOLDEN) >> np.uint64(64 - bits)
    cases = [rng.integers(-(1 << 62), 1 << 62, 16384), rng.integers(0, 40000, 16384),  # hashed: unique / repeats
             rng.integers(0, 6, 7), rng.permutation(1500), rng.integers(0, 3000, 1500),  # small: sorted whole
             np.sort(rng.choice(1 << 40, 5000, replace=False)), rng.permutation(same_bucket.view(np.int64))]
    assert np.unique(h).size == 1 and n > ps_client._UNIQUE_SORT_MAX  # the last case really shares one bucket
    for ids in cases:
        ids = ids.astype(np.int64)
        for a in (ids, np.sort(ids)):
            assert ps_client._all_unique(a) == (np.unique(a).size == a.size)
            if np.unique(a).size == a.size:  # one repeat anywhere is found, sorted or not
                for i, j in ((0, a.size - 1), (a.size // 2, 1), (3, 4)):
                    b = a.copy()
                    b[i] = b[j]
                    assert not ps_client._all_unique(b)
