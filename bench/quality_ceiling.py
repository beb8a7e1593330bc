"""The Bayes ceiling of first-k adaptation on the generator's cold-start users (issues 16, 29, 40).

Run::

    python -m bench.quality_ceiling [--quick] --seeds 3,4,5 --first-k 4,8,16,32 [--redraw 10]
        [--condition buckets|buckets+interests|none] [--samples 4000] [--sampler-seed 0]
        [--world default|hidden|taste] [--hidden-std X] [--hidden-cvr-std X] [--hidden-scene-std X]
        [--taste-std X] [--taste-groups G] [--taste-cvr-weight X]
    python -m bench.quality_ceiling --smoke   # bench.quality --smoke's data, seed 3, K=4, 2000 draws, 2 redraws

On EXACTLY the data, held-out users and first-k support / scored rows of
``python -m bench.quality --quick --cold-only`` for the same seed (its
``cold_sizes`` / ``cold_generator_config`` / ``cold_split``, and
``meta_io.firstk.first_k_layout`` as ``first_k_batches`` uses it), this scores
every first-k scored row four ways, with the generator's own world tables
(regenerated from the seed: the generator is deterministic). ``--world
hidden`` (``meta_io.synth.WORLDS``) generates the same seeds with per-user
click and cvr logit offsets that no feature reveals (the generator's hidden
per-task effects; ``--hidden-std`` / ``--hidden-cvr-std`` /
``--hidden-scene-std`` set them directly); in the default world they are 0
and every figure is what it was before they existed. ``--world taste`` gives
every user a hidden taste per item group (the generator's "Per-user tastes":
``taste(u, group(item))`` on the click logit, times ``taste_cvr_weight`` on
the cvr logit; ``--taste-std`` / ``--taste-groups`` / ``--taste-cvr-weight``
set them), which the sampler draws from their prior like the hidden offsets.
Every row is scored four ways:

* ``oracle_global``: the true logits with the personal terms removed
  (``user_bias``, ``user_scene_bias``, the ``personal(u)`` part of the user
  latent and the hidden effects), as the generator's ``oracle_auc_global``;
* ``prior_predictive`` (the best possible *base*): ``E[p | what a model sees
  without the user's labels]``: the global part (segment, item, scene,
  position, hour: all model features or functions of them) plus the personal
  terms averaged over their prior conditioned on the user's visible user
  features: the bucket of ``user_bias + N(0, 0.6)`` (``user_f2``), the buckets
  of three projections of the user latent (``user_f1/f4/f6``) (``--condition
  buckets``, the default); with ``--condition buckets+interests`` also the set
  of the user's top clusters (``mh_user_interests``, a function of the user
  latent too); with ``--condition none`` nothing (the prior itself: a base that
  ignores the user features);
* ``posterior_predictive`` (the best possible *adapted* score): the same
  expectation given, in addition, the click and conversion labels of the
  user's first K rows (conversion = click AND Bernoulli(p_cvr), as the
  generator draws them);
* ``oracle``: the true probabilities (``p_click``, ``p_conversion`` of the file).

Beside them, per head, ``offset_only``: the best that ONE logit offset per
user can take from the same support labels, on the best possible base:
``sigmoid(logit(prior_predictive) + E[delta_u | support])`` under ``delta_u ~
N(0, tau^2)``, exact on a grid, ``tau`` chosen by the marginal likelihood of
the support labels (:func:`offset_posterior`). So the full gain
(``full_gain`` = ``ceiling_gain``) splits into ``offset_only_gain`` and
``non_offset_gain`` (posterior - offset_only: what only a per-group /
per-item adaptation can reach), with ``offset_share``. The offset is one per
head, fitted on that head's own labels as ``[meta] offset_steps`` fits it
(``models/meta_offset.py``: the conversion head's on the CTCVR logit, from
the conversion labels), so on conversion the part beyond it also holds what
the click labels tell. In the hidden world an offset takes most of the click
gain; in the taste world most of it is beyond one.

For a bench that trains on the same split: :func:`ceiling_gains` ``(cfg,
holdout_dir, schema_path, k)`` returns those figures per head for exactly the
first-k scored rows of ``holdout_dir`` (``bench.quality``'s
``taste_gain_share`` = (adapted - best other) / ``non_offset_gain``).

Both expectations are self-normalized importance sampling over ALL personal
terms, M draws per user (``--samples``, default 4000), vectorized over users:
``user_bias`` is drawn exactly from its prior given its feature bucket (a
truncated normal), ``user_scene_bias`` (plus the hidden per-(user, scene)
offset: one normal of the summed variance) and the hidden per-user click / cvr
offsets from their priors (the config's stds: no feature reveals them, so only
the support labels move them), and ``personal(u)`` by
GHK (sequential truncated normals of its three bucketed projections, with the
truncation masses as weights; the rest of the vector from its conditional
normal); the interest set enters as an indicator weight; the support labels as
likelihood weights. A bucket is the interval between the midpoints of the
realized scores at the bucket boundaries (the generator's equal-frequency
``_bucketize`` over all users of the world).

Per head and K: AUC of each score on the scored rows, and the ceiling gain =
posterior - prior-predictive; also its mean and sd over redraws of the scored
rows' labels from the true probabilities (``ceiling_gain_relabeled``: the
gain without the label noise of the scored rows) and, with ``--redraw R``, over
R redraws of every label, support included (``ceiling_gain_redrawn``: the gain
without the luck of one label draw, which at ~5k rows and a few heavy users is
as large as the gain itself). ``--condition buckets+interests`` stops with an
error when a user has no draw consistent with its interest list (plain
indicator weights; raise ``--samples``). Per seed, then median (min, max) over seeds. The
last line printed is one JSON object. Pure numpy (torch only for the normal
CDF and its inverse); deterministic for a given ``--sampler-seed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.quality import _spread
from common.errors import MetapsError
from common.evaluation import auc
from common.log import kv

log = logging.getLogger(__name__)

HEADS = ("click", "conversion")
CONDITIONS = ("buckets", "buckets+interests", "none")
"""What the best possible base knows of a user's personal terms (``--condition``)."""
SCORES = ("oracle_global", "prior_predictive", "posterior_predictive", "oracle")

# The generator's hidden model (meta_io/synth/generator.py, module docstring), personal parts:
CLICK_INTER = 0.8  # logit_click += 0.8 * <u_vec, i_vec> / sqrt(k)
CVR_INTER = 0.4  # logit_cvr += 0.4 * <u_vec, i_vec> / sqrt(k)
CVR_BIAS = 0.5  # logit_cvr += 0.5 * user_bias
BIAS_FEATURE_NOISE = 0.6  # user_f2 = bucket(user_bias + N(0, 0.6))


class CeilingError(MetapsError):
    """The regenerated world does not reproduce the data (the generator changed), or bad input."""


@dataclass(frozen=True)
class Prior:
    """Prior of the personal terms (the generator's: user_bias std 0.8, user_scene_bias 0.4, 0.7 * N(0, I),
    and the hidden effects of its config, 0 by default).

    Args:
        bias_std: std of ``user_bias``.
        scene_std: std of each ``user_scene_bias``.
        personal_scale: ``personal(u)`` enters the user latent as ``personal_scale * N(0, I_k)``.
        hidden_click_std: std of the hidden per-user click-logit offset (``hidden_user_effect_std``).
        hidden_cvr_std: std of the hidden per-user cvr-logit offset (``hidden_user_cvr_effect_std``).
        hidden_scene_std: std of the hidden per-(user, scene) click-logit offset
            (``hidden_user_scene_effect_std``).
        taste_std: std of each per-(user, item group) taste (``GeneratorConfig.taste_std``; 0: none).
        taste_groups: item groups of a taste vector (``taste_groups``).
        taste_cvr_weight: the taste's weight in the cvr logit (``taste_cvr_weight``).
    """

    bias_std: float = 0.8
    scene_std: float = 0.4
    personal_scale: float = 0.7
    hidden_click_std: float = 0.0
    hidden_cvr_std: float = 0.0
    hidden_scene_std: float = 0.0
    taste_std: float = 0.0
    taste_groups: int = 4
    taste_cvr_weight: float = 0.5

    @classmethod
    def of_config(cls, cfg: Any) -> "Prior":
        """The generator's prior for ``cfg`` (a ``GeneratorConfig``): the fixed terms and its hidden effects."""
        return cls(hidden_click_std=float(cfg.hidden_user_effect_std),
                   hidden_cvr_std=float(cfg.hidden_user_cvr_effect_std),
                   hidden_scene_std=float(cfg.hidden_user_scene_effect_std), taste_std=float(cfg.taste_std),
                   taste_groups=int(cfg.taste_groups), taste_cvr_weight=float(cfg.taste_cvr_weight))


@dataclass(frozen=True)
class Samples:
    """M draws of every user's personal terms (users in a fixed order) and their log importance weights.

    Args:
        bias: ``[T, M]`` user_bias.
        scene_bias: ``[T, M, S]`` user_scene_bias per scene.
        personal: ``[T, M, k]`` the personal part of the user latent (``personal_scale * personal(u)``).
        log_w: ``[T, M]`` log weights of the feature conditioning (0 where drawn exactly).
        click_offset / cvr_offset: ``[T, M]`` the hidden per-user click / cvr logit offsets, or ``None``
            (none in the prior). The hidden per-(user, scene) offset is part of ``scene_bias``: both are
            independent normals per user and scene that no feature reveals.
        taste: ``[T, M, G]`` the per-(user, item group) tastes, or ``None`` (none in the prior).
        taste_cvr_weight: the taste's weight in the cvr logit.
    """

    bias: np.ndarray
    scene_bias: np.ndarray
    personal: np.ndarray
    log_w: np.ndarray
    click_offset: np.ndarray | None = None
    cvr_offset: np.ndarray | None = None
    taste: np.ndarray | None = None
    taste_cvr_weight: float = 0.0


@dataclass(frozen=True)
class Rows:
    """Scored and support rows, sorted by (user, time) as the first-k layout orders them.

    Args:
        user: ``[N]`` index into the users of :class:`Samples`.
        rank: ``[N]`` position within the user's rows by time (0 = earliest).
        scene: ``[N]`` scene id.
        item_vec: ``[N, k]`` the item latent / sqrt(k).
        g_click / g_cvr: ``[N]`` the global (non-personal) logits.
        click / conversion: ``[N]`` labels (0/1).
        group: ``[N]`` the item's taste group (``_World.item_taste_group``), or ``None`` (no tastes).
    """

    user: np.ndarray
    rank: np.ndarray
    scene: np.ndarray
    item_vec: np.ndarray
    g_click: np.ndarray
    g_cvr: np.ndarray
    click: np.ndarray
    conversion: np.ndarray
    group: np.ndarray | None = None


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(_log_sigmoid(x))


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def row_logits(rows: Rows, samples: Samples, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Click and cvr logits ``[n, M]`` of rows ``sel`` under every draw of their user's personal terms.

    The personal interaction is one batched matrix product per user (``[M, k] @ [k, rows]``, the
    users' rows padded to the longest), not a ``[n, M, k]`` gather.

    Args:
        rows: the rows.
        samples: the draws.
        sel: int ``[n]`` row indices.
    """
    u = rows.user[sel]
    users, local = np.unique(u, return_inverse=True)
    counts = np.bincount(local, minlength=users.shape[0])
    order = np.argsort(local, kind="stable")
    pos = np.empty(sel.shape[0], dtype=np.int64)
    pos[order] = np.arange(sel.shape[0]) - (np.cumsum(counts) - counts)[local[order]]
    iv = np.zeros((users.shape[0], int(counts.max(initial=0)), rows.item_vec.shape[1]))
    iv[local, pos] = rows.item_vec[sel]
    inter = np.matmul(samples.personal[users], iv.transpose(0, 2, 1))[local, :, pos]  # [n, M]
    b = samples.bias[u]
    click = rows.g_click[sel, None] + CLICK_INTER * inter + b
    if samples.scene_bias.shape[2]:
        click += np.ascontiguousarray(samples.scene_bias[users].transpose(0, 2, 1))[local, rows.scene[sel]]
    cvr = rows.g_cvr[sel, None] + CVR_INTER * inter + CVR_BIAS * b
    if samples.click_offset is not None:
        click += samples.click_offset[u]
    if samples.cvr_offset is not None:
        cvr += samples.cvr_offset[u]
    if samples.taste is not None:
        if rows.group is None:
            raise CeilingError("rows.group: the samples hold tastes, so every row needs its item's taste group")
        taste = np.ascontiguousarray(samples.taste[users].transpose(0, 2, 1))[local, rows.group[sel]]
        click += taste
        cvr += samples.taste_cvr_weight * taste
    return click, cvr


def row_log_lik(click_logit: np.ndarray, cvr_logit: np.ndarray, click: np.ndarray, conv: np.ndarray,
                log_pc: np.ndarray | None = None, log_pv: np.ndarray | None = None) -> np.ndarray:
    """Log P(click, conversion labels of a row | personal terms), ``[n, M]``.

    ``P(click=0) = 1 - pc``, ``P(click=1, conv=0) = pc (1 - pv)``, ``P(click=1, conv=1) = pc pv``
    (``log(1 - sigmoid(x)) = log sigmoid(x) - x``).

    Args:
        click_logit / cvr_logit: ``[n, M]``.
        click / conv: ``[n]`` labels.
        log_pc / log_pv: ``log sigmoid`` of the logits when already computed.
    """
    y, z = click[:, None], conv[:, None]
    lpc = _log_sigmoid(click_logit) if log_pc is None else log_pc
    lpv = _log_sigmoid(cvr_logit) if log_pv is None else log_pv
    return lpc - (1.0 - y) * click_logit + y * (lpv - (1.0 - z) * cvr_logit)


def _weighted_mean(w: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``sum_m w[n, m] p[n, m]`` with ``w`` normalized per row, written as ``p[:, 0] + sum w (p - p[:, 0])``
    so that equal draws give exactly ``p[:, 0]`` (no rounding from the weights)."""
    return p[:, 0] + np.einsum("nm,nm->n", w, p - p[:, :1])


def _normalize(log_w: np.ndarray) -> np.ndarray:
    w = np.exp(log_w - log_w.max(axis=1, keepdims=True))
    return w / w.sum(axis=1, keepdims=True)


def predictive(rows: Rows, samples: Samples, ks: list[int], budget: int = 2_000_000) -> dict[str, Any]:
    """Prior- and posterior-predictive probabilities of every row, and effective sample sizes.

    ``prior[h][r] = E[p_h(r) | features]`` (weights ``samples.log_w``), ``posterior[K][h][r] =
    E[p_h(r) | features, labels of the user's rows of rank < K]`` for rows of rank >= K (NaN below),
    ``p_conversion = p_click * p_cvr``. Vectorized over the users of a chunk and the draws.

    Args:
        rows: sorted by (user, rank).
        samples: the draws of every user.
        ks: support sizes K.
        budget: rows x draws per vectorized chunk of users (memory: a few arrays of that many doubles).

    Returns:
        ``{"prior": {h: [N]}, "posterior": {K: {h: [N]}}, "ess_prior": [T], "ess_posterior": {K: [T]}}``.
    """
    n = rows.user.shape[0]
    n_users = samples.bias.shape[0]
    prior = {h: np.full(n, np.nan) for h in HEADS}
    post = {k: {h: np.full(n, np.nan) for h in HEADS} for k in ks}
    ess_prior = np.zeros(n_users)
    ess_post = {k: np.full(n_users, np.nan) for k in ks}
    m = samples.bias.shape[1]
    per_user = np.bincount(rows.user, minlength=n_users)
    for lo, hi in _chunks(per_user, m, budget):
        sel = np.flatnonzero((rows.user >= lo) & (rows.user < hi))
        w0 = _normalize(samples.log_w[lo:hi])
        ess_prior[lo:hi] = 1.0 / (w0 ** 2).sum(axis=1)
        if sel.size == 0:
            continue
        cl, cv = row_logits(rows, samples, sel)
        lpc, lpv = _log_sigmoid(cl), _log_sigmoid(cv)
        ll = row_log_lik(cl, cv, rows.click[sel], rows.conversion[sel], lpc, lpv)
        pc = np.exp(lpc)
        pconv = np.exp(lpc + lpv)
        del cl, cv, lpc, lpv
        local = rows.user[sel] - lo
        prior["click"][sel] = _weighted_mean(w0[local], pc)
        prior["conversion"][sel] = _weighted_mean(w0[local], pconv)
        for k in ks:
            support = (rows.rank[sel] < k).astype(np.float64)
            onehot = np.zeros((hi - lo, sel.size))
            onehot[local, np.arange(sel.size)] = support
            wk = _normalize(samples.log_w[lo:hi] + onehot @ ll)
            has_query = np.bincount(local, weights=(rows.rank[sel] >= k), minlength=hi - lo) > 0
            ess_post[k][lo:hi] = np.where(has_query, 1.0 / (wk ** 2).sum(axis=1), np.nan)
            q = rows.rank[sel] >= k
            post[k]["click"][sel[q]] = _weighted_mean(wk[local[q]], pc[q])
            post[k]["conversion"][sel[q]] = _weighted_mean(wk[local[q]], pconv[q])
    return {"prior": prior, "posterior": post, "ess_prior": ess_prior, "ess_posterior": ess_post}


OFFSET_TAUS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
"""Prior stds of the offset-only posterior (:func:`offset_posterior`); the one of highest marginal likelihood wins."""
OFFSET_GRID = np.linspace(-12.0, 12.0, 481)
"""The offset's quadrature grid (step 0.05 logit; +-4 sd of the widest prior)."""


def offset_posterior(base: np.ndarray, label: np.ndarray, user: np.ndarray, rank: np.ndarray, k: int,
                     taus: tuple[float, ...] = OFFSET_TAUS) -> dict[str, Any]:
    """The best one-offset-per-user adaptation of ``base``: ``sigmoid(logit(base) + E[delta_u | support])``.

    The model: a user's labels are ``Bernoulli(sigmoid(logit(base) + delta_u))`` with one ``delta_u ~
    N(0, tau^2)`` per user (per head: call it once per head with that head's labels and base). The
    posterior of ``delta_u`` given the labels of the user's rows of rank < ``k`` is exact on
    :data:`OFFSET_GRID` (quadrature, vectorized over users and grid points); ``tau`` is chosen from
    ``taus`` by the marginal likelihood of all support labels (empirical Bayes: the scored labels are
    not looked at). On the best possible base (the prior predictive) this is the most an offset can
    take from the support labels, which a taste world's per-group effects exceed.

    Args:
        base: ``[N]`` base probability per row (in (0, 1)).
        label: ``[N]`` the head's 0/1 labels.
        user: ``[N]`` user index (0..T-1).
        rank: ``[N]`` the row's rank within its user's rows by time.
        k: support size K (rows of rank < k are the support; rows of rank >= k are scored).
        taus: candidate prior stds of ``delta``.

    Returns:
        ``{"score": [N] (NaN on support rows), "tau": the chosen prior std, "log_marginal": {tau: float}}``.
    """
    if not taus:
        raise CeilingError("taus: expected at least one prior std of the offset, got none")
    n_users = int(user.max(initial=-1)) + 1
    p = np.clip(base, 1e-12, 1.0 - 1e-12)
    logit = np.log(p) - np.log1p(-p)
    sup = np.flatnonzero(rank < k)
    z = logit[sup, None] + OFFSET_GRID[None, :]  # [n_support, G]
    ll_rows = _log_sigmoid(z) - (1.0 - label[sup, None]) * z
    ll = np.zeros((n_users, OFFSET_GRID.shape[0]))
    np.add.at(ll, user[sup], ll_rows)  # [T, G] log-likelihood of each user's support per offset
    step = float(OFFSET_GRID[1] - OFFSET_GRID[0])
    best: tuple[float, float, np.ndarray] | None = None
    log_marginal: dict[float, float] = {}
    for tau in taus:  # a handful of priors, each vectorized over users and the grid
        lp = ll - 0.5 * (OFFSET_GRID / tau) ** 2 - np.log(tau * np.sqrt(2.0 * np.pi)) + np.log(step)
        top = lp.max(axis=1, keepdims=True)
        w = np.exp(lp - top)
        log_marginal[tau] = float((top[:, 0] + np.log(w.sum(axis=1))).sum())
        mean = (w @ OFFSET_GRID) / w.sum(axis=1)
        if best is None or log_marginal[tau] > best[0]:
            best = (log_marginal[tau], tau, mean)
    assert best is not None  # taus is not empty
    score = np.full(base.shape[0], np.nan)
    q = rank >= k
    score[q] = _sigmoid(logit[q] + best[2][user[q]])
    return {"score": score, "tau": best[1], "log_marginal": log_marginal}


def _chunks(counts: np.ndarray, m: int, budget: int) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` ranges of users whose padded work (users x most rows x ``m``) stays within
    ``budget`` (at least one user each).

    Args:
        counts: ``[T]`` rows (or any size) per user.
        m: draws per user.
        budget: elements per chunk.
    """
    out, lo, top = [], 0, 0
    for i, c in enumerate(counts.tolist()):  # one entry per user, not per row
        if i > lo and (i - lo + 1) * max(top, c) * m > budget:
            out.append((lo, i))
            lo, top = i, 0
        top = max(top, c)
    if lo < len(counts):
        out.append((lo, len(counts)))
    return out


# -- sampling the personal terms given the visible user features ------------------------------------


def _ndtr(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.special.ndtr(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))).numpy()


def _ndtri(p: np.ndarray) -> np.ndarray:
    import torch

    return torch.special.ndtri(torch.from_numpy(np.ascontiguousarray(p, dtype=np.float64))).numpy()


def truncated_normal(lo: np.ndarray, hi: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Standard normal truncated to ``[lo, hi]`` by inverse CDF of uniforms ``u``; also the log mass.

    Intervals in the upper tail are drawn mirrored (from ``[-hi, -lo]``) so that the CDF keeps its precision.

    Args:
        lo / hi: bounds (``-inf`` / ``inf`` allowed), broadcastable with ``u``.
        u: uniforms in (0, 1).

    Returns:
        ``(x, log(Phi(hi) - Phi(lo)))``.
    """
    lo, hi = np.broadcast_arrays(lo, hi, u)[:2]
    flip = lo > 0
    a = np.where(flip, -hi, lo)
    b = np.where(flip, -lo, hi)
    fa, fb = _ndtr(a), _ndtr(b)
    mass = np.maximum(fb - fa, 1e-300)
    x = _ndtri(np.clip(fa + u * (fb - fa), 1e-300, 1.0 - 1e-16))
    x = np.clip(x, a, b)
    return np.where(flip, -x, x), np.log(mass)


@dataclass(frozen=True)
class UserEvidence:
    """What a model sees of each held-out user that depends on the personal terms.

    Args:
        bias_interval: ``[T, 2]`` the interval of ``user_bias + N(0, 0.6)`` given its bucket (or ``None``).
        proj: ``[d, k]`` the generator's projections of the user latent behind bucketed features.
        proj_offset: ``[T, d]`` the segment part of each projection (``user_seg_vec @ proj``).
        proj_interval: ``[T, d, 2]`` the interval of each projection given its bucket.
        cluster_center: ``[C, k]`` (for the interest set) or ``None``.
        seg_vec: ``[T, k]`` the segment part of the user latent.
        interests: bool ``[T, C]`` the clusters in the user's interest list, or ``None``: not conditioned on.
    """

    bias_interval: np.ndarray | None
    proj: np.ndarray
    proj_offset: np.ndarray
    proj_interval: np.ndarray
    cluster_center: np.ndarray | None
    seg_vec: np.ndarray
    interests: np.ndarray | None


def sample_personal(ev: UserEvidence, prior: Prior, n_scenes: int, m: int, rng: np.random.Generator) -> Samples:
    """M draws per user of all personal terms from their prior conditioned on ``ev`` (see the module docstring).

    Args:
        ev: the visible evidence per user.
        prior: the personal terms' prior.
        n_scenes: scenes (user_scene_bias per scene).
        m: draws per user.
        rng: the sampler's generator.
    """
    t = ev.seg_vec.shape[0]
    k = ev.seg_vec.shape[1]
    log_w = np.zeros((t, m))
    # user_bias: exact, from the truncated marginal of s = b + e, then b | s
    vb, ve = prior.bias_std ** 2, BIAS_FEATURE_NOISE ** 2
    if ev.bias_interval is not None and vb > 0:
        sd = np.sqrt(vb + ve)
        s, _ = truncated_normal(ev.bias_interval[:, :1] / sd, ev.bias_interval[:, 1:] / sd, rng.random((t, m)))
        s = s * sd
        bias = vb / (vb + ve) * s + np.sqrt(vb * ve / (vb + ve)) * rng.standard_normal((t, m))
    else:
        bias = prior.bias_std * rng.standard_normal((t, m))
    # user_scene_bias + the hidden per-(user, scene) offset: independent normals, so one normal of the summed variance
    scene_std = prior.scene_std if prior.hidden_scene_std == 0 else \
        float(np.hypot(prior.scene_std, prior.hidden_scene_std))
    scene_bias = scene_std * rng.standard_normal((t, m, n_scenes))
    z = rng.standard_normal((t, m, k))
    if prior.personal_scale > 0 and ev.proj.shape[0]:
        # y = proj @ q (q ~ N(0, I)) must fall in its bucket: GHK over the Cholesky factor of proj proj^T
        P = ev.proj
        sigma = P @ P.T
        chol = np.linalg.cholesky(sigma)
        lo = (ev.proj_interval[..., 0] - ev.proj_offset) / prior.personal_scale
        hi = (ev.proj_interval[..., 1] - ev.proj_offset) / prior.personal_scale
        eta = np.zeros((t, m, P.shape[0]))
        for i in range(P.shape[0]):  # d = 3 sequential conditionals, each vectorized over users and draws
            mean = eta[..., :i] @ chol[i, :i]
            x, lm = truncated_normal((lo[:, i, None] - mean) / chol[i, i], (hi[:, i, None] - mean) / chol[i, i],
                                     rng.random((t, m)))
            eta[..., i] = x
            log_w += lm
        y = eta @ chol.T
        gain = P.T @ np.linalg.inv(sigma)  # [k, d]: E[q | y] = gain @ y
        q = y @ gain.T + z - (z @ P.T) @ gain.T
    else:
        q = z
    personal = prior.personal_scale * q
    if ev.interests is not None and ev.cluster_center is not None and prior.personal_scale > 0:
        seg_aff = ev.seg_vec @ ev.cluster_center.T
        for lo, hi in _chunks(np.full(t, ev.cluster_center.shape[0]), m, 4_000_000):
            aff = seg_aff[lo:hi, None, :] + personal[lo:hi] @ ev.cluster_center.T
            inside = ev.interests[lo:hi, None, :]
            in_min = np.where(inside, aff, np.inf).min(axis=2)
            out_max = np.where(inside, -np.inf, aff).max(axis=2)
            log_w[lo:hi] += np.where(in_min > out_max, 0.0, -np.inf)
    dead = int((~np.isfinite(log_w.max(axis=1))).sum()) if t else 0
    if dead:
        raise CeilingError(f"{dead} of {t} users have no draw of {m} consistent with their visible features "
                           f"(interest set); raise --samples")
    # hidden per-user offsets: no feature reveals them, so drawn from the prior (last, so that a prior without them
    # draws everything else exactly as before they existed)
    click_offset = prior.hidden_click_std * rng.standard_normal((t, m)) if prior.hidden_click_std > 0 else None
    cvr_offset = prior.hidden_cvr_std * rng.standard_normal((t, m)) if prior.hidden_cvr_std > 0 else None
    # tastes: no feature reveals them either; drawn after everything else for the same reason
    taste = prior.taste_std * rng.standard_normal((t, m, prior.taste_groups)) if prior.taste_std > 0 else None
    return Samples(bias=bias, scene_bias=scene_bias, personal=personal, log_w=log_w, click_offset=click_offset,
                   cvr_offset=cvr_offset, taste=taste, taste_cvr_weight=prior.taste_cvr_weight)


# -- the generator's world, regenerated -------------------------------------------------------------


@dataclass(frozen=True)
class WorldExtras:
    """Draws of the generator's ``_World`` that it does not keep: replayed from the seed and checked.

    Args:
        proj: ``[F, k]`` user-feature projections.
        scores: feature index -> ``[U]`` the real score behind a bucketed user feature.
        cluster_center: ``[C, k]``.
    """

    proj: np.ndarray
    scores: dict[int, np.ndarray]
    cluster_center: np.ndarray


def replay_world(world: Any) -> WorldExtras:
    """Replay ``_World.__init__``'s random stream up to the cluster centres (same calls, same order) and
    check the result reproduces the world's bucketed user features and interest lists.

    Raises:
        CeilingError: the replay does not reproduce the world (the generator's draws changed).
    """
    from meta_io.synth import generator as G

    cfg = world.cfg
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x4D45544150]).spawn(1)[0])
    k, U = G.LATENT_DIM, cfg.users
    rng.normal(size=(G.N_SEGMENTS, k))
    rng.integers(0, G.N_SEGMENTS, size=U)
    rng.normal(size=(U, k))
    rng.normal(0.0, 0.8, size=U)
    rng.normal(0.0, 0.4, size=(U, len(G.SCENES)))
    cold_counts = rng.integers(1, 6, size=world.cold_users)
    rng.permutation(np.repeat(np.arange(world.warm_users, U), cold_counts))
    proj = rng.normal(size=(max(cfg.n_user_features, 1), k))
    scores: dict[int, np.ndarray] = {}
    for j in range(cfg.n_user_features):
        r = j % 8
        if r in (1, 4, 6):
            scores[j] = world.user_vec @ proj[j]
        elif r == 2:
            scores[j] = world.user_bias + rng.normal(0.0, BIAS_FEATURE_NOISE, size=U)
        elif r != 0:
            rng.zipf(1.5, size=U)
    cluster_center = rng.normal(size=(G.N_CLUSTERS, k))
    for j, s in scores.items():
        if not np.array_equal(G._bucketize(s, G._user_feature_vocab(j)), world.user_feats[:, j]):
            raise CeilingError(f"replayed generator world (seed {cfg.seed}): user_f{j} buckets differ from the "
                               f"world's; the generator's random draws changed, update bench/quality_ceiling.replay_world")
    top = world.user_interests.shape[1]
    aff = world.user_vec @ cluster_center.T.astype(np.float32)
    if not np.array_equal(np.argsort(-aff, axis=1)[:, :top], world.user_interests):
        raise CeilingError(f"replayed generator world (seed {cfg.seed}): user interests differ from the world's; "
                           f"update bench/quality_ceiling.replay_world")
    return WorldExtras(proj=proj, scores=scores, cluster_center=cluster_center)


def bucket_intervals(score: np.ndarray, vocab: int) -> np.ndarray:
    """``[vocab, 2]`` the score interval of each equal-frequency bucket (``_bucketize``): edges at the midpoints
    of the realized scores on either side of each bucket boundary (``-inf`` / ``inf`` outside).

    Args:
        score: ``[U]`` the realized scores of all users.
        vocab: buckets.
    """
    s = np.sort(score)
    u = s.shape[0]
    first = -(-np.arange(1, vocab) * u // vocab)  # first rank of bucket v: ceil(v U / V)
    first = np.clip(first, 1, u - 1)
    edges = np.concatenate([[-np.inf], 0.5 * (s[first - 1] + s[first]), [np.inf]])
    return np.stack([edges[:-1], edges[1:]], axis=1)


def user_evidence(world: Any, extras: WorldExtras, users: np.ndarray, condition: str = "buckets") -> UserEvidence:
    """The evidence a model sees of ``users`` (ids) in the regenerated world.

    Args:
        world: the generator's ``_World``.
        extras: :func:`replay_world` of it.
        users: int ``[T]`` user ids.
        condition: ``buckets`` (the bucketed user features), ``buckets+interests`` (also the interest set) or
            ``none`` (nothing: the prior itself).
    """
    from meta_io.synth import generator as G

    feats = world.user_feats[users]
    bias_iv = None
    proj_j = [j for j in sorted(extras.scores) if j % 8 in (1, 4, 6)] if condition != "none" else []
    for j in sorted(extras.scores):
        if j % 8 == 2 and bias_iv is None and condition != "none":
            bias_iv = bucket_intervals(extras.scores[j], G._user_feature_vocab(j))[feats[:, j]]
    seg_vec = world.user_seg_vec[users].astype(np.float64)
    proj = extras.proj[proj_j] if proj_j else np.zeros((0, extras.proj.shape[1]))
    proj_iv = np.stack([bucket_intervals(extras.scores[j], G._user_feature_vocab(j))[feats[:, j]] for j in proj_j],
                       axis=1) if proj_j else np.zeros((users.shape[0], 0, 2))
    mask = None
    if condition == "buckets+interests":
        mask = np.zeros((users.shape[0], extras.cluster_center.shape[0]), dtype=bool)
        lens = world.user_interests_len[users]
        cols = np.arange(world.user_interests.shape[1])[None, :] < lens[:, None]
        rr = np.repeat(np.arange(users.shape[0]), lens)
        mask[rr, world.user_interests[users][cols]] = True
    return UserEvidence(bias_interval=bias_iv, proj=proj, proj_offset=seg_vec @ proj.T, proj_interval=proj_iv,
                        cluster_center=extras.cluster_center, seg_vec=seg_vec, interests=mask)


def world_rows(world: Any, table: Any, order: np.ndarray, rank: np.ndarray, users: np.ndarray) -> tuple[Rows, dict[str, np.ndarray]]:
    """The held-out rows in (user, time) order with their global logits; checks the world reproduces the file.

    Args:
        world: the generator's ``_World``.
        table: the held-out rows (``meta_io.firstk.read_table``).
        order: the first-k layout's row order (by user, then time).
        rank: the layout's rank of every input row.
        users: sorted user ids (index = the user's position in :class:`Samples`).

    Returns:
        ``(rows, extra)``, ``extra`` holding the input row numbers, the oracle and global scores per head.

    Raises:
        CeilingError: the regenerated world's true probabilities differ from the file's ``p_click``/``p_conversion``.
    """
    from meta_io.synth import generator as G

    col = lambda name: table.column(name).to_numpy()[order]  # noqa: E731
    uid, item, scene = col("user_id"), col("item_id"), col("scene")
    pos, hour = col("ctx_f0"), col("ctx_f1")
    k = G.LATENT_DIM
    ivec = world.item_vec[item].astype(np.float64) / np.sqrt(k)
    inter_glob = np.einsum("nk,nk->n", world.user_seg_vec[uid].astype(np.float64), ivec)
    g_click = world.base_click[scene] + world.item_bias[item] + world.pos_effect[pos] + world.hour_effect[hour] \
        + CLICK_INTER * inter_glob
    g_cvr = world.base_cvr[scene] + world.item_cvr_bias[item] + CVR_INTER * inter_glob
    personal = (world.user_vec[uid] - world.user_seg_vec[uid]).astype(np.float64)
    inter_p = np.einsum("nk,nk->n", personal, ivec)
    b = world.user_bias[uid].astype(np.float64)
    hidden_click = world.hidden_click[uid] + world.hidden_scene[uid, scene]  # zeros in the default world
    taste = world.taste_of(uid, item)  # zeros outside a taste world
    true_click = _sigmoid(g_click + CLICK_INTER * inter_p + b + world.user_scene_bias[uid, scene] + hidden_click
                          + taste)
    true_conv = true_click * _sigmoid(g_cvr + CVR_INTER * inter_p + CVR_BIAS * b + world.hidden_cvr[uid]
                                      + world.cfg.taste_cvr_weight * taste)
    p_click, p_conv = col("p_click").astype(np.float64), col("p_conversion").astype(np.float64)
    err = max(float(np.abs(true_click - p_click).max(initial=0.0)), float(np.abs(true_conv - p_conv).max(initial=0.0)))
    if err > 1e-4:
        raise CeilingError(f"regenerated world (seed {world.cfg.seed}) does not reproduce the held-out rows' true "
                           f"probabilities: max |diff| {err:.2e} > 1e-4 (the generator's hidden model changed?)")
    rows = Rows(user=np.searchsorted(users, uid), rank=rank[order], scene=scene, item_vec=ivec, g_click=g_click,
                g_cvr=g_cvr, click=col("click").astype(np.float64), conversion=col("conversion").astype(np.float64),
                group=world.item_taste_group[item])
    extra = {"input_row": order, "oracle_click": p_click, "oracle_conversion": p_conv,
             "oracle_global_click": _sigmoid(g_click), "oracle_global_conversion": _sigmoid(g_click) * _sigmoid(g_cvr),
             "reconstruction_max_abs_err": np.array(err)}
    return rows, extra


# -- one seed -------------------------------------------------------------------------------------------


def ceiling_for_split(cfg: Any, holdout_dir: Path, schema_path: Path, ks: list[int], m: int, sampler_seed: int,
                      condition: str = "buckets", prior: Prior | None = None, relabel: int = 50,
                      redraw: int = 0) -> dict[str, Any]:
    """AUC of the four scores per K and head on the first-k scored rows of the held-out users of one seed.

    Args:
        cfg: the seed's ``GeneratorConfig`` (the world is regenerated from it).
        holdout_dir: the held-out users' rows (``split_by_task``'s holdout folder).
        schema_path: their schema.
        ks: support sizes K.
        m: importance draws per user.
        sampler_seed: the sampler's seed (with the generator's seed).
        condition: what the base knows besides the global features (:data:`CONDITIONS`).
        prior: the personal terms' prior (default: the generator's for ``cfg``, :meth:`Prior.of_config`).
        relabel: label redraws of :func:`relabeled_gain` (the gain's label noise; 0: off).
        redraw: redraws of every label, support included (:func:`redrawn_gains`; 0: off).

    Returns:
        per K and head (``out["by_k"][K][head]``) the AUC of each of :data:`SCORES` and of ``offset_only``
        (:func:`offset_posterior` on the prior predictive), ``ceiling_gain`` = ``full_gain`` (posterior -
        prior predictive), ``offset_only_gain`` (offset_only - prior predictive), ``non_offset_gain``
        (posterior - offset_only: the part of the gain an offset cannot reach), ``offset_share``
        (offset_only_gain / full_gain, ``None`` when the full gain is 0), ``offset_tau`` and
        ``offset_only_gain_best_tau`` (:func:`offset_figures`).
    """
    from meta_io.firstk import first_k_layout, read_table
    from meta_io.schema import load_schema
    from meta_io.synth import generator as G

    if condition not in CONDITIONS:
        raise CeilingError(f"condition: expected one of {', '.join(CONDITIONS)}, got {condition!r}")
    schema = load_schema(schema_path)
    table = read_table(holdout_dir, schema)
    keys = table.column(schema.task_key).to_numpy()
    times = table.column(schema.timestamp).to_numpy()
    lays = {k: first_k_layout(keys, times, k) for k in ks}
    lay0 = lays[ks[0]]
    world = G._World(cfg)
    extras = replay_world(world)
    users = np.unique(keys)
    rows, extra = world_rows(world, table, lay0.order, lay0.rank, users)
    ev = user_evidence(world, extras, users, condition)
    rng = np.random.default_rng([cfg.seed, sampler_seed, 0xCE1])
    samples = sample_personal(ev, Prior.of_config(cfg) if prior is None else prior, len(G.SCENES), m, rng)
    pred = predictive(rows, samples, ks)
    pos_of_input = np.empty(rows.user.shape[0], dtype=np.int64)
    pos_of_input[extra["input_row"]] = np.arange(rows.user.shape[0])
    out: dict[str, Any] = {"held_out_users": int(users.shape[0]), "rows": int(rows.user.shape[0]),
                           "reconstruction_max_abs_err": float(extra["reconstruction_max_abs_err"]),
                           "ess_prior": _quantiles(pred["ess_prior"]), "by_k": {}}
    for k in ks:
        scored = pos_of_input[lays[k].query_rows]  # exactly the rows first_k_batches scores
        if not np.array_equal(np.sort(scored), np.flatnonzero(rows.rank >= k)):
            raise CeilingError(f"first-k layout (k={k}) scores other rows than rank >= k")
        entry: dict[str, Any] = {"scored_rows": int(scored.size), "tasks": int(lays[k].task_keys.shape[0]),
                                 "ess_posterior": _quantiles(pred["ess_posterior"][k])}
        for h in HEADS:
            label = rows.click if h == "click" else rows.conversion
            sc = {"oracle_global": extra[f"oracle_global_{h}"], "prior_predictive": pred["prior"][h],
                  "posterior_predictive": pred["posterior"][k][h], "oracle": extra[f"oracle_{h}"]}
            entry[h] = head_aucs(label, sc, scored)
            entry[h].update(offset_figures(label, sc["prior_predictive"], rows, k, scored, entry[h]))
            if relabel:
                entry[h]["ceiling_gain_relabeled"] = relabeled_gain(sc["oracle"], sc["prior_predictive"],
                                                                    sc["posterior_predictive"], scored, relabel, rng)
        out["by_k"][k] = entry
    if redraw:
        for k, hs in redrawn_gains(rows, samples, extra["oracle_click"], extra["oracle_conversion"],
                                   {k: pos_of_input[lays[k].query_rows] for k in ks}, redraw,
                                   np.random.default_rng([cfg.seed, sampler_seed, 0x5EED])).items():
            for h, g in hs.items():
                out["by_k"][k][h]["ceiling_gain_redrawn"] = g
    return out


def offset_figures(label: np.ndarray, prior: np.ndarray, rows: Rows, k: int, scored: np.ndarray,
                   aucs: dict[str, float]) -> dict[str, Any]:
    """The offset-only AUC of one head and the split of the full gain into what an offset reaches and the rest;
    also ``offset_only_gain_best_tau``: the offset-only gain at the tau of :data:`OFFSET_TAUS` that is best on
    the scored labels (an upper bound on the choice of tau, not a posterior).

    Args:
        label: ``[N]`` the head's labels.
        prior: ``[N]`` the prior-predictive probability (the best possible base).
        rows: the rows (user, rank).
        k: support size K.
        scored: the scored row indices (rank >= k).
        aucs: :func:`head_aucs` of the head (``prior_predictive``, ``posterior_predictive``, ``ceiling_gain``).
    """
    off = offset_posterior(prior, label, rows.user, rows.rank, k)
    s = off["score"][scored]
    if not np.isfinite(s).all():
        raise CeilingError(f"offset_only: {int((~np.isfinite(s)).sum())} of {s.size} scored rows have no finite score")
    a = auc(label[scored], s)
    full = aucs["ceiling_gain"]
    off_gain = a - aucs["prior_predictive"]
    # the same with tau chosen on the scored labels (an upper bound on any tau): how much the choice matters
    best = max(auc(label[scored], offset_posterior(prior, label, rows.user, rows.rank, k, (tau,))["score"][scored])
               for tau in OFFSET_TAUS)
    return {"offset_only": a, "offset_tau": off["tau"], "full_gain": full, "offset_only_gain": off_gain,
            "non_offset_gain": aucs["posterior_predictive"] - a,
            "offset_share": off_gain / full if abs(full) > 1e-12 else None,
            "offset_only_gain_best_tau": best - aucs["prior_predictive"]}


def ceiling_gains(cfg: Any, holdout_dir: Path, schema_path: Path, k: int = 8, m: int = 4000,
                  sampler_seed: int = 0) -> dict[str, dict[str, Any]]:
    """The Bayes ceiling of first-k adaptation on exactly the scored rows of ``holdout_dir``: for a bench that
    trains on the same split (``bench.quality``'s ``taste_gain_share``) and needs the full gain and the part an
    offset cannot reach.

    Args:
        cfg: the ``GeneratorConfig`` that generated the data (any world; regenerated from it).
        holdout_dir: the held-out users' rows (the split's holdout folder).
        schema_path: their schema.
        k: support size K (first-k: each user's first k rows by time are the support).
        m: importance draws per user.
        sampler_seed: the sampler's seed.

    Returns:
        ``{head: {"prior_predictive", "posterior_predictive", "offset_only", "oracle", "full_gain",
        "offset_only_gain", "non_offset_gain", "offset_share", "offset_tau", "offset_only_gain_best_tau"}}``
        (AUCs and gains of
        :func:`ceiling_for_split`, no relabeling).
    """
    res = ceiling_for_split(cfg, holdout_dir, schema_path, [k], m, sampler_seed, relabel=0)
    keys = ("prior_predictive", "posterior_predictive", "offset_only", "oracle", "full_gain", "offset_only_gain",
            "non_offset_gain", "offset_share", "offset_tau", "offset_only_gain_best_tau")
    return {h: {key: res["by_k"][k][h][key] for key in keys} for h in HEADS}


def redrawn_gains(rows: Rows, samples: Samples, p_click: np.ndarray, p_conv: np.ndarray,
                  scored: dict[int, np.ndarray], repeats: int, rng: np.random.Generator) -> dict[int, Any]:
    """The ceiling gain's expectation over ALL label noise: every row's click and conversion redrawn from
    the true probabilities (support labels too, so the posterior changes), ``repeats`` times.

    Args:
        rows: the rows (their labels are replaced).
        samples: the draws of the personal terms (the same for every redraw).
        p_click / p_conv: ``[N]`` true probabilities (conversion = click AND Bernoulli(p_conv / p_click)).
        scored: K -> scored row indices.
        repeats: redraws.
        rng: their generator.

    Returns:
        ``{K: {head: {"mean", "sd", "draws"}}}``.
    """
    n = p_click.shape[0]
    pv = np.divide(p_conv, p_click, out=np.zeros(n), where=p_click > 0)
    ks = sorted(scored)
    d: dict[int, dict[str, list[float]]] = {k: {h: [] for h in HEADS} for k in ks}
    for _ in range(repeats):  # each redraw is one vectorized pass over all rows and draws
        c = (rng.random(n) < p_click).astype(np.float64)
        v = c * (rng.random(n) < pv)
        pred = predictive(dataclasses.replace(rows, click=c, conversion=v), samples, ks)
        for k in ks:
            sc = scored[k]
            for h, y in (("click", c), ("conversion", v)):
                d[k][h].append(auc(y[sc], pred["posterior"][k][h][sc]) - auc(y[sc], pred["prior"][h][sc]))
    return {k: {h: {"mean": float(np.mean(x)), "sd": float(np.std(x)), "draws": repeats} for h, x in hs.items()}
            for k, hs in d.items()}


def head_aucs(label: np.ndarray, scores: dict[str, np.ndarray], scored: np.ndarray) -> dict[str, float]:
    """AUC of each score on the ``scored`` rows, and ``ceiling_gain`` = posterior - prior-predictive.

    Args:
        label: ``[N]`` 0/1 per row.
        scores: :data:`SCORES` name -> ``[N]`` score per row.
        scored: int row indices.

    Raises:
        CeilingError: a score is not finite on a scored row.
    """
    out: dict[str, float] = {}
    for name in SCORES:
        s = scores[name][scored]
        if not np.isfinite(s).all():
            raise CeilingError(f"{name}: {int((~np.isfinite(s)).sum())} of {s.size} scored rows have no finite score")
        out[name] = auc(label[scored], s)
    out["ceiling_gain"] = out["posterior_predictive"] - out["prior_predictive"]
    return out


def relabeled_gain(p_true: np.ndarray, prior: np.ndarray, post: np.ndarray, scored: np.ndarray,
                   repeats: int, rng: np.random.Generator) -> dict[str, float]:
    """The ceiling gain's expectation over the scored rows' label noise: AUC(post) - AUC(prior) with the
    scored labels redrawn ``repeats`` times from the true probabilities (given the true personal terms a
    scored row's label is independent of the support labels, so this is the same experiment again).

    Args:
        p_true: ``[N]`` true probability of the head per row.
        prior / post: ``[N]`` the two scores.
        scored: int row indices.
        repeats: label draws.
        rng: their generator.

    Returns:
        ``{"mean": ..., "sd": ...}`` over the draws.
    """
    pt, a, b = p_true[scored], prior[scored], post[scored]
    d = []
    for _ in range(repeats):  # a few dozen draws, each vectorized over the scored rows
        y = (rng.random(pt.shape[0]) < pt).astype(np.float64)
        d.append(auc(y, b) - auc(y, a))
    return {"mean": float(np.mean(d)), "sd": float(np.std(d))}


def _quantiles(x: np.ndarray) -> dict[str, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return {}
    return {"min": float(x.min()), "p10": float(np.quantile(x, 0.1)), "median": float(np.median(x))}


def summary(per_seed: dict[int, Any], ks: list[int]) -> dict[int, Any]:
    """Median (min, max) over seeds per K and head of each AUC and the ceiling gain, and the goals' reach
    (issue 16's +0.02 click / +0.01 conversion; issue 29's hidden world: +0.03 click; issue 40's taste world:
    +0.02 click beyond what an offset reaches)."""
    out: dict[int, Any] = {}
    for k in ks:
        e: dict[str, Any] = {}
        for h in HEADS:
            e[h] = {name: _spread([r["by_k"][k][h][name] for r in per_seed.values()])
                    for name in (*SCORES, "offset_only", "ceiling_gain", "offset_only_gain", "non_offset_gain",
                                 "offset_only_gain_best_tau")}
            for key in ("ceiling_gain_relabeled", "ceiling_gain_redrawn"):
                if all(key in r["by_k"][k][h] for r in per_seed.values()):
                    e[h][f"{key}_mean"] = _spread([r["by_k"][k][h][key]["mean"] for r in per_seed.values()])
        e["ceiling_gain_reaches_goal_every_seed"] = {
            "click>=0.02": all(r["by_k"][k]["click"]["ceiling_gain"] >= 0.02 for r in per_seed.values()),
            "click>=0.03": all(r["by_k"][k]["click"]["ceiling_gain"] >= 0.03 for r in per_seed.values()),
            "conversion>=0.01": all(r["by_k"][k]["conversion"]["ceiling_gain"] >= 0.01 for r in per_seed.values()),
            "non_offset_click>=0.02": all(r["by_k"][k]["click"]["non_offset_gain"] >= 0.02 for r in per_seed.values()),
        }
        out[k] = e
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.quality import SMOKE_ROWS, cold_generator_config, cold_sizes, cold_split, parse_first_k
    from meta_io.synth import HIDDEN_KNOBS, TASTE_KNOBS, WORLDS, generate, world_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="bench.quality --quick's data (16k rows, 250 users)")
    ap.add_argument("--rows", type=int, default=0, help="generated rows (as bench.quality --rows)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs every code path and prints the JSON line (bench.quality --smoke's "
                         "data, seed 3, K=4, 2000 draws, 2 redraws unless given; seconds, figures meaningless)")
    ap.add_argument("--seeds", default="", help="seeds (default 3,4,5; --smoke: 3)")
    ap.add_argument("--first-k", default="", help="support sizes K (default 4,8,16,32; --smoke: 4)")
    ap.add_argument("--samples", type=int, default=None,
                    help="importance draws per user (>= 2000; default 4000, --smoke 2000)")
    ap.add_argument("--sampler-seed", type=int, default=0)
    ap.add_argument("--redraw", type=int, default=None,
                    help="also the gain's mean over this many redraws of every label from the true probabilities "
                         "(default 0: none; --smoke: 2)")
    ap.add_argument("--world", choices=tuple(WORLDS), default="default",
                    help="the generator's world (meta_io.synth.WORLDS): default, hidden (per-user click / cvr "
                         "logit offsets that no feature reveals: GeneratorConfig.hidden_user_effect_std 1.5, "
                         "hidden_user_cvr_effect_std 0.75) or taste (per-user tastes over item groups that no "
                         "feature reveals: taste_std, taste_groups, taste_cvr_weight)")
    for flag, knob, kind in (("--hidden-std", "hidden_user_effect_std", float),
                             ("--hidden-cvr-std", "hidden_user_cvr_effect_std", float),
                             ("--hidden-scene-std", "hidden_user_scene_effect_std", float),
                             ("--taste-std", "taste_std", float), ("--taste-groups", "taste_groups", int),
                             ("--taste-cvr-weight", "taste_cvr_weight", float)):
        ap.add_argument(flag, type=kind, default=None, dest=knob,
                        help=f"GeneratorConfig.{knob} (over --world's value)")
    ap.add_argument("--condition", choices=CONDITIONS, default="buckets",
                    help="what the base knows of a user besides the global features: the bucketed user features "
                         "(default), also the interest set (mh_user_interests), or nothing (labels only)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.seeds = args.seeds or ("3" if args.smoke else "3,4,5")
    args.first_k = args.first_k or ("4" if args.smoke else "4,8,16,32")
    if args.samples is None:
        args.samples = 2000 if args.smoke else 4000
    if args.redraw is None:
        args.redraw = 2 if args.smoke else 0
    ks = parse_first_k(args.first_k)
    if not ks:
        raise SystemExit("--first-k: at least one K >= 1")
    if args.samples < 2000:
        raise SystemExit(f"--samples: expected >= 2000 draws per user, got {args.samples}")
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    rows, users, items, fraction = cold_sizes(args.quick or args.smoke, args.rows or (SMOKE_ROWS if args.smoke else 0))
    overrides = {knob: getattr(args, knob) for knob in (*HIDDEN_KNOBS, *TASTE_KNOBS) if getattr(args, knob) is not None}
    for knob, v in overrides.items():
        if not (np.isfinite(v) and v >= 0):
            raise SystemExit(f"--{knob}: expected a finite number >= 0, got {v}")

    def config(seed: int) -> Any:
        base = world_config(cold_generator_config(rows, users, items, seed), args.world)
        cfg = dataclasses.replace(base, **overrides)
        try:
            cfg.validate()
        except ValueError as e:
            raise SystemExit(f"bench.quality_ceiling: {e}") from None
        return cfg

    first = config(seeds[0] if seeds else 0)
    hidden = {knob: float(getattr(first, knob)) for knob in HIDDEN_KNOBS}
    taste = {knob: getattr(first, knob) for knob in TASTE_KNOBS}
    out: dict[str, Any] = {"rows": rows, "users": users, "items": items, "held_out_fraction": fraction, "seeds": seeds,
                           "first_k": ks, "samples": args.samples, "sampler_seed": args.sampler_seed,
                           "condition": args.condition, "world": args.world, "hidden": hidden, "taste": taste,
                           "per_seed": {}}
    t0 = time.perf_counter()
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="bench-ceiling-") as td:
            tmp = Path(td)
            cfg = config(seed)
            gen = generate(tmp / "raw", cfg, progress=False)
            split = cold_split(gen, tmp, seed, fraction)
            res = ceiling_for_split(cfg, split.holdout_dir, split.schema_path, ks, args.samples, args.sampler_seed,
                                    condition=args.condition, redraw=args.redraw)
        out["per_seed"][seed] = res
        for k in ks:
            e = res["by_k"][k]
            print(f"[seed {seed}] K={k} rows {e['scored_rows']}: " + "; ".join(
                f"{h} " + " ".join(f"{n} {e[h][n]:.4f}" for n in SCORES) + f" gain {e[h]['ceiling_gain']:+.4f}"
                + f" (offset only {e[h]['offset_only_gain']:+.4f}, beyond an offset {e[h]['non_offset_gain']:+.4f})"
                + f" (relabeled {e[h]['ceiling_gain_relabeled']['mean']:+.4f} sd {e[h]['ceiling_gain_relabeled']['sd']:.4f}"
                + (f", redrawn {e[h]['ceiling_gain_redrawn']['mean']:+.4f} sd {e[h]['ceiling_gain_redrawn']['sd']:.4f}"
                   if "ceiling_gain_redrawn" in e[h] else "") + ")"
                for h in HEADS) + f"; ess posterior min {e['ess_posterior'].get('min', float('nan')):.0f}", flush=True)
        log.info("ceiling seed done", extra=kv(seed=seed, users=res["held_out_users"]))
    out["by_k"] = summary(out["per_seed"], ks)
    out["elapsed_s"] = time.perf_counter() - t0
    print(json.dumps(out, default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
