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
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from common.atomic_write import write_json_atomic
from common.log import kv
from common.process import pid_alive

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


_INC_FILE = re.compile(r"^worker-(\d+)\.inc-(\d+)\.json$")
_LEGACY_FILE = re.compile(r"^worker-(\d+)\.json$")


def read_incarnations(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> every incarnation's report (``<run>/workers/worker-R.inc-N.json``), in order.

    A worker rewrites its incarnation's file while it trains (``state`` ``running``) and at
    the end (``finished``); a killed incarnation leaves its last snapshot. Runs from before
    incarnation files have ``worker-R.json`` only: it counts as incarnation 1.
    """
    found: dict[int, dict[int, dict[str, Any]]] = {}
    legacy: dict[int, dict[str, Any]] = {}
    for p in sorted((run_dir / "workers").glob("worker-*.json")):
        m_inc, m_old = _INC_FILE.match(p.name), _LEGACY_FILE.match(p.name)
        if not (m_inc or m_old):
            continue
        try:
            rep = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            log.warning("unreadable worker report", extra=kv(path=str(p), error=str(exc)[:200]))
            continue
        if m_inc:
            rank, inc = int(m_inc.group(1)), int(m_inc.group(2))
            found.setdefault(rank, {})[inc] = {"rank": rank, **rep, "incarnation": inc}
        elif m_old:
            legacy[int(m_old.group(1))] = rep
    out = {r: [incs[i] for i in sorted(incs)] for r, incs in found.items()}
    for r, rep in legacy.items():
        out.setdefault(r, [{**rep, "incarnation": 1}])
    return out


def _wall(rep: Mapping[str, Any]) -> float:
    wall = float(rep.get("wall_s") or 0.0)
    if not wall and rep.get("train_start"):  # a snapshot of an incarnation that did not finish
        wall = max(0.0, float(rep.get("time") or 0.0) - float(rep["train_start"]))
    return wall


LIVE_STATES = ("starting", "running")
"""Snapshot states of an incarnation whose process was still going when it last wrote."""
MIN_RATE_WALL_S = 1.0
"""An incarnation that trained for less than this has no samples/wall rate (a 2 ms wall
after a kill made rates near 10^12): its last measured step rate stands instead."""


def incarnation_state(rep: Mapping[str, Any], newest: bool) -> str:
    """An incarnation's state as it is now: ``dead`` for a ``starting``/``running`` snapshot
    whose process is gone (a newer incarnation replaced it, or its pid no longer runs);
    otherwise the snapshot's own ``state`` (``finished`` for old reports without one).

    Args:
        rep: the incarnation's snapshot.
        newest: whether it is its rank's newest incarnation (an older one was replaced).
    """
    state = str(rep.get("state", "finished"))
    if state in LIVE_STATES and (not newest or not pid_alive(rep.get("pid"))):
        return "dead"
    return state


def incarnation_rate(rep: Mapping[str, Any], wall_s: float) -> float | None:
    """samples/s of one incarnation: samples over its training wall when that is long enough
    to mean something (:data:`MIN_RATE_WALL_S`), else its last measured step rate (None if none)."""
    samples = int(rep.get("samples") or 0)
    if wall_s >= MIN_RATE_WALL_S:
        return samples / wall_s
    for rec in [rep.get("last") or {}, *reversed(rep.get("history") or [])]:
        v = rec.get("samples_per_s")
        if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0:
            return float(v)
    return None


def merge_incarnations(incs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One rank's figures over all its incarnations.

    ``steps`` and ``samples`` are sums of what each incarnation trained (``steps_run``:
    a restarted worker resumes its step numbering from its PS clock), ``last_step`` the
    step number reached, ``wall_s`` the sum of the incarnations' training times,
    ``history`` every incarnation's records tagged with ``incarnation``, ``eval`` and
    ``checkpoint`` from the last incarnation that has them. ``incarnations`` lists each
    one's own figures.
    """
    last = dict(incs[-1])
    per: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    eval_history: list[dict[str, Any]] = []
    for n, rep in enumerate(incs):
        inc = int(rep.get("incarnation") or 1)
        steps_run = int(rep.get("steps_run", int(rep.get("steps") or 0) - int(rep.get("start_step") or 0)))
        hist = [{**h, "incarnation": inc} for h in rep.get("history") or []]
        history += hist
        eval_history += [{**h, "incarnation": inc} for h in rep.get("eval_history") or []]
        wall = _wall(rep)
        per.append({"incarnation": inc, "state": incarnation_state(rep, newest=n == len(incs) - 1),
                    "snapshot_state": rep.get("state", "finished"), "start_step": rep.get("start_step", 0),
                    "last_step": int(rep.get("steps") or 0), "steps": steps_run,
                    "samples": int(rep.get("samples") or 0), "wall_s": round(wall, 3),
                    "samples_per_s": incarnation_rate(rep, wall),
                    "train_start": rep.get("train_start", 0.0), "train_end": rep.get("train_end", 0.0),
                    "final_loss": hist[-1].get("loss") if hist else None})
    samples = sum(p["samples"] for p in per)
    wall = sum(p["wall_s"] for p in per)
    merged = {
        **last,
        "steps": sum(p["steps"] for p in per),
        "last_step": max(p["last_step"] for p in per),
        "samples": samples,
        "shards": sum(int(r.get("shards") or 0) for r in incs),
        "wall_s": round(wall, 3),
        "busy_s": sum(float(r.get("busy_s") or 0.0) for r in incs),
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "train_start": min((float(r.get("train_start") or 0.0) for r in incs if r.get("train_start")), default=0.0),
        "history": history,
        "eval_history": eval_history,
        "incarnations": per,
        "state": per[-1]["state"],
    }
    for key in ("eval", "checkpoint"):
        merged[key] = next((r.get(key) for r in reversed(incs) if r.get(key)), last.get(key) or ({} if key == "eval" else ""))
    return merged


def read_worker_reports(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> that worker's report, every incarnation counted (:func:`merge_incarnations`)."""
    return {r: merge_incarnations(incs) for r, incs in read_incarnations(run_dir).items() if incs}


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
    hist = list(log_history)
    log_last = int(hist[-1]["step"]) if hist else 0
    if rep is not None and all(i.get("snapshot_state", i.get("state")) == "starting"
                               for i in rep.get("incarnations") or [{}]):
        rep = None  # claimed, never trained far enough to write a snapshot: the log knows more
    if rep is not None:
        out = {**rep, "source": "report"}
        incs = rep.get("incarnations") or []
        last = int(rep.get("last_step") or rep.get("steps") or 0)
        if incs and incs[-1].get("state") != "finished" and log_last > last:
            # killed between two snapshots: its log lines went further
            out["steps"] = int(rep.get("steps") or 0) + log_last - last
            out["last_step"] = log_last
            out["steps_after_snapshot_from_log"] = log_last - last
        return out
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


FINAL_CHECKPOINT_CAUSE = "final_checkpoint"  # controller.run_outcome.CAUSE_FINAL_CHECKPOINT


def final_checkpoint_failure(controller_status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The evidence of a ``run_failed`` event for a final checkpoint that could not be written
    (``cause`` ``final_checkpoint``: ``worker``, ``error``, ``training_finished``); {} when none."""
    for e in (controller_status or {}).get("events", []) or []:
        ev = e.get("evidence") or {}
        if e.get("kind") == RUN_FAILED_EVENT and ev.get("cause") == FINAL_CHECKPOINT_CAUSE:
            return dict(ev)
    return {}


def final_checkpoint_entry(checkpoint: str, controller_status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The report's ``final_checkpoint``: ``state`` written | failed | none, ``path``, ``error``."""
    failed = final_checkpoint_failure(controller_status)
    if failed:
        return {"state": "failed", "path": "", "error": str(failed.get("error") or ""),
                "worker": failed.get("worker")}
    return {"state": "written" if checkpoint else "none", "path": checkpoint, "error": ""}


def coverage_text(coverage: Mapping[str, Any] | None, status: str, reason: str = "") -> str:
    """One line: ``complete``, ``in progress: 40%`` (status ``running``), or
    ``62% (stopped: launcher SIGTERM)`` -- never "complete" for a run stopped mid-epoch.
    Batches trained more than once are :func:`replay_text`'s.

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
    closed = dict(coverage.get("closed") or {})
    if not reason and closed:  # closed on request (the step limit): partial by request, not a failure
        reason = "; ".join(f"{ds} closed: {why}" for ds, why in sorted(closed.items()))
    why = reason or ("every worker exited before every shard was done" if status == "succeeded" else status)
    return f"{pct} (stopped: {why}){tail}"


def replay_text(coverage: Mapping[str, Any] | None) -> str:
    """One line: batches trained more than once, or ``none``. Replays (duplicate, stale and
    replayed ledger entries) exactly; abandoned leases (taken from a holder that may have pushed
    them: at-least-once) as an upper bound, e.g. ``3 batches trained twice; at most 4 more
    batches of abandoned leases trained twice (at-least-once)``.

    Args:
        coverage: the controller status' ``coverage`` (``Coverage.to_status()``); empty: unknown.
    """
    if not coverage:
        return "unknown (no controller status)"
    again = []
    if int(coverage.get("duplicate_batches") or 0):
        again.append(f"{int(coverage['duplicate_batches'])} batches trained twice")
    if int(coverage.get("abandoned_batches") or 0):
        again.append(f"at most {int(coverage['abandoned_batches'])} {'more ' if again else ''}batches of "
                     f"abandoned leases trained twice (at-least-once)")
    return "; ".join(again) or "none"


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
    # the worker that wrote the final checkpoint (the controller's leader then; rank 0 by default)
    lead = next((r for _, r in sorted(reports.items()) if r.get("final")), reports.get(0, {}))
    final_metrics = lead.get("eval", {}) or {}
    ckpt = checkpoint or lead.get("checkpoint", "")
    st = dict(controller_status or {})
    now = time.time()
    cov = dict(st.get("coverage", {}) or {})
    events = list(st.get("events", []) or [])
    final_ckpt = final_checkpoint_entry(ckpt, st)
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
            "last_step": max((int(w.get("last_step") or w.get("steps") or 0) for w in workers), default=0),
            "incarnations": sum(len(w.get("incarnations") or [1]) for w in workers),
            "checkpoint_step": checkpoint_step(ckpt),
        },
        "auc_history": list(lead.get("eval_history") or []),
        "faults": faults_entry(run_dir, job, started),
        "eval_data": {"final": str(job.data.eval or ""), "periodic": str(job.data.eval or ""),
                      "protocol": eval_protocol(job)},
        "shards_note": shards_note(st.get("datasets", []) or [], events),
        "ps": list(ps_stats) if ps_stats is not None else [],
        "controller": {
            "events": events,
            "coverage": cov,
            "datasets": st.get("datasets", []),
            "nodes": st.get("nodes", []),
            "checkpoints": st.get("checkpoints", []),
            "finished": bool(st.get("finished", False)),
        },
        "coverage_summary": coverage_text(cov, status, reason),
        "replays_summary": replay_text(cov),
        "shards": list(ledger),
        "final_metrics": final_metrics,
        "final_auc": flat_auc(final_metrics),
        "cold_start": cold_start(final_metrics),
        "checkpoint": ckpt,
        # training itself: "finished" when every dataset was done (whatever became of the final checkpoint)
        "training": "finished" if cov.get("complete") and st.get("finished") else "not finished",
        "final_checkpoint": final_ckpt,
        "resumed_from": resumed_from,
        "metrics_ports": dict(metrics_ports or {}),
        "processes": dict(processes or {}),
        "notes": list(notes),
    }


def faults_entry(run_dir: Path, job: Any, started: float) -> dict[str, Any]:
    """The report's ``faults``: ``fired`` (what the fault injectors recorded under ``RUN/faults/``,
    each with ``start_s`` / ``end_s`` seconds after the launch) and ``scheduled`` (how many
    ``[[faults.faults]]`` the job has). Text, plots and summaries name only ``fired`` ones."""
    from common.faults import read_fired

    fired = []
    for r in read_fired(Path(run_dir) / "faults"):
        rec = dict(r)
        t0 = float(started or r.get("launch_t0") or 0.0)
        if t0:
            rec["start_s"] = round(float(r.get("first_time") or 0.0) - t0, 2)
            rec["end_s"] = round(float(r.get("last_time") or 0.0) - t0, 2)
        fired.append(rec)
    scheduled = len(getattr(getattr(job, "faults", None), "faults", None) or [])
    return {"scheduled": scheduled, "fired": fired}


def fault_phrase(rec: Mapping[str, Any]) -> str:
    """One fired fault in words: ``worker 1 slow x3 (step) at steps 20-79 (60 steps), 9.1-24.0 s after
    launch, slept 14.2 s (scheduled: steps 20-79)``. The schedule is the config's; the rest is what
    the injector recorded (a worker that rejoins the PS clocks skips step numbers, so a step window
    can end early)."""
    what = str(rec.get("what") or f"{rec.get('target')} {rec.get('index')} {rec.get('kind')}")
    first, last, n = rec.get("first_step"), rec.get("last_step"), int(rec.get("count") or 0)
    when = []
    if rec.get("kind") == "kill":
        when.append(f"killed after step {first}" if first is not None else "killed")
    elif first is not None:
        when.append(f"at steps {first}-{last} ({n} steps)")
    elif n:
        when.append(f"{n:,} requests")
    if isinstance(rec.get("start_s"), (int, float)):
        when.append(f"{float(rec['start_s']):.1f}-{float(rec.get('end_s') or rec['start_s']):.1f} s after launch"
                    if rec.get("kind") != "kill" else f"{float(rec['start_s']):.1f} s after launch")
    if float(rec.get("sleep_s") or 0.0) > 0:
        when.append(f"slept {float(rec['sleep_s']):.1f} s")
    sched = f" (scheduled: {rec['schedule']})" if rec.get("schedule") else ""
    return what + (" " + ", ".join(when) if when else "") + sched


def faults_text(report: Mapping[str, Any]) -> str:
    """``faults fired: <phrase>; ...`` from what the injectors recorded (never from the config), or
    ``faults fired: none`` when the job scheduled some and none fired; '' when it scheduled none."""
    faults = report.get("faults") or {}
    fired = list(faults.get("fired") or [])
    if fired:
        return "faults fired: " + "; ".join(fault_phrase(r) for r in fired)
    n = int(faults.get("scheduled") or 0)
    return f"faults fired: none ({n} scheduled in [faults], none applied)" if n else ""


def controller_text(report: Mapping[str, Any]) -> str:
    """What the controller did about stragglers, from its events: ``controller: worker 1 flagged
    slow at 21.3 s; 3 shrink_shards, 1 release_clock`` or ``controller: flagged no node slow``."""
    t0 = float(report.get("started") or 0.0)
    events = (report.get("controller") or {}).get("events") or []
    flagged: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in events:
        kind = str(e.get("kind"))
        if kind in ("slow_detected", "slow"):
            flagged.setdefault(str(e.get("node")), float(e.get("time") or 0.0))
        if kind in ("shrink_shards", "release_clock", "restart", "move_vshards", "recovered", "rejoin_clock"):
            counts[kind] = counts.get(kind, 0) + 1
    if not flagged:
        return "controller: flagged no node slow" + (
            "; " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) if counts else "")
    who = ", ".join(f"{n.replace(':', ' ')} flagged slow at {t - t0:.1f} s" if t0 else f"{n} flagged slow"
                    for n, t in sorted(flagged.items(), key=lambda kv_: kv_[1]))
    acts = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return f"controller: {who}" + (f"; actions: {acts}" if acts else "")


def eval_protocol(job: Any) -> str:
    """What the run's evaluations score, in words (the data set and the protocol)."""
    meta = str(getattr(getattr(job, "train", None), "mode", "")).endswith("meta")
    return ("episodes of the Meta-IO eval set: base = no adaptation, adapted = after the inner loop on each "
            "task's support rows; both score the query rows" if meta else "rows of the eval set, no adaptation")


def checkpoint_step(path: str) -> int | None:
    """The step of a checkpoint directory ``.../ckpt-<step>`` (None: none or not one)."""
    m = re.search(r"ckpt-(\d+)$", str(path or "").rstrip("/"))
    return int(m.group(1)) if m else None


def shards_note(datasets: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]) -> str:
    """Why a dataset's shard total is larger than the shards it started with ('' when nothing explains it).

    The DDS splits a shard when a worker asks for smaller ones (the controller's
    ``shrink_shards`` on a slow worker) and requeues the shards of a worker that
    died, hung or lost its lease: both add records mid-run.
    """
    kinds: dict[str, int] = {}
    for e in events:
        kinds[str(e.get("kind"))] = kinds.get(str(e.get("kind")), 0) + 1
    shrinks = kinds.get("shrink_shards", 0)
    requeues = sum(kinds.get(k, 0) for k in ("shards_requeued", "lease_expired", "hang"))
    if not (shrinks or requeues):
        return ""
    totals = ", ".join(f"{d.get('dataset')} {d.get('shards_total')}" for d in datasets if d.get("shards_total"))
    why = []
    if shrinks:
        why.append(f"{shrinks} shrink_shards event(s): shards split into smaller leases for slow workers")
    if requeues:
        why.append(f"{requeues} requeue event(s): shards of a dead, hung or expired-lease worker handed out again")
    return f"shard totals{' (' + totals + ')' if totals else ''} grew mid-run: " + "; ".join(why)


def steps_text(report: Mapping[str, Any]) -> str:
    """``steps 70 over 3 incarnations (last step 40; last checkpoint at step 63)``: what the step figures mean."""
    t = report.get("totals", {})
    text = f"steps {t.get('steps', 0)} (all workers, every incarnation)"
    if t.get("incarnations") and t["incarnations"] > len(report.get("workers", [])):
        text += f" over {t['incarnations']} incarnations"
    ck = t.get("checkpoint_step")
    text += f"; furthest step {t.get('last_step', 0)}; " + (
        f"last checkpoint at step {ck}" if ck is not None else "no checkpoint")
    return text


def write_report(run_dir: Path, report: Mapping[str, Any]) -> Path:
    """Write ``<run>/report.json`` atomically."""
    return write_json_atomic(Path(run_dir) / REPORT_FILE, report)


def _store_rows(stats: Mapping[str, Any]) -> int:
    """Total rows over a PS shard's tables (``store.tables.<name>.rows``)."""
    tables = stats.get("store", {}).get("tables", {})
    return sum(int(t.get("rows", 0)) for t in tables.values() if isinstance(t, Mapping))


GAIN_NOISE = 0.001
"""An adapted-minus-base AUC gain smaller than this (either sign) is reported as "no clear change"."""


def cold_start(final_metrics: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per head, the held-out users' base vs adapted AUC: what adaptation bought, said plainly.

    ``{head: {"base", "adapted", "gain", "oracle" (None where the data has no Bayes reference),
    "verdict"}}`` with ``verdict`` ``helps`` (gain >= :data:`GAIN_NOISE`), ``hurts``
    (gain <= -:data:`GAIN_NOISE`) or ``no clear change``; empty when the eval has no adapted part.

    Args:
        final_metrics: the leader's merged eval (``base`` / ``adapted`` -> head -> ``auc``, ``oracle_auc``).
    """
    base, adapted = final_metrics.get("base") or {}, final_metrics.get("adapted") or {}
    out: dict[str, dict[str, Any]] = {}
    for head in sorted(set(base) & set(adapted)):
        b, a = base[head], adapted[head]
        if not (isinstance(b, Mapping) and isinstance(a, Mapping)):
            continue
        if not all(isinstance(x.get("auc"), (int, float)) and math.isfinite(x["auc"]) for x in (b, a)):
            continue
        gain = float(a["auc"]) - float(b["auc"])
        verdict = "helps" if gain >= GAIN_NOISE else "hurts" if gain <= -GAIN_NOISE else "no clear change"
        oracle = b.get("oracle_auc")
        out[head] = {"base": round(float(b["auc"]), 4), "adapted": round(float(a["auc"]), 4),
                     "gain": round(gain, 4), "oracle": round(float(oracle), 4) if isinstance(oracle, (int, float))
                     and math.isfinite(oracle) else None, "verdict": verdict}
    return out


def cold_start_text(table: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per head for the summary (``click: base 0.7942 -> adapted 0.7921 (-0.0021: hurts); ...``),
    and a closing line when adaptation helps no head."""
    lines = []
    for head, r in table.items():
        oracle = f"; Bayes oracle {r['oracle']:.4f}" if r.get("oracle") is not None else ""
        lines.append(f"{head}: base {r['base']:.4f} -> adapted {r['adapted']:.4f} ({r['gain']:+.4f}: "
                     f"{r['verdict']}){oracle}")
    if table and not any(r["verdict"] == "helps" for r in table.values()):
        lines.append("adaptation did not improve any head on these held-out users (docs/design/meta_learning.md)")
    return lines


def print_summary(console: Console, report: Mapping[str, Any]) -> None:
    """Workers, PS shards, final metrics and the run directory as rich tables."""
    colour = {"succeeded": "green", "failed": "red", "interrupted": "yellow"}.get(report["status"], "white")
    console.print(f"[bold {colour}]run {report['status']}[/]" + (f": {report['reason']}" if report["reason"] else ""))
    console.print(f"coverage: {report.get('coverage_summary') or '-'}", markup=False)
    console.print(f"trained more than once: {report.get('replays_summary') or '-'}", markup=False)

    wt = Table(title="workers (every incarnation counted)")
    for col in ("rank", "inc", "steps", "last step", "samples", "samples/s", "wall s", "final loss", "source"):
        wt.add_column(col, justify="right")

    def row(rank: str, inc: str, w: Mapping[str, Any], loss: Any, source: str) -> None:
        wt.add_row(rank, inc, str(w.get("steps", "")), str(w.get("last_step", w.get("steps", ""))),
                   str(w.get("samples") if w.get("samples") is not None else "-"),
                   f"{w['samples_per_s']:,.1f}" if w.get("samples_per_s") else "-",
                   f"{w['wall_s']:.1f}" if w.get("wall_s") else "-",
                   f"{loss:.4f}" if isinstance(loss, (int, float)) else "-", source)

    for w in report["workers"]:
        hist = w.get("history") or []
        incs = w.get("incarnations") or []
        if len(incs) > 1:
            for i in incs:
                row(str(w["rank"]), str(i["incarnation"]), i, i.get("final_loss"), str(i.get("state", "")))
        loss = hist[-1].get("loss") if hist else None
        row(str(w["rank"]), "all" if len(incs) > 1 else str(len(incs) or "-"), w, loss, str(w.get("source", "")))
    console.print(wt)
    console.print(steps_text(report), markup=False)
    if report.get("shards_note"):
        console.print(report["shards_note"], markup=False)

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
    ct.add_row("trained more than once", escape(report.get("replays_summary") or "-"))
    ct.add_row("events", str(len(report["controller"]["events"])))
    ct.add_row("samples/s (sum)", f"{report['totals']['samples_per_s']:,.1f}")
    fc = report.get("final_checkpoint") or {}
    ct.add_row("training", str(report.get("training") or "-"))
    ct.add_row("checkpoint", escape(f"failed: {fc.get('error')}") if fc.get("state") == "failed"
               else shown_path(report["checkpoint"]) or "-")
    ct.add_row("run dir", shown_path(report["run_dir"]))
    console.print(ct)
    for line in (faults_text(report), controller_text(report), workers_text(report)):
        if line:
            console.print(line, markup=False)
    auc_table(console, report)
    lines = cold_start_text(report.get("cold_start") or {})
    if lines:
        console.print(f"cold start, held-out users ({auc_source(report)}): base vs adapted", markup=False)
        for line in lines:
            console.print("  " + line, markup=False)


def shown_path(path: str) -> str:
    """``path`` as printed: relative to the working directory when it lies under it (the paths a
    user typed, like ``runs/main/...``), else as given."""
    if not path:
        return ""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def auc_source(report: Mapping[str, Any]) -> str:
    """``episodes on the Meta-IO holdout runs/main/metaio-holdout, 2,187 query rows``: what the final AUCs scored."""
    data = (report.get("eval_data") or {}).get("final") or ((report.get("config") or {}).get("data") or {}).get("eval")
    rows = max((int(m.get("rows") or 0) for heads in (report.get("final_metrics") or {}).values()
                if isinstance(heads, Mapping) for m in heads.values() if isinstance(m, Mapping)), default=0)
    meta = str(((report.get("config") or {}).get("train") or {}).get("mode") or "") == "meta"
    what = "episodes on the Meta-IO holdout" if meta else "the eval set"
    return f"{what} {shown_path(str(data)) or '?'}" + (f", {rows:,} query rows" if rows else "")


def auc_table(console: Console, report: Mapping[str, Any]) -> None:
    """The final evaluation's AUCs, one row per head, each column saying what it scored."""
    final = report.get("final_metrics") or {}
    heads = sorted({h for kind in ("base", "adapted") for h in (final.get(kind) or {})
                    if isinstance((final.get(kind) or {}).get(h), Mapping)})
    if not heads:
        return
    t = Table(title=f"final eval AUC: {auc_source(report)} (every eval row, after the last step)")
    for col in ("head", "base (no adaptation)", "adapted (inner loop on support rows)", "Bayes oracle", "rows"):
        t.add_column(col, justify="right")
    for h in heads:
        b, a = (final.get("base") or {}).get(h) or {}, (final.get("adapted") or {}).get(h) or {}

        def f(m: Mapping[str, Any], key: str = "auc") -> str:
            v = m.get(key)
            return f"{v:.4f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"

        t.add_row(h, f(b), f(a), f(b, "oracle_auc"), f"{int(b.get('rows') or a.get('rows') or 0):,}")
    console.print(t)


def workers_text(report: Mapping[str, Any]) -> str:
    """Steps per worker and, for the worker that ran the periodic evaluation, how it ran:
    ``steps per worker: 0: 118, 1: 121; periodic eval by worker 0 off its step path: 8 evals,
    4.1 s, 23 steps trained meanwhile``."""
    workers = report.get("workers") or []
    if not workers:
        return ""
    text = "steps per worker: " + ", ".join(f"{w.get('rank')}: {int(w.get('steps') or 0)}" for w in workers)
    for w in workers:
        pts = w.get("eval_history") or []
        if not pts:
            continue
        off = sum(1 for p in pts if p.get("thread") and p.get("thread") != "MainThread")
        secs = sum(float(p.get("seconds") or 0.0) for p in pts)
        during = sum(int(p.get("steps_during") or 0) for p in pts)
        where = ("off its step path (a background thread)" if off == len(pts) else
                 "on its step path" if not off else f"{off} of {len(pts)} off its step path")
        text += (f"; periodic eval by worker {w.get('rank')} {where}: {len(pts)} evals, {secs:.1f} s, "
                 f"{during} steps trained meanwhile")
    return text
