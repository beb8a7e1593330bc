"""Ranking and calibration metrics for CTR/CVR heads, vectorized.

Every function accepts numpy arrays or torch tensors (any device; they are
copied to host numpy) and an optional boolean ``mask`` selecting real rows
(padding slots of a meta batch carry ``mask=False``).

* :func:`auc` - rank-based ROC AUC (Mann-Whitney U); tied scores count 1/2.
* :func:`logloss` - mean binary cross-entropy of probabilities.
* :func:`grouped_auc` - one AUC per group (scenario, user) in one sort.
* :func:`gauc` - impression-weighted mean of per-group AUCs (the usual
  "GAUC" of recommender papers), skipping groups that lack a class.
* :class:`StreamingAUC` - a fixed-size histogram accumulator for AUC over
  data that does not fit in memory (used by the generator for its oracle AUC).

A metric that is undefined (no positives or no negatives) is ``nan``.

Example::

    >>> auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
    0.75
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np

ArrayLike = Any  # np.ndarray | torch.Tensor | sequence


def _np(x: ArrayLike) -> np.ndarray:
    """Host numpy view/copy of ``x`` (torch tensors are detached first)."""
    if hasattr(x, "detach"):  # torch.Tensor without importing torch here
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def _mask(mask: ArrayLike, labels: np.ndarray) -> np.ndarray:
    """``mask`` as a flat bool array, checked against the (flat) labels' size."""
    m = _np(mask).reshape(-1).astype(bool)
    if m.shape != labels.shape:
        raise ValueError(f"mask size {m.shape[0]} does not match labels size {labels.shape[0]}")
    return m


def _prepare(labels: ArrayLike, scores: ArrayLike, mask: ArrayLike | None) -> tuple[np.ndarray, np.ndarray]:
    y = _np(labels).reshape(-1)
    s = _np(scores).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in size: {y.shape[0]} vs {s.shape[0]}")
    if mask is not None:
        m = _mask(mask, y)
        y, s = y[m], s[m]
    y = y.astype(np.float64)
    bad = (y != 0) & (y != 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"labels must be 0 or 1; position {i} has {y[i]:g}")
    return y, s.astype(np.float64)


def _average_ranks(sorted_keys_change: np.ndarray, n: int) -> np.ndarray:
    """1-based ranks of n sorted items, ties averaged.

    ``sorted_keys_change[i]`` is True where item i starts a new tie run.
    """
    run_id = np.cumsum(sorted_keys_change) - 1
    run_start = np.flatnonzero(sorted_keys_change)
    run_len = np.diff(np.append(run_start, n))
    # ranks run_start+1 .. run_start+run_len average to run_start + (run_len+1)/2
    run_rank = run_start + (run_len + 1) / 2.0
    return np.asarray(run_rank[run_id])


def auc(labels: ArrayLike, scores: ArrayLike, mask: ArrayLike | None = None) -> float:
    """ROC AUC by average ranks (ties count one half).

    Args:
        labels: 0/1 per row.
        scores: any real score per row (higher = more likely positive).
        mask: optional bool per row; False rows are ignored.

    Returns:
        AUC in [0, 1], or ``nan`` if only one class is present.

    Example::

        >>> auc(np.array([1, 0, 1]), np.array([0.9, 0.5, 0.5]))
        0.75
    """
    y, s = _prepare(labels, scores, mask)
    n = y.size
    pos = float(y.sum())
    neg = n - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(s, kind="stable")
    ss = s[order]
    change = np.empty(n, dtype=bool)
    change[0] = True
    np.not_equal(ss[1:], ss[:-1], out=change[1:])
    ranks = _average_ranks(change, n)
    rank_sum = float(ranks[y[order] == 1].sum())
    return (rank_sum - pos * (pos + 1) / 2.0) / (pos * neg)


def logloss(labels: ArrayLike, probs: ArrayLike, mask: ArrayLike | None = None, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy; probabilities are clipped to [eps, 1-eps].

    Example::

        >>> round(logloss([1, 0], [0.9, 0.1]), 4)
        0.1054
    """
    y, p = _prepare(labels, probs, mask)
    if y.size == 0:
        return float("nan")
    p = np.clip(p, eps, 1.0 - eps)
    return float(-(y * np.log(p) + (1.0 - y) * np.log1p(-p)).mean())


def _grouped(
    labels: ArrayLike, scores: ArrayLike, groups: ArrayLike, mask: ArrayLike | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-group (keys, rows, positives, auc) in one lexsort."""
    g = _np(groups).reshape(-1)
    y, s = _prepare(labels, scores, None)
    if g.shape != y.shape:
        raise ValueError(f"groups size {g.shape[0]} does not match labels size {y.shape[0]}")
    if mask is not None:
        m = _mask(mask, y)
        g, y, s = g[m], y[m], s[m]
    keys, gidx = np.unique(g, return_inverse=True)
    gidx = gidx.reshape(-1)
    n = y.size
    k = keys.size
    if n == 0:
        return keys, np.zeros(0), np.zeros(0), np.zeros(0)
    # Layout after the sort: rows of group 0 by ascending score, then group 1, ...
    order = np.lexsort((s, gidx))
    gs, ss, ys = gidx[order], s[order], y[order]
    change = np.empty(n, dtype=bool)
    change[0] = True
    change[1:] = (gs[1:] != gs[:-1]) | (ss[1:] != ss[:-1])
    global_rank = _average_ranks(change, n)
    rows = np.bincount(gs, minlength=k).astype(np.float64)
    group_start = np.concatenate([[0.0], np.cumsum(rows)[:-1]])
    rank = global_rank - group_start[gs]  # 1-based rank within the group
    pos = np.bincount(gs, weights=ys, minlength=k)
    neg = rows - pos
    rank_sum = np.bincount(gs, weights=rank * ys, minlength=k)
    with np.errstate(invalid="ignore", divide="ignore"):
        aucs = (rank_sum - pos * (pos + 1) / 2.0) / (pos * neg)
    aucs[(pos == 0) | (neg == 0)] = np.nan
    return keys, rows, pos, aucs


def grouped_auc(
    labels: ArrayLike, scores: ArrayLike, groups: ArrayLike, mask: ArrayLike | None = None
) -> dict[Hashable, float]:
    """AUC of each group (e.g. per scenario), computed with one sort.

    Args:
        labels: 0/1 per row.
        scores: score per row.
        groups: group key per row (ints or strings).
        mask: optional bool per row.

    Returns:
        ``{group: auc}`` for every group present; ``nan`` where a group has a
        single class.

    Example::

        >>> grouped_auc([0, 1, 0, 1], [0.1, 0.9, 0.8, 0.2], [0, 0, 1, 1])
        {0: 1.0, 1: 0.0}
    """
    keys, _, _, aucs = _grouped(labels, scores, groups, mask)
    return {k.item() if hasattr(k, "item") else k: float(a) for k, a in zip(keys, aucs)}


def gauc(labels: ArrayLike, scores: ArrayLike, groups: ArrayLike, mask: ArrayLike | None = None) -> float:
    """Row-weighted mean of per-group AUCs over groups having both classes.

    Example::

        >>> gauc([0, 1, 0, 1, 1], [0.1, 0.9, 0.8, 0.2, 0.5], [0, 0, 1, 1, 2])
        0.5
    """
    _, rows, _, aucs = _grouped(labels, scores, groups, mask)
    ok = ~np.isnan(aucs)
    if not ok.any():
        return float("nan")
    return float((aucs[ok] * rows[ok]).sum() / rows[ok].sum())


class StreamingAUC:
    """AUC of probabilities over many batches, in fixed memory.

    Scores in [0, 1] fall into ``bins`` equal-width buckets; pairs inside a
    bucket count as ties, so the result is within ~1/bins of the exact AUC
    (exact when no two distinct scores share a bucket).

    Args:
        bins: number of histogram buckets (memory: 16 bytes each).

    Example::

        >>> acc = StreamingAUC()
        >>> acc.update(np.array([0, 1]), np.array([0.2, 0.7]))
        >>> acc.value()
        1.0
    """

    def __init__(self, bins: int = 1 << 20) -> None:
        if bins < 2:
            raise ValueError(f"bins must be >= 2, got {bins}")
        self.bins = bins
        self.pos = np.zeros(bins, dtype=np.int64)
        self.neg = np.zeros(bins, dtype=np.int64)

    def update(self, labels: ArrayLike, probs: ArrayLike, mask: ArrayLike | None = None) -> None:
        y, p = _prepare(labels, probs, mask)
        if p.size and (np.nanmin(p) < 0 or np.nanmax(p) > 1 or np.isnan(p).any()):
            raise ValueError("StreamingAUC needs scores in [0, 1]")
        b = np.minimum((p * self.bins).astype(np.int64), self.bins - 1)
        is_pos = y == 1
        self.pos += np.bincount(b[is_pos], minlength=self.bins)
        self.neg += np.bincount(b[~is_pos], minlength=self.bins)

    def value(self) -> float:
        pos_total = float(self.pos.sum())
        neg_total = float(self.neg.sum())
        if pos_total == 0 or neg_total == 0:
            return float("nan")
        neg_below = np.cumsum(self.neg) - self.neg  # negatives in strictly lower buckets
        u = (self.pos * (neg_below + 0.5 * self.neg)).sum(dtype=np.float64)
        return float(u / (pos_total * neg_total))
