"""Meta-IO build: every row lands once, the episode rule, fixed shapes, bad input."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meta_io import layout as L
from meta_io.build import MetaIOBuildConfig, build, plan_episodes
from meta_io.layout import Layout, Split, make_buckets
from meta_io.reader import MetaIODataset
from meta_io.schema import Schema
from meta_io.source import iter_source
from common.errors import ConfigError, DataError, SchemaError

S, Q, R = 8, 4, 96  # R is a multiple of every bucket capacity (12, 6, 3, 2)
FP_COLS = ("user_id", "log_time", "item_id", "p_click")


# --------------------------------------------------------------------------- helpers


def source_table(generated, schema: Schema) -> pa.Table:
    return pa.concat_tables([b.table for b in iter_source(generated.out_dir, schema, 1000)])


def fingerprints(table: pa.Table | pa.RecordBatch) -> list[tuple]:
    """One hashable tuple per row (user, time, item, p_click bits)."""
    cols = [np.asarray(table.column(c).to_numpy(zero_copy_only=False)) for c in FP_COLS]
    cols[-1] = cols[-1].view(np.int32)
    return list(zip(*(c.tolist() for c in cols)))


def real_rows(rb: pa.RecordBatch) -> pa.RecordBatch:
    return rb.filter(rb.column(L.MASK_COL))


def meta_arrays(rb: pa.RecordBatch, T: int, c: int) -> dict[str, np.ndarray]:
    """Bookkeeping and fingerprint columns of a meta record batch, shaped [T, c]."""
    out = {}
    for name in (L.TASK_COL, L.SLOT_COL, L.IS_QUERY_COL, L.MASK_COL, L.TASK_KEY_COL, "user_id", "log_time"):
        out[name] = np.asarray(rb.column(name).to_numpy(zero_copy_only=False)).reshape(T, c)
    return out


def episodes_of(ds: MetaIODataset) -> list[tuple]:
    """(task key, sorted support fingerprints, sorted query fingerprints) per real episode."""
    out = []
    idx = ds.index
    for f in range(ds.num_files):
        for b, pos in enumerate(idx.rows_of("meta", f)):
            e = idx.entry(int(pos))
            rb = ds.record_batch(f, b)
            flat = fingerprints(rb)
            fps = np.empty(len(flat), dtype=object)
            fps[:] = flat
            fps = fps.reshape(e.task_slots, e.capacity)
            a = meta_arrays(rb, e.task_slots, e.capacity)
            for t in range(e.task_slots):  # test code: a loop over tasks is fine
                m = a[L.MASK_COL][t]
                if not m.any():
                    continue
                sup = tuple(sorted(fps[t][: e.support][m[: e.support]]))
                qry = tuple(sorted(fps[t][e.support :][m[e.support :]]))
                out.append((int(a[L.TASK_KEY_COL][t, 0]), sup, qry))
    return out


def expected_episode_sizes(n: int, s: int = S, q: int = Q) -> list[tuple[int, int]]:
    """The documented rule, written out directly (per task, slow and obvious)."""
    if n < 2:
        return []
    e_count = -(-n // (s + q))
    sizes = Counter(r * e_count // n for r in range(n))
    out = []
    for e in range(e_count):
        ne = sizes[e]
        nq = min(max(int(np.floor(ne * q / (s + q) + 0.5)), 1), ne - 1)
        out.append((ne - nq, nq))
    return out


@pytest.fixture(scope="module")
def meta_ds(generated, generated_schema, tmp_path_factory) -> MetaIODataset:
    out = tmp_path_factory.mktemp("meta") / "ds"
    build(generated.out_dir, generated.schema_path, out,
          MetaIOBuildConfig(support=S, query=Q, rows_per_batch=R, max_file_mb=0.5, seed=3))
    return MetaIODataset(out)


# --------------------------------------------------------------------------- episode rule


def test_make_buckets_halves_down_to_two() -> None:
    assert [(b.support, b.query) for b in make_buckets(8, 4)] == [(8, 4), (4, 2), (2, 1), (1, 1)]
    assert [b.capacity for b in make_buckets(5, 3)] == [8, 5, 3, 2]
    assert [b.capacity for b in make_buckets(8, 4, bucketing=False)] == [12]
    assert [b.capacity for b in make_buckets(1, 1)] == [2]


def test_plan_episodes_follows_the_documented_rule() -> None:
    sizes = np.arange(2, 60)
    buckets = make_buckets(S, Q)
    plan = plan_episodes(sizes, S, Q, buckets)
    got: dict[int, list[tuple[int, int]]] = {}
    for t, ns, nq in zip(plan.task.tolist(), plan.n_support.tolist(), plan.n_query.tolist()):
        got.setdefault(int(sizes[t]), []).append((ns, nq))
    for n in sizes.tolist():
        assert got[n] == expected_episode_sizes(n), n
    assert (plan.n_support <= S).all() and (plan.n_query <= Q).all()
    assert (plan.n_support >= 1).all() and (plan.n_query >= 1).all()
    # hand-checked cases: 2 -> 1+1; 5 -> 3+2 (5*4/12=1.67 -> 2); 13 -> episodes of 7 and 6
    assert got[2] == [(1, 1)] and got[5] == [(3, 2)]
    assert [a + b for a, b in got[13]] == [7, 6]
    # each episode's bucket is the smallest that fits it
    for ns, nq, lv in zip(plan.n_support, plan.n_query, plan.level):
        fits = [i for i, b in enumerate(buckets) if ns <= b.support and nq <= b.query]
        assert lv == max(fits)
    # query rows are the last ones of their episode; slots are in range
    caps = np.array([b.capacity for b in buckets])[plan.level[plan.episode]]
    assert (plan.slot < caps).all()
    assert (plan.is_query == (plan.pos >= plan.n_support[plan.episode])).all()


def test_plan_episodes_rejects_one_row_tasks() -> None:
    with pytest.raises(ValueError, match="leftover"):
        plan_episodes(np.array([3, 1]), S, Q, make_buckets(S, Q))


# --------------------------------------------------------------------------- round trip


def test_every_row_lands_exactly_once(meta_ds, generated, generated_schema) -> None:
    src = source_table(generated, generated_schema)
    out: list[tuple] = []
    for f in range(meta_ds.num_files):
        for b in range(meta_ds.num_batches(f)):
            out += fingerprints(real_rows(meta_ds.record_batch(f, b)))
    left = [fp for rb in meta_ds.leftover_record_batches() for fp in fingerprints(real_rows(rb))]
    assert Counter(out + left) == Counter(fingerprints(src))
    t = meta_ds.manifest["totals"]
    assert t["support_rows"] + t["query_rows"] + t["leftover_rows"] == t["input_rows"] == src.num_rows
    assert len(left) == t["leftover_rows"] > 0
    assert meta_ds.num_files > 1  # max_file_mb rolled files


def test_episodes_follow_the_rule_per_task(meta_ds, generated, generated_schema) -> None:
    users = source_table(generated, generated_schema).column("user_id").to_numpy()
    keys, counts = np.unique(users, return_counts=True)
    expected = Counter()
    for k, n in zip(keys.tolist(), counts.tolist()):
        for ns, nq in expected_episode_sizes(n):
            expected[(k, ns, nq)] += 1
    got = Counter((k, len(s), len(q)) for k, s, q in episodes_of(meta_ds))
    assert got == expected
    # one-row tasks, and only those, are in the leftover file
    left_users = [fp[0] for rb in meta_ds.leftover_record_batches() for fp in fingerprints(real_rows(rb))]
    assert sorted(left_users) == sorted(keys[counts == 1].tolist())
    assert meta_ds.manifest["totals"]["leftover_tasks"] == int((counts == 1).sum())


def test_fixed_shapes_masks_and_time_order(meta_ds) -> None:
    idx = meta_ds.index
    seen_padding_task = False
    for f in range(meta_ds.num_files):
        for b, pos in enumerate(idx.rows_of("meta", f)):
            e = idx.entry(int(pos))
            rb = meta_ds.record_batch(f, b)
            assert rb.num_rows == R == e.task_slots * e.capacity
            a = meta_arrays(rb, e.task_slots, e.capacity)
            assert (a[L.TASK_COL] == np.arange(e.task_slots)[:, None]).all()
            assert (a[L.SLOT_COL] == np.arange(e.capacity)[None, :]).all()
            assert (a[L.IS_QUERY_COL] == (np.arange(e.capacity) >= e.support)[None, :]).all()
            m = a[L.MASK_COL]
            sup_m, qry_m = m[:, : e.support], m[:, e.support :]
            # real slots are a prefix of the support part and of the query part
            assert (np.sort(sup_m, axis=1)[:, ::-1] == sup_m).all()
            assert (np.sort(qry_m, axis=1)[:, ::-1] == qry_m).all()
            real_task = m.any(1)
            assert (sup_m[real_task].any(1) & qry_m[real_task].any(1)).all()
            assert int(real_task.sum()) == e.n_tasks and int(m.sum()) == e.n_rows
            assert int(qry_m.sum()) == e.n_query_rows and int(sup_m.sum()) == e.n_support_rows
            seen_padding_task |= bool((~real_task).any())
            # task key: the row's user on real slots, constant per task, -1 on empty tasks
            key = a[L.TASK_KEY_COL]
            assert (key == key[:, :1]).all()
            assert (key[m] == a["user_id"][m]).all()
            assert (key[~real_task] == -1).all()
            # padding slots hold padding values
            assert (a["user_id"][~m] == -1).all()
            # split time: every support row is no later than every query row of its task
            ts = a["log_time"].astype(np.float64)
            s_max = np.where(sup_m, ts[:, : e.support], -np.inf).max(1)
            q_min = np.where(qry_m, ts[:, e.support :], np.inf).min(1)
            assert (s_max[real_task] <= q_min[real_task]).all()
    assert seen_padding_task  # some bucket's last batch is only partly filled


def test_random_split_is_seeded_and_covers_every_row(generated, generated_schema, meta_ds, tmp_path) -> None:
    cfg = MetaIOBuildConfig(support=S, query=Q, rows_per_batch=R, split=Split.RANDOM, seed=11)
    a = MetaIODataset(build(generated.out_dir, generated_schema, tmp_path / "a", cfg).out_dir)
    b = MetaIODataset(build(generated.out_dir, generated_schema, tmp_path / "b", cfg).out_dir)
    for name in a.file_names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    ep_a = episodes_of(a)
    # same episode sizes per task as the time split, different members
    assert Counter((k, len(s), len(q)) for k, s, q in ep_a) == Counter(
        (k, len(s), len(q)) for k, s, q in episodes_of(meta_ds)
    )
    assert set(ep_a) != set(episodes_of(meta_ds))
    rows_a = Counter(fp for _, s, q in ep_a for fp in s + q)
    assert rows_a == Counter(fp for _, s, q in episodes_of(meta_ds) for fp in s + q)


def test_many_partitions_give_the_same_episodes(generated, generated_schema, meta_ds, tmp_path) -> None:
    cfg = MetaIOBuildConfig(support=S, query=Q, rows_per_batch=R, seed=3, memory_budget_mb=0.4)
    res = build(generated.out_dir, generated_schema, tmp_path / "small", cfg)
    assert res.manifest["totals"]["partitions"] >= 8
    one = build(generated.out_dir, generated_schema, tmp_path / "one",
                MetaIOBuildConfig(support=S, query=Q, rows_per_batch=R, seed=3, partitions=1))
    assert one.manifest["totals"]["partitions"] == 1
    many = Counter(episodes_of(MetaIODataset(res.out_dir)))
    assert many == Counter(episodes_of(MetaIODataset(one.out_dir))) == Counter(episodes_of(meta_ds))
    assert not list(res.out_dir.glob(L.STAGING_PREFIX + "*"))  # spill files cleaned up


def test_buckets_raise_the_fill_ratio(generated, generated_schema, meta_ds, tmp_path) -> None:
    flat = build(generated.out_dir, generated_schema, tmp_path / "flat",
                 MetaIOBuildConfig(support=S, query=Q, rows_per_batch=R, seed=3, bucketing=False))
    t_flat, t_b = flat.manifest["totals"], meta_ds.manifest["totals"]
    assert [b["capacity"] for b in flat.manifest["buckets"]] == [S + Q]
    assert t_flat["fill_ratio"] == t_flat["fill_ratio_without_buckets"]
    assert t_b["episode_fill_ratio"] > t_b["episode_fill_ratio_without_buckets"]
    assert t_b["fill_ratio_without_buckets"] == pytest.approx(t_flat["fill_ratio"], abs=1e-4)
    assert t_flat["episodes"] == t_b["episodes"]


def test_plain_layout_covers_every_row_once(generated, generated_schema, tmp_path) -> None:
    B = 480  # 3000 rows: the last batch is padded
    cfg = MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=B, seed=5, memory_budget_mb=0.4)
    res = build(generated.out_dir, generated_schema, tmp_path / "plain", cfg)
    ds = MetaIODataset(res.out_dir)
    src = source_table(generated, generated_schema)
    out, masks = [], []
    for f in range(ds.num_files):
        for b in range(ds.num_batches(f)):
            rb = ds.record_batch(f, b)
            assert rb.num_rows == B
            masks.append(np.asarray(rb.column(L.MASK_COL).to_numpy(zero_copy_only=False)))
            out += fingerprints(real_rows(rb))
    assert Counter(out) == Counter(fingerprints(src))
    assert src.num_rows % B and all(m.all() for m in masks[:-1]) and masks[-1].sum() == src.num_rows % B
    assert out != fingerprints(src)  # shuffled
    assert res.manifest["totals"]["partitions"] > 1
    assert not list(ds.leftover())


# --------------------------------------------------------------------------- bad input


def test_existing_dataset_is_refused_and_kept(generated, generated_schema, meta_ds) -> None:
    manifest = (meta_ds.path / L.MANIFEST_NAME).read_bytes()
    with pytest.raises(DataError, match="already holds a Meta-IO dataset"):
        build(generated.out_dir, generated_schema, meta_ds.path, MetaIOBuildConfig(support=S, query=Q))
    assert (meta_ds.path / L.MANIFEST_NAME).read_bytes() == manifest


def test_overwrite_replaces_and_failed_overwrite_keeps(generated, generated_schema, tmp_path) -> None:
    out = tmp_path / "ds"
    build(generated.out_dir, generated_schema, out, MetaIOBuildConfig(rows_per_batch=R, max_file_mb=0.5))
    n_files = len(list(out.glob("part-?????.arrow")))
    bad = tmp_path / "bad"
    bad.mkdir()
    t = pq.read_table(generated.files[0])
    t = t.set_column(t.schema.get_field_index("click"), "click", pa.array(np.full(t.num_rows, 2, np.int8)))
    pq.write_table(t, bad / "x.parquet")
    with pytest.raises(DataError, match=r"x\.parquet.*'click'.*row 0"):
        build(bad, generated_schema, out, MetaIOBuildConfig(overwrite=True))
    assert MetaIODataset(out).total_batches > 0  # the old dataset survived
    assert not list(out.glob(L.STAGING_PREFIX + "*"))
    res = build(generated.out_dir, generated_schema, out, MetaIOBuildConfig(rows_per_batch=768, overwrite=True))
    assert res.manifest["rows_per_batch"] == 768
    assert len(list(out.glob("part-?????.arrow"))) == res.manifest["totals"]["files"] < n_files


def test_bad_source_data_names_file_column_row(generated, generated_schema, tmp_path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    t = pq.read_table(generated.files[0]).slice(0, 50)
    d0 = t.column("dense_0").to_numpy().copy()
    d0[17] = np.nan
    t = t.set_column(t.schema.get_field_index("dense_0"), "dense_0", pa.array(d0))
    pq.write_table(t, bad / "y.parquet")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"y\.parquet.*'dense_0'.*row 17"):
        build(bad, generated_schema, out, MetaIOBuildConfig())
    assert not (out / L.MANIFEST_NAME).exists()
    assert not list(out.glob("*.arrow")) and not list(out.glob(L.STAGING_PREFIX + "*"))


def test_task_key_must_be_a_key_or_sparse_column(generated, generated_schema, tmp_path) -> None:
    with pytest.raises(SchemaError, match="task key 'nope' is not a column"):
        build(generated.out_dir, generated_schema, tmp_path / "o", MetaIOBuildConfig(task_key="nope"))
    with pytest.raises(SchemaError, match="task key 'dense_0' is a column of kind 'dense'; a task key must be of kind 'key'"):
        build(generated.out_dir, generated_schema, tmp_path / "o", MetaIOBuildConfig(task_key="dense_0"))
    assert not (tmp_path / "o").exists()


def test_time_split_needs_a_timestamp(generated, generated_schema, tmp_path) -> None:
    d = generated_schema.to_dict()
    d["timestamp"] = ""
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="split 'time' needs a timestamp"):
        build(generated.out_dir, path, tmp_path / "o", MetaIOBuildConfig())
    res = build(generated.out_dir, path, tmp_path / "o", MetaIOBuildConfig(split=Split.RANDOM))
    assert res.manifest["split"] == "random"


def test_empty_input_is_refused(generated, generated_schema, tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    pq.write_table(pq.read_table(generated.files[0]).slice(0, 0), empty / "z.parquet")
    with pytest.raises(DataError, match="no rows"):
        build(empty, generated_schema, tmp_path / "o", MetaIOBuildConfig())
    assert not (tmp_path / "o" / L.MANIFEST_NAME).exists()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="support and query"):
        MetaIOBuildConfig(support=0).validate()
    with pytest.raises(ValueError, match="rows_per_batch must be >= support\\+query=12"):
        MetaIOBuildConfig(rows_per_batch=10).validate()
    with pytest.raises(ValueError, match="memory_budget_mb"):
        MetaIOBuildConfig(memory_budget_mb=0).validate()


def test_user_schema_with_string_ids(user_parquet, example_schema, tmp_path) -> None:
    """User data (string ids hashed by the source) builds the same way."""
    res = build(user_parquet, example_schema, tmp_path / "u",
                MetaIOBuildConfig(support=4, query=2, rows_per_batch=24))
    t = res.manifest["totals"]
    assert t["input_rows"] == 80 and t["support_rows"] + t["query_rows"] + t["leftover_rows"] == 80
    ds = MetaIODataset(res.out_dir)
    assert sum(int(b.support.mask.sum() + b.query.mask.sum()) for b in ds.iter_all()) == t["support_rows"] + t["query_rows"]
    shutil.rmtree(res.out_dir)
