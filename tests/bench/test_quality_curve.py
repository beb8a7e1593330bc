"""bench.quality_curve's arithmetic: the per-task offset options and their choice on validation users, the
comparison figures (best rival, gap split, rows-only share), the summary over seeds and the goals. Pure
functions on small arrays (the arms' logits come from real models in the --smoke run, tests/bench/test_bench_smoke.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.quality_baselines import fit_task_offsets
from bench.quality_curve import (FirstK, choose, goals, option_metrics, parse_ints, parse_priors, parse_sets,
                                 run_figures, summarize)
from common.evaluation import auc


def _first_k(seed: int) -> tuple[FirstK, list[np.ndarray], list[np.ndarray]]:
    """Two batches of 3 tasks; each task's click rate differs (a per-task logit effect) and the base logits
    know only a per-row feature: the offset fitted on the support must lift the AUC over tasks."""
    rng = np.random.default_rng(seed)
    sm, qm, ys, yq, zs, zq = [], [], [], [], [], []
    for _ in range(2):
        t, k, q = 3, 8, 40
        effect = rng.normal(0, 2.0, t)[:, None]
        xs, xq = rng.normal(size=(t, k)), rng.normal(size=(t, q))
        ys.append((rng.random((t, k)) < 1 / (1 + np.exp(-(xs + effect)))).astype(np.float64))
        yq.append((rng.random((t, q)) < 1 / (1 + np.exp(-(xq + effect)))).astype(np.float64))
        m = np.ones((t, q), bool)
        m[0, 30:] = False  # padding is not scored
        sm.append(np.ones((t, k), bool))
        qm.append(m)
        zs.append(xs)
        zq.append(xq)
    fk = FirstK([], sm, qm, {"click": ys}, {"click": yq}, {})
    return fk, zs, zq


def test_offset_options_against_a_reference_and_chosen_on_validation() -> None:
    fk, zs, zq = _first_k(0)
    got = option_metrics(fk, {"click": (zs, zq)}, [1.0, 16.0])["click"]
    t = np.concatenate([y[m] for y, m in zip(fk.yq["click"], fk.qm)])
    for p in (1.0, 16.0):  # reference: per batch, the task offsets added to the scored rows' logits
        z = np.concatenate([(q + fit_task_offsets(s, y, m, p)[:, None])[qm]
                            for s, q, y, m, qm in zip(zs, zq, fk.ys["click"], fk.sm, fk.qm)])
        assert got[f"prior_{p:g}"]["auc"] == pytest.approx(auc(t, z), abs=1e-12)
    assert got["none"]["auc"] == pytest.approx(auc(t, np.concatenate([q[m] for q, m in zip(zq, fk.qm)])), abs=1e-12)
    assert got["prior_1"]["auc"] > got["none"]["auc"] + 0.02  # the per-task effect is what the offset finds
    assert choose({"click": got}) == {"click": "prior_1"}
    # no support logits (rows-only arm): the logits as they are only
    assert list(option_metrics(fk, {"click": (None, zq)}, [1.0])["click"]) == ["none"]


def _arm(auc_none: float, chosen_auc: float | None = None, opt: str = "none") -> dict:
    held = {h: {"none": {"auc": auc_none, "logloss": 0.5}} for h in ("click", "conversion")}
    a = chosen_auc if chosen_auc is not None else auc_none
    return {"chosen": {h: opt for h in held}, "auc": {h: a for h in held}, "held": held}


def test_run_figures_best_rival_gap_split_and_rows_only_share() -> None:
    arms = {"gmeta": _arm(0.70), "gmeta_adapted": _arm(0.74, 0.75, "prior_4"), "gmeta_rows_only": _arm(0.72),
            "plain": _arm(0.71, 0.73, "prior_1"), "plain_ft": _arm(0.74, 0.76, "prior_1"), "logreg": _arm(0.72, 0.74)}
    f = run_figures(arms, ("click",))
    assert f["best_other"] == {"click": "plain_ft[prior_1]"}
    assert f["adapted_minus_best_other"]["click"] == pytest.approx(-0.01)
    # plain + ft's base is the plain model's: the base gap is 0.70 - 0.71, the rest is adaptation
    assert f["gap_split"]["click"] == pytest.approx({"total": -0.01, "base": -0.01, "adaptation": 0.0,
                                                     "rival_base": "plain"})
    assert f["rows_only_gain_share"]["click"] == pytest.approx(0.5)  # (0.72 - 0.70) / (0.74 - 0.70)
    arms["gmeta_adapted"] = _arm(0.7005, 0.78)  # rows + dense gain under 0.001: no ratio
    f = run_figures(arms, ("click",))
    assert f["rows_only_gain_share"]["click"] is None
    assert f["best_other"] == {"click": "plain_ft[prior_1]"} and f["adapted_minus_best_other"]["click"] == pytest.approx(0.02)
    assert f["gap_split"]["click"]["base"] == pytest.approx(-0.01)


def _run(margin: tuple[float, float], share: tuple[float | None, float | None], rows: tuple[float, float]) -> dict:
    hs = ("click", "conversion")
    return {"adapted_minus_best_other": dict(zip(hs, margin)), "taste_gain_share": dict(zip(hs, share)),
            "rows_only_gain_share": dict(zip(hs, rows)), "rows_only_gain": dict(zip(hs, rows)),
            "rows_dense_gain": dict(zip(hs, rows)),
            "gap_split": {h: {"total": m, "base": m / 2, "adaptation": m / 2} for h, m in zip(hs, margin)},
            "arms": {"gmeta": {"auc": {"click": 0.7, "conversion": 0.8}}}, "oracle_auc": {"click": 0.9, "conversion": 0.95}}


def test_summary_minimums_and_goals() -> None:
    taste = summarize({3: _run((0.01, 0.004), (0.9, 0.6), (0.7, 0.8)), 4: _run((0.006, 0.02), (0.55, None), (0.6, 0.4))})
    assert taste["adapted_minus_best_other_min"] == {"click": 0.006, "conversion": 0.004}
    assert taste["taste_gain_share_min"] == {"click": 0.55, "conversion": 0.6}  # a seed without a share is left out
    assert taste["taste_gain_share"]["conversion"]["seeds"] == 1
    hidden = summarize({3: _run((-0.001, -0.0025), (None, None), (0.5, 0.5))})
    small = summarize({3: _run((-0.05, -0.04), (None, None), (0.1, 0.1))})
    g = goals({"16000": {"taste": small}, "64000": {"taste": taste, "hidden": hidden}}, 64_000)
    assert "16000/taste" not in g  # below the goals' smallest size: reported, not judged
    t = g["64000/taste"]
    assert t["click_adapted>=best_other"] == {"margin": 0.006, "met": True}
    assert t["click_taste_gain_share>=0.5"]["margin"] == pytest.approx(0.05) and t["click_taste_gain_share>=0.5"]["met"]
    assert t["conversion_rows_only_gain_share>=0.5"]["met"] is False  # seed 4: 0.4
    assert t["met"] is False
    h = g["64000/hidden"]
    assert h["click_adapted>=best_other-0.002"]["met"] and h["click_adapted>=best_other-0.002"]["margin"] == pytest.approx(0.001)
    assert h["conversion_adapted>=best_other-0.002"]["met"] is False
    assert g["all_met"] is False
    none = goals({"64000": {"taste": summarize({3: _run((0.01, 0.01), (None, None), (0.9, 0.9))})}}, 64_000)
    assert none["64000/taste"]["click_taste_gain_share>=0.5"] == {"margin": None, "met": False}  # no ceiling: missed


def test_flags_refused_in_one_line() -> None:
    from bench.quality_curve import CurveError, main

    assert parse_ints("16000,64000", "--sizes") == [16000, 64000]
    assert parse_priors("1,4,16") == [1.0, 4.0, 16.0]
    assert parse_sets(["meta.inner_lr=0.5", "model.hidden=[32, 16]", "meta.adapt=rows"]) == {
        "meta": {"inner_lr": 0.5, "adapt": "rows"}, "model": {"hidden": [32, 16]}}
    nested = parse_sets(["ps.table_defaults.optimizer.lr=0.02", "model.dropout=0.1"])
    assert nested == {"ps": {"table_defaults": {"optimizer": {"lr": 0.02}}}, "model": {"dropout": 0.1}}
    from bench.quality_setup import job_for

    job = job_for(Path("t"), Path("e"), Path("r"), "plain", "dnn", 1, None,
                  parse_sets(["ps.table_defaults.optimizer.lr=0.02", "model.hidden=[16]"]))
    assert job.ps.table_defaults.optimizer.lr == 0.02 and job.ps.table_defaults.optimizer.kind == "rowwise_adagrad"
    assert job.ps.table_defaults.dim == 8 and list(job.model.hidden) == [16]  # siblings of a nested set kept
    for bad, flag in ((lambda: parse_ints("16000,x", "--sizes"), "--sizes"), (lambda: parse_ints("3,3", "--seeds"), "--seeds"),
                      (lambda: parse_priors("1,0"), "--priors"), (lambda: parse_sets(["data.train=x"]), "--set data.train"),
                      (lambda: parse_sets(["inner_lr=0.5"]), "--set")):
        with pytest.raises(CurveError, match=flag):
            bad()
    with pytest.raises(SystemExit, match="--worlds: expected names of"):
        main(["--worlds", "nowhere"])
