"""bench.quality_ceiling: the Bayes ceiling of first-k adaptation on the generator.

Importance weights and AUCs against brute force on a tiny case, the feature-conditioned sampler
against rejection sampling from the prior, an exactly-zero gain when the personal terms have no
prior variance (on real generated data, split as bench.quality splits it), and a posterior that
reaches the oracle when a user's support is long.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from bench.quality import cold_generator_config, cold_sizes, cold_split
from bench.quality_ceiling import (
    CLICK_INTER, CVR_BIAS, CVR_INTER, CeilingError, Prior, Rows, Samples, UserEvidence, bucket_intervals,
    ceiling_for_split, head_aucs, predictive, replay_world, sample_personal,
)


def _rows(rng: np.random.Generator, users: int, per_user: int, k: int = 8, scenes: int = 5) -> Rows:
    n = users * per_user
    return Rows(user=np.repeat(np.arange(users), per_user), rank=np.tile(np.arange(per_user), users),
                scene=rng.integers(0, scenes, n), item_vec=rng.normal(size=(n, k)) / math.sqrt(k),
                g_click=rng.normal(-1.0, 1.0, n), g_cvr=rng.normal(-1.5, 1.0, n),
                click=np.zeros(n), conversion=np.zeros(n))


def _draw_labels(rows: Rows, pc: np.ndarray, pv: np.ndarray, rng: np.random.Generator) -> Rows:
    click = (rng.random(pc.shape[0]) < pc).astype(np.float64)
    conv = click * (rng.random(pc.shape[0]) < pv)
    return dataclasses.replace(rows, click=click, conversion=conv)


def _bias_only_case(rng: np.random.Generator, users: int, per: int
                    ) -> tuple[Rows, Prior, UserEvidence, np.ndarray, np.ndarray]:
    """Synthetic rows whose only personal term is a user bias (std 0.8), labels drawn from it, and
    no user evidence: (rows, prior, evidence, p_click, p_cvr)."""
    rows = _rows(rng, users, per)
    prior = Prior(bias_std=0.8, scene_std=0.0, personal_scale=0.0)
    true_b = prior.bias_std * rng.normal(size=users)
    pc = 1 / (1 + np.exp(-(rows.g_click + true_b[rows.user])))
    pv = 1 / (1 + np.exp(-(rows.g_cvr + CVR_BIAS * true_b[rows.user])))
    ev = UserEvidence(bias_interval=None, proj=np.zeros((0, 8)), proj_offset=np.zeros((users, 0)),
                      proj_interval=np.zeros((users, 0, 2)), cluster_center=None, seg_vec=np.zeros((users, 8)),
                      interests=None)
    return _draw_labels(rows, pc, pv, rng), prior, ev, pc, pv


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("hidden", [False, True], ids=["no-hidden", "hidden-offsets"])
def test_predictive_weights_match_brute_force(hidden: bool) -> None:
    """(``hidden``: with the hidden per-user click / cvr logit offsets of a hidden-effects world.)"""
    rng = np.random.default_rng(0)
    rows = _rows(rng, users=3, per_user=5)
    rows = _draw_labels(rows, np.full(15, 0.5), np.full(15, 0.5), rng)
    m = 6
    s = Samples(bias=rng.normal(size=(3, m)), scene_bias=rng.normal(size=(3, m, 5)),
                personal=rng.normal(size=(3, m, 8)), log_w=rng.normal(size=(3, m)),
                click_offset=rng.normal(size=(3, m)) if hidden else None,
                cvr_offset=rng.normal(size=(3, m)) if hidden else None)
    off_click = s.click_offset if s.click_offset is not None else np.zeros((3, m))
    off_cvr = s.cvr_offset if s.cvr_offset is not None else np.zeros((3, m))
    ks = [1, 3]
    got = predictive(rows, s, ks, budget=10)  # a small budget: several chunks of users
    for r in range(15):
        u = int(rows.user[r])
        pc, pconv, loglik = [], [], []
        for j in range(m):
            def logits(i: int) -> tuple[float, float]:
                inter = float(sum(s.personal[u, j, d] * rows.item_vec[i, d] for d in range(8)))
                lc = rows.g_click[i] + CLICK_INTER * inter + s.bias[u, j] + s.scene_bias[u, j, rows.scene[i]] \
                    + off_click[u, j]
                return lc, rows.g_cvr[i] + CVR_INTER * inter + CVR_BIAS * s.bias[u, j] + off_cvr[u, j]
            lc, lv = logits(r)
            pc.append(_sig(lc))
            pconv.append(_sig(lc) * _sig(lv))
            per_k = []
            for k in ks:
                ll = 0.0
                for i in range(15):
                    if rows.user[i] == u and rows.rank[i] < k:
                        c, v = logits(i)
                        y, z = rows.click[i], rows.conversion[i]
                        p = (1 - _sig(c)) if y == 0 else _sig(c) * (_sig(v) if z == 1 else 1 - _sig(v))
                        ll += math.log(p)
                per_k.append(ll)
            loglik.append(per_k)
        w0 = np.exp(s.log_w[u])
        assert got["prior"]["click"][r] == pytest.approx(float(w0 @ pc / w0.sum()), rel=1e-12)
        assert got["prior"]["conversion"][r] == pytest.approx(float(w0 @ pconv / w0.sum()), rel=1e-12)
        for ki, k in enumerate(ks):
            if rows.rank[r] < k:
                assert np.isnan(got["posterior"][k]["click"][r])
                continue
            w = w0 * np.exp([ll[ki] for ll in loglik])
            assert got["posterior"][k]["click"][r] == pytest.approx(float(w @ pc / w.sum()), rel=1e-10)
            assert got["posterior"][k]["conversion"][r] == pytest.approx(float(w @ pconv / w.sum()), rel=1e-10)
    assert got["ess_prior"][0] == pytest.approx(float(np.exp(s.log_w[0]).sum() ** 2 / (np.exp(s.log_w[0]) ** 2).sum()))


def test_head_aucs_match_pairwise_count() -> None:
    rng = np.random.default_rng(1)
    n = 60
    label = (rng.random(n) < 0.4).astype(np.float64)
    scores = {name: np.round(rng.random(n), 1) for name in ("oracle_global", "prior_predictive",
                                                             "posterior_predictive", "oracle")}  # with ties
    scored = np.flatnonzero(rng.random(n) < 0.7)
    got = head_aucs(label, scores, scored)
    for name, sc in scores.items():
        y, x = label[scored], sc[scored]
        pos, neg = x[y == 1], x[y == 0]
        pairs = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
        assert got[name] == pytest.approx(pairs / (len(pos) * len(neg)), abs=1e-12)
    assert got["ceiling_gain"] == got["posterior_predictive"] - got["prior_predictive"]
    bad = dict(scores, posterior_predictive=np.full(n, np.nan))
    with pytest.raises(CeilingError, match="posterior_predictive: .* no finite score"):
        head_aucs(label, bad, scored)


def test_feature_conditioned_draws_match_rejection_from_the_prior() -> None:
    """GHK + exact truncated bias draws give the same conditional means as accepting prior draws
    whose feature scores fall in the buckets (tolerance: 5 standard errors of either estimate)."""
    rng = np.random.default_rng(2)
    k, d = 8, 3
    proj = rng.normal(size=(d, k))
    seg = rng.normal(size=(2, k)) * 0.5
    off = seg @ proj.T
    prior = Prior()
    iv = np.stack([np.stack([off[t] + np.array([-0.5, 0.3, 0.8]), off[t] + np.array([0.5, 1.6, 2.0])], axis=1)
                   for t in range(2)])  # [T, d, 2]
    bias_iv = np.array([[0.2, 0.9], [-np.inf, -0.7]])
    ev = UserEvidence(bias_interval=bias_iv, proj=proj, proj_offset=off, proj_interval=iv, cluster_center=None,
                      seg_vec=seg, interests=None)
    s = sample_personal(ev, prior, 5, 20_000, np.random.default_rng(3))
    w = np.exp(s.log_w - s.log_w.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    n = 800_000
    for t in range(2):
        r = np.random.default_rng(10 + t)
        q = prior.personal_scale * r.normal(size=(n, k))
        y = off[t] + q @ proj.T
        ok = np.all((y >= iv[t, :, 0]) & (y < iv[t, :, 1]), axis=1)
        b = prior.bias_std * r.normal(size=n)
        sb = b + 0.6 * r.normal(size=n)
        okb = (sb >= bias_iv[t, 0]) & (sb < bias_iv[t, 1])
        assert ok.sum() > 1000 and okb.sum() > 1000, (ok.sum(), okb.sum())
        ess = 1.0 / (w[t] ** 2).sum()
        for dim in range(k):
            ref = q[ok, dim]
            se = ref.std() * math.sqrt(1 / ok.sum() + 1 / ess)
            assert abs(float(w[t] @ s.personal[t, :, dim]) - ref.mean()) < 5 * se + 1e-3, (t, dim)
        se_b = b[okb].std() * math.sqrt(1 / okb.sum() + 1 / 20_000)
        assert abs(float(s.bias[t].mean()) - b[okb].mean()) < 5 * se_b, t


def test_posterior_reaches_the_oracle_with_a_long_support() -> None:
    """K = 400 support rows per user (bias-only prior, so 2000 draws cover its 1-D posterior): the
    posterior-predictive AUC is within 0.01 of the oracle's on both heads, while the prior-predictive
    (no labels) is more than 0.03 below it.

    Why 0.01: with 400 rows the bias posterior sd is about 1 / sqrt(400 p (1 - p)) ~ 0.1 logit against a
    user spread of 0.8 (~2% of the user-effect variance left), so what remains is mostly the label noise
    of a paired AUC difference on 800 scored rows (~50 conversions): over five data seeds of this setup
    (and five with 24 users) it was at most 0.003 (click) and 0.0065 (conversion); the prior-predictive
    gaps were 0.03-0.09.
    """
    k = 400
    rows, prior, ev, pc, pv = _bias_only_case(np.random.default_rng(4), 20, 440)
    s = sample_personal(ev, prior, 5, 2000, np.random.default_rng(5))
    pred = predictive(rows, s, [k])
    scored = np.flatnonzero(rows.rank >= k)
    for h, label, oracle in (("click", rows.click, pc), ("conversion", rows.conversion, pc * pv)):
        a = head_aucs(label, {"oracle_global": oracle, "prior_predictive": pred["prior"][h],
                              "posterior_predictive": pred["posterior"][k][h], "oracle": oracle}, scored)
        assert a["oracle"] - a["prior_predictive"] > 0.03, a
        assert abs(a["oracle"] - a["posterior_predictive"]) < 0.01, a
    assert np.nanmin(pred["ess_posterior"][k]) > 20


def test_zero_prior_gives_exactly_zero_gain_on_generated_data(tmp_path: Path) -> None:
    """On generated data split as bench.quality splits it: with no prior variance of the personal terms
    the support labels carry nothing, so posterior == prior-predictive to the bit on every row."""
    from meta_io.synth import generate

    assert cold_sizes(True) == (16_000, 250, 200, 0.25)  # bench.quality --quick's data
    cfg = cold_generator_config(3000, 60, 80, 7)
    gen = generate(tmp_path / "raw", cfg, progress=False)
    split = cold_split(gen, tmp_path, 7, 0.25)
    zero = ceiling_for_split(cfg, split.holdout_dir, split.schema_path, [2, 6], 2000, 0, prior=Prior(0.0, 0.0, 0.0))
    real = ceiling_for_split(cfg, split.holdout_dir, split.schema_path, [2, 6], 2000, 0)
    assert real["reconstruction_max_abs_err"] < 1e-6
    for k in (2, 6):
        for h in ("click", "conversion"):
            assert zero["by_k"][k][h]["ceiling_gain"] == 0.0, (k, h, zero["by_k"][k][h])
            assert zero["by_k"][k][h]["posterior_predictive"] == zero["by_k"][k][h]["prior_predictive"]
            assert zero["by_k"][k][h]["ceiling_gain_relabeled"] == {"mean": 0.0, "sd": 0.0}
            assert real["by_k"][k][h]["ceiling_gain"] != 0.0  # not vacuous: with the real prior labels move it
            assert real["by_k"][k][h]["oracle"] == zero["by_k"][k][h]["oracle"]


def test_replayed_world_buckets_and_loud_mismatch() -> None:
    from meta_io.synth import generator as G

    world = G._World(G.GeneratorConfig(rows=2000, users=90, items=40, seed=11))
    ex = replay_world(world)
    for j, score in ex.scores.items():
        iv = bucket_intervals(score, G._user_feature_vocab(j))[world.user_feats[:, j]]
        assert np.all((score >= iv[:, 0]) & (score < iv[:, 1])), j
    world.user_feats[:, 2] = world.user_feats[::-1, 2]
    with pytest.raises(CeilingError, match="user_f2 buckets differ"):
        replay_world(world)


def test_interest_evidence_is_the_users_list_and_weights_only_consistent_draws() -> None:
    """``--condition buckets+interests``: the evidence holds exactly each user's interest list, the user's
    true personal latent is consistent with it, and a draw keeps weight exactly when its top clusters
    are that list (any order)."""
    from bench.quality_ceiling import user_evidence
    from meta_io.synth import generator as G

    world = G._World(G.GeneratorConfig(rows=2000, users=90, items=40, seed=11))
    ex = replay_world(world)
    users = np.flatnonzero(world.user_interests_len <= 2)[:12]
    assert users.size >= 4
    ev = user_evidence(world, ex, users, "buckets+interests")
    assert ev.interests is not None and ev.cluster_center is not None
    for i, u in enumerate(users):
        want = set(world.user_interests[u, : world.user_interests_len[u]].tolist())
        assert set(np.flatnonzero(ev.interests[i]).tolist()) == want, u

    def consistent(personal: np.ndarray) -> np.ndarray:  # [T, M, k] -> [T, M]
        assert ev.cluster_center is not None and ev.interests is not None
        aff = (ev.seg_vec @ ev.cluster_center.T)[:, None, :] + personal @ ev.cluster_center.T
        inside = ev.interests[:, None, :]
        return np.where(inside, aff, np.inf).min(axis=2) > np.where(inside, -np.inf, aff).max(axis=2)

    truth = (world.user_vec[users] - world.user_seg_vec[users]).astype(np.float64)[:, None, :]
    assert consistent(truth).all()
    s = sample_personal(ev, Prior(), 5, 3000, np.random.default_rng(6))
    ok = consistent(s.personal)
    assert ok.any(axis=1).all() and not ok.all()  # some draws out, every user keeps some
    assert np.array_equal(np.isfinite(s.log_w), ok)


def test_redrawn_gains_redraw_the_support_labels_too() -> None:
    """Each redraw replaces every label (support included) and rescores: the same as drawing the labels
    with the same generator and running :func:`predictive` on them; not the gain of the original labels."""
    from bench.quality_ceiling import redrawn_gains
    from common.evaluation import auc

    k = 8
    rows, prior, ev, pc, pv = _bias_only_case(np.random.default_rng(7), 30, 24)
    pconv = pc * pv
    s = sample_personal(ev, prior, 5, 500, np.random.default_rng(8))
    scored = np.flatnonzero(rows.rank >= k)
    got = redrawn_gains(rows, s, pc, pconv, {k: scored}, 3, np.random.default_rng(9))
    r = np.random.default_rng(9)
    want: dict[str, list[float]] = {"click": [], "conversion": []}
    for _ in range(3):
        c = (r.random(pc.size) < pc).astype(np.float64)
        v = c * (r.random(pc.size) < pconv / pc)
        pred = predictive(dataclasses.replace(rows, click=c, conversion=v), s, [k])
        for h, y in (("click", c), ("conversion", v)):
            want[h].append(auc(y[scored], pred["posterior"][k][h][scored]) - auc(y[scored], pred["prior"][h][scored]))
    for h in ("click", "conversion"):
        assert got[k][h] == {"mean": float(np.mean(want[h])), "sd": float(np.std(want[h])), "draws": 3}, h
        assert np.std(want[h]) > 0  # the draws differ


def test_an_unknown_condition_is_refused_before_any_work(tmp_path: Path) -> None:
    """(No data, no world: the check comes first.)"""
    with pytest.raises(CeilingError, match="condition: expected one of buckets, buckets\\+interests, none"):
        ceiling_for_split(None, tmp_path / "missing", tmp_path / "missing.json", [8], 2000, 0, condition="bogus")


# -- the hidden-effects world (issue 29) ------------------------------------------------------------


def test_prior_of_a_config_and_hidden_draws() -> None:
    """The prior knows the config's hidden stds; the sampler draws the per-user offsets with them (and the
    per-(user, scene) one inside ``scene_bias``), after every other draw: a prior with only per-user hidden
    offsets draws the other terms bit for bit as a prior without them."""
    from meta_io.synth import GeneratorConfig

    cfg = GeneratorConfig(hidden_user_effect_std=1.5, hidden_user_cvr_effect_std=0.75, hidden_user_scene_effect_std=0.3)
    prior = Prior.of_config(cfg)
    assert prior == Prior(hidden_click_std=1.5, hidden_cvr_std=0.75, hidden_scene_std=0.3)
    assert Prior.of_config(GeneratorConfig()) == Prior()
    _, _, ev, _, _ = _bias_only_case(np.random.default_rng(12), 40, 2)
    m = 4000
    plain = sample_personal(ev, Prior(), 5, m, np.random.default_rng(13))
    assert plain.click_offset is None and plain.cvr_offset is None
    per_user = sample_personal(ev, dataclasses.replace(prior, hidden_scene_std=0.0), 5, m, np.random.default_rng(13))
    for name in ("bias", "scene_bias", "personal", "log_w"):
        assert np.array_equal(getattr(per_user, name), getattr(plain, name)), name
    full = sample_personal(ev, prior, 5, m, np.random.default_rng(13))
    assert full.click_offset is not None and full.cvr_offset is not None
    n = 40 * m
    for x, want in ((full.click_offset, 1.5), (full.cvr_offset, 0.75), (full.scene_bias, math.hypot(0.4, 0.3))):
        assert abs(float(x.std()) / want - 1.0) < 0.02 and abs(float(x.mean())) < 5 * want / math.sqrt(n)


def test_the_ceiling_gain_grows_with_the_hidden_std(tmp_path: Path) -> None:
    """Tiny generated data split as bench.quality splits it (seed 7, 19 held-out users, K = 6): the world's
    hidden per-user offsets are reconstructed exactly (the file's true probabilities), and the click gain
    grows with their std: about 0 without (-0.003), +0.024 at std 1, +0.20 at 2.5 (1000 draws); a posterior
    whose prior ignores them (issue 16's Prior()) gains much less there (+0.09)."""
    from meta_io.synth import generate

    gains = []
    for std in (0.0, 1.0, 2.5):
        cfg = dataclasses.replace(cold_generator_config(3000, 60, 80, 7), hidden_user_effect_std=std,
                                  hidden_user_cvr_effect_std=std / 2)
        gen = generate(tmp_path / f"raw{std}", cfg, progress=False)
        split = cold_split(gen, tmp_path / f"s{std}", 7, 0.25)
        res = ceiling_for_split(cfg, split.holdout_dir, split.schema_path, [6], 1000, 0, relabel=2)
        assert res["reconstruction_max_abs_err"] < 1e-6
        gains.append(res["by_k"][6]["click"]["ceiling_gain"])
    assert abs(gains[0]) < 0.01 and gains[0] < gains[1] - 0.01 and gains[1] < gains[2] - 0.1, gains
    blind = ceiling_for_split(cfg, split.holdout_dir, split.schema_path, [6], 1000, 0, prior=Prior(), relabel=2)
    assert blind["by_k"][6]["click"]["ceiling_gain"] < gains[2] - 0.05, (blind["by_k"][6]["click"], gains)


# -- the taste world (issue 40) -----------------------------------------------------------------------


def _taste_only_rows(rng: np.random.Generator, users: int, per: int, groups: int) -> Rows:
    rows = _rows(rng, users, per)
    return dataclasses.replace(rows, group=rng.integers(0, groups, users * per))


def test_taste_posterior_matches_quadrature_on_one_user() -> None:
    """One user whose only personal term is a taste over 2 item groups (std 1.2, cvr weight 0.5), labels drawn
    from a known taste: the sampler's prior and posterior predictive (K = 6) match the exact expectations by
    2-D Gauss-Hermite quadrature over the taste vector (80 x 80 nodes), within the Monte Carlo error of 100k
    draws; a one-offset posterior (the same taste for both groups) is far from them."""
    rng = np.random.default_rng(20)
    n, k, std, wv = 14, 6, 1.2, 0.5
    rows = _taste_only_rows(rng, 1, n, 2)
    rows = dataclasses.replace(rows, group=np.array([0, 1] * 3 + [0, 1, 1, 0, 0, 1, 0, 1]))
    assert rows.group is not None
    taste = np.array([1.5, -1.0])
    pc = 1 / (1 + np.exp(-(rows.g_click + taste[rows.group])))
    pv = 1 / (1 + np.exp(-(rows.g_cvr + wv * taste[rows.group])))
    rows = _draw_labels(rows, pc, pv, rng)
    prior = Prior(bias_std=0.0, scene_std=0.0, personal_scale=0.0, taste_std=std, taste_groups=2, taste_cvr_weight=wv)
    _, _, ev, _, _ = _bias_only_case(np.random.default_rng(21), 1, 1)
    s = sample_personal(ev, prior, 5, 100_000, np.random.default_rng(22))
    assert s.taste is not None and s.taste.shape == (1, 100_000, 2) and s.taste_cvr_weight == wv
    got = predictive(rows, s, [k])

    x, w = np.polynomial.hermite_e.hermegauss(80)  # nodes and weights of N(0, 1) (unnormalized)
    t0, t1 = np.meshgrid(std * x, std * x, indexing="ij")
    ww = np.outer(w, w)

    def sig(z: np.ndarray) -> np.ndarray:
        return 1 / (1 + np.exp(-z))

    def tg(i: int) -> np.ndarray:  # the row's taste at every node
        return t0 if rows.group[i] == 0 else t1

    lik = np.ones_like(ww)
    for i in range(k):  # the support: the user's first k rows
        c, v = sig(rows.g_click[i] + tg(i)), sig(rows.g_cvr[i] + wv * tg(i))
        y, z = rows.click[i], rows.conversion[i]
        lik = lik * ((1 - c) if y == 0 else c * (v if z == 1 else 1 - v))
    post = ww * lik / (ww * lik).sum()
    prior_w = ww / ww.sum()
    one_offset = np.diag(post.sum(axis=1))  # the same taste posterior mass, put on both groups alike
    far = 0.0
    for i in range(n):
        c, v = sig(rows.g_click[i] + tg(i)), sig(rows.g_cvr[i] + wv * tg(i))
        assert got["prior"]["click"][i] == pytest.approx(float((prior_w * c).sum()), abs=3e-3)
        assert got["prior"]["conversion"][i] == pytest.approx(float((prior_w * c * v).sum()), abs=3e-3)
        if i < k:
            assert np.isnan(got["posterior"][k]["click"][i])
            continue
        assert got["posterior"][k]["click"][i] == pytest.approx(float((post * c).sum()), abs=3e-3), i
        assert got["posterior"][k]["conversion"][i] == pytest.approx(float((post * c * v).sum()), abs=3e-3), i
        off = sig(rows.g_click[i] + std * x)  # a taste shared by both groups, at the first group's posterior
        far = max(far, abs(float((one_offset.diagonal() * off).sum()) - float((post * c).sum())))
    assert far > 0.03, far  # the 3e-3 tolerance tells the two apart


def test_offset_posterior_matches_quadrature_and_picks_the_likeliest_prior() -> None:
    """The offset-only score: the posterior mean of one logit offset per user given the support labels under
    N(0, tau^2), tau of highest marginal likelihood; against 100-node Gauss-Hermite quadrature per tau."""
    from bench.quality_ceiling import OFFSET_TAUS, offset_posterior

    rng = np.random.default_rng(23)
    users, per, k = 5, 12, 7
    user, rank = np.repeat(np.arange(users), per), np.tile(np.arange(per), users)
    base = 1 / (1 + np.exp(-rng.normal(-0.8, 1.0, users * per)))
    truth = np.array([2.0, -1.5, 0.0, 1.0, 2.5])[user]
    label = (rng.random(users * per) < 1 / (1 + np.exp(-(np.log(base / (1 - base)) + truth)))).astype(np.float64)
    got = offset_posterior(base, label, user, rank, k)
    x, w = np.polynomial.hermite_e.hermegauss(100)
    lg = np.log(base / (1 - base))
    best = None
    for tau in OFFSET_TAUS:
        means, total = [], 0.0
        for u in range(users):
            sup = (user == u) & (rank < k)
            p = 1 / (1 + np.exp(-(lg[sup][:, None] + tau * x[None, :])))
            lik = np.prod(np.where(label[sup][:, None] == 1, p, 1 - p), axis=0)
            total += math.log(float((w * lik).sum() / w.sum()))
            means.append(float((w * lik * tau * x).sum() / (w * lik).sum()))
        assert got["log_marginal"][tau] == pytest.approx(total, abs=1e-4), tau  # the grid: +-12, step 0.05
        if best is None or total > best[0]:
            best = (total, tau, np.array(means))
    assert best is not None and got["tau"] == best[1] and got["tau"] > OFFSET_TAUS[0]
    q = rank >= k
    want = 1 / (1 + np.exp(-(lg[q] + best[2][user[q]])))
    np.testing.assert_allclose(got["score"][q], want, atol=1e-6)
    assert np.isnan(got["score"][~q]).all()


def test_offset_only_reaches_an_offset_world_but_not_a_taste_world() -> None:
    """150 synthetic users, 40 rows each, K = 8: where the per-user truth is one offset (a user bias, std 0.8)
    the offset-only posterior takes most of the full Bayes gain (not all: the full posterior also reads the
    conversion labels, and tau is chosen from a grid); where it is a taste over 4 item groups
    (std 2) an offset takes a small share and most of the gain is beyond it."""
    from bench.quality_ceiling import offset_figures

    k = 8
    rows, prior, ev, pc, pv = _bias_only_case(np.random.default_rng(24), 150, 40)
    figs = {}
    for name in ("offset", "taste"):
        if name == "taste":
            rng = np.random.default_rng(25)
            rows = _taste_only_rows(rng, 150, 40, 4)
            assert rows.group is not None
            prior = Prior(bias_std=0.0, scene_std=0.0, personal_scale=0.0, taste_std=2.0, taste_groups=4)
            t = 2.0 * rng.normal(size=(150, 4))[rows.user, rows.group]
            pc = 1 / (1 + np.exp(-(rows.g_click + t)))
            pv = 1 / (1 + np.exp(-(rows.g_cvr + 0.5 * t)))
            rows = _draw_labels(rows, pc, pv, rng)
        s = sample_personal(ev, prior, 5, 2000, np.random.default_rng(26))
        pred = predictive(rows, s, [k])
        scored = np.flatnonzero(rows.rank >= k)
        sc = {"oracle_global": pc, "prior_predictive": pred["prior"]["click"],
              "posterior_predictive": pred["posterior"][k]["click"], "oracle": pc}
        a = head_aucs(rows.click, sc, scored)
        figs[name] = offset_figures(rows.click, pred["prior"]["click"], rows, k, scored, a)
    off, taste = figs["offset"], figs["taste"]
    # measured: offset world full +0.033, offset share 0.88; taste world full +0.113, share 0.20, beyond +0.090
    assert off["full_gain"] > 0.02 and off["offset_share"] > 0.75 and abs(off["non_offset_gain"]) < 0.01, off
    assert taste["full_gain"] > 0.05 and taste["offset_share"] < 0.35 and taste["non_offset_gain"] > 0.05, taste
    assert taste["full_gain"] == pytest.approx(taste["offset_only_gain"] + taste["non_offset_gain"], abs=1e-12)
    for f in (off, taste):  # the best tau on the scored labels bounds the chosen one, and not by much here
        assert f["offset_only_gain"] <= f["offset_only_gain_best_tau"] < f["offset_only_gain"] + 0.01, f


def test_taste_ceiling_on_generated_data(tmp_path: Path) -> None:
    """A tiny generated taste world (seed 7, taste std 2.5), split as bench.quality splits it: the world's tastes
    are reconstructed exactly (the file's true probabilities), the gain beyond an offset is positive on click,
    and :func:`ceiling_gains` (what bench.quality calls) gives the same figures as the bench's own run."""
    from bench.quality_ceiling import ceiling_gains
    from meta_io.synth import generate, world_config

    cfg = dataclasses.replace(world_config(cold_generator_config(3000, 60, 80, 7), "taste"), taste_std=2.5)
    gen = generate(tmp_path / "raw", cfg, progress=False)
    split = cold_split(gen, tmp_path / "s", 7, 0.25)
    res = ceiling_for_split(cfg, split.holdout_dir, split.schema_path, [6], 1000, 0, relabel=0)
    assert res["reconstruction_max_abs_err"] < 1e-6
    e = res["by_k"][6]
    assert e["click"]["full_gain"] > e["click"]["offset_only_gain"] and e["click"]["non_offset_gain"] > 0.0, e["click"]
    assert "ceiling_gain_relabeled" not in e["click"]
    assert ceiling_gains(cfg, split.holdout_dir, split.schema_path, k=6, m=1000) == {
        h: {key: e[h][key] for key in ("prior_predictive", "posterior_predictive", "offset_only", "oracle", "full_gain",
                                       "offset_only_gain", "non_offset_gain", "offset_share", "offset_tau",
                                       "offset_only_gain_best_tau")}
        for h in ("click", "conversion")}
