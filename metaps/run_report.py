"""``report.json``: everything about one run in one file, and its console summary.

Inputs, all produced by the fleet itself:

* the effective job (``<run>/job.toml``) and library versions;
* ``<run>/workers/worker-R.json`` (steps, samples, throughput, history, rank 0's
  eval metrics and final checkpoint) -- or, for a worker that died before
  writing it, the step history recovered from its log lines;
* ``PsClient.stats()`` per shard, taken before the PS fleet stops;
* ``ControllerClient.status()`` (events, coverage, progress, checkpoint cuts);
* the completion ledger read from the controller's LMDB state after it stopped
  (who did which shard, when; duplicates and stale completions);
* the metrics port of every process.

Example::

    rep = build_report(run_dir, job, status="succeeded", ps_stats=stats, controller_status=st,
                       ledger=read_ledger(run_dir / "controller"), metrics_ports=ports)
    write_report(run_dir, rep)
    print_summary(Console(), rep)
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from metaps.core.atomic_write import write_json_atomic
from metaps.core.log import kv

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"

_DISTRIBUTIONS = {
    "metaps": ("metaps",),
    "torch": ("torch",),
    "fbgemm": ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm_gpu"),
    "grpc": ("grpcio",),
    "protobuf": ("protobuf",),
    "pyarrow": ("pyarrow",),
    "numpy": ("numpy",),
    "lmdb": ("lmdb",),
}


def versions() -> dict[str, str]:
    """Installed versions of metaps and the libraries a run depends on ('' if absent)."""
    out: dict[str, str] = {"python": platform.python_version()}
    for key, dists in _DISTRIBUTIONS.items():
        out[key] = ""
        for d in dists:
            try:
                out[key] = importlib.metadata.version(d)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if not out["metaps"]:
        from metaps import __version__

        out["metaps"] = __version__
    return out


def read_worker_reports(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> the JSON each worker wrote at ``<run>/workers/worker-R.json``."""
    out: dict[int, dict[str, Any]] = {}
    for p in sorted((run_dir / "workers").glob("worker-*.json")):
        try:
            rep = json.loads(p.read_text())
            out[int(rep["rank"])] = rep
        except (OSError, ValueError, KeyError) as exc:
            log.warning("unreadable worker report", extra=kv(path=str(p), error=str(exc)[:200]))
    return out


def read_ledger(state_dir: Path) -> list[dict[str, Any]]:
    """The controller's completion ledger (after it stopped) as plain dicts; [] if absent.

    Each entry: seq, time (completion), kind (done | duplicate | stale), dataset, epoch,
    file, start, stop, worker, attempt, samples, elapsed_s, replayed.
    """
    if not (Path(state_dir) / "data.mdb").exists():
        return []
    from controller.ledger import Ledger
    from controller.state import StateStore

    store = StateStore(state_dir)
    try:
        return [{**e.__dict__, "kind": e.kind.value} for e in Ledger(store).entries()]
    finally:
        store.env.close()


def _worker_entry(rank: int, rep: Mapping[str, Any] | None, log_history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    if rep is not None:
        return {**rep, "source": "report"}
    hist = list(log_history)
    return {"rank": rank, "steps": int(hist[-1]["step"]) if hist else 0, "samples": None, "samples_per_s": None,
            "history": hist, "eval": {}, "checkpoint": "", "source": "log" if hist else "missing"}


def flat_auc(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every ``auc``-like figure in a nested eval dict, keyed by its path (``adapted/ctr/auc``)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        path = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            if k == "by_scenario":
                continue
            out.update(flat_auc(v, path))
        elif k in ("auc", "oracle_auc", "norm_auc") and isinstance(v, (int, float)) and math.isfinite(v):
            out[path] = float(v)
    return out


RUN_FAILED_EVENT = "run_failed"  # controller.ps_recovery.RUN_FAILED: the run cannot go on


def run_failure(controller_status: Mapping[str, Any] | None) -> str:
    """Why the controller failed the run ('' when it did not): the reason of its first
    ``run_failed`` event (e.g. a PS recovery with no restorable checkpoint)."""
    for e in (controller_status or {}).get("events", []) or []:
        if e.get("kind") == RUN_FAILED_EVENT:
            return str((e.get("evidence") or {}).get("reason") or "the controller failed the run")
    return ""


def coverage_text(coverage: Mapping[str, Any] | None, status: str, reason: str = "") -> str:
    """One line: ``complete``, ``in progress: 40%`` (status ``running``), or
    ``62% (stopped: launcher SIGTERM)`` -- never "complete" for a run stopped mid-epoch.

    Args:
        coverage: the controller status' ``coverage`` (``Coverage.to_status()``); empty: unknown.
        status: the run's status (``running`` | ``succeeded`` | ``failed`` | ``interrupted``).
        reason: why the run stopped ('' when it ran to its end).
    """
    if not coverage:
        return "unknown (no controller status)"
    if coverage.get("complete"):
        return "complete"
    frac = coverage.get("fraction")
    pct = f"{100.0 * float(frac):.0f}%" if isinstance(frac, (int, float)) else "?%"
    problems = list(coverage.get("problems") or [])
    tail = f"; problems: {problems[:3]}" if problems else ""
    if status == "running":
        return f"in progress: {pct}{tail}"
    if reason.startswith("stopped by "):  # the launcher's own signal: "stopped by SIGTERM"
        reason = "launcher " + reason[len("stopped by "):]
    why = reason or ("every worker exited before every shard was done" if status == "succeeded" else status)
    return f"{pct} (stopped: {why}){tail}"


def build_report(
    run_dir: Path,
    job: Any,
    *,
    status: str,
    reason: str = "",
    exit_code: int = 0,
    started: float = 0.0,
    ps_stats: Sequence[Mapping[str, Any]] | None = None,
    controller_status: Mapping[str, Any] | None = None,
    ledger: Sequence[Mapping[str, Any]] = (),
    metrics_ports: Mapping[str, int | None] | None = None,
    processes: Mapping[str, Mapping[str, Any]] | None = None,
    log_histories: Mapping[int, Sequence[Mapping[str, Any]]] | None = None,
    checkpoint: str = "",
    resumed_from: str = "",
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """Assemble the report dict (see the module docstring for the sources).

    Args:
        run_dir: the run directory.
        job: the effective JobConfig.
        status: ``succeeded`` | ``failed`` | ``interrupted``.
        reason: why it failed or stopped ('' on success); also in ``coverage_summary``
            when the run's coverage is not complete.
        exit_code: the launcher's exit code.
        started: unix time of the launch.
        ps_stats: ``PsClient.stats()`` (None: PS unreachable at the end).
        controller_status: the last ``ControllerClient.status()``.
        ledger: :func:`read_ledger` entries.
        metrics_ports: process name -> Prometheus port (None: the process serves none).
        processes: process name -> {pid, exit_code, log}.
        log_histories: rank -> step records from logs, for workers without a report.
        checkpoint: the final checkpoint directory ('' if none).
        resumed_from: the checkpoint this run started from ('' if cold).
        notes: free-text remarks (e.g. processes without a metrics endpoint).
    """
    reports = read_worker_reports(run_dir)
    ranks = sorted(set(range(job.train.workers)) | set(reports))
    workers = [_worker_entry(r, reports.get(r), (log_histories or {}).get(r, ())) for r in ranks]
    final_metrics = reports.get(0, {}).get("eval", {}) or {}
    ckpt = checkpoint or reports.get(0, {}).get("checkpoint", "")
    st = dict(controller_status or {})
    now = time.time()
    cov = dict(st.get("coverage", {}) or {})
    return {
        "run_dir": str(run_dir),
        "name": job.run.name,
        "status": status,
        "reason": reason,
        "exit_code": exit_code,
        "started": started,
        "finished": now,
        "wall_s": round(now - started, 3) if started else None,
        "config_file": str(run_dir / "job.toml"),
        "config": job.to_dict(),
        "versions": versions(),
        "counts": {"ps": job.ps.shards, "workers": job.train.workers},
        "workers": workers,
        "totals": {
            "samples": sum(int(w.get("samples") or 0) for w in workers),
            "steps": sum(int(w.get("steps") or 0) for w in workers),
            "samples_per_s": round(sum(float(w.get("samples_per_s") or 0.0) for w in workers), 3),
        },
        "ps": list(ps_stats) if ps_stats is not None else [],
        "controller": {
            "events": st.get("events", []),
            "coverage": cov,
            "datasets": st.get("datasets", []),
            "nodes": st.get("nodes", []),
            "checkpoints": st.get("checkpoints", []),
            "finished": bool(st.get("finished", False)),
        },
        "coverage_summary": coverage_text(cov, status, reason),
        "shards": list(ledger),
        "final_metrics": final_metrics,
        "final_auc": flat_auc(final_metrics),
        "checkpoint": ckpt,
        "resumed_from": resumed_from,
        "metrics_ports": dict(metrics_ports or {}),
        "processes": dict(processes or {}),
        "notes": list(notes),
    }


def write_report(run_dir: Path, report: Mapping[str, Any]) -> Path:
    """Write ``<run>/report.json`` atomically."""
    return write_json_atomic(Path(run_dir) / REPORT_FILE, report)


def _store_rows(stats: Mapping[str, Any]) -> int:
    """Total rows over a PS shard's tables (``store.tables.<name>.rows``)."""
    tables = stats.get("store", {}).get("tables", {})
    return sum(int(t.get("rows", 0)) for t in tables.values() if isinstance(t, Mapping))


def print_summary(console: Console, report: Mapping[str, Any]) -> None:
    """Workers, PS shards, final metrics and the run directory as rich tables."""
    colour = {"succeeded": "green", "failed": "red", "interrupted": "yellow"}.get(report["status"], "white")
    console.print(f"[bold {colour}]run {report['status']}[/]" + (f": {report['reason']}" if report["reason"] else ""))
    console.print(f"coverage: {report.get('coverage_summary') or '-'}", markup=False)

    wt = Table(title="workers")
    for col in ("rank", "steps", "samples", "samples/s", "wall s", "final loss", "source"):
        wt.add_column(col, justify="right")
    for w in report["workers"]:
        hist = w.get("history") or []
        loss = hist[-1].get("loss") if hist else None
        wt.add_row(str(w["rank"]), str(w.get("steps", "")), str(w.get("samples") if w.get("samples") is not None else "-"),
                   f"{w['samples_per_s']:,.1f}" if w.get("samples_per_s") else "-",
                   f"{w['wall_s']:.1f}" if w.get("wall_s") else "-",
                   f"{loss:.4f}" if isinstance(loss, (int, float)) else "-", str(w.get("source", "")))
    console.print(wt)

    if report["ps"]:
        pt = Table(title="parameter servers")
        for col in ("shard", "vshards", "rows", "memory MiB"):
            pt.add_column(col, justify="right")
        for s in report["ps"]:
            pt.add_row(str(s.get("shard")), str(s.get("owned_vshards", "")), f"{_store_rows(s):,}",
                       f"{s.get('memory_bytes', 0) / 2**20:,.1f}")
        console.print(pt)

    ct = Table(title="run")
    ct.add_column("item")
    ct.add_column("value", overflow="fold")
    ct.add_row("coverage", escape(report.get("coverage_summary")
                                  or coverage_text(report["controller"]["coverage"], report["status"], report["reason"])))
    ct.add_row("events", str(len(report["controller"]["events"])))
    for k, v in sorted(report["final_auc"].items()):
        ct.add_row(k, f"{v:.4f}")
    ct.add_row("samples/s (sum)", f"{report['totals']['samples_per_s']:,.1f}")
    ct.add_row("checkpoint", report["checkpoint"] or "-")
    ct.add_row("run dir", report["run_dir"])
    console.print(ct)
