"""One delivery (checkpoint -> gate -> publish -> retention), and the periodic loop.

One delivery, under the publish root's lock::

    resolve checkpoint --(not newer than LATEST?)--> nothing to do
          |
    export into .vNNNNNN.tmp  (delta on LATEST if --incremental and the chain allows)
          |
    gate: consistency + holdout AUC vs LATEST --refused--> delete staging, exit 3
          |
    record gate metrics in the manifest, publish (rename + LATEST), keep K

The periodic loop runs a delivery each ``every`` seconds; a tick only exports
when the run's latest checkpoint is newer than what LATEST was built from, and
does not retry a checkpoint the gate already refused. It is one long-lived
process, so it keeps an :class:`~delivery.reuse.ExportCache` across ticks: the
parsed configs, the built model, the traced dense network and the parent's
live ids of the last delivery are reused by the next incremental one (each
keyed by the content it stands for; every check still runs).

Progress: ``deliver_once(..., progress=hook)`` tells ``hook(stage, done, total)`` the
stages of :class:`~delivery.export.DeliverStage` in order: ``verify`` (the sha256
check of the checkpoint, one step), ``export`` (rows exported) and ``dense`` (the rest
of the bundle, one step), both from :func:`~delivery.export.export_bundle`, then
``gate`` (:func:`~delivery.gate.run_gate`: the consistency check, the holdout AUC comparison,
then one step per adaptation candidate scored; one step without a holdout) and ``publish``
(publish, LATEST and retention; one step). A delivery that finds nothing newer stops after the
first; a refused one after ``gate``. The loop passes the same hook to every tick.

Example::

    cfg = DeliveryConfig(out=Path("bundles"), incremental=True, keep=5)
    outcome = deliver_once(cfg, run="runs/main")
    run_periodic(cfg, run="runs/main", every_s=600)
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import lmdb

from delivery.bundle import DeliveryError, DeliveryWriteError, read_manifest, write_manifest, checksum_files
from delivery.config import DeliveryConfig
from delivery.export import (
    CheckpointSource, DeliverStage, ParentState, ProgressHook, export_bundle, parent_state, resolve_checkpoint,
)
from delivery.gate import GateReport, run_gate
from delivery.loader import bundle_chain
from delivery.publish import Publisher
from delivery.reuse import ExportCache
from common.log import kv

log = logging.getLogger(__name__)

_LOW_SPACE = 64 << 20
"""An LMDB write error with less than this free under the publish root is reported as a full disk
(LMDB reports ENOSPC while flushing its pages as "Input/output error")."""


class Status(str, enum.Enum):
    PUBLISHED = "published"
    UP_TO_DATE = "up_to_date"
    REFUSED = "refused"


@dataclass(frozen=True)
class DeliveryOutcome:
    """What one delivery did.

    Args:
        status: published, up_to_date (no newer checkpoint) or refused (gate).
        checkpoint: the checkpoint considered.
        version: the version published (or that would have been).
        kind: 'full' or 'delta'.
        gate: the gate report (None when nothing was exported).
    """

    status: Status
    checkpoint: Path
    version: str | None = None
    kind: str | None = None
    gate: GateReport | None = None

    @property
    def reason(self) -> str:
        if self.status is Status.REFUSED and self.gate is not None:
            return "; ".join(self.gate.reasons)
        return self.status.value


def _is_newer(src: CheckpointSource, published: Path | None) -> bool:
    """Whether ``src`` is due: nothing published, or a later checkpoint than the published one's.

    Steps compare only within one run's checkpoint folder: another run (a fresh `make run`, the
    next day's warm start) counts its own steps, so its checkpoint is due whatever its step (the
    AUC gate still decides whether it replaces the published bundle).
    """
    if published is None:
        return True
    m = read_manifest(published)
    was = Path(m.source.get("checkpoint", ""))
    here = src.path.resolve()
    if was == here:
        return False
    if was.parent != here.parent:
        return True
    return src.step > m.source_step


def _parent_for(
    cfg: DeliveryConfig, pub: Publisher, latest: str | None, cache: ExportCache | None = None
) -> ParentState | None:
    """The parent for an incremental export, or None when a full bundle is due."""
    if not cfg.incremental or latest is None:
        return None
    chain = bundle_chain(pub.root / latest)
    if len(chain) - 1 >= cfg.max_chain:
        log.info("delta chain at its limit; exporting a full bundle", extra=kv(chain=len(chain) - 1, max_chain=cfg.max_chain))
        return None
    m = chain[0][1]
    if m.dtype != cfg.dtype:
        log.info("dtype changed; exporting a full bundle", extra=kv(published=m.dtype.value, now=cfg.dtype.value))
        return None
    return parent_state(chain, cache)


def deliver_once(
    cfg: DeliveryConfig,
    run: str | Path | None = None,
    checkpoint: str | Path | None = None,
    force: bool = False,
    cache: ExportCache | None = None,
    progress: ProgressHook | None = None,
) -> DeliveryOutcome:
    """Deliver the latest checkpoint of ``run`` (or ``checkpoint``) to ``cfg.out``.

    Args:
        cfg: the delivery config.
        run: a run directory (its latest committed checkpoint is used).
        checkpoint: a checkpoint directory (instead of ``run``).
        force: deliver even if LATEST was built from the same or a newer checkpoint.
        cache: state reused from this process's earlier deliveries (:mod:`delivery.reuse`);
            None = nothing reused.
        progress: told ``(stage, done, total)`` of each stage (see the module docstring);
            None: nothing told.

    Raises:
        DeliveryError: bad input (missing checkpoint, no schema/model info, bad rows, ...);
            nothing already published is touched.
    """
    cfg.validate()
    ckpt = resolve_checkpoint(run, checkpoint)
    _step(progress, DeliverStage.VERIFY, 0)
    src = CheckpointSource.open(ckpt, cache=cache)
    _step(progress, DeliverStage.VERIFY, 1)
    pub = Publisher(cfg.out)
    try:
        return _deliver_locked(cfg, pub, ckpt, src, force, cache, progress)
    except (OSError, lmdb.Error) as exc:  # a full disk, an I/O error: one line; nothing partial is left
        raise write_failed(pub.root, exc) from None


def write_failed(root: Path, exc: BaseException) -> DeliveryWriteError:
    """The one-line error of a delivery whose writes under ``root`` failed (a full disk named as such)."""
    err = getattr(exc, "errno", None)
    what = " ".join(str(exc).split()) or type(exc).__name__
    try:
        free: int | None = shutil.disk_usage(root).free
    except OSError:
        free = None
    where = getattr(exc, "filename", None) or root
    if err in (errno.ENOSPC, errno.EDQUOT) or (isinstance(exc, lmdb.Error) and free is not None and free < _LOW_SPACE):
        code = errno.errorcode.get(err, "ENOSPC") if err in (errno.ENOSPC, errno.EDQUOT) else "ENOSPC"
        return DeliveryWriteError(f"{where}: no space left on device while writing the bundle ({code}: {what}; "
                                  f"{free} bytes free); nothing was published, LATEST unchanged")
    return DeliveryWriteError(f"{where}: I/O error while writing the bundle ({type(exc).__name__}: {what}); "
                              f"nothing was published, LATEST unchanged")


def _step(progress: ProgressHook | None, stage: DeliverStage, done: int) -> None:
    """Tell ``progress`` that the one-step ``stage`` starts (``done`` 0) or ended (1)."""
    if progress is not None:
        progress(stage, done, 1)


def _deliver_locked(cfg: DeliveryConfig, pub: Publisher, ckpt: Path, src: CheckpointSource, force: bool,
                    cache: ExportCache | None, progress: ProgressHook | None = None) -> DeliveryOutcome:
    """:func:`deliver_once` from taking the publish root's lock on."""
    with pub.locked():
        latest = pub.latest()
        published = pub.root / latest if latest else None
        if not force and not _is_newer(src, published):
            log.info("no newer checkpoint", extra=kv(checkpoint=ckpt, latest=latest))
            return DeliveryOutcome(Status.UP_TO_DATE, ckpt, latest)
        parent = _parent_for(cfg, pub, latest, cache)
        version = pub.next_version()
        staging = pub.staging_dir(version)
        try:
            manifest = export_bundle(src, staging, version, cfg, parent, cache, progress)
            report = run_gate(staging, published, cfg.holdout, cfg.max_auc_drop, cfg.holdout_rows, progress=progress)
            if not report.ok:
                log.warning("gate refused the bundle", extra=kv(version=version, reasons=report.reasons))
                shutil.rmtree(staging)
                return DeliveryOutcome(Status.REFUSED, ckpt, version, manifest.kind.value, report)
            # The manifest says whether an AUC gate passed it (consistency checks always run).
            record = report.record(cfg.holdout) if cfg.holdout else {"gated": False, "holdout": ""}
            manifest = dataclasses.replace(manifest, gate=record)
            manifest = dataclasses.replace(manifest, files=checksum_files(staging))
            _step(progress, DeliverStage.PUBLISH, 0)
            write_manifest(staging, manifest, fsync=False)  # publish fsyncs every file of the staging dir
            pub.publish(staging, version)
        except BaseException:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
            raise
        deleted = pub.retain(cfg.keep)
        _step(progress, DeliverStage.PUBLISH, 1)
    log.info("delivered", extra=kv(version=version, kind=manifest.kind.value, checkpoint=ckpt, deleted=deleted))
    return DeliveryOutcome(Status.PUBLISHED, ckpt, version, manifest.kind.value, report)


class PeriodicDelivery:
    """A delivery each tick, only when the run has a newer checkpoint.

    Args:
        cfg: the delivery config.
        run: the run directory to watch.
        progress: told each delivery's stages (see :func:`deliver_once`); None: nothing told.

    Example::

        loop = PeriodicDelivery(cfg, "runs/main")
        loop.run(every_s=600)            # until stop() or Ctrl-C
    """

    def __init__(self, cfg: DeliveryConfig, run: str | Path, progress: ProgressHook | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run)
        self.progress = progress
        """Told each tick's stages (see :func:`deliver_once`); None: nothing told."""
        self.refused: set[Path] = set()
        self.cache = ExportCache()
        """Reused by this loop's deliveries (content-keyed; see :mod:`delivery.reuse`)."""
        self._stop = threading.Event()

    def tick(self) -> DeliveryOutcome | None:
        """One check-and-deliver; None when there is no checkpoint yet or it was refused before."""
        try:
            ckpt = resolve_checkpoint(run=self.run_dir)
        except DeliveryError as exc:
            log.info("nothing to deliver yet", extra=kv(reason=str(exc)))
            return None
        if ckpt in self.refused:
            log.info("latest checkpoint was refused by the gate; waiting for a newer one", extra=kv(checkpoint=ckpt))
            return None
        outcome = deliver_once(self.cfg, checkpoint=ckpt, cache=self.cache, progress=self.progress)
        if outcome.status is Status.REFUSED:
            self.refused.add(ckpt)
        return outcome

    def run(self, every_s: float, max_ticks: int | None = None) -> list[DeliveryOutcome | None]:
        """Tick every ``every_s`` seconds until :meth:`stop` (or ``max_ticks``)."""
        outcomes: list[DeliveryOutcome | None] = []
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                outcomes.append(self.tick())
            except DeliveryError as exc:
                # A bad checkpoint must not end the loop; the next one may be fine.
                log.error("delivery failed", extra=kv(run=self.run_dir, error=str(exc)))
                outcomes.append(None)
            if max_ticks is not None and len(outcomes) >= max_ticks:
                break
            self._stop.wait(max(0.0, every_s - (time.monotonic() - t0)))
        return outcomes

    def stop(self) -> None:
        self._stop.set()
