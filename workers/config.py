"""Worker settings: ``[train]`` in the job TOML.

Example::

    [train]
    mode = "meta"            # "plain" supervised CTR/CVR, or G-Meta "meta"
    workers = 2
    epochs = 1
    dense_sync = "ps"        # dense params on the PS, or "allreduce" between workers
                             # (either way they use [ps].dense_optimizer)
    overlap = "auto"         # overlap row traffic with compute where measured faster (true / false: always / never)
    device = "cpu"           # "cpu", "cuda", "cuda:N" or "auto" (cuda when available)
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Literal

_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+|auto)$")


class TrainMode(str, enum.Enum):
    PLAIN = "plain"
    META = "meta"


class LrSchedule(str, enum.Enum):
    """``[train] lr_schedule``: a factor on the dense optimizer's lr per step."""

    CONSTANT = "constant"
    """Factor 1 throughout."""
    WARMUP = "warmup"
    """Linear from 1/warmup_steps to 1 over ``warmup_steps``, then 1."""
    WARMUP_COSINE = "warmup_cosine"
    """The warm-up, then a cosine from 1 to 0 at the last step (``max_steps``, or the
    dataset's batches x epochs in train-local)."""


class EarlyStopMetric(str, enum.Enum):
    """``[train] early_stop_metric``: the validation figure that picks the best epoch and stops training."""

    AUC = "auc"
    """The mean AUC over the heads (higher is better; in meta mode the adapted AUC of the held-out tasks)."""
    LOSS = "loss"
    """The training objective on the validation batches (lower is better)."""


class DenseSync(str, enum.Enum):
    PS = "ps"
    """Dense parameters live on PS shard 0; workers push grads, pull params."""
    ALLREDUCE = "allreduce"
    """Workers average dense grads with torch.distributed and step locally."""


@dataclass(frozen=True)
class TrainConfig:
    """How workers train.

    Args:
        mode: plain supervised training or G-Meta meta-learning.
        workers: worker processes in the fleet.
        epochs: passes over the train dataset.
        dense_sync: where dense parameters are kept in step.
        overlap: send the last step's push and dense gradients with the next batch's pull
            while the current step computes; rows and (``dense_sync = "ps"``) dense parameters
            are then exactly one step stale for this worker. ``"auto"`` (default): the
            worker times its first steps both ways and keeps the faster (``workers.overlap``;
            logged, and in the worker's report); ``true`` / ``false``: always / never, a fixed
            schedule (reproducible runs).
        max_steps: stop after this many steps per worker (0: no limit).
        log_every: steps between progress log lines and metric reports.
        eval_batches: held-out meta-batches to evaluate on (0: all).
        threads: torch intra-op threads per worker process.
        seed: seed of the dense model initialisation (same on every worker).
        allreduce_port: rendezvous port of the gloo process group (0: launcher picks).
        dense_publish_steps: all-reduce mode: rank 0 stores the group's dense parameters on the
            PS every this many steps (and before every checkpoint); a group that re-forms after a
            rank failure, or a warm start, continues from that copy, so a rank restart loses at
            most this many steps of dense updates, never the model (0: only before checkpoints).
        device: device of the worker process (``cpu``, ``cuda``, ``cuda:N``, ``auto`` = cuda when
            available): where ``train-local`` keeps its in-process tables; a fleet worker checks it
            at start-up. The dense model computes on CPU in this version.
        tb_every_steps: a fleet worker writes live TensorBoard scalars (``<run>/tb/worker-R.inc-N``) and
            rewrites its incarnation report every this many steps (0: only at the end).
        eval_every_steps: the checkpoint leader evaluates on a bounded sample of ``[data] eval`` every this many
            steps, so AUC is a curve in TensorBoard and report.json (0: only the final evaluation).
        eval_max_rows: rows of the periodic evaluation's sample (the first batches of the eval set).
        val_fraction: share of each train file's batches held out (a seeded pick, ``seed``) to
            validate on after every epoch (``train-local``): the best epoch's checkpoint is kept
            and restored at the end. 0 (default) = no validation, every batch trains (a fleet
            and ``train-local`` then train on the same rows). 0.1 is a sound value for unseen data.
            ``[data] validation`` gives a dataset of its own instead (a time split's later rows).
        early_stop_patience: epochs without a better validation figure (``early_stop_metric``)
            before training stops (with ``val_fraction`` > 0 or ``[data] validation``). Default 2: one noisy epoch does not
            stop training, two in a row on data never seen before mean it is overfitting. 0 = never
            stop early (the best epoch is still restored).
        early_stop_metric: the validation figure that picks the best epoch (the one restored)
            and counts the bad epochs: ``auc`` (default: the metric that matters, the mean AUC
            over the heads, higher is better; in meta mode after adaptation, as the validation
            loss is) or ``loss`` (the training objective, lower is better; it tends to stop a few
            epochs before the best AUC). Both are recorded per epoch in report.json's
            ``validation``.
        lr_schedule: ``constant`` (default: Adam's bias correction already damps the first
            steps, and a decay needs the run length, unknown on new data), ``warmup`` or
            ``warmup_cosine``; a factor on the dense optimizer's lr (the embedding tables'
            row-wise optimizers on the PS keep theirs). Needs the dense optimizer in the
            worker: ``train-local`` or ``dense_sync = "allreduce"``.
        warmup_steps: steps of the linear warm-up. Default 100: a few hundred samples of
            statistics for Adam before full steps, short next to any real run.
    """

    mode: TrainMode = TrainMode.META
    workers: int = 2
    epochs: int = 1
    dense_sync: DenseSync = DenseSync.PS
    overlap: bool | Literal["auto"] = "auto"
    max_steps: int = 0
    log_every: int = 20
    eval_batches: int = 0
    threads: int = 1
    seed: int = 0
    allreduce_port: int = 0
    dense_publish_steps: int = 50
    device: str = "cpu"
    tb_every_steps: int = 10
    eval_every_steps: int = 0
    eval_max_rows: int = 2048
    val_fraction: float = 0.0
    early_stop_patience: int = 2
    early_stop_metric: EarlyStopMetric = EarlyStopMetric.AUC
    lr_schedule: LrSchedule = LrSchedule.CONSTANT
    warmup_steps: int = 100

    def validate(self) -> None:
        object.__setattr__(self, "lr_schedule", LrSchedule(self.lr_schedule))
        object.__setattr__(self, "early_stop_metric", EarlyStopMetric(self.early_stop_metric))
        if not 0.0 <= self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in [0, 0.5), got {self.val_fraction}")
        if self.early_stop_patience < 0:
            raise ValueError(f"early_stop_patience must be >= 0, got {self.early_stop_patience}")
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.dense_publish_steps < 0:
            raise ValueError(f"dense_publish_steps must be >= 0 (0: only before checkpoints), got {self.dense_publish_steps}")
        if self.tb_every_steps < 0:
            raise ValueError(f"tb_every_steps must be >= 0 (0: no live scalars), got {self.tb_every_steps}")
        if self.eval_every_steps < 0:
            raise ValueError(f"eval_every_steps must be >= 0 (0: final evaluation only), got {self.eval_every_steps}")
        if self.eval_max_rows < 1:
            raise ValueError(f"eval_max_rows must be >= 1, got {self.eval_max_rows}")
        if not _DEVICE.match(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}")


def resolve_device(device: str) -> str:
    """``[train] device`` as a torch device string on this machine.

    Args:
        device: a validated setting (``cpu``, ``cuda``, ``cuda:N``, ``auto``).

    Returns:
        ``"cpu"``, or ``"cuda"`` / ``"cuda:N"`` when that GPU exists.

    Raises:
        ConfigError: CUDA was asked for and torch sees no (such) GPU; one line.
    """
    import torch

    from common.errors import ConfigError

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(
            f"[train] device = {device!r}: torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}, a CPU build or no GPU); use 'cpu' or 'auto', or install the GPU set "
            f"(requirements/gpu.txt)"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"[train] device = {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
