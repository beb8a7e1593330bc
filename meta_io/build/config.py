"""Meta-IO build configuration (:class:`MetaIOBuildConfig`) and its result (:class:`BuildResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meta_io.layout import Layout, Split


@dataclass(frozen=True)
class MetaIOBuildConfig:
    """How ``metaps meta-io build`` lays data out.

    Args:
        layout: ``meta`` (tasks with support/query) or ``plain`` (shuffled rows).
        support: support slots S per task episode (largest bucket).
        query: query slots Q per task episode (largest bucket).
        split: ``time`` (support precedes query in time) or ``random`` (seeded).
        seed: seeds the task order, the random split and the plain shuffle.
        task_key: grouping column ('' = the schema's ``task_key``).
        rows_per_batch: slots per record batch (meta: T = rows_per_batch // c
            tasks of bucket capacity c; plain: rows per batch).
        bucketing: use power-of-two size buckets (False: pad every episode to S+Q).
        memory_budget_mb: pass 2 keeps one partition of about this size in memory.
        partitions: spill partitions (0 = from the budget and the input size).
        max_partitions: cap on automatic partitions (open files in pass 1).
        max_file_mb: start a new part file after this many MiB.
        source_batch_rows: rows per batch requested from ``iter_source``.
        overwrite: replace a dataset already in the output folder.
        pack_columns: store same-typed numeric columns as one block per record
            batch (format 2: the reader makes one tensor per dtype, not per
            column); False writes one Arrow column per schema column (format 1,
            the older layout, for tools that read the files directly).

    Example::

        >>> MetaIOBuildConfig(support=8, query=4, rows_per_batch=768).validate()
    """

    layout: Layout = Layout.META
    support: int = 8
    query: int = 4
    split: Split = Split.TIME
    seed: int = 0
    task_key: str = ""
    rows_per_batch: int = 768
    bucketing: bool = True
    memory_budget_mb: float = 512.0
    partitions: int = 0
    max_partitions: int = 256
    max_file_mb: float = 64.0
    source_batch_rows: int = 65_536
    overwrite: bool = False
    pack_columns: bool = True

    def validate(self) -> None:
        if self.support < 1 or self.query < 1:
            raise ValueError(f"support and query must be >= 1, got support={self.support} query={self.query}")
        if self.layout == Layout.META and self.rows_per_batch < self.support + self.query:
            raise ValueError(
                f"rows_per_batch must be >= support+query={self.support + self.query}, got {self.rows_per_batch}"
            )
        if self.rows_per_batch < 1:
            raise ValueError(f"rows_per_batch must be >= 1, got {self.rows_per_batch}")
        if not self.memory_budget_mb > 0:
            raise ValueError(f"memory_budget_mb must be > 0, got {self.memory_budget_mb}")
        if self.partitions < 0:
            raise ValueError(f"partitions must be >= 0 (0 = automatic), got {self.partitions}")
        if not 1 <= self.max_partitions <= 4096:
            raise ValueError(f"max_partitions must be in [1, 4096], got {self.max_partitions}")
        if not self.max_file_mb > 0:
            raise ValueError(f"max_file_mb must be > 0, got {self.max_file_mb}")
        if not isinstance(self.pack_columns, bool):
            raise ValueError(f"pack_columns must be true or false, got {self.pack_columns!r}")
        if self.source_batch_rows < 1:
            raise ValueError(f"source_batch_rows must be >= 1, got {self.source_batch_rows}")


@dataclass(frozen=True)
class BuildResult:
    """What a build wrote: the dataset folder and its manifest (as written)."""

    out_dir: Path
    manifest: dict[str, Any]
