"""``metaps train-local`` leaves a run directory the way ``metaps launch`` does.

::

    [run] dir/<name>-<time>/        (or --run-dir, new or empty)
        job.toml          the effective job (overrides applied, token redacted)
        workers/worker-0.json, checkpoints/ckpt-<step>/, eval/
        report.json, tb/, plots/    the launcher's run-report code (metaps.run_report,
                                    metaps.tb, metaps.plots) over this one-process run;
                                    report.json also holds ``validation`` (early stopping's
                                    record, workers/hygiene.py) when [train] val_fraction > 0
    [run] dir/latest -> the run     (auto-named runs only, as launch does)

Everything is checked before the directory is made: the job (with ``--set``) and
:func:`metaps.preflight.preflight` (a missing dataset says which command builds it).

Example::

    rep, run_dir = run_local(job, run_dir="")
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.log import kv

if TYPE_CHECKING:
    from metaps.job import JobConfig
    from workers.callbacks import TrainingCallbacks

log = logging.getLogger(__name__)


def run_local(job: "JobConfig", run_dir: str = "", plots: bool | None = None,
              callbacks: "TrainingCallbacks | None" = None) -> tuple[dict[str, Any], Path]:
    """Preflight, make the run dir, train in this process, write the report and its artefacts.

    Args:
        job: the parsed job (overrides applied).
        run_dir: run directory, new or empty ('' = ``[run] dir/<name>-<time>``, pointed at by ``latest``).
        plots: draw ``plots/`` (matplotlib: about as long as a short run itself); False skips them;
            None: as ``[run] plots`` says.
        callbacks: the worker's in-process callbacks (workers/callbacks.py); a stop they ask for
            ends training early: the run still evaluates and checkpoints, and its report says
            ``status = "stopped"``, the reason, and the steps run of the run's length.

    Returns:
        (report.json's dict, the run directory)
    """
    from common.security import make_run_dir
    from common.toml_writer import write
    from metaps.launch import LaunchConfig, _new_run_dir, mark_latest, settle_latest
    from metaps.plots import make_plots
    from metaps.preflight import preflight
    from metaps.run_report import build_report, write_report
    from metaps.tb import write_tensorboard

    d, auto_named = _new_run_dir(LaunchConfig(config=job.source or "<job>", run_dir=run_dir), job)
    preflight(job)  # every deterministic problem, in one line, before the run dir exists
    from workers.local import train_local  # torch: only once the job passed its checks (a refusal stays fast)

    for sub in ("", "workers", "checkpoints"):
        make_run_dir(d / sub)
    job = job.with_overrides(run=dataclasses.replace(job.run, dir=str(d)),
                             train=dataclasses.replace(job.train, workers=1))
    write(d / "job.toml", job.to_dict())
    # the launcher's rule: latest names the run from its start, and never a failed run
    previous = mark_latest(d) if auto_named else None
    t0 = time.time()
    try:
        worker_rep, worker = train_local(job, d, callbacks=callbacks)
    except BaseException:
        settle_latest(d, False, previous)
        raise
    stopped = str(worker_rep.get("stop_asked") or "")
    rep = build_report(d, job, status="stopped" if stopped else "succeeded", reason=stopped, started=t0,
                       checkpoint=str(worker_rep.get("checkpoint") or ""),
                       notes=["metaps train-local: one process, local tables, no PS fleet or controller"])
    if stopped:  # no controller ledger here: say what ran of the run's length, and why it ended
        total = int(getattr(worker.trainer, "total_steps", 0) or 0)
        rep["coverage_summary"] = (f"{worker_rep['steps']}/{total or '?'} steps (stopped: {stopped})")
    if worker_rep.get("validation") is not None:
        # early stopping's record (workers/hygiene.py): the metric, per-epoch validation loss and
        # AUC, the best epoch and its checkpoint, why the epochs ended; not only in the log
        rep["validation"] = worker_rep["validation"]
    write_report(d, rep)
    for what, fn in (("tensorboard", lambda: write_tensorboard(rep, d / "tb")),
                     ("plots", lambda: make_plots(rep, d / "plots"))):
        if what == "plots" and not (job.run.plots if plots is None else plots):
            log.info("plots not drawn", extra=kv(draw=f"metaps run-report --run-dir {d}"))
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001 -- the report stands without its pictures
            log.exception("could not write run artefact", extra=kv(what=what))
    settle_latest(d, True, previous)
    return {**rep, "worker": worker_rep}, d
