"""first-k evaluation layout, checked row by row on a real Parquet file (ties on time included)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from meta_io.firstk import first_k_batches, first_k_layout, read_table
from common.errors import DataError

K = 3


@pytest.fixture(scope="module")
def tied(generated, generated_schema, tmp_path_factory) -> Path:
    """600 generated rows of a few users, timestamps coarsened so many rows tie on time."""
    src = sorted(Path(generated.out_dir).glob("*.parquet"))[0]
    t = pq.read_table(src).slice(0, 600)
    users = pc.cast(pc.bit_wise_and(t.column("user_id"), 15), pa.int64())  # 16 users, sizes vary
    coarse = pc.cast(pc.bit_wise_and(t.column("log_time"), 3), pa.int64())  # times 0..3: lots of ties
    t = t.set_column(t.schema.get_field_index("user_id"), "user_id", users)
    t = t.set_column(t.schema.get_field_index("log_time"), "log_time", coarse)
    t = t.append_column("__probe", pa.array(np.arange(t.num_rows, dtype=np.int64)))  # not in the schema
    # make one user tiny (<= K rows): it must contribute no query
    keep = np.ones(t.num_rows, bool)
    tiny = np.flatnonzero(users.to_numpy() == 15)
    keep[tiny[K:]] = False
    out = tmp_path_factory.mktemp("firstk") / "rows.parquet"
    pq.write_table(t.filter(pa.array(keep)), out)
    return out


def _reference(keys: np.ndarray, times: np.ndarray, k: int) -> tuple[set[int], list[int]]:
    """Row by row, plain Python: support rows, and query rows in (task, time, row) order."""
    by_task: dict[int, list[tuple[int, int]]] = {}
    for i, (key, ts) in enumerate(zip(keys.tolist(), times.tolist())):
        by_task.setdefault(key, []).append((ts, i))
    support: set[int] = set()
    query: list[int] = []
    for key in sorted(by_task):
        rows = [i for _, i in sorted(by_task[key])]
        support.update(rows[:k])
        query.extend(rows[k:])
    return support, query


def test_every_row_once_support_first_k_by_time(tied, generated_schema) -> None:
    table = read_table(tied, generated_schema)
    keys = table.column("user_id").to_numpy()
    times = table.column("log_time").to_numpy()
    lay = first_k_layout(keys, times, K)
    want_support, want_query = _reference(keys, times, K)
    for i in range(table.num_rows):  # row by row
        assert bool(lay.is_support[i]) == (i in want_support), f"row {i}"
    assert lay.query_rows.tolist() == want_query  # each query row once, by task, then time, ties by row
    assert sorted(lay.query_rows.tolist() + sorted(want_support)) == list(range(table.num_rows))
    assert 15 not in lay.task_keys.tolist()  # <= K rows: no query
    sizes = Counter(keys.tolist())
    assert lay.task_keys.tolist() == sorted(k for k, n in sizes.items() if n > K)
    for j, key in enumerate(lay.task_keys.tolist()):  # support = that task's first K rows, in time order
        rows = lay.support[j].tolist()
        assert set(rows) <= want_support and all(keys[r] == key for r in rows)
        assert [(times[r], r) for r in rows] == sorted((times[r], r) for r in rows)


def test_episodes_split_query_without_repeating_rows(tied, generated_schema) -> None:
    table = read_table(tied, generated_schema)
    lay = first_k_layout(table.column("user_id").to_numpy(), table.column("log_time").to_numpy(), K)
    ep = lay.episodes(query_slots=5)
    q = ep.query[ep.query >= 0]
    assert sorted(q.tolist()) == sorted(lay.query_rows.tolist())  # every query row exactly once
    assert np.array_equal(ep.support, lay.support[ep.task])  # support shared, never per query row
    with pytest.raises(DataError, match="query_slots"):
        lay.episodes(0)
    with pytest.raises(DataError, match="k must be >= 1"):
        first_k_layout(np.zeros(3), np.zeros(3), 0)


def test_meta_batches_hold_the_layout(tied, generated_schema) -> None:
    table = read_table(tied, generated_schema)
    keys = table.column("user_id").to_numpy()
    items = table.column("item_id").to_numpy()
    lay = first_k_layout(keys, table.column("log_time").to_numpy(), K)
    got_q: Counter = Counter()
    got_s: Counter = Counter()
    n_tasks = 0
    for mb in first_k_batches(table, generated_schema, k=K, query_slots=4, tasks_per_batch=8):
        assert tuple(mb.support.mask.shape) == (8, K) and tuple(mb.query.mask.shape) == (8, 4)
        real = mb.task_mask.numpy()
        n_tasks += int(real.sum())
        assert mb.support.mask[real].all()  # every real episode has its K support rows
        for t in np.flatnonzero(real):
            key = int(mb.task_keys[t])
            qm = mb.query.mask[t].numpy()
            got_q.update((key, int(i)) for i in mb.query.ids["item_id"][t, qm, 0].tolist())
            got_s.update((key, int(i)) for i in mb.support.ids["item_id"][t, :, 0].tolist())
        assert not mb.query.mask[~real].any()
    assert got_q == Counter((int(keys[r]), int(items[r])) for r in lay.query_rows)
    assert n_tasks == lay.episodes(4).task.shape[0]
    # support rows seen once per episode of their task
    eps = lay.episodes(4)
    assert got_s == Counter((int(keys[r]), int(items[r])) for r in eps.support.reshape(-1))
