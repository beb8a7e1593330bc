"""The rows of one table as numpy arrays: the unit checkpoints, migration and the wire move.

A plain dataclass of numpy arrays with no torch and no fbgemm behind it, so the code that
only reads or writes rows (checkpoint files, manifests, delivery export, the launcher's
checkpoint lookups) starts without loading the table engine (``ps.embedding_table``,
which re-exports :class:`TableRows` for the code that works with live tables).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TableRows:
    """Rows of one table with everything needed to move or restore them.

    Args:
        ids: int64 [n].
        weights: float32 [n, dim].
        state: optimizer state per row, e.g. ``{"momentum": [n]}`` (rowwise adagrad),
            ``{"momentum": [n, dim]}`` (adagrad), ``{"m", "v": [n, dim], "step": [n]}``
            (adam), ``{"z", "n": [n, dim]}`` (ftrl), ``{}`` (sgd).
        freq: int64 [n] push counts.
        last_step: int64 [n] table step of the last push.
    """

    ids: np.ndarray
    weights: np.ndarray
    state: dict[str, np.ndarray] = field(default_factory=dict)
    freq: np.ndarray | None = None
    last_step: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = self.ids.shape[0]
        if self.freq is None:
            self.freq = np.zeros(n, dtype=np.int64)
        if self.last_step is None:
            self.last_step = np.zeros(n, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def take(self, idx: np.ndarray) -> "TableRows":
        """The subset at positions ``idx``."""
        freq, last_step = self.freq, self.last_step
        assert freq is not None and last_step is not None  # set by __post_init__
        return TableRows(
            ids=self.ids[idx],
            weights=self.weights[idx],
            state={k: v[idx] for k, v in self.state.items()},
            freq=freq[idx],
            last_step=last_step[idx],
        )

    @staticmethod
    def concat(
        parts: list["TableRows"], dim: int, state_spec: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
    ) -> "TableRows":
        """Concatenate parts (an empty list gives empty rows of ``dim``)."""
        if not parts:
            state = {}
            for k, (shape, dt) in (state_spec or {}).items():
                state[k] = np.empty((0, *shape), dtype=dt)
            return TableRows(np.empty(0, np.int64), np.empty((0, dim), np.float32), state)
        return TableRows(
            ids=np.concatenate([p.ids for p in parts]),
            weights=np.concatenate([p.weights for p in parts]),
            state={k: np.concatenate([p.state[k] for p in parts]) for k in parts[0].state},
            freq=np.concatenate([p.freq for p in parts]),
            last_step=np.concatenate([p.last_step for p in parts]),
        )
