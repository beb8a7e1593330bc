"""TensorBoard logs of a run, written from ``report.json`` after it ends.

Layout (``tensorboard --logdir <run>/tb`` overlays the workers)::

    <run>/tb/worker-R/   train/loss, train/samples_per_s, train/pull_s, train/compute_s,
                         train/push_s (and any other numeric per-step figure), by step
    <run>/tb/fleet/      eval/<kind>/<head>/auc (final, at the last step), fleet/samples_per_s

Example::

    write_tensorboard(report, Path("runs/x/tb"))
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metaps.core.log import kv

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
        if not hist:
            continue
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
        for k, v in sorted(report.get("final_auc", {}).items()):
            writer.add_scalar(f"eval/{k}", float(v), global_step=last_step)
        totals = report.get("totals", {})
        if totals.get("samples_per_s"):
            writer.add_scalar("fleet/samples_per_s", float(totals["samples_per_s"]), global_step=last_step)
        writer.add_text("run/status", f"{report.get('status')} {report.get('reason', '')}".strip(), last_step)
    finally:
        writer.close()
    dirs.append(d)
    log.info("tensorboard logs written", extra=kv(dir=str(out_dir), runs=len(dirs)))
    return dirs
