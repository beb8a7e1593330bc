"""Plots that teach (issue 28 item 5): each plot says what it is computed on, the fleet
throughput is a resampled rolling sum (no spikes from summing sparse points), a slow or
restarted worker stands out, loss is per head with TensorBoard's smoothing, and
``summary.png`` puts the run on one page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from metaps.plots import PLOTS, TB_SMOOTHING, fleet_throughput, make_plots, render, tb_smooth

T0 = 1_796_000_000.0  # a real unix time, as reports have


def _staggered(with_samples: bool, step_rate: float = 100.0) -> dict[str, Any]:
    """Two workers alive 0..100 s doing 100 samples/s each; sparse records, 10 s apart, staggered
    by 5 s (worker 0 at 2, 12, ..., 92 s; worker 1 at 7, 17, ..., 97 s). ``step_rate``: the
    records' ``samples_per_s`` (a step's own rate: above 100 when a worker waits between steps)."""
    workers = []
    for rank, first in ((0, 2.0), (1, 7.0)):
        hist = []
        for k in range(10):
            t = first + 10.0 * k
            rec: dict[str, Any] = {"step": 10 * (k + 1), "time": T0 + t, "samples_per_s": step_rate, "loss": 0.5,
                                   "incarnation": 1}
            if with_samples:
                rec["samples"] = 100.0 * t  # running count: 100 samples/s since the start
            hist.append(rec)
        workers.append({"rank": rank, "history": hist, "incarnations": [
            {"incarnation": 1, "train_start": T0, "train_end": T0 + 100.0, "samples": 10_000}]})
    return {"started": T0, "status": "succeeded", "workers": workers, "controller": {"events": []}, "shards": [],
            "final_auc": {}, "totals": {}}


def _total_line(rep: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    fig = render("throughput.png", rep)
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == "fleet total")
    x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
    return x[np.isfinite(y)], y[np.isfinite(y)]


@pytest.mark.parametrize("with_samples", [True, False], ids=["running-count", "rates-only"])
def test_fleet_total_of_staggered_sparse_records_has_no_spike(with_samples: bool) -> None:
    """Both workers run the whole 0..100 s at 100 samples/s: the total is 200 everywhere.

    Summing each worker's records interpolated between its own first and last record (the
    old plot) gives 100 for the first and last 5 s (one worker "not there yet") and no
    total at all outside 2..97 s.
    """
    x, y = _total_line(_staggered(with_samples))
    bad = [(round(float(a), 1), round(float(b))) for a, b in zip(x, y) if not 180.0 <= b <= 220.0]
    assert not bad, f"fleet total off 200 +-10% at (s, samples/s): {bad[:10]}"
    assert x.min() <= 1.0 and x.max() >= 99.0, f"the total covers {x.min():.1f}..{x.max():.1f} s, not 0..100 s"


def test_fleet_total_is_samples_done_not_summed_step_rates() -> None:
    """A step's own rate (300/s) overstates a worker that waits between steps; the total
    follows the samples actually done (2 x 100/s), not the sum of step rates (600/s)."""
    x, y = _total_line(_staggered(with_samples=True, step_rate=300.0))
    assert y.max() <= 220.0 and y.min() >= 180.0, (y.min(), y.max())


def test_throughput_rolling_window_and_alive_span() -> None:
    """The documented window (median gap between a worker's records) and NaN where a worker was not alive."""
    rep = _staggered(with_samples=True)
    rep["workers"][1]["incarnations"][0].update(train_start=T0 + 40.0, samples=6_000)  # worker 1 started at 40 s
    rep["workers"][1]["history"] = [h for h in rep["workers"][1]["history"] if h["time"] > T0 + 40.0]
    for h in rep["workers"][1]["history"]:
        h["samples"] = 100.0 * (h["time"] - T0 - 40.0)
    tp = fleet_throughput(rep)
    assert tp.window_s == pytest.approx(10.0)
    w1 = next(s for s in tp.segments if s.rank == 1)
    before = tp.grid < 39.0
    assert np.isnan(w1.rate[before]).all(), "a worker contributes only while it is alive"
    assert np.allclose(tp.total[before], 100.0, rtol=0.05) and np.allclose(tp.total[tp.grid > 41.0], 200.0, rtol=0.05)


def test_slow_worker_emphasized_and_restart_marked() -> None:
    rep = _staggered(with_samples=True)
    rep["controller"]["events"] = [{"seq": 0, "time": T0 + 50.0, "node": "worker:1", "kind": "slow_detected",
                                    "evidence": {}, "action": ""}]
    w0 = rep["workers"][0]
    for h in w0["history"]:
        h["incarnation"] = 1 if h["time"] < T0 + 50.0 else 2
        h["samples"] = 100.0 * (h["time"] - T0 - (0.0 if h["incarnation"] == 1 else 50.0))
    w0["incarnations"] = [{"incarnation": 1, "train_start": T0, "train_end": T0 + 45.0, "samples": 4500},
                          {"incarnation": 2, "train_start": T0 + 50.0, "train_end": T0 + 100.0, "samples": 5000}]
    fig = render("throughput.png", rep)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "worker 1 (slow)" in labels and "worker 0 (2 incarnations)" in labels, labels
    assert "restart (new incarnation)" in labels, labels
    width = {ln.get_label(): ln.get_linewidth() for ln in ax.get_lines()}
    assert width["worker 1 (slow)"] > width["worker 0 (2 incarnations)"], width
    texts = {t.get_text() for t in fig.findobj(Text) if t.get_visible()}
    assert "w1 slow" in texts, "the slow worker's line carries its label where it fits"


def test_tb_smooth_matches_tensorboard_by_hand() -> None:
    """TensorBoard: last = last * w + (1 - w) * v; shown last / (1 - w^n), n finite values so far."""
    assert TB_SMOOTHING == 0.6
    # by hand, w = 0.6: 0.4 / 0.4 = 1; (0.24 + 1.2) / 0.64 = 2.25; (0.864 + 0.8) / 0.784
    assert tb_smooth([1.0, 3.0, 2.0]) == pytest.approx([1.0, 2.25, 1.664 / 0.784])
    out = tb_smooth([1.0, float("nan"), 3.0])  # a non-finite value passes through and does not count
    assert out[0] == pytest.approx(1.0) and np.isnan(out[1]) and out[2] == pytest.approx(2.25)
    assert tb_smooth([5.0, 5.0, 5.0]).tolist() == [5.0, 5.0, 5.0]
    assert tb_smooth([1.0, 3.0], weight=0.0).tolist() == [1.0, 3.0]


def test_loss_per_head_smoothed_over_faint_raw_points() -> None:
    hist = [{"step": s, "time": T0 + s, "samples_per_s": 1.0, "loss": v + 0.1, "loss/click": v, "loss/conv": 0.1,
             "incarnation": 1} for s, v in ((1, 1.0), (2, 3.0), (3, 2.0))]
    rep = {"started": T0, "workers": [{"rank": 0, "history": hist}], "controller": {"events": []}, "shards": []}
    ax = render("loss.png", rep).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert {"all heads (loss), smoothed", "click, smoothed", "conv, smoothed"} <= set(lines), list(lines)
    assert np.asarray(lines["click, smoothed"].get_ydata()) == pytest.approx([1.0, 2.25, 1.664 / 0.784])
    raw = [ln for ln in ax.get_lines() if ln.get_linestyle() == "None"]
    assert raw and all((ln.get_alpha() or 1.0) <= 0.5 for ln in raw), "raw points drawn, faint"
    assert "TensorBoard" in "\n".join(t.get_text() for t in ax.texts)


def _auc_report() -> dict[str, Any]:
    final = {kind: {"click": {"rows": 2187, "auc": 0.79 if kind == "base" else 0.80, "oracle_auc": 0.85}}
             for kind in ("base", "adapted")}
    return {"started": T0, "workers": [{"rank": 0, "history": [], "eval_history": [{"step": 10}]}],
            "controller": {"events": []}, "shards": [],
            "config": {"train": {"eval_every_steps": 10, "eval_max_rows": 2048}},
            "auc_history": [{"step": s, "base/click/auc": 0.7 + 0.01 * s / 10, "adapted/click/auc": 0.71 + 0.01 * s / 10}
                            for s in (10, 20, 30)],
            "final_metrics": final, "final_auc": {"base/click/auc": 0.79, "adapted/click/auc": 0.80,
                                                  "base/click/oracle_auc": 0.85}}


def _all_text(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text) if t.get_visible())


def test_auc_plot_names_both_samples() -> None:
    text = _all_text(render("auc.png", _auc_report()))
    assert "2,048 rows" in text and "worker 0" in text and "every 10 steps" in text, text
    assert "all 2,187 held-out rows" in text, text
    assert "step 30" in text and "0.730 vs 0.790" in text, "the curve's last point is compared with the final figure"
    counted = _auc_report()  # points that say how many rows they scored: that count, not the bound
    for h in counted["auc_history"]:
        h["rows"] = 1984
    assert "the first 1,984 rows of [data] eval" in _all_text(render("auc.png", counted))
    bars = _auc_report()
    bars["auc_history"] = []
    assert "all 2,187 held-out rows" in _all_text(render("auc.png", bars))


def test_summary_has_four_panels(tmp_path: Path) -> None:
    from tests.metaps.test_plots import assert_png_not_blank

    rep = _staggered(with_samples=True)
    rep.update(_auc_report())
    rep["workers"] = _staggered(with_samples=True)["workers"]
    rep["controller"]["events"] = [{"seq": 0, "time": T0 + 50.0, "node": "worker:1", "kind": "slow_detected",
                                    "evidence": {}, "action": ""}]
    rep.update(name="demo", wall_s=101.5, coverage_summary="complete",
               totals={"samples": 20_000, "steps": 200, "last_step": 100, "samples_per_s": 200.0, "incarnations": 2})
    # one scheduled fault fired (the injector's record), one never did: only the first is named
    rep["config"] = {**rep.get("config", {}), "faults": {"faults": [
        {"target": "worker", "index": 1, "kind": "slow", "factor": 3.0, "start_step": 20, "end_step": 80},
        {"target": "ps", "index": 0, "kind": "latency", "latency_s": 0.5, "start_s": 900.0}]}}
    rep["faults"] = {"scheduled": 2, "fired": [
        {"target": "worker", "index": 1, "kind": "slow", "what": "worker 1 slow x3 (step)", "first_step": 20,
         "last_step": 79, "count": 60, "first_time": T0 + 30.0, "last_time": T0 + 60.0, "start_s": 30.0,
         "end_s": 60.0, "sleep_s": 12.0}]}
    assert "summary.png" in PLOTS
    fig = render("summary.png", rep)
    every_text = " ".join(_all_text(fig).split())  # wrapped lines joined
    assert "faults fired: worker 1 slow x3 (step) at steps 20-" in every_text, every_text
    assert "30.0-60.0 s after launch" in every_text.replace("- ", "-"), every_text
    assert "latency" not in every_text and "ps 0" not in every_text, "a fault that never fired is named nowhere"
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["throughput (fleet total and per worker)", "training loss per head (all workers, smoothed)",
                      "eval AUC by head (final evaluation)", "the run in numbers"], titles
    numbers = "\n".join(t.get_text() for t in fig.axes[3].texts)
    for part in ("coverage: complete", "steps 200", "samples: 20,000", "wall 101.5 s",
                 "slow (flagged by the controller): worker 1 at 50.0 s", "AUC click: base 0.790, adapted 0.800"):
        assert part in numbers, (part, numbers)
    paths = make_plots(rep, tmp_path)
    assert tmp_path / "summary.png" in paths
    assert_png_not_blank(tmp_path / "summary.png")


def test_a_worker_with_one_record_still_counts() -> None:
    """A worker killed after its first logged step (one record, no span known) holds its rate
    over one window around the record, in its line and in the total."""
    rep = {"started": T0, "controller": {"events": []}, "workers": [
        {"rank": 0, "history": [{"step": 1, "time": T0 + 5.0, "samples_per_s": 50.0}]},
        {"rank": 1, "history": [{"step": s, "time": T0 + s, "samples_per_s": 100.0} for s in (2, 4, 6, 8)]}]}
    tp = fleet_throughput(rep)
    assert tp.window_s == pytest.approx(2.0)
    assert {s.rank for s in tp.segments} == {0, 1}
    near = np.abs(tp.grid - 5.0) < 0.9
    assert np.allclose(tp.total[near], 150.0) and np.allclose(tp.total[~(np.abs(tp.grid - 5.0) <= 1.0)], 100.0)
