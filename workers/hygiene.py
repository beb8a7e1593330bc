"""Training hygiene: a validation split, early stopping, best-checkpoint selection, lr schedule.

``train-local`` with ``[train] val_fraction > 0``::

    per train file: a seeded pick of round(val_fraction * batches) batches (>= 1) -> validation
    for each epoch:
        train on the other batches (the same step engine)
        validation loss = the training objective on the validation batches, no update
            (meta: query loss after adaptation; plain: the loss), eval mode (no dropout)
        lower than the best so far -> checkpoint ckpt-<step> (the "best" checkpoint)
        else one more bad epoch; early_stop_patience bad epochs in a row -> stop
    the best checkpoint is loaded back (rows, dense params, learned inner rates): the model
    that is evaluated and reported is the best epoch's, not the last one's

The picked batches are whole Meta-IO batches, so in the meta layout they are whole
tasks (users) never trained on: a cold-start validation. Validation pulls rows of its
ids (unseen ids get their initial rows, as in evaluation) and never pushes.

``[train] lr_schedule`` is :func:`lr_factor` on the dense optimizer's lr, applied by
the trainer before each step where this process runs the dense optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from metaps.core.log import kv
from workers.config import LrSchedule

log = logging.getLogger(__name__)


def lr_factor(schedule: LrSchedule, step: int, warmup_steps: int, total_steps: int) -> float:
    """The dense lr factor of step ``step`` (0-based).

    Args:
        schedule: the ``[train] lr_schedule``.
        step: steps done so far.
        warmup_steps: length of the linear warm-up.
        total_steps: planned steps of the run (``warmup_cosine`` reaches 0 there); <= 0: unknown.
    """
    schedule = LrSchedule(schedule)
    if schedule == LrSchedule.CONSTANT:
        return 1.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == LrSchedule.WARMUP or total_steps <= warmup_steps:
        return 1.0
    done = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * done))


def validation_split(dataset: Any, fraction: float, seed: int) -> dict[int, np.ndarray]:
    """Per file of ``dataset``: sorted batch indices held out for validation.

    Args:
        dataset: a :class:`meta_io.reader.MetaIODataset`.
        fraction: ``[train] val_fraction`` (> 0).
        seed: the pick's seed (``[train] seed``).

    Returns:
        file index -> int64 batch indices (at least one per file with two or more batches).
    """
    out: dict[int, np.ndarray] = {}
    for i in range(dataset.num_files):
        n = int(dataset.num_batches(i))
        k = min(n - 1, max(1, round(fraction * n))) if n > 1 else 0
        rng = np.random.default_rng([seed, i])
        out[i] = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    return out


def _runs(n: int, held: np.ndarray) -> list[tuple[int, int]]:
    """Maximal ``[start, stop)`` batch ranges of ``range(n)`` without the ``held`` indices."""
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    edges = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


@dataclass
class ValidationRecord:
    """What early stopping saw: one entry per epoch, and the checkpoint it kept."""

    losses: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    best_epoch: int = -1
    best_loss: float = math.inf
    best_checkpoint: str = ""
    stopped_early: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validation_loss(worker: Any, batches: list[tuple[int, int]]) -> float:
    """The training objective on validation batches, sample-weighted, without any update.

    Args:
        worker: the :class:`~workers.worker.Worker` (its trainer, rows and dataset).
        batches: ``(file, batch index)`` pairs.
    """
    tr = worker.trainer
    was = tr.model.training
    tr.model.eval()
    total, weight = 0.0, 0.0
    try:
        for name, b in batches:
            for batch in worker.dataset.read_range(name, b, b + 1):
                rows = tr.rows.pull({t: u.numpy() for t, u in batch.unique_ids.items()})
                res = tr.compute(batch, rows)
                n = float(res.metrics.get("tasks", 0.0)) or float(_rows_of(batch))
                total += float(res.outer_loss) * n
                weight += n
    finally:
        tr.model.train(was)
    return total / weight if weight else math.inf


def _rows_of(batch: Any) -> int:
    fb = getattr(batch, "features", None)
    return int(fb.num_rows()) if fb is not None else int(batch.query.num_rows())


def train_with_validation(worker: Any, job: Any, make_store: Callable[[], Any]) -> ValidationRecord:
    """Epochs over the non-held batches, validation after each, early stop, best restored.

    Args:
        worker: a ``train-local`` :class:`~workers.worker.Worker` (LocalRowSource).
        job: the job (``[train] epochs, val_fraction, early_stop_patience, seed, max_steps``).
        make_store: a fresh in-process store of the job's tables, to restore the best epoch into
            (``workers.local.local_store``; passed in so this module does not import the
            train-local driver that calls it).

    Returns:
        the :class:`ValidationRecord` (also logged).
    """
    from meta_io.prefetch import prefetch

    cfg = job.train
    held = validation_split(worker.dataset, cfg.val_fraction, cfg.seed)
    files = {i: int(worker.dataset.num_batches(i)) for i in range(worker.dataset.num_files)}
    val = [(name, int(b)) for name, idx in held.items() for b in idx]
    plan = [(name, a, b) for name, n in files.items() for a, b in _runs(n, held[name])]
    per_epoch = sum(b - a for _, a, b in plan)
    worker.trainer.total_steps = cfg.max_steps or per_epoch * cfg.epochs
    rec = ValidationRecord()
    bad = 0
    for epoch in range(cfg.epochs):
        for name, a, b in plan:
            for stats in worker.trainer.run(prefetch(worker.read(name, a, b), depth=2)):
                worker._after_step(stats)
            worker.shards_done += 1
            if worker.trainer._at_limit():
                break
        loss = validation_loss(worker, val)
        rec.losses.append(loss)
        rec.steps.append(worker.trainer.step_no)
        improved = loss < rec.best_loss
        if improved:
            rec.best_loss, rec.best_epoch = loss, epoch
            rec.best_checkpoint = str(worker.checkpoint(metrics={"val_loss": loss}))
            bad = 0
        else:
            bad += 1
        log.info("validation", extra=kv(epoch=epoch, step=worker.trainer.step_no, val_loss=round(loss, 5),
                                        best_epoch=rec.best_epoch, bad_epochs=bad))
        if worker.trainer._at_limit():
            break
        if cfg.early_stop_patience and bad >= cfg.early_stop_patience:
            rec.stopped_early = epoch + 1 < cfg.epochs
            break
    if rec.best_checkpoint and rec.best_epoch != len(rec.losses) - 1:
        restore(worker, make_store(), Path(rec.best_checkpoint))
    log.info("validation done", extra=kv(best_epoch=rec.best_epoch, best_loss=round(rec.best_loss, 5),
                                         epochs=len(rec.losses), stopped_early=rec.stopped_early,
                                         best_checkpoint=rec.best_checkpoint))
    return rec


def restore(worker: Any, store: Any, ckpt: Path) -> None:
    """Load a checkpoint into ``store`` (a fresh in-process one) and point the worker at it."""
    from ps.checkpoint import load_dense, load_shard
    from workers.row_source import LocalRowSource

    load_shard(store, ckpt, range(store.num_vshards))
    load_dense(store, ckpt)
    tr = worker.trainer
    worker.rows = tr.rows = LocalRowSource(store)
    values = store.dense.pull(tr._names)
    tr._load_dense(values)
    if tr._local_dense is not None:
        tr._local_dense.set(values)
    log.info("restored the best checkpoint", extra=kv(dir=str(ckpt)))
