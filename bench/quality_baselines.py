"""Standard baselines beside G-Meta under first-k: logistic regression, LightGBM, a per-user offset.

``bench.quality --cold-only`` asks whether meta-learning beats what a team would do without
it. This module trains, in the same run, on the same rows and features as the metaps models:

* **Logistic regression** (torch, no sklearn): every id column one-hot over a vocabulary of
  the training rows (an unseen id, e.g. a held-out user's, falls into its column's
  "unknown" slot, whose weight the L2 term keeps at 0), id lists (multi-hot, text) pooled
  with weight ``1 / len`` (``sum`` pooling: weight 1), every dense column standardized and
  also one-hot over 16 training quantile buckets, vector columns standardized. Logit =
  ``sum_slots w[slot] * weight + dense @ u + b``, one weight column per head, all heads fitted
  jointly (the loss is a sum over heads: the same optimum as one fit per head) by full-batch
  L-BFGS to convergence for each L2 strength of a grid, largest first (each fit warm-starts
  the next; the grid stops after two strengths that improve no head); per head the L2 strength
  with the best AUC on the validation users is kept.
* **LightGBM**, where installed (``importlib.util.find_spec("lightgbm")``, never a
  requirement): per id column the log count and the smoothed target rate of every head
  (prior weight 20; out-of-fold over 5 folds of the task key on the training rows, so a row
  never sees its own label), pooled by the mean over a list; dense and vector columns raw.
  One binary booster per head, boosting rounds chosen by early stopping on the validation
  users' logloss. Absent: :func:`lightgbm_available` is False and the bench writes
  ``"not installed"``.
* **A per-task Bayesian logit offset** (:func:`fit_task_offsets`): on top of any model's
  logits ``z``, each held-out task fits one scalar ``b`` per head on its first-k support rows
  (mask ``m``, the head's target ``y``)::

      minimize  sum_i m_i BCE(y_i, sigmoid(z_i + b)) + lambda / 2 b^2       (lambda: prior strength, default 4)

  the MAP estimate under ``b ~ N(0, 1 / lambda)``, the objective of ``models/meta_offset.py``
  solved to convergence: Newton steps, vectorized over tasks (numpy arrays ``[T, K]``), kept
  inside the bracket ``|b| <= sum(m) / lambda`` (where the root lies: ``|sum m (p - y)| <= sum m``)
  by a bisection step whenever a Newton step would leave it. One step from 0 is the Laplace
  (ridge) estimate ``sum m (y - p) / (sum m p (1 - p) + lambda)``; a task without support rows
  gets ``b = 0``. The offset is added to the task's query logits.

The rows: baselines train on the training users' rows (``vsplit.train_dir``, the rows the
metaps models' Meta-IO dataset is built from), tune on the validation users
(``vsplit.holdout_dir``), and score the held-out users' first-k episodes
(``protocol_batches("first-k", ...)``: the very batches ``evaluate_protocol`` scores, so the
same query rows, targets, oracle and scenarios). Heads and targets are the bench's
(:func:`workers.evaluation.head_target`: conversion = CTCVR over all impressions, the
model's CTCVR logit gets the offset). :func:`score_first_k` scores any logit source under
first-k, base and + offset; :func:`model_logits` is the metaps models' source (their
``forward`` logits, the ones the loss sees).

Everything is array ops over rows (``np.searchsorted`` vocabularies, ``embedding_bag`` over
CSR slots, ``np.bincount`` encodings); the loops run over columns, batches, grid values and
Newton iterations, never over rows.
"""

from __future__ import annotations

import importlib.util
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from meta_io.schema import ColumnKind, Pooling, Schema
from common.errors import DataError
from common.evaluation import auc, logloss

if TYPE_CHECKING:
    from models.base import CtrModel

log = logging.getLogger(__name__)

DENSE_BUCKETS = 16
"""Quantile buckets per dense column (one-hot slots of the logistic regression)."""
L2_GRID = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5)
"""L2 strengths tried (penalty ``l2 / 2 * |w|^2`` on the mean BCE), largest first."""
L2_GRID_SMOKE = (1e-1, 1e-2, 1e-3)
TE_PRIOR = 20.0
"""Prior weight (rows) of LightGBM's smoothed target encodings."""
TE_FOLDS = 5


# -- the per-task offset -------------------------------------------------------------------------


def fit_task_offsets(z: np.ndarray, y: np.ndarray, m: np.ndarray, prior: float, steps: int = 60,
                     tol: float = 1e-10) -> np.ndarray:
    """Per task, the MAP logit offset ``b`` on its support rows (module docstring), ``[T]`` float64.

    Args:
        z: ``[T, K]`` base logits of each task's support rows (padding: anything finite or not).
        y: ``[T, K]`` 0/1 targets.
        m: ``[T, K]`` True / 1 on real support rows.
        prior: lambda > 0, the prior precision of ``b``.
        steps: most Newton iterations (``steps=1``: the Laplace estimate; the default converges).
        tol: stop when every task's ``|gradient| <= tol``.

    Raises:
        DataError: ``prior <= 0`` or shapes that differ.
    """
    if not prior > 0:
        raise DataError(f"offset prior: expected lambda > 0, got {prior}")
    z, y, m = (np.asarray(a, dtype=np.float64) for a in (z, y, m))
    if not z.shape == y.shape == m.shape or z.ndim != 2:
        raise DataError(f"offsets: z, y, m must share one [T, K] shape, got {z.shape}, {y.shape}, {m.shape}")
    real = m > 0
    z = np.where(real, z, 0.0)
    y = np.where(real, y, 0.0)
    m = real.astype(np.float64)
    n = m.sum(1)
    lo, hi = -n / prior, n / prior  # the root's bracket
    b = np.zeros(z.shape[0])
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(z + b[:, None])))
        g = (m * (p - y)).sum(1) + prior * b
        if np.all(np.abs(g) <= tol):
            break
        hi = np.where(g > 0, np.minimum(hi, b), hi)  # g is increasing in b: the root is below b
        lo = np.where(g < 0, np.maximum(lo, b), lo)
        new = b - g / ((m * p * (1.0 - p)).sum(1) + prior)
        b = np.where((new >= lo) & (new <= hi), new, 0.5 * (lo + hi))
    return b


# -- scoring under first-k -----------------------------------------------------------------------


LogitSource = Callable[[MetaBatch], tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]
"""A first-k batch -> (head -> support logits ``[T, K]``, head -> query logits ``[T, Q]``)."""
RowLogits = Callable[[FeatureBatch], dict[str, np.ndarray]]
"""A fitted baseline's logits of rows, head -> an array shaped like the batch's mask."""


def _first_k_source(row_logits: RowLogits) -> LogitSource:
    """The first-k source of a row scorer: the support and the query rows of each episode."""

    def src(mb: MetaBatch) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        return row_logits(mb.support), row_logits(mb.query)

    return src


def score_rows(batches: Iterable[FeatureBatch], row_logits: RowLogits, heads: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per head: AUC and logloss of every real row (a plain protocol, e.g. a time split's later
    rows), the oracle AUC of the same rows where the data has one, and ``norm_auc``.

    Raises:
        DataError: the batches hold no real row.
    """
    from workers.evaluation import head_target

    parts: dict[str, dict[str, list[np.ndarray]]] = {h: {"score": [], "target": [], "oracle": []} for h in heads}
    for fb in batches:
        m = fb.mask.numpy().astype(bool)
        z = row_logits(fb)
        for h in heads:
            parts[h]["score"].append(1.0 / (1.0 + np.exp(-np.asarray(z[h], dtype=np.float64)[m])))
            parts[h]["target"].append(head_target(h, fb.labels).numpy()[m].astype(np.float64))
            if h in fb.oracle:
                parts[h]["oracle"].append(fb.oracle[h].numpy()[m].astype(np.float64))
    out: dict[str, dict[str, Any]] = {}
    for h in heads:
        cat = {k: np.concatenate(v) for k, v in parts[h].items() if v}
        if "target" not in cat or cat["target"].size == 0:
            raise DataError("plain baselines: the batches yielded no rows to score")
        res: dict[str, Any] = {"rows": int(cat["target"].size), **auc_logloss(cat["score"], cat["target"])}
        if "oracle" in cat:
            res["oracle_auc"] = float(auc(cat["target"], cat["oracle"]))
            res["norm_auc"] = (res["auc"] - 0.5) / (res["oracle_auc"] - 0.5)
        out[h] = res
    return out


def auc_logloss(score: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """AUC and logloss of probabilities ``score`` against 0/1 ``target`` (flat arrays)."""
    return {"auc": float(auc(target, score)), "logloss": float(logloss(target, np.clip(score, 1e-7, 1 - 1e-7)))}


def score_first_k(batches: Iterable[MetaBatch | PlainBatch], source: LogitSource, heads: Sequence[str],
                  prior: float) -> dict[str, dict[str, Any]]:
    """Per head: AUC and logloss of the query rows as the source scores them ("base") and with
    each task's offset fitted on its support rows ("offset"), plus rows and the oracle AUC.

    Args:
        batches: first-k meta batches (``protocol_batches("first-k", ...)``), materialized or not.

    Raises:
        DataError: a plain batch, or no query rows.
        source: the model's logits per batch.
        heads: head names (``click``, ``conversion`` = CTCVR).
        prior: the offset's lambda.
    """
    from workers.evaluation import head_target

    parts: dict[str, dict[str, list[np.ndarray]]] = {h: {"base": [], "offset": [], "target": [], "oracle": []}
                                                     for h in heads}
    for mb in batches:
        if not isinstance(mb, MetaBatch):
            raise DataError("first-k baselines: expected first-k meta batches, got a plain batch")
        zs, zq = source(mb)
        sm = (mb.support.mask & mb.task_mask[:, None]).numpy()
        qm = (mb.query.mask & mb.task_mask[:, None]).numpy()
        for h in heads:
            b = fit_task_offsets(zs[h], head_target(h, mb.support.labels).numpy(), sm, prior)
            q = np.asarray(zq[h], dtype=np.float64)
            p = parts[h]
            p["base"].append(1.0 / (1.0 + np.exp(-q[qm])))
            p["offset"].append(1.0 / (1.0 + np.exp(-(q + b[:, None])[qm])))
            p["target"].append(head_target(h, mb.query.labels).numpy()[qm].astype(np.float64))
            if h in mb.query.oracle:
                p["oracle"].append(mb.query.oracle[h].numpy()[qm].astype(np.float64))
    out: dict[str, dict[str, Any]] = {}
    for h in heads:
        cat = {k: np.concatenate(v) for k, v in parts[h].items() if v}
        if "target" not in cat:
            raise DataError("first-k baselines: the batches yielded no query rows to score")
        t = cat["target"]
        res: dict[str, Any] = {"rows": int(t.shape[0]), "base": auc_logloss(cat["base"], t), "offset": auc_logloss(cat["offset"], t)}
        if "oracle" in cat:
            res["oracle_auc"] = float(auc(t, cat["oracle"]))
        out[h] = res
    return out


def model_logits(model: CtrModel, rows_src: Any) -> LogitSource:
    """A metaps model's logit source: its ``forward`` logits (the loss's; ESMM/DNN conversion = CTCVR).

    Args:
        model: a trained model, dense parameters current (``worker.trainer.refresh_dense()``).
        rows_src: ``pull(ids) -> rows`` (the worker's rows).
    """

    @torch.no_grad()
    def source(mb: MetaBatch) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        ids = {t: u.numpy() for t, u in mb.unique_ids.items()}
        rows = {t: torch.from_numpy(np.ascontiguousarray(r)) for t, r in rows_src.pull(ids).items()}
        was = model.training
        model.eval()
        try:
            zs = model(mb.support, rows, mb.unique_ids)
            zq = model(mb.query, rows, mb.unique_ids)
        finally:
            model.train(was)
        return ({h: z.double().numpy() for h, z in zs.items()}, {h: z.double().numpy() for h, z in zq.items()})

    return source


# -- features ------------------------------------------------------------------------------------


@dataclass
class Slots:
    """Rows as CSR one-hot slots plus a dense block (the logistic regression's input).

    Args:
        idx: int64 ``[nnz]`` slot per entry, row after row.
        weight: float32 ``[nnz]``.
        offsets: int64 ``[N]`` first entry of each row (``embedding_bag`` offsets).
        dense: float32 ``[N, D]`` standardized dense and vector columns.
    """

    idx: np.ndarray
    weight: np.ndarray
    offsets: np.ndarray
    dense: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.offsets.shape[0])

    @staticmethod
    def concat(parts: Sequence[Slots]) -> Slots:
        """One :class:`Slots` of ``parts`` in order."""
        sizes = np.array([p.idx.shape[0] for p in parts], dtype=np.int64)
        shift = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return Slots(np.concatenate([p.idx for p in parts]), np.concatenate([p.weight for p in parts]),
                     np.concatenate([p.offsets + s for p, s in zip(parts, shift)]),
                     np.concatenate([p.dense for p in parts]))


def _flat_rows(fb: FeatureBatch) -> int:
    return int(np.prod(fb.mask.shape))


def _dense_block(fb: FeatureBatch, schema: Schema) -> np.ndarray:
    n = _flat_rows(fb)
    blocks = [fb.dense.reshape(n, -1).numpy()] + [fb.vectors[c.name].reshape(n, -1).numpy()
                                                   for c in schema.vector_columns]
    return np.concatenate(blocks, axis=1).astype(np.float64) if blocks else np.zeros((n, 0))


class SlotEncoder:
    """The logistic regression's features (module docstring), fitted on training rows.

    Args:
        schema: the data's schema (id, dense and vector columns).
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.id_cols = [c for c in schema.id_columns]
        self.vocab: dict[str, np.ndarray] = {}
        self.base: dict[str, int] = {}
        self.bounds: list[np.ndarray] = []
        self.dense_base = 0
        self.size = 0
        self.mean = np.zeros(0)
        self.std = np.ones(0)

    def fit(self, batches: Iterable[FeatureBatch]) -> SlotEncoder:
        """Vocabularies, quantile bounds and dense moments of the training rows.

        Raises:
            DataError: no training rows.
        """
        seen: dict[str, list[np.ndarray]] = {c.name: [] for c in self.id_cols}
        dense: list[np.ndarray] = []
        for fb in batches:
            real = fb.mask.reshape(-1).numpy().astype(bool)
            n = real.shape[0]
            for c in self.id_cols:
                ids = fb.ids[c.name].reshape(n, -1).numpy()[real]
                seen[c.name].append(np.unique(ids[ids >= 0]))
            dense.append(_dense_block(fb, self.schema)[real])
        if not dense or not sum(d.shape[0] for d in dense):
            raise DataError("logistic regression: no training rows")
        pos = 0
        for c in self.id_cols:
            self.vocab[c.name] = np.unique(np.concatenate(seen[c.name]))
            self.base[c.name] = pos
            pos += 1 + self.vocab[c.name].shape[0]  # slot 0 of a column: an id not in the vocabulary
        x = np.concatenate(dense)
        n_dense = self.schema.dense_columns
        self.bounds = [np.unique(np.quantile(x[:, j], np.linspace(0, 1, DENSE_BUCKETS + 1)[1:-1]))
                       for j in range(len(n_dense))]
        self.dense_base = pos
        self.size = pos + sum(b.shape[0] + 1 for b in self.bounds)
        self.mean, self.std = x.mean(0), x.std(0) + 1e-6
        return self

    def encode(self, fb: FeatureBatch) -> Slots:
        """Every row of ``fb`` (padding included: the caller masks), flattened to ``[N]``."""
        n = _flat_rows(fb)
        idx_parts, w_parts = [], []
        for c in self.id_cols:
            ids = fb.ids[c.name].reshape(n, -1).numpy()
            valid = ids >= 0
            voc = self.vocab[c.name]
            pos = np.searchsorted(voc, ids).clip(max=max(voc.shape[0] - 1, 0))
            found = valid & (voc[pos] == ids) if voc.shape[0] else np.zeros_like(valid)
            idx_parts.append(np.where(found, self.base[c.name] + 1 + pos, self.base[c.name]))
            cnt = valid.sum(1, keepdims=True).clip(min=1)
            w = 1.0 if (c.kind == ColumnKind.SPARSE or c.pooling == Pooling.SUM) else 1.0 / cnt
            w_parts.append(np.where(valid, w, 0.0))
        x = _dense_block(fb, self.schema)
        slot = self.dense_base
        for j, b in enumerate(self.bounds):
            idx_parts.append((slot + np.searchsorted(b, x[:, j]))[:, None])
            w_parts.append(np.ones((n, 1)))
            slot += b.shape[0] + 1
        idx = np.concatenate(idx_parts, axis=1)
        w = np.concatenate(w_parts, axis=1)
        keep = w != 0
        return Slots(idx[keep].astype(np.int64), w[keep].astype(np.float32),
                     np.concatenate([[0], np.cumsum(keep.sum(1))[:-1]]).astype(np.int64),
                     ((x - self.mean) / self.std).astype(np.float32))


def _targets(fb: FeatureBatch, heads: Sequence[str]) -> np.ndarray:
    from workers.evaluation import head_target

    return np.stack([head_target(h, fb.labels).reshape(-1).numpy() for h in heads], axis=1).astype(np.float32)


def _real(fb: FeatureBatch) -> np.ndarray:
    return fb.mask.reshape(-1).numpy().astype(bool)


def _encode_rows(enc: SlotEncoder, batches: Iterable[FeatureBatch], heads: Sequence[str]) -> tuple[Slots, np.ndarray]:
    """Real rows of ``batches``, encoded, and their targets ``[N, H]``."""
    parts, ys = [], []
    for fb in batches:
        real = _real(fb)
        s = enc.encode(fb)
        if not real.all():
            cnt = np.diff(np.concatenate([s.offsets, [s.idx.shape[0]]]))
            keep = np.repeat(real, cnt)
            s = Slots(s.idx[keep], s.weight[keep], np.concatenate([[0], np.cumsum(cnt[real])[:-1]]).astype(np.int64),
                      s.dense[real])
        parts.append(s)
        ys.append(_targets(fb, heads)[real])
    return Slots.concat(parts), np.concatenate(ys)


# -- logistic regression -------------------------------------------------------------------------


class LogReg:
    """A fitted logistic regression: one weight column per head (module docstring).

    Args:
        enc: the fitted slot encoder.
        heads: head names, in weight-column order.
    """

    def __init__(self, enc: SlotEncoder, heads: Sequence[str]) -> None:
        self.enc = enc
        self.heads = list(heads)
        self.w = np.zeros((enc.size, len(self.heads)))
        self.u = np.zeros((len(enc.mean), len(self.heads)))
        self.b = np.zeros(len(self.heads))
        self.chosen_l2: dict[str, float] = {}
        self.val: dict[str, dict[str, float]] = {}

    def logits(self, s: Slots) -> np.ndarray:
        """``[N, H]`` logits of encoded rows."""
        with _one_thread():
            x = _csr(s, self.enc.size)
            return (x @ torch.from_numpy(self.w)).numpy() + s.dense.astype(np.float64) @ self.u + self.b

    def row_logits(self, fb: FeatureBatch) -> dict[str, np.ndarray]:
        """Head -> logits of ``fb``'s rows, shaped like its mask."""
        z = self.logits(self.enc.encode(fb)).reshape(*fb.mask.shape, len(self.heads))
        return {h: z[..., i] for i, h in enumerate(self.heads)}

    def source(self) -> LogitSource:
        """The first-k logit source of this model (:func:`score_first_k`)."""
        return _first_k_source(self.row_logits)


class _one_thread:
    """torch on one thread inside (small sparse products: on a shared box OpenMP's waiting costs ~20x)."""

    def __enter__(self) -> None:
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.n)


def _csr(s: Slots, size: int) -> torch.Tensor:
    """The ``[N, size]`` sparse float64 CSR matrix of ``s``'s slots."""
    crow = torch.from_numpy(np.concatenate([s.offsets, [s.idx.shape[0]]]).astype(np.int64))
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the products used here are the basic ones
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, torch.from_numpy(s.idx), torch.from_numpy(s.weight.astype(np.float64)),
                                       (s.rows, size), check_invariants=False)


def lbfgs(fn: Callable[[torch.Tensor], tuple[float, torch.Tensor]], x0: torch.Tensor, max_iter: int,
          history: int = 20, gtol: float = 1e-7, ftol: float = 1e-10) -> torch.Tensor:
    """Minimize a smooth function by L-BFGS (two-loop recursion, Armijo backtracking); returns the last point.

    (``torch.optim.LBFGS`` would import ``torch._dynamo``: seconds per process on this box.)

    Args:
        fn: ``x -> (f(x), gradient)``.
        x0: the start (1-D float64).
        max_iter: most iterations.
        history: (s, y) pairs kept.
        gtol: stop when ``max |gradient| <= gtol``.
        ftol: stop when an iteration lowers ``f`` by less than ``ftol * max(1, |f|)``.
    """
    x = x0.clone()
    f, g = fn(x)
    ss: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    for _ in range(max_iter):
        if float(g.abs().max()) <= gtol:
            break
        q = g.clone()
        alphas = []
        for s_, y_ in zip(reversed(ss), reversed(ys)):
            a = float(s_ @ q) / float(y_ @ s_)
            alphas.append(a)
            q -= a * y_
        if ss:
            q *= float(ss[-1] @ ys[-1]) / float(ys[-1] @ ys[-1])
        else:
            q /= max(1.0, float(g.abs().max()))
        for (s_, y_), a in zip(zip(ss, ys), reversed(alphas)):
            q += (a - float(y_ @ q) / float(y_ @ s_)) * s_
        d = -q
        slope = float(g @ d)
        if slope >= 0:  # not a descent direction: restart from the gradient
            ss.clear()
            ys.clear()
            d, slope = -g, -float(g @ g)
        step = 1.0
        for _ls in range(30):
            fx, gx = fn(x + step * d)
            if fx <= f + 1e-4 * step * slope:
                break
            step *= 0.5
        else:
            break  # no decrease found: at the optimum to float precision
        s_new, y_new = step * d, gx - g
        x, done = x + s_new, f - fx < ftol * max(1.0, abs(f))
        f, g = fx, gx
        if float(y_new @ s_new) > 1e-12:
            ss.append(s_new)
            ys.append(y_new)
            if len(ss) > history:
                del ss[0], ys[0]
        if done:
            break
    return x


def train_logreg(enc: SlotEncoder, train: Slots, y: np.ndarray, val: Slots, y_val: np.ndarray,
                 heads: Sequence[str], l2_grid: Sequence[float] = L2_GRID, max_iter: int = 200) -> LogReg:
    """Fit per L2 strength (largest first, warm-started), keep per head the best validation AUC.

    The grid stops early after two successive strengths that improve no head's validation AUC.

    Full-batch L-BFGS (:func:`lbfgs`) on the mean BCE per head, summed over heads,
    + ``l2 / 2 * (|w|^2 + |u|^2)`` (the bias is free); the gradient is written out (sparse CSR
    products ``X w`` and ``X^T g``), no autograd graph.

    Args:
        enc: the encoder of ``train`` / ``val``.
        train, y: encoded training rows and targets ``[N, H]``.
        val, y_val: encoded validation rows and targets.
        heads: head names (columns of ``y``).
        l2_grid: L2 strengths to try.
        max_iter: L-BFGS iterations per strength.
    """
    model = LogReg(enc, heads)
    n_h, v, d = len(heads), enc.size, len(enc.mean)
    with _one_thread():
        x, xt = _csr(train, v), _csr(train, v).to_sparse_coo().t().coalesce().to_sparse_csr()
        dense = torch.from_numpy(train.dense.astype(np.float64))
        yt = torch.from_numpy(y.astype(np.float64))
        n = max(train.rows, 1)
        theta = torch.zeros(v * n_h + d * n_h + n_h, dtype=torch.float64)

        def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return t[:v * n_h].view(v, n_h), t[v * n_h:(v + d) * n_h].view(d, n_h), t[(v + d) * n_h:]

        best: dict[str, float] = {h: -1.0 for h in heads}
        worse = 0  # successive strengths below every head's best so far
        for l2 in sorted(l2_grid, reverse=True):
            if worse >= 2:  # validation AUC falls as the fit loosens: the rest of the grid overfits more
                break

            def loss_grad(t: torch.Tensor) -> tuple[float, torch.Tensor]:
                w, u, b = split(t)
                z = x @ w + dense @ u + b
                loss = (F.softplus(z) - yt * z).sum() / n + 0.5 * l2 * ((w * w).sum() + (u * u).sum())
                gz = (torch.sigmoid(z) - yt) / n
                return float(loss), torch.cat([(xt @ gz + l2 * w).reshape(-1), (dense.T @ gz + l2 * u).reshape(-1),
                                               gz.sum(0)])

            theta = lbfgs(loss_grad, theta, max_iter)
            w, u, b = (t.numpy() for t in split(theta))
            zv = (_csr(val, v) @ torch.from_numpy(w)).numpy() + val.dense.astype(np.float64) @ u + b
            aucs = [float(auc(y_val[:, i], zv[:, i])) for i in range(n_h)]
            worse = worse + 1 if all(a <= best[h] for a, h in zip(aucs, heads)) else 0
            for i, h in enumerate(heads):
                a = aucs[i]
                if a > best[h]:
                    best[h] = a
                    model.w[:, i], model.u[:, i], model.b[i] = w[:, i], u[:, i], b[i]
                    model.chosen_l2[h] = l2
                    pv = 1.0 / (1.0 + np.exp(-zv[:, i]))
                    model.val[h] = {"auc": a, "logloss": float(logloss(y_val[:, i], np.clip(pv, 1e-7, 1 - 1e-7)))}
    return model


# -- LightGBM ------------------------------------------------------------------------------------


def lightgbm_available() -> bool:
    """True where the ``lightgbm`` package can be imported (it is optional, never a requirement)."""
    return importlib.util.find_spec("lightgbm") is not None


class TargetEncoder:
    """LightGBM's features (module docstring): per id column log count and smoothed target rate per head.

    Args:
        schema: the data's schema.
        heads: head names.
    """

    def __init__(self, schema: Schema, heads: Sequence[str]) -> None:
        self.schema = schema
        self.heads = list(heads)
        self.stats: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # vocab, count [V], positives [V, H]
        self.prior = np.zeros(len(self.heads))

    def _pairs(self, fb: FeatureBatch, name: str, real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = fb.ids[name].reshape(real.shape[0], -1).numpy()[real]
        row, slot = np.nonzero(ids >= 0)
        return row, ids[row, slot]

    def fit_transform(self, batches: Iterable[FeatureBatch]) -> tuple[np.ndarray, np.ndarray]:
        """Fit on the training rows and encode them out of fold: (features ``[N, F]``, targets ``[N, H]``)."""
        fbs = list(batches)
        reals = [_real(fb) for fb in fbs]
        y = np.concatenate([_targets(fb, self.heads)[r] for fb, r in zip(fbs, reals)]).astype(np.float64)
        key = np.concatenate([fb.ids[self.schema.task_key].reshape(r.shape[0], -1).numpy()[r, 0]
                              if self.schema.task_key in fb.ids else np.zeros(int(r.sum()), np.int64)
                              for fb, r in zip(fbs, reals)])
        fold = np.abs(key) % TE_FOLDS
        self.prior = y.mean(0)
        cols = []
        for c in self.schema.id_columns:
            rows, ids, start = [], [], 0
            for fb, r in zip(fbs, reals):
                rr, ii = self._pairs(fb, c.name, r)
                rows.append(rr + start)
                ids.append(ii)
                start += int(r.sum())
            row, idv = np.concatenate(rows), np.concatenate(ids)
            voc, inv = np.unique(idv, return_inverse=True)
            v = voc.shape[0]
            cnt = np.bincount(inv, minlength=v).astype(np.float64)
            pos = np.stack([np.bincount(inv, weights=y[row, i], minlength=v) for i in range(len(self.heads))], 1)
            self.stats[c.name] = (voc, cnt, pos)
            f = fold[row]
            cnt_f = np.stack([np.bincount(inv[f == k], minlength=v) for k in range(TE_FOLDS)]).astype(np.float64)
            pos_f = np.stack([np.stack([np.bincount(inv[f == k], weights=y[row[f == k], i], minlength=v)
                                        for i in range(len(self.heads))], 1) for k in range(TE_FOLDS)])
            oof_cnt = cnt[inv] - cnt_f[f, inv]
            oof_pos = pos[inv] - pos_f[f, inv]
            cols.append(self._pool(row, start, oof_cnt, oof_pos))
        x = np.concatenate(cols + [np.concatenate([_dense_block(fb, self.schema)[r] for fb, r in zip(fbs, reals)])],
                           axis=1)
        return x, y

    def _pool(self, row: np.ndarray, n: int, cnt: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Mean over a row's ids of (log1p count, smoothed rate per head): ``[n, 1 + H]``."""
        te = (pos + TE_PRIOR * self.prior) / (cnt + TE_PRIOR)[:, None]
        feats = np.concatenate([np.log1p(cnt)[:, None], te], axis=1)
        per = np.bincount(row, minlength=n).astype(np.float64)
        out = np.stack([np.bincount(row, weights=feats[:, j], minlength=n) for j in range(feats.shape[1])], 1)
        mean = out / np.maximum(per, 1)[:, None]
        mean[per == 0, 1:] = self.prior  # a row without ids (an empty list): the prior rate
        return mean

    def transform(self, fb: FeatureBatch) -> np.ndarray:
        """Every row of ``fb`` flattened (padding included), with the full training statistics."""
        n = _flat_rows(fb)
        real = np.ones(n, dtype=bool)
        cols = []
        for c in self.schema.id_columns:
            row, idv = self._pairs(fb, c.name, real)
            voc, cnt, pos = self.stats[c.name]
            at = np.searchsorted(voc, idv).clip(max=max(voc.shape[0] - 1, 0))
            found = (voc[at] == idv) if voc.shape[0] else np.zeros(idv.shape[0], bool)
            cols.append(self._pool(row, n, np.where(found, cnt[at], 0.0),
                                   np.where(found[:, None], pos[at], 0.0)))
        return np.concatenate(cols + [_dense_block(fb, self.schema)], axis=1)


class Gbdt:
    """LightGBM boosters, one per head, on :class:`TargetEncoder` features.

    Args:
        enc: the fitted encoder.
        boosters: head -> booster.
    """

    def __init__(self, enc: TargetEncoder, boosters: dict[str, Any]) -> None:
        self.enc = enc
        self.boosters = boosters

    def row_logits(self, fb: FeatureBatch) -> dict[str, np.ndarray]:
        """Head -> raw scores (logits) of ``fb``'s rows, shaped like its mask."""
        x = self.enc.transform(fb)
        return {h: np.asarray(bst.predict(x, num_iteration=bst.best_iteration, raw_score=True),
                              dtype=np.float64).reshape(fb.mask.shape) for h, bst in self.boosters.items()}

    def source(self) -> LogitSource:
        """The first-k logit source (raw scores = logits)."""
        return _first_k_source(self.row_logits)


def train_lightgbm(schema: Schema, train: Sequence[FeatureBatch], val: Sequence[FeatureBatch], heads: Sequence[str],
                   smoke: bool = False) -> tuple[Gbdt, dict[str, Any]]:
    """One booster per head, rounds by early stopping on the validation users (lightgbm must be installed).

    Args:
        schema: the data's schema.
        train / val: training and validation rows.
        heads: head names.
        smoke: at most 50 rounds (figures meaningless).

    Returns:
        the model, and per head the chosen rounds and validation AUC / logloss.
    """
    import lightgbm as lgb

    enc = TargetEncoder(schema, heads)
    x, y = enc.fit_transform(train)
    xv = np.concatenate([enc.transform(fb)[_real(fb)] for fb in val])
    yv = np.concatenate([_targets(fb, heads)[_real(fb)] for fb in val]).astype(np.float64)
    params = {"objective": "binary", "learning_rate": 0.05, "num_leaves": 31, "min_data_in_leaf": 50,
              "feature_fraction": 0.8, "bagging_fraction": 0.8, "bagging_freq": 1, "lambda_l2": 1.0,
              "verbose": -1, "num_threads": 1, "seed": 0, "force_col_wise": True}
    boosters: dict[str, Any] = {}
    info: dict[str, Any] = {}
    for i, h in enumerate(heads):
        dtr = lgb.Dataset(x, y[:, i])
        dv = lgb.Dataset(xv, yv[:, i], reference=dtr)
        bst = lgb.train(params, dtr, num_boost_round=50 if smoke else 2000, valid_sets=[dv],
                        callbacks=[lgb.early_stopping(50, verbose=False)])
        boosters[h] = bst
        zv = bst.predict(xv, num_iteration=bst.best_iteration, raw_score=True)
        pv = 1.0 / (1.0 + np.exp(-zv))
        info[h] = {"rounds": int(bst.best_iteration), "val": {"auc": float(auc(yv[:, i], zv)),
                                                              "logloss": float(logloss(yv[:, i], np.clip(pv, 1e-7, 1 - 1e-7)))}}
    return Gbdt(enc, boosters), info


# -- the bench's entry points --------------------------------------------------------------------


@dataclass
class Baselines:
    """The baselines of one seed, trained once, scored under every K.

    Args:
        sources: name ("logreg", "lightgbm") -> first-k logit source.
        info: name -> what was chosen on validation and the training time, or ``"not installed"``.
    """

    sources: dict[str, LogitSource]
    info: dict[str, Any]
    rows: dict[str, RowLogits] = field(default_factory=dict)
    """name -> the model's logits of plain rows (:func:`score_rows`)."""


def train_baselines(train_dir: Path, val_dir: Path, schema: Schema, heads: Sequence[str],
                    smoke: bool = False) -> Baselines:
    """Train the logistic regression and (where installed) LightGBM on ``train_dir``, tuned on ``val_dir``.

    Args:
        train_dir: the training users' rows (Parquet).
        val_dir: the validation users' rows (Parquet).
        schema: their schema.
        heads: head names.
        smoke: a 3-value L2 grid, 50 L-BFGS iterations, 50 boosting rounds.
    """
    from workers.eval_protocols import protocol_batches

    def rows(d: Path) -> list[FeatureBatch]:
        return [b.features for b in protocol_batches("plain", d, schema, batch_rows=65_536)]  # type: ignore[union-attr]

    train, val = rows(train_dir), rows(val_dir)
    t0 = time.perf_counter()
    enc = SlotEncoder(schema).fit(train)
    xs, ys = _encode_rows(enc, train, heads)
    xv, yv = _encode_rows(enc, val, heads)
    lr = train_logreg(enc, xs, ys, xv, yv, heads, L2_GRID_SMOKE if smoke else L2_GRID, 50 if smoke else 200)
    info: dict[str, Any] = {"logreg": {"train_rows": xs.rows, "val_rows": xv.rows, "slots": enc.size,
                                       "chosen_l2": lr.chosen_l2, "val": lr.val, "train_s": time.perf_counter() - t0}}
    sources: dict[str, LogitSource] = {"logreg": lr.source()}
    row_fns: dict[str, RowLogits] = {"logreg": lr.row_logits}
    if lightgbm_available():
        t0 = time.perf_counter()
        gb, ginfo = train_lightgbm(schema, train, val, heads, smoke)
        sources["lightgbm"] = gb.source()
        row_fns["lightgbm"] = gb.row_logits
        info["lightgbm"] = {"heads": ginfo, "train_s": time.perf_counter() - t0}
    else:
        info["lightgbm"] = "not installed"
    log.info("baselines trained: %s", {k: (v if isinstance(v, str) else v.get("train_s")) for k, v in info.items()})
    return Baselines(sources, info, row_fns)


# -- the report ----------------------------------------------------------------------------------

ARMS_WITHOUT_META = ("metaps_plain", "logreg", "lightgbm")
"""What a team would run without meta-learning: each + the per-task offset competes with adapted G-Meta."""


def _pick(m: dict[str, Any]) -> dict[str, float]:
    return {"auc": float(m["auc"]), "logloss": float(m["logloss"])}


def compare_entry(meta_fk: dict[str, Any], plain_fk: dict[str, Any], scored: dict[str, dict[str, Any]],
                  info: dict[str, Any], heads: Sequence[str], prior: float) -> dict[str, Any]:
    """One K of one seed: every arm per head side by side, and the goal adapted >= best baseline + offset.

    Args:
        meta_fk / plain_fk: ``evaluate_protocol`` results (first-k) of the chosen meta model and of
            the plain model with the same fine-tuning (``base``, ``adapted`` per head).
        scored: :func:`score_first_k` per arm: ``metaps_plain`` and ``metaps_meta`` (the two models'
            own logits), ``logreg``, and ``lightgbm`` where trained.
        info: :attr:`Baselines.info` (``lightgbm`` may be ``"not installed"``).
        heads: head names.
        prior: the offset's lambda (recorded).

    Raises:
        DataError: an arm scored other rows than ``evaluate_protocol`` did, or a metaps model's base
            AUC differs from its own (the arms would not be comparable).
    """
    out: dict[str, Any] = {"offset_prior": prior,
                           "bayes_ceiling": "not computed by bench.quality: python -m bench.quality_ceiling on "
                                            "the same seeds and K scores the same rows"}
    goal: dict[str, Any] = {}
    for h in heads:
        rows = int(meta_fk["base"][h]["rows"])
        for name, sc in scored.items():
            if sc[h]["rows"] != rows:
                raise DataError(f"first-k baselines: {name} scored {sc[h]['rows']} {h} rows, "
                                f"evaluate_protocol scored {rows}")
        for name, ev in (("metaps_plain", plain_fk), ("metaps_meta", meta_fk)):
            if abs(scored[name][h]["base"]["auc"] - ev["base"][h]["auc"]) > 1e-3:
                raise DataError(f"first-k baselines: {name} {h} base AUC {scored[name][h]['base']['auc']:.6f} "
                                f"from its logits, {ev['base'][h]['auc']:.6f} from evaluate_protocol")
        e: dict[str, Any] = {"rows": rows, "oracle_auc": meta_fk["base"][h].get("oracle_auc"),
                             "metaps_plain": {"base": _pick(plain_fk["base"][h]),
                                              "finetuned": _pick(plain_fk["adapted"][h]),
                                              "offset": scored["metaps_plain"][h]["offset"]},
                             "metaps_meta": {"base": _pick(meta_fk["base"][h]), "adapted": _pick(meta_fk["adapted"][h]),
                                             "offset": scored["metaps_meta"][h]["offset"]}}
        for name in ("logreg", "lightgbm"):
            e[name] = ({"base": scored[name][h]["base"], "offset": scored[name][h]["offset"]} if name in scored
                       else info.get(name, "not trained"))
        rivals = {f"{n}+offset": e[n]["offset"]["auc"] for n in ARMS_WITHOUT_META if isinstance(e[n], dict)}
        best = max(rivals, key=lambda n: rivals[n])
        adapted = e["metaps_meta"]["adapted"]["auc"]
        goal[h] = {"adapted": adapted, "best": best, "best_auc": rivals[best], "margin": adapted - rivals[best],
                   "met": bool(adapted >= rivals[best])}
        out[h] = e
    out["goal"] = goal
    return out


def baseline_goals(per_seed: dict[Any, dict[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    """The ``goals`` block: per K, per head, adapted - best baseline + offset on every seed.

    Args:
        per_seed: seed -> ``cold_start_sweep`` result (``first_k_by_k[k]["baselines"]["goal"]``).
        ks: the K values (the first is the headline).
    """
    out: dict[str, Any] = {"k": ks[0], "by_k": {}}
    for k in ks:
        goals = {seed: r["first_k_by_k"][k]["baselines"]["goal"] for seed, r in per_seed.items()}
        heads = list(next(iter(goals.values())))
        by: dict[str, Any] = {}
        for h in heads:
            margins = [g[h]["margin"] for g in goals.values()]
            by[h] = {"per_seed": {seed: {"margin": g[h]["margin"], "best": g[h]["best"], "met": g[h]["met"]}
                                  for seed, g in goals.items()},
                     "margin": {"median": float(np.median(margins)), "min": float(np.min(margins)),
                                "max": float(np.max(margins))},
                     "met_every_seed": all(g[h]["met"] for g in goals.values())}
        by["adapted>=best_baseline+offset(both heads, every seed)"] = all(by[h]["met_every_seed"] for h in heads)
        out["by_k"][k] = by
    out["adapted>=best_baseline+offset(both heads, every seed)"] = \
        out["by_k"][ks[0]]["adapted>=best_baseline+offset(both heads, every seed)"]
    return out
