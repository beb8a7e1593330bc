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

Example::

    split_by_task("raw/", schema, "split/", fraction=0.1, seed=0)
    split_by_task("raw/", schema, "again/", keys=read_task_keys("split/holdout_keys.txt"))  # the same split
    # then: metaps meta-io build --input split/train ...; --input split/holdout ...
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from meta_io.schema import Schema
from meta_io.source import iter_source
from metaps.core.errors import DataError
from metaps.core.hashing import mix64
from metaps.core.log import kv

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


def holdout_mask(task_keys: np.ndarray, fraction: float, seed: int = 0) -> np.ndarray:
    """True for rows whose task goes to the held-out set (vectorized, stable)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction}")
    h = mix64(task_keys, salt=_HOLDOUT_SALT ^ seed) >> np.uint64(32)
    return h < np.uint64(int(fraction * (1 << 32)))


KEYS_FILE = "holdout_keys.txt"


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
        from metaps.core.hashing import hash_strings

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
    out = Path(out_dir)
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
            keys_ = table.column(schema.task_key).to_numpy()
            mask = holdout_mask(keys_, fraction, seed) if chosen is None else np.isin(keys_, chosen)
            pa_mask = pa.array(mask)
            for name, sel in (("holdout", pa_mask), ("train", pc.invert(pa_mask))):
                part = table.filter(sel)
                if part.num_rows:
                    writers[name].write_table(part)
                    counts[name] += part.num_rows
            if mask.any():
                held_keys.append(np.unique(keys_[mask]))
    finally:
        for w in writers.values():
            w.close()
    if chosen is not None and counts["holdout"] == 0:
        raise DataError(f"{input_path}: none of the {chosen.size} given task keys is a task of the input "
                        f"(column '{schema.task_key}'); check the keys file")
    if chosen is None and counts["holdout"] == 0 and fraction > 0:
        raise DataError(f"{input_path}: holdout fraction {fraction} selected no task; use a larger fraction")
    held = np.unique(np.concatenate(held_keys)) if held_keys else np.zeros(0, np.int64)
    n_tasks = int(held.size)
    if chosen is not None and n_tasks < chosen.size:
        log.warning("task keys not in the input", extra=kv(given=int(chosen.size), found=n_tasks))
    (out / KEYS_FILE).write_text("".join(f"{int(k)}\n" for k in held))
    schema_path = out / "schema.json"
    dataclasses.replace(schema, columns=[dataclasses.replace(c, hash=False) for c in schema.columns]).save(schema_path)
    log.info("holdout split", extra=kv(train_rows=counts["train"], holdout_rows=counts["holdout"], holdout_tasks=n_tasks))
    return HoldoutSplit(train_dir, hold_dir, schema_path, counts["train"], counts["holdout"], n_tasks)
