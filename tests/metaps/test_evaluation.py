"""common.evaluation against brute-force definitions on small random inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.evaluation import StreamingAUC, auc, gauc, grouped_auc, logloss


def brute_auc(y: np.ndarray, s: np.ndarray) -> float:
    """P(score_pos > score_neg) + 0.5 P(tie), over all pairs."""
    pos, neg = s[y == 1], s[y == 0]
    if pos.size == 0 or neg.size == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


@pytest.mark.parametrize("seed", range(6))
def test_auc_matches_pairwise_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 200))
    y = rng.integers(0, 2, size=n)
    s = rng.integers(0, 5, size=n).astype(np.float64)  # many ties on purpose
    assert auc(y, s) == pytest.approx(brute_auc(y, s), abs=1e-12, nan_ok=True)
    s2 = rng.normal(size=n)
    assert auc(y, s2) == pytest.approx(brute_auc(y, s2), abs=1e-12, nan_ok=True)


def test_auc_mask_and_torch_inputs() -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, size=100)
    s = rng.normal(size=100)
    m = rng.random(100) < 0.6
    expected = brute_auc(y[m], s[m])
    assert auc(y, s, mask=m) == pytest.approx(expected, abs=1e-12)
    assert auc(torch.tensor(y, dtype=torch.float32), torch.tensor(s), torch.tensor(m)) == pytest.approx(expected, abs=1e-6)


def test_auc_edge_cases() -> None:
    assert math.isnan(auc([1, 1, 1], [0.1, 0.2, 0.3]))
    assert auc([0, 1], [0.2, 0.9]) == 1.0
    assert auc([0, 1], [0.9, 0.2]) == 0.0
    assert auc([0, 1], [0.5, 0.5]) == 0.5
    with pytest.raises(ValueError, match="position 1 has 2"):
        auc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="differ in size"):
        auc([0, 1], [0.1])


def test_logloss_matches_formula() -> None:
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, size=50)
    p = rng.random(50)
    expected = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert logloss(y, p) == pytest.approx(expected, rel=1e-9)
    m = np.arange(50) < 20
    assert logloss(torch.tensor(y), torch.tensor(p), torch.tensor(m)) == pytest.approx(
        -np.mean(y[:20] * np.log(p[:20]) + (1 - y[:20]) * np.log(1 - p[:20])), rel=1e-9
    )
    assert np.isfinite(logloss([1, 0], [0.0, 1.0]))  # clipped, not inf


@pytest.mark.parametrize("seed", range(4))
def test_grouped_auc_matches_per_group_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 300
    y = rng.integers(0, 2, size=n)
    s = rng.integers(0, 6, size=n).astype(np.float32)
    g = rng.integers(0, 7, size=n)
    g[g == 6] = 5
    y[g == 5] = 1  # a group with one class -> nan
    got = grouped_auc(y, s, g)
    assert sorted(got) == sorted(np.unique(g).tolist())
    for key, value in got.items():
        sel = g == key
        assert value == pytest.approx(brute_auc(y[sel], s[sel]), abs=1e-12, nan_ok=True), key
    # gauc: row-weighted mean over groups with both classes
    ok = [k for k, v in got.items() if not math.isnan(v)]
    w = np.array([(g == k).sum() for k in ok], dtype=np.float64)
    expect = float((np.array([got[k] for k in ok]) * w).sum() / w.sum())
    assert gauc(y, s, g) == pytest.approx(expect, abs=1e-12)


def test_grouped_auc_string_groups_and_mask() -> None:
    y = np.array([0, 1, 0, 1, 0, 1])
    s = np.array([0.1, 0.9, 0.8, 0.2, 0.5, 0.4])
    g = np.array(["a", "a", "b", "b", "c", "c"])
    m = np.array([True, True, True, True, False, False])
    assert grouped_auc(y, s, g, mask=m) == {"a": 1.0, "b": 0.0}


def test_streaming_auc_close_to_exact_over_batches() -> None:
    rng = np.random.default_rng(3)
    acc = StreamingAUC()
    ys, ps = [], []
    for _ in range(5):
        p = rng.random(400)
        y = (rng.random(400) < p).astype(np.int64)
        acc.update(y, p)
        ys.append(y)
        ps.append(p)
    exact = auc(np.concatenate(ys), np.concatenate(ps))
    assert acc.value() == pytest.approx(exact, abs=1e-4)
    coarse = StreamingAUC(bins=2)
    coarse.update(np.array([0, 1, 0, 1]), np.array([0.1, 0.2, 0.7, 0.9]))
    assert coarse.value() == pytest.approx(brute_auc(np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1.0])))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        acc.update(np.array([1]), np.array([1.5]))
