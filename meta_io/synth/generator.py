"""AntM2C-like synthetic CTR/CVR logs with a known ground-truth model.

The generator writes ``n_files`` Parquet files plus ``schema.json`` into an
output folder. Rows imitate AntM2C (arXiv 2308.16437): five scenarios (item
types: 0 ads, 1 vouchers, 2 mini-programs, 3 contents, 4 videos), user / item /
context categorical features, multi-hot lists, dense features, a title
(token-id list) and an image embedding (fixed-length float vector), a
``log_time`` spread over 8 days, and labels ``click`` and ``conversion``
drawn from a hidden model whose true probabilities are written next to them
(``p_click``, ``p_conversion``; ``p_conversion`` is P(click AND convert), the
CTCVR probability).

Hidden model (per row r with user u, item i, scene s)::

    latent u_vec = 0.9 * segment_center[seg(u)] + 0.7 * personal(u)     (k=8)
    latent i_vec = cluster_center[cluster(i)] + 0.5 * noise(i)
    logit_click  = base_click[s] + item_bias(i) + pos_effect[position(r)]
                 + hour_effect[hour(r)] + 0.8 * <u_vec, i_vec> / sqrt(k)
                 + user_bias(u) + user_scene_bias(u, s)          <- personal
                 + hidden_click(u) + hidden_scene(u, s)          <- hidden (default 0)
                 + taste(u, group(i))                            <- taste (default 0)
    p_cvr        = sigmoid(base_cvr[s] + item_cvr_bias(i) + 0.4 * <u_vec, i_vec>/sqrt(k)
                           + 0.5 * user_bias(u) + hidden_cvr(u)
                           + taste_cvr_weight * taste(u, group(i)))
    p_click = sigmoid(logit_click);  p_conversion = p_click * p_cvr
    click ~ Bernoulli(p_click);  conversion = click AND Bernoulli(p_cvr)

``personal(u)``, ``user_bias`` and ``user_scene_bias`` are visible only
through the user's own rows (and weakly through two bucketed user features),
so adapting to a user's support rows pays off, while the segment, item,
scenario and context terms (about 70% of the logit variance) are learnable
from the features of any row.

Hidden per-task effects (``GeneratorConfig.hidden_user_effect_std``,
``hidden_user_cvr_effect_std``, ``hidden_user_scene_effect_std``; all 0 by
default): ``hidden_click(u) ~ N(0, hidden_user_effect_std^2)``,
``hidden_cvr(u) ~ N(0, hidden_user_cvr_effect_std^2)`` and
``hidden_scene(u, s) ~ N(0, hidden_user_scene_effect_std^2)`` (one per user
and scenario: AntM2C's per-scenario cold start) are logit offsets drawn from
a random stream of their own, independent of every other draw of the world,
and no column depends on them: every feature column of a world with them is
byte-identical to the same seed's world without them; only ``click``,
``conversion``, ``p_click`` and ``p_conversion`` change. The one way to learn
them is a user's own labels, which is what per-task adaptation is for (the
personal terms above are mostly revealed by the bucketed user features, see
``bench/quality_ceiling.py``). The draws are standard normals scaled by the
std, so for one seed the offsets are proportional to it; with every std 0 the
data are those of before the knobs existed, bit for bit.

Per-user tastes (``GeneratorConfig.taste_std``, ``taste_groups``,
``taste_cvr_weight``; ``taste_std`` 0 by default): every user has a hidden
taste vector over ``taste_groups`` item groups, ``taste(u, g) ~ N(0,
taste_std^2)`` i.i.d. over users and groups, drawn from a random stream of its
own ("TASTE"). An item's group is a function of its cluster, ``group(i) =
cluster(i) * taste_groups // N_CLUSTERS`` (contiguous blocks of clusters), and
the cluster is visible: it is ``item_f0`` (and it shapes ``item_f1``, the
title's own tokens and the item tags), so a model's item / category embeddings
carry the group. No user column is computed from the taste: it is revealed
only by a user's own labels, and by item group, so the right adaptation is a
different score per item group, not one offset per user (the part of a
user's taste vector that is a per-user offset is its mean over the groups:
``1 / taste_groups`` of its variance). The taste enters the click logit in
full and the cvr logit times ``taste_cvr_weight``. As with the hidden effects,
every feature column of a taste world is byte-identical to the same seed's
default world; only the labels and true probabilities change. No drift over
time: a user's taste is the same on all 8 days.

Memory: only per-user and per-item tables live in memory (about 250 bytes a
user plus 56 for the hidden-effect tables and, in a taste world, 8 per taste
group; 200 bytes an item). Rows are generated and written one row group at a
time, so 10M rows need the same row memory as 100k.

Example::

    >>> data = generate("/tmp/gen", GeneratorConfig(rows=10_000, users=1_000, items=500))
    >>> sorted(data.oracle_auc)
    ['click', 'conversion']
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from meta_io.schema import ColumnKind, ColumnSpec, Pooling, Schema
from common.evaluation import StreamingAUC
from common.log import kv

log = logging.getLogger(__name__)

SCENES = ("ads", "vouchers", "mini_programs", "contents", "videos")
"""Scenario ids 0..4, as in AntM2C's five item types."""

# Share of rows per scenario and its base rates (before user/item effects).
SCENE_ROW_SHARE = np.array([0.35, 0.10, 0.15, 0.25, 0.15])
SCENE_BASE_CLICK = np.array([0.05, 0.30, 0.12, 0.22, 0.35])
SCENE_BASE_CVR = np.array([0.08, 0.35, 0.15, 0.03, 0.05])

LATENT_DIM = 8
N_SEGMENTS = 20
N_CLUSTERS = 32
TIME_START = 1_685_577_600  # 2023-06-01T00:00:00Z
TIME_SPAN_S = 8 * 86_400
ZIPF_SHIFT = 10.0  # Zipf-Mandelbrot shift: the head id holds ~2% of rows, not 20%

HIDDEN_KNOBS = ("hidden_user_effect_std", "hidden_user_cvr_effect_std", "hidden_user_scene_effect_std")
"""The :class:`GeneratorConfig` fields of the hidden per-task effects."""

TASTE_KNOBS = ("taste_std", "taste_groups", "taste_cvr_weight")
"""The :class:`GeneratorConfig` fields of the per-user tastes over item groups (module docstring)."""

WORLDS: dict[str, dict[str, Any]] = {  # Any: replace(**) checks each field's type
    "default": {},
    "hidden": {"hidden_user_effect_std": 1.5, "hidden_user_cvr_effect_std": 0.75},
    "taste": {"taste_std": 2.0, "taste_groups": 4, "taste_cvr_weight": 0.5},
}
"""Named worlds: :class:`GeneratorConfig` fields set over the defaults (:func:`world_config`).

``hidden``: per-user click / cvr logit offsets no feature reveals, std 1.5 / 0.75 (about the user_bias's
0.8 / 0.4 scaled by 1.9). Chosen with ``python -m bench.quality_ceiling --quick --world hidden``: the Bayes
ceiling's first-k (K = 8) click AUC gain is >= +0.03 on seeds 3, 4, 5 there (about +0.00 in ``default``).

``taste``: a taste per user and item group, 4 groups of 8 clusters, std 2.0, half of it on the cvr logit
(module docstring, "Per-user tastes"). Chosen with ``python -m bench.quality_ceiling --quick --rows 64000
--seeds 3,4,5 --first-k 8 --world taste --taste-std S``: the part of the Bayes gain beyond one offset per
user (``non_offset_gain``, K = 8) was +0.030 / +0.029 / +0.021 click at std 1.5 and +0.0512 / +0.0465 /
+0.0501 click, +0.0772 / +0.0489 / +0.0375 conversion at std 2.0 (full gains +0.054 to +0.083 click; an
offset takes +0.004 to +0.037 of them).
"""


@dataclass(frozen=True)
class GeneratorConfig:
    """How much and what kind of data to generate.

    Args:
        rows: total rows over all files.
        users: distinct user ids (warm + cold).
        items: distinct item ids.
        seed: the same seed (and config) gives byte-identical data.
        n_files: Parquet files written (rows split evenly).
        row_group_rows: rows per Parquet row group (and per generated chunk).
        n_user_features / n_item_features / n_context_features: categorical
            feature columns per group (``user_f*``, ``item_f*``, ``ctx_f*``).
        n_multi_hot: multi-hot list columns (``mh_*``), each up to
            ``multi_hot_max_len`` ids.
        n_dense: dense float columns (``dense_*``).
        text_max_len / text_vocab: title token lists (``title``).
        image_dim: length of the ``image`` float vector.
        zipf_users / zipf_items: popularity exponents.
        cold_user_fraction: share of users that get only 1-5 rows each.
        hidden_user_effect_std: std of a per-user click-logit offset that no
            feature reveals (module docstring, "Hidden per-task effects"); 0: none.
        hidden_user_cvr_effect_std: the same for the conversion (p_cvr) logit,
            drawn independently of the click offset; 0: none.
        hidden_user_scene_effect_std: std of a per-(user, scenario)
            click-logit offset that no feature reveals; 0: none.
        taste_std: std of each user's hidden taste for an item group (module
            docstring, "Per-user tastes"), added to the click logit; 0: none.
        taste_groups: item groups a taste vector spans (1..N_CLUSTERS); an
            item's group is ``cluster * taste_groups // N_CLUSTERS``.
        taste_cvr_weight: the taste enters the cvr logit times this (>= 0).

    Example::

        >>> GeneratorConfig(rows=1000, users=100, items=50).validate()
    """

    rows: int = 100_000
    users: int = 10_000
    items: int = 5_000
    seed: int = 0
    n_files: int = 4
    row_group_rows: int = 65_536
    n_user_features: int = 8
    n_item_features: int = 8
    n_context_features: int = 6
    n_multi_hot: int = 3
    multi_hot_max_len: int = 6
    n_dense: int = 8
    text_max_len: int = 16
    text_vocab: int = 20_000
    image_dim: int = 16
    zipf_users: float = 1.1
    zipf_items: float = 1.2
    cold_user_fraction: float = 0.3
    hidden_user_effect_std: float = 0.0
    hidden_user_cvr_effect_std: float = 0.0
    hidden_user_scene_effect_std: float = 0.0
    taste_std: float = 0.0
    taste_groups: int = 4
    taste_cvr_weight: float = 0.5

    @property
    def cold_users(self) -> int:
        return int(round(self.users * self.cold_user_fraction))

    def validate(self) -> None:
        for name in ("rows", "users", "n_files", "row_group_rows", "multi_hot_max_len", "text_max_len", "image_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.items < len(SCENES):
            raise ValueError(f"items must be >= {len(SCENES)} (one per scenario), got {self.items}")
        for name in ("n_user_features", "n_item_features", "n_context_features", "n_multi_hot", "n_dense"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.text_vocab < 2 * N_CLUSTERS:
            raise ValueError(f"text_vocab must be >= {2 * N_CLUSTERS}, got {self.text_vocab}")
        if self.zipf_users <= 0 or self.zipf_items <= 0:
            raise ValueError(f"zipf exponents must be > 0, got users={self.zipf_users} items={self.zipf_items}")
        if not 0.0 <= self.cold_user_fraction < 1.0:
            raise ValueError(f"cold_user_fraction must be in [0, 1), got {self.cold_user_fraction}")
        for name in ("hidden_user_effect_std", "hidden_user_cvr_effect_std", "hidden_user_scene_effect_std"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        for name in ("taste_std", "taste_cvr_weight"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if not 1 <= self.taste_groups <= N_CLUSTERS:
            raise ValueError(f"taste_groups must be in [1, {N_CLUSTERS}], got {self.taste_groups}")
        if self.users - self.cold_users < 1:
            raise ValueError(f"cold_user_fraction={self.cold_user_fraction} leaves no warm users of {self.users}")
        need = 5 * self.cold_users + 1
        if self.rows < need:
            raise ValueError(
                f"rows={self.rows} too few for {self.cold_users} cold users (1-5 rows each): need >= {need}"
            )
        if self.rows < self.n_files:
            raise ValueError(f"rows={self.rows} must be >= n_files={self.n_files}")


def world_config(cfg: GeneratorConfig, world: str) -> GeneratorConfig:
    """``cfg`` with the fields of the named world (:data:`WORLDS`) set.

    Args:
        cfg: the base config (its own hidden-effect fields are replaced only where the world sets them).
        world: a key of :data:`WORLDS`.

    Raises:
        ValueError: an unknown world.

    Example::

        >>> world_config(GeneratorConfig(), "hidden").hidden_user_effect_std
        1.5
    """
    if world not in WORLDS:
        raise ValueError(f"world: expected one of {', '.join(WORLDS)}, got {world!r}")
    return replace(cfg, **WORLDS[world])


@dataclass
class GeneratedData:
    """What :func:`generate` wrote and measured.

    Args:
        out_dir: the output folder.
        files: the Parquet files, in order.
        schema_path: ``schema.json`` next to them.
        rows: rows written.
        oracle_auc: label -> AUC of the true probability against the label.
        oracle_auc_global: label -> AUC of the true logit with the personal
            (per-user) terms, hidden ones included, removed: what a model that
            cannot adapt to a user can reach at best, roughly. ``oracle_auc - oracle_auc_global`` is
            the headroom of per-user adaptation.
        scene_rows / scene_click_rate: per scenario id.
        elapsed_s, rows_per_s, peak_rss_mb: speed and memory of the run.
    """

    out_dir: Path
    files: list[Path]
    schema_path: Path
    rows: int
    oracle_auc: dict[str, float]
    oracle_auc_global: dict[str, float] = field(default_factory=dict)
    scene_rows: dict[int, int] = field(default_factory=dict)
    scene_click_rate: dict[int, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    rows_per_s: float = 0.0
    peak_rss_mb: float = 0.0


# -- schema -------------------------------------------------------------------


def _user_feature_vocab(j: int) -> int:
    return [N_SEGMENTS, 10, 8, 3, 30, 500, 50, 1000][j % 8] * (1 + j // 8)


def _item_feature_vocab(j: int) -> int:
    return [N_CLUSTERS, N_CLUSTERS * 50, 20, 12, 1000, 24, 40, 5000][j % 8] * (1 + j // 8)


def _ctx_feature_vocab(j: int) -> int:
    return [10, 24, 7, 3, 4, 20][j % 6] * (1 + j // 6)


def _multi_hot_names(cfg: GeneratorConfig) -> list[str]:
    base = ["mh_user_interests", "mh_item_tags", "mh_session_tags"]
    return [base[j] if j < len(base) else f"mh_extra{j}" for j in range(cfg.n_multi_hot)]


def generator_schema(cfg: GeneratorConfig) -> Schema:
    """The schema of the files :func:`generate` writes (also saved as schema.json).

    Column order: ids, scene, categorical features, multi-hot lists, title,
    image, dense, time, labels, oracle probabilities.
    """
    cols: list[ColumnSpec] = [
        ColumnSpec("user_id", ColumnKind.SPARSE, table="user"),
        ColumnSpec("item_id", ColumnKind.SPARSE, table="item"),
        ColumnSpec("scene", ColumnKind.SPARSE, table="scene"),
    ]
    cols += [ColumnSpec(f"user_f{j}", ColumnKind.SPARSE) for j in range(cfg.n_user_features)]
    cols += [ColumnSpec(f"item_f{j}", ColumnKind.SPARSE) for j in range(cfg.n_item_features)]
    cols += [ColumnSpec(f"ctx_f{j}", ColumnKind.SPARSE) for j in range(cfg.n_context_features)]
    cols += [
        ColumnSpec(name, ColumnKind.MULTI_HOT, max_len=cfg.multi_hot_max_len, pooling=Pooling.MEAN)
        for name in _multi_hot_names(cfg)
    ]
    cols.append(ColumnSpec("title", ColumnKind.TEXT, table="token", max_len=cfg.text_max_len))
    cols.append(ColumnSpec("image", ColumnKind.VECTOR, dim=cfg.image_dim))
    cols += [ColumnSpec(f"dense_{j}", ColumnKind.DENSE) for j in range(cfg.n_dense)]
    cols.append(ColumnSpec("log_time", ColumnKind.TIMESTAMP))
    cols.append(ColumnSpec("click", ColumnKind.LABEL))
    cols.append(ColumnSpec("conversion", ColumnKind.LABEL))
    cols.append(ColumnSpec("p_click", ColumnKind.ORACLE))
    cols.append(ColumnSpec("p_conversion", ColumnKind.ORACLE))
    schema = Schema(
        columns=cols,
        task_key="user_id",
        labels=["click", "conversion"],
        timestamp="log_time",
        scenario="scene",
        oracle={"click": "p_click", "conversion": "p_conversion"},
    )
    schema.validate()
    return schema


def _arrow_schema(cfg: GeneratorConfig, schema: Schema) -> pa.Schema:
    """Physical Parquet types: lists stay variable-length, as real logs are."""
    fields = []
    for c in schema.columns:
        if c.kind == ColumnKind.SPARSE:
            t = pa.int64()
        elif c.kind in (ColumnKind.MULTI_HOT, ColumnKind.TEXT):
            t = pa.list_(pa.int64())
        elif c.kind == ColumnKind.VECTOR:
            t = pa.list_(pa.float32())
        elif c.kind == ColumnKind.TIMESTAMP:
            t = pa.int64()
        elif c.kind == ColumnKind.LABEL:
            t = pa.int8()
        else:
            t = pa.float32()
        fields.append(pa.field(c.name, t, nullable=False))
    return pa.schema(fields)


# -- hidden world ---------------------------------------------------------------


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p / (1.0 - p))


def _zipf_cdf(n: int, s: float) -> np.ndarray:
    w = (np.arange(1, n + 1, dtype=np.float64) + ZIPF_SHIFT) ** (-s)
    c = np.cumsum(w)
    return c / c[-1]


def _bucketize(x: np.ndarray, vocab: int) -> np.ndarray:
    """Equal-frequency buckets 0..vocab-1 of a real score (rank-based)."""
    ranks = np.argsort(np.argsort(x, kind="stable"), kind="stable")
    return (ranks * vocab // max(len(x), 1)).astype(np.int64)


def _ragged_table(rng: np.random.Generator, n: int, max_len: int, min_len: int = 1) -> np.ndarray:
    """Random list lengths in [min_len, max_len] per entity."""
    return rng.integers(min(min_len, max_len), max_len + 1, size=n)


class _World:
    """Per-user and per-item tables of the hidden model (the only big state)."""

    def __init__(self, cfg: GeneratorConfig) -> None:
        self.cfg = cfg
        ss = np.random.SeedSequence([cfg.seed, 0x4D45544150])  # "METAP"
        rng = np.random.default_rng(ss.spawn(1)[0])
        k = LATENT_DIM
        U, I = cfg.users, cfg.items

        # ---- users: warm ids 0..W-1 by popularity rank, then cold ids.
        self.cold_users = cfg.cold_users
        self.warm_users = U - self.cold_users
        seg_center = rng.normal(size=(N_SEGMENTS, k))
        self.user_seg = rng.integers(0, N_SEGMENTS, size=U)
        personal = rng.normal(size=(U, k))
        self.user_vec = (0.9 * seg_center[self.user_seg] + 0.7 * personal).astype(np.float32)
        self.user_seg_vec = (0.9 * seg_center[self.user_seg]).astype(np.float32)
        self.user_bias = rng.normal(0.0, 0.8, size=U).astype(np.float32)
        self.user_scene_bias = rng.normal(0.0, 0.4, size=(U, len(SCENES))).astype(np.float32)
        cold_counts = rng.integers(1, 6, size=self.cold_users)
        self.cold_rows = int(cold_counts.sum())
        warm_rows = cfg.rows - self.cold_rows
        if self.warm_users == 0 and warm_rows > 0:
            raise ValueError("cold_user_fraction leaves no warm users for the remaining rows")
        self.warm_cdf = _zipf_cdf(max(self.warm_users, 1), cfg.zipf_users)
        # The cold users' rows, shuffled once: an O(users) table consumed in order.
        self.cold_stream = rng.permutation(np.repeat(np.arange(self.warm_users, U), cold_counts)).astype(np.int64)
        expected = np.empty(U)
        expected[: self.warm_users] = np.diff(np.concatenate([[0.0], self.warm_cdf]))[: self.warm_users] * warm_rows
        expected[self.warm_users :] = cold_counts
        self.user_activity = np.log1p(expected).astype(np.float32)

        # User categorical features: segment, two latent buckets, a noisy
        # personal-bias bucket, then noise features of growing vocabularies.
        proj = rng.normal(size=(max(cfg.n_user_features, 1), k))
        feats = []
        for j in range(cfg.n_user_features):
            vocab = _user_feature_vocab(j)
            r = j % 8
            if r == 0:
                f = self.user_seg % vocab
            elif r in (1, 4, 6):
                f = _bucketize(self.user_vec @ proj[j], vocab)
            elif r == 2:
                f = _bucketize(self.user_bias + rng.normal(0.0, 0.6, size=U), vocab)
            else:
                f = np.minimum(rng.zipf(1.5, size=U) - 1, vocab - 1)
            feats.append(f.astype(np.int64))
        self.user_feats = np.stack(feats, axis=1) if feats else np.zeros((U, 0), np.int64)

        # ---- items: each belongs to one scenario (item type) and one cluster.
        cluster_center = rng.normal(size=(N_CLUSTERS, k))
        self.item_scene = rng.integers(0, len(SCENES), size=I)
        self.item_scene[: len(SCENES)] = np.arange(len(SCENES))  # every scene has items
        self.item_cluster = rng.integers(0, N_CLUSTERS, size=I)
        self.item_vec = (cluster_center[self.item_cluster] + 0.5 * rng.normal(size=(I, k))).astype(np.float32)
        w_bias = rng.normal(size=k) / np.sqrt(k)
        self.item_bias = (0.5 * (self.item_vec @ w_bias) + rng.normal(0.0, 0.4, size=I)).astype(np.float32)
        self.item_cvr_bias = (0.5 * self.item_bias + rng.normal(0.0, 0.5, size=I)).astype(np.float32)
        # Popularity: Zipf within each scenario, ids ranked by a random order.
        self.scene_items = [np.flatnonzero(self.item_scene == s) for s in range(len(SCENES))]
        for s in range(len(SCENES)):
            self.scene_items[s] = rng.permutation(self.scene_items[s])
        self.scene_cdf = [_zipf_cdf(len(ids), cfg.zipf_items) for ids in self.scene_items]
        iproj = rng.normal(size=(max(cfg.n_item_features, 1), k))
        feats = []
        for j in range(cfg.n_item_features):
            vocab = _item_feature_vocab(j)
            r = j % 8
            if r == 0:
                f = self.item_cluster % vocab
            elif r == 1:  # brand: 50 per cluster
                f = (self.item_cluster * 50 + rng.integers(0, 50, size=I)) % vocab
            elif r in (3, 5):
                f = _bucketize(self.item_vec @ iproj[j], vocab)
            elif r == 6:
                f = _bucketize(self.item_bias + rng.normal(0.0, 0.3, size=I), vocab)
            else:
                f = rng.integers(0, vocab, size=I)
            feats.append(f.astype(np.int64))
        self.item_feats = np.stack(feats, axis=1) if feats else np.zeros((I, 0), np.int64)
        self.item_price = np.exp(rng.normal(1.0 + 0.1 * (self.item_cluster % 10), 0.8)).astype(np.float32)
        self.item_quality = (self.item_bias + rng.normal(0.0, 0.5, size=I)).astype(np.float32)

        # Titles: half the tokens from the cluster's own 64-token block (so the
        # title tells the category), the rest Zipf over the whole vocabulary.
        L = cfg.text_max_len
        self.title_len = _ragged_table(rng, I, L, min_len=min(3, L))
        own = self.item_cluster[:, None] * 64 + rng.integers(0, 64, size=(I, L))
        common = np.minimum(rng.zipf(1.3, size=(I, L)) - 1 + N_CLUSTERS * 64, cfg.text_vocab - 1)
        pick_own = rng.random(size=(I, L)) < 0.5
        self.title = (np.where(pick_own, own, common) % cfg.text_vocab).astype(np.int64)
        # Image: a noisy linear view of the item latent.
        img_proj = rng.normal(size=(k, cfg.image_dim)) / np.sqrt(k)
        self.image = (self.item_vec @ img_proj + 0.3 * rng.normal(size=(I, cfg.image_dim))).astype(np.float32)

        # Multi-hot tables: user interests = the user's best clusters; item tags
        # = tags of the item's cluster. Session tags are drawn per row.
        M = cfg.multi_hot_max_len
        top = min(M, N_CLUSTERS)
        self.user_interests = np.empty((U, top), dtype=np.int64)
        for b in range(0, U, 1 << 16):  # blocks keep the [U, clusters] temporaries small
            affinity = self.user_vec[b : b + (1 << 16)] @ cluster_center.T.astype(np.float32)
            self.user_interests[b : b + (1 << 16)] = np.argsort(-affinity, axis=1)[:, :top]
        if M > N_CLUSTERS:
            self.user_interests = np.pad(self.user_interests, ((0, 0), (0, M - N_CLUSTERS)), constant_values=0)
        self.user_interests_len = _ragged_table(rng, U, min(M, N_CLUSTERS))
        self.item_tags = self.item_cluster[:, None] * 10 + rng.integers(0, 10, size=(I, M))
        self.item_tags_len = _ragged_table(rng, I, M)

        # Context effects: position (strong), hour of day (mild).
        self.pos_effect = -0.12 * np.arange(10)
        self.hour_effect = 0.25 * np.sin(2 * np.pi * (np.arange(24) - 14) / 24)
        self.base_click = _logit(SCENE_BASE_CLICK)
        self.base_cvr = _logit(SCENE_BASE_CVR)

        # Hidden per-task effects: a stream of their own (the draws above, and so
        # every feature, are the same with or without them); scaled standard normals.
        hrng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x48494445]))  # "HIDE"
        z_click, z_cvr, z_scene = hrng.normal(size=U), hrng.normal(size=U), hrng.normal(size=(U, len(SCENES)))
        self.hidden_click = cfg.hidden_user_effect_std * z_click
        self.hidden_cvr = cfg.hidden_user_cvr_effect_std * z_cvr
        self.hidden_scene = cfg.hidden_user_scene_effect_std * z_scene

        # Per-user tastes over item groups: a stream of their own too; the table exists only where
        # configured ([users, groups] float64 would be 32 bytes a user at 4 groups).
        self.item_taste_group = (self.item_cluster * cfg.taste_groups // N_CLUSTERS).astype(np.int64)
        self.taste: np.ndarray | None = None
        if cfg.taste_std > 0:
            trng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5441535445]))  # "TASTE"
            self.taste = cfg.taste_std * trng.normal(size=(U, cfg.taste_groups))

    def taste_of(self, user: np.ndarray, item: np.ndarray) -> np.ndarray:
        """``taste(user, group(item))`` per row (zeros where the world has no tastes).

        Args:
            user / item: int ``[n]`` ids.
        """
        if self.taste is None:
            return np.zeros(user.shape[0])
        return self.taste[user, self.item_taste_group[item]]


def _lists(table: np.ndarray, lengths: np.ndarray, rows: np.ndarray) -> pa.ListArray:
    """ListArray of ``table[rows, :lengths[rows]]`` without a per-row loop."""
    lens = lengths[rows]
    width = table.shape[1]
    keep = np.arange(width)[None, :] < lens[:, None]
    values = table[rows][keep]
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int64()))


def _chunk(
    world: _World, cfg: GeneratorConfig, index: int, row_start: int, n: int, arrow_schema: pa.Schema
) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """Generate rows [row_start, row_start + n) as one Arrow table."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x524F5753, index]))  # "ROWS"
    k = LATENT_DIM

    # Users: this chunk's share of the cold stream, the rest Zipf over warm users.
    c0 = row_start * world.cold_rows // cfg.rows
    c1 = (row_start + n) * world.cold_rows // cfg.rows
    cold = world.cold_stream[c0:c1]
    n_warm = n - len(cold)
    warm = np.searchsorted(world.warm_cdf, rng.random(n_warm), side="right").clip(max=world.warm_users - 1)
    user = np.concatenate([warm, cold])
    # Time: chunk `index` covers its slice of the 8 days; sorting the random
    # times within the chunk also shuffles cold and warm rows together.
    t0 = TIME_START + row_start * TIME_SPAN_S // cfg.rows
    t1 = TIME_START + (row_start + n) * TIME_SPAN_S // cfg.rows
    times = rng.integers(t0, max(t1, t0 + 1), size=n)
    order = np.argsort(times, kind="stable")
    user, times = user[order], times[order]

    # Items: scenario first (fixed shares), then Zipf within the scenario.
    scene = np.searchsorted(np.cumsum(SCENE_ROW_SHARE), rng.random(n) * SCENE_ROW_SHARE.sum(), side="right")
    scene = scene.clip(max=len(SCENES) - 1)
    item = np.empty(n, dtype=np.int64)
    u_item = rng.random(n)
    for s in range(len(SCENES)):  # 5 scenarios, vectorized over rows
        rows = scene == s
        idx = np.searchsorted(world.scene_cdf[s], u_item[rows], side="right").clip(max=len(world.scene_items[s]) - 1)
        item[rows] = world.scene_items[s][idx]

    position = np.minimum(rng.geometric(0.3, size=n) - 1, 9)
    hour = (times // 3600) % 24
    weekday = (times // 86_400 + 4) % 7  # 1970-01-01 was a Thursday

    # Hidden model.
    inter_full = np.einsum("ij,ij->i", world.user_vec[user], world.item_vec[item]) / np.sqrt(k)
    inter_glob = np.einsum("ij,ij->i", world.user_seg_vec[user], world.item_vec[item]) / np.sqrt(k)
    personal = world.user_bias[user] + world.user_scene_bias[user, scene]
    glob = world.base_click[scene] + world.item_bias[item] + world.pos_effect[position] + world.hour_effect[hour]
    logit_click = glob + 0.8 * inter_full + personal
    logit_cvr = world.base_cvr[scene] + world.item_cvr_bias[item] + 0.4 * inter_full + 0.5 * world.user_bias[user]
    # Hidden effects: added only where configured (x + 0.0 == x, but skipping keeps the default obviously unchanged).
    if cfg.hidden_user_effect_std > 0:
        logit_click = logit_click + world.hidden_click[user]
    if cfg.hidden_user_scene_effect_std > 0:
        logit_click = logit_click + world.hidden_scene[user, scene]
    if cfg.hidden_user_cvr_effect_std > 0:
        logit_cvr = logit_cvr + world.hidden_cvr[user]
    if world.taste is not None:
        taste = world.taste_of(user, item)
        logit_click = logit_click + taste
        logit_cvr = logit_cvr + cfg.taste_cvr_weight * taste
    logit_click_global = glob + 0.8 * inter_glob
    logit_cvr_global = world.base_cvr[scene] + world.item_cvr_bias[item] + 0.4 * inter_glob
    p_click = _sigmoid(logit_click)
    p_cvr = _sigmoid(logit_cvr)
    p_conv = p_click * p_cvr
    click = rng.random(n) < p_click
    conversion = click & (rng.random(n) < p_cvr)

    cols: dict[str, pa.Array] = {
        "user_id": pa.array(user, pa.int64()),
        "item_id": pa.array(item, pa.int64()),
        "scene": pa.array(scene.astype(np.int64)),
    }
    for j in range(cfg.n_user_features):
        cols[f"user_f{j}"] = pa.array(world.user_feats[user, j])
    for j in range(cfg.n_item_features):
        cols[f"item_f{j}"] = pa.array(world.item_feats[item, j])
    ctx_source = {0: position, 1: hour, 2: weekday}
    for j in range(cfg.n_context_features):
        vocab = _ctx_feature_vocab(j)
        v = ctx_source[j] if j in ctx_source else rng.integers(0, vocab, size=n)
        cols[f"ctx_f{j}"] = pa.array(np.asarray(v, dtype=np.int64))
    M = cfg.multi_hot_max_len
    for j, name in enumerate(_multi_hot_names(cfg)):
        if j == 0:
            cols[name] = _lists(world.user_interests, world.user_interests_len, user)
        elif j == 1:
            cols[name] = _lists(world.item_tags, world.item_tags_len, item)
        else:  # per-row noise tags
            tags = rng.integers(0, 1000 * j, size=(n, M))
            cols[name] = _lists(tags, rng.integers(0, M + 1, size=n), np.arange(n))
    cols["title"] = _lists(world.title, world.title_len, item)
    img = world.image[item]
    cols["image"] = pa.ListArray.from_arrays(
        pa.array(np.arange(0, n * cfg.image_dim + 1, cfg.image_dim, dtype=np.int32)), pa.array(img.reshape(-1))
    )
    dense_src = [
        np.log(world.item_price[item]),
        world.user_activity[user],
        world.item_quality[item],
        inter_glob + rng.normal(0.0, 0.5, size=n),
        np.sin(2 * np.pi * hour / 24),
    ]
    for j in range(cfg.n_dense):
        v = dense_src[j] if j < len(dense_src) else rng.normal(size=n)
        cols[f"dense_{j}"] = pa.array(np.asarray(v, dtype=np.float32))
    cols["log_time"] = pa.array(times.astype(np.int64))
    cols["click"] = pa.array(click.astype(np.int8))
    cols["conversion"] = pa.array(conversion.astype(np.int8))
    cols["p_click"] = pa.array(p_click.astype(np.float32))
    cols["p_conversion"] = pa.array(p_conv.astype(np.float32))
    table = pa.Table.from_arrays([cols[f.name] for f in arrow_schema], schema=arrow_schema)
    stats = {
        "scene": scene,
        "click": click,
        "conversion": conversion,
        "p_click": p_click,
        "p_conversion": p_conv,
        "p_click_global": _sigmoid(logit_click_global),
        "p_conversion_global": _sigmoid(logit_click_global) * _sigmoid(logit_cvr_global),
    }
    return table, stats


def generate(out_dir: str | Path, cfg: GeneratorConfig, progress: bool = True) -> GeneratedData:
    """Write ``cfg.rows`` rows as Parquet files plus ``schema.json`` into ``out_dir``.

    Args:
        out_dir: created if missing; existing ``part-*.parquet`` files of an
            earlier run are replaced.
        cfg: what to generate (validated here).
        progress: log a progress line (logger ``meta_io.synth.generator``, INFO) about
            once a second.

    Returns:
        :class:`GeneratedData` with the file list, oracle AUCs, speed and peak RSS.

    Example::

        >>> data = generate(tmp, GeneratorConfig(rows=5_000, users=500, items=300, n_files=2))
        >>> len(data.files)
        2
    """
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.parquet"):
        old.unlink()
    t_start = time.perf_counter()
    schema = generator_schema(cfg)
    arrow_schema = _arrow_schema(cfg, schema)
    world = _World(cfg)

    # 2^16 buckets: within ~1e-4 of the exact AUC, and cheap per chunk.
    auc_acc = {lab: StreamingAUC(bins=1 << 16) for lab in ("click", "conversion")}
    auc_glob = {lab: StreamingAUC(bins=1 << 16) for lab in ("click", "conversion")}
    # Dictionary-encode only the integer id columns: dictionaries of float
    # columns never pay off and cost ~40% of the write time.
    dict_cols = [c.name for c in schema.id_columns]
    scene_rows = np.zeros(len(SCENES), dtype=np.int64)
    scene_clicks = np.zeros(len(SCENES), dtype=np.int64)

    # Rows per file: as even as possible; each file is a sequence of chunks.
    base, extra = divmod(cfg.rows, cfg.n_files)
    file_rows = [base + (1 if f < extra else 0) for f in range(cfg.n_files)]
    width = max(2, len(str(cfg.n_files - 1)))
    files: list[Path] = []
    row_start = 0
    chunk_index = 0
    last_log = t_start
    for f, nrows in enumerate(file_rows):
        path = out / f"part-{f:0{width}d}.parquet"
        with pq.ParquetWriter(path, arrow_schema, compression="snappy", use_dictionary=dict_cols) as writer:
            done = 0
            while done < nrows:
                n = min(cfg.row_group_rows, nrows - done)
                table, st = _chunk(world, cfg, chunk_index, row_start, n, arrow_schema)
                writer.write_table(table, row_group_size=cfg.row_group_rows)
                for lab in ("click", "conversion"):
                    auc_acc[lab].update(st[lab], st[f"p_{lab}"])
                    auc_glob[lab].update(st[lab], st[f"p_{lab}_global"])
                scene_rows += np.bincount(st["scene"], minlength=len(SCENES))
                scene_clicks += np.bincount(st["scene"], weights=st["click"], minlength=len(SCENES)).astype(np.int64)
                done += n
                row_start += n
                chunk_index += 1
                now = time.perf_counter()
                if progress and (now - last_log >= 1.0 or row_start == cfg.rows):
                    last_log = now
                    log.info(
                        "generating",
                        extra=kv(
                            rows=f"{row_start}/{cfg.rows}",
                            pct=f"{100.0 * row_start / cfg.rows:.1f}",
                            file=path.name,
                            rows_per_s=f"{row_start / max(now - t_start, 1e-9):.0f}",
                        ),
                    )
        files.append(path)

    schema_path = out / "schema.json"
    schema.save(schema_path)
    elapsed = time.perf_counter() - t_start
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    data = GeneratedData(
        out_dir=out,
        files=files,
        schema_path=schema_path,
        rows=row_start,
        oracle_auc={lab: acc.value() for lab, acc in auc_acc.items()},
        oracle_auc_global={lab: acc.value() for lab, acc in auc_glob.items()},
        scene_rows={s: int(scene_rows[s]) for s in range(len(SCENES))},
        scene_click_rate={
            s: float(scene_clicks[s] / scene_rows[s]) if scene_rows[s] else float("nan") for s in range(len(SCENES))
        },
        elapsed_s=elapsed,
        rows_per_s=row_start / max(elapsed, 1e-9),
        peak_rss_mb=peak_rss_mb,
    )
    if progress:
        log.info(
            "generated",
            extra=kv(
                out=str(out),
                rows=data.rows,
                files=len(files),
                elapsed_s=f"{elapsed:.2f}",
                rows_per_s=f"{data.rows_per_s:.0f}",
                peak_rss_mb=f"{peak_rss_mb:.0f}",
                oracle_auc_click=f"{data.oracle_auc['click']:.4f}",
                oracle_auc_conversion=f"{data.oracle_auc['conversion']:.4f}",
            ),
        )
    return data
