"""PsClient.pull_groups / push_groups: a step's storage group as one job, the same as table by table.

Three real shards on loopback (the group's ids split across them, a frame section run per
shard) and one; the framed data plane and the protobuf fallback (an older shard); and the
in-process LocalRowSource when the store groups its tables otherwise (the per-table path).
Judged on what the shards hold afterwards, against a second fleet fed table by table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.shard_store import ShardStore
from workers.row_source import LocalRowSource

DIM = 8
TABLES = [TableConfig(name=n, dim=DIM, capacity=4096, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD))
          for n in ("user", "item", "tag")]


def _step(rng: np.random.Generator) -> tuple[tuple[str, ...], np.ndarray, torch.Tensor, torch.Tensor]:
    sizes = [int(rng.integers(1, 60)) for _ in TABLES]
    ids = [np.sort(rng.choice(5000, size=n, replace=False)).astype(np.int64) for n in sizes]
    flat = torch.from_numpy(np.concatenate(ids))
    return tuple(t.name for t in TABLES), np.array(sizes, dtype=np.int64), flat, torch.randn(flat.numel(), DIM)


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("framed", [True, False])
def test_groups_equal_table_by_table(ps_fleet, shards: int, framed: bool) -> None:
    grouped, ref = ps_fleet(shards, tables=TABLES), ps_fleet(shards, tables=TABLES)
    cg, cr = grouped.client(framed=framed), ref.client()
    rng = np.random.default_rng(4)
    for _ in range(6):
        names, counts, flat, grads = _step(rng)
        rows = cg.pull_groups([names], [counts], [flat], [DIM])[0]
        parts = torch.split(flat, counts.tolist())
        want = cr.pull({t: p.numpy() for t, p in zip(names, parts)})
        np.testing.assert_array_equal(rows.numpy(), np.concatenate([want[t] for t in names]))
        got = cg.push_groups([names], [counts], [flat], [grads])
        sent = cr.push({t: (p.numpy(), g.numpy()) for t, p, g in zip(names, parts, torch.split(grads, counts.tolist()))})
        assert got == sent
    for a, b in zip(grouped.servers, ref.servers):  # what every shard holds
        for t in ("user", "item", "tag"):
            ra, rb = a.store.all_rows(t), b.store.all_rows(t)
            oa, ob = np.argsort(ra.ids), np.argsort(rb.ids)
            np.testing.assert_array_equal(ra.ids[oa], rb.ids[ob])
            np.testing.assert_array_equal(ra.weights[oa], rb.weights[ob])


def test_local_source_takes_the_per_table_path_when_the_store_groups_otherwise() -> None:
    """The trainer's groups come from the job; a store built with its tables in another order
    (or grouped otherwise) is still served, table by table, with the same result."""
    store = ShardStore(list(reversed(TABLES)), shard_id=0, num_vshards=8, seed=1)
    ref = ShardStore(TABLES, shard_id=0, num_vshards=8, seed=1)
    src, ref_src = LocalRowSource(store), LocalRowSource(ref)

    class Idx:
        def __init__(self, names: tuple[str, ...], counts: np.ndarray, ids: torch.Tensor) -> None:
            self.tables, self.counts, self.ids, self.dims = [names], [counts], [ids], [DIM]

    rng = np.random.default_rng(9)
    for _ in range(4):
        names, counts, flat, grads = _step(rng)
        idx = Idx(names, counts, flat)
        assert src._group(names) is None and ref_src._group(names) == 0
        torch.testing.assert_close(src.pull_groups(idx)[0], ref_src.pull_groups(idx)[0])
        src.push_groups(idx, [grads], 0)
        ref_src.push_groups(idx, [grads], 0)
    for t in ("user", "item", "tag"):
        a, b = store.all_rows(t), ref.all_rows(t)
        oa, ob = np.argsort(a.ids), np.argsort(b.ids)
        np.testing.assert_array_equal(a.weights[oa], b.weights[ob])
