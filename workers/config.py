"""Worker settings: ``[train]`` in the job TOML.

Example::

    [train]
    mode = "meta"            # "plain" supervised CTR/CVR, or G-Meta "meta"
    workers = 2
    epochs = 1
    dense_sync = "ps"        # dense params on the PS, or "allreduce" between workers
                             # (either way they use [ps].dense_optimizer)
    overlap = true           # pull the next batch's rows during this step's compute
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TrainMode(str, enum.Enum):
    PLAIN = "plain"
    META = "meta"


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
        overlap: pull the next batch's rows while the current step computes.
            Rows are then at most one step stale for this worker.
        max_steps: stop after this many steps per worker (0: no limit).
        log_every: steps between progress log lines and metric reports.
        eval_batches: held-out meta-batches to evaluate on (0: all).
        threads: torch intra-op threads per worker process.
        seed: seed of the dense model initialisation (same on every worker).
        allreduce_port: rendezvous port of the gloo process group (0: launcher picks).
    """

    mode: TrainMode = TrainMode.META
    workers: int = 2
    epochs: int = 1
    dense_sync: DenseSync = DenseSync.PS
    overlap: bool = True
    max_steps: int = 0
    log_every: int = 20
    eval_batches: int = 0
    threads: int = 1
    seed: int = 0
    allreduce_port: int = 0

    def validate(self) -> None:
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
