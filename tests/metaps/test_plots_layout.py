"""Plots stay readable from 2 to 32 workers: no two texts overlap, none leaves the figure.

Measured on the laid-out figures :func:`metaps.plots.render` returns (the ones
``make_plots`` saves): every visible text's display box (``get_window_extent``
with the figure's renderer) -- titles, axis and tick labels, legends, bar,
event and value labels.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from matplotlib.text import Text

from metaps.plots import PLOTS, render


def _report(workers: int, t0: float = 1000.0) -> dict[str, Any]:
    """A run of ``workers`` workers: worker 1 restarted (two incarnations), many events, shards of all widths."""
    out_workers = []
    for r in range(workers):
        hist = []
        for inc, (lo, hi) in enumerate([(1, 12), (13, 30)] if r == 1 else [(1, 30)], start=1):
            hist += [{"step": s, "time": t0 + 3 + 2.0 * s + (8 if inc == 2 else 0), "loss": 0.9 - 0.01 * s + 0.003 * r,
                      "samples_per_s": 100.0 + s - 2 * r, "incarnation": inc} for s in range(lo, hi + 1)]
        out_workers.append({"rank": r, "history": hist, "steps": 30,
                            "incarnations": [{"incarnation": 1}, {"incarnation": 2}] if r == 1 else [{"incarnation": 1}]})
    ledger = []
    seq = 0
    for r in range(workers):
        t = t0 + 4
        for k, elapsed in enumerate((0.3, 2.0, 9.0, 14.0, 0.8, 20.0)):
            t += elapsed
            ledger.append({"seq": seq, "time": t, "kind": "stale" if (r == 1 and k == 2) else "done",
                           "dataset": "eval" if k == 5 else "train", "epoch": 0, "file": r % 3, "start": 4 * k,
                           "stop": 4 * k + 4, "worker": r, "attempt": 1, "samples": 100, "elapsed_s": elapsed,
                           "replayed": False})
            seq += 1
    kinds = ["slow_detected", "shrink_shards", "restart", "shards_requeued", "move_vshards", "checkpoint",
             "node_down", "lease_expired"]
    events = [{"seq": i, "time": t0 + 10 + 0.7 * i, "node": f"worker:{i % workers}", "kind": kinds[i % len(kinds)],
               "evidence": {}, "action": ""} for i in range(24)]
    final = {"base/click/auc": 0.61, "adapted/click/auc": 0.66, "base/click/oracle_auc": 0.86,
             "base/conversion/auc": 0.58, "adapted/conversion/auc": 0.63, "base/conversion/oracle_auc": 0.81,
             "adapted/click/oracle_auc": 0.86, "base/click/norm_auc": 0.3}
    return {"started": t0, "status": "succeeded", "reason": "", "workers": out_workers, "shards": ledger,
            "controller": {"events": events}, "final_auc": final, "totals": {"samples_per_s": 170.0}}


def _with_curves(rep: dict[str, Any]) -> dict[str, Any]:
    rep = dict(rep)
    rep["auc_history"] = [{"step": s, "base/click/auc": 0.5 + 0.004 * s, "adapted/click/auc": 0.52 + 0.005 * s,
                           "base/conversion/auc": 0.5 + 0.003 * s, "adapted/conversion/auc": 0.51 + 0.004 * s,
                           "base/click/oracle_auc": 0.86} for s in range(3, 31, 3)]
    return rep


def _drawn_texts(fig: Any) -> list[tuple[str, Any]]:
    """(text, display bbox) of every text drawn: tick labels only for ticks inside the view."""
    renderer = fig.canvas.get_renderer()
    skip: set[int] = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            eps = 1e-9 * max(1.0, abs(hi - lo))
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not (lo - eps <= tick.get_loc() <= hi + eps):
                    skip.update((id(tick.label1), id(tick.label2)))
    out = []
    for t in fig.findobj(Text):
        if id(t) in skip or not t.get_visible() or not t.get_text().strip():
            continue
        out.append((t.get_text(), t.get_window_extent(renderer)))
    return out


def _problems(fig: Any) -> list[str]:
    texts = _drawn_texts(fig)
    fb = fig.bbox
    bad = [f"{s!r} leaves the figure ({b.x0:.0f},{b.y0:.0f})-({b.x1:.0f},{b.y1:.0f}) vs {fb.width:.0f}x{fb.height:.0f}"
           for s, b in texts if b.x0 < fb.x0 - 0.5 or b.y0 < fb.y0 - 0.5 or b.x1 > fb.x1 + 0.5 or b.y1 > fb.y1 + 0.5]
    for (s1, b1), (s2, b2) in itertools.combinations(texts, 2):
        # touching edges are not an overlap: require a positive intersection area
        w = min(b1.x1, b2.x1) - max(b1.x0, b2.x0)
        h = min(b1.y1, b2.y1) - max(b1.y0, b2.y0)
        if w > 0.5 and h > 0.5:
            bad.append(f"{s1!r} overlaps {s2!r}")
    return bad


@pytest.mark.parametrize("workers", [2, 32])
@pytest.mark.parametrize("name", PLOTS)
def test_no_text_overlaps_or_leaves_the_figure(name: str, workers: int) -> None:
    fig = render(name, _report(workers))
    problems = _problems(fig)
    assert not problems, f"{name} at {workers} workers:\n" + "\n".join(problems[:20])


@pytest.mark.parametrize("workers", [2, 32])
def test_auc_curves_readable(workers: int) -> None:
    fig = render("auc.png", _with_curves(_report(workers)))
    assert not _problems(fig)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert {"click base", "click adapted", "click oracle 0.860"} <= set(legend), legend
    assert any(s.startswith("click final adapted") for s in legend), legend


def test_labels_are_placed_where_they_fit() -> None:
    """At 2 workers the wide bars carry their shard, the events lane names events, bars show AUC values."""
    fig = render("shards.png", _report(2))
    texts = {t for t, _ in _drawn_texts(fig)}
    assert "0:12-16" in texts, "a 14 s bar is wide enough for its label"
    assert "0:0-4" not in texts, "a 0.3 s bar is too narrow for its label"
    assert any(t.startswith("slow w") for t in texts) and "events" in texts
    legend = fig.axes[0].get_legend()
    ax_box = fig.axes[0].get_window_extent(fig.canvas.get_renderer())
    assert legend.get_window_extent(fig.canvas.get_renderer()).x0 >= ax_box.x1, "the legend sits outside the axes"

    auc = render("auc.png", _report(2))
    texts = {t for t, _ in _drawn_texts(auc)}
    assert {"0.610", "0.660", "0.580", "0.630"} <= texts and "oracle 0.860" in texts
    assert [t.get_text() for t in auc.axes[0].get_xticklabels()] == ["click", "conversion"]


def test_fleet_total_and_every_incarnation_drawn() -> None:
    fig = render("throughput.png", _report(2))
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    # worker 0 is the one the controller flagged slow (slow_detected on worker:0)
    assert "fleet total" in labels and "worker 0 (slow)" in labels and "worker 1 (2 incarnations)" in labels
    assert "restart (new incarnation)" in labels
    assert {"event: slow", "event: restart", "event: checkpoint", "event: migrate"} <= set(labels), labels
    total = next(line for line in ax.get_lines() if line.get_label() == "fleet total")
    worker_peak = max(max(line.get_ydata()) for line in ax.get_lines() if line.get_label().startswith("worker"))
    assert max(total.get_ydata()) > worker_peak  # the sum of two workers is above either
    loss = render("loss.png", _report(2))
    assert "all heads (loss), smoothed" in [t.get_text() for t in loss.axes[0].get_legend().get_texts()]
