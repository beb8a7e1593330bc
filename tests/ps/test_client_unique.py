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
