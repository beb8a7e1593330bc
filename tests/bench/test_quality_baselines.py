"""bench.quality_baselines: the per-task offset against closed forms, the L-BFGS and the logistic
regression against their optimality conditions, the features, the report, and the whole chain on
real generated data split as bench.quality splits it (a real trained metaps model beside them)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.quality_baselines import (
    SlotEncoder, TargetEncoder, baseline_goals, compare_entry, fit_task_offsets, lbfgs, lightgbm_available,
    score_first_k, train_baselines,
)
from meta_io.batch import FeatureBatch
from meta_io.schema import schema_from_dict
from common.errors import DataError


def _sig(x: np.ndarray | float) -> Any:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def _bisect(z: float, n: int, k: int, lam: float) -> float:
    """The root of n sigmoid(z + b) - k + lam b = 0 by plain bisection (increasing in b)."""
    lo, hi = -n / lam - 1.0, n / lam + 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if n * _sig(z + mid) - k + lam * mid > 0:
            hi = mid
        else:
            lo = mid
    return 0.5 * (lo + hi)


# -- the offset -----------------------------------------------------------------------------------


def test_offset_solves_the_map_equation_for_a_constant_logit() -> None:
    # tasks with a constant base logit z, n real rows of K = 12 slots, k positives: the MAP offset
    # solves n sigmoid(z + b) - k + lambda b = 0
    cases = [(z, n, k, lam) for z in (-3.0, -0.5, 0.0, 2.0) for (n, k) in ((1, 0), (1, 1), (8, 0), (8, 3), (12, 12))
             for lam in (0.5, 4.0, 16.0)]
    kk = 12
    zz = np.array([[c[0]] * kk for c in cases])
    m = np.array([[j < c[1] for j in range(kk)] for c in cases])
    y = np.array([[j < c[2] for j in range(kk)] for c in cases], dtype=np.float64)
    for lam in (0.5, 4.0, 16.0):
        sel = np.array([c[3] == lam for c in cases])
        b = fit_task_offsets(zz[sel], y[sel], m[sel], lam)
        want = np.array([_bisect(c[0], c[1], c[2], lam) for c in cases if c[3] == lam])
        np.testing.assert_allclose(b, want, atol=1e-9)


def test_one_step_is_the_laplace_formula_and_padding_changes_nothing() -> None:
    rng = np.random.default_rng(0)
    t, k, lam = 50, 8, 4.0
    z = rng.normal(-1.0, 1.5, (t, k))
    y = (rng.random((t, k)) < 0.3).astype(np.float64)
    m = rng.random((t, k)) < 0.8
    p = _sig(z)
    laplace = (m * (y - p)).sum(1) / ((m * p * (1 - p)).sum(1) + lam)
    np.testing.assert_allclose(fit_task_offsets(z, y, m, lam, steps=1), laplace, rtol=1e-12, atol=1e-15)
    # padding slots hold garbage (NaN logits, labels of 7): the offsets do not move
    zg, yg = np.where(m, z, np.nan), np.where(m, y, 7.0)
    np.testing.assert_array_equal(fit_task_offsets(zg, yg, m, lam), fit_task_offsets(z, y, m, lam))


def test_no_support_rows_give_a_zero_offset() -> None:
    z = np.full((3, 4), 1.5)
    y = np.ones((3, 4))
    m = np.zeros((3, 4), dtype=bool)
    m[1, :2] = True
    b = fit_task_offsets(z, y, m, 4.0)
    assert b[0] == 0.0 and b[2] == 0.0 and b[1] > 0
    assert fit_task_offsets(np.zeros((0, 8)), np.zeros((0, 8)), np.zeros((0, 8)), 4.0).shape == (0,)


def test_offset_matches_models_meta_offset() -> None:
    from models.losses import HeadSpec
    from models.meta_offset import fit_offsets

    rng = np.random.default_rng(1)
    z = rng.normal(0.0, 2.0, 16)
    y = (rng.random(16) < 0.7).astype(np.float32)
    m = rng.random(16) < 0.75
    fb = FeatureBatch(ids={}, dense=torch.zeros(16, 0), vectors={}, labels={"click": torch.from_numpy(y)},
                      mask=torch.from_numpy(m), scenario=torch.zeros(16, dtype=torch.int64))
    want = fit_offsets({"click": torch.from_numpy(z)}, fb, [HeadSpec("click", "click")], steps=30, prior=2.0)["click"]
    got = fit_task_offsets(z[None], y[None], m[None], 2.0)
    assert abs(float(got[0]) - float(want)) < 1e-9


def test_offset_refuses_a_bad_prior_or_shape() -> None:
    with pytest.raises(DataError, match="lambda > 0"):
        fit_task_offsets(np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), 0.0)
    with pytest.raises(DataError, match=r"\[T, K\]"):
        fit_task_offsets(np.zeros((1, 2)), np.zeros((1, 3)), np.ones((1, 2)), 4.0)


# -- L-BFGS and the features ----------------------------------------------------------------------


def test_lbfgs_reaches_the_ridge_logistic_optimum() -> None:
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.normal(size=(400, 6)))
    y = torch.from_numpy((rng.random(400) < _sig(x.numpy() @ np.linspace(-1, 1, 6))).astype(np.float64))
    lam = 0.01

    def fn(w: torch.Tensor) -> tuple[float, torch.Tensor]:
        z = x @ w
        f = (torch.nn.functional.softplus(z) - y * z).mean() + 0.5 * lam * (w @ w)
        return float(f), x.T @ (torch.sigmoid(z) - y) / 400 + lam * w

    w = lbfgs(fn, torch.zeros(6, dtype=torch.float64), 200)
    assert float(fn(w)[1].abs().max()) < 1e-6  # the gradient vanishes: the optimum


SCHEMA = schema_from_dict({
    "task_key": "user_id", "labels": ["click"],
    "columns": [{"name": "user_id", "kind": "sparse"}, {"name": "tags", "kind": "multi_hot", "max_len": 3},
                {"name": "price", "kind": "dense"}, {"name": "click", "kind": "label"}]})


def _fb(users: list[int], tags: list[list[int]], price: list[float], click: list[float]) -> FeatureBatch:
    n = len(users)
    return FeatureBatch(ids={"user_id": torch.tensor(users)[:, None],
                             "tags": torch.tensor([t + [-1] * (3 - len(t)) for t in tags])},
                        dense=torch.tensor(price)[:, None], vectors={}, labels={"click": torch.tensor(click)},
                        mask=torch.ones(n, dtype=torch.bool), scenario=torch.zeros(n, dtype=torch.int64))


def test_slots_one_hot_unseen_ids_and_pooled_lists() -> None:
    train = _fb([5, 7, 7, 9], [[1], [1, 2], [3, 1, 2], []], [0.0, 1.0, 2.0, 3.0], [0, 1, 0, 1])
    enc = SlotEncoder(SCHEMA).fit([train])
    # user_id: slot 0 = unknown, 1..3 = ids 5, 7, 9; tags: slot 4 = unknown, 5..7 = tags 1, 2, 3
    s = enc.encode(_fb([7, 42], [[2, 3], [1, 99]], [1.5, 9.0], [0, 0]))
    rows = np.split(np.stack([s.idx, s.weight], 1), s.offsets[1:])
    assert rows[0][:3].tolist() == [[2, 1.0], [6, 0.5], [7, 0.5]]  # seen user, two tags pooled by the mean
    assert rows[1][:3].tolist() == [[0, 1.0], [5, 0.5], [4, 0.5]]  # unseen user and tag: their columns' slot 0
    assert rows[0][3, 0] != rows[1][3, 0] and len(rows[0]) == 4  # the price bucket; no slot for padding
    empty = enc.encode(_fb([9], [[]], [0.0], [0]))
    assert empty.idx.shape == (2,)  # a row with an empty list: user and price bucket only


def test_target_encoding_is_out_of_fold() -> None:
    # every row of a user sits in its user's fold: the user's own rows never enter its encoding,
    # so the training rows see the prior for user_id; the full statistics serve new rows
    rng = np.random.default_rng(3)
    users = rng.integers(0, 40, 600)
    click = (rng.random(600) < 0.2 + 0.6 * (users % 2)).astype(np.float32)
    fb = _fb(users.tolist(), [[int(u % 3)] for u in users], rng.normal(size=600).tolist(), click.tolist())
    enc = TargetEncoder(SCHEMA, ["click"])
    x, y = enc.fit_transform([fb])
    np.testing.assert_allclose(x[:, 1], click.mean())  # user_id's rate column: the prior on every training row
    full = enc.transform(_fb([1, 2], [[0], [0]], [0.0, 0.0], [0, 0]))
    assert full[0, 1] > click.mean() > full[1, 1]  # odd users click more: the full statistics show it


# -- the report -----------------------------------------------------------------------------------


def _ev(base: float, adapted: float, rows: int = 100) -> dict[str, Any]:
    return {"base": {h: {"auc": base, "logloss": 0.5, "rows": rows, "oracle_auc": 0.9} for h in ("click", "conversion")},
            "adapted": {h: {"auc": adapted, "logloss": 0.4, "rows": rows} for h in ("click", "conversion")}}


def _sc(base: float, offset: float, rows: int = 100) -> dict[str, Any]:
    return {h: {"rows": rows, "base": {"auc": base, "logloss": 0.5}, "offset": {"auc": offset, "logloss": 0.5}}
            for h in ("click", "conversion")}


def test_compare_entry_goal_and_checks() -> None:
    heads = ["click", "conversion"]
    scored = {"metaps_plain": _sc(0.70, 0.74), "metaps_meta": _sc(0.69, 0.73), "logreg": _sc(0.72, 0.76)}
    info = {"lightgbm": "not installed"}
    e = compare_entry(_ev(0.69, 0.75), _ev(0.70, 0.71), scored, info, heads, 4.0)
    assert e["click"]["lightgbm"] == "not installed"
    assert e["click"]["metaps_plain"]["finetuned"]["auc"] == 0.71 and e["click"]["oracle_auc"] == 0.9
    g = e["goal"]["click"]
    assert g["best"] == "logreg+offset" and g["met"] is False and g["margin"] == pytest.approx(-0.01)
    scored["lightgbm"] = _sc(0.70, 0.745)
    scored["logreg"] = _sc(0.72, 0.74)
    g = compare_entry(_ev(0.69, 0.75), _ev(0.70, 0.71), scored, info, heads, 4.0)["goal"]["conversion"]
    assert g["best"] == "lightgbm+offset" and g["met"] is True and g["margin"] == pytest.approx(0.005)
    scored["logreg"] = _sc(0.72, 0.74, rows=99)
    with pytest.raises(DataError, match="logreg scored 99 click rows"):
        compare_entry(_ev(0.69, 0.75), _ev(0.70, 0.71), scored, info, heads, 4.0)
    scored["logreg"] = _sc(0.72, 0.74)
    scored["metaps_meta"] = _sc(0.60, 0.73)
    with pytest.raises(DataError, match="metaps_meta click base AUC"):
        compare_entry(_ev(0.69, 0.75), _ev(0.70, 0.71), scored, info, heads, 4.0)


def test_baseline_goals_over_seeds() -> None:
    def seed(mc: float, mv: float) -> dict[str, Any]:
        goal = {"click": {"margin": mc, "best": "logreg+offset", "met": mc >= 0},
                "conversion": {"margin": mv, "best": "metaps_plain+offset", "met": mv >= 0}}
        return {"first_k_by_k": {8: {"baselines": {"goal": goal}}}}

    out = baseline_goals({3: seed(0.01, 0.002), 4: seed(0.003, -0.001), 5: seed(0.02, 0.0)}, [8])
    by = out["by_k"][8]
    assert by["click"]["margin"] == {"median": 0.01, "min": 0.003, "max": 0.02} and by["click"]["met_every_seed"]
    assert by["conversion"]["per_seed"][4] == {"margin": -0.001, "best": "metaps_plain+offset", "met": False}
    assert not by["conversion"]["met_every_seed"]
    assert out["adapted>=best_baseline+offset(both heads, every seed)"] is False


# -- the chain on real data -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from bench.quality import cold_generator_config, cold_sizes, cold_split
    from meta_io.holdout import split_by_task
    from meta_io.schema import load_schema
    from meta_io.synth import generate

    tmp = tmp_path_factory.mktemp("baselines")
    rows, users, items, fraction = cold_sizes(True, 4000)
    gen = generate(tmp / "raw", cold_generator_config(rows, users, items, 3), progress=False)
    split = cold_split(gen, tmp, 3, fraction)
    schema = load_schema(split.schema_path)
    vsplit = split_by_task(split.train_dir, schema, tmp / "vsplit", fraction=0.1, seed=1003)
    return tmp, split, vsplit, schema


def test_baselines_on_generated_rows_beside_a_trained_model(data: Any) -> None:
    from bench.quality import first_k_baselines, job_for
    from meta_io.build import MetaIOBuildConfig, build
    from models.meta import MetaConfig
    from workers.eval_protocols import evaluate_protocol, protocol_batches
    from workers.local import train_local

    tmp, split, vsplit, schema = data
    bl = train_baselines(vsplit.train_dir, vsplit.holdout_dir, schema, ["click", "conversion"], smoke=True)
    info = bl.info["logreg"]
    assert info["train_rows"] > 2000 and info["val_rows"] > 100
    assert info["val"]["click"]["auc"] > 0.65 and info["val"]["conversion"]["auc"] > 0.65  # it learned
    if lightgbm_available():
        assert bl.info["lightgbm"]["heads"]["click"]["val"]["auc"] > 0.6
    else:
        assert bl.info["lightgbm"] == "not installed" and "lightgbm" not in bl.sources
    # the logistic regression + offset on the held-out users' first-k rows
    batches = list(protocol_batches("first-k", split.holdout_dir, schema, k=8))
    sc = score_first_k(batches, bl.sources["logreg"], ["click", "conversion"], 4.0)
    assert sc["click"]["rows"] > 500 and math.isfinite(sc["click"]["offset"]["logloss"])
    assert 0.6 < sc["click"]["base"]["auc"] < sc["click"]["oracle_auc"]
    # plain rows (the time split's scoring): the same query rows score as under first-k's base
    from bench.quality_baselines import score_rows

    rows = score_rows((mb.query for mb in batches), bl.rows["logreg"], ["click", "conversion"])
    for h in ("click", "conversion"):
        assert rows[h]["rows"] == sc[h]["rows"]
        assert rows[h]["auc"] == pytest.approx(sc[h]["base"]["auc"], abs=1e-12)
        assert rows[h]["logloss"] == pytest.approx(sc[h]["base"]["logloss"], abs=1e-12)
        assert rows[h]["oracle_auc"] == pytest.approx(sc[h]["oracle_auc"], abs=1e-12)
        assert rows[h]["norm_auc"] == pytest.approx((rows[h]["auc"] - 0.5) / (rows[h]["oracle_auc"] - 0.5))

    # wired into bench.quality beside a real (plain, 1 epoch) model standing in for both metaps arms
    mtrain = build(vsplit.train_dir, vsplit.schema_path, tmp / "m-train", MetaIOBuildConfig(support=8, query=8,
                                                                                          rows_per_batch=256)).out_dir
    _, w = train_local(job_for(mtrain, mtrain, tmp / "run", "plain", "dnn", 1), tmp / "run", checkpoint=False)
    w.trainer.refresh_dense()
    fk = evaluate_protocol(w.model, w.rows, batches, MetaConfig(inner_steps=1, inner_lr=0.1), task_key="user_id")
    res: dict[str, Any] = {"first_k_by_k": {8: {"meta": fk, "plain": fk}}}
    first_k_baselines(res, [8], w, w, vsplit, split.holdout_dir, schema, 4.0, smoke=True)
    e = res["first_k_by_k"][8]["baselines"]
    for h in ("click", "conversion"):
        assert e[h]["rows"] == fk["base"][h]["rows"]
        assert e[h]["metaps_plain"]["offset"] == e[h]["metaps_meta"]["offset"]  # the same model twice
        assert e["goal"][h]["adapted"] == fk["adapted"][h]["auc"]
        assert set(e["goal"][h]) == {"adapted", "best", "best_auc", "margin", "met"}
    assert res["baselines"]["logreg"]["chosen_l2"]["click"] > 0
