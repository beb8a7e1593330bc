"""The AntM2C-like generator: determinism, schema, label logic, shape of the data."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meta_io.synth import SCENES, GeneratedData, GeneratorConfig, generate, generator_schema
from meta_io.schema import ColumnKind, Schema
from meta_io.source import iter_source, normalized_arrow_schema
from common.evaluation import auc


def _read_all(data: GeneratedData) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in data.files])


SMALL = GeneratorConfig(rows=1500, users=150, items=100, seed=3, n_files=2, row_group_rows=400)


def test_same_seed_same_data_different_seed_different(tmp_path: Path) -> None:
    a = generate(tmp_path / "a", SMALL, progress=False)
    b = generate(tmp_path / "b", SMALL, progress=False)
    c = generate(tmp_path / "c", dataclasses.replace(SMALL, seed=4), progress=False)
    ta, tb, tc = _read_all(a), _read_all(b), _read_all(c)
    assert ta.equals(tb)
    assert a.oracle_auc == b.oracle_auc
    assert not ta.column("click").equals(tc.column("click"))
    assert not ta.column("user_id").equals(tc.column("user_id"))


def test_files_row_groups_and_schema_file(generated: GeneratedData, tiny_gen_config: GeneratorConfig, generated_schema: Schema) -> None:
    cfg = tiny_gen_config
    assert len(generated.files) == cfg.n_files
    assert generated.rows == cfg.rows
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in generated.files) == cfg.rows
    for f in generated.files:  # 1500 rows per file in row groups of <= 1000
        md = pq.ParquetFile(f).metadata
        assert md.num_row_groups == 2
        assert max(md.row_group(i).num_rows for i in range(md.num_row_groups)) <= cfg.row_group_rows
    assert generated.schema_path == generated.out_dir / "schema.json"
    assert generated_schema == generator_schema(cfg)
    assert generated.rows_per_s > 0 and generated.peak_rss_mb > 0 and generated.elapsed_s > 0


def test_every_column_declared_with_its_kind(generated: GeneratedData, generated_schema: Schema, tiny_gen_config: GeneratorConfig) -> None:
    cfg = tiny_gen_config
    table = _read_all(generated)
    assert table.column_names == [c.name for c in generated_schema.columns]
    n_cat = cfg.n_user_features + cfg.n_item_features + cfg.n_context_features
    assert len(generated_schema.of_kind(ColumnKind.SPARSE)) == 3 + n_cat  # user, item, scene + features
    assert n_cat >= 20  # "dozens" of categorical features by default
    assert len(generated_schema.of_kind(ColumnKind.MULTI_HOT)) == cfg.n_multi_hot
    assert len(generated_schema.dense_columns) == cfg.n_dense
    for col in generated_schema.columns:
        t = table.schema.field(col.name).type
        if col.kind in (ColumnKind.SPARSE, ColumnKind.TIMESTAMP):
            assert t == pa.int64(), col.name
        elif col.kind in (ColumnKind.MULTI_HOT, ColumnKind.TEXT):
            assert t == pa.list_(pa.int64()), col.name
            lengths = np.asarray(pa.compute.list_value_length(table.column(col.name)))
            assert lengths.max() <= col.max_len and lengths.min() >= 0
        elif col.kind == ColumnKind.VECTOR:
            assert t == pa.list_(pa.float32())
            lengths = np.asarray(pa.compute.list_value_length(table.column(col.name)))
            assert (lengths == cfg.image_dim).all()
        elif col.kind in (ColumnKind.DENSE, ColumnKind.ORACLE):
            assert t == pa.float32(), col.name
        elif col.kind == ColumnKind.LABEL:
            assert t == pa.int8()
    # ids are never negative (-1 is padding downstream)
    for col in generated_schema.id_columns:
        c = table.column(col.name)
        vals = pa.compute.list_flatten(c) if col.kind != ColumnKind.SPARSE else c
        assert pa.compute.min(vals).as_py() >= 0, col.name
    # title lengths vary (variable-length text) and the normalized import works
    title_len = np.asarray(pa.compute.list_value_length(table.column("title")))
    assert title_len.min() < title_len.max() <= cfg.text_max_len
    batches = list(iter_source(generated.out_dir, generated_schema, batch_rows=1000))
    assert sum(b.num_rows for b in batches) == cfg.rows
    assert all(b.table.schema == normalized_arrow_schema(generated_schema) for b in batches)


def test_labels_conversion_only_after_click_and_oracle(generated: GeneratedData) -> None:
    t = _read_all(generated)
    click = t.column("click").to_numpy()
    conv = t.column("conversion").to_numpy()
    p_click = t.column("p_click").to_numpy()
    p_conv = t.column("p_conversion").to_numpy()
    assert set(np.unique(click)) == {0, 1} and set(np.unique(conv)) == {0, 1}
    assert not ((conv == 1) & (click == 0)).any()
    assert ((p_conv >= 0) & (p_conv <= p_click + 1e-7) & (p_click <= 1)).all()  # CTCVR <= CTR
    for lab, p in (("click", p_click), ("conversion", p_conv)):
        exact = auc(t.column(lab).to_numpy(), p)
        assert 0.6 < generated.oracle_auc[lab] < 0.99
        assert generated.oracle_auc[lab] == pytest.approx(exact, abs=2e-3)
        # per-user terms carry real signal: removing them costs AUC
        assert generated.oracle_auc_global[lab] < generated.oracle_auc[lab]
    assert generated.oracle_auc["click"] - generated.oracle_auc_global["click"] > 0.02


def test_scenarios_present_with_different_base_rates(generated: GeneratedData) -> None:
    t = _read_all(generated)
    scene = t.column("scene").to_numpy()
    click = t.column("click").to_numpy()
    assert sorted(np.unique(scene).tolist()) == list(range(len(SCENES)))
    rates = np.array([click[scene == s].mean() for s in range(len(SCENES))])
    assert rates.max() - rates.min() > 0.15
    assert ((rates > 0.03) & (rates < 0.5)).all()
    sizes = np.bincount(scene)
    assert sizes.max() > 2 * sizes.min()  # scenarios differ in size too
    assert generated.scene_rows == {s: int(sizes[s]) for s in range(len(SCENES))}
    assert generated.scene_click_rate[0] == pytest.approx(rates[0])


def test_zipf_popularity_and_cold_users(generated: GeneratedData, tiny_gen_config: GeneratorConfig) -> None:
    cfg = tiny_gen_config
    t = _read_all(generated)
    per_user = np.bincount(t.column("user_id").to_numpy(), minlength=cfg.users)
    warm = cfg.users - cfg.cold_users
    cold = per_user[warm:]
    assert ((cold >= 1) & (cold <= 5)).all()  # every cold user appears, with 1-5 rows
    assert per_user[:warm].max() > 10 * np.median(per_user[per_user > 0])  # a heavy head
    per_item = np.bincount(t.column("item_id").to_numpy(), minlength=cfg.items)
    assert per_item.max() > 5 * np.median(per_item[per_item > 0])
    times = t.column("log_time").to_numpy()
    assert times.max() - times.min() > 5 * 86_400  # several days


def test_features_are_informative(generated: GeneratedData) -> None:
    """Item quality and the segment match score predict clicks; noise dense does not."""
    t = _read_all(generated)
    click = t.column("click").to_numpy()
    assert auc(click, t.column("dense_2").to_numpy()) > 0.58  # item quality
    assert auc(click, t.column("dense_3").to_numpy()) > 0.55  # segment x item match
    assert abs(auc(click, t.column("dense_7").to_numpy()) - 0.5) < 0.05  # pure noise
    assert auc(click, -t.column("ctx_f0").to_numpy().astype(float)) > 0.53  # position


def test_progress_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="meta_io.synth.generator"):
        generate(tmp_path, dataclasses.replace(SMALL, rows=600, n_files=1), progress=True)
    msgs = [r.getMessage() for r in caplog.records if r.name == "meta_io.synth.generator"]
    assert "generating" in msgs and msgs[-1] == "generated"


def test_rerun_replaces_old_parts(tmp_path: Path) -> None:
    generate(tmp_path, dataclasses.replace(SMALL, n_files=3), progress=False)
    data = generate(tmp_path, dataclasses.replace(SMALL, n_files=2), progress=False)
    assert sorted(tmp_path.glob("part-*.parquet")) == data.files


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rows": 0}, "rows must be >= 1"),
        ({"items": 3}, "items must be >= 5"),
        ({"rows": 100, "users": 100}, "too few for 30 cold users"),
        ({"cold_user_fraction": 1.0}, "cold_user_fraction must be in"),
        ({"zipf_users": 0.0}, "zipf exponents must be > 0"),
        ({"n_dense": -1}, "n_dense must be >= 0"),
        ({"hidden_user_effect_std": -0.1}, "hidden_user_effect_std must be a finite number >= 0, got -0.1"),
        ({"hidden_user_scene_effect_std": float("nan")}, "hidden_user_scene_effect_std must be a finite number >= 0"),
        ({"taste_std": -1.0}, "taste_std must be a finite number >= 0, got -1.0"),
        ({"taste_cvr_weight": float("inf")}, "taste_cvr_weight must be a finite number >= 0"),
        ({"taste_groups": 0}, "taste_groups must be in \\[1, 32\\], got 0"),
        ({"taste_groups": 33}, "taste_groups must be in \\[1, 32\\], got 33"),
    ],
)
def test_config_validation(change: dict, message: str, tmp_path: Path) -> None:
    cfg = dataclasses.replace(SMALL, **change)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    with pytest.raises(ValueError, match=message):
        generate(tmp_path, cfg, progress=False)
    assert not list(tmp_path.glob("*.parquet"))  # nothing written for a bad config


def test_adapting_on_eight_support_rows_pays_off() -> None:
    """The data property meta-learning relies on, checked with the hidden model.

    For users with >= 12 rows, take the global-only true logit (no personal
    terms), fit one offset per user on the user's first 8 rows in time (one
    ridge Newton step) and score the later rows: pooled AUC must rise clearly,
    and stay below the full oracle.
    """
    from meta_io.synth.generator import _World, _arrow_schema, _chunk

    cfg = GeneratorConfig(rows=20_000, users=2_000, items=1_000, seed=0, n_files=1, row_group_rows=20_000)
    world = _World(cfg)
    table, st = _chunk(world, cfg, 0, 0, cfg.rows, _arrow_schema(cfg, generator_schema(cfg)))
    order = np.lexsort((table.column("log_time").to_numpy(), table.column("user_id").to_numpy()))
    user = table.column("user_id").to_numpy()[order]
    y = st["click"][order].astype(np.float64)
    p_glob = st["p_click_global"][order]
    logit = np.log(p_glob / (1 - p_glob))
    rank = np.arange(user.size) - np.searchsorted(user, user, side="left")
    enough = np.bincount(user, minlength=cfg.users)[user] >= 12
    support, query = enough & (rank < 8), enough & (rank >= 8)
    num = np.bincount(user[support], weights=(y - p_glob)[support], minlength=cfg.users)
    den = np.bincount(user[support], weights=(p_glob * (1 - p_glob))[support], minlength=cfg.users) + 2.0
    adapted = logit + (num / den)[user]
    before, after = auc(y[query], logit[query]), auc(y[query], adapted[query])
    oracle = auc(y[query], st["p_click"][order][query])
    assert after - before > 0.02, (before, after)
    assert before > 0.7 and after < oracle


# -- hidden per-task effects (issue 29) ------------------------------------------------------------

HIDDEN: dict[str, Any] = {"hidden_user_effect_std": 1.0, "hidden_user_cvr_effect_std": 0.5, "hidden_user_scene_effect_std": 0.7}
LABEL_COLUMNS = {"click", "conversion", "p_click", "p_conversion"}


def _digest(table: pa.Table) -> str:
    """sha256 of every column's values (list columns: lengths and flattened values), in column order."""
    import hashlib

    h = hashlib.sha256()
    for name in table.column_names:
        c = table.column(name).combine_chunks()
        h.update(name.encode())
        if pa.types.is_list(c.type):
            h.update(np.asarray(pa.compute.list_value_length(c)).tobytes())
            h.update(np.asarray(pa.compute.list_flatten(c)).tobytes())
        else:
            h.update(np.asarray(c).tobytes())
    return h.hexdigest()


def test_default_world_is_the_world_of_before_the_hidden_knobs(tmp_path: Path) -> None:
    """Bit for bit: the digest of SMALL's rows recorded with the generator before the hidden-effect knobs
    existed (commit 13df852), and the same oracle AUCs."""
    data = generate(tmp_path, SMALL, progress=False)
    assert _digest(_read_all(data)) == "27a7e24bffb18b52510608603831249f6c207241f322cbd7e7eaff27453353c1"
    assert data.oracle_auc == {"click": 0.8494320732692826, "conversion": 0.920538263942314}
    assert data.oracle_auc_global == {"click": 0.752808768070396, "conversion": 0.840750544392432}


def test_hidden_effects_move_only_the_labels_by_the_documented_offsets(tmp_path: Path) -> None:
    """Every feature column of the hidden world is the default world's (no feature can reveal the
    offsets); the true logits differ by exactly hidden_click(u) + hidden_scene(u, s) (click) and
    hidden_cvr(u) (p_cvr = p_conversion / p_click)."""
    from meta_io.synth.generator import _World

    cfg = dataclasses.replace(SMALL, **HIDDEN)
    base = _read_all(generate(tmp_path / "a", SMALL, progress=False))
    hid = _read_all(generate(tmp_path / "b", cfg, progress=False))
    for name in base.column_names:
        if name not in LABEL_COLUMNS:
            assert base.column(name).equals(hid.column(name)), name
    assert not base.column("click").equals(hid.column("click"))
    world = _World(cfg)
    user, scene = base.column("user_id").to_numpy(), base.column("scene").to_numpy()
    p0, p1 = (t.column("p_click").to_numpy().astype(np.float64) for t in (base, hid))
    v0, v1 = (t.column("p_conversion").to_numpy().astype(np.float64) / p for t, p in ((base, p0), (hid, p1)))
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    ok = (np.minimum(p0, p1) > 1e-5) & (np.maximum(p0, p1) < 0.999) & (np.maximum(v0, v1) < 0.999)
    assert ok.mean() > 0.95
    want_click = world.hidden_click[user] + world.hidden_scene[user, scene]
    np.testing.assert_allclose((logit(p1) - logit(p0))[ok], want_click[ok], atol=2e-3)
    np.testing.assert_allclose((logit(v1) - logit(v0))[ok], world.hidden_cvr[user][ok], atol=2e-3)
    assert np.abs(want_click).max() > 0.5 and np.abs(world.hidden_cvr[user]).max() > 0.3  # not vacuous


def test_hidden_offsets_have_the_configured_std_and_are_independent_of_the_features() -> None:
    """One offset per user (per user and scene), std as configured, proportional to it for one seed,
    uncorrelated with every user feature and personal term; std 0 gives zeros."""
    from meta_io.synth.generator import _World

    cfg = GeneratorConfig(rows=40_000, users=4_000, items=200, seed=5)
    stds: dict[str, Any] = {"hidden_user_effect_std": 1.5, "hidden_user_cvr_effect_std": 0.75,
                            "hidden_user_scene_effect_std": 0.5}
    w = _World(dataclasses.replace(cfg, **stds))
    half = _World(dataclasses.replace(cfg, **{k: v / 2 for k, v in stds.items()}))
    zero = _World(cfg)
    for attr, knob, shape in (("hidden_click", "hidden_user_effect_std", (4000,)),
                              ("hidden_cvr", "hidden_user_cvr_effect_std", (4000,)),
                              ("hidden_scene", "hidden_user_scene_effect_std", (4000, len(SCENES)))):
        x = getattr(w, attr)
        assert x.shape == shape, attr
        assert abs(x.std() / stds[knob] - 1.0) < 0.05 and abs(x.mean()) < 4 * stds[knob] / np.sqrt(x.size), attr
        np.testing.assert_allclose(getattr(half, attr), x / 2, rtol=1e-12)
        assert not getattr(zero, attr).any(), attr
    visible = np.column_stack([w.user_feats, w.user_bias, w.user_scene_bias, w.user_vec, w.user_activity])
    offsets = np.column_stack([w.hidden_click, w.hidden_cvr, w.hidden_scene])
    corr = np.corrcoef(np.column_stack([visible, offsets]), rowvar=False)[: visible.shape[1], visible.shape[1]:]
    assert np.abs(corr).max() < 4.5 / np.sqrt(4000), np.abs(corr).max()  # ~0.071: 4.5 sd of a null correlation
    # the hidden stream is the offsets' own: the world's visible tables are the default world's
    assert np.array_equal(zero.user_feats, w.user_feats) and np.array_equal(zero.user_bias, w.user_bias)


def test_named_worlds() -> None:
    from meta_io.synth import HIDDEN_KNOBS, TASTE_KNOBS, WORLDS, world_config

    assert world_config(SMALL, "default") == SMALL
    hid = world_config(SMALL, "hidden")
    assert hid == dataclasses.replace(SMALL, **WORLDS["hidden"])
    assert hid.hidden_user_effect_std > 0 and set(WORLDS["hidden"]) <= set(HIDDEN_KNOBS)
    taste = world_config(SMALL, "taste")
    assert taste == dataclasses.replace(SMALL, **WORLDS["taste"]) and taste.taste_std > 0
    assert set(WORLDS["taste"]) <= set(TASTE_KNOBS) and taste.hidden_user_effect_std == 0
    with pytest.raises(ValueError, match="world: expected one of default, hidden, taste, got 'bogus'"):
        world_config(SMALL, "bogus")


# -- per-user tastes over item groups (issue 40) ---------------------------------------------------


def test_taste_world_moves_only_the_labels_by_the_users_taste_of_the_items_group(tmp_path: Path) -> None:
    """Every feature column of a taste world is the default world's; the click logit moves by exactly
    ``taste[user, group(item)]`` and the cvr logit by ``taste_cvr_weight`` times it; the group is a function of
    the visible item category ``item_f0``; and within one user the effect differs by group (not one offset:
    the within-user spread over groups is about ``taste_std * sqrt(1 - 1 / groups)``)."""
    from meta_io.synth.generator import N_CLUSTERS, _World

    cfg = dataclasses.replace(SMALL, taste_std=1.5, taste_groups=4, taste_cvr_weight=0.5)
    base = _read_all(generate(tmp_path / "a", SMALL, progress=False))
    tas = _read_all(generate(tmp_path / "b", cfg, progress=False))
    for name in base.column_names:
        if name not in LABEL_COLUMNS:
            assert base.column(name).equals(tas.column(name)), name
    world = _World(cfg)
    assert world.taste is not None and world.taste.shape == (SMALL.users, 4) and _World(SMALL).taste is None
    assert np.array_equal(world.item_taste_group, world.item_feats[:, 0] * 4 // N_CLUSTERS)  # visible via item_f0
    user, item = base.column("user_id").to_numpy(), base.column("item_id").to_numpy()
    p0, p1 = (t.column("p_click").to_numpy().astype(np.float64) for t in (base, tas))
    v0, v1 = (t.column("p_conversion").to_numpy().astype(np.float64) / p for t, p in ((base, p0), (tas, p1)))
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    ok = (np.minimum(p0, p1) > 1e-5) & (np.maximum(p0, p1) < 0.999) & (np.maximum(v0, v1) < 0.999)
    assert ok.mean() > 0.95
    want = world.taste[user, world.item_taste_group[item]]
    np.testing.assert_allclose((logit(p1) - logit(p0))[ok], want[ok], atol=2e-3)
    np.testing.assert_allclose((logit(v1) - logit(v0))[ok], 0.5 * want[ok], atol=2e-3)
    # not one offset per user: the effect's spread around each user's own mean, over the rows
    d = (logit(p1) - logit(p0))[ok]
    u = user[ok]
    mean_u = np.bincount(u, weights=d, minlength=SMALL.users) / np.maximum(np.bincount(u, minlength=SMALL.users), 1)
    within = float(np.sqrt(np.mean((d - mean_u[u]) ** 2)))
    assert within > 0.6, within  # one offset per user: 0
    spread = world.taste - world.taste.mean(axis=1, keepdims=True)
    assert abs(float(spread.std()) / (1.5 * np.sqrt(1 - 1 / 4)) - 1.0) < 0.15


def test_tastes_have_the_configured_std_and_are_independent_of_the_features() -> None:
    """One taste per user and group, std as configured, proportional to it for one seed, uncorrelated with
    every user feature and personal term, drawn from a stream of their own (the hidden offsets and every
    visible table are the default world's)."""
    from meta_io.synth.generator import _World

    cfg = GeneratorConfig(rows=40_000, users=4_000, items=200, seed=5)
    w = _World(dataclasses.replace(cfg, taste_std=1.5, taste_groups=3, hidden_user_effect_std=1.0))
    half = _World(dataclasses.replace(cfg, taste_std=0.75, taste_groups=3, hidden_user_effect_std=1.0))
    zero = _World(dataclasses.replace(cfg, hidden_user_effect_std=1.0))
    assert w.taste is not None and half.taste is not None and w.taste.shape == (4000, 3)
    assert abs(w.taste.std() / 1.5 - 1.0) < 0.05 and abs(w.taste.mean()) < 4 * 1.5 / np.sqrt(w.taste.size)
    np.testing.assert_allclose(half.taste, w.taste / 2, rtol=1e-12)
    visible = np.column_stack([w.user_feats, w.user_bias, w.user_scene_bias, w.user_vec, w.user_activity])
    corr = np.corrcoef(np.column_stack([visible, w.taste]), rowvar=False)[: visible.shape[1], visible.shape[1]:]
    assert np.abs(corr).max() < 4.5 / np.sqrt(4000), np.abs(corr).max()
    for name in ("user_feats", "user_bias", "item_feats", "user_interests", "hidden_click", "hidden_scene"):
        assert np.array_equal(getattr(zero, name), getattr(w, name)), name
