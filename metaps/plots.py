"""PNG plots of a run (matplotlib, Agg backend: no display needed).

From ``report.json`` (see :mod:`metaps.run_report`); every plot says, under its title,
what it is computed on:

* ``throughput.png``: samples/s over time, the fleet total and every worker (every
  incarnation of a restarted worker, its restarts marked with a triangle), controller
  events (slow, shrink, restart, requeue, migrate, checkpoint, ...) as vertical lines.
  Each incarnation's running sample count is resampled onto one time grid as a rolling
  average (window: the median gap between a worker's records, at least 1 s); the total is
  the sum of the workers alive at each time (:func:`fleet_throughput`), so sparse,
  staggered records do not make it jump. A worker the controller flagged slow
  (``slow_detected``) is drawn thick and labelled ``slow``;
* ``loss.png``: training loss per head (``loss/<head>``, each head's share) and in total,
  every worker's records pooled in time order: raw points faint, TensorBoard's smoothing
  over them (a debiased EMA, weight 0.6: :func:`tb_smooth`); events marked;
* ``shards.png``: the shard timeline -- one lane per worker, a bar per shard
  completion (from the controller's ledger: start = completion - elapsed),
  coloured by dataset; duplicate/stale completions (replays after a requeue)
  hatched in red; events in a lane of their own at the top;
* ``auc.png``: eval AUC grouped by head -- curves over steps when the leader ran
  periodic evaluations (``[train] eval_every_steps``, on the first ``[train]
  eval_max_rows`` rows of ``[data] eval``), else bars per kind (base, adapted) of the
  final evaluation (every held-out row); reference lines (oracle, final base/adapted)
  labelled; the subtitle names both samples and how far the curve's last point is from
  the final figure;
* ``summary.png``: one figure to paste in a chat -- throughput (workers + total), loss
  per head smoothed, final AUC per head (base vs adapted), and the run in numbers
  (status, coverage, steps, samples, wall, slow and restarted workers, faults injected).

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
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import matplotlib

matplotlib.use("Agg")
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from common.log import kv

log = logging.getLogger(__name__)

PLOTS = ("throughput.png", "shards.png", "loss.png", "auc.png", "summary.png")

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


# ---------------------------------------------------------------- titles
def _titles(ax: Any, title: str, sub: Sequence[str] = (), fontsize: float = 8.0, width: int = 120) -> None:
    """``title`` on top, and under it ``sub`` (what the plot is computed on), wrapped to ``width`` characters.

    The subtitle is an annotation just above the axes (laid out with them); the title is
    lifted above it.
    """
    lines = [w for s in sub if s for w in textwrap.wrap(s, width)]
    if not lines:
        ax.set_title(title)
        return
    ax.annotate("\n".join(lines), xy=(0.5, 1.0), xycoords="axes fraction", xytext=(0, 4),
                textcoords="offset points", ha="center", va="bottom", fontsize=fontsize, color="dimgray")
    ax.set_title(title, pad=4 + len(lines) * fontsize * 1.25 + 6)


# ---------------------------------------------------------------- series over time
def _segments(w: Mapping[str, Any], key: str) -> list[list[Mapping[str, Any]]]:
    """A worker's history records with ``key``, split per incarnation (a restart breaks the line)."""
    segs: dict[int, list[Mapping[str, Any]]] = {}
    for h in w.get("history") or []:
        if isinstance(h.get(key), (int, float)) and isinstance(h.get("time"), (int, float)):
            segs.setdefault(int(h.get("incarnation") or 1), []).append(h)
    return [sorted(v, key=lambda h: float(h["time"])) for _, v in sorted(segs.items())]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v))


def slow_workers(report: Mapping[str, Any]) -> dict[int, float]:
    """rank -> when (unix time) the controller first flagged it slow (``slow_detected`` on ``worker:R``)."""
    out: dict[int, float] = {}
    for ev in report.get("controller", {}).get("events", []) or []:
        role, _, idx = str(ev.get("node", "")).partition(":")
        if ev.get("kind") in ("slow_detected", "slow") and role == "worker" and idx.isdigit():
            out.setdefault(int(idx), float(ev.get("time") or 0.0))
    return out


class Segment:
    """One incarnation's throughput: its cumulative sample count over time, and on the common grid."""

    def __init__(self, rank: int, incarnation: int, t: np.ndarray, cum: np.ndarray) -> None:
        self.rank, self.incarnation = rank, incarnation
        self.t, self.cum = t, cum  # seconds since launch, samples done by then (non-decreasing)
        self.rate = np.zeros(0)  # samples/s on the grid, NaN where this incarnation was not alive

    @property
    def span(self) -> tuple[float, float]:
        return float(self.t[0]), float(self.t[-1])


def _cumulative(w: Mapping[str, Any], seg: Sequence[Mapping[str, Any]], t0: float) -> tuple[np.ndarray, np.ndarray]:
    """(times, cumulative samples) of one incarnation's records.

    The records' ``samples`` (the incarnation's running sample count) when every record has
    it; else the integral of their ``samples_per_s`` (trapezoids; a lone record's rate held
    over its incarnation's known span). The incarnation's ``train_start`` (0 samples) and
    ``train_end`` (its final ``samples``) from the report's ``incarnations`` extend the span
    to the whole time it trained.
    """
    inc = int(seg[0].get("incarnation") or 1)
    info: Mapping[str, Any] = next((i for i in w.get("incarnations") or [] if int(i.get("incarnation") or 0) == inc), {})
    t = np.array([float(h["time"]) - t0 for h in seg])
    start = float(info["train_start"]) - t0 if _finite(info.get("train_start")) and info["train_start"] else float("nan")
    end = float(info["train_end"]) - t0 if _finite(info.get("train_end")) and info["train_end"] else float("nan")
    if all(_finite(h.get("samples")) for h in seg):
        cum = np.maximum.accumulate(np.array([float(h["samples"]) for h in seg]))
        if np.isfinite(start) and start < t[0]:
            t, cum = np.concatenate([[start], t]), np.concatenate([[0.0], cum])
        total = info.get("samples")
        if np.isfinite(end) and end > t[-1] and isinstance(total, (int, float)) and float(total) >= cum[-1]:
            t, cum = np.concatenate([t, [end]]), np.concatenate([cum, [float(total)]])
        return t, cum
    rate = np.array([float(h["samples_per_s"]) for h in seg])
    if np.isfinite(start) and start < t[0]:
        t, rate = np.concatenate([[start], t]), np.concatenate([[rate[0]], rate])
    if np.isfinite(end) and end > t[-1]:
        t, rate = np.concatenate([t, [end]]), np.concatenate([rate, [rate[-1]]])
    cum = np.concatenate([[0.0], np.cumsum(np.diff(t) * (rate[1:] + rate[:-1]) / 2.0)])
    return t, cum


class Throughput:
    """The fleet's samples/s on one time grid (see :func:`fleet_throughput`)."""

    def __init__(self, grid: np.ndarray, total: np.ndarray, segments: list[Segment], window_s: float) -> None:
        self.grid, self.total, self.segments, self.window_s = grid, total, segments, window_s


def fleet_throughput(report: Mapping[str, Any]) -> Throughput:
    """Every worker incarnation's samples/s resampled onto one time grid, and their sum.

    Each incarnation's cumulative sample count (:func:`_cumulative`) is interpolated
    linearly between its records; its rate at a grid time ``g`` is the samples it did in
    the window ``[g - W/2, g + W/2]`` (cut to the time it was alive) over that window's
    length -- a rolling average. An incarnation contributes only while alive (its
    first to last known time); elsewhere its rate is NaN. The fleet total at ``g`` is
    the sum over the incarnations alive at ``g``: sparse, staggered records do not make
    it jump (each worker's rate is defined everywhere it is alive, not only at its records).

    ``W`` (``window_s``) is the median gap between a worker's records, at least 1 s; the
    grid step is ``W / 5`` (at most 2,000 points). An incarnation with a single record and
    no known span holds that record's rate over one window around it.
    """
    t0 = _t0(report)
    segs: list[Segment] = []
    gaps: list[np.ndarray] = []
    lone: list[tuple[int, int, float, float]] = []  # one record, no known span: (rank, incarnation, time, rate)
    for w in report.get("workers", []) or []:
        for seg in _segments(w, "samples_per_s"):
            gaps.append(np.diff([float(h["time"]) for h in seg]))
            t, cum = _cumulative(w, seg, t0)
            rank, inc = int(w.get("rank", 0)), int(seg[0].get("incarnation") or 1)
            if t[-1] > t[0]:
                segs.append(Segment(rank, inc, t, cum))
            else:
                lone.append((rank, inc, float(t[0]), float(seg[-1]["samples_per_s"])))
    all_gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    all_gaps = all_gaps[all_gaps > 0]
    window = max(1.0, float(np.median(all_gaps))) if all_gaps.size else 1.0
    for rank, inc, t1, rate in lone:  # its rate held over one window around it
        segs.append(Segment(rank, inc, np.array([t1 - window / 2, t1 + window / 2]), np.array([0.0, rate * window])))
    if not segs:
        return Throughput(np.zeros(0), np.zeros(0), [], window)
    lo, hi = min(s.span[0] for s in segs), max(s.span[1] for s in segs)
    n = int(min(2000, max(2, np.ceil((hi - lo) / (window / 5.0)) + 1)))
    grid = np.linspace(lo, hi, n)
    total = np.zeros_like(grid)
    alive_any = np.zeros(grid.shape, dtype=bool)
    for s in segs:
        a, b = s.span
        left, right = np.clip(grid - window / 2, a, b), np.clip(grid + window / 2, a, b)
        alive = (grid >= a) & (grid <= b)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = (np.interp(right, s.t, s.cum) - np.interp(left, s.t, s.cum)) / (right - left)
        s.rate = np.where(alive, rate, np.nan)
        total += np.where(alive, rate, 0.0)
        alive_any |= alive
    return Throughput(grid, np.where(alive_any, total, np.nan), segs, window)


TB_SMOOTHING = 0.6
"""TensorBoard's default scalar smoothing weight."""


def tb_smooth(values: Sequence[float] | np.ndarray, weight: float = TB_SMOOTHING) -> np.ndarray:
    """TensorBoard's scalar smoothing: a debiased exponential moving average.

    As TensorBoard's line chart computes it: ``last = last * w + (1 - w) * v`` over the
    finite values in order (``last`` starts at 0), each smoothed value ``last / (1 - w**n)``
    with ``n`` the finite values so far (the debias: early values are not pulled to 0);
    non-finite values pass through unsmoothed, and a constant series is returned as it is.

    Args:
        values: the raw series, in step (here: time) order.
        weight: the smoothing weight ``w`` in [0, 1); 0 returns the raw series.
    """
    v = np.asarray(values, dtype=float)
    out = v.copy()
    if v.size == 0 or bool(np.all(v == v[0])):
        return out
    last, n = 0.0, 0
    for i in np.flatnonzero(np.isfinite(v)):  # a recurrence: each value needs the one before (reports are small)
        last = last * weight + (1.0 - weight) * float(v[i])
        n += 1
        out[i] = last / (1.0 - weight ** n) if weight != 1.0 else last
    return out


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


def _faults_text(report: Mapping[str, Any]) -> str:
    """The faults that fired, with when (``report["faults"]["fired"]``, recorded by the injectors;
    never the job's ``[faults]``, which may schedule what never happened): :func:`metaps.run_report.faults_text`."""
    from metaps.run_report import faults_text

    return faults_text(report)


def _fault_spans(report: Mapping[str, Any], ax: Any, t0: float) -> int:
    """Each fired slow/latency fault as a shaded span over the seconds it applied; returns legend entries."""
    n = 0
    for rec in (report.get("faults") or {}).get("fired") or []:
        a, b = rec.get("first_time"), rec.get("last_time")
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            continue
        if rec.get("kind") == "kill":
            ax.axvline(float(a) - t0, color="black", linewidth=1.5, label=f"fault fired: {rec.get('what')}")
        else:
            ax.axvspan(float(a) - t0, max(float(b), float(a) + 0.1) - t0, color="tab:red", alpha=0.08,
                       label=f"fault fired: {rec.get('what')}")
        n += 1
    return n


def plot_throughput(report: Mapping[str, Any], ax: Any, compact: bool = False) -> PostLayout | None:
    """Samples/s over time: every worker incarnation resampled (:func:`fleet_throughput`) and
    their sum; workers the controller flagged slow drawn thick and labelled, restarts marked.

    Args:
        report: the run report.
        ax: the axes to draw on.
        compact: a panel of ``summary.png``: workers not flagged or restarted share one legend entry.
    """
    tp = fleet_throughput(report)
    if not tp.segments:
        _empty(ax, "no worker step history")
        return None
    t0 = _t0(report)
    slow = slow_workers(report)
    ranks = sorted({s.rank for s in tp.segments})
    n_incs = {r: sum(1 for s in tp.segments if s.rank == r) for r in ranks}
    cmap = colormaps.get_cmap("tab20" if len(ranks) > 10 else "tab10")
    colour: Any
    entries, restart_labelled, plain_labelled = 0, False, False
    ends: list[tuple[float, float, str, Any]] = []
    for i, r in enumerate(ranks):
        colour = cmap(i % cmap.N)
        notes = ([f"{n_incs[r]} incarnations"] if n_incs[r] > 1 else []) + (["slow"] if r in slow else [])
        label: str | None = f"worker {r}" + (f" ({', '.join(notes)})" if notes else "")
        if compact and not notes and len(ranks) > 6:
            label = None if plain_labelled else "workers (one line each)"
            plain_labelled = True
            colour = "tab:gray"
        segs = [s for s in tp.segments if s.rank == r]
        for j, s in enumerate(segs):
            ax.plot(tp.grid, s.rate, color=colour, linewidth=2.4 if r in slow else 1.0,
                    linestyle="-" if j == 0 else "--", label=label if j == 0 else None)
            if j > 0:
                k = int(np.nanargmax(np.isfinite(s.rate)))
                ax.plot([tp.grid[k]], [s.rate[k]], marker="^", markersize=7, color=colour, linestyle="none",
                        markeredgecolor="black", label=None if restart_labelled else "restart (new incarnation)")
                entries += 0 if restart_labelled else 1
                restart_labelled = True
        if label is not None:
            entries += 1
        if r in slow:
            last = segs[-1]
            k = int(np.flatnonzero(np.isfinite(last.rate))[-1])
            ends.append((float(tp.grid[k]), float(last.rate[k]), f"w{r} slow", colour))
    ax.plot(tp.grid, tp.total, color="black", linewidth=2.0, label="fleet total")
    entries += 1 + len(_event_lines(report, ax, t0)) + _fault_spans(report, ax, t0)
    from metaps.run_report import controller_text

    sub = [f"each worker: samples done per second (from its running sample count), rolling {tp.window_s:.1f} s "
           f"window; fleet total = sum over the workers alive at each time", _faults_text(report),
           controller_text(report) if (report.get("faults") or {}).get("fired") or slow else ""]
    _finish(ax, "", "seconds since launch", "samples/s", legend=_outside_legend(entries))
    _titles(ax, "throughput (fleet total and per worker)", sub, fontsize=7 if compact else 8, width=70 if compact else 120)

    def post(renderer: Any) -> None:
        place_labels(ax, renderer, [[{"x": x, "y": y, "s": s, "ha": ha, "va": "bottom", "fontsize": 7,
                                      "color": c, "fontweight": "bold"} for ha in ("right", "left")]
                                    for x, y, s, c in ends])

    return post


def loss_series(report: Mapping[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``loss`` and every ``loss/<head>``: (seconds since launch, value) of every worker's
    records pooled and in time order (the fleet's loss as the steps happened)."""
    t0 = _t0(report)
    keys = sorted({k for w in report.get("workers", []) or [] for h in w.get("history") or [] for k in h
                   if k.startswith("loss/")})
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key in ["loss", *keys]:
        pts = [(float(h["time"]) - t0, float(h[key])) for w in report.get("workers", []) or []
               for h in w.get("history") or [] if _finite(h.get(key)) and _finite(h.get("time"))]
        if pts:
            arr = np.array(sorted(pts))
            out[key] = (arr[:, 0], arr[:, 1])
    return out


def plot_loss(report: Mapping[str, Any], ax: Any, compact: bool = False) -> PostLayout | None:
    """Training loss per head over time: every worker's records pooled in time order, raw
    points faint, TensorBoard's smoothing (:func:`tb_smooth`) drawn over them; events marked."""
    series = loss_series(report)
    if not series:
        _empty(ax, "no loss history")
        return None
    t0 = _t0(report)
    cmap = colormaps.get_cmap("tab10")
    entries = 0
    for i, (key, (t, v)) in enumerate(series.items()):
        colour = "black" if key == "loss" else cmap((i - 1) % 10)
        name = "all heads (loss)" if key == "loss" else key.split("/", 1)[1]
        ax.plot(t, v, linestyle="none", marker=".", markersize=4, color=colour, alpha=0.3,
                label="raw records (faint)" if entries == 0 else None)
        ax.plot(t, tb_smooth(v), color=colour, linewidth=1.8, label=f"{name}, smoothed")
        entries += 2 if entries == 0 else 1
    entries += len(_event_lines(report, ax, t0))
    n_workers = len([w for w in report.get("workers", []) or [] if w.get("history")])
    sub = [f"every logged step of all {n_workers} workers in time order; lines: TensorBoard's smoothing "
           f"(debiased EMA, weight {TB_SMOOTHING}); a head's loss is its share of the total"]
    _finish(ax, "", "seconds since launch", "loss", legend=_outside_legend(entries))
    _titles(ax, "training loss per head (all workers, smoothed)", sub, fontsize=7 if compact else 8,
            width=70 if compact else 120)
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
    colours = {d: colormaps.get_cmap("tab10")(i % 10) for i, d in enumerate(datasets)}
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


def final_eval_rows(report: Mapping[str, Any]) -> int | None:
    """Held-out rows the final evaluation scored (``final_metrics.<kind>.<head>.rows``; None: not recorded)."""
    rows = [int(m["rows"]) for heads in (report.get("final_metrics") or {}).values() if isinstance(heads, Mapping)
            for m in heads.values() if isinstance(m, Mapping) and _finite(m.get("rows"))]
    return max(rows) if rows else None


def eval_sources(report: Mapping[str, Any]) -> tuple[str, str]:
    """(periodic, final): what each evaluation is computed on, one phrase each.

    The periodic evaluation's sample is the leading batches of ``[data] eval`` holding at
    most ``[train] eval_max_rows`` rows (``workers.evaluation.bounded_batches``), scored by
    the checkpoint leader every ``[train] eval_every_steps``; the report does not record
    its row count (unless its points carry ``rows``), so the bound is read from the job
    config in the report.
    """
    train = (report.get("config") or {}).get("train") or {}
    cap, every = train.get("eval_max_rows"), train.get("eval_every_steps")
    who = next((f"worker {w.get('rank')}" for w in report.get("workers", []) or [] if w.get("eval_history")),
               "the leader (rank 0)")
    scored = next((h["rows"] for h in reversed(report.get("auc_history") or []) if _finite(h.get("rows"))), None)
    sample = (f"the first {int(scored):,} rows of [data] eval" if isinstance(scored, (int, float))
              else f"the first ≤ {int(cap):,} rows of [data] eval" if isinstance(cap, (int, float))
              else "a bounded sample of [data] eval")
    periodic = f"periodic eval (curves): {who} on {sample}" + (f", every {int(every)} steps" if _finite(every) and every else "")
    rows = final_eval_rows(report)
    data = (report.get("config") or {}).get("data") or {}
    from metaps.run_report import shown_path

    where = f" of {shown_path(str(data['eval']))}" if data.get("eval") else ""
    meta = train.get("mode") == "meta"
    final = ("final eval: " + (f"all {rows:,} held-out {'query ' if meta else ''}rows" if rows else "every held-out row")
             + where + (" (episodes)" if meta else "") + ", after the last step")
    return periodic, final


def _auc_curves(report: Mapping[str, Any], ax: Any, hist: Sequence[Mapping[str, Any]],
                by_head: Mapping[str, Mapping[str, float]]) -> None:
    heads = sorted({k.split("/")[1] for h in hist for k in h if k.count("/") == 2 and k.endswith("/auc")})
    cmap = colormaps.get_cmap("tab10")
    entries = 0
    gaps: list[str] = []
    last_step = 0
    for i, head in enumerate(heads):
        for kind in ("base", "adapted"):
            pts = [(h["step"], h[f"{kind}/{head}/auc"]) for h in hist if f"{kind}/{head}/auc" in h]
            if pts:
                ax.plot(*zip(*pts), color=cmap(i % 10), linestyle="-" if kind == "base" else "--", marker="o",
                        markersize=3, label=f"{head} {kind}")
                entries += 1
                if kind in by_head.get(head, {}):
                    gaps.append(f"{head} {kind} {pts[-1][1]:.3f} vs {by_head[head][kind]:.3f}")
                    last_step = max(last_step, int(pts[-1][0]))
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
    periodic, final = eval_sources(report)
    sub = [periodic, final.replace("final eval:", "final eval (thin lines):")]
    if gaps:
        sub.append(f"the curves' last point (step {last_step}) vs final, other rows: " + "; ".join(gaps[:4]))
    _finish(ax, "", "step", "AUC", legend=_outside_legend(entries))
    _titles(ax, "eval AUC by head (periodic evaluation)", sub)


def _auc_bars(report: Mapping[str, Any], ax: Any, by_head: Mapping[str, Mapping[str, float]],
              compact: bool = False) -> PostLayout | None:
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
    _finish(ax, "", "head", "AUC", legend=_outside_legend(len(labelled)))
    sub = [eval_sources(report)[1] + "; base: no adaptation, adapted: after the support-set inner loop"]
    _titles(ax, "eval AUC by head (final evaluation)", sub, fontsize=7 if compact else 8, width=70 if compact else 120)

    def post(renderer: Any) -> None:
        place_labels(ax, renderer, [[{"x": x, "y": v, "s": f"{v:.3f}", "ha": "center", "va": "bottom",
                                      "fontsize": 7}] for x, v in values])
        place_labels(ax, renderer, [[{"x": g + 0.45, "y": by_head[h]["oracle"], "s": f"oracle {by_head[h]['oracle']:.3f}",
                                      "ha": "right", "va": va, "fontsize": 7, "color": "dimgray"}
                                     for va in ("bottom", "top")]
                                    for g, h in enumerate(heads) if "oracle" in by_head[h]])

    return post


def plot_auc(report: Mapping[str, Any], ax: Any, final_only: bool = False) -> PostLayout | None:
    """Eval AUC grouped by head: curves over steps (periodic evaluation) or bars per kind; the
    subtitle says which rows each evaluation scored; oracle and final lines labelled.

    Args:
        report: the run report.
        ax: the axes to draw on.
        final_only: bars of the final evaluation even when periodic curves exist (``summary.png``).
    """
    by_head = _auc_by_head(report.get("final_auc", {}) or {})
    hist = _auc_history(report)
    if hist and not final_only:
        _auc_curves(report, ax, hist, by_head)
        return None
    if not by_head:
        _empty(ax, "no eval metrics ([data] eval is empty?)")
        return None
    return _auc_bars(report, ax, by_head, compact=final_only)


# ---------------------------------------------------------------- summary
def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """The text panel of ``summary.png``: status, coverage, steps, samples, wall, slow and restarted workers."""
    from metaps.run_report import steps_text

    t0 = _t0(report)
    totals = report.get("totals") or {}
    workers = report.get("workers") or []
    wall = report.get("wall_s")
    status = f"run {report.get('name') or ''} {report.get('status', '?')}".replace("  ", " ")
    lines = [status + (f": {report['reason']}" if report.get("reason") else "")
             + (f"  (wall {float(wall):.1f} s)" if isinstance(wall, (int, float)) else ""),
             f"coverage: {report.get('coverage_summary') or '-'}",
             steps_text(report),
             f"samples: {int(totals.get('samples') or 0):,} by {len(workers)} workers"
             + (f" ({float(totals['samples_per_s']):,.0f} samples/s, each worker's samples/wall summed)"
                if _finite(totals.get("samples_per_s")) else "")]
    slow = slow_workers(report)
    names = [f"worker {r} at {t - t0:.1f} s" for r, t in sorted(slow.items())]
    lines.append("slow (flagged by the controller): " + (", ".join(names[:6]) + (f" +{len(names) - 6} more"
                                                                                  if len(names) > 6 else "")
                                                          if names else "none"))
    restarted = [f"worker {w.get('rank')} x{len(w.get('incarnations') or [])}" for w in workers
                 if len(w.get("incarnations") or []) > 1]
    lines.append("restarted: " + (", ".join(restarted[:6]) + (f" +{len(restarted) - 6} more" if len(restarted) > 6
                                                               else "") if restarted else "none"))
    from metaps.run_report import controller_text, workers_text

    for extra in (_faults_text(report), controller_text(report), workers_text(report)):
        if extra:
            lines.append(extra)
    by_head = _auc_by_head(report.get("final_auc", {}) or {})
    for head, ref in sorted(by_head.items()):
        lines.append(f"AUC {head}: " + ", ".join(f"{k} {ref[k]:.3f}" for k in ("base", "adapted", "oracle") if k in ref))
    if by_head:
        lines.append(eval_sources(report)[1])
    return [w for line in lines for w in textwrap.wrap(line, 72, subsequent_indent="    ")]


def plot_summary(report: Mapping[str, Any], fig: Figure) -> PostLayout | None:
    """One figure to paste in a chat: throughput, loss per head, final AUC per head, and the run in numbers."""
    axes = fig.subplots(2, 2)
    posts = []
    for ax, draw in ((axes[0, 0], lambda a: plot_throughput(report, a, compact=True)),
                     (axes[0, 1], lambda a: plot_loss(report, a, compact=True)),
                     (axes[1, 0], lambda a: plot_auc(report, a, final_only=True))):
        try:
            posts.append(draw(ax))
        except Exception as exc:  # one bad panel must not cost the others
            log.exception("summary panel failed", extra=kv(plot="summary.png"))
            ax.clear()
            _empty(ax, f"panel failed: {exc}"[:80])
    text_ax = axes[1, 1]
    text_ax.axis("off")
    text_ax.set_title("the run in numbers")
    text_ax.text(0.0, 1.0, "\n".join(summary_lines(report)), transform=text_ax.transAxes, ha="left", va="top",
                 fontsize=8, family="monospace")
    fig.suptitle(f"run summary: {report.get('name') or report.get('run_dir') or ''}".rstrip(": "), fontsize=12)

    def post(renderer: Any) -> None:
        for p in posts:
            if p is not None:
                p(renderer)

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
    if name == "summary.png":
        return 15.0, 9.0
    return 11.0, max(4.0, 1.5 + 0.14 * min(n, _LEGEND_ROWS))


def render(name: str, report: Mapping[str, Any]) -> Figure:
    """One plot of :data:`PLOTS`, laid out, its optional labels placed; the caller saves or measures it.

    Args:
        name: a file name of :data:`PLOTS`.
        report: the run report dict.
    """
    fig = Figure(figsize=figure_size(name, report), dpi=100, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    post: PostLayout | None = None
    try:
        if name == "summary.png":
            post = plot_summary(report, fig)
        else:
            post = _PLOTTERS[name](report, fig.add_subplot(1, 1, 1))
    except Exception as exc:  # one bad plot must not cost the others (or the report)
        log.exception("plot failed", extra=kv(plot=name))
        fig.clear()
        _empty(fig.add_subplot(1, 1, 1), f"{name}: plot failed: {exc}"[:120])
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
