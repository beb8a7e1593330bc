"""``metaps launch --resume RUN``: continue an interrupted run from its last committed cut.

A run interrupted (Ctrl-C, a killed launcher, a box that went down) keeps what a
continuation needs in its run directory: the controller's LMDB state (the DDS, its
ledger and the committed checkpoint cuts) and the checkpoints. Continuing means::

    the run's own directory and job file           (not a new run: report, ledger, TensorBoard go on)
    the controller on the run's state, rolled back to the latest committed cut
                                                   (shards done by the cut stay done; later ones are redone)
    every PS shard restored from that cut's checkpoint (rows and dense state of the cut)
    workers numbering steps from the cut's step    (LR schedule, step limit and logs go on)

so work after the cut is rolled back in the PS and in the DDS alike (the ledger marks it
replayed) and trained again. One thing is trained twice into the model: a shard in flight at
the cut is redone from its first batch, so its batches trained before the cut (they are in the
cut's rows) are trained again after it; the report counts them as replayed. A warm
start (``--resume-from``) is something else: a new run, fresh data accounting, the
model of a checkpoint.

The previous attempt's logs move to ``logs/attempt-N/`` and its report to
``report.attempt-N.json``. Refused, in one line: a run that succeeded (nothing to
continue), a run the controller failed (its state is not consistent: warm-start a new
run from a checkpoint), a run with no committed cut.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError
from common.log import kv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContinuePoint:
    """Where a continued run starts.

    Attributes:
        run_dir: the run directory.
        checkpoint: the latest committed cut's checkpoint directory.
        step: its step (workers number their steps from it).
        cut_id: the cut the controller rolls back to.
        attempt: this continuation's number (1: the first continuation).
    """

    run_dir: Path
    checkpoint: Path
    step: int
    cut_id: int
    attempt: int


def find_continue_point(run: str | Path) -> ContinuePoint:
    """The latest committed cut of ``run``, checked to be a run that can continue.

    Raises:
        ConfigError: not a run directory, a finished or failed run, or no committed cut.
    """
    from controller.state import StateStore

    d = Path(run).resolve()
    where = f"--resume {d}"
    if not (d / "job.toml").is_file() or not (d / "controller").is_dir():
        raise ConfigError(f"{where}: not a run directory of `metaps launch` (no job.toml and controller/ state)")
    rep = d / "report.json"
    if rep.is_file():
        try:
            status = str(json.loads(rep.read_text()).get("status", ""))
        except (OSError, ValueError):
            status = ""
        if status == "succeeded":
            raise ConfigError(f"{where}: the run succeeded; nothing to continue (warm-start a new run from it with "
                              f"--resume-from {d})")
    store = StateStore(d / "controller")
    try:
        failed = [body for _, body in store.items("events") if body.get("kind") == "run_failed"]
        cuts = [body for _, body in store.items("cuts") if body.get("state") == "committed"]
    finally:
        store.close()
    if failed:
        why = (failed[0].get("evidence") or {}).get("reason", "")
        raise ConfigError(f"{where}: the controller failed this run ({why}); its state is not consistent: warm-start "
                          f"a new run from a checkpoint with --resume-from {d}")
    if not cuts:
        from ps.checkpoint import latest_checkpoint

        every = _cut_interval(d)
        why = (f"[controller] checkpoint_interval_s = {every:g}" if every is not None else "its cut period")
        found = latest_checkpoint(d / "checkpoints")
        hint = (f"; its checkpoint {found.name} (written when it stopped) holds the model but no data accounting: "
                f"warm-start a new run from it with --resume-from {d}" if found is not None else "; start it again")
        raise ConfigError(f"{where}: no committed checkpoint cut to continue from (the run stopped before its first "
                          f"one, {why}){hint}")
    last = max(cuts, key=lambda c: int(c["cut_id"]))
    ckpt = Path(str(last.get("dir", "")))
    if not (ckpt / "manifest.json").is_file():
        raise ConfigError(f"{where}: the latest committed cut {last['cut_id']} names {ckpt}, which holds no "
                          f"manifest.json")
    attempt = 1 + sum(1 for p in d.glob("report.attempt-*.json"))
    return ContinuePoint(d, ckpt, int(last.get("step", 0)), int(last["cut_id"]), attempt)


def _cut_interval(run_dir: Path) -> float | None:
    """The run's ``[controller] checkpoint_interval_s`` (None: its job.toml does not read)."""
    try:
        from metaps.job import load_job

        return float(load_job(run_dir / "job.toml").controller.checkpoint_interval_s)
    except Exception:  # noqa: BLE001 -- only for the message
        return None


def set_aside_previous_attempt(point: ContinuePoint) -> None:
    """Move the previous attempt's logs to ``logs/attempt-N/`` and its report to
    ``report.attempt-N.json`` (the continuation writes its own)."""
    d = point.run_dir
    logs = d / "logs"
    if logs.is_dir():
        dest = logs / f"attempt-{point.attempt}"
        dest.mkdir(mode=0o750, exist_ok=True)
        for f in logs.glob("*.log"):
            f.rename(dest / f.name)
    rep = d / "report.json"
    if rep.exists():
        rep.rename(d / f"report.attempt-{point.attempt}.json")
    for ready in (d / "ps").glob("ps-*.ready"):
        ready.unlink()
    log.info("continuing the run", extra=kv(run_dir=str(d), cut=point.cut_id, step=point.step,
                                            checkpoint=str(point.checkpoint), attempt=point.attempt))
