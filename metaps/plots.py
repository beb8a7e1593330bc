"""PNG plots of a run (matplotlib, Agg backend: no display needed).

From ``report.json`` (see :mod:`metaps.run_report`):

* ``throughput.png``: samples/s over time, the fleet total and every worker
  (every incarnation of a restarted worker, its restarts marked), controller
  events (slow, shrink, restart, requeue, migrate, checkpoint, ...) as vertical lines;
* ``loss.png``: training loss over time, the fleet mean and every worker, same events;
* ``shards.png``: the shard timeline -- one lane per worker, a bar per shard
  completion (from the controller's ledger: start = completion - elapsed),
  coloured by dataset; duplicate/stale completions (replays after a requeue)
  hatched in red; events in a lane of their own at the top;
* ``auc.png``: eval AUC grouped by head -- curves over steps when rank 0 ran
  periodic evaluations (``[train] eval_every_steps``), else bars per kind
  (base, adapted); reference lines (oracle, final base/adapted) labelled.

Readable at 2 to 32 workers: figures grow with the worker count, legends sit
outside the axes, and optional labels (bar labels, event names, values) are
placed after layout only where they fit without overlapping other text or
leaving the figure (:func:`render` returns the laid-out figure; tests measure it).

A plot with nothing to show still renders a labelled empty figure, so every
file exists after every run.

Example::

    paths = make_plots(json.loads(Path("runs/x/report.json").read_text()), Path("runs/x/plots"))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from metaps.core.log import kv

log = logging.getLogger(__name__)

PLOTS = ("throughput.png", "shards.png", "loss.png", "auc.png")

EVENT_STYLE = {
    "slow_detected": ("tab:red", "slow"),
    "slow": ("tab:red", "slow"),
    "shrink_shards": ("tab:orange", "shrink"),
    "restart": ("tab:purple", "restart"),
    "node_down": ("black", "down"),
    "shards_requeued": ("tab:brown", "requeue"),
    "lease_expired": ("tab:brown", "lease"),
    "hang": ("tab:brown", "hang"),
    "recovered": ("tab:green", "recovered"),
    "move_vshards": ("tab:pink", "migrate"),
    "checkpoint": ("tab:olive", "checkpoint"),
    "rollback": ("tab:gray", "rollback"),
}

PostLayout = Callable[[Any], None]
"""Run after the figure is laid out, with its renderer: places the optional labels."""

_LEGEND_ROWS = 16  # legend entries per column before another column starts


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, fontsize=12, color="dimgray")
    ax.set_xticks([])
    ax.set_yticks([])


def _outside_legend(n_entries: int) -> dict[str, Any]:
    """``ax.legend`` keywords: outside the axes on the right, in as many columns as it needs."""
    return {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
            "ncols": max(1, -(-n_entries // _LEGEND_ROWS))}


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


# ---------------------------------------------------------------- label placement
def text_boxes(fig: Figure, renderer: Any) -> list[tuple[Text, Any]]:
    """Every visible, non-empty text of ``fig`` with its display-space bounding box."""
    out = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and t.get_figure(root=True) is fig:
            out.append((t, t.get_window_extent(renderer)))
    return out


def _fits(bbox: Any, fig: Figure, taken: Sequence[Any]) -> bool:
    fb = fig.bbox
    inside = bbox.x0 >= fb.x0 and bbox.y0 >= fb.y0 and bbox.x1 <= fb.x1 and bbox.y1 <= fb.y1
    return inside and not any(bbox.overlaps(o) for o in taken)


def place_labels(ax: Any, renderer: Any, candidates: Sequence[Sequence[Mapping[str, Any]]]) -> int:
    """Add each candidate label at the first of its positions where it fits; returns how many were placed.

    A label fits when its box stays inside the figure and overlaps no text already
    there (tick labels, titles, legend, labels placed before it). A label with no such
    position is left out (the legend still explains the mark it belongs to).

    Args:
        ax: the axes the labels belong to.
        renderer: the laid-out figure's renderer.
        candidates: per label, alternative ``ax.text`` keyword sets (``x``, ``y``, ``s``, ...), best first;
            a ``max_width_px`` key also rejects a position whose text is wider than that.
    """
    fig = ax.get_figure(root=True)
    taken = [b for _, b in text_boxes(fig, renderer)]
    placed = 0
    for options in candidates:
        for opt in options:
            kw = dict(opt)
            max_w = kw.pop("max_width_px", None)
            t = ax.text(**kw)
            bb = t.get_window_extent(renderer)
            if (max_w is None or bb.width <= max_w) and _fits(bb, fig, taken):
                taken.append(bb)
                placed += 1
                break
            t.remove()
    return placed


# ---------------------------------------------------------------- series over time
def _segments(w: Mapping[str, Any], key: str) -> list[list[Mapping[str, Any]]]:
    """A worker's history records with ``key``, split per incarnation (a restart breaks the line)."""
    segs: dict[int, list[Mapping[str, Any]]] = {}
    for h in w.get("history") or []:
        if isinstance(h.get(key), (int, float)) and isinstance(h.get("time"), (int, float)):
            segs.setdefault(int(h.get("incarnation") or 1), []).append(h)
    return [sorted(v, key=lambda h: float(h["time"])) for _, v in sorted(segs.items())]


def _fleet_series(report: Mapping[str, Any], key: str, t0: float, how: str) -> tuple[np.ndarray, np.ndarray]:
    """The fleet's ``key`` over time: sum (``how="sum"``) or mean (``"mean"``) of the workers active then.

    Each incarnation's records are interpolated on one time grid inside its own span only.
    """
    segs = [seg for w in report.get("workers", []) for seg in _segments(w, key) if seg]
    if not segs:
        return np.zeros(0), np.zeros(0)
    lo = min(float(s[0]["time"]) for s in segs) - t0
    hi = max(float(s[-1]["time"]) for s in segs) - t0
    grid = np.linspace(lo, hi, 200) if hi > lo else np.array([lo])
    total, count = np.zeros_like(grid), np.zeros_like(grid)
    for seg in segs:
        t = np.array([float(h["time"]) - t0 for h in seg])
        v = np.array([float(h[key]) for h in seg])
        active = (grid >= t[0]) & (grid <= t[-1])
        total += np.where(active, np.interp(grid, t, v), 0.0)
        count += active
    if how == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            return grid, np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return grid, total


def _event_lines(report: Mapping[str, Any], ax: Any, t0: float) -> list[str]:
    """Controller events as dashed vertical lines (one legend entry per kind); returns the kinds drawn."""
    drawn: list[str] = []
    for ev in report.get("controller", {}).get("events", []) or []:
        style = EVENT_STYLE.get(str(ev.get("kind")))
        if style is None:
            continue
        colour, name = style
        ax.axvline(float(ev["time"]) - t0, color=colour, linestyle="--", linewidth=0.8, alpha=0.8,
                   label=None if name in drawn else f"event: {name}")
        if name not in drawn:
            drawn.append(name)
    return drawn


def _plot_over_time(report: Mapping[str, Any], ax: Any, key: str, how: str, title: str, ylabel: str,
                    empty: str) -> None:
    t0 = _t0(report)
    workers = [w for w in report.get("workers", []) if any(_segments(w, key))]
    if not workers:
        _empty(ax, empty)
        return
    cmap = plt.get_cmap("tab20" if len(workers) > 10 else "tab10")
    entries = 0
    for i, w in enumerate(workers):
        segs = _segments(w, key)
        colour = cmap(i % cmap.N)
        for j, seg in enumerate(segs):
            ax.plot([float(h["time"]) - t0 for h in seg], [float(h[key]) for h in seg], color=colour,
                    linewidth=1.0, marker="o" if len(workers) <= 8 else None, markersize=2.5,
                    linestyle="-" if j == 0 else "--",
                    label=(f"worker {w['rank']}" + (f" ({len(segs)} incarnations)" if len(segs) > 1 else ""))
                    if j == 0 else None)
        entries += 1
    grid, fleet = _fleet_series(report, key, t0, how)
    ax.plot(grid, fleet, color="black", linewidth=2.0, label="fleet total" if how == "sum" else "fleet mean")
    entries += 1 + len(_event_lines(report, ax, t0))
    _finish(ax, title, "seconds since launch", ylabel, legend=_outside_legend(entries))


def plot_throughput(report: Mapping[str, Any], ax: Any) -> PostLayout | None:
    """Samples/s over time: fleet total (sum) and every worker incarnation; events marked."""
    _plot_over_time(report, ax, "samples_per_s", "sum", "throughput (fleet total and per worker)", "samples/s",
                    "no worker step history")
    return None


def plot_loss(report: Mapping[str, Any], ax: Any) -> PostLayout | None:
    """Training loss over time: fleet mean and every worker incarnation; events marked."""
    _plot_over_time(report, ax, "loss", "mean", "training loss (fleet mean and per worker)", "loss",
                    "no loss history")
    return None


# ---------------------------------------------------------------- shards
def _node_short(node: str) -> str:
    role, _, idx = str(node).partition(":")
    return {"worker": "w", "ps": "ps"}.get(role, role) + idx


def plot_shard_timeline(report: Mapping[str, Any], ax: Any) -> PostLayout | None:
    """One lane per worker (a bar per shard completion), events in a lane of their own on top."""
    t0 = _t0(report)
    ledger: Sequence[Mapping[str, Any]] = report.get("shards", [])
    events = [e for e in report.get("controller", {}).get("events", []) or [] if e.get("kind") in EVENT_STYLE]
    if not ledger and not events:
        _empty(ax, "no shard ledger")
        return None
    datasets = sorted({str(e["dataset"]) for e in ledger})
    colours = {d: plt.get_cmap("tab10")(i % 10) for i, d in enumerate(datasets)}
    workers = sorted({int(e["worker"]) for e in ledger} | {int(w["rank"]) for w in report.get("workers", [])})
    lane = {w: i for i, w in enumerate(workers)}
    ev_y = len(workers) + 0.3
    labelled: set[str] = set()
    bars: list[tuple[float, float, float, str]] = []
    for e in ledger:
        start = float(e["time"]) - float(e.get("elapsed_s") or 0.0) - t0
        width = max(float(e.get("elapsed_s") or 0.0), 0.05)
        replay = e["kind"] != "done" or e.get("replayed")
        label = "replayed/duplicate" if replay else str(e["dataset"])
        y = lane[int(e["worker"])]
        ax.barh(y, width, left=start, height=0.6,
                color="tab:red" if replay else colours[str(e["dataset"])], edgecolor="black", linewidth=0.5,
                hatch="//" if replay else None, alpha=0.85,
                label=None if label in labelled else label)
        labelled.add(label)
        bars.append((start, width, y, f"{e['file']}:{e['start']}-{e['stop']}"))
    marks: list[tuple[float, str, str]] = []
    for ev in events:
        colour, name = EVENT_STYLE[str(ev["kind"])]
        x = float(ev["time"]) - t0
        ax.axvline(x, color=colour, linestyle="--", linewidth=0.8, alpha=0.6,
                   label=None if f"event: {name}" in labelled else f"event: {name}")
        labelled.add(f"event: {name}")
        ax.plot([x], [ev_y], marker="v", color=colour, markersize=6)
        marks.append((x, f"{name} {_node_short(ev.get('node', ''))}", colour))
    ax.set_yticks([*range(len(workers)), ev_y])
    ax.set_yticklabels([f"worker {w}" for w in workers] + ["events"], fontsize=8 if len(workers) <= 16 else 6)
    ax.set_ylim(-0.6, ev_y + 0.9)
    _finish(ax, "shard timeline (who did which shard; requeues and stragglers marked)", "seconds since launch",
            grid="x", legend=_outside_legend(len(labelled)))
    fontsize = 6 if len(workers) <= 16 else 5

    def post(renderer: Any) -> None:
        to_px = ax.transData
        cands = []
        for start, width, y, text in bars:
            x0, _ = to_px.transform((start, y))
            x1, _ = to_px.transform((start + width, y))
            cands.append([{"x": start + width / 2, "y": y, "s": text, "ha": "center", "va": "center",
                           "fontsize": fontsize, "max_width_px": (x1 - x0) - 4}])
        place_labels(ax, renderer, cands)
        # events: staggered rows inside the events lane
        rows = (ev_y + 0.45, ev_y - 0.35, ev_y + 0.05)
        place_labels(ax, renderer, [[{"x": x, "y": r, "s": name, "ha": "left", "va": "center", "fontsize": fontsize,
                                      "color": colour} for r in rows] for x, name, colour in sorted(marks)])

    return post


# ---------------------------------------------------------------- AUC
_KIND_COLOUR = {"base": "tab:blue", "adapted": "tab:orange"}


def _auc_by_head(final: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``{"base/click/auc": .6, ...}`` -> ``{"click": {"base": .6, "oracle": .86, ...}}``."""
    out: dict[str, dict[str, float]] = {}
    for k, v in final.items():
        parts = k.split("/")
        if len(parts) != 3:
            continue
        kind, head, metric = parts
        if metric == "auc":
            out.setdefault(head, {})[kind] = float(v)
        elif metric == "oracle_auc":
            out.setdefault(head, {})["oracle"] = float(v)
    return out


def _auc_history(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    hist = list(report.get("auc_history") or [])
    if not hist:
        for w in report.get("workers", []):
            hist += [{"step": h["step"], "base/auc/auc": h["auc"]} for h in (w.get("history") or [])
                     if isinstance(h.get("auc"), (int, float)) and w.get("rank") == 0]
    return hist


def plot_auc(report: Mapping[str, Any], ax: Any) -> PostLayout | None:
    """Eval AUC grouped by head: curves over steps (periodic evaluation) or bars per kind; oracle lines labelled."""
    by_head = _auc_by_head(report.get("final_auc", {}) or {})
    hist = _auc_history(report)
    if hist:
        heads = sorted({k.split("/")[1] for h in hist for k in h if k.count("/") == 2 and k.endswith("/auc")})
        cmap = plt.get_cmap("tab10")
        entries = 0
        for i, head in enumerate(heads):
            for kind in ("base", "adapted"):
                pts = [(h["step"], h[f"{kind}/{head}/auc"]) for h in hist if f"{kind}/{head}/auc" in h]
                if pts:
                    ax.plot(*zip(*pts), color=cmap(i % 10), linestyle="-" if kind == "base" else "--", marker="o",
                            markersize=3, label=f"{head} {kind}")
                    entries += 1
            ref = by_head.get(head, {})
            oracle = ref.get("oracle") or next((h[f"base/{head}/oracle_auc"] for h in reversed(hist)
                                                if f"base/{head}/oracle_auc" in h), None)
            if oracle is not None:
                ax.axhline(oracle, color=cmap(i % 10), linestyle=":", linewidth=1.2, label=f"{head} oracle {oracle:.3f}")
                entries += 1
            for kind, style in (("base", (0, (1, 3))), ("adapted", (0, (4, 2)))):
                if kind in ref:
                    ax.axhline(ref[kind], color=cmap(i % 10), linestyle=style, linewidth=0.8, alpha=0.6,
                               label=f"{head} final {kind} {ref[kind]:.3f}")
                    entries += 1
        _finish(ax, "eval AUC by head (periodic evaluation)", "step", "AUC", legend=_outside_legend(entries))
        return None
    if not by_head:
        _empty(ax, "no eval metrics ([data] eval is empty?)")
        return None
    heads = sorted(by_head)
    kinds = [k for k in ("base", "adapted") if any(k in by_head[h] for h in heads)]
    width = 0.8 / max(len(kinds), 1)
    values: list[tuple[float, float]] = []
    labelled: set[str] = set()
    for g, head in enumerate(heads):
        for j, kind in enumerate(kinds):
            if kind not in by_head[head]:
                continue
            x = g - 0.4 + width * (j + 0.5)
            v = by_head[head][kind]
            ax.bar([x], [v], width=width * 0.9, color=_KIND_COLOUR.get(kind, "gray"),
                   label=None if kind in labelled else kind)
            labelled.add(kind)
            values.append((x, v))
        if "oracle" in by_head[head]:
            ax.hlines(by_head[head]["oracle"], g - 0.45, g + 0.45, colors="dimgray", linestyles=":", linewidth=1.5,
                      label=None if "oracle" in labelled else "oracle (true probabilities)")
            labelled.add("oracle")
    ax.set_xticks(range(len(heads)))
    ax.set_xticklabels(heads, fontsize=9)
    lo = min([v for _, v in values] + [h.get("oracle", 1.0) for h in by_head.values()] + [0.5])
    ax.set_ylim(max(0.0, lo - 0.1), 1.05)
    _finish(ax, "eval AUC by head (final evaluation)", "head", "AUC", legend=_outside_legend(len(labelled)))

    def post(renderer: Any) -> None:
        place_labels(ax, renderer, [[{"x": x, "y": v, "s": f"{v:.3f}", "ha": "center", "va": "bottom",
                                      "fontsize": 7}] for x, v in values])
        place_labels(ax, renderer, [[{"x": g + 0.45, "y": by_head[h]["oracle"], "s": f"oracle {by_head[h]['oracle']:.3f}",
                                      "ha": "right", "va": va, "fontsize": 7, "color": "dimgray"}
                                     for va in ("bottom", "top")]
                                    for g, h in enumerate(heads) if "oracle" in by_head[h]])

    return post


_PLOTTERS: dict[str, Callable[[Mapping[str, Any], Any], PostLayout | None]] = {
    "throughput.png": plot_throughput,
    "shards.png": plot_shard_timeline,
    "loss.png": plot_loss,
    "auc.png": plot_auc,
}


def figure_size(name: str, report: Mapping[str, Any]) -> tuple[float, float]:
    """Inches: wide enough for an outside legend, taller with more workers (lanes, legend rows)."""
    n = len(report.get("workers", []) or []) or len({e.get("worker") for e in report.get("shards", []) or []})
    if name == "shards.png":
        return 11.0, max(4.0, 1.6 + 0.3 * (n + 1))
    if name == "auc.png":
        return 10.0, 4.5
    return 11.0, max(4.0, 1.5 + 0.14 * min(n, _LEGEND_ROWS))


def render(name: str, report: Mapping[str, Any]) -> Figure:
    """One plot of :data:`PLOTS`, laid out, its optional labels placed; the caller saves or measures it.

    Args:
        name: a file name of :data:`PLOTS`.
        report: the run report dict.
    """
    fig = Figure(figsize=figure_size(name, report), dpi=100, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    post: PostLayout | None = None
    try:
        post = _PLOTTERS[name](report, ax)
    except Exception as exc:  # one bad plot must not cost the others (or the report)
        log.exception("plot failed", extra=kv(plot=name))
        ax.clear()
        _empty(ax, f"{name}: plot failed: {exc}"[:120])
    canvas.draw()  # lays the figure out
    fig.set_layout_engine("none")  # labels added now must not move what they were measured against
    if post is not None:
        try:
            post(canvas.get_renderer())
        except Exception:
            log.exception("plot labels failed", extra=kv(plot=name))
    return fig


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
        fig = render(name, report)
        path = out_dir / name
        fig.savefig(path)
        paths.append(path)
    log.info("plots written", extra=kv(dir=str(out_dir), n=len(paths)))
    return paths
