"""The schema file: what every column of a training log means.

A schema is a JSON (or TOML) file. The generator writes one next to its
Parquet files; users write one for their own data. Everything downstream
(import, Meta-IO build, reader, models, PS table list) is driven by it.

Example (JSON)::

    {
      "version": 1,
      "task_key": "user_id",          # rows are grouped into tasks by this column
      "timestamp": "log_time",        # int64 seconds; orders support before query
      "scenario": "scene",            # int scenario id (also usable as a feature)
      "labels": ["click", "conversion"],
      "oracle": {"click": "p_click", "conversion": "p_conversion"},
      "columns": [
        {"name": "user_id",  "kind": "sparse",    "table": "user"},
        {"name": "item_id",  "kind": "sparse",    "table": "item"},
        {"name": "item_tags","kind": "multi_hot", "table": "tag",  "max_len": 6},
        {"name": "title",    "kind": "text",      "table": "token","max_len": 16},
        {"name": "image",    "kind": "vector",    "dim": 16},
        {"name": "price",    "kind": "dense"},
        {"name": "click",    "kind": "label"},
        {"name": "p_click",  "kind": "oracle"},
        {"name": "log_time", "kind": "timestamp"},
        {"name": "scene",    "kind": "sparse",    "table": "scene"}
      ]
    }

Column kinds and how they are stored after import / in Meta-IO::

    sparse     one int64 id per row            -> int64 [rows]          (string ids hashed)
    multi_hot  a list of int64 ids per row     -> int64 [rows, max_len] (padded with -1)
    text       a list of token ids per row     -> int64 [rows, max_len] (padded with -1)
    vector     a fixed-length float list       -> float32 [rows, dim]
    dense      one float per row               -> float32 [rows]
    label      0/1 per row (no NaN allowed)    -> float32 [rows]
    oracle     true probability of a label     -> float32 [rows]
    timestamp  int64 per row                   -> int64 [rows]
    key        a grouping key, not a feature   -> int64 [rows]          (string keys hashed)
    extra      carried through, not a feature  -> as is

The task key and features: ``task_key`` names the column rows are grouped by
into tasks (episodes, the first-k layout, split-holdout, per-task GAUC,
per-task adaptation). Whether it is also a model feature is the schema's
choice, made by the task key column's kind:

* ``sparse``: the key is also an embedding feature (it has a table, e.g. a
  per-user embedding row);
* ``key``: the key only groups rows; it is not a feature, creates no
  embedding table and is never looked up on the PS.

Both normalize the same way: integer keys are kept, string keys are hashed
to int64 with :func:`common.hashing.hash_strings` (as string ids are),
so the same data grouped by a ``key`` or a ``sparse`` column gives the same
tasks. A ``key`` column must have a value on every row (a null is an error
naming the file, column and row). Any other kind cannot be the task key
(``extra`` is carried as text: declare the column ``key`` to group by it).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import from_mapping, read_toml
from common.errors import ConfigError, SchemaError

PAD_ID = -1
"""Padding value of multi-hot and text id lists (never a real id: ids are >= 0)."""


class ColumnKind(str, enum.Enum):
    SPARSE = "sparse"
    MULTI_HOT = "multi_hot"
    TEXT = "text"
    VECTOR = "vector"
    DENSE = "dense"
    LABEL = "label"
    ORACLE = "oracle"
    TIMESTAMP = "timestamp"
    KEY = "key"
    EXTRA = "extra"


ID_KINDS = (ColumnKind.SPARSE, ColumnKind.MULTI_HOT, ColumnKind.TEXT)
LIST_KINDS = (ColumnKind.MULTI_HOT, ColumnKind.TEXT)
TASK_KEY_KINDS = (ColumnKind.SPARSE, ColumnKind.KEY)
"""Kinds a task key column may have: ``sparse`` (key and feature) or ``key`` (key only)."""


def task_key_kind_error(name: str, kind: ColumnKind) -> str:
    """The one-line problem with grouping tasks by column ``name`` of kind ``kind`` ('' if none)."""
    if kind in TASK_KEY_KINDS:
        return ""
    return (f"task key '{name}' is a column of kind '{kind.value}'; a task key must be of kind 'key' "
            f"(groups rows only, not a model feature) or 'sparse' (groups rows and is an embedding feature)")


class Pooling(str, enum.Enum):
    SUM = "sum"
    MEAN = "mean"


@dataclass(frozen=True)
class ColumnSpec:
    """One column of the input.

    Args:
        name: column name in the Parquet/CSV input.
        kind: what the column is (see the module docstring).
        table: embedding table for id kinds (default: the column name). Several
            columns may share a table (e.g. item id in two roles).
        max_len: list length after padding/truncation (multi_hot, text).
        dim: vector length (vector).
        pooling: how a multi-hot/text list is pooled on the worker.
        hash: hash string ids to int64 (default: automatic for string columns);
            on a ``key`` column, hash integer keys too (their decimal text).
    """

    name: str
    kind: ColumnKind
    table: str = ""
    max_len: int = 0
    dim: int = 0
    pooling: Pooling = Pooling.MEAN
    hash: bool = False

    def validate(self) -> None:
        if not self.name:
            raise ValueError("column name must not be empty")
        if self.kind in LIST_KINDS and self.max_len < 1:
            raise ValueError(f"column '{self.name}' ({self.kind.value}) needs max_len >= 1, got {self.max_len}")
        if self.kind == ColumnKind.VECTOR and self.dim < 1:
            raise ValueError(f"column '{self.name}' (vector) needs dim >= 1, got {self.dim}")
        if self.table and self.kind not in ID_KINDS:
            raise ValueError(f"column '{self.name}' ({self.kind.value}) cannot have a table")

    @property
    def table_name(self) -> str:
        """The embedding table this id column looks up ('' for non-id kinds)."""
        if self.kind not in ID_KINDS:
            return ""
        return self.table or self.name


@dataclass(frozen=True)
class Schema:
    """A parsed, validated schema file.

    Args:
        columns: every column the pipeline reads.
        task_key: the column that defines meta-learning tasks (a user, usually);
            of kind ``key`` (grouping only) or ``sparse`` (grouping and a feature).
        timestamp: the time column ('' if none; then time splits are refused).
        scenario: the scenario column ('' if none).
        labels: label columns, in head order (e.g. click then conversion).
        oracle: label -> column of its true probability (generated data only).
    """

    columns: list[ColumnSpec]
    task_key: str
    labels: list[str]
    timestamp: str = ""
    scenario: str = ""
    oracle: dict[str, str] = field(default_factory=dict)
    version: int = 1

    def validate(self) -> None:
        names = [c.name for c in self.columns]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate column names: {dup}")
        by_name = {c.name: c for c in self.columns}
        if self.task_key not in by_name:
            raise ValueError(f"task_key '{self.task_key}' is not a declared column")
        bad_key = task_key_kind_error(self.task_key, by_name[self.task_key].kind)
        if bad_key:
            raise ValueError(bad_key)
        if not self.labels:
            raise ValueError("at least one label is required")
        for lab in self.labels:
            if lab not in by_name or by_name[lab].kind != ColumnKind.LABEL:
                raise ValueError(f"label '{lab}' must be a declared column of kind 'label'")
        if self.timestamp and (self.timestamp not in by_name or by_name[self.timestamp].kind != ColumnKind.TIMESTAMP):
            raise ValueError(f"timestamp '{self.timestamp}' must be a declared column of kind 'timestamp'")
        if self.scenario and self.scenario not in by_name:
            raise ValueError(f"scenario '{self.scenario}' is not a declared column")
        for lab, col in self.oracle.items():
            if lab not in self.labels:
                raise ValueError(f"oracle key '{lab}' is not a label")
            if col not in by_name or by_name[col].kind != ColumnKind.ORACLE:
                raise ValueError(f"oracle column '{col}' must be a declared column of kind 'oracle'")

    # -- views -----------------------------------------------------------------
    def column(self, name: str) -> ColumnSpec:
        for c in self.columns:
            if c.name == name:
                return c
        raise SchemaError(f"schema has no column '{name}'")

    def of_kind(self, *kinds: ColumnKind) -> list[ColumnSpec]:
        return [c for c in self.columns if c.kind in kinds]

    @property
    def id_columns(self) -> list[ColumnSpec]:
        """Columns looked up in embedding tables (sparse, multi_hot, text)."""
        return self.of_kind(*ID_KINDS)

    @property
    def dense_columns(self) -> list[ColumnSpec]:
        return self.of_kind(ColumnKind.DENSE)

    @property
    def vector_columns(self) -> list[ColumnSpec]:
        return self.of_kind(ColumnKind.VECTOR)

    @property
    def tables(self) -> list[str]:
        """Embedding table names, in first-use order."""
        seen: dict[str, None] = {}
        for c in self.id_columns:
            seen.setdefault(c.table_name, None)
        return list(seen)

    def to_dict(self) -> dict[str, Any]:
        from common.config import to_dict

        return to_dict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def schema_from_dict(data: dict[str, Any], where: str = "<schema>") -> Schema:
    """Validate a mapping as a schema; errors name ``where`` and the key."""
    try:
        return from_mapping(Schema, data, where=where)
    except ConfigError as exc:
        raise SchemaError(str(exc)) from None


def load_schema(path: str | Path) -> Schema:
    """Load a schema file (``.json`` or ``.toml``).

    Raises:
        SchemaError: the file is missing, unparsable, or not a valid schema.
    """
    path = Path(path)
    if not path.exists():
        raise SchemaError(f"{path}: schema file not found")
    if path.suffix == ".toml":
        try:
            data = read_toml(path)
        except ConfigError as exc:
            raise SchemaError(str(exc)) from None
    else:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SchemaError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: a schema must be an object, got {type(data).__name__}")
    return schema_from_dict(data, where=str(path))
