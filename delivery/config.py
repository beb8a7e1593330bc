"""Configuration of a delivery job (``metaps deliver`` / ``[delivery]`` in a job TOML).

Example::

    cfg = DeliveryConfig(out=Path("bundles"), incremental=True, keep=5,
                         holdout="data/holdout.parquet", max_auc_drop=0.005)
    cfg.validate()

or in TOML::

    [delivery]
    out = "bundles"
    incremental = true
    keep = 5
    dtype = "fp16"
    every = "10m"
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class RowDtype(str, enum.Enum):
    """How embedding rows are stored in a bundle's LMDB (serving reads them as fp32)."""

    FP32 = "fp32"
    FP16 = "fp16"

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(np.float32 if self is RowDtype.FP32 else np.float16)


_INTERVAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_interval(text: str) -> float:
    """Seconds in an interval such as ``"10m"``, ``"30s"``, ``"1.5h"`` or ``"45"`` (seconds).

    Args:
        text: a number with an optional unit (ms, s, m, h, d).

    Example::

        >>> parse_interval("10m")
        600.0
    """
    m = _INTERVAL.match(text)
    if not m:
        raise ValueError(f"bad interval {text!r}: expected a number and an optional unit (ms, s, m, h, d), e.g. '10m'")
    value = float(m.group(1)) * _UNIT_S[m.group(2) or "s"]
    if value <= 0:
        raise ValueError(f"interval must be > 0, got {text!r}")
    return value


@dataclass(frozen=True)
class DeliveryConfig:
    """What one delivery (or a periodic loop of them) does.

    Args:
        out: publish root; versions live in ``out/v000001``... and ``out/LATEST`` names the served one.
        incremental: publish a delta against LATEST (rows changed since it, plus removed ids)
            when LATEST is compatible; a full bundle otherwise.
        keep: how many newest versions to keep (plus whatever chains they need).
        dtype: row storage in the bundle (fp16 halves the size; serving upcasts to fp32).
        max_chain: deltas allowed on top of one base; the next delivery after that is full,
            so a loader never replays a long chain.
        holdout: evaluation data for the gate (Parquet file/dir, or a Meta-IO dataset dir);
            '' = no AUC gate (consistency checks still run).
        max_auc_drop: refuse to publish if the new AUC is below the published AUC minus this.
        holdout_rows: cap on holdout rows evaluated (0 = all).
        every: periodic loop interval ('' = one shot), e.g. '10m'.
        map_size_gb: LMDB map size ceiling of the embeddings file (sparse on disk).
    """

    out: Path = Path("bundles")
    incremental: bool = False
    keep: int = 5
    dtype: RowDtype = RowDtype.FP32
    max_chain: int = 8
    holdout: str = ""
    max_auc_drop: float = 0.01
    holdout_rows: int = 0
    every: str = ""
    map_size_gb: float = 64.0

    def validate(self) -> None:
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        if self.max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {self.max_chain}")
        if not (0.0 <= self.max_auc_drop <= 1.0):
            raise ValueError(f"max_auc_drop must be in [0, 1], got {self.max_auc_drop}")
        if self.holdout_rows < 0:
            raise ValueError(f"holdout_rows must be >= 0, got {self.holdout_rows}")
        if self.map_size_gb <= 0:
            raise ValueError(f"map_size_gb must be > 0, got {self.map_size_gb}")
        if self.every:
            parse_interval(self.every)

    @property
    def every_s(self) -> float:
        """The loop interval in seconds (0 for one shot)."""
        return parse_interval(self.every) if self.every else 0.0
