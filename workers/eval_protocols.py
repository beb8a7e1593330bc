"""Evaluation protocols for ``metaps evaluate``: plain, episodes, first-k; base vs adapted; GAUC.

The scores come from the training-time scorer (:func:`workers.evaluation.score_batches`),
batch by batch, so ``episodes`` on a Meta-IO dataset gives exactly the numbers
the trainer's evaluation gives on it. Protocols::

    plain     every real row scored once by the base model (Parquet/CSV, or a Meta-IO
              dataset's support and query halves and leftover rows); no adaptation
    episodes  a Meta-IO meta dataset as built: each episode's query rows scored by the
              base model and after adapting on the episode's support (training-time protocol)
    first-k   Parquet/CSV with a timestamp: per task the first K rows by time are the
              support, every later row is scored once (meta_io.firstk; strict cold start)

Adaptation works for any model, meta- or plain-trained: the same per-task
fine-tuning of the configured ``[meta] adapt`` target (``inner_steps`` SGD steps at
``inner_lr``), so "plain model + the same fine-tuning" is comparable.

Metrics per head (:func:`workers.evaluation.summarize`: AUC, logloss, per scenario,
oracle-normalized where the data has oracle columns) plus ``gauc``: the mean of
per-task AUCs weighted by the task's scored rows, over tasks with both classes.

Rows for the model come from a row source; :class:`FixedRows` serves a checkpoint's
or bundle's rows with the unseen-id rule of training (the PS's initial row).

Example::

    batches = protocol_batches("first-k", "holdout/", schema, k=5)
    report = evaluate_protocol(model, FixedRows(rows, init), batches, meta_cfg, task_key="user_id")
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from meta_io.batch import MetaBatch, PlainBatch
from meta_io.schema import Schema
from common.errors import DataError
from common.evaluation import auc
from common.log import kv
from workers.evaluation import score_batches, summarize

if TYPE_CHECKING:
    from models.base import CtrModel

log = logging.getLogger(__name__)

PROTOCOLS = ("plain", "episodes", "first-k")


class FixedRows:
    """A read-only row source over fixed rows (a checkpoint's or a bundle's).

    Args:
        rows: table -> (sorted ids int64 [n], rows float32 [n, dim]).
        init: table -> callable ``ids -> initial rows``: unseen ids read it, as a PS pull does.
    """

    def __init__(self, rows: dict[str, tuple[np.ndarray, np.ndarray]],
                 init: dict[str, Callable[[np.ndarray], np.ndarray]]) -> None:
        self.rows = rows
        self.init = init
        self.unknown_ids = 0

    def pull(self, ids: dict[str, np.ndarray], step: int | None = None) -> dict[str, np.ndarray]:
        out = {}
        for t, want in ids.items():
            if t not in self.rows:
                raise DataError(f"no rows for table '{t}'; known tables: {sorted(self.rows)}")
            have, r = self.rows[t]
            want = np.asarray(want, dtype=np.int64)
            pos = np.searchsorted(have, want).clip(max=max(have.shape[0] - 1, 0))
            found = (have[pos] == want) if have.shape[0] else np.zeros(want.shape[0], bool)
            res = np.zeros((want.shape[0], r.shape[1]), dtype=np.float32)
            res[found] = r[pos[found]]
            if not found.all():
                self.unknown_ids += int((~found).sum())
                if t in self.init:
                    res[~found] = self.init[t](want[~found])
            out[t] = res
        return out


def _is_meta_io(path: Path) -> bool:
    from meta_io.layout import INDEX_NAME, MANIFEST_NAME

    return path.is_dir() and (path / MANIFEST_NAME).is_file() and (path / INDEX_NAME).is_file()


def protocol_batches(
    protocol: str, data: str | Path, schema: Schema, k: int = 5, query_slots: int = 32,
    tasks_per_batch: int = 64, batch_rows: int = 4096,
) -> Iterator[MetaBatch | PlainBatch]:
    """The batches a protocol scores (see the module docstring).

    Args:
        protocol: plain, episodes or first-k.
        data: a Meta-IO dataset directory, or Parquet/CSV file(s).
        schema: the model's schema (Parquet/CSV input is read with it).
        k: support rows per task (first-k).
        query_slots: query rows per first-k episode.
        tasks_per_batch: episodes per first-k meta batch.
        batch_rows: rows per plain batch read from Parquet/CSV.

    Raises:
        DataError: an unknown protocol, or data of the wrong kind for it (named).
    """
    p = Path(data)
    if protocol not in PROTOCOLS:
        raise DataError(f"unknown protocol {protocol!r}; expected one of {list(PROTOCOLS)}")
    if not p.exists():
        raise DataError(f"{p}: evaluation data not found")
    if protocol == "episodes":
        if not _is_meta_io(p):
            raise DataError(f"{p}: --protocol episodes needs a Meta-IO dataset (metaps meta-io build); "
                            f"use first-k or plain for Parquet/CSV")
        from meta_io.reader import MetaIODataset

        ds = MetaIODataset(p)
        if ds.manifest.get("layout", "meta") != "meta":
            raise DataError(f"{p}: --protocol episodes needs a meta layout dataset, this one is "
                            f"{ds.manifest.get('layout')!r}")
        return (b for b in ds.iter_all() if isinstance(b, MetaBatch))
    if protocol == "first-k":
        if _is_meta_io(p):
            raise DataError(f"{p}: --protocol first-k reads Parquet/CSV rows (it orders each task by time); "
                            f"give the raw or split-holdout data, not a Meta-IO dataset")
        from meta_io.firstk import first_k_batches, read_table

        return first_k_batches(read_table(p, schema), schema, k, query_slots, tasks_per_batch)
    return _plain_batches(p, schema, batch_rows)


def _plain_batches(p: Path, schema: Schema, batch_rows: int) -> Iterator[PlainBatch]:
    if _is_meta_io(p):
        from meta_io.reader import MetaIODataset

        ds = MetaIODataset(p)
        for b in ds.iter_all():
            if isinstance(b, MetaBatch):
                keys_s = b.task_keys[:, None].expand(b.support.mask.shape).contiguous()
                keys_q = b.task_keys[:, None].expand(b.query.mask.shape).contiguous()
                yield _tagged(PlainBatch(b.support, b.unique_ids), keys_s)
                yield _tagged(PlainBatch(b.query, b.unique_ids), keys_q)
            else:
                yield b
        # leftover rows: a 'key' task key is no feature, so tag them from the stored key column
        key = str(ds.manifest.get("task_key") or ds.schema.task_key)
        raws = None if key in {c.name for c in ds.schema.id_columns} else ds.leftover_record_batches()
        for lb in ds.leftover():
            if raws is not None:
                col = next(raws).column(key).to_numpy(zero_copy_only=False).copy()
                lb = _tagged(lb, torch.from_numpy(col))
            yield lb
        return
    import pyarrow as pa

    from meta_io.layout import MASK_COL
    from meta_io.reader import BatchConverter
    from meta_io.source import iter_source

    conv = BatchConverter(schema)
    for sb in iter_source(p, schema, batch_rows):
        tab = sb.table.append_column(MASK_COL, pa.array(np.ones(sb.num_rows, dtype=bool)))
        for rb in tab.to_batches(max_chunksize=batch_rows):
            # the task key column itself (a 'key' column is not among the features' ids)
            keys = torch.from_numpy(rb.column(schema.task_key).to_numpy(zero_copy_only=False).copy())
            yield _tagged(conv.plain(rb), keys)


def _tagged(b: PlainBatch, keys: torch.Tensor) -> PlainBatch:
    b.task_keys = keys  # type: ignore[attr-defined]
    return b


def _row_keys(batch: MetaBatch | PlainBatch, task_key: str) -> np.ndarray | None:
    """Task key of every scored (real) row, in the order score_batches collects them."""
    keys: torch.Tensor | None
    if isinstance(batch, MetaBatch):
        fb = batch.query
        keys = batch.task_keys[:, None].expand(fb.mask.shape)
    else:
        fb = batch.features
        keys = getattr(batch, "task_keys", None)
        if keys is None:
            if task_key not in fb.ids:
                return None
            keys = fb.ids[task_key][..., 0]
    return keys.reshape(-1).numpy()[fb.mask.reshape(-1).numpy().astype(bool)]


def gauc(keys: np.ndarray, target: np.ndarray, score: np.ndarray) -> float:
    """Row-weighted mean of per-task AUCs over tasks with both classes (NaN if none).

    Args:
        keys: task key per row.
        target: 0/1 per row.
        score: prediction per row.
    """
    order = np.argsort(keys, kind="stable")
    k, y, s = keys[order], target[order], score[order]
    cut = np.flatnonzero(k[1:] != k[:-1]) + 1
    total, weight = 0.0, 0
    for yy, ss in zip(np.split(y, cut), np.split(s, cut)):  # per task (not per row)
        pos = int(yy.sum())
        if 0 < pos < yy.shape[0]:
            total += auc(yy, ss) * yy.shape[0]
            weight += yy.shape[0]
    return total / weight if weight else float("nan")


def evaluate_protocol(
    model: CtrModel,
    rows_src: Any,
    batches: Iterable[MetaBatch | PlainBatch],
    meta_cfg: Any = None,
    adapt: bool = True,
    task_key: str = "",
) -> dict[str, Any]:
    """Score ``batches`` (base, and adapted for meta batches) and summarize with GAUC.

    Args:
        model: the trained model (eager, dense parameters loaded).
        rows_src: ``pull(ids) -> rows`` (e.g. :class:`FixedRows`, a PS row source).
        batches: from :func:`protocol_batches`.
        meta_cfg: the inner loop for adapted scores (None, or no inner step and no offset: base only).
        adapt: score adapted too (meta batches only).
        task_key: the task key column of plain rows without task keys (for GAUC); Parquet/CSV
            plain rows are tagged with the key column itself (of kind ``key`` or ``sparse``).

    Returns:
        ``{"rows", "tasks", "base": {head: metrics}, ["adapted": ..., "gain": {head: {...}}]}``, and with
        inner steps ``inner_diverged``: ``{"episodes", "diverged", "share"}``, the adapted episodes whose
        inner steps raised the support loss or left it non-finite.
    """
    do_adapt = adapt and meta_cfg is not None and bool(getattr(meta_cfg, "adapts", False))  # offset-only adapts too
    parts: dict[str, dict[str, dict[str, list[np.ndarray]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    keys_parts: list[np.ndarray] = []
    have_keys = True
    stepped = do_adapt and int(getattr(meta_cfg, "inner_steps", 0)) > 0
    divergence = [0, 0] if stepped else None  # [diverged, adapted] episodes
    for batch in batches:
        scores = score_batches(model, rows_src, [batch], meta_cfg, adapt=do_adapt, divergence=divergence)
        rk = _row_keys(batch, task_key)
        if rk is None:
            have_keys = False
        else:
            keys_parts.append(rk)
        for kind, heads in scores.items():
            for head, arrs in heads.items():
                for name, v in arrs.items():
                    parts[kind][head][name].append(v)
    if not parts:
        raise DataError("the evaluation data yielded no rows to score")
    keys = np.concatenate(keys_parts) if have_keys and keys_parts else None
    out: dict[str, Any] = {}
    for kind, per_head in parts.items():
        merged = {h: {n: np.concatenate(v) for n, v in arrs.items()} for h, arrs in per_head.items()}
        res = summarize(merged)
        for h, arr in merged.items():
            if keys is not None and keys.shape[0] == arr["score"].shape[0]:
                res[h]["gauc"] = gauc(keys, arr["target"].astype(np.float64), arr["score"].astype(np.float64))
        out[kind] = res
    first = next(iter(out["base"].values()))
    out = {"rows": first["rows"], "tasks": int(np.unique(keys).size) if keys is not None else None, **out}
    if divergence is not None and divergence[1]:
        out["inner_diverged"] = {"episodes": divergence[1], "diverged": divergence[0],
                                 "share": divergence[0] / divergence[1]}
    if "adapted" in out:
        out["gain"] = {
            h: {m: out["adapted"][h][m] - out["base"][h][m] for m in ("auc", "logloss", "gauc", "norm_auc")
                if m in out["base"][h] and m in out["adapted"][h]}
            for h in out["base"]
        }
    log.info("evaluated", extra=kv(rows=out["rows"], tasks=out["tasks"], adapted="adapted" in out))
    return out
