"""What a worker tells a caller in its own process while it trains: the Python API's callbacks.

The worker calls its :class:`TrainingCallbacks` at the end of every step, after every
periodic evaluation and after every checkpoint it writes (``workers/worker.py``); a
call returns a non-empty reason to stop training (``''``: go on). A stop asked for ends
training after the current step, like the step limit: the worker then evaluates and
writes its final checkpoint as usual, and ``Worker.stop_asked`` keeps the reason.

Only a worker in the caller's process runs them (``metaps train-local``,
``metaps.api.train_local``); the fleet's worker processes have none. The events are
small frozen values; this module imports nothing of the project, so ``workers/`` keeps
pointing down.

Example::

    class Stopper:
        def step(self, event: StepEvent) -> str:
            return "loss is low enough" if event.loss < 0.3 else ""
        def evaluated(self, event: EvalEvent) -> str:
            return ""
        def checkpointed(self, event: CheckpointEvent) -> str:
            return ""

    worker.callbacks = Stopper()
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class StepEvent:
    """One training step done.

    Args:
        step: the step number just done (1-based; a continued run goes on from its checkpoint's).
        loss: that step's training loss (``nan`` when not known).
        samples: samples trained so far.
        total_steps: the run's length in steps when it is known (0: not known).
        metrics: the step's own figures (per-head losses, ...), as the trainer reports them.
        fraction: share of the run done, 0..1 (None: not known).
    """

    step: int
    loss: float
    samples: int
    total_steps: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    fraction: float | None = None


@dataclass(frozen=True)
class EvalEvent:
    """An evaluation done.

    Args:
        step: the step the model was evaluated at.
        metrics: flat figures, ``"base/click/auc"`` -> value (``adapted/...`` after per-task adaptation).
        final: the run's final evaluation on the whole eval set (False: a periodic one, on its
            first ``[train] eval_max_rows`` rows).
    """

    step: int
    metrics: Mapping[str, float]
    final: bool = False


@dataclass(frozen=True)
class CheckpointEvent:
    """A checkpoint committed.

    Args:
        step: its step.
        path: its directory (``RUN/checkpoints/ckpt-<step>``).
    """

    step: int
    path: Path


class TrainingCallbacks(Protocol):
    """What a worker calls in its own process; each call returns a reason to stop ('' to go on)."""

    def step(self, event: StepEvent) -> str:
        """After every training step."""
        ...

    def evaluated(self, event: EvalEvent) -> str:
        """After a periodic evaluation (and train-local's final one)."""
        ...

    def checkpointed(self, event: CheckpointEvent) -> str:
        """After a checkpoint is committed."""
        ...


class NoCallbacks:
    """The default: nothing is called, nothing stops."""

    def step(self, event: StepEvent) -> str:
        return ""

    def evaluated(self, event: EvalEvent) -> str:
        return ""

    def checkpointed(self, event: CheckpointEvent) -> str:
        return ""


NO_CALLBACKS: TrainingCallbacks = NoCallbacks()
