"""Offline Meta-IO build: group rows by task, split support/query, pack fixed shapes.

``metaps meta-io build`` turns training logs (anything :func:`meta_io.source.iter_source`
reads) into a folder of uncompressed Arrow IPC files whose record batches are
whole tasks of a fixed shape, plus ``index.arrow`` and ``manifest.json`` (see
:mod:`meta_io.layout`). Training then reads tasks with no grouping or shuffling.

Two passes, out of core (input may be larger than memory)::

    pass 1  iter_source --> hash(task_key) % P --> P spill files (Arrow IPC, uncompressed)
    pass 2  for each spill file (fits the memory budget):
              one lexsort by (hash(task_key), timestamp | seeded random, input row)
              one take
              task boundaries (np.diff), episodes, slots, buckets  (numpy arithmetic)
              one take per bucket scatters rows into fixed-shape slots
            --> part-*.arrow, leftover-*.arrow (+ index rows)

Task key: the schema's ``task_key`` (or ``config.task_key``), a column of kind
``sparse`` (also a feature) or ``key`` (grouping only, no embedding table);
both are int64 after import (string keys hashed), so both group alike.

Episode rule (documented in docs/design/meta_io.md and tested): a task with
``n >= 2`` rows (in split order) is cut into ``E = ceil(n / (S+Q))`` episodes;
row ``r`` goes to episode ``r*E // n``. An episode of ``n_e`` rows gets
``n_q = clamp(floor(n_e*Q/(S+Q) + 1/2), 1, n_e-1)`` query rows (its last rows)
and ``n_s = n_e - n_q`` support rows, so ``n_s <= S`` and ``n_q <= Q``. A task
with one row goes to the leftover (plain-format) files. No row is dropped.

Progress: ``build(..., progress=hook)`` calls ``hook(stage, done, total)`` as the
build goes (no printing here; ``metaps meta-io build`` draws a bar or logs lines):
stage :attr:`BuildStage.READ`, rows read in pass 1 out of the input's rows (Parquet
footers, known before reading), after each source batch; then :attr:`BuildStage.PACK`,
rows of the spill partitions packed in pass 2 out of the same total, after each
partition. Each stage starts with ``done`` 0, never goes down, and ends with
``done == total``. What follows pass 2 (index, manifest, rename) is small and not counted.

Example::

    cfg = MetaIOBuildConfig(support=8, query=4, split=Split.TIME)
    result = build("data/", "data/schema.json", "metaio/", cfg,
                   progress=lambda stage, done, total: print(stage, done, total))
    result.manifest["totals"]["episodes"]
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

import pyarrow as pa

from meta_io import layout as L
from meta_io.build.config import BuildResult, MetaIOBuildConfig
from meta_io.build.manifest import _first_missing, _index_checksum, _manifest, _publish, dataset_files
from meta_io.build.pass1 import _pass1
from meta_io.build.pass2 import _pass2_meta, _pass2_plain
from meta_io.build.writers import _RollingWriter
from meta_io.packing import packing_manifest, packing_plans
from meta_io.index import IndexBuilder
from meta_io.layout import Layout, Split
from meta_io.schema import Schema, load_schema, task_key_kind_error
from common.atomic_write import write_json_atomic
from common.errors import ConfigError, DataError, SchemaError
from common.eta import ProgressHook as ProgressHook  # re-exported: build(progress=...)
from common.log import kv

log = logging.getLogger(__name__)


class BuildStage(enum.StrEnum):
    """The stages :func:`build` reports progress for (values: one word, for bars and log fields).

    Both count rows: ``pass1`` rows read, ``pass2`` rows packed.
    """

    READ = "pass1"
    PACK = "pass2"


def _stage_hook(progress: ProgressHook | None, stage: BuildStage) -> Callable[[int, int], None] | None:
    """``progress`` bound to one stage (None stays None)."""
    if progress is None:
        return None
    return lambda done, total: progress(stage, done, total)


def _resolve(schema: Schema | str | Path, cfg: MetaIOBuildConfig) -> tuple[Schema, str, pa.Schema]:
    from meta_io import source

    if not isinstance(schema, Schema):
        schema = load_schema(schema)
    key = cfg.task_key or schema.task_key
    names = [c.name for c in schema.columns]
    data_schema = source.normalized_arrow_schema(schema)
    if cfg.layout == Layout.META:
        if key not in names:
            raise SchemaError(f"task key '{key}' is not a column of the schema; columns: {names}")
        bad_key = task_key_kind_error(key, schema.column(key).kind)
        if bad_key:
            raise SchemaError(bad_key)
        if cfg.split == Split.TIME and not schema.timestamp:
            raise ConfigError("split 'time' needs a timestamp column, but the schema declares none "
                              "(set \"timestamp\" in the schema or use --split random)")
    return schema, key, data_schema


def build(
    input_path: str | Path,
    schema: Schema | str | Path,
    out_dir: str | Path,
    config: MetaIOBuildConfig = MetaIOBuildConfig(),
    progress: ProgressHook | None = None,
) -> BuildResult:
    """Build a Meta-IO dataset from ``input_path`` into ``out_dir``.

    Args:
        input_path: a Parquet file or folder (anything ``iter_source`` reads).
        schema: a :class:`Schema` or the path of a schema file.
        out_dir: the dataset folder (created; must not hold a dataset unless
            ``config.overwrite``).
        config: layout, S/Q, split, seed, batch shape, memory budget.
        progress: told ``(stage, done, total)`` as pass 1 reads and pass 2 packs rows
            (see the module docstring); None: nothing told.

    Returns:
        The folder and the manifest written last into it.

    Raises:
        DataError: bad or empty input, or an existing dataset without overwrite.
        SchemaError / ConfigError: a task key or split the schema cannot serve.

    Example::

        >>> r = build("gen/", "gen/schema.json", "metaio/", MetaIOBuildConfig(support=8, query=4))
        >>> r.manifest["totals"]["input_rows"]
    """
    config.validate()
    t_start = time.perf_counter()
    input_path, out = Path(input_path), Path(out_dir)
    schema, key, data_schema = _resolve(schema, config)
    existing = dataset_files(out) if out.exists() else []
    if existing and not config.overwrite:
        raise DataError(f"{out}: already holds a Meta-IO dataset ({existing[0].name}); pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    # Build beside the output (same file system), never inside it: a failed build
    # leaves no output folder behind (nor parent folders it had to create).
    created_root = _first_missing(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}{L.STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    spill_dir = staging / "spill"
    spill_dir.mkdir(parents=True)
    ok = False
    try:
        spill = _pass1(input_path, schema, data_schema, config, key, spill_dir,
                       _stage_hook(progress, BuildStage.READ))
        index = IndexBuilder()
        max_bytes = int(config.max_file_mb * 2**20)
        tables = L.id_tables(schema)
        packs = packing_plans(schema, data_schema, config.layout) if config.pack_columns else {}
        t2 = time.perf_counter()
        if config.layout == Layout.META:
            parts = _RollingWriter(staging, L.PART_PATTERN, L.meta_arrow_schema(data_schema), max_bytes, index,
                                   tables, packs.get("main"))
            left_w = _RollingWriter(staging, L.LEFTOVER_PATTERN, L.plain_arrow_schema(data_schema), max_bytes, index,
                                   tables, packs.get("leftover"))
            stats, packers, left = _pass2_meta(spill, schema, data_schema, config, key, parts, left_w,
                                               _stage_hook(progress, BuildStage.PACK))
            files, left_files = parts.close(), left_w.close()
        else:
            parts = _RollingWriter(staging, L.PART_PATTERN, L.plain_arrow_schema(data_schema), max_bytes, index,
                                   tables, packs.get("main"))
            stats, plain = _pass2_plain(spill, schema, data_schema, config, parts, _stage_hook(progress, BuildStage.PACK))
            files, left_files, packers = parts.close(), [], []
        pass2_s = time.perf_counter() - t2
        index.write(staging / L.INDEX_NAME)
        placed = stats.support_rows + stats.query_rows + stats.leftover_rows + stats.plain_rows
        if placed != spill.input_rows:  # an internal invariant, never expected to fire
            raise DataError(f"{input_path}: placed {placed} rows but read {spill.input_rows}")
        manifest = _manifest(config, schema, key, data_schema, input_path, spill, stats, packers, files,
                             left_files, index, time.perf_counter() - t_start, pass2_s)
        manifest.update(_index_checksum(staging / L.INDEX_NAME))
        manifest.update(packing_manifest(packs))
        shutil.rmtree(spill_dir, ignore_errors=True)
        if out.exists():  # an empty folder, or a dataset being overwritten
            _publish(staging, out, files + left_files, manifest, config.overwrite)
        else:
            write_json_atomic(staging / L.MANIFEST_NAME, manifest, indent=2)
            os.rename(staging, out)
        ok = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not ok and created_root is not None:
            shutil.rmtree(created_root, ignore_errors=True)
    log.info("build done", extra=kv(out=out, **{k: manifest["totals"][k] for k in ("input_rows", "batches", "files")}))
    return BuildResult(out, manifest)
