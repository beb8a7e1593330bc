"""PNG plots of a run (matplotlib, Agg backend: no display needed).

From ``report.json`` (see :mod:`metaps.run_report`):

* ``throughput.png``: samples/s of every worker over time;
* ``shards.png``: the shard timeline -- one lane per worker, a bar per shard
  completion (from the controller's ledger: start = completion - elapsed),
  coloured by dataset; duplicate/stale completions (replays after a requeue)
  hatched in red; straggler and recovery events (slow, shrink, restart,
  node down, requeue) as marked vertical lines;
* ``loss.png``: training loss per worker against step;
* ``auc.png``: eval AUC -- per-step curves when workers log an ``auc``,
  and the final held-out AUC of every head/kind as bars.

A plot with nothing to show still renders a labelled empty figure, so every
file exists after every run.

Example::

    paths = make_plots(json.loads(Path("runs/x/report.json").read_text()), Path("runs/x/plots"))
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from metaps.core.log import kv

log = logging.getLogger(__name__)

PLOTS = ("throughput.png", "shards.png", "loss.png", "auc.png")

EVENT_STYLE = {
    "slow_detected": ("tab:red", "slow"),
    "shrink_shards": ("tab:orange", "shrink"),
    "restart": ("tab:purple", "restart"),
    "node_down": ("black", "down"),
    "shards_requeued": ("tab:brown", "requeue"),
    "lease_expired": ("tab:brown", "lease"),
    "hang": ("tab:brown", "hang"),
    "recovered": ("tab:green", "recovered"),
    "move_vshards": ("tab:pink", "move"),
    "rollback": ("tab:gray", "rollback"),
}


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, fontsize=12, color="dimgray")
    ax.set_xticks([])
    ax.set_yticks([])


def _finish(ax: Any, title: str, xlabel: str = "", ylabel: str = "", grid: str = "both",
            legend: Mapping[str, Any] | None = None) -> None:
    """The axis finishing every plot shares: labels, title, a light grid, an optional legend.

    Args:
        ax: the matplotlib axes.
        title: the plot title.
        xlabel: x axis label ('' leaves it unset).
        ylabel: y axis label ('' leaves it unset).
        grid: which axes get grid lines (``both``, ``x``, ``y``).
        legend: keyword arguments of ``ax.legend``; None draws no legend.
    """
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis=grid, alpha=0.3)
    if legend is not None:
        ax.legend(**legend)


def _t0(report: Mapping[str, Any]) -> float:
    return float(report.get("started") or 0.0) or min(
        (float(h["time"]) for w in report.get("workers", []) for h in (w.get("history") or [])), default=0.0)


def plot_throughput(report: Mapping[str, Any], ax: Any) -> None:
    t0 = _t0(report)
    drawn = False
    for w in report.get("workers", []):
        hist = [h for h in (w.get("history") or []) if h.get("samples_per_s") is not None]
        if not hist:
            continue
        ax.plot([h["time"] - t0 for h in hist], [h["samples_per_s"] for h in hist], marker="o", markersize=3,
                label=f"worker {w['rank']}")
        drawn = True
    if not drawn:
        _empty(ax, "no worker step history")
        return
    _finish(ax, "throughput per worker", "seconds since launch", "samples/s", legend={"fontsize": 8})


def plot_shard_timeline(report: Mapping[str, Any], ax: Any) -> None:
    t0 = _t0(report)
    ledger: Sequence[Mapping[str, Any]] = report.get("shards", [])
    events = report.get("controller", {}).get("events", [])
    if not ledger and not events:
        _empty(ax, "no shard ledger")
        return
    datasets = sorted({e["dataset"] for e in ledger})
    colours = {d: plt.get_cmap("tab10")(i % 10) for i, d in enumerate(datasets)}
    workers = sorted({int(e["worker"]) for e in ledger})
    labelled: set[str] = set()
    for e in ledger:
        start = float(e["time"]) - float(e.get("elapsed_s") or 0.0) - t0
        width = max(float(e.get("elapsed_s") or 0.0), 0.05)
        replay = e["kind"] != "done" or e.get("replayed")
        label = "replayed/duplicate" if replay else str(e["dataset"])
        ax.barh(int(e["worker"]), width, left=start, height=0.6,
                color="tab:red" if replay else colours[e["dataset"]], edgecolor="black", linewidth=0.5,
                hatch="//" if replay else None, alpha=0.85,
                label=None if label in labelled else label)
        labelled.add(label)
        if width > 0.5:
            ax.text(start + width / 2, int(e["worker"]), f"{e['file']}:{e['start']}-{e['stop']}",
                    ha="center", va="center", fontsize=6)
    for ev in events:
        style = EVENT_STYLE.get(ev["kind"])
        if style is None:
            continue
        colour, name = style
        x = float(ev["time"]) - t0
        ax.axvline(x, color=colour, linestyle="--", linewidth=1,
                   label=None if f"event: {name}" in labelled else f"event: {name}")
        labelled.add(f"event: {name}")
        ax.annotate(f"{name} {ev['node']}", (x, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                    fontsize=6, va="top", ha="right", color=colour)
    if workers:
        ax.set_yticks(workers)
        ax.set_yticklabels([f"worker {w}" for w in workers])
    _finish(ax, "shard timeline (who did which shard; requeues and stragglers marked)", "seconds since launch",
            grid="x", legend={"fontsize": 7, "loc": "lower right"})


def plot_loss(report: Mapping[str, Any], ax: Any) -> None:
    drawn = False
    for w in report.get("workers", []):
        hist = [h for h in (w.get("history") or []) if h.get("loss") is not None]
        if not hist:
            continue
        ax.plot([h["step"] for h in hist], [h["loss"] for h in hist], marker="o", markersize=3,
                label=f"worker {w['rank']} loss")
        q = [h for h in hist if h.get("query_loss") is not None]
        if q and any(h["query_loss"] != h["loss"] for h in q):
            ax.plot([h["step"] for h in q], [h["query_loss"] for h in q], linestyle=":",
                    label=f"worker {w['rank']} query loss")
        drawn = True
    if not drawn:
        _empty(ax, "no loss history")
        return
    _finish(ax, "training loss", "step", "loss", legend={"fontsize": 8})


def plot_auc(report: Mapping[str, Any], ax: Any) -> None:
    curves = False
    for w in report.get("workers", []):
        hist = [h for h in (w.get("history") or []) if isinstance(h.get("auc"), (int, float))]
        if hist:
            ax.plot([h["step"] for h in hist], [h["auc"] for h in hist], marker="o", markersize=3,
                    label=f"worker {w['rank']}")
            curves = True
    final = {k: v for k, v in report.get("final_auc", {}).items() if k.endswith("/auc") or k == "auc"}
    if curves:
        last = max((h["step"] for w in report.get("workers", []) for h in (w.get("history") or [])), default=0)
        for k, v in sorted(final.items()):
            ax.scatter([last], [v], marker="*", s=80, label=f"final {k}")
    elif final:
        names = sorted(final)
        bars = ax.bar(range(len(names)), [final[n] for n in names],
                      color=[plt.get_cmap("tab10")(i % 10) for i in range(len(names))])
        for b, n in zip(bars, names):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{final[n]:.3f}", ha="center", va="bottom",
                    fontsize=8)
        oracle = {k: v for k, v in report.get("final_auc", {}).items() if k.endswith("oracle_auc")}
        for k, v in oracle.items():
            ax.axhline(v, color="gray", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_ylim(0.4, 1.0)
    else:
        _empty(ax, "no eval metrics ([data] eval is empty?)")
        return
    _finish(ax, "eval AUC" + (" (dotted: oracle)" if not curves and report.get("final_auc") else ""),
            "step" if curves else "", "AUC", legend={"fontsize": 8} if curves else None)


_PLOTTERS = {
    "throughput.png": (plot_throughput, (8, 4)),
    "shards.png": (plot_shard_timeline, (10, 4)),
    "loss.png": (plot_loss, (8, 4)),
    "auc.png": (plot_auc, (8, 4)),
}


def make_plots(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write every plot of :data:`PLOTS` into ``out_dir``; returns their paths.

    Args:
        report: the run report dict.
        out_dir: created if missing.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PLOTS:
        fn, size = _PLOTTERS[name]
        fig = Figure(figsize=size, dpi=100)
        ax = fig.add_subplot(1, 1, 1)
        try:
            fn(report, ax)
        except Exception as exc:  # one bad plot must not cost the others (or the report)
            log.exception("plot failed", extra=kv(plot=name))
            ax.clear()
            _empty(ax, f"{name}: plot failed: {exc}"[:120])
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        paths.append(path)
    log.info("plots written", extra=kv(dir=str(out_dir), n=len(paths)))
    return paths
