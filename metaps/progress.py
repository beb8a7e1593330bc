"""The launcher's live view of a run: controller status + what the workers publish while they train.

Sources, all produced by the fleet:

* ``ControllerClient.status()``: shards done/total per dataset, nodes (step,
  slow flag, restarts, RSS), events (stragglers, requeues, restarts);
* each worker's live state, read by :class:`LiveWorkers` from

  - its incarnation snapshots ``<run>/workers/worker-R.inc-N.json`` (rewritten
    every ``[train] tb_every_steps`` steps, ``last`` = the newest step's figures;
    ``workers/telemetry.py``): steps and samples summed over every incarnation of
    the rank, so a restarted worker keeps its history;
  - its ``/metrics`` endpoint when the launcher knows its port (``metaps_worker_step``,
    ``..._samples_total``, ``..._loss``): the current step, between two snapshots;

* as a fallback only (a rank with neither yet), its structured ``msg="step"`` log
  lines, tailed from ``<run>/logs/worker-R.log`` by :class:`StepLogTail`, which also
  give a per-worker history when a worker dies before writing any report.

:func:`render` turns them into rich tables; :class:`ProgressDisplay` shows them
live on a terminal, or logs a one-line summary every few seconds otherwise.

One command's own work toward a known total (``predict``'s rows) is drawn by
:class:`TaskProgress`; a library that reports stages through a hook
``(stage, done, total)`` (``meta_io.build.pipeline.build``: pass 1 and pass 2;
``delivery.job.deliver_once``: verify, export, dense, gate, publish) is drawn by
:class:`StageProgress`, one :class:`TaskProgress` per stage in turn, each with a
final log line when it reaches its total (a short stage still leaves one line).

Percent and time left come from the controller's own accounting, never from the
shard counts (shards split at an epoch's tail, so their total grows during a run):
``status["coverage"]`` counts the batches of every requested epoch of every dataset
(``total_batches`` is fixed at the start) and those done so far. :class:`JobEta` turns
successive readings into a rate over a sliding window and a time left; the live view
draws them with rich's progress bar, the log line carries the same figures
(``done``, ``pct``, ``batches_per_s``, ``eta_s``).

Example::

    live = LiveWorkers(run_dir, ports={0: 9101})
    tail = StepLogTail({0: run_dir / "logs" / "worker-0.log"})
    display = ProgressDisplay(Console(), live=True)
    while running:
        live.poll(); tail.poll()
        display.update(ctl.status(), live.latest(fallback=tail.latest()), elapsed_s)
    display.close()
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

from common.eta import EtaReading, JobEta, duration_text
from common.log import kv

log = logging.getLogger(__name__)

_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_UNESCAPE = {"n": "\n", "t": "\t"}
_TS = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})")


def parse_kv_line(line: str) -> dict[str, Any] | None:
    """The fields of one ``common.log`` line (``msg`` unquoted; numbers as float); None if not one.
    A JSON line (``[log] format = "json"``) reads the same: ``message`` as ``msg``, ``time`` as
    a timestamp.

    Example::

        parse_kv_line('2026-01-01T00:00:00 INFO workers.worker msg="step" rank=0 step=5 loss=0.69')
        # {'time': 1767225600.0, 'msg': 'step', 'rank': 0.0, 'step': 5.0, 'loss': 0.69}
    """
    if line.startswith("{"):
        return _parse_json_line(line)
    m = _TS.match(line)
    if not m:
        return None
    out: dict[str, Any] = {"time": datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").timestamp()}
    for k, v in _KV.findall(line):
        if v.startswith('"'):  # quoted by common.log.quote_value: undo its escapes
            out[k] = re.sub(r"\\(.)", lambda e: _UNESCAPE.get(e.group(1), e.group(1)), v[1:-1])
            continue
        try:
            out[k] = float(v)
        except ValueError:
            out[k] = v
    return out


def _parse_json_line(line: str) -> dict[str, Any] | None:
    """:func:`parse_kv_line` of a :class:`common.log.JsonFormatter` line (None if not one)."""
    try:
        rec = json.loads(line)
        when = datetime.fromisoformat(str(rec.pop("time")).replace("Z", "+00:00")).timestamp()
        msg = rec.pop("message")
    except (ValueError, KeyError, AttributeError, TypeError):
        return None
    out: dict[str, Any] = {"time": when, "msg": msg}
    for k, v in rec.items():
        if k in ("level", "logger"):
            continue
        try:  # as the key=value parser reads them: every number a float
            out[k] = float(v) if not isinstance(v, bool) and v is not None else v
        except (TypeError, ValueError):
            out[k] = v
    return out


class StepLogTail:
    """Follows workers' log files and keeps their ``step`` records.

    Args:
        paths: worker rank -> its log file (may not exist yet).
    """

    def __init__(self, paths: Mapping[int, Path]) -> None:
        self.paths = dict(paths)
        self._offsets = {r: 0 for r in self.paths}
        self._partial = {r: "" for r in self.paths}
        self.history: dict[int, list[dict[str, Any]]] = {r: [] for r in self.paths}

    def poll(self) -> None:
        """Read whatever the files gained since the last call."""
        for rank, path in self.paths.items():
            try:
                with path.open("rb") as fh:
                    fh.seek(self._offsets[rank])
                    data = fh.read()
            except OSError:
                continue
            self._offsets[rank] += len(data)
            text = self._partial[rank] + data.decode(errors="replace")
            lines = text.split("\n")
            self._partial[rank] = lines.pop()
            for line in lines:
                if 'msg="step"' not in line and '"message": "step"' not in line:
                    continue
                rec = parse_kv_line(line)
                if rec is None or "step" not in rec:
                    continue
                self.history[rank].append({
                    "step": int(rec["step"]), "time": rec["time"],
                    "loss": float(rec.get("loss", float("nan"))),
                    "samples_per_s": float(rec.get("samples_per_s", float("nan"))),
                })

    def latest(self) -> dict[int, dict[str, Any]]:
        """rank -> its newest step record (ranks without one are left out)."""
        return {r: h[-1] for r, h in self.history.items() if h}

    def max_step(self) -> int:
        return max((int(h[-1]["step"]) for h in self.history.values() if h), default=0)


_INC_FILE = re.compile(r"^worker-(\d+)\.inc-(\d+)\.json$")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


class LiveWorkers:
    """Each worker's live state from its incarnation snapshots and (when known) its ``/metrics``.

    A rank's record (:meth:`latest`): ``step`` (the step number reached), ``samples``
    (summed over its incarnations), ``incarnations``, ``loss``, ``samples_per_s``,
    ``time`` and ``source`` (``snapshot`` or ``metrics``).

    Args:
        run_dir: the run directory (``workers/`` under it).
        ports: rank -> its ``/metrics`` port (None or missing: snapshots only).
        scrape_timeout_s: per scrape; an endpoint that does not answer leaves the snapshot figures.
    """

    def __init__(self, run_dir: Path, ports: Mapping[int, int | None] | None = None,
                 scrape_timeout_s: float = 1.0) -> None:
        self.workers_dir = Path(run_dir) / "workers"
        self.ports: dict[int, int | None] = dict(ports or {})
        self.scrape_timeout_s = scrape_timeout_s
        self._files: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}
        self._scraped: dict[int, tuple[int, float, float]] = {}  # rank -> (incarnation, samples, time)
        self._latest: dict[int, dict[str, Any]] = {}

    def _snapshots(self) -> dict[int, list[dict[str, Any]]]:
        """rank -> its incarnation reports in order (unchanged files are not re-read)."""
        out: dict[int, dict[int, dict[str, Any]]] = {}
        seen: set[Path] = set()
        for p in self.workers_dir.glob("worker-*.inc-*.json"):
            m = _INC_FILE.match(p.name)
            if not m:
                continue
            try:
                st = p.stat()
                key = (st.st_mtime_ns, st.st_size)
                cached = self._files.get(p)
                if cached is None or cached[0] != key:
                    cached = (key, json.loads(p.read_text()))
                    self._files[p] = cached
            except (OSError, ValueError) as exc:  # replaced between stat and read: next poll
                log.debug("worker snapshot unreadable", extra=kv(path=str(p), error=str(exc)[:200]))
                continue
            seen.add(p)
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = cached[1]
        for gone in set(self._files) - seen:
            del self._files[gone]
        return {r: [incs[i] for i in sorted(incs)] for r, incs in out.items()}

    def _scrape(self, rank: int, port: int) -> dict[str, float]:
        """``metaps_worker_*`` samples of ``rank`` at ``/metrics`` (name or name{head,kind} -> value)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=self.scrape_timeout_s) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("metaps_worker_"):
                continue
            for smp in fam.samples:
                if smp.labels.get("rank") != str(rank):
                    continue
                name = smp.name
                if "head" in smp.labels:
                    name += f"{{{smp.labels['head']},{smp.labels.get('kind', '')}}}"
                out[name] = float(smp.value)
        return out

    def poll(self) -> None:
        """Re-read the snapshots that changed and scrape the known endpoints."""
        latest: dict[int, dict[str, Any]] = {}
        for rank, incs in self._snapshots().items():
            cur = incs[-1]
            # loss and rate from the newest incarnation that has stepped (a fresh restart has not yet)
            src = next((r for r in reversed(incs) if r.get("last") or r.get("history")), cur)
            last = src.get("last") or {}
            hist = src.get("history") or []
            rec: dict[str, Any] = {
                "step": max(int(_num(r.get("steps")) or 0) for r in incs),
                "samples": sum(int(_num(r.get("samples")) or 0) for r in incs),
                "incarnations": len(incs),
                "time": _num(cur.get("time")),
                "source": "snapshot",
            }
            for key in ("loss", "samples_per_s"):
                v = _num(last.get(key)) if key in last else (_num(hist[-1].get(key)) if hist else None)
                if v is not None:
                    rec[key] = v
            port = self.ports.get(rank)
            if port:
                self._merge_metrics(rank, port, incs, rec)
            latest[rank] = rec
        self._latest = latest

    def _merge_metrics(self, rank: int, port: int, incs: list[dict[str, Any]], rec: dict[str, Any]) -> None:
        """Newer figures from the running incarnation's ``/metrics`` (when it is the newest snapshot's)."""
        try:
            m = self._scrape(rank, port)
        except (OSError, ValueError) as exc:  # not up yet, restarting, gone
            log.debug("worker metrics unavailable", extra=kv(rank=rank, port=port, error=str(exc)[:200]))
            return
        inc = int(m.get("metaps_worker_incarnation", 0))
        if inc != int(_num(incs[-1].get("incarnation")) or len(incs)) or "metaps_worker_step" not in m:
            return  # another process (an old one still exiting, or a newer one before its snapshot)
        earlier = sum(int(_num(r.get("samples")) or 0) for r in incs[:-1])
        samples = m.get("metaps_worker_samples_total", 0.0)
        now = time.time()
        rec["step"] = max(rec["step"], int(m["metaps_worker_step"]))
        rec["samples"] = max(rec["samples"], earlier + int(samples))
        rec["time"], rec["source"] = now, "metrics"
        loss = m.get("metaps_worker_loss{all,total}")
        if loss is not None and loss == loss:
            rec["loss"] = loss
        prev = self._scraped.get(rank)
        if prev is not None and prev[0] == inc and now > prev[2] and samples > prev[1]:
            rec["samples_per_s"] = (samples - prev[1]) / (now - prev[2])
        if prev is None or prev[0] != inc or samples > prev[1]:
            self._scraped[rank] = (inc, samples, now)

    def latest(self, fallback: Mapping[int, Mapping[str, Any]] | None = None) -> dict[int, dict[str, Any]]:
        """rank -> its live record; ranks with no snapshot yet take ``fallback``'s (e.g. :meth:`StepLogTail.latest`).

        Args:
            fallback: rank -> a step record from another source, used only for ranks missing here.
        """
        out = {r: {**w, "source": "log"} for r, w in (fallback or {}).items() if r not in self._latest}
        out.update(self._latest)
        return out

    def max_step(self) -> int:
        return max((int(w["step"]) for w in self._latest.values()), default=0)


def eta_bar(reading: EtaReading, description: str = "job") -> Progress:
    """A rich progress bar (not started: a renderable for a Live view) showing ``reading``."""
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                   TextColumn("{task.completed:.0f}/{task.total:.0f} batches"),
                   TextColumn("{task.fields[rate]}"), TextColumn("ETA {task.fields[eta]}"), auto_refresh=False)
    rate = "" if reading.batches_per_s is None else f"{reading.batches_per_s:.2f} batches/s"
    bar.add_task(description, total=max(reading.total, 1), completed=reading.done, rate=rate,
                 eta=duration_text(reading.eta_s))
    return bar


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    try:
        return format(float(v), spec)
    except (TypeError, ValueError):
        return str(v)


def epoch_text(d: Mapping[str, Any]) -> str:
    """``current/total`` epochs, 1-based, the same while running and once finished (``2/2`` at the end).

    Args:
        d: one dataset of the controller status (``epoch`` 0-based, ``epochs``, ``finished``).
    """
    epochs = int(d.get("epochs") or 0)
    current = epochs if d.get("finished") else min(int(d.get("epoch") or 0) + 1, max(epochs, 1))
    return f"{current}/{epochs}"


def render(status: Mapping[str, Any] | None, workers: Mapping[int, Mapping[str, Any]], elapsed_s: float,
           title: str = "metaps launch", max_events: int = 6, eta: EtaReading | None = None) -> Group:
    """The job's progress bar, then tables for datasets, nodes and recent events.

    Args:
        status: ``ControllerClient.status()`` (None while unreachable).
        workers: rank -> latest step record (``loss``, ``samples_per_s``, ``step``).
        elapsed_s: seconds since the launch.
        title: heading.
        max_events: newest events shown.
        eta: the job's percent and time left (:class:`JobEta`); no bar when None.
    """
    status = status or {}
    head = Text(f"{title}  elapsed {elapsed_s:,.0f}s", style="bold")
    if not status:
        head.append("  (controller status unavailable)", style="yellow")

    ds = Table(title="datasets", expand=False)
    for col in ("dataset", "epoch", "shards done/total", "doing", "batches", "finished"):
        ds.add_column(col)
    for d in status.get("datasets", []):
        ds.add_row(str(d["dataset"]), epoch_text(d),
                   f"{d['shards_done']}/{d['shards_total']}", str(d["shards_doing"]),
                   f"{d['batches_done']}/{d['batches_total']}", "yes" if d["finished"] else "")

    nodes = Table(title="nodes", expand=False)
    for col in ("node", "state", "step", "samples/s", "loss", "slow", "restarts", "rss MiB"):
        nodes.add_column(col)
    seen = set()
    for n in sorted(status.get("nodes", []), key=lambda n: (n["role"], n["index"])):
        seen.add((n["role"], n["index"]))
        w = workers.get(n["index"], {}) if n["role"] == "worker" else {}
        nodes.add_row(f"{n['role']}:{n['index']}", str(n["state"]), str(w.get("step", n.get("step", 0))),
                      _fmt(w.get("samples_per_s"), ",.1f"), _fmt(w.get("loss")),
                      Text("SLOW", style="bold red") if n.get("slow") else Text(""),
                      str(n.get("restarts", 0)), _fmt(n.get("rss_bytes", 0) / 2**20, ",.0f"))
    for rank, w in sorted(workers.items()):
        if ("worker", rank) not in seen:
            nodes.add_row(f"worker:{rank}", "?", str(w.get("step", "")), _fmt(w.get("samples_per_s"), ",.1f"),
                          _fmt(w.get("loss")), "", "", "")

    ev = Table(title="events", expand=False)
    for col in ("time", "node", "kind", "action"):
        ev.add_column(col)
    for e in list(status.get("events", []))[-max_events:]:
        ev.add_row(time.strftime("%H:%M:%S", time.localtime(e["time"])), str(e["node"]), str(e["kind"]),
                   str(e.get("action", "")))
    parts: list[Any] = [head]
    if eta is not None:
        parts.append(eta_bar(eta))
    return Group(*parts, ds, nodes, ev)


def one_line(status: Mapping[str, Any] | None, workers: Mapping[int, Mapping[str, Any]],
             eta: EtaReading | None = None) -> dict[str, Any]:
    """A compact summary for a log line (non-terminal runs): the job's batches done/total,
    percent and time left first (when known), then shards, rate, loss, slow nodes."""
    status = status or {}
    out: dict[str, Any] = eta.fields() if eta is not None else {}
    for d in status.get("datasets", []):
        out[f"{d['dataset']}_shards"] = f"{d['shards_done']}/{d['shards_total']}"
    if workers:
        out["samples_per_s"] = round(sum(float(w.get("samples_per_s", 0.0)) for w in workers.values()), 1)
        losses = [float(w["loss"]) for w in workers.values() if "loss" in w]
        if losses:
            out["loss"] = round(sum(losses) / len(losses), 4)
    slow = [f"{n['role']}:{n['index']}" for n in status.get("nodes", []) if n.get("slow")]
    if slow:
        out["slow"] = ",".join(slow)
    out["events"] = len(status.get("events", []))
    return out


class ProgressDisplay:
    """Live rich view on a terminal; a log line every ``log_every_s`` otherwise.

    Args:
        console: where to draw.
        live: draw a live view (False: log lines only, e.g. ``--no-progress``).
        log_every_s: period of the summary log line when not live.
    """

    def __init__(self, console: Console, live: bool = True, log_every_s: float = 10.0) -> None:
        self.console = console
        self.log_every_s = log_every_s
        self.eta = JobEta()
        self._last_log = 0.0
        self._live: Live | None = None
        if live and console.is_terminal:
            self._live = Live(Text("starting..."), console=console, refresh_per_second=2, transient=False)
            self._live.start()

    def update(self, status: Mapping[str, Any] | None, workers: Mapping[int, Mapping[str, Any]],
               elapsed_s: float) -> None:
        now = time.monotonic()
        reading = self.eta.from_status(status, now)
        if self._live is not None:
            self._live.update(render(status, workers, elapsed_s, eta=reading))
            return
        if now - self._last_log >= self.log_every_s:
            self._last_log = now
            log.info("progress", extra=kv(elapsed_s=round(elapsed_s), **one_line(status, workers, reading)))

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


class TaskProgress:
    """One command's progress toward a known total: rich's progress bar on a terminal, else a
    log line (``msg="progress"``: ``what``, ``done``, ``pct``, ``per_s``, ``eta_s``) every
    ``log_every_s`` seconds. Without a total it counts and gives a rate, no percent or ETA.

    Args:
        what: what is counted (``rows scored``).
        total: how many there will be (None: unknown).
        console: where the bar is drawn (a terminal); None or not a terminal: log lines.
        log_every_s: period of the log line.

    Example::

        with TaskProgress("rows scored", total=50_000, console=Console(stderr=True)) as p:
            for n in batches:
                p.update(n)
    """

    def __init__(self, what: str, total: int | None, console: Console | None = None,
                 log_every_s: float = 5.0) -> None:
        self.what, self.total, self.log_every_s = what, total, log_every_s
        self.eta = JobEta(window_s=30.0)
        self._t0 = time.monotonic()
        self._last_log = self._t0
        self._done = 0
        self.last: EtaReading | None = None
        self.logged: int | None = None
        """``done`` of the last log line written (None: none yet)."""
        self._bar: Progress | None = None
        if console is not None and console.is_terminal:
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.completed:,.0f}/{task.fields[total_text]}"),
                                 TextColumn("ETA {task.fields[eta]}"), console=console, transient=False)
            self._task = self._bar.add_task(what, total=total, total_text=f"{total:,}" if total else "?", eta="-")
            self._bar.start()

    def __enter__(self) -> "TaskProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, done: int) -> None:
        """``done`` so far (cumulative); the figures are then in :attr:`last`."""
        now = time.monotonic()
        self._done = done
        r = self.last = self.eta.update(done, self.total or 0, now)
        if self._bar is not None:
            self._bar.update(self._task, completed=done, eta=duration_text(r.eta_s) if self.total else "-")
        elif now - self._last_log >= self.log_every_s:
            self.log_line(now)

    def log_line(self, now: float | None = None) -> None:
        """Log the figures of the last :meth:`update` now (off a terminal; nothing before an update)."""
        if self.last is None:
            return
        now = time.monotonic() if now is None else now
        self._last_log = now
        self.logged = self.last.done
        log.info("progress", extra=kv(**self.fields(self.last, now)))

    @property
    def drawn(self) -> bool:
        """Whether a bar is drawn (a terminal), rather than log lines written."""
        return self._bar is not None

    def set_total(self, total: int | None) -> None:
        """A total that became known or changed (later readings use it)."""
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total, total_text=f"{total:,}" if total else "?")

    def fields(self, r: EtaReading, now: float) -> dict[str, Any]:
        """The log line's figures for reading ``r``."""
        out: dict[str, Any] = {"what": self.what, "done": r.done,
                               "per_s": round(r.done / max(now - self._t0, 1e-9), 1)}
        if self.total:
            out.update(total=self.total, pct=round(r.pct, 1), eta_s=None if r.eta_s is None else round(r.eta_s))
        return out

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class StageProgress:
    """A progress hook ``(stage, done, total)`` drawn like :class:`TaskProgress`, one stage after another.

    A stage other than the current one closes it and starts a new :class:`TaskProgress`
    (its own bar on a terminal; a stage that comes round again, as in ``deliver --every``,
    starts afresh). Off a terminal, a stage's log line (``msg="progress"``: ``what`` = the
    stage, ``done``, ``total``, ``pct``, ``per_s``, ``eta_s``) comes every ``log_every_s``
    seconds and once more when it reaches its total, so each finished stage leaves a line.
    A total of 0 is unknown: counts and rate, no percent or ETA.

    Args:
        console: where bars are drawn (a terminal); None or not a terminal: log lines.
        log_every_s: period of the log lines within a stage.

    Example::

        with StageProgress(Console(stderr=True)) as hook:
            build(input, schema, out, cfg, progress=hook)
    """

    def __init__(self, console: Console | None = None, log_every_s: float = 5.0) -> None:
        self.console = console
        self.log_every_s = log_every_s
        self.stage: str | None = None
        self._task: TaskProgress | None = None

    def __enter__(self) -> "StageProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, stage: str, done: int, total: int) -> None:
        """One reading of ``stage``: ``done`` of ``total`` (cumulative; 0 total: unknown)."""
        name = str(stage)
        task = self._task
        if task is None or name != self.stage:
            self.close()
            task = self._task = TaskProgress(name, total or None, console=self.console,
                                             log_every_s=self.log_every_s)
            self.stage = name
        elif (total or None) != task.total:
            task.set_total(total or None)
        task.update(done)
        if total and done >= total and not task.drawn and task.logged != done:
            task.log_line()

    def close(self) -> None:
        """End the current stage (its bar stays on the terminal)."""
        if self._task is not None:
            self._task.close()
            self._task = None


def command_progress(no_progress: bool = False, log_every_s: float = 5.0) -> StageProgress:
    """The :class:`StageProgress` of a CLI command: bars on stderr when it is a terminal, else log lines.

    Args:
        no_progress: the command's ``--no-progress``: log lines even on a terminal (as ``launch``'s).
        log_every_s: period of the log lines within a stage.
    """
    import sys

    bar = not no_progress and sys.stderr.isatty()
    return StageProgress(Console(stderr=True) if bar else None, log_every_s=log_every_s)


PROGRESS_MODES = ("auto", "bar", "lines", "off")
"""What :func:`progress_mode` accepts besides True/False."""


def _ipywidgets() -> bool:
    import importlib.util

    return importlib.util.find_spec("ipywidgets") is not None


def progress_mode(progress: bool | str) -> str:
    """``bar``, ``lines`` or ``off`` for a run's progress setting (tqdm.auto's rule, drawn with rich).

    ``auto`` (or True): in Jupyter a rich bar in the cell when ipywidgets is installed (rich
    draws live views there through it), else a line in the cell every few seconds; on a
    terminal (stderr a TTY) a rich bar on stderr; anywhere else (a pipe, a file, CI) a line on
    stderr every few seconds. False or ``off``: nothing.

    Args:
        progress: True, False, or one of :data:`PROGRESS_MODES`.

    Raises:
        ValueError: anything else.
    """
    import sys

    if progress is False or progress == "off":
        return "off"
    if progress in ("bar", "lines"):
        return str(progress)
    if progress is True or progress == "auto":
        if Console().is_jupyter:
            return "bar" if _ipywidgets() else "lines"
        return "bar" if sys.stderr.isatty() else "lines"
    raise ValueError(f"expected True, False or one of {list(PROGRESS_MODES)}, got {progress!r}")


class RunProgress:
    """One run's progress for the Python API: a rich bar, a line every ``every_s`` seconds, or nothing.

    The bar and the lines go to the cell's output in Jupyter, else to stderr (stdout stays
    the caller's). Lines read ``train-local: 40/100 steps (40%) loss 0.6931 ETA 5s``; the
    first update and :meth:`close` always write one.

    Args:
        what: names the run (``train-local``, ``launch``).
        mode: ``bar``, ``lines`` or ``off`` (:func:`progress_mode`).
        unit: what is counted (``steps``, ``batches``).
        every_s: period of the lines.

    Example::

        p = RunProgress("train-local", progress_mode("auto"), "steps")
        p.update(4, 10, "loss 0.69")
        p.close("train-local succeeded: 10 steps")
    """

    def __init__(self, what: str, mode: str, unit: str, every_s: float = 10.0) -> None:
        self.what, self.mode, self.unit, self.every_s = what, mode, unit, every_s
        self.eta = JobEta(window_s=30.0)
        self.lines_written = 0
        self._next_line = 0.0
        self._last: tuple[int, int, str] | None = None
        self._unshown = False  # the newest update's figures are not in a line yet
        self.console: Console | None = None
        self._bar: Progress | None = None
        if mode == "off":
            return
        jupyter = Console().is_jupyter
        self.console = Console() if jupyter else Console(stderr=True)
        if mode == "bar":
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[count]}"), TextColumn("{task.fields[text]}"),
                                 TextColumn("ETA {task.fields[eta]}"), console=self.console, transient=False)
            self._task = self._bar.add_task(what, total=None, count="", text="", eta="-")
            self._bar.start()

    def update(self, done: int, total: int, text: str = "") -> None:
        """``done`` of ``total`` (0: not known) so far, with a short ``text`` (loss, workers)."""
        if self.mode == "off":
            return
        now = time.monotonic()
        r = self.eta.update(done, total, now)
        self._last = (done, total, text)
        if self._bar is not None:
            self._bar.update(self._task, total=total or None, completed=done, text=text,
                             count=f"{done:,}/{total:,} {self.unit}" if total else f"{done:,} {self.unit}",
                             eta=duration_text(r.eta_s) if total else "-")
            return
        self._unshown = True
        if now >= self._next_line:
            self._next_line = now + self.every_s
            self._line(self._text(done, total, text, r))
            self._unshown = False

    def _text(self, done: int, total: int, text: str, r: EtaReading) -> str:
        count = f"{done:,}/{total:,} {self.unit} ({r.pct:.0f}%)" if total else f"{done:,} {self.unit}"
        eta = f" ETA {duration_text(r.eta_s)}" if total and r.eta_s is not None and done < total else ""
        return f"{self.what}: {count}{' ' + text if text else ''}{eta}"

    def _line(self, text: str) -> None:
        assert self.console is not None
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self.lines_written += 1

    def close(self, summary: str = "") -> None:
        """Stop the bar (it stays drawn) or write the last figures, then ``summary`` as a last line."""
        if self.mode == "off":
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self._last is not None and self._unshown:
            done, total, text = self._last  # the newest figures, if the last line did not show them
            self._line(self._text(done, total, text, self.eta.update(done, total, time.monotonic())))
            self._unshown = False
        if summary:
            self._line(summary)
