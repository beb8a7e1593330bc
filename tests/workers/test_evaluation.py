"""Evaluation: summarize / merge_eval_files against direct metric computation."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from common.evaluation import auc, logloss
from workers.evaluation import head_target, merge_eval_files, score_batches, summarize, write_eval_file

from tests.workers.conftest import make_job


def _random_head(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    oracle = rng.uniform(0.02, 0.9, size=n).astype(np.float32)
    target = (rng.uniform(size=n) < oracle).astype(np.float32)
    score = np.clip(oracle + rng.normal(0, 0.2, size=n), 0.001, 0.999).astype(np.float32)
    return {"score": score, "target": target, "scenario": rng.integers(0, 3, size=n), "oracle": oracle}


def test_summarize_matches_direct_metrics() -> None:
    rng = np.random.default_rng(0)
    arr = _random_head(rng, 5000)
    res = summarize({"click": arr})["click"]
    y, s = arr["target"].astype(np.float64), arr["score"].astype(np.float64)
    assert res["rows"] == 5000
    assert res["positives"] == int(y.sum())
    assert res["auc"] == pytest.approx(auc(y, s), abs=1e-12)
    assert res["logloss"] == pytest.approx(logloss(y, s), abs=1e-12)
    oracle_auc = auc(y, arr["oracle"].astype(np.float64))
    assert res["oracle_auc"] == pytest.approx(oracle_auc, abs=1e-12)
    assert res["norm_auc"] == pytest.approx((auc(y, s) - 0.5) / (oracle_auc - 0.5), abs=1e-12)
    # Scores are the oracle plus noise: informative but worse than the oracle.
    assert 0.5 < res["norm_auc"] < 1.0
    for scen in range(3):
        sel = arr["scenario"] == scen
        assert res["by_scenario"][str(scen)]["rows"] == int(sel.sum())
        assert res["by_scenario"][str(scen)]["auc"] == pytest.approx(auc(y[sel], s[sel]), abs=1e-12)


def test_summarize_brute_force_auc_on_ties() -> None:
    """Pairwise definition (ties count one half) on coarse scores with many ties."""
    rng = np.random.default_rng(1)
    y = (rng.uniform(size=300) < 0.3).astype(np.float32)
    s = (rng.integers(0, 5, size=300) / 4.0).astype(np.float32)
    res = summarize({"h": {"score": s, "target": y, "scenario": np.zeros(300, dtype=np.int64)}})["h"]
    pos, neg = s[y == 1][:, None], s[y == 0][None, :]
    brute = ((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size)
    assert res["auc"] == pytest.approx(float(brute), abs=1e-12)
    assert "norm_auc" not in res  # no oracle column, no normalized AUC


def test_merge_of_shard_files_equals_one_summary(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    full = {"base": {h: _random_head(rng, 3000) for h in ("click", "conversion")},
            "adapted": {h: _random_head(rng, 3000) for h in ("click", "conversion")}}
    cuts = [0, 700, 701, 1900, 3000]  # uneven shards, one of a single row
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        part = {kind: {h: {k: v[a:b] for k, v in arrs.items()} for h, arrs in heads.items()}
                for kind, heads in full.items()}
        write_eval_file(tmp_path / f"shard-{i}.npz", part)
    (tmp_path / "stale.tmp.npz").write_bytes(b"half-written")  # an interrupted write is ignored
    merged = merge_eval_files(tmp_path)
    for kind in ("base", "adapted"):
        direct = summarize(full[kind])
        for head in ("click", "conversion"):
            for key in ("rows", "positives", "auc", "logloss", "oracle_auc", "norm_auc"):
                assert merged[kind][head][key] == pytest.approx(direct[head][key], abs=1e-12), (kind, head, key)
            got, want = merged[kind][head]["by_scenario"], direct[head]["by_scenario"]
            assert sorted(got) == sorted(want) == ["0", "1", "2"]
            for scen in want:
                assert got[scen]["rows"] == want[scen]["rows"]
                assert got[scen]["auc"] == pytest.approx(want[scen]["auc"], abs=1e-12)


def test_scoring_range_by_range_equals_scoring_all_at_once(worker_data, tmp_path: Path) -> None:
    """Real model, real rows: per-range score files merged == one pass over the dataset."""
    from meta_io.reader import MetaIODataset
    from workers.local import local_store
    from workers.row_source import LocalRowSource
    from workers.worker import build_model

    job = make_job(worker_data["meta"], tmp_path, mode="meta")
    model = build_model(job)
    rows = LocalRowSource(local_store(job))
    ds = MetaIODataset(worker_data["meta"])
    # The first 4 record batches of each file, cut into uneven ranges (adapted scoring is slow on 2 cores).
    ranges = [(f, a, b) for f in range(ds.num_files) for a, b in ((0, 1), (1, 3), (3, min(4, ds.num_batches(f))))
              if b > a]
    whole = score_batches(model, rows, itertools.chain.from_iterable(ds.read_range(*r) for r in ranges),
                          job.meta, adapt=True)
    assert set(whole) == {"base", "adapted"}
    out = tmp_path / "eval"
    for f, a, b in reversed(ranges):  # any order: merging concatenates files, AUC is order-free
        write_eval_file(out / f"{f}-{a}-{b}.npz", score_batches(model, rows, ds.read_range(f, a, b), job.meta, adapt=True))
    n_files = len(ranges)
    merged = merge_eval_files(out)
    assert merged["files"] == n_files
    for kind in ("base", "adapted"):
        direct = summarize(whole[kind])
        for head in ("click", "conversion"):
            assert merged[kind][head]["rows"] == direct[head]["rows"] > 0
            for key in ("auc", "logloss", "oracle_auc"):
                assert merged[kind][head][key] == pytest.approx(direct[head][key], abs=1e-9), (kind, head, key)


def test_head_target_conversion_is_ctcvr() -> None:
    import torch

    labels = {"click": torch.tensor([1.0, 1.0, 0.0, 0.0]), "conversion": torch.tensor([1.0, 0.0, 1.0, 0.0])}
    assert head_target("conversion", labels).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert head_target("click", labels).tolist() == [1.0, 1.0, 0.0, 0.0]
