"""Split input rows into train and held-out sets by task (users unseen in training).

Meta-learning is judged on tasks the model never trained on: after adapting
on a held-out user's support rows, how well does it predict that user's query
rows? The split is by task key, deterministic (``mix64(key ^ seed)``), streams
the input (out of core) and writes normalized Parquet that
``metaps meta-io build`` reads like any other input::

    input rows --iter_source--> task key --mix64--> bucket < fraction*2^32 ? holdout : train
                                                     |                      |
                                        OUT/holdout/part-*.parquet   OUT/train/part-*.parquet
                                        OUT/schema.json (the same schema; ids already hashed)

The held-out keys are written to ``OUT/holdout_keys.txt`` (one imported int64
key per line, sorted). An external split, or an earlier one, is reproduced by
passing such a file as ``keys`` (``--keys FILE``) instead of a fraction: exactly
the tasks it names are held out. A keys file holds either imported keys (every
line a decimal integer: taken as the int64 key) or raw string keys (any other
line: every line is hashed with ``hash_strings``, as string ids are on import).
The task key may be a feature (kind ``sparse``) or only a key (kind ``key``);
both split alike. A string key whose values are all decimal digits in a typed
Parquet string column is hashed on import: give such keys as the imported int64
keys (the file this split writes), since an all-integer file is read as those.

A **time split** (:func:`split_by_time`, ``--by time``) is how recommenders are judged in
production: train on the past, score the future. Every row at or after a cut time goes to the
holdout, whatever its task (so a holdout user may be a training user too); the cut is the
timestamp below which ``1 - fraction`` of the rows fall (a first pass reads the timestamp
column only: 8 bytes a row in memory), or one given (``--cut``). The cut is written to
``OUT/time_cut.json`` (pass its ``cut`` to reproduce the split)::

    pass 1: timestamps --np.quantile--> cut          (skipped with --cut)
    pass 2: input rows --timestamp >= cut ?--> OUT/holdout/ : OUT/train/

Example::

    split_by_task("raw/", schema, "split/", fraction=0.1, seed=0)
    split_by_task("raw/", schema, "again/", keys=read_task_keys("split/holdout_keys.txt"))  # the same split
    split_by_time("raw/", schema, "future/", fraction=0.1)  # the latest 10% of rows held out
    # then: metaps meta-io build --input split/train ...; --input split/holdout ...
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from meta_io.schema import Schema
from meta_io.source import iter_source
from common.errors import DataError
from common.hashing import mix64
from common.log import kv

log = logging.getLogger(__name__)

_HOLDOUT_SALT = 0x401D_0C7A_5EED_0001


@dataclass(frozen=True)
class HoldoutSplit:
    train_dir: Path
    holdout_dir: Path
    schema_path: Path
    """The schema of the split data (ids already normalized: no column re-hashes)."""
    train_rows: int
    holdout_rows: int
    holdout_tasks: int
    record: Path
    """What reproduces the split: the held-out task keys (``holdout_keys.txt``, ``--keys``) or the
    time cut (``time_cut.json``, ``--cut``)."""
    time_cut: int | None = None
    """The time split's cut (rows with a timestamp >= it are held out); None for a task split."""


def holdout_mask(task_keys: np.ndarray, fraction: float, seed: int = 0) -> np.ndarray:
    """True for rows whose task goes to the held-out set (vectorized, stable)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction}")
    h = mix64(task_keys, salt=_HOLDOUT_SALT ^ seed) >> np.uint64(32)
    return h < np.uint64(int(fraction * (1 << 32)))


KEYS_FILE = "holdout_keys.txt"
TIME_CUT_FILE = "time_cut.json"


def read_task_keys(path: str | Path) -> np.ndarray:
    """Sorted unique int64 task keys from a file of one key per line (blank lines ignored).

    Args:
        path: the keys file; all-integer lines are imported keys, otherwise every line is hashed.

    Raises:
        DataError: the file is missing or names no key.
    """
    p = Path(path)
    try:
        lines = [ln.strip() for ln in p.read_text().splitlines()]
    except OSError as exc:
        raise DataError(f"{p}: cannot read the task keys file: {exc}") from None
    lines = [ln for ln in lines if ln]
    if not lines:
        raise DataError(f"{p}: task keys file names no key (expected one task key per line)")
    try:
        keys = np.array([int(ln) for ln in lines], dtype=np.int64)
    except (ValueError, OverflowError):
        from common.hashing import hash_strings

        keys = hash_strings(pa.array(lines, type=pa.string()))
    return np.unique(keys)


def _unpad_lists(table: pa.Table, schema: Schema) -> pa.Table:
    """Padded fixed-size id lists back to variable lists (-1 padding removed), vectorized."""
    from meta_io.schema import LIST_KINDS

    for col in schema.of_kind(*LIST_KINDS):
        arr = table.column(col.name).combine_chunks()
        values = arr.flatten().to_numpy().reshape(len(arr), col.max_len)
        keep = values >= 0
        offsets = np.zeros(len(arr) + 1, dtype=np.int32)
        np.cumsum(keep.sum(axis=1), out=offsets[1:])
        lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values[keep]))
        table = table.set_column(table.schema.get_field_index(col.name), col.name, lists)
    return table


def split_by_task(
    input_path: str | Path, schema: Schema, out_dir: str | Path, fraction: float = 0.1, seed: int = 0,
    batch_rows: int = 65_536, keys: np.ndarray | None = None,
) -> HoldoutSplit:
    """Write ``out_dir/train`` and ``out_dir/holdout`` (Parquet, normalized columns).

    Args:
        input_path: Parquet/CSV file or folder (anything ``iter_source`` reads).
        schema: the input's schema; its ``task_key`` decides the split.
        out_dir: where the two folders go (must not already hold them).
        fraction: share of tasks held out, in [0, 1).
        seed: changes which tasks are held out.
        keys: hold out exactly these task keys (int64, e.g. :func:`read_task_keys`) instead of a
            seeded fraction; ``fraction`` and ``seed`` are then ignored.

    Raises:
        DataError: a non-empty output folder, a split that holds out nothing, or
            ``keys`` of which none is a task of the input.
    """
    chosen = None if keys is None else np.unique(np.asarray(keys, dtype=np.int64))
    if chosen is None and not 0.0 <= fraction < 1.0:
        raise DataError(f"split-holdout: --fraction must be in [0, 1), got {fraction}")

    def mask_of(table: pa.Table) -> np.ndarray:
        keys_ = table.column(schema.task_key).to_numpy()
        return holdout_mask(keys_, fraction, seed) if chosen is None else np.isin(keys_, chosen)

    out = Path(out_dir)
    counts, held = _write_split(input_path, schema, out, mask_of, batch_rows)
    if chosen is not None and counts["holdout"] == 0:
        _discard(out)
        raise DataError(f"{input_path}: none of the {chosen.size} given task keys is a task of the input "
                        f"(column '{schema.task_key}'); check the keys file")
    if chosen is None and counts["holdout"] == 0 and fraction > 0:
        _discard(out)
        raise DataError(f"{input_path}: holdout fraction {fraction} selected no task; use a larger fraction")
    n_tasks = int(held.size)
    if chosen is not None and n_tasks < chosen.size:
        log.warning("task keys not in the input", extra=kv(given=int(chosen.size), found=n_tasks))
    (out / KEYS_FILE).write_text("".join(f"{int(k)}\n" for k in held))
    schema_path = _write_schema(schema, out)
    log.info("holdout split", extra=kv(train_rows=counts["train"], holdout_rows=counts["holdout"], holdout_tasks=n_tasks))
    return HoldoutSplit(out / "train", out / "holdout", schema_path, counts["train"], counts["holdout"], n_tasks,
                        out / KEYS_FILE)


def time_cut(input_path: str | Path, schema: Schema, fraction: float, batch_rows: int = 65_536) -> int:
    """The timestamp at and after which about ``fraction`` of the input's rows lie.

    One pass over the timestamp column (held in memory: 8 bytes a row). Rows with equal
    timestamps stay together, so the held-out share can exceed ``fraction`` when many rows
    share the cut's timestamp.

    Args:
        input_path: Parquet/CSV file or folder.
        schema: its schema (``timestamp`` names the column).
        fraction: share of rows to hold out, in (0, 1).
        batch_rows: rows read at a time.

    Raises:
        DataError: no timestamp column, a fraction out of range, or a cut that holds out nothing
            or everything (too few distinct times).
    """
    _need_timestamp(input_path, schema)
    if not 0.0 < fraction < 1.0:
        raise DataError(f"split-holdout --by time: --fraction must be in (0, 1), got {fraction}")
    parts = [sb.table.column(schema.timestamp).to_numpy().astype(np.int64, copy=False)
             for sb in iter_source(input_path, schema, batch_rows=batch_rows)]
    ts = np.sort(np.concatenate(parts))
    # the smallest timestamp with at most `fraction` of the rows at or after it, but at least one row
    k = min(ts.size - 1, max(0, ts.size - max(1, int(round(fraction * ts.size)))))
    cut = int(ts[k])
    if cut <= int(ts[0]):
        raise DataError(f"{input_path}: column '{schema.timestamp}': a time cut holding out {fraction:.0%} of the "
                        f"rows would hold out every row (the earliest timestamp {int(ts[0])} is at the cut); "
                        f"the data has too few distinct times")
    return cut


def split_by_time(
    input_path: str | Path, schema: Schema, out_dir: str | Path, fraction: float = 0.1, cut: int | None = None,
    batch_rows: int = 65_536,
) -> HoldoutSplit:
    """Write ``out_dir/train`` (rows before the cut) and ``out_dir/holdout`` (rows at or after it).

    Args:
        input_path: Parquet/CSV file or folder.
        schema: its schema (``timestamp`` names the column the cut applies to).
        out_dir: where the two folders go (must not already hold them).
        fraction: share of rows held out, the latest ones (:func:`time_cut`); ignored with ``cut``.
        cut: hold out exactly the rows with a timestamp >= ``cut`` instead.
        batch_rows: rows read at a time.

    Raises:
        DataError: no timestamp column, a non-empty output folder, or a cut that leaves either side empty.
    """
    _need_timestamp(input_path, schema)
    at = time_cut(input_path, schema, fraction, batch_rows) if cut is None else int(cut)
    col = schema.timestamp
    out = Path(out_dir)
    counts, held = _write_split(input_path, schema, out,
                                lambda t: t.column(col).to_numpy().astype(np.int64, copy=False) >= at, batch_rows)
    for side in ("train", "holdout"):
        if counts[side] == 0:
            _discard(out)
            raise DataError(f"{input_path}: column '{col}': the time cut {at} leaves no {side} rows "
                            f"(train: before it, holdout: at or after it)")
    record = {"timestamp": col, "cut": at, "fraction": None if cut is not None else fraction,
              "train_rows": counts["train"], "holdout_rows": counts["holdout"]}
    (out / TIME_CUT_FILE).write_text(json.dumps(record, indent=1) + "\n")
    schema_path = _write_schema(schema, out)
    log.info("time split", extra=kv(cut=at, train_rows=counts["train"], holdout_rows=counts["holdout"],
                                    holdout_tasks=int(held.size)))
    return HoldoutSplit(out / "train", out / "holdout", schema_path, counts["train"], counts["holdout"],
                        int(held.size), out / TIME_CUT_FILE, at)


def _discard(out: Path) -> None:
    """Remove the two folders :func:`_write_split` wrote (they were absent or empty before it): a refused
    split leaves nothing behind."""
    import shutil

    for side in ("train", "holdout"):
        shutil.rmtree(out / side, ignore_errors=True)


def _need_timestamp(input_path: str | Path, schema: Schema) -> None:
    if not schema.timestamp:
        raise DataError(f"{input_path}: a time split needs a timestamp column, but the schema declares none "
                        f"(set \"timestamp\" in the schema, or split by task)")


def _write_schema(schema: Schema, out: Path) -> Path:
    """The split data's schema (ids already normalized: no column re-hashes) at ``out/schema.json``."""
    schema_path = out / "schema.json"
    dataclasses.replace(schema, columns=[dataclasses.replace(c, hash=False) for c in schema.columns]).save(schema_path)
    return schema_path


def _write_split(
    input_path: str | Path, schema: Schema, out: Path, holdout_of: Callable[[pa.Table], np.ndarray], batch_rows: int,
) -> tuple[dict[str, int], np.ndarray]:
    """Stream the input into ``out/train`` and ``out/holdout`` Parquet by ``holdout_of(table)`` (a row mask).

    Returns:
        ``({"train": rows, "holdout": rows}, sorted unique task keys of the holdout rows)``.

    Raises:
        DataError: an output folder that exists and is not empty (checked before anything is read).
    """
    train_dir, hold_dir = out / "train", out / "holdout"
    for d in (train_dir, hold_dir):
        if d.exists() and any(d.iterdir()):
            raise DataError(f"{d}: already exists and is not empty; remove it or pick another --out")
        d.mkdir(parents=True, exist_ok=True)
    writers: dict[str, pq.ParquetWriter] = {}
    counts = {"train": 0, "holdout": 0}
    held_keys: list[np.ndarray] = []
    try:
        for sb in iter_source(input_path, schema, batch_rows=batch_rows):
            table = _unpad_lists(sb.table, schema)
            if not writers:
                writers = {
                    "train": pq.ParquetWriter(train_dir / "part-00000.parquet", table.schema),
                    "holdout": pq.ParquetWriter(hold_dir / "part-00000.parquet", table.schema),
                }
            mask = np.asarray(holdout_of(table), dtype=bool)
            pa_mask = pa.array(mask)
            for name, sel in (("holdout", pa_mask), ("train", pc.invert(pa_mask))):
                part = table.filter(sel)
                if part.num_rows:
                    writers[name].write_table(part)
                    counts[name] += part.num_rows
            if mask.any():
                held_keys.append(np.unique(table.column(schema.task_key).to_numpy()[mask]))
    finally:
        for w in writers.values():
            w.close()
    held = np.unique(np.concatenate(held_keys)) if held_keys else np.zeros(0, np.int64)
    return counts, held
