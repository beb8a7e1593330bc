"""Training hygiene: a validation split, early stopping, best-checkpoint selection, lr schedule.

``train-local`` with ``[train] val_fraction > 0`` or a ``[data] validation`` dataset::

    per train file: a seeded pick of round(val_fraction * batches) batches (>= 1) -> validation
        (or: every batch of the [data] validation dataset, and every train batch trains)
    for each epoch:
        train on the other batches (the same step engine), in a one-worker fleet's order
        (common.shard_order: the DDS's shuffled shards, the held-out batches left out)
        validation loss = the training objective on the validation batches, no update
            (meta: query loss after adaptation; plain: the loss), eval mode (no dropout)
        validation AUC = per head on the same batches (meta: adapted, as the loss is);
            its mean over the heads with both classes present
        the [train] early_stop_metric (auc: higher, loss: lower) better than the best so far
            -> checkpoint ckpt-<step> (the "best" checkpoint)
        else one more bad epoch; early_stop_patience bad epochs in a row -> stop
    the best checkpoint is loaded back (rows, dense params, learned inner rates): the model
    that is evaluated and reported is the best epoch's, not the last one's

AUC is the default metric: the loss tends to turn up a few epochs before the AUC turns
down (issue 29), so stopping on the loss gives away ranking quality. Both figures are
recorded per epoch in the :class:`ValidationRecord`, with why training stopped;
``train-local`` puts it in the worker report and the run's ``report.json``
(``validation``).

The picked batches are whole Meta-IO batches, so in the meta layout they are whole
tasks (users) never trained on: a cold-start validation. A random pick cannot see drift
over time; ``[data] validation`` takes a dataset built from the later rows of a time split
(``metaps meta-io split-holdout --by time``) instead, so the epoch kept is the one that
scores the future best. Validation pulls rows of its
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

from common.log import kv
from common.shard_order import shard_order
from workers.config import EarlyStopMetric, LrSchedule, TrainMode

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


def training_plan(files: dict[int, int], held: dict[int, np.ndarray], dds: Any, epoch: int) -> list[tuple[int, int, int]]:
    """``(file, start, stop)`` ranges train-local trains in ``epoch``: a one-worker fleet's order
    (:func:`common.shard_order.shard_order`, the DDS's shuffled shards) without the held-out batches.

    Args:
        files: file index -> its record batches.
        held: file index -> the validation batches (:func:`validation_split`; empty arrays: none).
        dds: the job's ``[controller.dds]`` (``batches_per_shard``, ``seed``).
        epoch: 0-based.
    """
    order = shard_order([files[i] for i in range(len(files))], dds.batches_per_shard, dds.seed, epoch, "train")
    return [(f, a, b) for f, s, e in order for a, b in _runs_between(s, e, held[f])]


def _runs_between(start: int, stop: int, held: np.ndarray) -> list[tuple[int, int]]:
    """Maximal ``[a, b)`` ranges of ``range(start, stop)`` without the ``held`` indices."""
    inside = held[(held >= start) & (held < stop)] - start
    return [(start + a, start + b) for a, b in _runs(stop - start, inside)]


def _runs(n: int, held: np.ndarray) -> list[tuple[int, int]]:
    """Maximal ``[start, stop)`` batch ranges of ``range(n)`` without the ``held`` indices."""
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    edges = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


@dataclass
class ValidationRecord:
    """What early stopping saw: one entry per epoch, the checkpoint it kept, and why it stopped.

    Args:
        metric: the ``[train] early_stop_metric`` that chose ``best_epoch`` (``auc`` / ``loss``).
        losses: validation loss per epoch.
        aucs: mean validation AUC over the heads per epoch (NaN where no head has both classes).
        head_aucs: validation AUC per head per epoch.
        steps: training steps done at each epoch's end.
        best_epoch: the epoch whose checkpoint was kept and restored (0-based; -1: none).
        best_value: its ``metric`` figure.
        best_loss / best_auc: its validation loss and mean AUC.
        best_checkpoint: the kept checkpoint's directory.
        stopped_early: training stopped before ``epochs`` for lack of improvement.
        stop_reason: why the epochs ended (``patience``: ``early_stop_patience`` epochs without a
            better figure; ``max_steps``; ``epochs``: all ran), with the figures, in words.
    """

    metric: str = EarlyStopMetric.AUC.value
    losses: list[float] = field(default_factory=list)
    aucs: list[float] = field(default_factory=list)
    head_aucs: list[dict[str, float]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    best_epoch: int = -1
    best_value: float = math.nan
    best_loss: float = math.inf
    best_auc: float = math.nan
    best_checkpoint: str = ""
    stopped_early: bool = False
    stop_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON values: an undefined figure (NaN, inf) is ``None`` (strict JSON)."""

        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, list):
                return [clean(x) for x in v]
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return v

        return {k: clean(v) for k, v in dataclasses.asdict(self).items()}

    def better(self, value: float) -> bool:
        """Whether an epoch's ``metric`` figure beats the best so far (NaN never does)."""
        if not math.isfinite(value):
            return False
        if self.best_epoch < 0 or not math.isfinite(self.best_value):
            return True
        return value > self.best_value if self.metric == EarlyStopMetric.AUC.value else value < self.best_value


def validation_loss(worker: Any, batches: list[tuple[int, int]], dataset: Any = None) -> float:
    """The training objective on validation batches, sample-weighted, without any update.

    Args:
        worker: the :class:`~workers.worker.Worker` (its trainer, rows and dataset).
        batches: ``(file, batch index)`` pairs.
        dataset: the :class:`meta_io.reader.MetaIODataset` they index (None: the worker's).
    """
    ds = worker.dataset if dataset is None else dataset
    tr = worker.trainer
    was = tr.model.training
    tr.model.eval()
    total, weight = 0.0, 0.0
    try:
        for name, b in batches:
            for batch in ds.read_range(name, b, b + 1):
                rows = tr.rows.pull({t: u.numpy() for t, u in batch.unique_ids.items()})
                res = tr.compute(batch, rows)
                n = float(res.metrics.get("tasks", 0.0)) or float(_rows_of(batch))
                total += float(res.outer_loss) * n
                weight += n
    finally:
        tr.model.train(was)
    return total / weight if weight else math.inf


def validation_auc(worker: Any, batches: list[tuple[int, int]], dataset: Any = None) -> dict[str, float]:
    """AUC per head on validation batches, without any update (eval mode).

    Meta mode scores the query rows after adapting on each task's support rows (the
    trainer's inner loop), as the validation loss does; plain mode scores every row.

    Args:
        worker: the :class:`~workers.worker.Worker` (its trainer, rows and dataset).
        batches: ``(file, batch index)`` pairs.
        dataset: the :class:`meta_io.reader.MetaIODataset` they index (None: the worker's).

    Returns:
        head -> AUC (NaN where the validation rows hold one class only).
    """
    from common.evaluation import auc
    from workers.evaluation import score_batches

    tr = worker.trainer
    meta = TrainMode(worker.job.train.mode) == TrainMode.META

    ds = worker.dataset if dataset is None else dataset

    def read() -> Any:
        for name, b in batches:
            yield from ds.read_range(name, b, b + 1)

    scores = score_batches(tr.model, tr.rows, read(), tr.inner_loop if meta else None, adapt=meta)
    arrays = scores["adapted"] if meta and "adapted" in scores else scores["base"]
    return {h: float(auc(a["target"].astype(np.float64), a["score"].astype(np.float64)))
            for h, a in sorted(arrays.items())}


def mean_auc(head_aucs: dict[str, float]) -> float:
    """The mean of the defined (finite) head AUCs; NaN when none is."""
    vals = [v for v in head_aucs.values() if math.isfinite(v)]
    return float(np.mean(vals)) if vals else math.nan


def _rows_of(batch: Any) -> int:
    fb = getattr(batch, "features", None)
    return int(fb.num_rows()) if fb is not None else int(batch.query.num_rows())


def train_with_validation(worker: Any, job: Any, make_store: Callable[[], Any]) -> ValidationRecord:
    """Epochs over the non-held batches, validation after each, early stop, best restored.

    Args:
        worker: a ``train-local`` :class:`~workers.worker.Worker` (LocalRowSource).
        job: the job (``[train] epochs, val_fraction, early_stop_patience, early_stop_metric, seed,
            max_steps``; ``[data] validation``).
        make_store: a fresh in-process store of the job's tables, to restore the best epoch into
            (``workers.local.local_store``; passed in so this module does not import the
            train-local driver that calls it).

    Returns:
        the :class:`ValidationRecord` (also logged).
    """
    from meta_io.prefetch import prefetch

    cfg = job.train
    files = {i: int(worker.dataset.num_batches(i)) for i in range(worker.dataset.num_files)}
    if job.data.validation:
        from meta_io.reader import MetaIODataset

        vds = MetaIODataset(job.data.validation)
        held = {i: np.zeros(0, np.int64) for i in files}
        val = [(name, b) for name in range(vds.num_files) for b in range(int(vds.num_batches(name)))]
    else:
        vds = worker.dataset
        held = validation_split(worker.dataset, cfg.val_fraction, cfg.seed)
        val = [(name, int(b)) for name, idx in held.items() for b in idx]
    per_epoch = sum(files.values()) - sum(int(h.size) for h in held.values())
    worker.trainer.total_steps = cfg.max_steps or per_epoch * cfg.epochs
    metric = EarlyStopMetric(cfg.early_stop_metric)
    rec = ValidationRecord(metric=metric.value)
    bad = 0
    for epoch in range(cfg.epochs):
        for name, a, b in training_plan(files, held, job.controller.dds, epoch):
            for stats in worker.trainer.run(prefetch(worker.read(name, a, b), depth=2)):
                worker._after_step(stats)
                if worker.stop_asked:  # a callback asked to stop (workers/callbacks.py)
                    break
            worker.shards_done += 1
            if worker.trainer._at_limit() or worker.stop_asked:
                break
        loss = validation_loss(worker, val, vds)
        heads = validation_auc(worker, val, vds)
        val_auc = mean_auc(heads)
        rec.losses.append(loss)
        rec.aucs.append(val_auc)
        rec.head_aucs.append(heads)
        rec.steps.append(worker.trainer.step_no)
        value = val_auc if metric == EarlyStopMetric.AUC else loss
        if rec.better(value):
            rec.best_value, rec.best_epoch, rec.best_loss, rec.best_auc = value, epoch, loss, val_auc
            figures = {"val_loss": loss, **({"val_auc": val_auc} if math.isfinite(val_auc) else {})}
            rec.best_checkpoint = str(worker.checkpoint(metrics=figures))
            bad = 0
        else:
            bad += 1
        log.info("validation", extra=kv(epoch=epoch, step=worker.trainer.step_no, val_loss=round(loss, 5),
                                        val_auc=round(val_auc, 5), metric=metric.value, best_epoch=rec.best_epoch,
                                        bad_epochs=bad))
        if worker.trainer._at_limit():
            rec.stop_reason = f"max_steps: {cfg.max_steps} steps reached in epoch {epoch}"
            break
        if worker.stop_asked:
            rec.stop_reason = f"callback: {worker.stop_asked} (epoch {epoch})"
            break
        if cfg.early_stop_patience and bad >= cfg.early_stop_patience:
            rec.stopped_early = epoch + 1 < cfg.epochs
            word = "higher validation auc" if metric == EarlyStopMetric.AUC else "lower validation loss"
            rec.stop_reason = (f"patience: {bad} epochs without a {word} than epoch {rec.best_epoch}'s "
                               f"{rec.best_value:.5f} (early_stop_patience = {cfg.early_stop_patience})")
            break
    else:
        rec.stop_reason = f"epochs: all {cfg.epochs} epochs ran"
    if rec.best_checkpoint and rec.best_epoch != len(rec.losses) - 1:
        restore(worker, make_store(), Path(rec.best_checkpoint))
    log.info("validation done", extra=kv(metric=metric.value, best_epoch=rec.best_epoch,
                                         best_value=round(rec.best_value, 5), best_loss=round(rec.best_loss, 5),
                                         best_auc=round(rec.best_auc, 5), epochs=len(rec.losses),
                                         stopped_early=rec.stopped_early, stop_reason=rec.stop_reason,
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
