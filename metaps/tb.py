"""TensorBoard logs of a run: the workers' live ones, completed from ``report.json`` after it ends.

Layout (``tensorboard --logdir <run>/tb`` overlays the workers)::

    <run>/tb/worker-R.inc-N/  written live by the worker process (workers/telemetry.py): train/loss,
                              train/samples_per_s, train/pull_s, ... every [train] tb_every_steps
                              steps, eval/<kind>/<head>/auc at each periodic evaluation (rank 0)
    <run>/tb/worker-R/        after the run, only for a rank with no live directory (a worker that
                              died before its first live write, an older worker): from its history
    <run>/tb/fleet/           eval/<kind>/<head>/auc (periodic evaluations by step, and the final
                              one at the last step), fleet/samples_per_s; text run/status,
                              run/faults (the faults that fired, with when), run/controller

Example::

    write_tensorboard(report, Path("runs/x/tb"))
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.log import kv

log = logging.getLogger(__name__)

_SKIP = {"step", "time", "samples"}


def write_tensorboard(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write one event-file directory per worker plus ``fleet``; returns the directories.

    Args:
        report: the run report dict (:mod:`metaps.run_report`).
        out_dir: the TensorBoard log root (created).
    """
    from torch.utils.tensorboard import SummaryWriter

    out_dir = Path(out_dir)
    dirs = []
    last_step = 0
    for w in report.get("workers", []):
        hist = w.get("history") or []
        last_step = max([last_step, *(int(h["step"]) for h in hist if "step" in h)])
        if not hist or any(out_dir.glob(f"worker-{w['rank']}.inc-*")):
            continue  # the worker wrote its own live logs
        d = out_dir / f"worker-{w['rank']}"
        writer = SummaryWriter(log_dir=str(d))
        try:
            for h in hist:
                step = int(h["step"])
                last_step = max(last_step, step)
                for k, v in h.items():
                    if k in _SKIP or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                        continue
                    writer.add_scalar(f"train/{k}", float(v), global_step=step, walltime=float(h["time"]))
        finally:
            writer.close()
        dirs.append(d)
    d = out_dir / "fleet"
    writer = SummaryWriter(log_dir=str(d))
    try:
        for point in report.get("auc_history") or []:
            for k, v in point.items():
                if "/" in k and isinstance(v, (int, float)) and math.isfinite(v):
                    writer.add_scalar(f"eval/{k}", float(v), global_step=int(point["step"]),
                                      walltime=float(point.get("time") or 0.0) or None)
        for k, v in sorted(report.get("final_auc", {}).items()):
            writer.add_scalar(f"eval/{k}", float(v), global_step=last_step)
        totals = report.get("totals", {})
        if totals.get("samples_per_s"):
            writer.add_scalar("fleet/samples_per_s", float(totals["samples_per_s"]), global_step=last_step)
        writer.add_text("run/status", f"{report.get('status')} {report.get('reason', '')}".strip(), last_step)
        from metaps.run_report import controller_text, faults_text

        # what happened to the run, as the report says it: faults that fired (never the config's
        # schedule alone) and the controller's reaction
        for tag, text in (("run/faults", faults_text(report)), ("run/controller", controller_text(report))):
            if text:
                writer.add_text(tag, text, last_step)
    finally:
        writer.close()
    dirs.append(d)
    log.info("tensorboard logs written", extra=kv(dir=str(out_dir), runs=len(dirs)))
    return dirs
