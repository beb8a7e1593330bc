"""metaps.plots: every plot is written and shows something, with full and with empty inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread

from metaps.plots import PLOTS, make_plots


def assert_png_not_blank(path: Path) -> None:
    """The PNG exists and is not one flat colour (pixel variance > 0, > 1 distinct colour)."""
    assert path.is_file(), f"{path} missing"
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50, f"{path}: odd image shape {img.shape}"
    flat = img[..., :3].reshape(-1, 3)
    rgb = (flat * 255).astype(np.uint8)
    # more than one distinct colour <=> some pixel differs from the first (np.unique(axis=0) sorted ~0.5M rows: ~1 s)
    assert bool((rgb != rgb[0]).any()), f"{path} is blank (one colour)"
    assert float(flat.var()) > 0.0, f"{path} has zero pixel variance"


def test_the_blank_check_refuses_one_colour_and_passes_one_odd_pixel(tmp_path: Path) -> None:
    from matplotlib.image import imsave

    img = np.full((60, 80, 3), 0.5)
    imsave(tmp_path / "blank.png", img)
    with pytest.raises(AssertionError, match="is blank"):
        assert_png_not_blank(tmp_path / "blank.png")
    img[59, 79] = (0.5, 0.5, 0.0)  # the last pixel alone differs
    imsave(tmp_path / "dot.png", img)
    assert_png_not_blank(tmp_path / "dot.png")


def _report(t0: float = 1000.0) -> dict[str, Any]:
    hist = lambda rank: [
        {"step": s, "time": t0 + 5 + s * (1 + rank), "loss": 0.9 - 0.02 * s + 0.01 * rank,
         "samples_per_s": 100.0 + 10 * s - 30 * rank, "query_loss": 0.8 - 0.02 * s} for s in range(1, 11)]
    ledger = [
        {"seq": 0, "time": t0 + 10, "kind": "done", "dataset": "train", "epoch": 0, "file": 0, "start": 0, "stop": 4,
         "worker": 0, "attempt": 1, "samples": 200, "elapsed_s": 5.0, "replayed": False},
        {"seq": 1, "time": t0 + 14, "kind": "done", "dataset": "train", "epoch": 0, "file": 0, "start": 4, "stop": 8,
         "worker": 1, "attempt": 1, "samples": 200, "elapsed_s": 9.0, "replayed": False},
        {"seq": 2, "time": t0 + 20, "kind": "stale", "dataset": "train", "epoch": 0, "file": 0, "start": 8,
         "stop": 12, "worker": 1, "attempt": 1, "samples": 200, "elapsed_s": 6.0, "replayed": False},
        {"seq": 3, "time": t0 + 22, "kind": "done", "dataset": "train", "epoch": 0, "file": 0, "start": 8,
         "stop": 12, "worker": 0, "attempt": 2, "samples": 200, "elapsed_s": 4.0, "replayed": False},
        {"seq": 4, "time": t0 + 24, "kind": "done", "dataset": "eval", "epoch": 0, "file": 0, "start": 0, "stop": 4,
         "worker": 0, "attempt": 1, "samples": 0, "elapsed_s": 0.0, "replayed": False},
    ]
    events = [
        {"seq": 0, "time": t0 + 12, "node": "worker:1", "kind": "slow_detected", "evidence": {}, "action": ""},
        {"seq": 1, "time": t0 + 13, "node": "worker:1", "kind": "shrink_shards", "evidence": {}, "action": "shrink"},
        {"seq": 2, "time": t0 + 16, "node": "worker:1", "kind": "lease_expired", "evidence": {}, "action": "requeue"},
        {"seq": 3, "time": t0 + 18, "node": "worker:1", "kind": "restart", "evidence": {}, "action": "restart"},
    ]
    return {
        "started": t0, "status": "succeeded", "reason": "",
        "workers": [{"rank": r, "history": hist(r)} for r in (0, 1)],
        "shards": ledger, "controller": {"events": events},
        "final_auc": {"base/click/auc": 0.61, "adapted/click/auc": 0.66, "base/click/oracle_auc": 0.86},
        "totals": {"samples_per_s": 170.0},
    }


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("plots")
    return {"full": make_plots(_report(), root / "full"),
            "empty": make_plots({"workers": [], "shards": [], "controller": {}}, root / "empty")}


def test_every_plot_is_written_and_not_blank(rendered: dict[str, list[Path]]) -> None:
    assert [p.name for p in rendered["full"]] == list(PLOTS)
    for p in rendered["full"]:
        assert_png_not_blank(p)


def test_empty_report_still_renders_labelled_figures(rendered: dict[str, list[Path]]) -> None:
    assert [p.name for p in rendered["empty"]] == list(PLOTS)
    for p in rendered["empty"]:
        assert_png_not_blank(p)  # the "no data" text is drawn


def test_each_plot_draws_its_data(rendered: dict[str, list[Path]]) -> None:
    """Full and empty versions of every plot are different images."""
    for full, empty in zip(rendered["full"], rendered["empty"]):
        a, b = imread(full), imread(empty)
        assert a.shape != b.shape or not np.array_equal(a, b), full.name


def test_auc_curves_when_workers_log_auc(tmp_path: Path) -> None:
    rep = _report()
    for w in rep["workers"]:
        for h in w["history"]:
            h["auc"] = 0.5 + 0.01 * h["step"]
    make_plots(rep, tmp_path / "plots")
    assert_png_not_blank(tmp_path / "plots" / "auc.png")


def test_a_plot_that_fails_does_not_stop_the_others(tmp_path: Path) -> None:
    rep = _report()
    rep["shards"][0] = {"bad": "entry"}  # the timeline cannot draw this
    paths = make_plots(rep, tmp_path / "plots")
    assert [p.name for p in paths] == list(PLOTS)
    for p in paths:
        assert_png_not_blank(p)


@pytest.mark.parametrize(("fn", "title", "xlabel", "ylabel", "legend"), [
    ("plot_throughput", "throughput (fleet total and per worker)", "seconds since launch", "samples/s", True),
    ("plot_shard_timeline", "shard timeline (who did which shard; requeues and stragglers marked)",
     "seconds since launch", "", True),
    ("plot_loss", "training loss per head (all workers, smoothed)", "seconds since launch", "loss", True),
    ("plot_auc", "eval AUC by head (final evaluation)", "head", "AUC", True),
])
def test_every_plot_finishes_its_axes(fn: str, title: str, xlabel: str, ylabel: str, legend: bool) -> None:
    from matplotlib.figure import Figure

    import metaps.plots as plots

    ax = Figure().add_subplot(1, 1, 1)
    getattr(plots, fn)(_report(), ax)
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (title, xlabel, ylabel)
    assert (ax.get_legend() is not None) == legend
    gridded = [line.get_visible() for line in ax.xaxis.get_gridlines()]
    assert gridded and all(gridded)
